//! Identify data structures (NVMe Base 2.0, section 5.17.2; NVM Command Set 1.0, section 4.1.5).

use bitflags::bitflags;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Size of every Identify data structure.
pub const IDENTIFY_DATA_SIZE: usize = 4096;

/// Identify Controller data structure, CNS 01h (NVMe Base 2.0, Figure 275).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct IdentifyController {
    /// PCI Vendor ID.
    pub vid: u16,
    /// PCI Subsystem Vendor ID.
    pub ssvid: u16,
    /// Serial Number (ASCII, space padded).
    pub sn: [u8; 20],
    /// Model Number (ASCII, space padded).
    pub mn: [u8; 40],
    /// Firmware Revision (ASCII, space padded).
    pub fr: [u8; 8],
    /// Recommended Arbitration Burst.
    pub rab: u8,
    /// IEEE OUI Identifier.
    pub ieee: [u8; 3],
    /// Controller Multi-Path I/O and Namespace Sharing Capabilities.
    pub cmic: u8,
    /// Maximum Data Transfer Size: `2 ^ mdts` units of CAP.MPSMIN; 0 means no limit.
    pub mdts: u8,
    /// Controller ID.
    pub cntlid: u16,
    /// Version (same layout as the VS register).
    pub ver: u32,
    /// RTD3 Resume Latency, microseconds.
    pub rtd3r: u32,
    /// RTD3 Entry Latency, microseconds: expected time to complete a normal shutdown.
    pub rtd3e: u32,
    /// Optional Asynchronous Events Supported.
    pub oaes: u32,
    /// Controller Attributes.
    pub ctratt: u32,
    /// Read Recovery Levels Supported.
    pub rrls: u16,
    /// Reserved.
    pub rsvd102: [u8; 9],
    /// Controller Type.
    pub cntrltype: u8,
    /// FRU Globally Unique Identifier.
    pub fguid: [u8; 16],
    /// Command Retry Delay Time 1, 2 and 3, in 100 ms units.
    pub crdt: [u16; 3],
    /// Reserved.
    pub rsvd134: [u8; 119],
    /// NVM Subsystem Report.
    pub nvmsr: u8,
    /// VPD Write Cycle Information.
    pub vwci: u8,
    /// Management Endpoint Capabilities.
    pub mec: u8,
    /// Optional Admin Command Support.
    pub oacs: u16,
    /// Abort Command Limit, zero-based.
    pub acl: u8,
    /// Asynchronous Event Request Limit, zero-based.
    pub aerl: u8,
    /// Firmware Updates.
    pub frmw: u8,
    /// Log Page Attributes.
    pub lpa: u8,
    /// Error Log Page Entries, zero-based.
    pub elpe: u8,
    /// Number of Power States Support, zero-based.
    pub npss: u8,
    /// Admin Vendor Specific Command Configuration.
    pub avscc: u8,
    /// Autonomous Power State Transition Attributes.
    pub apsta: u8,
    /// Warning Composite Temperature Threshold, kelvin.
    pub wctemp: u16,
    /// Critical Composite Temperature Threshold, kelvin.
    pub cctemp: u16,
    /// Maximum Time for Firmware Activation, 100 ms units.
    pub mtfa: u16,
    /// Host Memory Buffer Preferred Size, 4 KiB units.
    pub hmpre: u32,
    /// Host Memory Buffer Minimum Size, 4 KiB units.
    pub hmmin: u32,
    /// Total NVM Capacity, bytes (128-bit little endian).
    pub tnvmcap: [u8; 16],
    /// Unallocated NVM Capacity, bytes (128-bit little endian).
    pub unvmcap: [u8; 16],
    /// Replay Protected Memory Block Support.
    pub rpmbs: u32,
    /// Extended Device Self-test Time, minutes.
    pub edstt: u16,
    /// Device Self-test Options.
    pub dsto: u8,
    /// Firmware Update Granularity, 4 KiB units.
    pub fwug: u8,
    /// Keep Alive Support, 100 ms units.
    pub kas: u16,
    /// Host Controlled Thermal Management Attributes.
    pub hctma: u16,
    /// Minimum Thermal Management Temperature.
    pub mntmt: u16,
    /// Maximum Thermal Management Temperature.
    pub mxtmt: u16,
    /// Sanitize Capabilities.
    pub sanicap: u32,
    /// Host Memory Buffer Minimum Descriptor Entry Size.
    pub hmminds: u32,
    /// Host Memory Maximum Descriptors Entries.
    pub hmmaxd: u16,
    /// NVM Set Identifier Maximum.
    pub nsetidmax: u16,
    /// Endurance Group Identifier Maximum.
    pub endgidmax: u16,
    /// ANA Transition Time.
    pub anatt: u8,
    /// Asymmetric Namespace Access Capabilities.
    pub anacap: u8,
    /// ANA Group Identifier Maximum.
    pub anagrpmax: u32,
    /// Number of ANA Group Identifiers.
    pub nanagrpid: u32,
    /// Persistent Event Log Size, 64 KiB units.
    pub pels: u32,
    /// Domain Identifier.
    pub domainid: u16,
    /// Reserved.
    pub rsvd358: [u8; 10],
    /// Max Endurance Group Capacity (128-bit little endian).
    pub megcap: [u8; 16],
    /// Reserved.
    pub rsvd384: [u8; 128],
    /// Submission Queue Entry Size: bits 3:0 required, 7:4 maximum (log2 bytes).
    pub sqes: u8,
    /// Completion Queue Entry Size: bits 3:0 required, 7:4 maximum (log2 bytes).
    pub cqes: u8,
    /// Maximum Outstanding Commands.
    pub maxcmd: u16,
    /// Number of Namespaces (largest valid NSID).
    pub nn: u32,
    /// Optional NVM Command Support (see [`Oncs`]).
    pub oncs: u16,
    /// Fused Operation Support.
    pub fuses: u16,
    /// Format NVM Attributes.
    pub fna: u8,
    /// Volatile Write Cache: bit 0 set when one is present.
    pub vwc: u8,
    /// Atomic Write Unit Normal, logical blocks, zero-based.
    pub awun: u16,
    /// Atomic Write Unit Power Fail, logical blocks, zero-based.
    pub awupf: u16,
    /// I/O Command Set Vendor Specific Command Configuration (NVSCC).
    pub nvscc: u8,
    /// Namespace Write Protection Capabilities.
    pub nwpc: u8,
    /// Atomic Compare & Write Unit, zero-based.
    pub acwu: u16,
    /// Copy Descriptor Formats Supported.
    pub ocfs: u16,
    /// SGL Support.
    pub sgls: u32,
    /// Maximum Number of Allowed Namespaces.
    pub mnan: u32,
    /// Maximum Domain Namespace Attachments (128-bit little endian).
    pub maxdna: [u8; 16],
    /// Maximum I/O Controller Namespace Attachments.
    pub maxcna: u32,
    /// Reserved.
    pub rsvd564: [u8; 204],
    /// NVM Subsystem NVMe Qualified Name (UTF-8, NUL padded).
    pub subnqn: [u8; 256],
    /// Reserved.
    pub rsvd1024: [u8; 768],
    /// NVMe over Fabrics attributes.
    pub nvmeof: [u8; 256],
    /// Power State Descriptors 0..31.
    pub psd: [PowerStateDescriptor; 32],
    /// Vendor Specific.
    pub vs: [u8; 1024],
}
const _: () = assert!(size_of::<IdentifyController>() == IDENTIFY_DATA_SIZE);

