//! The connection against the fake daemon (`fake/`): Hello and versions, refusals mapped by
//! kind, arenas, grants checked, deletes and frees, admin and status, raw requests, events
//! that revoke pairs, and the daemon's end.

mod fake;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake::{BOUND, CONTROLLER, LBA_SIZE, NSID};
use gpunvme_serve_client::layout::arena_bytes_for;
use gpunvme_serve_client::{ClientError, Connection, Event, PROTOCOL_VERSION, RefusalKind};
use gpunvme_serve_proto::socket::Channel;
use gpunvme_serve_proto::{Frame, Message, Reply, Request};

#[test]
fn hello_welcome_and_the_controller() {
    let (conn, fake) = fake::start();
    let w = conn.welcome();
    assert_eq!(w.version, PROTOCOL_VERSION);
    assert_eq!(w.daemon, "fake-serve 0");
    assert!(w.trust.contains("cooperative"));
    assert_eq!(w.controllers, [CONTROLLER]);
    let info = conn.controller(CONTROLLER).unwrap();
    assert_eq!(info.namespace(NSID).unwrap().lba_size, LBA_SIZE);
    assert!(info.namespace(2).is_none());
    let e = conn.controller("nope").unwrap_err();
    assert!(
        matches!(&e, ClientError::Refused { kind: RefusalKind::NotFound, message } if message.contains("nope")),
        "{e}"
    );
    // Request ids increase from 1, one per request.
    conn.status().unwrap();
    assert_eq!(*fake.knobs.request_ids.lock().unwrap(), [1, 2, 3, 4]);
}

#[test]
fn requests_from_many_threads_are_sequential_with_increasing_ids() {
    let (conn, fake) = fake::start();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..25 {
                    conn.status().unwrap();
                }
            });
        }
    });
    let ids = fake.knobs.request_ids.lock().unwrap().clone();
    assert_eq!(ids, (1..=101).collect::<Vec<u32>>());
}

#[test]
fn connect_over_a_socket_path() {
    let path =
        std::env::temp_dir().join(format!("gpunvme-client-test-{}.sock", std::process::id()));
    let server = fake::listen(&path);
    let conn = Connection::connect(&path, "path-client", BOUND).unwrap();
    let _fake = server.join().unwrap();
    assert_eq!(conn.welcome().controllers, [CONTROLLER]);
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, arena_bytes_for(1, 4, 4096))
            .unwrap(),
    );
    let mut qp = conn
        .create_queues(CONTROLLER, &arena, 1, 4, 4096)
        .unwrap()
        .pop()
        .unwrap();
    qp.write(NSID, 3, 1, LBA_SIZE, &[9; 512]).unwrap();
    let mut back = [0u8; 512];
    qp.read(NSID, 3, 1, LBA_SIZE, &mut back).unwrap();
    assert_eq!(back, [9; 512]);
    std::fs::remove_file(&path).unwrap();
    // Nobody there.
    let e = Connection::connect(&path, "x", BOUND).unwrap_err();
    assert!(matches!(e, ClientError::Connect { .. }), "{e}");
    assert!(e.to_string().contains("gpunvme-client-test"), "{e}");
}

