//! Controller registers (NVMe Base 2.0, section 3.1.3 "Controller Properties"): offsets,
//! bitfield layouts and doorbell address arithmetic.

use bitfield_struct::bitfield;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Controller Capabilities, 64 bits (section 3.1.3.1).
pub const CAP: usize = 0x00;
/// Version, 32 bits (section 3.1.3.2).
pub const VS: usize = 0x08;
/// Interrupt Mask Set, 32 bits.
pub const INTMS: usize = 0x0c;
/// Interrupt Mask Clear, 32 bits.
pub const INTMC: usize = 0x10;
/// Controller Configuration, 32 bits (section 3.1.3.5).
pub const CC: usize = 0x14;
/// Controller Status, 32 bits (section 3.1.3.6).
pub const CSTS: usize = 0x1c;
/// NVM Subsystem Reset, 32 bits.
pub const NSSR: usize = 0x20;
/// Admin Queue Attributes, 32 bits (section 3.1.3.8).
pub const AQA: usize = 0x24;
/// Admin Submission Queue Base Address, 64 bits.
pub const ASQ: usize = 0x28;
/// Admin Completion Queue Base Address, 64 bits.
pub const ACQ: usize = 0x30;
/// Controller Memory Buffer Location, 32 bits.
pub const CMBLOC: usize = 0x38;
/// Controller Memory Buffer Size, 32 bits.
pub const CMBSZ: usize = 0x3c;
/// First doorbell register (Submission Queue 0 Tail Doorbell); defined in [`crate::wire`].
pub use crate::wire::DOORBELL_BASE;
/// Doorbell offsets and stride; defined in [`crate::wire`].
pub use crate::wire::{cq_head_doorbell, doorbell_stride, sq_tail_doorbell};

/// Value written to [`NSSR`] to start an NVM subsystem reset ("NVMe" in ASCII).
pub const NSSR_RESET_VALUE: u32 = 0x4e56_4d65;

/// Controller Capabilities (CAP, section 3.1.3.1).
#[bitfield(u64)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Cap {
    /// Maximum Queue Entries Supported, zero-based.
    pub mqes_z: u16,
    /// Contiguous Queues Required.
    pub cqr: bool,
    /// Arbitration Mechanism Supported (bit 0: weighted round robin, bit 1: vendor specific).
    #[bits(2)]
    pub ams: u8,
    #[bits(5)]
    __: u8,
    /// Timeout: worst-case time for CSTS.RDY to change, in 500 ms units.
    pub to: u8,
    /// Doorbell Stride: doorbells are `4 << dstrd` bytes apart.
    #[bits(4)]
    pub dstrd: u8,
    /// NVM Subsystem Reset Supported.
    pub nssrs: bool,
    /// Command Sets Supported (bit 0: NVM command set, bit 6: I/O command sets, bit 7: admin only).
    pub css: u8,
    /// Boot Partition Support.
    pub bps: bool,
    /// Controller Power Scope.
    #[bits(2)]
    pub cps: u8,
    /// Memory Page Size Minimum: `2 ^ (12 + mpsmin)` bytes.
    #[bits(4)]
    pub mpsmin: u8,
    /// Memory Page Size Maximum: `2 ^ (12 + mpsmax)` bytes.
    #[bits(4)]
    pub mpsmax: u8,
    /// Persistent Memory Region Supported.
    pub pmrs: bool,
    /// Controller Memory Buffer Supported.
    pub cmbs: bool,
    /// NVM Subsystem Shutdown Supported.
    pub nsss: bool,
    /// Controller Ready Modes Supported.
    #[bits(2)]
    pub crms: u8,
    #[bits(3)]
    __: u8,
}

impl Cap {
    /// CAP.CSS bit: the NVM command set is supported.
    pub const CSS_NVM: u8 = 1 << 0;
    /// CAP.CSS bit: one or more I/O command sets are supported (CC.CSS = 110b allowed).
    pub const CSS_IO_COMMAND_SETS: u8 = 1 << 6;
    /// CAP.CSS bit: only the admin command set is supported.
    pub const CSS_ADMIN_ONLY: u8 = 1 << 7;

    /// Maximum queue entries as a count (MQES + 1).
    pub const fn max_queue_entries(&self) -> u32 {
        self.mqes_z() as u32 + 1
    }

