//! Completion queue entries (NVMe Base 2.0, section 4.6 "Completion Queue Entry").

use crate::status::{Status, StatusCodeType};
use bitfield_struct::bitfield;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Completion Queue Entry: 16 bytes (NVMe Base 2.0, Figure 89).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Completion {
    /// Dword 0: command specific result.
    pub dw0: u32,
    /// Dword 1: command specific result.
    pub dw1: u32,
    /// SQ Head Pointer: the submission queue head as the controller consumed it.
    pub sqhd: u16,
    /// SQ Identifier of the submission queue the command came from.
    pub sqid: u16,
    /// Command Identifier of the completed command.
    pub cid: u16,
    /// Phase Tag and Status.
    pub status: CqeStatus,
}
const _: () = assert!(size_of::<Completion>() == 16 && size_of::<Completion>() == CQE_SIZE);

/// Size of a completion queue entry in bytes (CC.IOCQES = 4); defined in [`crate::wire`].
pub use crate::wire::CQE_SIZE;
/// log2 of [`CQE_SIZE`], the value for CC.IOCQES.
pub const CQE_SIZE_LOG2: u8 = 4;
const _: () = assert!(1 << CQE_SIZE_LOG2 == CQE_SIZE);
/// Byte offset, within a [`Completion`], of the dword holding CID, phase tag and status; the
/// driver loads it first (Acquire) to see whether the entry is new. The same number as
/// [`crate::wire::CQE_STATUS_DWORD`], under its older name.
pub use crate::wire::CQE_STATUS_DWORD as CQE_STATUS_DWORD_OFFSET;

/// Phase Tag and Status Field of a completion (NVMe Base 2.0, Figure 92/93).
#[bitfield(u16)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CqeStatus {
    /// Phase Tag: flips each time the controller wraps the completion queue.
    pub p: bool,
    /// Status Code.
    pub sc: u8,
    /// Status Code Type.
    #[bits(3)]
    pub sct: u8,
    /// Command Retry Delay.
    #[bits(2)]
    pub crd: u8,
    /// More: more status information is in the Error Information log page.
    pub m: bool,
    /// Do Not Retry.
    pub dnr: bool,
}

impl CqeStatus {
    /// The status without the phase tag.
    pub const fn status(&self) -> Status {
        Status {
            sct: StatusCodeType(self.sct()),
            sc: self.sc(),
            crd: self.crd(),
            more: self.m(),
            dnr: self.dnr(),
        }
    }

    /// Builds the field from a status and a phase tag (what a controller posts).
    pub const fn from_status(status: Status, phase: bool) -> Self {
        Self::new()
            .with_p(phase)
            .with_sc(status.sc)
            .with_sct(status.sct.0 & 0x7)
            .with_crd(status.crd & 0x3)
            .with_m(status.more)
            .with_dnr(status.dnr)
    }
}

impl Completion {
    /// The completion's status (without the phase tag).
    pub const fn status(&self) -> Status {
        self.status.status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::generic;
    use core::mem::offset_of;

    #[test]
    fn layout() {
        assert_eq!(offset_of!(Completion, sqhd), 8);
        assert_eq!(offset_of!(Completion, sqid), 10);
        assert_eq!(offset_of!(Completion, cid), CQE_STATUS_DWORD_OFFSET);
        assert_eq!(offset_of!(Completion, status), 14);
    }

    #[test]
    fn status_bits() {
        // LBA Out of Range (SCT 0, SC 0x80) with DNR and phase 1: 0x8101.
        let s = CqeStatus::from(0x8101);
        assert!(s.p());
        assert_eq!(s.sc(), 0x80);
        assert_eq!(s.sct(), 0);
        assert!(s.dnr());
        assert!(!s.m());
        let st = s.status();
        assert_eq!(st.sct, StatusCodeType::GENERIC);
        assert_eq!(st.sc, generic::LBA_OUT_OF_RANGE);
        assert!(st.dnr);
        assert_eq!(CqeStatus::from_status(st, true), s);
        // Invalid Queue Identifier (SCT 1, SC 0x01), phase 0: sc<<1 | sct<<9.
        let s = CqeStatus::from(0x0202);
        assert_eq!((s.sct(), s.sc(), s.p()), (1, 1, false));
        // Unrecovered Read Error (SCT 2, SC 0x81) with More and CRD 1.
        let s = CqeStatus::from((0x81 << 1) | (2 << 9) | (1 << 12) | (1 << 14));
        assert_eq!((s.sct(), s.sc(), s.crd(), s.m()), (2, 0x81, 1, true));
    }

    #[test]
    fn completion_bytes() {
        let mut raw = [0u8; 16];
        raw[0..4].copy_from_slice(&0x0003_0007u32.to_le_bytes());
        raw[8..10].copy_from_slice(&5u16.to_le_bytes());
        raw[10..12].copy_from_slice(&1u16.to_le_bytes());
        raw[12..14].copy_from_slice(&0x1234u16.to_le_bytes());
        raw[14..16].copy_from_slice(&0x0001u16.to_le_bytes());
        let c = Completion::read_from_bytes(&raw).unwrap();
        assert_eq!((c.dw0, c.sqhd, c.sqid, c.cid), (0x0003_0007, 5, 1, 0x1234));
        assert!(c.status.p());
        assert!(c.status().is_success());
    }
}