#[test]
fn another_version_is_refused_naming_both() {
    // In the Welcome's body.
    let knobs = fake::Knobs::default();
    knobs
        .welcome_version
        .store(PROTOCOL_VERSION + 1, Ordering::Relaxed);
    let Err((e, _fake)) = fake::start_with(knobs) else {
        panic!("connected to a daemon of another version")
    };
    assert!(
        matches!(e, ClientError::Version { daemon, client } if daemon == PROTOCOL_VERSION + 1 && client == PROTOCOL_VERSION),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains(&format!("version {}", PROTOCOL_VERSION + 1)),
        "{text}"
    );
    assert!(
        text.contains(&format!("speaks {PROTOCOL_VERSION}")),
        "{text}"
    );

    // In the frame's header: a daemon of version 2 answering with its own header.
    let (ours, theirs) = Channel::pair(BOUND).unwrap();
    let daemon = std::thread::spawn(move || {
        let (hello, _) = theirs.recv().unwrap();
        let refusal = Frame {
            request_id: hello.request_id,
            message: Message::Reply(Reply::Refused {
                kind: RefusalKind::Protocol,
                message: "protocol version 1, this daemon speaks 2".into(),
            }),
        };
        let mut bytes = refusal.encode().unwrap();
        bytes[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        theirs.send_raw(&bytes, &[]).unwrap();
    });
    let e = Connection::from_channel(ours, "old", BOUND).unwrap_err();
    daemon.join().unwrap();
    assert!(
        matches!(e, ClientError::Version { daemon, client } if daemon == PROTOCOL_VERSION + 1 && client == PROTOCOL_VERSION),
        "{e}"
    );

    // A refusal of our Hello in our version: mapped by kind.
    let (ours, theirs) = Channel::pair(BOUND).unwrap();
    let daemon = std::thread::spawn(move || {
        let (hello, _) = theirs.recv().unwrap();
        let refusal = Frame {
            request_id: hello.request_id,
            message: Message::Reply(Reply::Refused {
                kind: RefusalKind::PermissionDenied,
                message: "uid 1000 is not in group gpunvme".into(),
            }),
        };
        theirs.send(&refusal, &[]).unwrap();
    });
    let e = Connection::from_channel(ours, "stranger", BOUND).unwrap_err();
    daemon.join().unwrap();
    assert!(
        matches!(&e, ClientError::Refused { kind: RefusalKind::PermissionDenied, message } if message.contains("gpunvme")),
        "{e}"
    );
}

#[test]
fn a_silent_daemon_times_out_and_a_wrong_reply_is_a_protocol_error() {
    let bound = Duration::from_millis(100);
    let (ours, theirs) = Channel::pair(bound).unwrap();
    let t = Instant::now();
    let e = Connection::from_channel(ours, "x", bound).unwrap_err();
    assert!(matches!(e, ClientError::Socket { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
    drop(theirs);

    let (ours, theirs) = Channel::pair(BOUND).unwrap();
    let daemon = std::thread::spawn(move || {
        let (hello, _) = theirs.recv().unwrap();
        let wrong = Frame {
            request_id: hello.request_id,
            message: Message::Reply(Reply::Status { json: "{}".into() }),
        };
        theirs.send(&wrong, &[]).unwrap();
    });
    let e = Connection::from_channel(ours, "x", BOUND).unwrap_err();
    assert!(
        matches!(&e, ClientError::Protocol(why) if why.contains("hello was answered by a status-reply")),
        "{e}"
    );
    drop(e);
    daemon.join().unwrap();
}

#[test]
fn refusals_are_mapped_by_kind() {
    let knobs = fake::Knobs::default();
    *knobs.refuse_alloc.lock().unwrap() = Some((
        RefusalKind::Budget,
        "an arena of 1 GiB is past the budget of 64 MiB".into(),
    ));
    let (conn, _fake) = fake::start_with(knobs).ok().unwrap();
    let e = conn.alloc_arena(CONTROLLER, 1 << 30).unwrap_err();
    let ClientError::Refused { kind, message } = &e else {
        panic!("{e}")
    };
    assert_eq!(*kind, RefusalKind::Budget);
    assert!(message.contains("64 MiB"));
    assert!(e.to_string().contains("Budget"), "{e}");
    // The layout refused for an arena too small.
    let arena = Arc::new(conn.alloc_arena(CONTROLLER, 4096).unwrap());
    let e = conn
        .create_queues(CONTROLLER, &arena, 1, 8, 4096)
        .unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Refused {
                kind: RefusalKind::InvalidArgument,
                ..
            }
        ),
        "{e}"
    );
    // Our own request outside the protocol's limits never leaves.
    let e = conn.alloc_arena(CONTROLLER, 100).unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
    let e = conn
        .create_queues(CONTROLLER, &arena, 1, 1, 4096)
        .unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
}

#[test]
fn overlapping_grants_are_a_protocol_error() {
    let knobs = fake::Knobs::default();
    knobs.overlap_grants.store(true, Ordering::Relaxed);
    let (conn, _fake) = fake::start_with(knobs).ok().unwrap();
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, arena_bytes_for(2, 8, 4096))
            .unwrap(),
    );
    let e = conn
        .create_queues(CONTROLLER, &arena, 2, 8, 4096)
        .unwrap_err();
    assert!(
        matches!(&e, ClientError::Protocol(why) if why.contains("overlaps")),
        "{e}"
    );
}