    /// Smallest memory page size in bytes (saturating for out-of-range values).
    pub const fn min_page_size(&self) -> u64 {
        1u64 << (12 + self.mpsmin() as u32)
    }

    /// Largest memory page size in bytes.
    pub const fn max_page_size(&self) -> u64 {
        1u64 << (12 + self.mpsmax() as u32)
    }

    /// CAP.TO in milliseconds.
    pub const fn timeout_ms(&self) -> u64 {
        self.to() as u64 * 500
    }
}

/// Version (VS, section 3.1.3.2).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Vs {
    /// Tertiary version number.
    pub ter: u8,
    /// Minor version number.
    pub mnr: u8,
    /// Major version number.
    pub mjr: u16,
}

/// Controller Configuration (CC, section 3.1.3.5).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Cc {
    /// Enable.
    pub en: bool,
    #[bits(3)]
    __: u8,
    /// I/O Command Set Selected (000b: NVM command set).
    #[bits(3)]
    pub css: u8,
    /// Memory Page Size: `2 ^ (12 + mps)` bytes.
    #[bits(4)]
    pub mps: u8,
    /// Arbitration Mechanism Selected (000b: round robin).
    #[bits(3)]
    pub ams: u8,
    /// Shutdown Notification (see [`Cc::SHN_NORMAL`], [`Cc::SHN_ABRUPT`]).
    #[bits(2)]
    pub shn: u8,
    /// I/O Submission Queue Entry Size: `2 ^ iosqes` bytes (6 for 64 B).
    #[bits(4)]
    pub iosqes: u8,
    /// I/O Completion Queue Entry Size: `2 ^ iocqes` bytes (4 for 16 B).
    #[bits(4)]
    pub iocqes: u8,
    /// Controller Ready Independent of Media Enable.
    pub crime: bool,
    #[bits(7)]
    __: u8,
}

impl Cc {
    /// CC.CSS value selecting the NVM command set.
    pub const CSS_NVM: u8 = 0b000;
    /// CC.CSS value selecting all supported I/O command sets.
    pub const CSS_ALL_IO: u8 = 0b110;
    /// CC.CSS value selecting the admin command set only.
    pub const CSS_ADMIN_ONLY: u8 = 0b111;
    /// CC.SHN: no notification.
    pub const SHN_NONE: u8 = 0b00;
    /// CC.SHN: normal shutdown notification.
    pub const SHN_NORMAL: u8 = 0b01;
    /// CC.SHN: abrupt shutdown notification.
    pub const SHN_ABRUPT: u8 = 0b10;
}

/// Controller Status (CSTS, section 3.1.3.6).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Csts {
    /// Ready.
    pub rdy: bool,
    /// Controller Fatal Status.
    pub cfs: bool,
    /// Shutdown Status (see [`Csts::SHST_NORMAL`] and friends).
    #[bits(2)]
    pub shst: u8,
    /// NVM Subsystem Reset Occurred.
    pub nssro: bool,
    /// Processing Paused.
    pub pp: bool,
    /// Shutdown Type.
    pub st: bool,
    #[bits(25)]
    __: u32,
}

impl Csts {
    /// CSTS.SHST: normal operation, no shutdown requested.
    pub const SHST_NORMAL: u8 = 0b00;
    /// CSTS.SHST: shutdown processing occurring.
    pub const SHST_OCCURRING: u8 = 0b01;
    /// CSTS.SHST: shutdown processing complete.
    pub const SHST_COMPLETE: u8 = 0b10;
}

/// Admin Queue Attributes (AQA, section 3.1.3.8).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Aqa {
    /// Admin Submission Queue Size, zero-based.
    #[bits(12)]
    pub asqs_z: u16,
    #[bits(4)]
    __: u8,
    /// Admin Completion Queue Size, zero-based.
    #[bits(12)]
    pub acqs_z: u16,
    #[bits(4)]
    __: u8,
}

/// Inverse of the doorbell functions: which queue a doorbell offset belongs to.
///
/// Returns `None` for offsets below [`DOORBELL_BASE`] or not on a doorbell boundary.
pub const fn doorbell_target(offset: usize, dstrd: u8) -> Option<Doorbell> {
    if offset < DOORBELL_BASE {
        return None;
    }
    let stride = doorbell_stride(dstrd);
    let rel = offset - DOORBELL_BASE;
    if rel % stride != 0 {
        return None;
    }
    let index = rel / stride;
    let qid = index / 2;
    if qid > u16::MAX as usize {
        return None;
    }
    if index % 2 == 0 {
        Some(Doorbell::SqTail(qid as u16))
    } else {
        Some(Doorbell::CqHead(qid as u16))
    }
}

