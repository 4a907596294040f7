//! Byte layout of what crosses the wire between a host and a controller through memory and
//! BAR0: field offsets and sizes of the submission queue entry (SQE) and completion queue entry
//! (CQE), and doorbell addresses (NVMe Base 2.0, sections 3.1.3.12/13, 4.2 and 4.6).
//!
//! These are the single definition of those numbers for every agent that builds or parses
//! entries by byte offset instead of through [`Command`](crate::Command) /
//! [`Completion`](crate::Completion): the driver's queue engine, the software controller, and the
//! GPU side (`ptx/include/gpunvme.cuh` asserts the same values). The tests prove that they match the
//! `#[repr(C)]` structs.
//!
//! All multi-byte fields are little endian. Each field is naturally aligned inside its entry,
//! and entries are naturally aligned inside a queue (queues start on 4 KiB pages), so a field of
//! `N` bytes can be written or read with one `N`-byte access.

/// Size in bytes of a submission queue entry (CC.IOSQES = 6).
pub const SQE_SIZE: usize = 64;

/// SQE byte 0: Opcode (OPC), 1 byte.
pub const SQE_OPC: usize = 0;
/// Size of [`SQE_OPC`].
pub const SQE_OPC_SIZE: usize = 1;
/// SQE byte 1: flags; bits 1:0 Fused Operation (FUSE), bits 7:6 PRP or SGL for Data Transfer
/// (PSDT), 1 byte.
pub const SQE_FLAGS: usize = 1;
/// Size of [`SQE_FLAGS`].
pub const SQE_FLAGS_SIZE: usize = 1;
/// Bit mask of FUSE within [`SQE_FLAGS`].
pub const SQE_FLAGS_FUSE_MASK: u8 = 0b0000_0011;
/// Bit mask of PSDT within [`SQE_FLAGS`].
pub const SQE_FLAGS_PSDT_MASK: u8 = 0b1100_0000;
/// SQE bytes 2..4: Command Identifier (CID), u16.
pub const SQE_CID: usize = 2;
/// Size of [`SQE_CID`].
pub const SQE_CID_SIZE: usize = 2;
/// SQE bytes 0..4: Command Dword 0 as a whole (OPC, flags, CID), u32.
pub const SQE_CDW0: usize = 0;
/// SQE bytes 4..8: Namespace Identifier (NSID), u32.
pub const SQE_NSID: usize = 4;
/// SQE bytes 8..12: Command Dword 2, u32.
pub const SQE_CDW2: usize = 8;
/// SQE bytes 12..16: Command Dword 3, u32.
pub const SQE_CDW3: usize = 12;
/// SQE bytes 16..24: Metadata Pointer (MPTR), u64.
pub const SQE_MPTR: usize = 16;
/// SQE bytes 24..32: PRP Entry 1 (PRP1), u64.
pub const SQE_PRP1: usize = 24;
/// SQE bytes 32..40: PRP Entry 2 (PRP2), u64.
pub const SQE_PRP2: usize = 32;
/// SQE bytes 40..44: Command Dword 10, u32 (Read/Write: SLBA bits 31:0).
pub const SQE_CDW10: usize = 40;
/// SQE bytes 44..48: Command Dword 11, u32 (Read/Write: SLBA bits 63:32).
pub const SQE_CDW11: usize = 44;
/// SQE bytes 48..52: Command Dword 12, u32 (Read/Write: NLB, zero-based, in bits 15:0).
pub const SQE_CDW12: usize = 48;
/// SQE bytes 52..56: Command Dword 13, u32.
pub const SQE_CDW13: usize = 52;
/// SQE bytes 56..60: Command Dword 14, u32.
pub const SQE_CDW14: usize = 56;
/// SQE bytes 60..64: Command Dword 15, u32.
pub const SQE_CDW15: usize = 60;
/// Size of every 32-bit SQE field ([`SQE_CDW0`], [`SQE_NSID`], [`SQE_CDW2`], [`SQE_CDW3`],
/// [`SQE_CDW10`]..=[`SQE_CDW15`]).
pub const SQE_DWORD_SIZE: usize = 4;
/// Size of every 64-bit SQE field ([`SQE_MPTR`], [`SQE_PRP1`], [`SQE_PRP2`]).
pub const SQE_QWORD_SIZE: usize = 8;

