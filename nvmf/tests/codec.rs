//! The NVMe/TCP codec against PDUs built here byte by byte from the specification's layouts
//! (not through the codec's own encoder), fed in arbitrary pieces, and against each way a
//! controller can get a header wrong.

use nvme_spec::tcp::{DigestFlags, Fes, IcReq, IcResp, PduType};
use nvme_spec::{Command, Completion};
use nvmf::tcp::codec::{Decoder, Fatal, Negotiated, Pdu, digest, encode};
use rand::{Rng, SeedableRng};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

const DIGESTS: Negotiated = Negotiated {
    hdgst: true,
    ddgst: true,
    cpda: 3,
    hpda: 1,
    maxh2cdata: 131072,
};
const PLAIN: Negotiated = Negotiated {
    hdgst: false,
    ddgst: false,
    cpda: 0,
    hpda: 0,
    maxh2cdata: 131072,
};

/// A controller's PDU: common header (type, flags, HLEN, PDO, PLEN) + `psh`, then data at
/// `pdo` (0: none), with the digests `neg` asks for.
fn pdu(t: u8, mut flags: u8, psh: &[u8], data: &[u8], neg: &Negotiated, pdo_min: usize) -> Vec<u8> {
    let hlen = 8 + psh.len();
    let hd = if neg.hdgst { 4 } else { 0 };
    if neg.hdgst {
        flags |= 0x01;
    }
    if neg.ddgst && !data.is_empty() {
        flags |= 0x02;
    }
    let align = (usize::from(neg.hpda) + 1) * 4;
    let pdo = if data.is_empty() {
        0
    } else {
        (hlen + hd).max(pdo_min).next_multiple_of(align)
    };
    let plen = if data.is_empty() {
        hlen + hd
    } else {
        pdo + data.len() + if neg.ddgst { 4 } else { 0 }
    };
    let mut out = vec![t, flags, hlen as u8, pdo as u8];
    out.extend_from_slice(&(plen as u32).to_le_bytes());
    out.extend_from_slice(psh);
    if neg.hdgst {
        let d = digest(&out);
        out.extend_from_slice(&d);
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

fn c2h(cccid: u16, datao: u32, data: &[u8], flags: u8, neg: &Negotiated) -> Vec<u8> {
    let mut psh = Vec::new();
    psh.extend_from_slice(&cccid.to_le_bytes());
    psh.extend_from_slice(&[0, 0]);
    psh.extend_from_slice(&datao.to_le_bytes());
    psh.extend_from_slice(&(data.len() as u32).to_le_bytes());
    psh.extend_from_slice(&[0; 4]);
    pdu(0x07, flags, &psh, data, neg, 0)
}

fn resp(cid: u16, neg: &Negotiated) -> Vec<u8> {
    let mut cqe = Completion::new_zeroed();
    cqe.cid = cid;
    cqe.sqhd = 5;
    pdu(0x05, 0, cqe.as_bytes(), &[], neg, 0)
}

fn r2t(cccid: u16, ttag: u16, r2to: u32, r2tl: u32, neg: &Negotiated) -> Vec<u8> {
    let mut psh = Vec::new();
    psh.extend_from_slice(&cccid.to_le_bytes());
    psh.extend_from_slice(&ttag.to_le_bytes());
    psh.extend_from_slice(&r2to.to_le_bytes());
    psh.extend_from_slice(&r2tl.to_le_bytes());
    psh.extend_from_slice(&[0; 4]);
    pdu(0x09, 0, &psh, &[], neg, 0)
}

fn icresp(cpda: u8, dgst: u8, maxh2cdata: u32) -> Vec<u8> {
    let mut b = vec![0x01, 0, 128, 0, 128, 0, 0, 0, 0, 0, cpda, dgst];
    b.extend_from_slice(&maxh2cdata.to_le_bytes());
    b.resize(128, 0);
    b
}

fn live(neg: Negotiated) -> Decoder {
    let mut d = Decoder::new(1 << 20);
    d.negotiated(neg);
    d
}

fn fatal(d: &mut Decoder, bytes: &[u8]) -> Fatal {
    d.push(bytes);
    d.next_pdu().expect_err("refused")
}

#[test]
fn an_icresp_negotiates_and_what_the_host_did_not_ask_for_is_refused() {
    let req = IcReq::new(1, DigestFlags::new().with_hdgst(true).with_ddgst(true), 0);
    let mut d = Decoder::new(1 << 20);
    d.push(&icresp(3, 0x03, 131072));
    let Some(Pdu::IcResp(r)) = d.next_pdu().unwrap() else {
        panic!()
    };
    let neg = Negotiated::from_exchange(&req, &r).unwrap();
    assert_eq!(neg, DIGESTS);
    // Digests the host did not ask for, MAXH2CDATA under 4096, another format, CPDA > 31.
    let plain = IcReq::new(0, DigestFlags::new(), 0);
    let resp = |cpda, dgst, max| IcResp::read_from_bytes(&icresp(cpda, dgst, max)).unwrap();
    let e = Negotiated::from_exchange(&plain, &resp(0, 0x01, 8192)).unwrap_err();
    assert_eq!((e.fes, e.fei), (Fes::UNSUPPORTED_PARAMETER, 11));
    let e = Negotiated::from_exchange(&plain, &resp(0, 0, 2048)).unwrap_err();
    assert!(e.why.contains("MAXH2CDATA 2048"), "{e}");
    let e = Negotiated::from_exchange(&plain, &resp(32, 0, 8192)).unwrap_err();
    assert!(e.why.contains("CPDA 32"), "{e}");
    let mut v1 = icresp(0, 0, 8192);
    v1[8] = 1;
    let e = Negotiated::from_exchange(&plain, &IcResp::read_from_bytes(&v1).unwrap()).unwrap_err();
    assert!(e.why.contains("version 1"), "{e}");
}

#[test]
fn pdus_in_any_pieces_come_out_whole_and_checked() {
    for neg in [PLAIN, DIGESTS] {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut stream = Vec::new();
        stream.extend(r2t(3, 9, 4096, 8192, &neg));
        stream.extend(c2h(4, 0, &data[..6000], 0, &neg));
        stream.extend(c2h(4, 6000, &data[6000..], 0x04 | 0x08, &neg));
        stream.extend(resp(5, &neg));
        let mut rng = rand::rngs::StdRng::seed_from_u64(57);
        for _ in 0..50 {
            let mut d = live(neg);
            let mut got = Vec::new();
            let mut at = 0;
            while at < stream.len() {
                let n = rng.random_range(1..=700).min(stream.len() - at);
                d.push(&stream[at..at + n]);
                at += n;
                while let Some(p) = d.next_pdu().unwrap() {
                    got.push(p);
                }
            }
            assert_eq!(d.pending(), 0);
            assert_eq!(got.len(), 4);
            let Pdu::R2t(r) = &got[0] else { panic!() };
            assert_eq!((r.cccid, r.ttag, r.r2to, r.r2tl), (3, 9, 4096, 8192));
            let (
                Pdu::C2hData {
                    header: a,
                    data: da,
                    digest_ok: oa,
                },
                Pdu::C2hData {
                    header: b,
                    data: db,
                    digest_ok: ob,
                },
            ) = (&got[1], &got[2])
            else {
                panic!()
            };
            assert!(*oa && *ob);
            assert_eq!((a.cccid, a.datao, b.datao), (4, 0, 6000));
            assert!(!a.ch.flags.last_pdu() && b.ch.flags.last_pdu() && b.ch.flags.success());
            assert_eq!([da.as_slice(), db.as_slice()].concat(), data);
            let Pdu::CapsuleResp(c) = &got[3] else {
                panic!()
            };
            assert_eq!((c.cid, c.sqhd), (5, 5));
        }
    }
}

#[test]
fn each_bad_header_is_refused_with_its_fatal_error_status() {
    // Before the ICResp: only an ICResp (or a TermReq).
    let mut d = Decoder::new(1 << 20);
    let e = fatal(&mut d, &resp(1, &PLAIN));
    assert_eq!(e.fes, Fes::PDU_SEQUENCE_ERROR);
    assert!(
        e.why
            .contains("CapsuleResp PDU (type 0x05) before the ICResp"),
        "{e}"
    );
    // Host-to-controller types and unknown ones from a controller.
    for t in [0x00u8, 0x04, 0x06, 0x08, 0xff] {
        let mut b = resp(1, &PLAIN);
        b[0] = t;
        assert_eq!(
            fatal(&mut live(PLAIN), &b).fes,
            Fes::PDU_SEQUENCE_ERROR,
            "type {t:#x}"
        );
    }
    // HLEN not the type's.
    let mut b = resp(1, &PLAIN);
    b[2] = 20;
    let e = fatal(&mut live(PLAIN), &b);
    assert_eq!((e.fes, e.fei), (Fes::INVALID_HEADER_FIELD, 2));
    // A header digest flag the connection did not negotiate, and one missing.
    assert_eq!(fatal(&mut live(PLAIN), &resp(1, &DIGESTS)).fei, 1);
    assert_eq!(fatal(&mut live(DIGESTS), &resp(1, &PLAIN)).fei, 1);
    // PLEN of a PDU without data that is not HLEN (+ digest).
    let mut b = resp(1, &PLAIN);
    b[4] = 28;
    assert_eq!(fatal(&mut live(PLAIN), &b).fei, 4);
    // Data not at the host's alignment (HPDA 1: multiples of 8): PDO 28.
    let mut b = c2h(1, 0, &[1; 16], 0x04, &DIGESTS);
    b[3] = 28;
    let e = fatal(&mut live(DIGESTS), &b);
    assert_eq!((e.fes, e.fei), (Fes::INVALID_HEADER_FIELD, 3));
    // PLEN that ends before the data starts (here before the header digest): refused, not
    // cut past its end.
    let mut b = c2h(1, 0, &[1; 16], 0x04, &DIGESTS);
    b[4..8].copy_from_slice(&24u32.to_le_bytes());
    b.truncate(24);
    assert_eq!(fatal(&mut live(DIGESTS), &b).fei, 3);
    // DATAL that does not add up with PDO and PLEN.
    let mut b = c2h(1, 0, &[1; 16], 0x04, &PLAIN);
    b[16] = 15;
    assert_eq!(fatal(&mut live(PLAIN), &b).fei, 16);
    // SUCCESS without LAST_PDU.
    let e = fatal(&mut live(PLAIN), &c2h(1, 0, &[1; 16], 0x08, &PLAIN));
    assert!(e.why.contains("SUCCESS without LAST_PDU"), "{e}");
    // A header digest that does not match.
    let mut b = resp(1, &DIGESTS);
    b[24] ^= 1;
    let e = fatal(&mut live(DIGESTS), &b);
    assert_eq!((e.fes, e.fei), (Fes::HEADER_DIGEST_ERROR, 24));
    // More data than the host takes: refused from the header, before the data arrives.
    let mut d = Decoder::new(4096);
    d.negotiated(PLAIN);
    let big = c2h(1, 0, &vec![0; 8192], 0x04, &PLAIN);
    d.push(&big[..24]);
    assert_eq!(
        d.next_pdu().unwrap_err().fes,
        Fes::DATA_TRANSFER_LIMIT_EXCEEDED
    );
}

#[test]
fn a_data_digest_that_does_not_match_fails_the_command_not_the_connection() {
    let mut d = live(DIGESTS);
    let mut b = c2h(2, 0, &[9; 512], 0x04, &DIGESTS);
    let n = b.len();
    b[n - 1] ^= 0xff;
    d.push(&b);
    d.push(&resp(2, &DIGESTS));
    let Some(Pdu::C2hData { digest_ok, .. }) = d.next_pdu().unwrap() else {
        panic!()
    };
    assert!(!digest_ok);
    assert!(matches!(d.next_pdu().unwrap(), Some(Pdu::CapsuleResp(_))));
}

#[test]
fn a_controllers_term_req_is_read_with_its_status() {
    let mut psh = Vec::new();
    psh.extend_from_slice(&Fes::HEADER_DIGEST_ERROR.0.to_le_bytes());
    psh.extend_from_slice(&8u32.to_le_bytes());
    psh.extend_from_slice(&[0; 10]);
    // With 8 bytes of the offending header after it (PDO 24).
    let mut b = vec![0x03, 0, 24, 24];
    b.extend_from_slice(&32u32.to_le_bytes());
    b.extend_from_slice(&psh);
    b.extend_from_slice(&[0xaa; 8]);
    let mut d = live(DIGESTS);
    d.push(&b);
    assert_eq!(
        d.next_pdu().unwrap(),
        Some(Pdu::TermReq {
            fes: Fes::HEADER_DIGEST_ERROR,
            fei: 8
        })
    );
}

#[test]
fn encoded_pdus_carry_the_negotiated_digests_and_alignment() {
    let mut sqe = Command::new_zeroed();
    sqe.cdw10 = 0x1234;
    // Digests, CPDA 3 (16-byte alignment): header 72 + digest 4 -> data at 80.
    let b = encode::capsule(&DIGESTS, &sqe, &[7; 100]);
    assert_eq!(b[0], 0x04);
    assert_eq!(b[1], 0x03, "HDGSTF | DDGSTF");
    assert_eq!((b[2], b[3]), (72, 80));
    let plen = u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize;
    assert_eq!(plen, 80 + 100 + 4);
    assert_eq!(b.len(), plen);
    assert_eq!(&b[72..76], &digest(&b[..72]));
    assert_eq!(&b[80..180], &[7; 100]);
    assert_eq!(&b[180..], &digest(&[7; 100]));
    assert_eq!(
        &b[8 + 40..8 + 44],
        &0x1234u32.to_le_bytes(),
        "the SQE after the header"
    );
    // No data, no digests: PDO 0, PLEN 72.
    let b = encode::capsule(&PLAIN, &sqe, &[]);
    assert_eq!((b[1], b[3], b.len()), (0, 0, 72));
    // H2CData: LAST_PDU, tag and offsets at their bytes.
    let b = encode::h2c_data(&PLAIN, 3, 9, 4096, &[1; 64], true);
    assert_eq!((b[0], b[1] & 0x04, b[2], b[3]), (0x06, 0x04, 24, 24));
    assert_eq!(&b[8..12], &[3, 0, 9, 0]);
    assert_eq!(&b[12..16], &4096u32.to_le_bytes());
    assert_eq!(&b[16..20], &64u32.to_le_bytes());
    // H2CTermReq: FES, the unaligned FEI, the offending header.
    let f = Fatal {
        fes: Fes::INVALID_HEADER_FIELD,
        fei: 2,
        why: String::new(),
    };
    let b = encode::term_req(&f, &[0xab; 24]);
    assert_eq!((b[0], b[2], b[3], b.len()), (0x02, 24, 24, 48));
    assert_eq!(&b[8..10], &1u16.to_le_bytes());
    assert_eq!(&b[10..14], &2u32.to_le_bytes());
    let req = encode::icreq(1, DigestFlags::new().with_ddgst(true));
    assert_eq!(
        (req[0], req[2], req[10], req[11]),
        (PduType::IC_REQ.0, 128, 1, 0x02)
    );
}

#[test]
fn random_and_mutated_bytes_never_panic() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(8000);
    let good = [
        resp(1, &DIGESTS),
        c2h(1, 0, &[5; 300], 0x0c, &DIGESTS),
        r2t(1, 1, 0, 512, &DIGESTS),
    ];
    for i in 0..20_000 {
        let mut d = Decoder::new(1 << 16);
        if i % 3 != 0 {
            d.negotiated(if i % 2 == 0 { DIGESTS } else { PLAIN });
        }
        let bytes: Vec<u8> = if i % 2 == 0 {
            let mut b = good[i % 3].clone();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..b.len());
                b[at] = rng.random();
            }
            b.truncate(rng.random_range(0..=b.len()));
            b
        } else {
            (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect()
        };
        d.push(&bytes);
        // Each call either returns a PDU, waits for more, or refuses; never loops or panics.
        for _ in 0..8 {
            match d.next_pdu() {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
    }
}
