//! The NVMe/TCP codec, host side, without I/O: [`encode`] builds the PDUs a host sends
//! (ICReq, CapsuleCmd with optional in-capsule data, H2CData, H2CTermReq) with the header
//! digest, padding to the controller's data alignment and data digest that were negotiated;
//! [`Decoder`] takes the bytes a controller sends, in whatever pieces the socket gives, and
//! returns whole PDUs (ICResp, CapsuleResp, C2HData, R2T, C2HTermReq) once every field was
//! checked: the type is one a controller sends, HLEN is the type's, PDO and PLEN are
//! consistent with the digests and the data length, the data is aligned as the host asked,
//! the digests match, and no PDU is larger than the host allows. A violation is a [`Fatal`]
//! naming the FES and FEI for the H2CTermReq that ends the connection.

use nvme_spec::Command;
use nvme_spec::tcp::{
    C2hData, CapsuleCmd, CapsuleResp, CommonHeader, DigestFlags, Fes, H2cData, IcReq, IcResp,
    PduFlags, PduType, R2t, TermReq,
};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

/// What an ICReq/ICResp exchange settled for one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// Header digests on every PDU but ICReq/ICResp/TermReq.
    pub hdgst: bool,
    /// Data digests after every PDU's data.
    pub ddgst: bool,
    /// The controller's alignment for data the host sends: multiples of (CPDA + 1) * 4.
    pub cpda: u8,
    /// The host's alignment for data the controller sends: multiples of (HPDA + 1) * 4.
    pub hpda: u8,
    /// The most data bytes in one H2CData PDU.
    pub maxh2cdata: u32,
}

impl Negotiated {
    /// What the ICResp `resp` settles for a host that sent `req`; refused when the
    /// controller enables a digest the host did not ask for, speaks another PDU format, or
    /// allows less than 4096 bytes per H2CData (the spec's floor).
    pub fn from_exchange(req: &IcReq, resp: &IcResp) -> Result<Self, Fatal> {
        if resp.pfv != 0 {
            return Err(Fatal::new(
                Fes::UNSUPPORTED_PARAMETER,
                8,
                format!("ICResp PDU format version {}, this host speaks 0", resp.pfv),
            ));
        }
        let asked = req.dgst;
        if (resp.dgst.hdgst() && !asked.hdgst()) || (resp.dgst.ddgst() && !asked.ddgst()) {
            return Err(Fatal::new(
                Fes::UNSUPPORTED_PARAMETER,
                11,
                "the controller enabled a digest the host did not ask for".into(),
            ));
        }
        if resp.maxh2cdata < 4096 {
            return Err(Fatal::new(
                Fes::UNSUPPORTED_PARAMETER,
                12,
                format!("MAXH2CDATA {} is below the spec's 4096", resp.maxh2cdata),
            ));
        }
        if resp.cpda > 31 {
            return Err(Fatal::new(
                Fes::UNSUPPORTED_PARAMETER,
                10,
                format!("CPDA {} is above 31", resp.cpda),
            ));
        }
        Ok(Self {
            hdgst: resp.dgst.hdgst(),
            ddgst: resp.dgst.ddgst(),
            cpda: resp.cpda,
            hpda: req.hpda,
            maxh2cdata: resp.maxh2cdata,
        })
    }

    fn hdgst_len(&self) -> usize {
        if self.hdgst { 4 } else { 0 }
    }

    fn ddgst_len(&self) -> usize {
        if self.ddgst { 4 } else { 0 }
    }
}

/// A protocol violation by the controller: the connection ends with an H2CTermReq carrying
/// `fes` and `fei` ([`encode::term_req`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("NVMe/TCP: {why} ({})", .fes.name())]
pub struct Fatal {
    /// Fatal Error Status.
    pub fes: Fes,
    /// Fatal Error Information: the byte offset of the bad field in the PDU, where there is one.
    pub fei: u32,
    /// What was wrong, with the numbers.
    pub why: String,
}

impl Fatal {
    fn new(fes: Fes, fei: u32, why: String) -> Self {
        Self { fes, fei, why }
    }
}

