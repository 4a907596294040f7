//! NVMe/TCP PDUs (NVMe/TCP Transport Specification, originally TP 8000): the 8-byte common
//! header and each PDU type's specific header, as they are on the wire.
//!
//! One TCP connection carries one queue pair. A PDU is its common header ([`CommonHeader`]),
//! the rest of its type's header (HLEN bytes in all), an optional header digest, padding up to
//! PDO, data, and an optional data digest; PLEN counts everything. Digests (CRC-32C,
//! little endian) and the checks of HLEN/PDO/PLEN per type belong to the transport, not here.
//! Data only, as the rest of this crate.

use bitfield_struct::bitfield;
use zerocopy::byteorder::little_endian::U32 as Le32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::command::Command;
use crate::completion::Completion;

/// A PDU's type (the common header's first byte).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PduType(pub u8);

impl PduType {
    /// Initialize Connection Request (host to controller).
    pub const IC_REQ: Self = Self(0x00);
    /// Initialize Connection Response.
    pub const IC_RESP: Self = Self(0x01);
    /// Host to Controller Terminate Connection Request.
    pub const H2C_TERM_REQ: Self = Self(0x02);
    /// Controller to Host Terminate Connection Request.
    pub const C2H_TERM_REQ: Self = Self(0x03);
    /// A command capsule (the SQE, optionally in-capsule data).
    pub const CAPSULE_CMD: Self = Self(0x04);
    /// A response capsule (the CQE).
    pub const CAPSULE_RESP: Self = Self(0x05);
    /// Host to Controller Data (answering an R2T).
    pub const H2C_DATA: Self = Self(0x06);
    /// Controller to Host Data (a read's data).
    pub const C2H_DATA: Self = Self(0x07);
    /// Ready to Transfer: the controller asks for a write's data.
    pub const R2T: Self = Self(0x09);

    /// The PDU's specific header length (HLEN: common header and PSH, no digest).
    pub fn hlen(self) -> Option<u8> {
        Some(match self {
            Self::IC_REQ | Self::IC_RESP => 128,
            Self::CAPSULE_CMD => 72,
            Self::H2C_TERM_REQ
            | Self::C2H_TERM_REQ
            | Self::CAPSULE_RESP
            | Self::H2C_DATA
            | Self::C2H_DATA
            | Self::R2T => 24,
            _ => return None,
        })
    }

    /// The spec's name ("ICReq", "CapsuleCmd", ...), or `None` for a type no PDU has.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            Self::IC_REQ => "ICReq",
            Self::IC_RESP => "ICResp",
            Self::H2C_TERM_REQ => "H2CTermReq",
            Self::C2H_TERM_REQ => "C2HTermReq",
            Self::CAPSULE_CMD => "CapsuleCmd",
            Self::CAPSULE_RESP => "CapsuleResp",
            Self::H2C_DATA => "H2CData",
            Self::C2H_DATA => "C2HData",
            Self::R2T => "R2T",
            _ => return None,
        })
    }
}

/// The common header's flags.
#[bitfield(u8)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PduFlags {
    /// HDGSTF: a header digest follows the header.
    pub hdgstf: bool,
    /// DDGSTF: a data digest follows the data.
    pub ddgstf: bool,
    /// LAST_PDU: the last data PDU of a transfer (H2CData, C2HData).
    pub last_pdu: bool,
    /// SUCCESS: on the last C2HData, the command succeeded and no CapsuleResp follows.
    pub success: bool,
    #[bits(4)]
    _rsvd: u8,
}

/// The 8-byte common header every PDU starts with.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CommonHeader {
    /// The PDU's type.
    pub pdu_type: PduType,
    /// Its flags.
    pub flags: PduFlags,
    /// HLEN: this header and the type's specific header, without the header digest.
    pub hlen: u8,
    /// PDO: where the data starts in the PDU (0: no data).
    pub pdo: u8,
    /// PLEN: the whole PDU's length, digests and padding included.
    pub plen: u32,
}
const _: () = assert!(size_of::<CommonHeader>() == 8);

