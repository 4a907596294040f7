//! Log pages (NVMe Base 2.0, section 5.16.1): Error Information and SMART / Health Information.

use zerocopy::little_endian::{U16, U32, U128};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Error Information log entry, 64 bytes (NVMe Base 2.0, Figure 205).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ErrorInformationLogEntry {
    /// Error Count: unique, increasing identifier of this error (0 = entry invalid).
    pub error_count: u64,
    /// Submission Queue ID of the failed command.
    pub sqid: u16,
    /// Command ID of the failed command.
    pub cid: u16,
    /// Status Field of the completion (bit 0 is the phase tag as posted).
    pub status: u16,
    /// Parameter Error Location: byte (bits 7:0) and bit (bits 10:8) of the offending field.
    pub parameter_error_location: u16,
    /// LBA of the first failing block.
    pub lba: u64,
    /// Namespace of the failed command.
    pub nsid: u32,
    /// Vendor Specific Information Available.
    pub vsia: u8,
    /// Transport Type.
    pub trtype: u8,
    /// Reserved.
    pub rsvd30: [u8; 2],
    /// Command Specific Information.
    pub csi: u64,
    /// Transport Type Specific Information.
    pub ttsi: u16,
    /// Reserved.
    pub rsvd42: [u8; 22],
}
const _: () = assert!(size_of::<ErrorInformationLogEntry>() == 64);

/// SMART / Health Information log page, 512 bytes (NVMe Base 2.0, Figure 207). Several fields
/// are unaligned in the spec, so they are declared as little-endian byte arrays.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct SmartHealthLog {
    /// Critical Warning flags.
    pub critical_warning: u8,
    /// Composite Temperature, kelvin.
    pub composite_temperature: U16,
    /// Available Spare, percent.
    pub available_spare: u8,
    /// Available Spare Threshold, percent.
    pub available_spare_threshold: u8,
    /// Percentage Used.
    pub percentage_used: u8,
    /// Endurance Group Critical Warning Summary.
    pub endurance_group_critical_warning: u8,
    /// Reserved.
    pub rsvd7: [u8; 25],
    /// Data Units Read, thousands of 512-byte units.
    pub data_units_read: U128,
    /// Data Units Written, thousands of 512-byte units.
    pub data_units_written: U128,
    /// Host Read Commands.
    pub host_read_commands: U128,
    /// Host Write Commands.
    pub host_write_commands: U128,
    /// Controller Busy Time, minutes.
    pub controller_busy_time: U128,
    /// Power Cycles.
    pub power_cycles: U128,
    /// Power On Hours.
    pub power_on_hours: U128,
    /// Unsafe Shutdowns.
    pub unsafe_shutdowns: U128,
    /// Media and Data Integrity Errors.
    pub media_errors: U128,
    /// Number of Error Information Log Entries over the controller's life.
    pub error_log_entries: U128,
    /// Warning Composite Temperature Time, minutes.
    pub warning_temperature_time: U32,
    /// Critical Composite Temperature Time, minutes.
    pub critical_temperature_time: U32,
    /// Temperature Sensors 1..8, kelvin.
    pub temperature_sensors: [U16; 8],
    /// Thermal Management Temperature 1 Transition Count.
    pub thermal_transition_count_1: U32,
    /// Thermal Management Temperature 2 Transition Count.
    pub thermal_transition_count_2: U32,
    /// Total Time For Thermal Management Temperature 1, seconds.
    pub thermal_time_1: U32,
    /// Total Time For Thermal Management Temperature 2, seconds.
    pub thermal_time_2: U32,
    /// Reserved.
    pub rsvd232: [u8; 280],
}
const _: () = assert!(size_of::<SmartHealthLog>() == 512);

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;

    #[test]
    fn error_entry_offsets() {
        type E = ErrorInformationLogEntry;
        assert_eq!(offset_of!(E, sqid), 8);
        assert_eq!(offset_of!(E, cid), 10);
        assert_eq!(offset_of!(E, status), 12);
        assert_eq!(offset_of!(E, parameter_error_location), 14);
        assert_eq!(offset_of!(E, lba), 16);
        assert_eq!(offset_of!(E, nsid), 24);
        assert_eq!(offset_of!(E, vsia), 28);
        assert_eq!(offset_of!(E, csi), 32);
        assert_eq!(offset_of!(E, ttsi), 40);
    }

    #[test]
    fn smart_offsets_and_decode() {
        type S = SmartHealthLog;
        assert_eq!(offset_of!(S, composite_temperature), 1);
        assert_eq!(offset_of!(S, available_spare), 3);
        assert_eq!(offset_of!(S, percentage_used), 5);
        assert_eq!(offset_of!(S, data_units_read), 32);
        assert_eq!(offset_of!(S, data_units_written), 48);
        assert_eq!(offset_of!(S, host_read_commands), 64);
        assert_eq!(offset_of!(S, power_cycles), 112);
        assert_eq!(offset_of!(S, power_on_hours), 128);
        assert_eq!(offset_of!(S, unsafe_shutdowns), 144);
        assert_eq!(offset_of!(S, media_errors), 160);
        assert_eq!(offset_of!(S, error_log_entries), 176);
        assert_eq!(offset_of!(S, warning_temperature_time), 192);
        assert_eq!(offset_of!(S, temperature_sensors), 200);
        assert_eq!(offset_of!(S, thermal_time_2), 228);

        let mut raw = [0u8; 512];
        raw[1..3].copy_from_slice(&300u16.to_le_bytes());
        raw[3] = 100;
        raw[32..48].copy_from_slice(&12345u128.to_le_bytes());
        raw[160..176].copy_from_slice(&2u128.to_le_bytes());
        let s = SmartHealthLog::read_from_bytes(&raw[..]).unwrap();
        assert_eq!(s.composite_temperature.get(), 300);
        assert_eq!(s.available_spare, 100);
        assert_eq!(s.data_units_read.get(), 12345);
        assert_eq!(s.media_errors.get(), 2);
    }
}
