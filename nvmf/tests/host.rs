//! The NVMe/TCP host (bring-up, I/O queues, reads and writes) against the fake target of
//! `common`: the paths SPDK takes (SUCCESS flag, in-capsule writes) and those it never takes by
//! itself (a CapsuleResp after every read, no in-capsule data, read data in many PDUs, several
//! R2Ts per write, H2CData cut at a small MAXH2CDATA, CPDA padding, digests), and each way a
//! target can break a queue, a typed error within the bound.

mod common;

use std::time::{Duration, Instant};

use common::{Fault, Knobs};
use nvme_spec::tcp::DigestFlags;
use nvmf::host::{Controller, FabricsError, HostOptions, Target};
use nvmf::tcp::conn::{ConnectOptions, TcpError};

fn host(digests: bool, bound: Duration) -> HostOptions {
    HostOptions {
        connect: ConnectOptions {
            digests: DigestFlags::new().with_hdgst(digests).with_ddgst(digests),
            bound,
            ..ConnectOptions::default()
        },
        kato: Duration::from_millis(200),
        timeout: bound,
        ..HostOptions::default()
    }
}

fn target(t: &common::Target) -> Target {
    Target {
        addr: t.addr,
        subnqn: "nqn.2026-12.test:fake".into(),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Writes and reads back 512 B to 1 MiB at a few LBAs; returns the controller.
fn round_trips(t: &common::Target, digests: bool) -> Controller {
    let c = Controller::connect(&target(t), &host(digests, Duration::from_secs(5))).unwrap();
    let ns = c.namespace(1).unwrap();
    assert_eq!((ns.blocks, ns.lba_size), (4096, 512));
    let mut q = c.io_queue(16).unwrap();
    for (i, len) in [512usize, 4096, 8192, 65536, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let lba = (i * 64) as u64;
        let data = pattern(len, i as u8);
        q.write(1, lba, &data, 512).unwrap();
        let at = lba as usize * 512;
        assert!(
            t.media.lock().unwrap()[at..at + len] == data[..],
            "the target holds what was written ({len} bytes)"
        );
        let back = q.read(1, lba, (len / 512) as u32, 512).unwrap();
        assert!(back == data, "{len} bytes read back");
    }
    c
}

#[test]
fn bring_up_follows_the_spec_and_io_round_trips_the_way_spdk_answers() {
    let t = common::start(Knobs::default());
    let c = round_trips(&t, false);
    assert_eq!(c.cntlid(), 1);
    assert_eq!(c.version(), 0x0001_0300);
    assert_eq!(c.io_queues(), 4);
    assert_eq!(c.io_in_capsule(), 4096);
    assert_eq!(c.max_transfer(), 128 << 10, "MDTS 5 of 4 KiB pages");
    assert_eq!(&c.identify().mn[..12], b"gpunvme fake");
    let s = t.seen.lock().unwrap();
    // CC: EN, IOSQES 6, IOCQES 4.
    assert_eq!(s.cc & 1, 1);
    assert_eq!((s.cc >> 16) & 0xf, 6);
    assert_eq!((s.cc >> 20) & 0xf, 4);
    assert_eq!(s.connects, vec![0, 1], "the admin queue, then I/O queue 1");
    assert!(
        s.in_capsule_writes >= 2,
        "writes of up to 4 KiB travel in the capsule"
    );
    drop(s);
    c.shutdown().unwrap();
    assert_eq!((t.seen.lock().unwrap().cc >> 14) & 3, 1, "CC.SHN normal");
}

#[test]
fn a_strict_target_without_success_flag_or_in_capsule_data_and_many_pdus_per_command() {
    let t = common::start(Knobs {
        success_flag: false,
        in_capsule: 0,
        c2h_piece: 1000,
        r2t_piece: 12 << 10,
        maxh2cdata: 4096,
        cpda: 3,
        ..Knobs::default()
    });
    let _c = round_trips(&t, true);
    let s = t.seen.lock().unwrap();
    assert_eq!(s.in_capsule_writes, 0);
    assert!(s.r2ts > 10, "several R2Ts per write ({})", s.r2ts);
    assert!(
        s.h2c_pdus > 2 * s.r2ts,
        "R2Ts answered by several H2CData each"
    );
    assert_eq!(s.largest_h2c, 4096, "cut at MAXH2CDATA");
}

#[test]
fn keep_alive_is_sent_within_the_timeout() {
    let t = common::start(Knobs::default());
    let c = Controller::connect(&target(&t), &host(false, Duration::from_secs(5))).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let n = t.seen.lock().unwrap().keep_alives;
    assert!(
        (2..=8).contains(&n),
        "{n} Keep Alives in 700 ms at KATO 200 ms"
    );
    drop(c);
}

#[test]
fn bad_requests_are_refused_before_anything_is_sent() {
    let t = common::start(Knobs::default());
    let c = Controller::connect(&target(&t), &host(false, Duration::from_secs(5))).unwrap();
    let mut q = c.io_queue(8).unwrap();
    assert!(matches!(
        q.write(1, 0, &[0u8; 100], 512),
        Err(FabricsError::InvalidArgument(_))
    ));
    assert!(matches!(
        q.read(1, 0, 8, 1000),
        Err(FabricsError::InvalidArgument(_))
    ));
    // Past the namespace: the target's status, and the queue goes on.
    assert!(matches!(
        q.read(1, 4095, 2, 512),
        Err(FabricsError::Command { status, .. }) if status.sc == 0x80
    ));
    assert_eq!(q.read(1, 0, 1, 512).unwrap().len(), 512);
    // Every I/O queue the controller granted is connected; one more is refused by name.
    let _more: Vec<_> = (0..3).map(|_| c.io_queue(8).unwrap()).collect();
    assert!(matches!(
        c.io_queue(8),
        Err(FabricsError::InvalidArgument(_))
    ));
}

fn faulted(f: Fault) -> (FabricsError, Duration) {
    let t = common::start(Knobs {
        fault: Some(f),
        ..Knobs::default()
    });
    let bound = Duration::from_millis(800);
    let c = Controller::connect(&target(&t), &host(false, bound)).unwrap();
    let mut q = c.io_queue(8).unwrap();
    let start = Instant::now();
    let e = q.read(1, 0, 8, 512).unwrap_err();
    let took = start.elapsed();
    // The queue is done for: the next command fails at once.
    assert!(q.read(1, 0, 1, 512).is_err());
    (e, took)
}

#[test]
fn a_target_that_breaks_a_queue_gets_a_typed_error_within_the_bound() {
    let (e, _) = faulted(Fault::UnknownCid);
    assert!(
        matches!(&e, FabricsError::Tcp(TcpError::Fatal(f)) if f.why.contains("not in flight")),
        "{e}"
    );
    let (e, _) = faulted(Fault::OutOfRange);
    assert!(
        matches!(&e, FabricsError::Tcp(TcpError::Fatal(f)) if f.fes.0 == 0x04),
        "{e}"
    );
    let (e, _) = faulted(Fault::TermReq);
    assert!(
        matches!(&e, FabricsError::Tcp(TcpError::Terminated { .. })),
        "{e}"
    );
    let (e, _) = faulted(Fault::Close);
    assert!(matches!(&e, FabricsError::Tcp(TcpError::Closed)), "{e}");
    let (e, took) = faulted(Fault::Silent);
    assert!(
        matches!(&e, FabricsError::Tcp(TcpError::Timeout { .. })),
        "{e}"
    );
    assert!(
        took < Duration::from_millis(800 + 400),
        "a silent target noticed at the bound ({took:?})"
    );
}

#[test]
fn a_wrong_address_is_a_typed_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let e = Controller::connect(
        &Target {
            addr,
            subnqn: "nqn.x".into(),
        },
        &host(false, Duration::from_millis(500)),
    )
    .unwrap_err();
    assert!(
        matches!(e, FabricsError::Tcp(TcpError::Connect { .. })),
        "{e}"
    );
}

fn listed(n: usize) -> Vec<(u8, u8, String, String, String)> {
    let mut v = vec![(3u8, 3u8, String::new(), "127.0.0.1".into(), "4420".into())];
    for i in 0..n {
        v.push((
            3,
            2,
            format!("nqn.2026-12.test:sub{i}"),
            "127.0.0.1".into(),
            "4420".into(),
        ));
    }
    // A vfio-user subsystem: another transport, no address.
    v.push((
        0,
        2,
        "nqn.2026-12.test:vfio".into(),
        String::new(),
        String::new(),
    ));
    v
}

#[test]
fn discovery_reads_every_entry_and_names_the_tcp_subsystems() {
    // 70 subsystems: the entries take two reads after the header.
    let t = common::start(Knobs {
        discovery: listed(70),
        ..Knobs::default()
    });
    let e = nvmf::discovery::discover(t.addr, &host(false, Duration::from_secs(5))).unwrap();
    assert_eq!(e.len(), 72);
    let tcp: Vec<_> = e.iter().filter(|e| e.is_tcp_subsystem()).collect();
    assert_eq!(tcp.len(), 70);
    assert_eq!(tcp[69].subnqn, "nqn.2026-12.test:sub69");
    assert_eq!(
        (tcp[0].traddr.as_str(), tcp[0].trsvcid.as_str()),
        ("127.0.0.1", "4420")
    );
    assert!(!e[71].is_tcp_subsystem() && e[71].traddr.is_empty());
    assert_eq!(
        t.seen.lock().unwrap().log_reads,
        4,
        "header, 64 + 8 entries, header again"
    );
}

#[test]
fn a_discovery_log_that_changes_while_read_is_read_again() {
    let t = common::start(Knobs {
        discovery: listed(2),
        genctr_changes_after: Some(1),
        ..Knobs::default()
    });
    let e = nvmf::discovery::discover(t.addr, &host(false, Duration::from_secs(5))).unwrap();
    assert_eq!(e.len(), 4);
    // First round: header (7), entries, header (8): changed; second round consistent.
    assert_eq!(t.seen.lock().unwrap().log_reads, 6);
}

#[test]
fn a_data_digest_that_does_not_match_fails_only_its_command() {
    let t = common::start(Knobs {
        fault: Some(Fault::BadDigest),
        ..Knobs::default()
    });
    let c = Controller::connect(&target(&t), &host(true, Duration::from_secs(5))).unwrap();
    let mut q = c.io_queue(8).unwrap();
    let e = q.read(1, 0, 8, 512).unwrap_err();
    assert!(
        matches!(&e, FabricsError::Command { status, .. } if status.sc == 0x22),
        "Transient Transport Error expected: {e}"
    );
    // The connection goes on: the same read again, its digest right this time.
    assert_eq!(q.read(1, 0, 8, 512).unwrap().len(), 4096);
}