/// The CRC-32C digest of `bytes`, as it goes on the wire.
pub fn digest(bytes: &[u8]) -> [u8; 4] {
    crc32c::crc32c(bytes).to_le_bytes()
}

/// Building the PDUs a host sends.
pub mod encode {
    use super::*;

    /// An ICReq asking for `dgst` and data at multiples of (`hpda` + 1) * 4 bytes, one R2T
    /// outstanding per command.
    pub fn icreq(hpda: u8, dgst: DigestFlags) -> [u8; 128] {
        let mut out = [0u8; 128];
        out.copy_from_slice(IcReq::new(hpda, dgst, 0).as_bytes());
        out
    }

    /// A PDU of `header` (its common header's HLEN, PDO, PLEN and digest flags filled in
    /// here), then `data` at the controller's alignment, with the negotiated digests.
    fn with_data(neg: &Negotiated, header: &mut [u8], data: &[u8]) -> Vec<u8> {
        let hlen = header.len();
        let head = hlen + neg.hdgst_len();
        let align = (usize::from(neg.cpda) + 1) * 4;
        let pdo = if data.is_empty() {
            0
        } else {
            head.next_multiple_of(align)
        };
        let plen = if data.is_empty() {
            head
        } else {
            pdo + data.len() + neg.ddgst_len()
        };
        let mut flags = PduFlags::from_bits(header[1]);
        flags.set_hdgstf(neg.hdgst);
        flags.set_ddgstf(neg.ddgst && !data.is_empty());
        header[1] = flags.into_bits();
        header[2] = hlen as u8;
        // PDO is one byte: the transport keeps headers and alignment under 256.
        header[3] = pdo as u8;
        header[4..8].copy_from_slice(&(plen as u32).to_le_bytes());
        let mut out = Vec::with_capacity(plen);
        out.extend_from_slice(header);
        if neg.hdgst {
            out.extend_from_slice(&digest(header));
        }
        if !data.is_empty() {
            out.resize(pdo, 0);
            out.extend_from_slice(data);
            if neg.ddgst {
                out.extend_from_slice(&digest(data));
            }
        }
        out
    }

    /// A command capsule for `sqe`, with `in_capsule` data after it (empty: none).
    pub fn capsule(neg: &Negotiated, sqe: &Command, in_capsule: &[u8]) -> Vec<u8> {
        let mut h = CapsuleCmd {
            ch: CommonHeader {
                pdu_type: PduType::CAPSULE_CMD,
                flags: PduFlags::new(),
                hlen: 0,
                pdo: 0,
                plen: 0,
            },
            sqe: *sqe,
        };
        with_data(neg, h.as_mut_bytes(), in_capsule)
    }

    /// H2CData for command `cccid`: `data` at offset `datao` of its data, answering the R2T
    /// tagged `ttag`; `last` on the last PDU of that R2T's range.
    pub fn h2c_data(
        neg: &Negotiated,
        cccid: u16,
        ttag: u16,
        datao: u32,
        data: &[u8],
        last: bool,
    ) -> Vec<u8> {
        let mut h = H2cData::new_zeroed();
        h.ch.pdu_type = PduType::H2C_DATA;
        h.ch.flags = PduFlags::new().with_last_pdu(last);
        h.cccid = cccid;
        h.ttag = ttag;
        h.datao = datao;
        h.datal = data.len() as u32;
        with_data(neg, h.as_mut_bytes(), data)
    }

    /// An H2CTermReq for `fatal`, with up to 128 bytes of the offending PDU's header.
    pub fn term_req(fatal: &Fatal, offending: &[u8]) -> Vec<u8> {
        let mut h = TermReq::new_zeroed();
        h.ch.pdu_type = PduType::H2C_TERM_REQ;
        h.ch.hlen = 24;
        h.fes = fatal.fes.0;
        h.fei.set(fatal.fei);
        let tail = &offending[..offending.len().min(128)];
        h.ch.pdo = if tail.is_empty() { 0 } else { 24 };
        h.ch.plen = (24 + tail.len()) as u32;
        let mut out = h.as_bytes().to_vec();
        out.extend_from_slice(tail);
        out
    }
}

