//! NVMe over Fabrics commands (NVMe Base 2.0, section 6 "Fabrics Command Set"): Connect and
//! its 1024-byte data, Property Get and Set (how a fabric host reaches CAP, CC, CSTS), and the
//! Fabrics status codes. All use opcode 0x7F with the command type (FCTYPE) in byte 4.

use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

use crate::command::{Cdw0, Command};

/// The opcode of every Fabrics command.
pub const FABRICS_OPCODE: u8 = 0x7f;

/// A Fabrics command's type (FCTYPE, byte 4).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FabricsType(pub u8);

impl FabricsType {
    /// Property Set.
    pub const PROPERTY_SET: Self = Self(0x00);
    /// Connect.
    pub const CONNECT: Self = Self(0x01);
    /// Property Get.
    pub const PROPERTY_GET: Self = Self(0x04);
    /// Authentication Send.
    pub const AUTH_SEND: Self = Self(0x05);
    /// Authentication Receive.
    pub const AUTH_RECV: Self = Self(0x06);
    /// Disconnect (an I/O queue).
    pub const DISCONNECT: Self = Self(0x08);
}

/// The Fabrics status codes (status code type 1, Command Specific, on Fabrics commands).
pub mod status {
    /// The Connect's data format (RECFMT) is not supported.
    pub const INCOMPATIBLE_FORMAT: u8 = 0x80;
    /// The controller is busy.
    pub const CONTROLLER_BUSY: u8 = 0x81;
    /// A Connect parameter is invalid (a wrong SUBNQN, an I/O queue before CC.EN); DW0 says
    /// which.
    pub const INVALID_PARAMETERS: u8 = 0x82;
    /// The discovery information changed: start over.
    pub const RESTART_DISCOVERY: u8 = 0x83;
    /// The host is not allowed (HOSTNQN).
    pub const INVALID_HOST: u8 = 0x84;
    /// The queue type is not valid.
    pub const INVALID_QUEUE_TYPE: u8 = 0x85;
    /// The discovery log changed while it was read.
    pub const DISCOVERY_RESTART: u8 = 0x90;
    /// Authentication is required.
    pub const AUTH_REQUIRED: u8 = 0x91;

    /// The name of Fabrics status `sc` (Command Specific), if it is one.
    pub fn name(sc: u8) -> Option<&'static str> {
        Some(match sc {
            INCOMPATIBLE_FORMAT => "Incompatible Format",
            CONTROLLER_BUSY => "Controller Busy",
            INVALID_PARAMETERS => "Connect Invalid Parameters",
            RESTART_DISCOVERY => "Connect Restart Discovery",
            INVALID_HOST => "Connect Invalid Host",
            INVALID_QUEUE_TYPE => "Invalid Queue Type",
            DISCOVERY_RESTART => "Discover Restart",
            AUTH_REQUIRED => "Authentication Required",
            _ => return None,
        })
    }
}

/// The controller id a first Connect asks for: any (dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xffff;

/// The 1024-byte data of a Connect command (in-capsule).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ConnectData {
    /// The host's identifier (the same on every connection of one host).
    pub hostid: [u8; 16],
    /// The controller to join: [`CNTLID_DYNAMIC`] on the admin queue, the one its Connect
    /// returned on the I/O queues.
    pub cntlid: u16,
    _rsvd0: [u8; 238],
    /// NVM Subsystem NQN, NUL-padded.
    pub subnqn: [u8; 256],
    /// Host NQN, NUL-padded.
    pub hostnqn: [u8; 256],
    _rsvd1: [u8; 256],
}
const _: () = assert!(size_of::<ConnectData>() == 1024);

/// Why an NQN cannot go in a [`ConnectData`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NqnTooLong {
    /// Its length.
    pub len: usize,
}

