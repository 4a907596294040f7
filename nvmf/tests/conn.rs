//! An NVMe/TCP connection against a fake target in a thread (a loopback listener on a free
//! port): the ICReq it sends, the negotiation, and each way a target can fail it, each a typed
//! error within the bound.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use nvme_spec::tcp::{DigestFlags, Fes};
use nvmf::tcp::conn::{ConnectOptions, Connection, TcpError};

const BOUND: Duration = Duration::from_millis(500);

/// A target that reads the 128-byte ICReq, hands it to `answer`, and writes what that
/// returns (then keeps the socket open briefly unless `close`).
fn target(
    answer: impl FnOnce(&[u8]) -> Vec<u8> + Send + 'static,
    close: bool,
) -> (SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut req = vec![0u8; 128];
        s.read_exact(&mut req).unwrap();
        let out = answer(&req);
        s.write_all(&out).unwrap();
        if close {
            drop(s);
        } else {
            // Whatever the host sends next (a TermReq), until it closes.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            return [req, rest].concat();
        }
        req
    });
    (addr, t)
}

fn icresp(cpda: u8, dgst: u8, maxh2cdata: u32) -> Vec<u8> {
    let mut b = vec![0x01, 0, 128, 0, 128, 0, 0, 0, 0, 0, cpda, dgst];
    b.extend_from_slice(&maxh2cdata.to_le_bytes());
    b.resize(128, 0);
    b
}

fn opts(digests: DigestFlags) -> ConnectOptions {
    ConnectOptions {
        digests,
        hpda: 0,
        max_data: 1 << 20,
        bound: BOUND,
    }
}

#[test]
fn the_icreq_asks_for_what_was_chosen_and_the_icresp_settles_the_connection() {
    let (addr, t) = target(|_| icresp(3, 0x01, 65536), false);
    let c = Connection::connect(addr, &opts(DigestFlags::new().with_hdgst(true))).unwrap();
    let n = c.negotiated();
    assert!(n.hdgst && !n.ddgst);
    assert_eq!((n.cpda, n.maxh2cdata), (3, 65536));
    drop(c);
    let seen = t.join().unwrap();
    // ICReq: type 0, HLEN 128, PLEN 128, PFV 0, HPDA 0, DGST = header digests.
    assert_eq!(&seen[..8], &[0x00, 0, 128, 0, 128, 0, 0, 0]);
    assert_eq!((seen[10], seen[11]), (0, 0x01));
    assert_eq!(seen.len(), 128, "nothing more was sent");
}

#[test]
fn a_target_that_breaks_the_exchange_is_told_and_refused() {
    // A digest the host did not ask for: refused, and an H2CTermReq (Unsupported Parameter)
    // goes back before the socket closes.
    let (addr, t) = target(|_| icresp(0, 0x02, 65536), false);
    let e = Connection::connect(addr, &opts(DigestFlags::new())).unwrap_err();
    assert!(
        matches!(&e, TcpError::Fatal(f) if f.fes == Fes::UNSUPPORTED_PARAMETER),
        "{e}"
    );
    let seen = t.join().unwrap();
    assert_eq!(seen[128], 0x02, "an H2CTermReq followed the ICReq");
    assert_eq!(
        &seen[128 + 8..128 + 10],
        &Fes::UNSUPPORTED_PARAMETER.0.to_le_bytes()
    );
    // A CapsuleResp instead of the ICResp: a sequence error.
    let (addr, _t) = target(
        |_| {
            let mut b = vec![0x05, 0, 24, 0, 24, 0, 0, 0];
            b.resize(24, 0);
            b
        },
        false,
    );
    let e = Connection::connect(addr, &opts(DigestFlags::new())).unwrap_err();
    assert!(
        matches!(&e, TcpError::Fatal(f) if f.fes == Fes::PDU_SEQUENCE_ERROR),
        "{e}"
    );
    // A C2HTermReq: the target's reason, named.
    let (addr, _t) = target(
        |_| {
            let mut b = vec![0x03, 0, 24, 0, 24, 0, 0, 0];
            b.extend_from_slice(&Fes::UNSUPPORTED_PARAMETER.0.to_le_bytes());
            b.extend_from_slice(&11u32.to_le_bytes());
            b.resize(24, 0);
            b
        },
        false,
    );
    let e = Connection::connect(addr, &opts(DigestFlags::new())).unwrap_err();
    assert!(
        matches!(
            e,
            TcpError::Terminated {
                fes: Fes::UNSUPPORTED_PARAMETER,
                fei: 11
            }
        ),
        "{e}"
    );
}