/// A whole PDU from the controller, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pdu {
    /// The answer to the ICReq.
    IcResp(IcResp),
    /// A completion.
    CapsuleResp(nvme_spec::Completion),
    /// Read data for `cccid` at `datao`; `last`/`success` as the flags say.
    C2hData {
        /// The header.
        header: C2hData,
        /// The data (DATAL bytes).
        data: Vec<u8>,
        /// Whether its data digest matched (always, without data digests). A mismatch is not
        /// fatal to the connection: the command fails (Transient Transport Error), the
        /// connection goes on.
        digest_ok: bool,
    },
    /// The controller asks for write data.
    R2t(R2t),
    /// The controller ends the connection.
    TermReq {
        /// Fatal Error Status.
        fes: Fes,
        /// Fatal Error Information.
        fei: u32,
    },
}

/// The incremental decoder of what a controller sends (see the module documentation).
#[derive(Debug)]
pub struct Decoder {
    neg: Option<Negotiated>,
    max_data: u32,
    buf: Vec<u8>,
}

impl Decoder {
    /// A decoder for a new connection: the first PDU must be the ICResp. PDUs with more than
    /// `max_data` bytes of data are refused (Data Transfer Limit Exceeded).
    pub fn new(max_data: u32) -> Self {
        Self {
            neg: None,
            max_data,
            buf: Vec::new(),
        }
    }

    /// What was negotiated, once [`Decoder::negotiated`] was told.
    pub fn negotiation(&self) -> Option<Negotiated> {
        self.neg
    }

    /// Takes the negotiation (after the ICResp), so digests and alignment are checked from
    /// the next PDU on.
    pub fn negotiated(&mut self, neg: Negotiated) {
        self.neg = Some(neg);
    }