/// The digests asked for (ICReq) or enabled (ICResp).
#[bitfield(u8)]
#[derive(PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct DigestFlags {
    /// Header digests.
    pub hdgst: bool,
    /// Data digests.
    pub ddgst: bool,
    #[bits(6)]
    _rsvd: u8,
}

/// Initialize Connection Request (128 bytes): the first PDU on a connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct IcReq {
    /// Type IC_REQ, HLEN 128, PDO 0, PLEN 128.
    pub ch: CommonHeader,
    /// PDU Format Version (0).
    pub pfv: u16,
    /// Host PDU Data Alignment: the host wants data at multiples of (HPDA + 1) * 4 bytes.
    pub hpda: u8,
    /// The digests the host asks for.
    pub dgst: DigestFlags,
    /// Maximum outstanding R2Ts per command, 0-based.
    pub maxr2t_z: u32,
    _rsvd: [u8; 112],
}
const _: () = assert!(size_of::<IcReq>() == 128);

impl IcReq {
    /// An ICReq of format version 0 asking for `dgst`, data at (`hpda` + 1) * 4 bytes, and
    /// `maxr2t_z` + 1 R2Ts outstanding per command.
    pub fn new(hpda: u8, dgst: DigestFlags, maxr2t_z: u32) -> Self {
        Self {
            ch: CommonHeader {
                pdu_type: PduType::IC_REQ,
                flags: PduFlags::new(),
                hlen: 128,
                pdo: 0,
                plen: 128,
            },
            pfv: 0,
            hpda,
            dgst,
            maxr2t_z,
            _rsvd: [0; 112],
        }
    }
}

/// Initialize Connection Response (128 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct IcResp {
    /// Type IC_RESP, HLEN 128, PLEN 128.
    pub ch: CommonHeader,
    /// PDU Format Version (0).
    pub pfv: u16,
    /// Controller PDU Data Alignment: data the host sends starts at multiples of
    /// (CPDA + 1) * 4 bytes.
    pub cpda: u8,
    /// The digests enabled.
    pub dgst: DigestFlags,
    /// The most bytes of data one H2CData PDU may carry (at least 4096).
    pub maxh2cdata: u32,
    _rsvd: [u8; 112],
}
const _: () = assert!(size_of::<IcResp>() == 128);

/// Terminate Connection Request, either direction (24 bytes; the offending header follows as
/// data, PLEN at most 152). Fatal: the connection ends.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct TermReq {
    /// Type H2C_TERM_REQ or C2H_TERM_REQ, HLEN 24.
    pub ch: CommonHeader,
    /// Fatal Error Status ([`Fes`]).
    pub fes: u16,
    /// Fatal Error Information (the offset of a bad header field, say); not 4-byte aligned on
    /// the wire.
    pub fei: Le32,
    _rsvd: [u8; 10],
}
const _: () = assert!(size_of::<TermReq>() == 24);

/// Fatal Error Status codes of a [`TermReq`].
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Fes(pub u16);

impl Fes {
    /// An invalid header field (FEI: its byte offset).
    pub const INVALID_HEADER_FIELD: Self = Self(0x01);
    /// A PDU out of sequence.
    pub const PDU_SEQUENCE_ERROR: Self = Self(0x02);
    /// A header digest that did not match.
    pub const HEADER_DIGEST_ERROR: Self = Self(0x03);
    /// Data outside the command's range.
    pub const DATA_OUT_OF_RANGE: Self = Self(0x04);
    /// More data than a PDU may carry.
    pub const DATA_TRANSFER_LIMIT_EXCEEDED: Self = Self(0x05);
    /// An unsupported parameter (an ICReq field, say).
    pub const UNSUPPORTED_PARAMETER: Self = Self(0x06);

    /// The spec's words for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::INVALID_HEADER_FIELD => "Invalid PDU Header Field",
            Self::PDU_SEQUENCE_ERROR => "PDU Sequence Error",
            Self::HEADER_DIGEST_ERROR => "Header Digest Error",
            Self::DATA_OUT_OF_RANGE => "Data Transfer Out of Range",
            Self::DATA_TRANSFER_LIMIT_EXCEEDED => "Data Transfer Limit Exceeded",
            Self::UNSUPPORTED_PARAMETER => "Unsupported Parameter",
            _ => "reserved fatal error status",
        }
    }
}