impl ConnectData {
    /// The data for joining `cntlid` of subsystem `subnqn` as host `hostnqn` / `hostid`. NQNs
    /// are at most 223 bytes (the spec's limit; the field has room for a NUL after it).
    pub fn new(
        hostid: [u8; 16],
        cntlid: u16,
        subnqn: &str,
        hostnqn: &str,
    ) -> Result<Self, NqnTooLong> {
        fn field(s: &str) -> Result<[u8; 256], NqnTooLong> {
            if s.len() > 223 {
                return Err(NqnTooLong { len: s.len() });
            }
            let mut f = [0u8; 256];
            f[..s.len()].copy_from_slice(s.as_bytes());
            Ok(f)
        }
        Ok(Self {
            hostid,
            cntlid,
            _rsvd0: [0; 238],
            subnqn: field(subnqn)?,
            hostnqn: field(hostnqn)?,
            _rsvd1: [0; 256],
        })
    }
}

/// The well-known NQN of a discovery controller.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Log Page Identifier of the Discovery log page (NVMe over Fabrics 1.1, section 5.3).
pub const DISCOVERY_LOG_PAGE: u8 = 0x70;

/// The Discovery log page's header (1024 bytes; the entries follow, 1024 bytes each).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DiscoveryLogHeader {
    /// Generation Counter: changes whenever the log does.
    pub genctr: u64,
    /// Number of Records.
    pub numrec: u64,
    /// Record Format (0).
    pub recfmt: u16,
    _rsvd: [u8; 1006],
}
const _: () = assert!(size_of::<DiscoveryLogHeader>() == 1024);

/// One Discovery log page entry (1024 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DiscoveryLogEntry {
    /// Transport Type ([`TRTYPE_TCP`], RDMA 1, FC 2, loop 254).
    pub trtype: u8,
    /// Address Family (IPv4 1, IPv6 2).
    pub adrfam: u8,
    /// Subsystem Type ([`SUBTYPE_NVME`], discovery 1 or 3).
    pub subtype: u8,
    /// Transport Requirements.
    pub treq: u8,
    /// Port ID.
    pub portid: u16,
    /// Controller ID (0xFFFF: dynamic).
    pub cntlid: u16,
    /// Admin Max SQ Size.
    pub asqsz: u16,
    /// Entry Flags.
    pub eflags: u16,
    _rsvd0: [u8; 20],
    /// Transport Service Identifier (the TCP port, ASCII, space padded).
    pub trsvcid: [u8; 32],
    _rsvd1: [u8; 192],
    /// The subsystem's NQN (NUL padded).
    pub subnqn: [u8; 256],
    /// Transport Address (the IP address, ASCII, space padded).
    pub traddr: [u8; 256],
    /// Transport Specific Address Subtype.
    pub tsas: [u8; 256],
}
const _: () = assert!(size_of::<DiscoveryLogEntry>() == 1024);

/// [`DiscoveryLogEntry::trtype`] of NVMe/TCP.
pub const TRTYPE_TCP: u8 = 3;
/// [`DiscoveryLogEntry::subtype`] of an NVM subsystem (not a discovery controller).
pub const SUBTYPE_NVME: u8 = 2;

fn fabrics(fctype: FabricsType, cid: u16) -> Command {
    let mut c = Command::new_zeroed();
    // PSDT 01b: SGLs, as every command over a fabric.
    c.cdw0 = Cdw0::new()
        .with_opcode(FABRICS_OPCODE)
        .with_psdt(1)
        .with_cid(cid);
    c.nsid = u32::from(fctype.0);
    c
}

/// Connect for queue `qid` (0: the admin queue) of `sqsize_z` + 1 entries; `kato_ms` is the
/// Keep Alive Timeout asked for (admin queue only); `cattr` the Connect attributes (bit 2:
/// disable SQ flow control). Its data ([`ConnectData`]) goes in-capsule; SGL1 is the
/// transport's to fill.
pub fn connect(cid: u16, qid: u16, sqsize_z: u16, cattr: u8, kato_ms: u32) -> Command {
    let mut c = fabrics(FabricsType::CONNECT, cid);
    // Bytes 40-41 RECFMT 0, 42-43 QID, 44-45 SQSIZE, 46 CATTR, 48-51 KATO.
    c.cdw10 = u32::from(qid) << 16;
    c.cdw11 = u32::from(sqsize_z) | (u32::from(cattr) << 16);
    c.cdw12 = kato_ms;
    c
}