impl IdentifyController {
    /// Whether a volatile write cache is present (VWC bit 0).
    pub const fn has_volatile_write_cache(&self) -> bool {
        self.vwc & 1 != 0
    }

    /// ONCS as flags.
    pub const fn oncs_flags(&self) -> Oncs {
        Oncs::from_bits_retain(self.oncs)
    }
}

bitflags! {
    /// Optional NVM Command Support (Identify Controller ONCS, bytes 521:520).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Oncs: u16 {
        /// Compare.
        const COMPARE = 1 << 0;
        /// Write Uncorrectable.
        const WRITE_UNCORRECTABLE = 1 << 1;
        /// Dataset Management.
        const DATASET_MANAGEMENT = 1 << 2;
        /// Write Zeroes.
        const WRITE_ZEROES = 1 << 3;
        /// Save field in Set Features / Select field in Get Features.
        const SAVE_SELECT = 1 << 4;
        /// Reservations.
        const RESERVATIONS = 1 << 5;
        /// Timestamp feature.
        const TIMESTAMP = 1 << 6;
        /// Verify.
        const VERIFY = 1 << 7;
        /// Copy.
        const COPY = 1 << 8;
    }
}

/// Power State Descriptor, 32 bytes (NVMe Base 2.0, Figure 276).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PowerStateDescriptor {
    /// Maximum Power.
    pub mp: u16,
    /// Reserved.
    pub rsvd2: u8,
    /// Bit 0 Max Power Scale, bit 1 Non-Operational State.
    pub flags: u8,
    /// Entry Latency, microseconds.
    pub enlat: u32,
    /// Exit Latency, microseconds.
    pub exlat: u32,
    /// Relative Read Throughput.
    pub rrt: u8,
    /// Relative Read Latency.
    pub rrl: u8,
    /// Relative Write Throughput.
    pub rwt: u8,
    /// Relative Write Latency.
    pub rwl: u8,
    /// Idle Power.
    pub idlp: u16,
    /// Idle Power Scale (bits 7:6).
    pub ips: u8,
    /// Reserved.
    pub rsvd19: u8,
    /// Active Power.
    pub actp: u16,
    /// Active Power Workload (bits 2:0) and Active Power Scale (bits 7:6).
    pub apw_aps: u8,
    /// Reserved.
    pub rsvd23: [u8; 9],
}
const _: () = assert!(size_of::<PowerStateDescriptor>() == 32);

