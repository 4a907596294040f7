//! Submission queue entries, opcodes and the command dwords of the commands the driver uses
//! (NVMe Base 2.0 sections 4.2 and 5; NVM Command Set 1.0 section 3).

use bitfield_struct::bitfield;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Submission Queue Entry: one 64-byte command (NVMe Base 2.0, section 4.2
/// "Submission Queue Entry"), with PRP data pointers.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Command {
    /// Command Dword 0: opcode, fused operation, PSDT, command identifier.
    pub cdw0: Cdw0,
    /// Namespace Identifier.
    pub nsid: u32,
    /// Command Dword 2 (command specific).
    pub cdw2: u32,
    /// Command Dword 3 (command specific).
    pub cdw3: u32,
    /// Metadata Pointer.
    pub mptr: u64,
    /// Data Pointer, first half: PRP Entry 1.
    pub prp1: u64,
    /// Data Pointer, second half: PRP Entry 2 (a page address or a PRP list pointer).
    pub prp2: u64,
    /// Command Dword 10.
    pub cdw10: u32,
    /// Command Dword 11.
    pub cdw11: u32,
    /// Command Dword 12.
    pub cdw12: u32,
    /// Command Dword 13.
    pub cdw13: u32,
    /// Command Dword 14.
    pub cdw14: u32,
    /// Command Dword 15.
    pub cdw15: u32,
}
const _: () = assert!(size_of::<Command>() == 64 && size_of::<Command>() == SQE_SIZE);

/// The spec's name for [`Command`].
pub type SubmissionQueueEntry = Command;

/// Size of a submission queue entry in bytes (CC.IOSQES = 6); defined in [`crate::wire`].
pub use crate::wire::SQE_SIZE;
/// log2 of [`SQE_SIZE`], the value for CC.IOSQES.
pub const SQE_SIZE_LOG2: u8 = 6;
const _: () = assert!(1 << SQE_SIZE_LOG2 == SQE_SIZE);

/// Command Dword 0 (NVMe Base 2.0, Figure 88 "Command Dword 0").
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Cdw0 {
    /// Opcode (an [`AdminOpcode`] or [`NvmOpcode`] value).
    pub opcode: u8,
    /// Fused Operation (00b: normal).
    #[bits(2)]
    pub fuse: u8,
    #[bits(4)]
    __: u8,
    /// PRP or SGL for Data Transfer (00b: PRPs).
    #[bits(2)]
    pub psdt: u8,
    /// Command Identifier.
    pub cid: u16,
}

/// Admin command opcodes (NVMe Base 2.0, Figure 138). Open enum: unknown values stay
/// representable.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct AdminOpcode(pub u8);

impl AdminOpcode {
    /// Delete I/O Submission Queue.
    pub const DELETE_IO_SQ: Self = Self(0x00);
    /// Create I/O Submission Queue.
    pub const CREATE_IO_SQ: Self = Self(0x01);
    /// Get Log Page.
    pub const GET_LOG_PAGE: Self = Self(0x02);
    /// Delete I/O Completion Queue.
    pub const DELETE_IO_CQ: Self = Self(0x04);
    /// Create I/O Completion Queue.
    pub const CREATE_IO_CQ: Self = Self(0x05);
    /// Identify.
    pub const IDENTIFY: Self = Self(0x06);
    /// Abort.
    pub const ABORT: Self = Self(0x08);
    /// Set Features.
    pub const SET_FEATURES: Self = Self(0x09);
    /// Get Features.
    pub const GET_FEATURES: Self = Self(0x0a);
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT_REQUEST: Self = Self(0x0c);
    /// Keep Alive.
    pub const KEEP_ALIVE: Self = Self(0x18);
    /// Format NVM.
    pub const FORMAT_NVM: Self = Self(0x80);

    /// The spec's name for this opcode, if it is one the crate knows.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::DELETE_IO_SQ => "Delete I/O Submission Queue",
            Self::CREATE_IO_SQ => "Create I/O Submission Queue",
            Self::GET_LOG_PAGE => "Get Log Page",
            Self::DELETE_IO_CQ => "Delete I/O Completion Queue",
            Self::CREATE_IO_CQ => "Create I/O Completion Queue",
            Self::IDENTIFY => "Identify",
            Self::ABORT => "Abort",
            Self::SET_FEATURES => "Set Features",
            Self::GET_FEATURES => "Get Features",
            Self::ASYNC_EVENT_REQUEST => "Asynchronous Event Request",
            Self::KEEP_ALIVE => "Keep Alive",
            Self::FORMAT_NVM => "Format NVM",
            _ => return None,
        })
    }
}

