//! Completion status codes (NVMe Base 2.0, section 4.6.1 "Status Field Definition"; NVM Command
//! Set 1.0, section 4.1.1) and the decoded [`Status`] shared by the driver and the emulator.

use core::fmt;

/// Status Code Type (NVMe Base 2.0, Figure 94). Open enum.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct StatusCodeType(pub u8);

impl StatusCodeType {
    /// Generic Command Status.
    pub const GENERIC: Self = Self(0);
    /// Command Specific Status.
    pub const COMMAND_SPECIFIC: Self = Self(1);
    /// Media and Data Integrity Errors.
    pub const MEDIA_AND_DATA_INTEGRITY: Self = Self(2);
    /// Path Related Status.
    pub const PATH: Self = Self(3);
    /// Vendor Specific.
    pub const VENDOR: Self = Self(7);

    /// The spec's name for the status code type.
    pub const fn name(self) -> &'static str {
        match self.0 {
            0 => "Generic",
            1 => "Command Specific",
            2 => "Media and Data Integrity",
            3 => "Path Related",
            7 => "Vendor Specific",
            _ => "Reserved",
        }
    }
}

/// Generic Command Status values (SCT 0; NVMe Base 2.0, Figure 95; NVM Command Set 1.0,
/// Figure 74 for 0x80..).
pub mod generic {
    /// Successful Completion.
    pub const SUCCESS: u8 = 0x00;
    /// Invalid Command Opcode.
    pub const INVALID_COMMAND_OPCODE: u8 = 0x01;
    /// Invalid Field in Command.
    pub const INVALID_FIELD_IN_COMMAND: u8 = 0x02;
    /// Command ID Conflict.
    pub const COMMAND_ID_CONFLICT: u8 = 0x03;
    /// Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: u8 = 0x04;
    /// Commands Aborted due to Power Loss Notification.
    pub const ABORTED_POWER_LOSS: u8 = 0x05;
    /// Internal Error.
    pub const INTERNAL_ERROR: u8 = 0x06;
    /// Command Abort Requested.
    pub const COMMAND_ABORT_REQUESTED: u8 = 0x07;
    /// Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: u8 = 0x08;
    /// Command Aborted due to Failed Fused Command.
    pub const ABORTED_FAILED_FUSED: u8 = 0x09;
    /// Command Aborted due to Missing Fused Command.
    pub const ABORTED_MISSING_FUSED: u8 = 0x0a;
    /// Invalid Namespace or Format.
    pub const INVALID_NAMESPACE_OR_FORMAT: u8 = 0x0b;
    /// Command Sequence Error.
    pub const COMMAND_SEQUENCE_ERROR: u8 = 0x0c;
    /// Invalid SGL Segment Descriptor.
    pub const INVALID_SGL_SEGMENT_DESCRIPTOR: u8 = 0x0d;
    /// Invalid Number of SGL Descriptors.
    pub const INVALID_NUMBER_OF_SGL_DESCRIPTORS: u8 = 0x0e;
    /// Data SGL Length Invalid.
    pub const DATA_SGL_LENGTH_INVALID: u8 = 0x0f;
    /// Metadata SGL Length Invalid.
    pub const METADATA_SGL_LENGTH_INVALID: u8 = 0x10;
    /// SGL Descriptor Type Invalid.
    pub const SGL_DESCRIPTOR_TYPE_INVALID: u8 = 0x11;
    /// Invalid Use of Controller Memory Buffer.
    pub const INVALID_USE_OF_CMB: u8 = 0x12;
    /// PRP Offset Invalid.
    pub const PRP_OFFSET_INVALID: u8 = 0x13;
    /// Atomic Write Unit Exceeded.
    pub const ATOMIC_WRITE_UNIT_EXCEEDED: u8 = 0x14;
    /// Operation Denied.
    pub const OPERATION_DENIED: u8 = 0x15;
    /// SGL Offset Invalid.
    pub const SGL_OFFSET_INVALID: u8 = 0x16;
    /// Host Identifier Inconsistent Format.
    pub const HOST_IDENTIFIER_INCONSISTENT_FORMAT: u8 = 0x18;
    /// Keep Alive Timer Expired.
    pub const KEEP_ALIVE_TIMER_EXPIRED: u8 = 0x19;
    /// Keep Alive Timeout Invalid.
    pub const KEEP_ALIVE_TIMEOUT_INVALID: u8 = 0x1a;
    /// Command Aborted due to Preempt and Abort.
    pub const ABORTED_PREEMPT_AND_ABORT: u8 = 0x1b;
    /// Sanitize Failed.
    pub const SANITIZE_FAILED: u8 = 0x1c;
    /// Sanitize In Progress.
    pub const SANITIZE_IN_PROGRESS: u8 = 0x1d;
    /// SGL Data Block Granularity Invalid.
    pub const SGL_DATA_BLOCK_GRANULARITY_INVALID: u8 = 0x1e;
    /// Command Not Supported for Queue in CMB.
    pub const NOT_SUPPORTED_FOR_QUEUE_IN_CMB: u8 = 0x1f;
    /// Namespace is Write Protected.
    pub const NAMESPACE_WRITE_PROTECTED: u8 = 0x20;
    /// Command Interrupted.
    pub const COMMAND_INTERRUPTED: u8 = 0x21;
    /// Transient Transport Error.
    pub const TRANSIENT_TRANSPORT_ERROR: u8 = 0x22;
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: u8 = 0x80;
    /// Capacity Exceeded.
    pub const CAPACITY_EXCEEDED: u8 = 0x81;
    /// Namespace Not Ready.
    pub const NAMESPACE_NOT_READY: u8 = 0x82;
    /// Reservation Conflict.
    pub const RESERVATION_CONFLICT: u8 = 0x83;
    /// Format In Progress.
    pub const FORMAT_IN_PROGRESS: u8 = 0x84;
}