/// LBA Format data structure (NVM Command Set 1.0, Figure 98).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct LbaFormat {
    /// Metadata Size, bytes per logical block.
    pub ms: u16,
    /// LBA Data Size: `2 ^ lbads` bytes (at least 9 when the format is valid).
    pub lbads: u8,
    /// Relative Performance (bits 1:0).
    pub rp: u8,
}
const _: () = assert!(size_of::<LbaFormat>() == 4);

/// Identify Namespace data structure for the NVM command set, CNS 00h (NVM Command Set 1.0,
/// Figure 97).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct IdentifyNamespace {
    /// Namespace Size, logical blocks.
    pub nsze: u64,
    /// Namespace Capacity, logical blocks.
    pub ncap: u64,
    /// Namespace Utilization, logical blocks.
    pub nuse: u64,
    /// Namespace Features.
    pub nsfeat: u8,
    /// Number of LBA Formats, zero-based.
    pub nlbaf: u8,
    /// Formatted LBA Size: bits 3:0 low index, bit 4 metadata at end of LBA, bits 6:5 high index.
    pub flbas: u8,
    /// Metadata Capabilities.
    pub mc: u8,
    /// End-to-end Data Protection Capabilities.
    pub dpc: u8,
    /// End-to-end Data Protection Type Settings.
    pub dps: u8,
    /// Namespace Multi-path I/O and Namespace Sharing Capabilities.
    pub nmic: u8,
    /// Reservation Capabilities.
    pub rescap: u8,
    /// Format Progress Indicator.
    pub fpi: u8,
    /// Deallocate Logical Block Features.
    pub dlfeat: u8,
    /// Namespace Atomic Write Unit Normal.
    pub nawun: u16,
    /// Namespace Atomic Write Unit Power Fail.
    pub nawupf: u16,
    /// Namespace Atomic Compare & Write Unit.
    pub nacwu: u16,
    /// Namespace Atomic Boundary Size Normal.
    pub nabsn: u16,
    /// Namespace Atomic Boundary Offset.
    pub nabo: u16,
    /// Namespace Atomic Boundary Size Power Fail.
    pub nabspf: u16,
    /// Namespace Optimal I/O Boundary.
    pub noiob: u16,
    /// NVM Capacity, bytes (128-bit little endian).
    pub nvmcap: [u8; 16],
    /// Namespace Preferred Write Granularity.
    pub npwg: u16,
    /// Namespace Preferred Write Alignment.
    pub npwa: u16,
    /// Namespace Preferred Deallocate Granularity.
    pub npdg: u16,
    /// Namespace Preferred Deallocate Alignment.
    pub npda: u16,
    /// Namespace Optimal Write Size.
    pub nows: u16,
    /// Maximum Single Source Range Length.
    pub mssrl: u16,
    /// Maximum Copy Length.
    pub mcl: u32,
    /// Maximum Source Range Count.
    pub msrc: u8,
    /// Reserved.
    pub rsvd81: [u8; 11],
    /// ANA Group Identifier.
    pub anagrpid: u32,
    /// Reserved.
    pub rsvd96: [u8; 3],
    /// Namespace Attributes.
    pub nsattr: u8,
    /// NVM Set Identifier.
    pub nvmsetid: u16,
    /// Endurance Group Identifier.
    pub endgid: u16,
    /// Namespace Globally Unique Identifier.
    pub nguid: [u8; 16],
    /// IEEE Extended Unique Identifier.
    pub eui64: [u8; 8],
    /// LBA Format 0..63 Support.
    pub lbaf: [LbaFormat; 64],
    /// Reserved.
    pub rsvd384: [u8; 3456],
    /// Vendor Specific.
    pub vs: [u8; 256],
}
const _: () = assert!(size_of::<IdentifyNamespace>() == IDENTIFY_DATA_SIZE);

