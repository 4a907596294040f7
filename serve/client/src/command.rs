//! The bytes a client writes and reads in its rings: Read and Write submission entries with
//! their data pointers (PRPs) into a slot buffer, and completion entries.
//!
//! Pure: no memory is touched here. The entries are `nvme_spec`'s [`Command`] and
//! [`Completion`], put to and taken from bytes at the offsets of [`nvme_spec::wire`] (the
//! single definition of those layouts, tested there against the structs).

use nvme_spec::command::ReadWriteCdw12;
use nvme_spec::command::{Cdw0, NvmOpcode};
use nvme_spec::wire::{
    CQE_CID, CQE_DW0, CQE_DW1, CQE_SIZE, CQE_SQHD, CQE_SQID, CQE_STATUS, SQE_CDW0, SQE_CDW2,
    SQE_CDW3, SQE_CDW10, SQE_CDW11, SQE_CDW12, SQE_CDW13, SQE_CDW14, SQE_CDW15, SQE_MPTR, SQE_NSID,
    SQE_PRP1, SQE_PRP2, SQE_SIZE,
};
use nvme_spec::{Command, Completion, CqeStatus};

/// Bytes of a memory page as PRP entries address them (CC.MPS = 0), and of a PRP list page.
pub const PAGE: u64 = 4096;
/// Entries in one PRP list page.
pub const PRP_LIST_ENTRIES: u64 = PAGE / 8;
/// The most logical blocks one Read or Write moves (NLB is a zero-based 16-bit field).
pub const MAX_BLOCKS: u32 = 1 << 16;

/// The two commands a queue pair sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IoOp {
    /// Read: the controller writes the slot buffer.
    Read,
    /// Write: the controller reads the slot buffer.
    Write,
}

impl IoOp {
    /// Its NVM command set opcode.
    pub const fn opcode(self) -> NvmOpcode {
        match self {
            Self::Read => NvmOpcode::READ,
            Self::Write => NvmOpcode::WRITE,
        }
    }

    /// Its name in errors.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Read => "Read",
            Self::Write => "Write",
        }
    }
}

/// A Read or Write of `blocks` logical blocks (1 to [`MAX_BLOCKS`]) from `lba` on `nsid`,
/// command id `cid`, data pointer not yet set: CDW10/11 the starting LBA, CDW12 the zero-based
/// block count. `None` for a block count outside its range.
pub fn rw_command(op: IoOp, cid: u16, nsid: u32, lba: u64, blocks: u32) -> Option<Command> {
    if blocks == 0 || blocks > MAX_BLOCKS {
        return None;
    }
    let mut cmd = Command::new(op.opcode().0, cid, nsid);
    cmd.set_slba(lba);
    cmd.cdw12 = ReadWriteCdw12::new()
        .with_nlb_z((blocks - 1) as u16)
        .into_bits();
    Some(cmd)
}

/// A command's data pointer for a transfer from the start of a slot buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prps {
    /// PRP Entry 1: the buffer's first page.
    pub prp1: u64,
    /// PRP Entry 2: 0 for one page, the second page for two, the PRP list page for more.
    pub prp2: u64,
    /// Entries the PRP list page must hold ([`prp_list_entry`] gives each); 0 without a list.
    pub list_entries: u64,
}

/// The PRPs of a transfer of `len` bytes from the start of the physically contiguous buffer
/// at device address `buffer` (page-aligned), with `list_page` (page-aligned) as the PRP list
/// page where more than two pages are spanned. `None` for an empty transfer, a misaligned
/// address, or one longer than a single list page describes (`PRP_LIST_ENTRIES + 1` pages).
pub fn slot_prps(buffer: u64, list_page: u64, len: u64) -> Option<Prps> {
    if buffer % PAGE != 0 {
        return None;
    }
    buffer_prps(buffer, list_page, len)
}