/// Command Specific Status values (SCT 1; NVMe Base 2.0, Figure 96; NVM Command Set 1.0,
/// Figure 75 for 0x80..).
pub mod command_specific {
    /// Completion Queue Invalid.
    pub const COMPLETION_QUEUE_INVALID: u8 = 0x00;
    /// Invalid Queue Identifier.
    pub const INVALID_QUEUE_IDENTIFIER: u8 = 0x01;
    /// Invalid Queue Size.
    pub const INVALID_QUEUE_SIZE: u8 = 0x02;
    /// Abort Command Limit Exceeded.
    pub const ABORT_COMMAND_LIMIT_EXCEEDED: u8 = 0x03;
    /// Asynchronous Event Request Limit Exceeded.
    pub const ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED: u8 = 0x05;
    /// Invalid Firmware Slot.
    pub const INVALID_FIRMWARE_SLOT: u8 = 0x06;
    /// Invalid Firmware Image.
    pub const INVALID_FIRMWARE_IMAGE: u8 = 0x07;
    /// Invalid Interrupt Vector.
    pub const INVALID_INTERRUPT_VECTOR: u8 = 0x08;
    /// Invalid Log Page.
    pub const INVALID_LOG_PAGE: u8 = 0x09;
    /// Invalid Format.
    pub const INVALID_FORMAT: u8 = 0x0a;
    /// Firmware Activation Requires Conventional Reset.
    pub const FIRMWARE_ACTIVATION_REQUIRES_RESET: u8 = 0x0b;
    /// Invalid Queue Deletion.
    pub const INVALID_QUEUE_DELETION: u8 = 0x0c;
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: u8 = 0x0d;
    /// Feature Not Changeable.
    pub const FEATURE_NOT_CHANGEABLE: u8 = 0x0e;
    /// Feature Not Namespace Specific.
    pub const FEATURE_NOT_NAMESPACE_SPECIFIC: u8 = 0x0f;
    /// Overlapping Range.
    pub const OVERLAPPING_RANGE: u8 = 0x14;
    /// Conflicting Attributes.
    pub const CONFLICTING_ATTRIBUTES: u8 = 0x80;
    /// Invalid Protection Information.
    pub const INVALID_PROTECTION_INFORMATION: u8 = 0x81;
    /// Attempted Write to Read Only Range.
    pub const WRITE_TO_READ_ONLY_RANGE: u8 = 0x82;
    /// Command Size Limit Exceeded.
    pub const COMMAND_SIZE_LIMIT_EXCEEDED: u8 = 0x83;
    /// Zoned Boundary Error (Zoned Namespace Command Set 1.1, Figure 26).
    pub const ZONED_BOUNDARY_ERROR: u8 = 0xb8;
    /// Zone Is Full.
    pub const ZONE_IS_FULL: u8 = 0xb9;
    /// Zone Is Read Only.
    pub const ZONE_IS_READ_ONLY: u8 = 0xba;
    /// Zone Is Offline.
    pub const ZONE_IS_OFFLINE: u8 = 0xbb;
    /// Zone Invalid Write: a write not at the zone's write pointer.
    pub const ZONE_INVALID_WRITE: u8 = 0xbc;
    /// Too Many Active Zones.
    pub const TOO_MANY_ACTIVE_ZONES: u8 = 0xbd;
    /// Too Many Open Zones.
    pub const TOO_MANY_OPEN_ZONES: u8 = 0xbe;
    /// Invalid Zone State Transition.
    pub const INVALID_ZONE_STATE_TRANSITION: u8 = 0xbf;
}