#[test]
fn delete_free_admin_status_and_raw_requests() {
    let (conn, fake) = fake::start();
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, arena_bytes_for(2, 8, 4096) + 4096)
            .unwrap(),
    );
    assert_eq!(arena.device_address % 4096, 0);
    let pairs = conn.create_queues(CONTROLLER, &arena, 2, 8, 4096).unwrap();
    assert_eq!(pairs.iter().map(|p| p.qid()).collect::<Vec<_>>(), [1, 2]);
    assert!(conn.status().unwrap().contains("\"queues\": 2"));

    // Identify into the page after the queues.
    let offset = arena_bytes_for(2, 8, 4096);
    let (status, result) = conn
        .admin(CONTROLLER, 0x06, 0, [1, 0, 0, 0, 0, 0], &arena, offset)
        .unwrap();
    assert_eq!((status, result), (0, 0x1234));
    let mut page = vec![0u8; 4096];
    arena.mem.read(offset as usize, &mut page).unwrap();
    assert!(page.iter().all(|&b| b == 0x06));
    // Not on the allowlist, or data outside the arena: never sent.
    for e in [
        conn.admin(CONTROLLER, 0x80, 0, [0; 6], &arena, 0)
            .unwrap_err(),
        conn.admin(CONTROLLER, 0x06, 0, [0; 6], &arena, 100)
            .unwrap_err(),
        conn.admin(CONTROLLER, 0x06, 0, [0; 6], &arena, arena.len())
            .unwrap_err(),
    ] {
        assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
    }
    assert!(
        conn.admin(CONTROLLER, 0x80, 0, [0; 6], &arena, 0)
            .unwrap_err()
            .to_string()
            .contains("operator's")
    );

    // A raw frame: its own request id comes back.
    let raw = Frame {
        request_id: 77,
        message: Message::Request(Request::Status),
    }
    .encode()
    .unwrap();
    let (frame, fds) = conn.request_raw(&raw).unwrap();
    assert_eq!(frame.request_id, 77);
    assert!(matches!(
        frame.message,
        Message::Reply(Reply::Status { .. })
    ));
    assert!(fds.is_empty());
    // A malformed one: the fake's refusal comes back.
    let (frame, _) = conn.request_raw(b"GNVS garbage").unwrap();
    assert!(matches!(
        frame.message,
        Message::Reply(Reply::Refused {
            kind: RefusalKind::Protocol,
            ..
        })
    ));
    // The counter goes on past the raw requests.
    conn.status().unwrap();

    // Pairs go back only to their connection and controller.
    let (other, _other_fake) = fake::start();
    let e = other.delete_queues(CONTROLLER, pairs).unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
    let other_arena = Arc::new(
        other
            .alloc_arena(CONTROLLER, arena_bytes_for(1, 8, 4096))
            .unwrap(),
    );
    let theirs = other
        .create_queues(CONTROLLER, &other_arena, 1, 8, 4096)
        .unwrap();
    let e = conn.delete_queues(CONTROLLER, theirs).unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
    let fresh = |count| {
        let a = Arc::new(
            conn.alloc_arena(CONTROLLER, arena_bytes_for(count, 8, 4096))
                .unwrap(),
        );
        conn.create_queues(CONTROLLER, &a, count, 8, 4096).unwrap()
    };
    let e = conn.delete_queues("fake1", fresh(1)).unwrap_err();
    assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
    let pairs = fresh(2);
    let ids_before = fake.knobs.request_ids.lock().unwrap().len();
    conn.delete_queues(CONTROLLER, pairs).unwrap();
    conn.delete_queues(CONTROLLER, Vec::new()).unwrap();
    assert_eq!(
        fake.knobs.request_ids.lock().unwrap().len(),
        ids_before + 1,
        "one DeleteQueues for two pairs, none for none"
    );
    conn.free_arena(arena).unwrap();
    let e = conn.free_arena(other_arena).unwrap_err();
    assert!(
        matches!(
            e,
            ClientError::Refused {
                kind: RefusalKind::NotFound,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn events_revoke_the_pairs_they_name() {
    let (conn, fake) = fake::start();
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, arena_bytes_for(3, 4, 4096))
            .unwrap(),
    );
    let mut qps = conn.create_queues(CONTROLLER, &arena, 3, 4, 4096).unwrap();
    let mut buf = [0u8; 512];
    // Delivered while a request awaits its reply.
    fake.knobs
        .events_before_reply
        .lock()
        .unwrap()
        .push(Event::QueuesRevoked {
            controller: CONTROLLER.into(),
            qids: vec![qps[0].qid()],
            why: "the operator said so".into(),
        });
    conn.status().unwrap();
    let events = conn.events();
    assert!(matches!(&events[..], [Event::QueuesRevoked { qids, .. }] if qids == &[1]));
    assert!(conn.events().is_empty(), "events() drains");
    let e = qps[0].read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap_err();
    assert!(
        matches!(&e, ClientError::Revoked { qid: 1, why } if why.contains("the operator said so")),
        "{e}"
    );
    assert!(qps[0].submit_read(NSID, 0, 1, LBA_SIZE).is_err());
    assert!(qps[0].reap(Duration::ZERO).is_err());
    assert!(qps[0].revoked().is_some());
    qps[1].read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap();

    // Taken in unasked by check_events.
    fake.knobs
        .events_now
        .lock()
        .unwrap()
        .push(Event::ControllerFailed {
            controller: CONTROLLER.into(),
            why: "CSTS.CFS".into(),
        });
    let deadline = Instant::now() + BOUND;
    while conn.check_events().unwrap() == 0 {
        assert!(Instant::now() < deadline, "no event came");
        std::thread::sleep(Duration::from_millis(5));
    }
    for qp in &mut qps[1..] {
        let e = qp.read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap_err();
        assert!(
            matches!(&e, ClientError::Revoked { why, .. } if why.contains("CSTS.CFS")),
            "{e}"
        );
    }
    assert!(matches!(
        &conn.events()[..],
        [Event::ControllerFailed { .. }]
    ));
}

#[test]
fn shutdown_and_the_daemons_end_revoke_everything() {
    let (conn, fake) = fake::start();
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, arena_bytes_for(2, 4, 4096))
            .unwrap(),
    );
    let qps = conn.create_queues(CONTROLLER, &arena, 2, 4, 4096).unwrap();
    fake.knobs
        .events_before_reply
        .lock()
        .unwrap()
        .push(Event::Shutdown);
    conn.status().unwrap();
    assert!(qps.iter().all(|q| q.revoked().is_some()));

    drop(qps);
    drop(conn);
    drop(fake);

    // A fresh connection: the daemon goes away.
    let (conn, mut fake) = fake::start();
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, arena_bytes_for(1, 4, 4096))
            .unwrap(),
    );
    let mut qp = conn
        .create_queues(CONTROLLER, &arena, 1, 4, 4096)
        .unwrap()
        .pop()
        .unwrap();
    fake.hang_up();
    let deadline = Instant::now() + BOUND;
    loop {
        match conn.check_events() {
            Err(ClientError::Closed { .. }) => break,
            Ok(_) => assert!(Instant::now() < deadline, "the end was not seen"),
            Err(e) => panic!("{e}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut buf = [0u8; 512];
    let e = qp.read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap_err();
    assert!(
        matches!(&e, ClientError::Revoked { why, .. } if why.contains("closed")),
        "{e}"
    );
    assert!(matches!(conn.status(), Err(ClientError::Closed { .. })));
    // A pair outliving its connection is revoked too.
    let (conn, _fake) = fake::start();
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, arena_bytes_for(1, 4, 4096))
            .unwrap(),
    );
    let qp = conn
        .create_queues(CONTROLLER, &arena, 1, 4, 4096)
        .unwrap()
        .pop()
        .unwrap();
    drop(conn);
    assert!(qp.revoked().unwrap().contains("connection was closed"));
}