/// NVM command set I/O opcodes (NVM Command Set 1.0, Figure 18). Open enum.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct NvmOpcode(pub u8);

impl NvmOpcode {
    /// Flush.
    pub const FLUSH: Self = Self(0x00);
    /// Write.
    pub const WRITE: Self = Self(0x01);
    /// Read.
    pub const READ: Self = Self(0x02);
    /// Write Uncorrectable.
    pub const WRITE_UNCORRECTABLE: Self = Self(0x04);
    /// Compare.
    pub const COMPARE: Self = Self(0x05);
    /// Write Zeroes.
    pub const WRITE_ZEROES: Self = Self(0x08);
    /// Dataset Management.
    pub const DATASET_MANAGEMENT: Self = Self(0x09);

    /// The spec's name for this opcode, if it is one the crate knows.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::FLUSH => "Flush",
            Self::WRITE => "Write",
            Self::READ => "Read",
            Self::WRITE_UNCORRECTABLE => "Write Uncorrectable",
            Self::COMPARE => "Compare",
            Self::WRITE_ZEROES => "Write Zeroes",
            Self::DATASET_MANAGEMENT => "Dataset Management",
            _ => return None,
        })
    }
}

/// Controller or Namespace Structure value of Identify (NVMe Base 2.0, Figure 273). Open enum.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Cns(pub u8);

impl Cns {
    /// Identify Namespace data structure for the NSID.
    pub const NAMESPACE: Self = Self(0x00);
    /// Identify Controller data structure.
    pub const CONTROLLER: Self = Self(0x01);
    /// Active Namespace ID list (NSIDs greater than the NSID in the command).
    pub const ACTIVE_NAMESPACES: Self = Self(0x02);
    /// Namespace Identification Descriptor list.
    pub const NAMESPACE_DESCRIPTORS: Self = Self(0x03);
}

/// Identify, Command Dword 10 (NVMe Base 2.0, section 5.17).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct IdentifyCdw10 {
    /// Controller or Namespace Structure (a [`Cns`] value).
    pub cns: u8,
    __: u8,
    /// Controller Identifier.
    pub cntid: u16,
}

/// Identify, Command Dword 11 (NVMe Base 2.0, section 5.17).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct IdentifyCdw11 {
    /// CNS Specific Identifier.
    pub cnssid: u16,
    __: u8,
    /// Command Set Identifier.
    pub csi: u8,
}

/// Create I/O Completion Queue and Create I/O Submission Queue, Command Dword 10
/// (NVMe Base 2.0, sections 5.4 and 5.5); Delete I/O queue commands use only `qid`.
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CreateQueueCdw10 {
    /// Queue Identifier.
    pub qid: u16,
    /// Queue Size, zero-based.
    pub qsize_z: u16,
}

/// Create I/O Completion Queue, Command Dword 11 (NVMe Base 2.0, section 5.4).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CreateCqCdw11 {
    /// Physically Contiguous.
    pub pc: bool,
    /// Interrupts Enabled.
    pub ien: bool,
    #[bits(14)]
    __: u16,
    /// Interrupt Vector.
    pub iv: u16,
}

/// Create I/O Submission Queue, Command Dword 11 (NVMe Base 2.0, section 5.5).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CreateSqCdw11 {
    /// Physically Contiguous.
    pub pc: bool,
    /// Queue Priority (for weighted round robin).
    #[bits(2)]
    pub qprio: u8,
    #[bits(13)]
    __: u16,
    /// Completion Queue Identifier this submission queue posts to.
    pub cqid: u16,
}

/// Delete I/O Submission Queue / Delete I/O Completion Queue, Command Dword 10
/// (NVMe Base 2.0, sections 5.6 and 5.7).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DeleteQueueCdw10 {
    /// Queue Identifier.
    pub qid: u16,
    __: u16,
}

/// Log page identifiers (NVMe Base 2.0, Figure 202). Open enum.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct LogPageId(pub u8);