/// Every SQE field as (spec mnemonic, byte offset, size), in order; the fields tile the entry
/// exactly. For generators and cross-checks of mirrors in other languages.
pub const SQE_FIELDS: [(&str, usize, usize); 15] = [
    ("OPC", SQE_OPC, SQE_OPC_SIZE),
    ("FLAGS", SQE_FLAGS, SQE_FLAGS_SIZE),
    ("CID", SQE_CID, SQE_CID_SIZE),
    ("NSID", SQE_NSID, SQE_DWORD_SIZE),
    ("CDW2", SQE_CDW2, SQE_DWORD_SIZE),
    ("CDW3", SQE_CDW3, SQE_DWORD_SIZE),
    ("MPTR", SQE_MPTR, SQE_QWORD_SIZE),
    ("PRP1", SQE_PRP1, SQE_QWORD_SIZE),
    ("PRP2", SQE_PRP2, SQE_QWORD_SIZE),
    ("CDW10", SQE_CDW10, SQE_DWORD_SIZE),
    ("CDW11", SQE_CDW11, SQE_DWORD_SIZE),
    ("CDW12", SQE_CDW12, SQE_DWORD_SIZE),
    ("CDW13", SQE_CDW13, SQE_DWORD_SIZE),
    ("CDW14", SQE_CDW14, SQE_DWORD_SIZE),
    ("CDW15", SQE_CDW15, SQE_DWORD_SIZE),
];

/// Size in bytes of a completion queue entry (CC.IOCQES = 4).
pub const CQE_SIZE: usize = 16;

/// CQE bytes 0..4: Dword 0, command specific, u32.
pub const CQE_DW0: usize = 0;
/// CQE bytes 4..8: Dword 1, command specific, u32.
pub const CQE_DW1: usize = 4;
/// Size of [`CQE_DW0`] and [`CQE_DW1`].
pub const CQE_DWORD_SIZE: usize = 4;
/// CQE bytes 8..10: SQ Head Pointer (SQHD), u16.
pub const CQE_SQHD: usize = 8;
/// CQE bytes 10..12: SQ Identifier (SQID), u16.
pub const CQE_SQID: usize = 10;
/// CQE bytes 12..14: Command Identifier (CID), u16.
pub const CQE_CID: usize = 12;
/// CQE bytes 14..16: Phase Tag (bit 0) and Status Field (bits 15:1), u16.
pub const CQE_STATUS: usize = 14;
/// Size of [`CQE_SQHD`], [`CQE_SQID`], [`CQE_CID`] and [`CQE_STATUS`].
pub const CQE_HALF_SIZE: usize = 2;
/// Bit of the Phase Tag within the 16-bit [`CQE_STATUS`] field.
pub const CQE_STATUS_PHASE_BIT: u16 = 1 << 0;
/// CQE bytes 12..16: the dword holding CID (bits 15:0), Phase Tag (bit 16) and Status
/// (bits 31:17). A host polls the queue by loading this dword with Acquire ordering first.
pub const CQE_STATUS_DWORD: usize = 12;
/// Bit of the Phase Tag within the [`CQE_STATUS_DWORD`] dword.
pub const CQE_STATUS_DWORD_PHASE_BIT: u32 = 1 << 16;
/// Bytes 8..12 as one dword: SQHD (bits 15:0) and SQID (bits 31:16).
pub const CQE_SQ_DWORD: usize = 8;

