//! The daemon against clients that speak the protocol by hand: the grants it makes, and each
//! way a lying client can misbehave, refused by name while the daemon lives and serves others.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use gpunvme_serve::{Budgets, ServeOptions, Server};
use gpunvme_serve_proto::msg::{RefusalKind, Reply, Request};
use gpunvme_serve_proto::socket::{Channel, SocketError};
use gpunvme_serve_proto::{Frame, Message, PROTOCOL_VERSION};
use gpunvme_serve_shm::SharedMemory;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

const BOUND: Duration = Duration::from_secs(5);

fn daemon(dir: &Path, budgets: Budgets, send_bound: Duration) -> Server {
    let image = dir.join("a.img");
    nvme_emu::EmuConfig::create_image(&image, 64 << 20).unwrap();
    let mut opts = ServeOptions::new(
        dir.join("serve.sock"),
        vec![("nvme0".into(), image.to_str().unwrap().into())],
    );
    opts.budgets = budgets;
    opts.send_bound = send_bound;
    opts.open.controller_queue_pairs = 8;
    Server::start(opts).unwrap()
}

fn connect(socket: &Path) -> Channel {
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    rustix::net::connect(&fd, &SocketAddrUnix::new(socket).unwrap()).unwrap();
    Channel::new(fd, BOUND)
}

fn ask(c: &Channel, id: u32, r: Request) -> (Reply, Vec<OwnedFd>) {
    c.send(
        &Frame {
            request_id: id,
            message: Message::Request(r),
        },
        &[],
    )
    .unwrap();
    let (f, fds) = c.recv().unwrap();
    assert_eq!(f.request_id, id, "a reply carries its request's id");
    match f.message {
        Message::Reply(r) => (r, fds),
        other => panic!("not a reply: {other:?}"),
    }
}

/// `CreateQueues` on nvme0 in `arena`: the reply and its descriptors.
fn create(
    c: &Channel,
    id: u32,
    arena: u64,
    count: u16,
    depth: u32,
    slot_bytes: u32,
) -> (Reply, Vec<OwnedFd>) {
    ask(
        c,
        id,
        Request::CreateQueues {
            controller: "nvme0".into(),
            arena,
            count,
            depth,
            slot_bytes,
        },
    )
}

fn hello(c: &Channel) {
    let (r, _) = ask(
        c,
        1,
        Request::Hello {
            version: PROTOCOL_VERSION,
            name: "test".into(),
        },
    );
    assert!(matches!(r, Reply::Welcome { .. }), "{r:?}");
}

fn refused(r: &Reply, want: RefusalKind, words: &str) {
    match r {
        Reply::Refused { kind, message } => {
            assert_eq!(*kind, want, "{message}");
            assert!(message.contains(words), "{message:?} lacks {words:?}");
        }
        other => panic!("not refused: {other:?}"),
    }
}

fn status(server: &Server) -> serde_json::Value {
    server.daemon().status()
}