/// The PRPs of a transfer of `len` bytes into or out of the physically contiguous buffer at
/// device address `buffer`, which may start inside a page (dword-aligned: PRP Entry 1 carries
/// the offset, every later entry is a whole page), with `list_page` (page-aligned) as the PRP
/// list page where more than two pages are spanned. `None` for an empty transfer, an address
/// not dword-aligned, or more pages than a single list page describes.
pub fn buffer_prps(buffer: u64, list_page: u64, len: u64) -> Option<Prps> {
    if len == 0 || buffer % 4 != 0 || list_page % PAGE != 0 {
        return None;
    }
    let pages = (buffer % PAGE + len).div_ceil(PAGE);
    if pages > PRP_LIST_ENTRIES + 1 {
        return None;
    }
    // The last page's address must not overflow either.
    buffer.checked_add(len - 1)?;
    Some(match pages {
        1 => Prps {
            prp1: buffer,
            prp2: 0,
            list_entries: 0,
        },
        2 => Prps {
            prp1: buffer,
            prp2: prp_list_entry(buffer, 0),
            list_entries: 0,
        },
        _ => Prps {
            prp1: buffer,
            prp2: list_page,
            list_entries: pages - 1,
        },
    })
}

/// Entry `index` of the PRP list of a buffer at `buffer`: the device address of its page
/// `index + 1` (PRP1 is page 0, the page `buffer` is in). Valid for the indexes
/// [`buffer_prps`] asked for.
pub const fn prp_list_entry(buffer: u64, index: u64) -> u64 {
    (buffer & !(PAGE - 1)) + (index + 1) * PAGE
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn get64(b: &[u8], at: usize) -> u64 {
    u64::from(get32(b, at)) | u64::from(get32(b, at + 4)) << 32
}

/// The 64 bytes of a submission entry, little-endian.
pub fn encode_sqe(cmd: &Command) -> [u8; SQE_SIZE] {
    let mut b = [0u8; SQE_SIZE];
    put32(&mut b, SQE_CDW0, cmd.cdw0.into_bits());
    put32(&mut b, SQE_NSID, cmd.nsid);
    put32(&mut b, SQE_CDW2, cmd.cdw2);
    put32(&mut b, SQE_CDW3, cmd.cdw3);
    put64(&mut b, SQE_MPTR, cmd.mptr);
    put64(&mut b, SQE_PRP1, cmd.prp1);
    put64(&mut b, SQE_PRP2, cmd.prp2);
    put32(&mut b, SQE_CDW10, cmd.cdw10);
    put32(&mut b, SQE_CDW11, cmd.cdw11);
    put32(&mut b, SQE_CDW12, cmd.cdw12);
    put32(&mut b, SQE_CDW13, cmd.cdw13);
    put32(&mut b, SQE_CDW14, cmd.cdw14);
    put32(&mut b, SQE_CDW15, cmd.cdw15);
    b
}

/// A submission entry from its 64 bytes (what a controller, or a test's fake one, reads).
pub fn decode_sqe(b: &[u8; SQE_SIZE]) -> Command {
    Command {
        cdw0: Cdw0::from_bits(get32(b, SQE_CDW0)),
        nsid: get32(b, SQE_NSID),
        cdw2: get32(b, SQE_CDW2),
        cdw3: get32(b, SQE_CDW3),
        mptr: get64(b, SQE_MPTR),
        prp1: get64(b, SQE_PRP1),
        prp2: get64(b, SQE_PRP2),
        cdw10: get32(b, SQE_CDW10),
        cdw11: get32(b, SQE_CDW11),
        cdw12: get32(b, SQE_CDW12),
        cdw13: get32(b, SQE_CDW13),
        cdw14: get32(b, SQE_CDW14),
        cdw15: get32(b, SQE_CDW15),
    }
}

/// The 16 bytes of a completion entry, little-endian (what a controller posts; the last
/// dword, CID with phase and status, is the one a controller stores last).
pub fn encode_cqe(c: &Completion) -> [u8; CQE_SIZE] {
    let mut b = [0u8; CQE_SIZE];
    put32(&mut b, CQE_DW0, c.dw0);
    put32(&mut b, CQE_DW1, c.dw1);
    b[CQE_SQHD..CQE_SQHD + 2].copy_from_slice(&c.sqhd.to_le_bytes());
    b[CQE_SQID..CQE_SQID + 2].copy_from_slice(&c.sqid.to_le_bytes());
    b[CQE_CID..CQE_CID + 2].copy_from_slice(&c.cid.to_le_bytes());
    b[CQE_STATUS..CQE_STATUS + 2].copy_from_slice(&c.status.into_bits().to_le_bytes());
    b
}

/// A completion entry from its 16 bytes.
pub fn decode_cqe(b: &[u8; CQE_SIZE]) -> Completion {
    Completion {
        dw0: get32(b, CQE_DW0),
        dw1: get32(b, CQE_DW1),
        sqhd: get16(b, CQE_SQHD),
        sqid: get16(b, CQE_SQID),
        cid: get16(b, CQE_CID),
        status: CqeStatus::from_bits(get16(b, CQE_STATUS)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_spec::status::generic;
    use nvme_spec::{Status, StatusCodeType};

    #[test]
    fn read_and_write_dwords() {
        let cmd = rw_command(IoOp::Read, 0x0102, 7, 0x1_2345_6789, 8).unwrap();
        assert_eq!(cmd.cdw0.opcode(), 0x02);
        assert_eq!(cmd.cdw0.cid(), 0x0102);
        assert_eq!(cmd.cdw0.psdt(), 0, "PRPs, not SGLs");
        assert_eq!(cmd.nsid, 7);
        assert_eq!((cmd.cdw10, cmd.cdw11), (0x2345_6789, 1));
        assert_eq!(cmd.cdw12, 7, "NLB is zero-based");
        let b = encode_sqe(&cmd);
        assert_eq!(&b[0..4], &[0x02, 0x00, 0x02, 0x01]);
        assert_eq!(&b[4..8], &[7, 0, 0, 0]);
        assert_eq!(&b[40..48], &[0x89, 0x67, 0x45, 0x23, 1, 0, 0, 0]);
        assert_eq!(&b[48..52], &[7, 0, 0, 0]);
        assert!(b[8..40].iter().all(|&x| x == 0), "CDW2-3, MPTR, PRPs unset");
        assert!(b[52..].iter().all(|&x| x == 0), "CDW13-15 zero");

        let w = rw_command(IoOp::Write, 3, 1, 0, MAX_BLOCKS).unwrap();
        assert_eq!(w.cdw0.opcode(), 0x01);
        assert_eq!(w.cdw12, 0xffff);
        assert_eq!(rw_command(IoOp::Write, 3, 1, 0, 1).unwrap().cdw12, 0);
        assert!(rw_command(IoOp::Read, 0, 1, 0, 0).is_none());
        assert!(rw_command(IoOp::Read, 0, 1, 0, MAX_BLOCKS + 1).is_none());
    }

    #[test]
    fn sqe_round_trips_every_field() {
        let mut cmd = rw_command(IoOp::Write, 0xbeef, 0x1122_3344, u64::MAX - 1, 300).unwrap();
        cmd.prp1 = 0x0102_0304_0506_7000;
        cmd.prp2 = 0x1112_1314_1516_8000;
        cmd.mptr = 0xdead_beef_0000_0010;
        (cmd.cdw2, cmd.cdw3, cmd.cdw13, cmd.cdw14, cmd.cdw15) = (2, 3, 13, 14, 15);
        let b = encode_sqe(&cmd);
        assert_eq!(&b[24..32], &0x0102_0304_0506_7000u64.to_le_bytes());
        assert_eq!(&b[32..40], &0x1112_1314_1516_8000u64.to_le_bytes());
        assert_eq!(decode_sqe(&b), cmd);
    }

    const BUF: u64 = 0x10_0000_0000;
    const LIST: u64 = 0x20_0000_0000;

    #[test]
    fn prps_for_one_two_three_and_512_pages() {
        // One page, whole or partial.
        for len in [512, 4096] {
            let p = slot_prps(BUF, LIST, len).unwrap();
            assert_eq!((p.prp1, p.prp2, p.list_entries), (BUF, 0, 0));
        }
        // Two pages: PRP2 is the second page, no list (4097 bytes span two pages).
        for len in [4097, 8192] {
            let p = slot_prps(BUF, LIST, len).unwrap();
            assert_eq!((p.prp1, p.prp2, p.list_entries), (BUF, BUF + PAGE, 0));
        }
        // Three pages: PRP2 is the list, holding pages 1 and 2.
        let p = slot_prps(BUF, LIST, 3 * PAGE).unwrap();
        assert_eq!((p.prp1, p.prp2, p.list_entries), (BUF, LIST, 2));
        assert_eq!(prp_list_entry(BUF, 0), BUF + PAGE);
        assert_eq!(prp_list_entry(BUF, 1), BUF + 2 * PAGE);
        // 512 pages (2 MiB): 511 list entries, the last one page 511.
        let p = slot_prps(BUF, LIST, 512 * PAGE).unwrap();
        assert_eq!((p.prp1, p.prp2, p.list_entries), (BUF, LIST, 511));
        assert_eq!(prp_list_entry(BUF, 510), BUF + 511 * PAGE);
        // 513 pages still fit one list (PRP1 plus 512 entries); 514 do not.
        assert_eq!(slot_prps(BUF, LIST, 513 * PAGE).unwrap().list_entries, 512);
        assert!(slot_prps(BUF, LIST, 513 * PAGE + 1).is_none());
        // Nothing to move, or addresses PRPs cannot carry.
        assert!(slot_prps(BUF, LIST, 0).is_none());
        assert!(slot_prps(BUF + 512, LIST, 512).is_none());
        assert!(slot_prps(BUF, LIST + 8, 3 * PAGE).is_none());
        assert!(slot_prps(u64::MAX - PAGE + 1, LIST, 2 * PAGE).is_none());
    }

    #[test]
    fn prps_for_buffers_starting_inside_a_page() {
        // 512 bytes at offset 3584 end the page: one entry; 1024 bytes there span two pages.
        let p = buffer_prps(BUF + 3584, LIST, 512).unwrap();
        assert_eq!((p.prp1, p.prp2, p.list_entries), (BUF + 3584, 0, 0));
        let p = buffer_prps(BUF + 3584, LIST, 1024).unwrap();
        assert_eq!(
            (p.prp1, p.prp2, p.list_entries),
            (BUF + 3584, BUF + PAGE, 0)
        );
        // 128 KiB from offset 512 spans 33 pages: a list of 32 whole pages after the first.
        let p = buffer_prps(BUF + 512, LIST, 128 << 10).unwrap();
        assert_eq!((p.prp1, p.prp2, p.list_entries), (BUF + 512, LIST, 32));
        assert_eq!(prp_list_entry(BUF + 512, 0), BUF + PAGE);
        assert_eq!(prp_list_entry(BUF + 512, 31), BUF + 32 * PAGE);
        // 2 MiB from an offset spans 513 pages (still one list); a byte more does not fit.
        assert_eq!(
            buffer_prps(BUF + 4092, LIST, 512 * PAGE)
                .unwrap()
                .list_entries,
            512
        );
        assert!(buffer_prps(BUF + 4092, LIST, 512 * PAGE + 8).is_none());
        // PRP Entry 1 must be dword-aligned; aligned buffers give what slots do.
        assert!(buffer_prps(BUF + 2, LIST, 512).is_none());
        assert_eq!(
            buffer_prps(BUF, LIST, 3 * PAGE),
            slot_prps(BUF, LIST, 3 * PAGE)
        );
        assert!(buffer_prps(u64::MAX - 3, LIST, 8).is_none());
    }

    #[test]
    fn completion_bytes() {
        // From the spec crate's own test: dw0 0x0003_0007, SQHD 5, SQID 1, CID 0x1234,
        // success with phase 1.
        let mut raw = [0u8; 16];
        raw[0..4].copy_from_slice(&0x0003_0007u32.to_le_bytes());
        raw[8..10].copy_from_slice(&5u16.to_le_bytes());
        raw[10..12].copy_from_slice(&1u16.to_le_bytes());
        raw[12..14].copy_from_slice(&0x1234u16.to_le_bytes());
        raw[14..16].copy_from_slice(&0x0001u16.to_le_bytes());
        let c = decode_cqe(&raw);
        assert_eq!((c.dw0, c.sqhd, c.sqid, c.cid), (0x0003_0007, 5, 1, 0x1234));
        assert!(c.status.p());
        assert!(c.status().is_success());
        assert_eq!(encode_cqe(&c), raw);
        // LBA Out of Range with DNR, phase 0: status 0x8100; dword 3 bit 16 is the phase.
        let mut c2 = c;
        c2.status = CqeStatus::from_status(
            Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr(true),
            false,
        );
        let b = encode_cqe(&c2);
        assert_eq!(&b[14..16], &0x8100u16.to_le_bytes());
        let dw3 = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        assert_eq!(dw3 & (1 << 16), 0);
        assert_eq!(dw3 & 0xffff, 0x1234);
        let back = decode_cqe(&b).status();
        assert!(back.is(StatusCodeType::GENERIC, generic::LBA_OUT_OF_RANGE) && back.dnr);
    }
}