/// Media and Data Integrity Errors (SCT 2; NVMe Base 2.0, Figure 97; NVM Command Set 1.0,
/// Figure 76).
pub mod media {
    /// Write Fault.
    pub const WRITE_FAULT: u8 = 0x80;
    /// Unrecovered Read Error.
    pub const UNRECOVERED_READ_ERROR: u8 = 0x81;
    /// End-to-end Guard Check Error.
    pub const GUARD_CHECK_ERROR: u8 = 0x82;
    /// End-to-end Application Tag Check Error.
    pub const APPLICATION_TAG_CHECK_ERROR: u8 = 0x83;
    /// End-to-end Reference Tag Check Error.
    pub const REFERENCE_TAG_CHECK_ERROR: u8 = 0x84;
    /// Compare Failure.
    pub const COMPARE_FAILURE: u8 = 0x85;
    /// Access Denied.
    pub const ACCESS_DENIED: u8 = 0x86;
    /// Deallocated or Unwritten Logical Block.
    pub const DEALLOCATED_OR_UNWRITTEN: u8 = 0x87;
    /// End-to-End Storage Tag Check Error.
    pub const STORAGE_TAG_CHECK_ERROR: u8 = 0x88;
}

/// Path Related Status (SCT 3; NVMe Base 2.0, Figure 98).
pub mod path {
    /// Internal Path Error.
    pub const INTERNAL_PATH_ERROR: u8 = 0x00;
    /// Asymmetric Access Persistent Loss.
    pub const ASYMMETRIC_ACCESS_PERSISTENT_LOSS: u8 = 0x01;
    /// Asymmetric Access Inaccessible.
    pub const ASYMMETRIC_ACCESS_INACCESSIBLE: u8 = 0x02;
    /// Asymmetric Access Transition.
    pub const ASYMMETRIC_ACCESS_TRANSITION: u8 = 0x03;
    /// Controller Pathing Error.
    pub const CONTROLLER_PATHING_ERROR: u8 = 0x60;
    /// Host Pathing Error.
    pub const HOST_PATHING_ERROR: u8 = 0x70;
    /// Command Aborted By Host.
    pub const ABORTED_BY_HOST: u8 = 0x71;
}