/// Every CQE field as (spec mnemonic, byte offset, size), in order; the fields tile the entry
/// exactly.
pub const CQE_FIELDS: [(&str, usize, usize); 6] = [
    ("DW0", CQE_DW0, CQE_DWORD_SIZE),
    ("DW1", CQE_DW1, CQE_DWORD_SIZE),
    ("SQHD", CQE_SQHD, CQE_HALF_SIZE),
    ("SQID", CQE_SQID, CQE_HALF_SIZE),
    ("CID", CQE_CID, CQE_HALF_SIZE),
    ("STATUS", CQE_STATUS, CQE_HALF_SIZE),
];

/// BAR0 byte offset of the first doorbell register (Submission Queue 0 Tail Doorbell).
pub const DOORBELL_BASE: usize = 0x1000;
/// Size of one doorbell register (32 bits).
pub const DOORBELL_SIZE: usize = 4;

/// Distance in bytes between consecutive doorbell registers: `4 << CAP.DSTRD`.
pub const fn doorbell_stride(dstrd: u8) -> usize {
    DOORBELL_SIZE << dstrd
}

/// BAR0 byte offset of Submission Queue `qid`'s Tail Doorbell:
/// `0x1000 + (2 * qid) * (4 << CAP.DSTRD)` (section 3.1.3.12).
pub const fn sq_tail_doorbell(qid: u16, dstrd: u8) -> usize {
    DOORBELL_BASE + (2 * qid as usize) * doorbell_stride(dstrd)
}

/// BAR0 byte offset of Completion Queue `qid`'s Head Doorbell:
/// `0x1000 + (2 * qid + 1) * (4 << CAP.DSTRD)` (section 3.1.3.13).
pub const fn cq_head_doorbell(qid: u16, dstrd: u8) -> usize {
    DOORBELL_BASE + (2 * qid as usize + 1) * doorbell_stride(dstrd)
}