/// Waits (bounded) until the daemon has reclaimed `n` clients.
fn reclaimed(server: &Server, n: u64) {
    let t = Instant::now();
    while server.daemon().reclaimed() < n {
        assert!(
            t.elapsed() < BOUND,
            "client not reclaimed: {}",
            status(server)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn arena(c: &Channel, id: u32, bytes: u64) -> (u64, u64, SharedMemory) {
    let (r, mut fds) = ask(
        c,
        id,
        Request::AllocArena {
            controller: "nvme0".into(),
            bytes,
        },
    );
    let Reply::Arena {
        id,
        device_address,
        len,
    } = r
    else {
        panic!("{r:?}")
    };
    assert_eq!(len, bytes);
    let mem = SharedMemory::from_fd(fds.pop().unwrap(), len as usize).unwrap();
    (id, device_address, mem)
}

#[test]
fn a_client_gets_arenas_and_queues_and_all_of_it_is_reclaimed_when_it_goes() {
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path(), Budgets::default(), BOUND);
    let c = connect(server.socket());
    hello(&c);
    let (r, _) = ask(
        &c,
        2,
        Request::OpenController {
            controller: "nvme0".into(),
        },
    );
    let Reply::Controller {
        queues_free,
        namespaces,
        ..
    } = r
    else {
        panic!("{r:?}")
    };
    assert!(queues_free >= 2, "{queues_free}");
    assert_eq!(namespaces.len(), 1);
    assert_eq!(
        namespaces[0].blocks * u64::from(namespaces[0].lba_size),
        64 << 20
    );
    let (aid, base, mem) = arena(&c, 3, 4 << 20);
    assert_ne!(base, 0);
    let (r, fds) = create(&c, 4, aid, 2, 16, 8192);
    let Reply::Queues { queues } = r else {
        panic!("{r:?}")
    };
    assert_eq!(queues.len(), 2);
    assert_eq!(fds.len(), 1, "the doorbell page");
    let page = SharedMemory::from_fd(fds.into_iter().next().unwrap(), 4096).unwrap();
    assert_eq!(page.len(), 4096);
    // Laid out as docs/serve.md says: SQ, CQ, two PRP list pages per slot, then the slots
    // (the GPU protocol's order), page-aligned, in the arena.
    let q = &queues[0];
    assert_eq!(
        (q.sq, q.cq, q.prp_lists, q.slots),
        (0, 4096, 8192, 8192 + 32 * 4096)
    );
    assert!(queues[1].sq >= q.slots + 16 * 8192);
    assert_ne!(q.sq_doorbell, queues[1].sq_doorbell);
    assert!(mem.len() as u64 >= queues[1].slots + 16 * 8192);
    let s = status(&server);
    assert_eq!(s["controllers"][0]["lent_queue_pairs"], 2, "{s}");
    assert_eq!(
        s["clients"][0]["queues"].as_array().unwrap().len(),
        2,
        "{s}"
    );
    assert_eq!(s["clients"][0]["arena_bytes"], 4 << 20, "{s}");
    // The client goes: its queues are deleted, then its arena released, nothing late.
    drop(c);
    reclaimed(&server, 1);
    let s = status(&server);
    assert_eq!(s["controllers"][0]["lent_queue_pairs"], 0, "{s}");
    assert_eq!(s["clients"].as_array().unwrap().len(), 0, "{s}");
    assert_eq!(s["released_arenas"], 1, "{s}");
    assert_eq!(s["late_controller_writes"], 0, "{s}");
    // The queue ids are free again: a new client gets two.
    let c2 = connect(server.socket());
    hello(&c2);
    let (aid, _, _m) = arena(&c2, 2, 4 << 20);
    let (r, _) = create(&c2, 3, aid, 2, 16, 8192);
    assert!(matches!(r, Reply::Queues { .. }), "{r:?}");
    server.stop();
}

#[test]
fn malformed_frames_wrong_versions_and_descriptors_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path(), Budgets::default(), BOUND);
    let c = connect(server.socket());
    // Before Hello: nothing else.
    let (r, _) = ask(&c, 7, Request::Status);
    refused(&r, RefusalKind::InvalidArgument, "Hello");
    // A short datagram: refused, the connection goes on.
    c.send_raw(b"GNVS\x01", &[]).unwrap();
    let (f, _) = c.recv().unwrap();
    let Message::Reply(r) = f.message else {
        panic!()
    };
    refused(&r, RefusalKind::Protocol, "shorter than its 16-byte header");
    // A body with a field no message has.
    let hello_bytes = Frame {
        request_id: 9,
        message: Message::Request(Request::Hello {
            version: PROTOCOL_VERSION,
            name: "x".into(),
        }),
    }
    .encode()
    .unwrap();
    let mut bad = hello_bytes.clone();
    let body = br#"{"Request":{"Hello":{"version":1,"name":"x","root":true}}}"#;
    bad.truncate(16);
    bad[12..16].copy_from_slice(&(body.len() as u32).to_le_bytes());
    bad.extend_from_slice(body);
    c.send_raw(&bad, &[]).unwrap();
    let (f, _) = c.recv().unwrap();
    assert_eq!(f.request_id, 9);
    let Message::Reply(r) = f.message else {
        panic!()
    };
    refused(&r, RefusalKind::Protocol, "root");
    // A request with a descriptor (requests carry none): refused, the descriptor closed.
    let memfd = SharedMemory::create("lie", 4096).unwrap();
    c.send_raw(&hello_bytes, &[memfd.fd()]).unwrap();
    let (f, _) = c.recv().unwrap();
    let Message::Reply(r) = f.message else {
        panic!()
    };
    refused(&r, RefusalKind::Protocol, "descriptor");
    // An admin opcode outside the allowlist (Format NVM), hand-encoded: the encoder refuses it.
    self_hello(&c);
    let body = br#"{"Request":{"Admin":{"controller":"nvme0","opcode":128,"nsid":1,"cdw":[0,0,0,0,0,0],"arena":1,"offset":0}}}"#;
    c.send_raw(&frame_bytes(11, 7, body), &[]).unwrap();
    let (f, _) = c.recv().unwrap();
    let Message::Reply(r) = f.message else {
        panic!()
    };
    refused(&r, RefusalKind::Protocol, "operator");
    // Another protocol version: one refusal naming both, then the connection ends.
    let mut v2 = hello_bytes.clone();
    v2[4..6].copy_from_slice(&2u16.to_le_bytes());
    c.send_raw(&v2, &[]).unwrap();
    let (f, _) = c.recv().unwrap();
    let Message::Reply(r) = f.message else {
        panic!()
    };
    refused(&r, RefusalKind::Protocol, "version 2");
    assert!(matches!(c.recv(), Err(SocketError::Closed)));
    // Not a gpunvme frame at all: refused, then closed.
    let c = connect(server.socket());
    c.send_raw(&[0xff; 64], &[]).unwrap();
    let (f, _) = c.recv().unwrap();
    let Message::Reply(r) = f.message else {
        panic!()
    };
    refused(&r, RefusalKind::Protocol, "not a gpunvme serve frame");
    assert!(matches!(c.recv(), Err(SocketError::Closed)));
    // The daemon lives and serves the next client.
    let c = connect(server.socket());
    hello(&c);
    server.stop();
}