impl IdentifyNamespace {
    /// Index of the LBA format in use (FLBAS bits 3:0, plus bits 6:5 as the high bits when
    /// more than 16 formats exist).
    pub const fn flbas_index(&self) -> usize {
        let low = (self.flbas & 0x0f) as usize;
        if self.nlbaf >= 16 {
            low | (((self.flbas >> 5) & 0x3) as usize) << 4
        } else {
            low
        }
    }

    /// End-to-end protection as formatted (DPS), `None` when protection is off.
    pub const fn protection(&self) -> Option<Protection> {
        match self.dps & 0x7 {
            0 => None,
            t => Some(Protection {
                pi_type: t,
                first_bytes: self.dps & 0x8 != 0,
            }),
        }
    }

    /// The LBA format in use.
    pub const fn current_lba_format(&self) -> LbaFormat {
        self.lbaf[self.flbas_index()]
    }

    /// Whether metadata is transferred at the end of the data LBA (FLBAS bit 4).
    pub const fn metadata_extended(&self) -> bool {
        self.flbas & 0x10 != 0
    }
}

/// Active Namespace ID list, CNS 02h: up to 1024 NSIDs in increasing order, zero terminated
/// (NVMe Base 2.0, section 5.17.2.2).
#[repr(C)]
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ActiveNamespaceList {
    /// The NSIDs; the first zero ends the list.
    pub nsids: [u32; 1024],
}
const _: () = assert!(size_of::<ActiveNamespaceList>() == IDENTIFY_DATA_SIZE);

impl ActiveNamespaceList {
    /// The NSIDs before the first zero.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.nsids.iter().copied().take_while(|&n| n != 0)
    }
}