impl LogPageId {
    /// Supported Log Pages.
    pub const SUPPORTED_LOG_PAGES: Self = Self(0x00);
    /// Error Information.
    pub const ERROR_INFORMATION: Self = Self(0x01);
    /// SMART / Health Information.
    pub const SMART_HEALTH: Self = Self(0x02);
    /// Firmware Slot Information.
    pub const FIRMWARE_SLOT: Self = Self(0x03);
    /// Changed Namespace List.
    pub const CHANGED_NAMESPACES: Self = Self(0x04);
    /// Commands Supported and Effects.
    pub const COMMANDS_SUPPORTED_AND_EFFECTS: Self = Self(0x05);
}

/// Get Log Page, Command Dword 10 (NVMe Base 2.0, section 5.16).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct GetLogPageCdw10 {
    /// Log Page Identifier (a [`LogPageId`] value).
    pub lid: u8,
    /// Log Specific Field.
    #[bits(7)]
    pub lsp: u8,
    /// Retain Asynchronous Event.
    pub rae: bool,
    /// Number of Dwords Lower (zero-based, low 16 bits of NUMD).
    pub numdl_z: u16,
}

/// Get Log Page, Command Dword 11 (NVMe Base 2.0, section 5.16).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct GetLogPageCdw11 {
    /// Number of Dwords Upper (high 16 bits of the zero-based NUMD).
    pub numdu: u16,
    /// Log Specific Identifier.
    pub lsi: u16,
}

/// Get Log Page, Command Dword 14 (NVMe Base 2.0, section 5.16).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct GetLogPageCdw14 {
    /// UUID Index.
    #[bits(7)]
    pub uuid_index: u8,
    #[bits(16)]
    __: u16,
    /// Offset Type (0: byte offset in CDW12/13, 1: index offset).
    pub ot: bool,
    /// Command Set Identifier.
    pub csi: u8,
}

/// Feature identifiers (NVMe Base 2.0, Figure 317). Open enum.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FeatureId(pub u8);

impl FeatureId {
    /// Arbitration.
    pub const ARBITRATION: Self = Self(0x01);
    /// Power Management.
    pub const POWER_MANAGEMENT: Self = Self(0x02);
    /// Temperature Threshold.
    pub const TEMPERATURE_THRESHOLD: Self = Self(0x04);
    /// Volatile Write Cache.
    pub const VOLATILE_WRITE_CACHE: Self = Self(0x06);
    /// Number of Queues.
    pub const NUMBER_OF_QUEUES: Self = Self(0x07);
    /// Interrupt Coalescing.
    pub const INTERRUPT_COALESCING: Self = Self(0x08);
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: Self = Self(0x0b);
}

/// Set Features / Get Features, Command Dword 10 (NVMe Base 2.0, sections 5.27 and 5.15).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FeaturesCdw10 {
    /// Feature Identifier (a [`FeatureId`] value).
    pub fid: u8,
    /// Select (Get Features only: 000b current, 001b default, 010b saved, 011b capabilities).
    #[bits(3)]
    pub sel: u8,
    #[bits(20)]
    __: u32,
    /// Save (Set Features only).
    pub sv: bool,
}

/// Number of Queues feature: Set Features Command Dword 11, and Dword 0 of its completion
/// (NVMe Base 2.0, section 5.27.1.5). In the completion, the counts are those allocated.
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct NumberOfQueues {
    /// Number of I/O Submission Queues Requested (or Allocated), zero-based.
    pub nsq_z: u16,
    /// Number of I/O Completion Queues Requested (or Allocated), zero-based.
    pub ncq_z: u16,
}

/// Volatile Write Cache feature, Command Dword 11 (NVMe Base 2.0, section 5.27.1.4).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VolatileWriteCache {
    /// Volatile Write Cache Enable.
    pub wce: bool,
    #[bits(31)]
    __: u32,
}

/// The Protection Information field (PRINFO) of Read, Write and Write Zeroes (CDW12 bits
/// 29:26; NVM Command Set 1.0, Figure 33).
pub mod prinfo {
    /// Bit position of PRINFO in CDW12.
    pub const SHIFT: u32 = 26;
    /// Protection Information Action: the controller inserts (writes) and strips (reads) the
    /// protection information; the host moves data only.
    pub const PRACT: u8 = 0b1000;
    /// Check the guard.
    pub const PRCHK_GUARD: u8 = 0b0100;
    /// Check the application tag.
    pub const PRCHK_APP: u8 = 0b0010;
    /// Check the reference tag (initial value in CDW14).
    pub const PRCHK_REF: u8 = 0b0001;
}