fn frame_bytes(id: u32, kind: u16, body: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GNVS");
    b.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(&id.to_le_bytes());
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(body);
    b
}

fn self_hello(c: &Channel) {
    let (r, _) = ask(
        c,
        10,
        Request::Hello {
            version: PROTOCOL_VERSION,
            name: "liar".into(),
        },
    );
    assert!(matches!(r, Reply::Welcome { .. }), "{r:?}");
}

#[test]
fn another_clients_queues_and_arenas_and_budgets_past_their_numbers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let budgets = Budgets {
        queues: 4,
        depth: 64,
        arena_bytes: 8 << 20,
        arenas: 2,
    };
    let server = daemon(dir.path(), budgets, BOUND);
    let a = connect(server.socket());
    hello(&a);
    let (a_arena, _, _am) = arena(&a, 2, 4 << 20);
    let (r, _) = create(&a, 3, a_arena, 2, 16, 4096);
    let Reply::Queues { queues } = r else {
        panic!("{r:?}")
    };
    let a_qid = queues[0].qid;
    let b = connect(server.socket());
    hello(&b);
    // A's queue, A's arena: not B's.
    let (r, _) = ask(
        &b,
        2,
        Request::DeleteQueues {
            controller: "nvme0".into(),
            qids: vec![a_qid],
        },
    );
    refused(
        &r,
        RefusalKind::NotFound,
        &format!("queue {a_qid} on nvme0 is not one of this client's"),
    );
    let (r, _) = ask(&b, 3, Request::FreeArena { arena: a_arena });
    refused(&r, RefusalKind::NotFound, "not one of this client's");
    let (r, _) = create(&b, 4, a_arena, 1, 16, 4096);
    refused(&r, RefusalKind::NotFound, "not one of this client's");
    // B's budgets, with the numbers.
    let (b_arena, _, _bm) = arena(&b, 5, 4 << 20);
    let (r, _) = ask(
        &b,
        6,
        Request::AllocArena {
            controller: "nvme0".into(),
            bytes: 8 << 20,
        },
    );
    refused(&r, RefusalKind::Budget, "budget of 8388608 bytes");
    let (r, _) = create(&b, 7, b_arena, 1, 128, 4096);
    refused(&r, RefusalKind::Budget, "the budget is 64 entries");
    let (r, _) = create(&b, 8, b_arena, 5, 16, 4096);
    refused(&r, RefusalKind::Budget, "budget of 4 per client");
    // An arena too small for the layout: the bytes needed and free.
    let (r, _) = create(&b, 9, b_arena, 4, 64, 65536);
    refused(&r, RefusalKind::InvalidArgument, "bytes of arena");
    // A million queues, asked 64 at a time: each refused, never granted (the controller has 8,
    // A holds 2, so B gets at most its budget of 4).
    let mut granted = 0;
    for i in 0..200u32 {
        let (r, _) = create(&b, 100 + i, b_arena, if i == 0 { 4 } else { 64 }, 2, 4096);
        if let Reply::Queues { queues } = r {
            granted += queues.len();
        }
    }
    assert_eq!(granted, 4);
    let s = status(&server);
    assert_eq!(s["controllers"][0]["lent_queue_pairs"], 6, "{s}");
    // A's queue still works as A's: A deletes it.
    let (r, _) = ask(
        &a,
        4,
        Request::DeleteQueues {
            controller: "nvme0".into(),
            qids: vec![a_qid],
        },
    );
    assert!(matches!(r, Reply::Done { status: 0, .. }), "{r:?}");
    // An arena with queues in it cannot be freed.
    let (r, _) = ask(&a, 5, Request::FreeArena { arena: a_arena });
    refused(&r, RefusalKind::InvalidArgument, "still holds queues");
    server.stop();
}