/// Trims an ASCII identify string (SN, MN, FR): stops at the first NUL and drops trailing
/// spaces. Non-ASCII bytes are left for the caller to deal with.
pub fn trim_identify_string(bytes: &[u8]) -> &[u8] {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let mut s = &bytes[..end];
    while let [rest @ .., b' '] = s {
        s = rest;
    }
    while let [b' ', rest @ ..] = s {
        s = rest;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;
    use zerocopy::FromZeros;

    #[test]
    fn controller_offsets() {
        type C = IdentifyController;
        assert_eq!(offset_of!(C, sn), 4);
        assert_eq!(offset_of!(C, mn), 24);
        assert_eq!(offset_of!(C, fr), 64);
        assert_eq!(offset_of!(C, rab), 72);
        assert_eq!(offset_of!(C, ieee), 73);
        assert_eq!(offset_of!(C, cmic), 76);
        assert_eq!(offset_of!(C, mdts), 77);
        assert_eq!(offset_of!(C, cntlid), 78);
        assert_eq!(offset_of!(C, ver), 80);
        assert_eq!(offset_of!(C, rtd3e), 88);
        assert_eq!(offset_of!(C, ctratt), 96);
        assert_eq!(offset_of!(C, cntrltype), 111);
        assert_eq!(offset_of!(C, fguid), 112);
        assert_eq!(offset_of!(C, crdt), 128);
        assert_eq!(offset_of!(C, mec), 255);
        assert_eq!(offset_of!(C, oacs), 256);
        assert_eq!(offset_of!(C, npss), 263);
        assert_eq!(offset_of!(C, wctemp), 266);
        assert_eq!(offset_of!(C, hmpre), 272);
        assert_eq!(offset_of!(C, tnvmcap), 280);
        assert_eq!(offset_of!(C, rpmbs), 312);
        assert_eq!(offset_of!(C, kas), 320);
        assert_eq!(offset_of!(C, sanicap), 328);
        assert_eq!(offset_of!(C, anatt), 342);
        assert_eq!(offset_of!(C, pels), 352);
        assert_eq!(offset_of!(C, megcap), 368);
        assert_eq!(offset_of!(C, sqes), 512);
        assert_eq!(offset_of!(C, cqes), 513);
        assert_eq!(offset_of!(C, maxcmd), 514);
        assert_eq!(offset_of!(C, nn), 516);
        assert_eq!(offset_of!(C, oncs), 520);
        assert_eq!(offset_of!(C, fuses), 522);
        assert_eq!(offset_of!(C, fna), 524);
        assert_eq!(offset_of!(C, vwc), 525);
        assert_eq!(offset_of!(C, awun), 526);
        assert_eq!(offset_of!(C, awupf), 528);
        assert_eq!(offset_of!(C, nvscc), 530);
        assert_eq!(offset_of!(C, acwu), 532);
        assert_eq!(offset_of!(C, sgls), 536);
        assert_eq!(offset_of!(C, mnan), 540);
        assert_eq!(offset_of!(C, maxcna), 560);
        assert_eq!(offset_of!(C, subnqn), 768);
        assert_eq!(offset_of!(C, nvmeof), 1792);
        assert_eq!(offset_of!(C, psd), 2048);
        assert_eq!(offset_of!(C, vs), 3072);
    }

    #[test]
    fn namespace_offsets() {
        type N = IdentifyNamespace;
        assert_eq!(offset_of!(N, ncap), 8);
        assert_eq!(offset_of!(N, nuse), 16);
        assert_eq!(offset_of!(N, nsfeat), 24);
        assert_eq!(offset_of!(N, nlbaf), 25);
        assert_eq!(offset_of!(N, flbas), 26);
        assert_eq!(offset_of!(N, dlfeat), 33);
        assert_eq!(offset_of!(N, nawun), 34);
        assert_eq!(offset_of!(N, noiob), 46);
        assert_eq!(offset_of!(N, nvmcap), 48);
        assert_eq!(offset_of!(N, npwg), 64);
        assert_eq!(offset_of!(N, mcl), 76);
        assert_eq!(offset_of!(N, msrc), 80);
        assert_eq!(offset_of!(N, anagrpid), 92);
        assert_eq!(offset_of!(N, nsattr), 99);
        assert_eq!(offset_of!(N, nvmsetid), 100);
        assert_eq!(offset_of!(N, endgid), 102);
        assert_eq!(offset_of!(N, nguid), 104);
        assert_eq!(offset_of!(N, eui64), 120);
        assert_eq!(offset_of!(N, lbaf), 128);
        assert_eq!(offset_of!(N, vs), 3840);
    }

    #[test]
    fn decode_from_bytes() {
        let mut raw = [0u8; 4096];
        raw[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
        raw[4..24].copy_from_slice(b"deadbeef            ");
        raw[77] = 5;
        raw[80..84].copy_from_slice(&0x0001_0400u32.to_le_bytes());
        raw[516..520].copy_from_slice(&256u32.to_le_bytes());
        raw[520..522].copy_from_slice(&0x000cu16.to_le_bytes());
        raw[525] = 1;
        let c = IdentifyController::read_from_bytes(&raw[..]).unwrap();
        assert_eq!(c.vid, 0x1b36);
        assert_eq!(trim_identify_string(&c.sn), b"deadbeef");
        assert_eq!(c.mdts, 5);
        assert_eq!(c.ver, 0x0001_0400);
        assert_eq!(c.nn, 256);
        assert!(
            c.oncs_flags()
                .contains(Oncs::WRITE_ZEROES | Oncs::DATASET_MANAGEMENT)
        );
        assert!(!c.oncs_flags().contains(Oncs::COMPARE));
        assert!(c.has_volatile_write_cache());

        let mut raw = [0u8; 4096];
        raw[0..8].copy_from_slice(&131072u64.to_le_bytes());
        raw[25] = 1; // two formats
        raw[26] = 1; // using format 1
        raw[128..132].copy_from_slice(&[0, 0, 9, 0]); // 512 B
        raw[132..136].copy_from_slice(&[8, 0, 12, 1]); // 4096 B + 8 B metadata
        let n = IdentifyNamespace::read_from_bytes(&raw[..]).unwrap();
        assert_eq!(n.nsze, 131072);
        assert_eq!(n.flbas_index(), 1);
        assert_eq!(
            n.current_lba_format(),
            LbaFormat {
                ms: 8,
                lbads: 12,
                rp: 1
            }
        );
        assert!(!n.metadata_extended());
    }

    #[test]
    fn flbas_high_bits() {
        let mut n = IdentifyNamespace::new_zeroed();
        n.nlbaf = 20;
        n.flbas = 0x20 | 0x03; // index 0x13
        assert_eq!(n.flbas_index(), 0x13);
        n.nlbaf = 3;
        assert_eq!(n.flbas_index(), 3);
    }

    #[test]
    fn active_list_and_trim() {
        let mut l = ActiveNamespaceList::new_zeroed();
        l.nsids[0] = 1;
        l.nsids[1] = 4;
        l.nsids[3] = 9; // after the terminator: ignored
        let mut it = l.iter();
        assert_eq!((it.next(), it.next(), it.next()), (Some(1), Some(4), None));
        assert_eq!(
            trim_identify_string(b"  QEMU NVMe Ctrl   "),
            b"QEMU NVMe Ctrl"
        );
        assert_eq!(trim_identify_string(b"1.0\0\0\0\0\0"), b"1.0");
        assert_eq!(trim_identify_string(b"        "), b"");
    }
}

/// End-to-end data protection as a namespace is formatted (DPS, NVM Command Set 1.0 Figure 97).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protection {
    /// Protection Information type: 1, 2 or 3 (4-7 are reserved and reported as read).
    pub pi_type: u8,
    /// The PI sits in the first 8 bytes of the metadata (DPS bit 3), else the last 8.
    pub first_bytes: bool,
}

/// Command Set Identifier (NVMe Base 2.0, Figure 286): the I/O command set of a namespace, from
/// its Namespace Identification Descriptor of type 4 (Identify CNS 03h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Csi(pub u8);

impl Csi {
    /// NVM Command Set.
    pub const NVM: Self = Self(0);
    /// Key Value Command Set.
    pub const KEY_VALUE: Self = Self(1);
    /// Zoned Namespace Command Set.
    pub const ZONED: Self = Self(2);

    /// The command set's name; `None` for identifiers this crate does not know.
    pub const fn name(self) -> Option<&'static str> {
        match self.0 {
            0 => Some("NVM"),
            1 => Some("Key Value"),
            2 => Some("Zoned Namespace"),
            _ => None,
        }
    }
}