/// A command capsule: the common header and the 64-byte SQE (in-capsule data at PDO after it).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CapsuleCmd {
    /// Type CAPSULE_CMD, HLEN 72.
    pub ch: CommonHeader,
    /// The command (PSDT = 01b: SGLs, as every command over TCP).
    pub sqe: Command,
}
const _: () = assert!(size_of::<CapsuleCmd>() == 72);

/// A response capsule: the common header and the 16-byte CQE (its phase bit means nothing).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CapsuleResp {
    /// Type CAPSULE_RESP, HLEN 24.
    pub ch: CommonHeader,
    /// The completion.
    pub cqe: Completion,
}
const _: () = assert!(size_of::<CapsuleResp>() == 24);

/// Host to Controller Data (24 bytes): part of a write's data, answering an [`R2t`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct H2cData {
    /// Type H2C_DATA, HLEN 24; LAST_PDU on the last of an R2T's range.
    pub ch: CommonHeader,
    /// Command Capsule CID: the command the data belongs to.
    pub cccid: u16,
    /// Transfer Tag, from the R2T.
    pub ttag: u16,
    /// Data offset in the command's data.
    pub datao: u32,
    /// Data length (at most the ICResp's MAXH2CDATA).
    pub datal: u32,
    _rsvd: [u8; 4],
}
const _: () = assert!(size_of::<H2cData>() == 24);

/// Controller to Host Data (24 bytes): part of a read's data.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct C2hData {
    /// Type C2H_DATA, HLEN 24; LAST_PDU on the last, SUCCESS when no CapsuleResp follows.
    pub ch: CommonHeader,
    /// Command Capsule CID.
    pub cccid: u16,
    _rsvd0: u16,
    /// Data offset in the command's data.
    pub datao: u32,
    /// Data length.
    pub datal: u32,
    _rsvd1: [u8; 4],
}
const _: () = assert!(size_of::<C2hData>() == 24);

/// Ready to Transfer (24 bytes): the controller asks for `r2tl` bytes of a write's data from
/// offset `r2to`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct R2t {
    /// Type R2T, HLEN 24.
    pub ch: CommonHeader,
    /// Command Capsule CID.
    pub cccid: u16,
    /// Transfer Tag, to be echoed in the H2CData PDUs.
    pub ttag: u16,
    /// R2T Offset in the command's data.
    pub r2to: u32,
    /// R2T Length.
    pub r2tl: u32,
    _rsvd: [u8; 4],
}
const _: () = assert!(size_of::<R2t>() == 24);

/// The SGL descriptor type byte (SQE byte 39) for data that moves by C2HData or R2T/H2CData
/// (Transport SGL Data Block, transport-specific subtype).
pub const SGL_TRANSPORT_DATA_BLOCK: u8 = 0x5a;
/// The SGL descriptor type byte for in-capsule data (Data Block, Offset subtype; address =
/// offset in the capsule's data).
pub const SGL_DATA_BLOCK_OFFSET: u8 = 0x01;