#[test]
fn a_client_that_never_reads_its_replies_is_disconnected_and_reclaimed() {
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path(), Budgets::default(), Duration::from_millis(200));
    let quiet = connect(server.socket());
    hello(&quiet);
    let (aid, _, _m) = arena(&quiet, 2, 1 << 20);
    // Requests and never a read: the daemon's replies fill the socket, a send runs past its
    // bound, and the client is cut off. The loop is bounded: it ends when sends fail.
    let status = Frame {
        request_id: 3,
        message: Message::Request(Request::Status),
    };
    let t = Instant::now();
    while quiet.send(&status, &[]).is_ok() {
        assert!(t.elapsed() < Duration::from_secs(30), "never disconnected");
    }
    reclaimed(&server, 1);
    let s = server.daemon().status();
    assert_eq!(s["clients"].as_array().unwrap().len(), 0, "{s}");
    assert_eq!(s["released_arenas"], 1, "{s}");
    let _ = aid;
    // Others are served.
    let c = connect(server.socket());
    hello(&c);
    let _ = quiet.fd().as_fd();
    server.stop();
}

#[test]
fn a_second_daemon_on_a_live_socket_is_refused_and_a_stale_socket_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path(), Budgets::default(), BOUND);
    let other = dir.path().join("b.img");
    nvme_emu::EmuConfig::create_image(&other, 16 << 20).unwrap();
    let e = Server::start(ServeOptions::new(
        server.socket().to_owned(),
        vec![("x".into(), other.to_str().unwrap().into())],
    ))
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("a daemon already serves"), "{e}");
    let socket = server.socket().to_owned();
    // Killed without removing its socket: simulated by a socket file nobody listens on.
    server.stop();
    let _listener_gone = std::os::unix::net::UnixDatagram::bind(&socket).unwrap();
    let s = Server::start(ServeOptions::new(
        socket,
        vec![("x".into(), other.to_str().unwrap().into())],
    ))
    .unwrap();
    let c = connect(s.socket());
    hello(&c);
    s.stop();
}