impl core::fmt::Display for Csi {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "command set {:#04x}", self.0),
        }
    }
}

/// Namespace Identification Descriptor type: Command Set Identifier.
pub const NIDT_CSI: u8 = 0x04;

/// The Command Set Identifier in a Namespace Identification Descriptor list (Identify CNS 03h,
/// a 4096-byte page), or `None` when the list has no CSI descriptor (controllers before NVMe
/// 2.0: the namespace is then an NVM one). Malformed lists end the walk; nothing panics.
pub fn descriptor_csi(page: &[u8]) -> Option<Csi> {
    let mut at = 0usize;
    while at + 4 <= page.len() {
        let (nidt, nidl) = (page[at], page[at + 1] as usize);
        if nidt == 0 {
            return None;
        }
        let body = page.get(at + 4..at + 4 + nidl)?;
        if nidt == NIDT_CSI {
            return body.first().map(|&c| Csi(c));
        }
        at += 4 + nidl;
    }
    None
}

#[cfg(test)]
mod namespace_kind_tests {
    use super::*;
    use zerocopy::FromZeros;

    #[test]
    fn protection_and_metadata_placement_decode() {
        let mut id = IdentifyNamespace::new_zeroed();
        assert_eq!(id.protection(), None);
        id.dps = 0b1001;
        id.flbas = 0x10;
        assert_eq!(
            id.protection(),
            Some(Protection {
                pi_type: 1,
                first_bytes: true
            })
        );
        assert!(id.metadata_extended());
        id.dps = 3;
        assert_eq!(
            id.protection().map(|p| (p.pi_type, p.first_bytes)),
            Some((3, false))
        );
    }

    #[test]
    fn csi_is_found_after_other_descriptors_and_malformed_lists_stop() {
        let mut page = [0u8; 4096];
        page[0] = 0x02;
        page[1] = 16;
        page[20] = NIDT_CSI;
        page[21] = 1;
        page[24] = 2;
        assert_eq!(descriptor_csi(&page), Some(Csi::ZONED));
        assert_eq!(descriptor_csi(&[0u8; 4096]), None);
        // A length running off the page ends the walk.
        let mut bad = [0u8; 64];
        bad[0] = 0x03;
        bad[1] = 200;
        assert_eq!(descriptor_csi(&bad), None);
        assert_eq!(Csi(9).name(), None);
    }
}