// The entries' sizes and their log2 forms are checked against these in `command` and
// `completion`, which import this module (never the other way round).

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Cdw0;
    use crate::{Command, Completion, CqeStatus, Status};
    use core::mem::offset_of;
    use zerocopy::{FromBytes, FromZeros, IntoBytes};

    #[test]
    fn sqe_offsets_match_command() {
        assert_eq!(offset_of!(Command, cdw0), SQE_CDW0);
        assert_eq!(offset_of!(Command, cdw0), SQE_OPC);
        assert_eq!(offset_of!(Command, nsid), SQE_NSID);
        assert_eq!(offset_of!(Command, cdw2), SQE_CDW2);
        assert_eq!(offset_of!(Command, cdw3), SQE_CDW3);
        assert_eq!(offset_of!(Command, mptr), SQE_MPTR);
        assert_eq!(offset_of!(Command, prp1), SQE_PRP1);
        assert_eq!(offset_of!(Command, prp2), SQE_PRP2);
        assert_eq!(offset_of!(Command, cdw10), SQE_CDW10);
        assert_eq!(offset_of!(Command, cdw11), SQE_CDW11);
        assert_eq!(offset_of!(Command, cdw12), SQE_CDW12);
        assert_eq!(offset_of!(Command, cdw13), SQE_CDW13);
        assert_eq!(offset_of!(Command, cdw14), SQE_CDW14);
        assert_eq!(offset_of!(Command, cdw15), SQE_CDW15);
        assert_eq!(size_of::<Command>(), SQE_SIZE);
        assert_eq!(size_of::<Cdw0>(), SQE_DWORD_SIZE);
        assert_eq!(size_of::<u64>(), SQE_QWORD_SIZE);
    }

    #[test]
    fn sqe_bytes_inside_cdw0() {
        // OPC, FUSE/PSDT and CID are bitfields of CDW0: check their bytes in an encoded entry.
        let mut cmd = Command::new_zeroed();
        cmd.cdw0 = Cdw0::new()
            .with_opcode(0x02)
            .with_fuse(0b01)
            .with_psdt(0b10)
            .with_cid(0xbeef);
        cmd.nsid = 0x1122_3344;
        cmd.prp1 = 0x0102_0304_0506_0708;
        cmd.cdw12 = 0xa5a5_0007;
        let bytes = cmd.as_bytes();
        assert_eq!(bytes[SQE_OPC], 0x02);
        assert_eq!(bytes[SQE_FLAGS] & SQE_FLAGS_FUSE_MASK, 0b01);
        assert_eq!((bytes[SQE_FLAGS] & SQE_FLAGS_PSDT_MASK) >> 6, 0b10);
        assert_eq!(
            u16::from_le_bytes([bytes[SQE_CID], bytes[SQE_CID + 1]]),
            0xbeef
        );
        let dw = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let qw = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
        assert_eq!(dw(SQE_NSID), 0x1122_3344);
        assert_eq!(qw(SQE_PRP1), 0x0102_0304_0506_0708);
        assert_eq!(dw(SQE_CDW12), 0xa5a5_0007);
    }

    #[test]
    fn cqe_offsets_match_completion() {
        assert_eq!(offset_of!(Completion, dw0), CQE_DW0);
        assert_eq!(offset_of!(Completion, dw1), CQE_DW1);
        assert_eq!(offset_of!(Completion, sqhd), CQE_SQHD);
        assert_eq!(offset_of!(Completion, sqhd), CQE_SQ_DWORD);
        assert_eq!(offset_of!(Completion, sqid), CQE_SQID);
        assert_eq!(offset_of!(Completion, cid), CQE_CID);
        assert_eq!(offset_of!(Completion, cid), CQE_STATUS_DWORD);
        assert_eq!(offset_of!(Completion, status), CQE_STATUS);
        assert_eq!(size_of::<Completion>(), CQE_SIZE);
        assert_eq!(size_of::<CqeStatus>(), CQE_HALF_SIZE);
    }

    #[test]
    fn phase_tag_bits() {
        let mut c = Completion::new_zeroed();
        c.cid = 0x1234;
        c.status = CqeStatus::from_status(Status::SUCCESS, true);
        let bytes = c.as_bytes();
        let status = u16::from_le_bytes([bytes[CQE_STATUS], bytes[CQE_STATUS + 1]]);
        assert_eq!(status, CQE_STATUS_PHASE_BIT);
        let dword = u32::from_le_bytes(
            bytes[CQE_STATUS_DWORD..CQE_STATUS_DWORD + 4]
                .try_into()
                .unwrap(),
        );
        assert_eq!(dword, CQE_STATUS_DWORD_PHASE_BIT | 0x1234);
        let back = Completion::read_from_bytes(bytes).unwrap();
        assert!(back.status.p());
        c.status = CqeStatus::from_status(Status::SUCCESS, false);
        assert_eq!(c.as_bytes()[CQE_STATUS] & CQE_STATUS_PHASE_BIT as u8, 0);
    }

    #[test]
    fn fields_tile_the_entries() {
        for (table, entry) in [(&SQE_FIELDS[..], SQE_SIZE), (&CQE_FIELDS[..], CQE_SIZE)] {
            let mut end = 0;
            for &(name, offset, size) in table {
                assert_eq!(
                    offset, end,
                    "{name} does not begin where the previous field ends"
                );
                assert_eq!(offset % size, 0, "{name} is not naturally aligned");
                end = offset + size;
            }
            assert_eq!(end, entry);
        }
    }

    #[test]
    fn doorbells() {
        assert_eq!(doorbell_stride(0), 4);
        assert_eq!(doorbell_stride(3), 32);
        assert_eq!(sq_tail_doorbell(0, 0), 0x1000);
        assert_eq!(cq_head_doorbell(0, 0), 0x1004);
        assert_eq!(sq_tail_doorbell(5, 1), 0x1000 + 10 * 8);
        assert_eq!(cq_head_doorbell(5, 1), 0x1000 + 11 * 8);
    }
}