/// The spec's name for a status code, or `None` if this crate does not know it.
pub const fn status_name(sct: StatusCodeType, sc: u8) -> Option<&'static str> {
    Some(match (sct.0, sc) {
        (0, 0x00) => "Successful Completion",
        (0, 0x01) => "Invalid Command Opcode",
        (0, 0x02) => "Invalid Field in Command",
        (0, 0x03) => "Command ID Conflict",
        (0, 0x04) => "Data Transfer Error",
        (0, 0x05) => "Commands Aborted due to Power Loss Notification",
        (0, 0x06) => "Internal Error",
        (0, 0x07) => "Command Abort Requested",
        (0, 0x08) => "Command Aborted due to SQ Deletion",
        (0, 0x09) => "Command Aborted due to Failed Fused Command",
        (0, 0x0a) => "Command Aborted due to Missing Fused Command",
        (0, 0x0b) => "Invalid Namespace or Format",
        (0, 0x0c) => "Command Sequence Error",
        (0, 0x0d) => "Invalid SGL Segment Descriptor",
        (0, 0x0e) => "Invalid Number of SGL Descriptors",
        (0, 0x0f) => "Data SGL Length Invalid",
        (0, 0x10) => "Metadata SGL Length Invalid",
        (0, 0x11) => "SGL Descriptor Type Invalid",
        (0, 0x12) => "Invalid Use of Controller Memory Buffer",
        (0, 0x13) => "PRP Offset Invalid",
        (0, 0x14) => "Atomic Write Unit Exceeded",
        (0, 0x15) => "Operation Denied",
        (0, 0x16) => "SGL Offset Invalid",
        (0, 0x18) => "Host Identifier Inconsistent Format",
        (0, 0x19) => "Keep Alive Timer Expired",
        (0, 0x1a) => "Keep Alive Timeout Invalid",
        (0, 0x1b) => "Command Aborted due to Preempt and Abort",
        (0, 0x1c) => "Sanitize Failed",
        (0, 0x1d) => "Sanitize In Progress",
        (0, 0x1e) => "SGL Data Block Granularity Invalid",
        (0, 0x1f) => "Command Not Supported for Queue in CMB",
        (0, 0x20) => "Namespace is Write Protected",
        (0, 0x21) => "Command Interrupted",
        (0, 0x22) => "Transient Transport Error",
        (0, 0x80) => "LBA Out of Range",
        (0, 0x81) => "Capacity Exceeded",
        (0, 0x82) => "Namespace Not Ready",
        (0, 0x83) => "Reservation Conflict",
        (0, 0x84) => "Format In Progress",
        (1, 0x00) => "Completion Queue Invalid",
        (1, 0x01) => "Invalid Queue Identifier",
        (1, 0x02) => "Invalid Queue Size",
        (1, 0x03) => "Abort Command Limit Exceeded",
        (1, 0x05) => "Asynchronous Event Request Limit Exceeded",
        (1, 0x06) => "Invalid Firmware Slot",
        (1, 0x07) => "Invalid Firmware Image",
        (1, 0x08) => "Invalid Interrupt Vector",
        (1, 0x09) => "Invalid Log Page",
        (1, 0x0a) => "Invalid Format",
        (1, 0x0b) => "Firmware Activation Requires Conventional Reset",
        (1, 0x0c) => "Invalid Queue Deletion",
        (1, 0x0d) => "Feature Identifier Not Saveable",
        (1, 0x0e) => "Feature Not Changeable",
        (1, 0x0f) => "Feature Not Namespace Specific",
        (1, 0x14) => "Overlapping Range",
        (1, 0x80) => "Conflicting Attributes",
        (1, 0x81) => "Invalid Protection Information",
        (1, 0x82) => "Attempted Write to Read Only Range",
        (1, 0x83) => "Command Size Limit Exceeded",
        // Zoned Namespace Command Set 1.1, Figure 26 (no NVM command set code uses B8h-BFh).
        (1, 0xb8) => "Zoned Boundary Error",
        (1, 0xb9) => "Zone Is Full",
        (1, 0xba) => "Zone Is Read Only",
        (1, 0xbb) => "Zone Is Offline",
        (1, 0xbc) => "Zone Invalid Write",
        (1, 0xbd) => "Too Many Active Zones",
        (1, 0xbe) => "Too Many Open Zones",
        (1, 0xbf) => "Invalid Zone State Transition",
        (2, 0x80) => "Write Fault",
        (2, 0x81) => "Unrecovered Read Error",
        (2, 0x82) => "End-to-end Guard Check Error",
        (2, 0x83) => "End-to-end Application Tag Check Error",
        (2, 0x84) => "End-to-end Reference Tag Check Error",
        (2, 0x85) => "Compare Failure",
        (2, 0x86) => "Access Denied",
        (2, 0x87) => "Deallocated or Unwritten Logical Block",
        (2, 0x88) => "End-to-End Storage Tag Check Error",
        (3, 0x00) => "Internal Path Error",
        (3, 0x01) => "Asymmetric Access Persistent Loss",
        (3, 0x02) => "Asymmetric Access Inaccessible",
        (3, 0x03) => "Asymmetric Access Transition",
        (3, 0x60) => "Controller Pathing Error",
        (3, 0x70) => "Host Pathing Error",
        (3, 0x71) => "Command Aborted By Host",
        _ => return None,
    })
}