/// Read / Write, Command Dword 12 (NVM Command Set 1.0, sections 3.2.4 and 3.2.6). Command
/// Dwords 10 and 11 hold the 64-bit Starting LBA (low dword in CDW10).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ReadWriteCdw12 {
    /// Number of Logical Blocks, zero-based.
    pub nlb_z: u16,
    #[bits(4)]
    __: u8,
    /// Directive Type (Write only).
    #[bits(4)]
    pub dtype: u8,
    /// Storage Tag Check.
    pub stc: bool,
    __: bool,
    /// Protection Information field.
    #[bits(4)]
    pub prinfo: u8,
    /// Force Unit Access.
    pub fua: bool,
    /// Limited Retry.
    pub lr: bool,
}

/// Read / Write, Command Dword 13 (NVM Command Set 1.0).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ReadWriteCdw13 {
    /// Dataset Management attributes.
    pub dsm: u8,
    __: u8,
    /// Directive Specific (Write only).
    pub dspec: u16,
}

/// Write Zeroes, Command Dword 12 (NVM Command Set 1.0, section 3.2.8). CDW10/11 hold the SLBA.
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct WriteZeroesCdw12 {
    /// Number of Logical Blocks, zero-based.
    pub nlb_z: u16,
    __: u8,
    /// Storage Tag Check.
    pub stc: bool,
    /// Deallocate: the controller may deallocate the blocks instead of writing zeroes.
    pub deac: bool,
    /// Protection Information field.
    #[bits(4)]
    pub prinfo: u8,
    /// Force Unit Access.
    pub fua: bool,
    /// Limited Retry.
    pub lr: bool,
}

/// Dataset Management, Command Dword 10 (NVM Command Set 1.0, section 3.2.3).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DsmCdw10 {
    /// Number of Ranges, zero-based (1 to 256 ranges).
    pub nr_z: u8,
    #[bits(24)]
    __: u32,
}

/// Dataset Management, Command Dword 11 (NVM Command Set 1.0, section 3.2.3).
#[bitfield(u32)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DsmCdw11 {
    /// Attribute – Integral Dataset for Read.
    pub idr: bool,
    /// Attribute – Integral Dataset for Write.
    pub idw: bool,
    /// Attribute – Deallocate.
    pub ad: bool,
    #[bits(29)]
    __: u32,
}

/// One Dataset Management range (NVM Command Set 1.0, Figure 39). `nlb` is a count, not
/// zero-based.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DsmRange {
    /// Context Attributes.
    pub context_attributes: u32,
    /// Length in logical blocks.
    pub nlb: u32,
    /// Starting LBA.
    pub slba: u64,
}
const _: () = assert!(size_of::<DsmRange>() == 16);

/// Most ranges one Dataset Management command carries.
pub const DSM_MAX_RANGES: usize = 256;

impl Command {
    /// A zeroed command with the given opcode byte, command id and namespace.
    pub const fn new(opcode: u8, cid: u16, nsid: u32) -> Self {
        Self {
            cdw0: Cdw0::new().with_opcode(opcode).with_cid(cid),
            nsid,
            cdw2: 0,
            cdw3: 0,
            mptr: 0,
            prp1: 0,
            prp2: 0,
            cdw10: 0,
            cdw11: 0,
            cdw12: 0,
            cdw13: 0,
            cdw14: 0,
            cdw15: 0,
        }
    }

    /// The 64-bit Starting LBA held in CDW10 (low) and CDW11 (high) by Read, Write and Write
    /// Zeroes.
    pub const fn slba(&self) -> u64 {
        self.cdw10 as u64 | ((self.cdw11 as u64) << 32)
    }