#[test]
fn doorbell_values_outside_the_ring_fail_only_the_liars_queue() {
    use gpunvme_serve_client::check::{CheckOptions, run};
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path(), Budgets::default(), BOUND);
    let liar = connect(server.socket());
    hello(&liar);
    let (aid, _, _m) = arena(&liar, 2, 1 << 20);
    let (r, fds) = create(&liar, 3, aid, 1, 16, 4096);
    let Reply::Queues { queues } = r else {
        panic!("{r:?}")
    };
    let page = SharedMemory::from_fd(fds.into_iter().next().unwrap(), 4096).unwrap();
    let g = queues[0];
    // An honest client verifies meanwhile, on its own range.
    let socket = server.socket().to_owned();
    let honest = std::thread::spawn(move || {
        let conn = gpunvme_serve_client::Connection::connect(&socket, "honest", BOUND).unwrap();
        let opts = CheckOptions {
            lbas: 8192,
            first_lba: 65536,
            runtime: Some(Duration::from_millis(500)),
            ..CheckOptions::default()
        };
        run(&conn, &opts).unwrap()
    });
    // A tail past the ring, then a CQ head past anything posted.
    page.store_u32(g.sq_doorbell as usize, 16 + 5, Ordering::Release)
        .unwrap();
    let t = Instant::now();
    while status(&server)["controllers"][0]["invalid_doorbell_writes"] == 0 {
        assert!(t.elapsed() < BOUND, "never refused: {}", status(&server));
        std::thread::sleep(Duration::from_millis(5));
    }
    page.store_u32(g.cq_doorbell as usize, 7, Ordering::Release)
        .unwrap();
    let t = Instant::now();
    while status(&server)["controllers"][0]["invalid_doorbell_writes"].as_u64() < Some(2) {
        assert!(t.elapsed() < BOUND, "never refused: {}", status(&server));
        std::thread::sleep(Duration::from_millis(5));
    }
    let r = honest.join().unwrap();
    assert_eq!((r.errors, r.mismatched_bytes), (0, 0), "{r:?}");
    assert!(r.ios > 0);
    // The liar's queue is still its own to delete; the daemon lives.
    let (r, _) = ask(
        &liar,
        4,
        Request::DeleteQueues {
            controller: "nvme0".into(),
            qids: vec![g.qid],
        },
    );
    assert!(matches!(r, Reply::Done { status: 0, .. }), "{r:?}");
    let s = status(&server);
    assert!(s["controllers"][0]["degraded"].is_null(), "{s}");
    server.stop();
}

#[test]
fn a_delete_that_fails_degrades_the_controller_keeps_the_memory_and_tells_every_client() {
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path(), Budgets::default(), BOUND);
    let a = connect(server.socket());
    hello(&a);
    let (aid, _, _am) = arena(&a, 2, 1 << 20);
    let (r, _) = create(&a, 3, aid, 2, 16, 4096);
    assert!(matches!(r, Reply::Queues { .. }), "{r:?}");
    let b = connect(server.socket());
    hello(&b);
    let (bid, _, _bm) = arena(&b, 2, 1 << 20);
    // The controller fails: A's queues cannot be deleted when A goes.
    server.daemon().controllers()[0]
        .emu()
        .unwrap()
        .faults()
        .fatal();
    drop(a);
    reclaimed(&server, 1);
    let s = status(&server);
    let why = s["controllers"][0]["degraded"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(why.contains("deleting queues"), "{s}");
    assert_eq!(s["quarantined_arenas"], 1, "A's arena stays mapped: {s}");
    assert_eq!(s["released_arenas"], 0, "{s}");
    // B is told, by an event, and new queues are refused with the reason.
    let (f, _) = b.recv().unwrap();
    assert_eq!(f.request_id, 0);
    match f.message {
        Message::Event(gpunvme_serve_proto::Event::ControllerFailed { controller, why }) => {
            assert_eq!(controller, "nvme0");
            assert!(why.contains("deleting queues"), "{why}");
        }
        other => panic!("not the event: {other:?}"),
    }
    let (r, _) = create(&b, 3, bid, 1, 16, 4096);
    refused(&r, RefusalKind::Device, "degraded");
    drop(b);
    server.stop();
}

#[test]
fn the_socket_admits_the_daemons_user_or_its_group_and_nobody_else() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let server = daemon(dir.path(), Budgets::default(), BOUND);
    let mode = std::fs::metadata(server.socket())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    server.stop();
    let image = dir.path().join("a.img");
    let gid = std::fs::metadata(&image).unwrap().gid();
    let mut opts = ServeOptions::new(
        dir.path().join("g.sock"),
        vec![("nvme0".into(), image.to_str().unwrap().into())],
    );
    opts.group = Some(gid);
    let s = Server::start(opts).unwrap();
    let meta = std::fs::metadata(s.socket()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), gid);
    s.stop();
    assert_eq!(gpunvme_serve::group_id("root").unwrap(), 0);
    assert_eq!(gpunvme_serve::group_id("4242").unwrap(), 4242);
    let e = gpunvme_serve::group_id("no-such-group-here")
        .unwrap_err()
        .to_string();
    assert!(e.contains("no group \"no-such-group-here\""), "{e}");
}