/// A decoded completion status (the Status Field without the phase tag).
///
/// `Display` gives the spec's names, e.g. `Generic: LBA Out of Range (sct 0x0, sc 0x80)`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct Status {
    /// Status Code Type.
    pub sct: StatusCodeType,
    /// Status Code.
    pub sc: u8,
    /// Command Retry Delay (index into the controller's CRDT values).
    pub crd: u8,
    /// More: further information is in the Error Information log page.
    pub more: bool,
    /// Do Not Retry.
    pub dnr: bool,
}

impl Status {
    /// Successful Completion.
    pub const SUCCESS: Self = Self::new(StatusCodeType::GENERIC, generic::SUCCESS);

    /// A status with the given type and code, CRD 0, More and DNR clear.
    pub const fn new(sct: StatusCodeType, sc: u8) -> Self {
        Self {
            sct,
            sc,
            crd: 0,
            more: false,
            dnr: false,
        }
    }

    /// A Generic Command Status.
    pub const fn generic(sc: u8) -> Self {
        Self::new(StatusCodeType::GENERIC, sc)
    }

    /// A Command Specific Status.
    pub const fn command_specific(sc: u8) -> Self {
        Self::new(StatusCodeType::COMMAND_SPECIFIC, sc)
    }

    /// A Media and Data Integrity Error.
    pub const fn media(sc: u8) -> Self {
        Self::new(StatusCodeType::MEDIA_AND_DATA_INTEGRITY, sc)
    }

    /// The same status with Do Not Retry set as given.
    pub const fn with_dnr(mut self, dnr: bool) -> Self {
        self.dnr = dnr;
        self
    }

    /// The same status with More set as given.
    pub const fn with_more(mut self, more: bool) -> Self {
        self.more = more;
        self
    }

    /// Whether this is Successful Completion.
    pub const fn is_success(&self) -> bool {
        self.sct.0 == 0 && self.sc == 0
    }

    /// Whether type and code match (CRD, More and DNR are ignored).
    pub const fn is(&self, sct: StatusCodeType, sc: u8) -> bool {
        self.sct.0 == sct.0 && self.sc == sc
    }

    /// The spec's name for the code, if known.
    pub const fn name(&self) -> Option<&'static str> {
        status_name(self.sct, self.sc)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name().unwrap_or("unknown status code");
        write!(
            f,
            "{}: {} (sct {:#x}, sc {:#04x})",
            self.sct.name(),
            name,
            self.sct.0,
            self.sc
        )
    }
}

impl core::error::Error for Status {}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::format;

    #[test]
    fn names() {
        assert_eq!(
            status_name(StatusCodeType::GENERIC, generic::LBA_OUT_OF_RANGE),
            Some("LBA Out of Range")
        );
        assert_eq!(
            status_name(
                StatusCodeType::COMMAND_SPECIFIC,
                command_specific::INVALID_QUEUE_IDENTIFIER
            ),
            Some("Invalid Queue Identifier")
        );
        assert_eq!(
            status_name(
                StatusCodeType::MEDIA_AND_DATA_INTEGRITY,
                media::UNRECOVERED_READ_ERROR
            ),
            Some("Unrecovered Read Error")
        );
        assert_eq!(status_name(StatusCodeType::GENERIC, 0x7f), None);
        assert_eq!(status_name(StatusCodeType::VENDOR, 0), None);
    }

    #[test]
    fn display() {
        let s = Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr(true);
        assert_eq!(
            format!("{s}"),
            "Generic: LBA Out of Range (sct 0x0, sc 0x80)"
        );
        let s = Status::command_specific(command_specific::INVALID_QUEUE_DELETION);
        assert_eq!(
            format!("{s}"),
            "Command Specific: Invalid Queue Deletion (sct 0x1, sc 0x0c)"
        );
        let s = Status::new(StatusCodeType::VENDOR, 0xc3);
        assert_eq!(
            format!("{s}"),
            "Vendor Specific: unknown status code (sct 0x7, sc 0xc3)"
        );
        assert!(Status::SUCCESS.is_success());
        assert!(!s.is_success());
        assert!(
            Status::media(media::WRITE_FAULT)
                .with_more(true)
                .is(StatusCodeType::MEDIA_AND_DATA_INTEGRITY, media::WRITE_FAULT)
        );
    }
}