#[test]
fn no_listener_a_closed_socket_and_a_silent_target_each_end_within_the_bound() {
    // No listener: a port just freed.
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = Connection::connect(addr, &opts(DigestFlags::new())).unwrap_err();
    assert!(matches!(e, TcpError::Connect { .. }), "{e}");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    // The target closes after reading the ICReq.
    let (addr, _t) = target(|_| Vec::new(), true);
    let e = Connection::connect(addr, &opts(DigestFlags::new())).unwrap_err();
    assert!(matches!(e, TcpError::Closed), "{e}");
    // A target that accepts and never answers: a timeout at about the bound.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let keep = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        std::thread::sleep(Duration::from_millis(1200));
        drop(s);
    });
    let t0 = Instant::now();
    let e = Connection::connect(addr, &opts(DigestFlags::new())).unwrap_err();
    assert!(
        matches!(
            e,
            TcpError::Timeout {
                waiting: "ICResp",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        t0.elapsed() < Duration::from_millis(1200),
        "{:?}",
        t0.elapsed()
    );
    keep.join().unwrap();
}

#[test]
fn a_connect_goes_in_one_capsule_with_its_data_and_its_completion_comes_back() {
    use nvme_spec::fabrics::{self, CNTLID_DYNAMIC, ConnectData};
    use zerocopy::IntoBytes;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut req = vec![0u8; 128];
        s.read_exact(&mut req).unwrap();
        s.write_all(&icresp(0, 0, 8192)).unwrap();
        // CapsuleCmd: HLEN 72, PDO 72, PLEN 72 + 1024.
        let mut cap = vec![0u8; 72 + 1024];
        s.read_exact(&mut cap).unwrap();
        let cid = u16::from_le_bytes([cap[8 + 2], cap[8 + 3]]);
        // The reply: CapsuleResp with DW0 = controller id 7.
        let mut resp = vec![0x05, 0, 24, 0, 24, 0, 0, 0];
        resp.extend_from_slice(&7u32.to_le_bytes());
        resp.extend_from_slice(&[0; 8]);
        resp.extend_from_slice(&cid.to_le_bytes());
        resp.extend_from_slice(&[0, 0]);
        s.write_all(&resp).unwrap();
        cap
    });
    let mut c = Connection::connect(addr, &opts(DigestFlags::new())).unwrap();
    let data = ConnectData::new([1; 16], CNTLID_DYNAMIC, "nqn.test:sub", "nqn.test:host").unwrap();
    let done = c
        .command(fabrics::connect(9, 0, 31, 0, 0), data.as_bytes())
        .unwrap();
    assert_eq!((done.cid, done.dw0), (9, 7));
    let cap = t.join().unwrap();
    assert_eq!((cap[0], cap[2], cap[3]), (0x04, 72, 72));
    assert_eq!(u32::from_le_bytes(cap[4..8].try_into().unwrap()), 72 + 1024);
    let sqe = &cap[8..72];
    assert_eq!((sqe[0], sqe[4]), (0x7f, 0x01), "Fabrics Connect");
    assert_eq!(&sqe[32..36], &1024u32.to_le_bytes(), "SGL1 length");
    assert_eq!(sqe[39], 0x01, "SGL1: in-capsule Data Block");
    assert_eq!(&cap[72 + 256..72 + 268], b"nqn.test:sub");
}