#[test]
fn a_late_reply_to_a_request_given_up_on_is_skipped() {
    let bound = Duration::from_millis(100);
    let (ours, theirs) = Channel::pair(bound).unwrap();
    let daemon = std::thread::spawn(move || {
        let answer = |id: u32, reply: Reply| {
            let frame = Frame {
                request_id: id,
                message: Message::Reply(reply),
            };
            theirs.send(&frame, &[]).unwrap();
        };
        let (hello, _) = theirs.recv().unwrap();
        answer(
            hello.request_id,
            Reply::Welcome {
                version: PROTOCOL_VERSION,
                daemon: "slow".into(),
                trust: "t".into(),
                controllers: vec![],
            },
        );
        let (first, _) = theirs.recv().unwrap();
        std::thread::sleep(Duration::from_millis(250));
        answer(first.request_id, Reply::Status { json: "1".into() });
        let (second, _) = theirs.recv().unwrap();
        answer(second.request_id, Reply::Status { json: "2".into() });
        (first.request_id, second.request_id)
    });
    let conn = Connection::from_channel(ours, "x", bound).unwrap();
    let e = conn.status().unwrap_err();
    assert!(matches!(e, ClientError::Socket { .. }), "{e}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(conn.status().unwrap(), "2");
    assert_eq!(daemon.join().unwrap(), (2, 3));
}

/// File requests: each answered with the generation; a reservation whose table is longer than
/// the memory file that carries it is refused before anything reads past the mapping.
#[test]
fn file_requests_and_a_reservation_table_bigger_than_its_memory() {
    let (conn, _fake) = fake::start();
    assert_eq!(conn.fs_view(CONTROLLER, NSID, None).unwrap(), 7);
    assert_eq!(conn.fs_remove(CONTROLLER, NSID, "a").unwrap(), 7);
    assert_eq!(conn.fs_rename(CONTROLLER, NSID, "a", "b", true).unwrap(), 7);
    assert_eq!(conn.fs_commit(1, 10, Some(3)).unwrap(), 7);
    assert_eq!(conn.fs_abort(1).unwrap(), 7);
    let (lease, table) = conn.fs_create(CONTROLLER, NSID, "a", 4096, false).unwrap();
    assert_eq!((lease, table.len(), &table[..4]), (9, 4096, &b"BFXT"[..]));
    let e = conn
        .fs_create(CONTROLLER, NSID, "a", 8192, false)
        .unwrap_err();
    assert!(format!("{e}").contains("extent table"), "{e}");
    let table = conn.fs_grow(9, 1 << 20).unwrap();
    assert_eq!((table.len(), &table[..4]), (4096, &b"BFXT"[..]));
    let e = conn.fs_grow(5, 1 << 20).unwrap_err();
    assert!(
        format!("{e}").contains("answered for lease 9"),
        "a grown table of another lease is refused: {e}"
    );
}