/// Property Get of the register at `offset` (CAP 0x0, VS 0x8, CC 0x14, CSTS 0x1C), 8 bytes
/// wide when `eight` (CAP), else 4. The value comes back in DW0 (and DW1).
pub fn property_get(cid: u16, offset: u32, eight: bool) -> Command {
    let mut c = fabrics(FabricsType::PROPERTY_GET, cid);
    c.cdw10 = u32::from(eight);
    c.cdw11 = offset;
    c
}

/// Property Set of the register at `offset` to `value` (4 bytes, or 8 when `eight`).
pub fn property_set(cid: u16, offset: u32, value: u64, eight: bool) -> Command {
    let mut c = fabrics(FabricsType::PROPERTY_SET, cid);
    c.cdw10 = u32::from(eight);
    c.cdw11 = offset;
    c.cdw12 = value as u32;
    c.cdw13 = (value >> 32) as u32;
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;

    #[test]
    fn discovery_log_fields_sit_at_the_specs_offsets() {
        assert_eq!(offset_of!(DiscoveryLogHeader, numrec), 8);
        assert_eq!(offset_of!(DiscoveryLogHeader, recfmt), 16);
        assert_eq!(offset_of!(DiscoveryLogEntry, portid), 4);
        assert_eq!(offset_of!(DiscoveryLogEntry, cntlid), 6);
        assert_eq!(offset_of!(DiscoveryLogEntry, asqsz), 8);
        assert_eq!(offset_of!(DiscoveryLogEntry, trsvcid), 32);
        assert_eq!(offset_of!(DiscoveryLogEntry, subnqn), 256);
        assert_eq!(offset_of!(DiscoveryLogEntry, traddr), 512);
        assert_eq!(offset_of!(DiscoveryLogEntry, tsas), 768);
    }

    #[test]
    fn connect_data_fields_sit_at_the_specs_offsets() {
        assert_eq!(offset_of!(ConnectData, cntlid), 16);
        assert_eq!(offset_of!(ConnectData, subnqn), 256);
        assert_eq!(offset_of!(ConnectData, hostnqn), 512);
        let d =
            ConnectData::new([7; 16], CNTLID_DYNAMIC, "nqn.2019-07.io.spdk:a", "nqn.h").unwrap();
        let b = d.as_bytes();
        assert_eq!(&b[16..18], &[0xff, 0xff]);
        assert_eq!(&b[256..277], b"nqn.2019-07.io.spdk:a");
        assert_eq!(b[277], 0);
        assert_eq!(&b[512..517], b"nqn.h");
        let long = "n".repeat(224);
        assert_eq!(
            ConnectData::new([0; 16], 1, &long, "h"),
            Err(NqnTooLong { len: 224 })
        );
    }

    #[test]
    fn fabrics_commands_carry_their_type_in_byte_4_and_fields_at_their_bytes() {
        let c = connect(3, 2, 127, 0, 0);
        let b = c.as_bytes();
        assert_eq!(b[0], 0x7f);
        assert_eq!(b[1] >> 6, 0b01, "PSDT: SGLs");
        assert_eq!(&b[2..4], &3u16.to_le_bytes());
        assert_eq!(b[4], 0x01);
        assert_eq!(&b[42..44], &2u16.to_le_bytes(), "QID");
        assert_eq!(&b[44..46], &127u16.to_le_bytes(), "SQSIZE");
        let a = connect(0, 0, 31, 0, 120_000);
        assert_eq!(&a.as_bytes()[48..52], &120_000u32.to_le_bytes(), "KATO");
        let g = property_get(1, 0x1c, false);
        assert_eq!((g.as_bytes()[4], g.as_bytes()[40]), (0x04, 0));
        assert_eq!(&g.as_bytes()[44..48], &0x1cu32.to_le_bytes());
        let s = property_set(1, 0x14, 0x0046_0001, false);
        assert_eq!(s.as_bytes()[4], 0x00);
        assert_eq!(&s.as_bytes()[48..56], &0x0046_0001u64.to_le_bytes());
        assert_eq!(property_get(1, 0, true).as_bytes()[40], 1, "8-byte CAP");
    }
}