    /// Bytes received and not yet part of a returned PDU.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Adds bytes from the socket.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole PDU, `None` while one is incomplete, or the violation that ends the
    /// connection (the bytes are then left as they are: nothing after a fatal error is read).
    pub fn next_pdu(&mut self) -> Result<Option<Pdu>, Fatal> {
        if self.buf.len() < 8 {
            return Ok(None);
        }
        let Ok((ch, _)) = CommonHeader::read_from_prefix(&self.buf) else {
            return Ok(None);
        };
        let t = ch.pdu_type;
        let bad = |fei: u32, why: String| Err(Fatal::new(Fes::INVALID_HEADER_FIELD, fei, why));
        let expected = matches!(
            (self.neg.is_some(), t),
            (false, PduType::IC_RESP | PduType::C2H_TERM_REQ)
                | (
                    true,
                    PduType::CAPSULE_RESP
                        | PduType::C2H_DATA
                        | PduType::R2T
                        | PduType::C2H_TERM_REQ
                )
        );
        if !expected {
            let what = t.name().unwrap_or("an unknown type");
            let when = if self.neg.is_some() {
                "on a live connection"
            } else {
                "before the ICResp"
            };
            return Err(Fatal::new(
                Fes::PDU_SEQUENCE_ERROR,
                0,
                format!("a {what} PDU (type {:#04x}) {when}", t.0),
            ));
        }
        let hlen = usize::from(t.hlen().unwrap_or(0));
        if usize::from(ch.hlen) != hlen {
            return bad(
                2,
                format!("HLEN {} for a {}, which has {hlen}", ch.hlen, name(t)),
            );
        }
        let term = matches!(t, PduType::C2H_TERM_REQ);
        let icresp = matches!(t, PduType::IC_RESP);
        let neg = self.neg.unwrap_or(Negotiated {
            hdgst: false,
            ddgst: false,
            cpda: 0,
            hpda: 0,
            maxh2cdata: 4096,
        });
        // No header digest on ICResp and TermReq, whatever was negotiated.
        let hd = if term || icresp { 0 } else { neg.hdgst_len() };
        if ch.flags.hdgstf() != (hd == 4) {
            return bad(
                1,
                format!(
                    "HDGSTF {} on a {}, the connection has header digests {}",
                    ch.flags.hdgstf(),
                    name(t),
                    hd == 4
                ),
            );
        }
        let plen = ch.plen as usize;
        let has_data = matches!(t, PduType::C2H_DATA) || (term && plen > hlen);
        if !has_data {
            if ch.pdo != 0 || plen != hlen + hd {
                return bad(
                    4,
                    format!(
                        "PDO {} and PLEN {plen} for a {} without data (HLEN {hlen}, header digest {hd})",
                        ch.pdo,
                        name(t)
                    ),
                );
            }
        } else if term {
            if plen > 152 || usize::from(ch.pdo) != hlen {
                return bad(4, format!("a C2HTermReq of PLEN {plen}, PDO {}", ch.pdo));
            }
        } else {
            let pdo = usize::from(ch.pdo);
            let align = (usize::from(neg.hpda) + 1) * 4;
            // PLEN must reach past PDO too: the digest and the data are cut from the PDU.
            if pdo < hlen + hd || pdo % align != 0 || plen <= pdo {
                return bad(
                    3,
                    format!(
                        "PDO {pdo}: data must start after the {}-byte header and digest, at a multiple of {align}",
                        hlen + hd
                    ),
                );
            }
        }
        if plen > hlen + hd + 255 + self.max_data as usize + 4 {
            return Err(Fatal::new(
                Fes::DATA_TRANSFER_LIMIT_EXCEEDED,
                4,
                format!(
                    "a PDU of {plen} bytes; this host takes at most {} of data",
                    self.max_data
                ),
            ));
        }
        if self.buf.len() < plen {
            return Ok(None);
        }
        let pdu: Vec<u8> = self.buf.drain(..plen).collect();
        if hd == 4 && pdu[hlen..hlen + 4] != digest(&pdu[..hlen]) {
            return Err(Fatal::new(
                Fes::HEADER_DIGEST_ERROR,
                hlen as u32,
                format!("the header digest of a {} does not match", name(t)),
            ));
        }
        let out = match t {
            PduType::IC_RESP => Pdu::IcResp(read(&pdu)),
            PduType::CAPSULE_RESP => {
                let r: CapsuleResp = read(&pdu);
                Pdu::CapsuleResp(r.cqe)
            }
            PduType::R2T => Pdu::R2t(read(&pdu)),
            PduType::C2H_TERM_REQ => {
                let r: TermReq = read(&pdu);
                Pdu::TermReq {
                    fes: Fes(r.fes),
                    fei: r.fei.get(),
                }
            }
            _ => {
                let header: C2hData = read(&pdu);
                let pdo = usize::from(ch.pdo);
                let dd = if ch.flags.ddgstf() { 4 } else { 0 };
                if ch.flags.ddgstf() != neg.ddgst {
                    return bad(
                        1,
                        format!(
                            "DDGSTF {} on a connection with data digests {}",
                            ch.flags.ddgstf(),
                            neg.ddgst
                        ),
                    );
                }
                let datal = header.datal as usize;
                if datal == 0 || pdo + datal + dd != plen {
                    return bad(
                        16,
                        format!("DATAL {datal} with PDO {pdo} and PLEN {plen} (data digest {dd})"),
                    );
                }
                if header.ch.flags.success() && !header.ch.flags.last_pdu() {
                    return bad(1, "SUCCESS without LAST_PDU on a C2HData".into());
                }
                let data = pdu[pdo..pdo + datal].to_vec();
                let digest_ok = dd == 0 || pdu[pdo + datal..] == digest(&data);
                Pdu::C2hData {
                    header,
                    data,
                    digest_ok,
                }
            }
        };
        Ok(Some(out))
    }
}

fn name(t: PduType) -> &'static str {
    t.name().unwrap_or("PDU")
}

/// The PDU's header as `T` (the length was checked: HLEN is `T`'s size).
fn read<T: FromBytes>(pdu: &[u8]) -> T {
    // HLEN was checked against the type, and every header type is exactly its HLEN.
    T::read_from_prefix(pdu).map_or_else(|_| T::new_zeroed(), |(t, _)| t)
}