/// A doorbell register, decoded from its offset by [`doorbell_target`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doorbell {
    /// Submission Queue Tail Doorbell of the given queue.
    SqTail(u16),
    /// Completion Queue Head Doorbell of the given queue.
    CqHead(u16),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_cap_decodes() {
        // CAP as read from QEMU's emulated NVMe controller.
        let cap = Cap::from(0x0040_1820_0f01_07ff);
        assert_eq!(cap.mqes_z(), 0x7ff);
        assert_eq!(cap.max_queue_entries(), 0x800);
        assert!(cap.cqr());
        assert_eq!(cap.ams(), 0);
        assert_eq!(cap.to(), 15);
        assert_eq!(cap.timeout_ms(), 7500);
        assert_eq!(cap.dstrd(), 0);
        assert!(!cap.nssrs());
        assert_eq!(cap.css() & Cap::CSS_NVM, Cap::CSS_NVM);
        assert_eq!(cap.css(), 0xc1);
        assert_eq!(cap.mpsmin(), 0);
        assert_eq!(cap.mpsmax(), 4);
        assert_eq!(cap.min_page_size(), 4096);
        assert_eq!(cap.max_page_size(), 65536);
        assert!(!cap.pmrs() && !cap.cmbs());
    }

    #[test]
    fn cc_bring_up_value() {
        // EN=1, CSS=NVM, MPS=0, IOSQES=6, IOCQES=4: the value Linux writes, 0x00460001.
        let cc = Cc::new()
            .with_en(true)
            .with_css(Cc::CSS_NVM)
            .with_mps(0)
            .with_iosqes(6)
            .with_iocqes(4);
        assert_eq!(u32::from(cc), 0x0046_0001);
        let shn = cc.with_shn(Cc::SHN_NORMAL);
        assert_eq!(u32::from(shn), 0x0046_4001);
        assert_eq!(Cc::from(0x0046_4001).shn(), Cc::SHN_NORMAL);
    }

    #[test]
    fn csts_fields() {
        let csts = Csts::from(0b1001);
        assert!(csts.rdy());
        assert!(!csts.cfs());
        assert_eq!(csts.shst(), Csts::SHST_COMPLETE);
        assert!(Csts::from(0b10).cfs());
        assert!(Csts::from(1 << 5).pp());
        assert!(Csts::from(1 << 4).nssro());
    }

    #[test]
    fn aqa_and_vs() {
        let aqa = Aqa::new().with_asqs_z(31).with_acqs_z(63);
        assert_eq!(u32::from(aqa), 0x003f_001f);
        let vs = Vs::from(0x0001_0400);
        assert_eq!((vs.mjr(), vs.mnr(), vs.ter()), (1, 4, 0));
        let vs2 = Vs::from(0x0002_0001);
        assert_eq!((vs2.mjr(), vs2.mnr(), vs2.ter()), (2, 0, 1));
    }

    #[test]
    fn doorbells() {
        assert_eq!(sq_tail_doorbell(0, 0), 0x1000);
        assert_eq!(cq_head_doorbell(0, 0), 0x1004);
        assert_eq!(sq_tail_doorbell(1, 0), 0x1008);
        assert_eq!(cq_head_doorbell(1, 0), 0x100c);
        assert_eq!(sq_tail_doorbell(3, 2), 0x1000 + 6 * 16);
        assert_eq!(cq_head_doorbell(3, 2), 0x1000 + 7 * 16);
        for dstrd in 0..4 {
            for qid in [0u16, 1, 7, 65535] {
                assert_eq!(
                    doorbell_target(sq_tail_doorbell(qid, dstrd), dstrd),
                    Some(Doorbell::SqTail(qid))
                );
                assert_eq!(
                    doorbell_target(cq_head_doorbell(qid, dstrd), dstrd),
                    Some(Doorbell::CqHead(qid))
                );
            }
        }
        assert_eq!(doorbell_target(0x1002, 0), None);
        assert_eq!(doorbell_target(0x1004, 1), None);
        assert_eq!(doorbell_target(0x14, 0), None);
    }
}