/// SGL Descriptor 1 of a command over TCP, as the SQE's data pointer fields (`prp1`, `prp2`):
/// `address` at bytes 24..32, `length` at 32..36, the type byte at 39.
pub fn sgl1(address: u64, length: u32, type_byte: u8) -> (u64, u64) {
    (address, u64::from(length) | (u64::from(type_byte) << 56))
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::offset_of;

    #[test]
    fn headers_sit_at_the_specs_byte_offsets() {
        assert_eq!(offset_of!(CommonHeader, hlen), 2);
        assert_eq!(offset_of!(CommonHeader, pdo), 3);
        assert_eq!(offset_of!(CommonHeader, plen), 4);
        assert_eq!(offset_of!(IcReq, pfv), 8);
        assert_eq!(offset_of!(IcReq, hpda), 10);
        assert_eq!(offset_of!(IcReq, dgst), 11);
        assert_eq!(offset_of!(IcReq, maxr2t_z), 12);
        assert_eq!(offset_of!(IcResp, cpda), 10);
        assert_eq!(offset_of!(IcResp, maxh2cdata), 12);
        assert_eq!(offset_of!(TermReq, fes), 8);
        assert_eq!(offset_of!(TermReq, fei), 10);
        assert_eq!(offset_of!(CapsuleCmd, sqe), 8);
        assert_eq!(offset_of!(CapsuleResp, cqe), 8);
        assert_eq!(offset_of!(H2cData, ttag), 10);
        assert_eq!(offset_of!(H2cData, datao), 12);
        assert_eq!(offset_of!(H2cData, datal), 16);
        assert_eq!(offset_of!(C2hData, datao), 12);
        assert_eq!(offset_of!(R2t, r2to), 12);
        assert_eq!(offset_of!(R2t, r2tl), 16);
    }

    #[test]
    fn an_icreq_is_the_bytes_a_target_expects() {
        let req = IcReq::new(0, DigestFlags::new().with_hdgst(true), 0);
        let b = req.as_bytes();
        assert_eq!(&b[..8], &[0x00, 0x00, 128, 0, 128, 0, 0, 0]);
        assert_eq!((b[10], b[11]), (0, 0x01));
        assert!(b[12..].iter().all(|&x| x == 0));
        // Every PDU type's HLEN and name; an unknown type has neither.
        for t in [0u8, 1, 2, 3, 4, 5, 6, 7, 9] {
            assert!(
                PduType(t).hlen().is_some() && PduType(t).name().is_some(),
                "{t}"
            );
        }
        assert_eq!(PduType(8).hlen(), None);
        assert_eq!(PduType::CAPSULE_CMD.hlen(), Some(72));
    }

    #[test]
    fn flags_and_a_c2hdata_header_decode_from_wire_bytes() {
        // C2HData, LAST_PDU | SUCCESS, HLEN 24, PDO 24, PLEN 24 + 4096; CCCID 7, DATAO 8192,
        // DATAL 4096.
        let mut raw = [0u8; 24];
        raw[..8].copy_from_slice(&[0x07, 0x0c, 24, 24, 0x18, 0x10, 0, 0]);
        raw[8..10].copy_from_slice(&7u16.to_le_bytes());
        raw[12..16].copy_from_slice(&8192u32.to_le_bytes());
        raw[16..20].copy_from_slice(&4096u32.to_le_bytes());
        let h = C2hData::read_from_bytes(&raw).unwrap();
        assert_eq!(h.ch.pdu_type, PduType::C2H_DATA);
        assert!(h.ch.flags.last_pdu() && h.ch.flags.success() && !h.ch.flags.hdgstf());
        assert_eq!(
            (h.ch.plen, h.cccid, h.datao, h.datal),
            (4120, 7, 8192, 4096)
        );
        // A TermReq's FEI is unaligned on the wire: bytes 10..14.
        let mut t = [0u8; 24];
        t[0] = 0x03;
        t[8..10].copy_from_slice(&Fes::HEADER_DIGEST_ERROR.0.to_le_bytes());
        t[10..14].copy_from_slice(&0x1234_5678u32.to_le_bytes());
        let term = TermReq::read_from_bytes(&t).unwrap();
        assert_eq!(Fes(term.fes).name(), "Header Digest Error");
        assert_eq!(term.fei.get(), 0x1234_5678);
    }

    #[test]
    fn sgl1_puts_the_type_in_byte_39() {
        let (a, b) = sgl1(0, 4096, SGL_TRANSPORT_DATA_BLOCK);
        let mut sqe = [0u8; 16];
        sqe[..8].copy_from_slice(&a.to_le_bytes());
        sqe[8..].copy_from_slice(&b.to_le_bytes());
        assert_eq!(&sqe[8..12], &4096u32.to_le_bytes());
        assert_eq!(sqe[15], 0x5a);
    }
}