    /// Sets the Starting LBA in CDW10/CDW11.
    pub const fn set_slba(&mut self, slba: u64) {
        self.cdw10 = slba as u32;
        self.cdw11 = (slba >> 32) as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;

    #[test]
    fn command_layout() {
        assert_eq!(offset_of!(Command, nsid), 4);
        assert_eq!(offset_of!(Command, mptr), 16);
        assert_eq!(offset_of!(Command, prp1), 24);
        assert_eq!(offset_of!(Command, prp2), 32);
        assert_eq!(offset_of!(Command, cdw10), 40);
        assert_eq!(offset_of!(Command, cdw15), 60);
    }

    #[test]
    fn cdw0_bytes() {
        let mut cmd = Command::new(NvmOpcode::READ.0, 0xabcd, 1);
        cmd.prp1 = 0x1122_3344_5566_7000;
        cmd.set_slba(0x1_0000_0002);
        let bytes = cmd.as_bytes();
        assert_eq!(&bytes[0..4], &[0x02, 0x00, 0xcd, 0xab]);
        assert_eq!(&bytes[4..8], &[1, 0, 0, 0]);
        assert_eq!(&bytes[24..32], &0x1122_3344_5566_7000u64.to_le_bytes());
        assert_eq!(&bytes[40..48], &[2, 0, 0, 0, 1, 0, 0, 0]);
        let back = Command::read_from_bytes(bytes).unwrap();
        assert_eq!(back.cdw0.cid(), 0xabcd);
        assert_eq!(back.slba(), 0x1_0000_0002);
        let psdt = Cdw0::from(0x0000_4001);
        assert_eq!((psdt.opcode(), psdt.psdt(), psdt.fuse()), (1, 1, 0));
    }

    #[test]
    fn admin_dwords() {
        let c = CreateQueueCdw10::new().with_qid(1).with_qsize_z(1023);
        assert_eq!(u32::from(c), 0x03ff_0001);
        let cq = CreateCqCdw11::new()
            .with_pc(true)
            .with_ien(false)
            .with_iv(3);
        assert_eq!(u32::from(cq), 0x0003_0001);
        let sq = CreateSqCdw11::new()
            .with_pc(true)
            .with_qprio(2)
            .with_cqid(5);
        assert_eq!(u32::from(sq), 0x0005_0005);
        let id = IdentifyCdw10::new()
            .with_cns(Cns::ACTIVE_NAMESPACES.0)
            .with_cntid(7);
        assert_eq!(u32::from(id), 0x0007_0002);
        // Get Log Page for 512 bytes (128 dwords) of SMART, RAE set.
        let glp = GetLogPageCdw10::new()
            .with_lid(LogPageId::SMART_HEALTH.0)
            .with_rae(true)
            .with_numdl_z(127);
        assert_eq!(u32::from(glp), 0x007f_8002);
        let f = FeaturesCdw10::new()
            .with_fid(FeatureId::NUMBER_OF_QUEUES.0)
            .with_sv(true);
        assert_eq!(u32::from(f), 0x8000_0007);
        let nq = NumberOfQueues::from(0x0003_0007);
        assert_eq!((nq.nsq_z(), nq.ncq_z()), (7, 3));
        assert_eq!(u32::from(DeleteQueueCdw10::new().with_qid(9)), 9);
    }

    #[test]
    fn io_dwords() {
        let rw = ReadWriteCdw12::new().with_nlb_z(7).with_fua(true);
        assert_eq!(u32::from(rw), 0x4000_0007);
        assert!(ReadWriteCdw12::from(0x8000_0000).lr());
        assert_eq!(ReadWriteCdw12::from(0x3c00_0000).prinfo(), 0xf);
        let wz = WriteZeroesCdw12::new().with_nlb_z(0xffff).with_deac(true);
        assert_eq!(u32::from(wz), 0x0200_ffff);
        assert_eq!(u32::from(DsmCdw10::new().with_nr_z(255)), 255);
        assert_eq!(u32::from(DsmCdw11::new().with_ad(true)), 4);
        let range = DsmRange {
            context_attributes: 0,
            nlb: 8,
            slba: 0x10,
        };
        assert_eq!(
            range.as_bytes(),
            &[0, 0, 0, 0, 8, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn opcode_names() {
        assert_eq!(AdminOpcode::IDENTIFY.name(), Some("Identify"));
        assert_eq!(AdminOpcode(0x7f).name(), None);
        assert_eq!(NvmOpcode::WRITE_ZEROES.name(), Some("Write Zeroes"));
        assert_eq!(NvmOpcode::DATASET_MANAGEMENT.0, 0x09);
    }
}
