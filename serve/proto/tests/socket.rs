//! `Channel` over a `SOCK_SEQPACKET` pair: frames and descriptors arrive whole, malformed ones
//! are refused by name (their descriptors closed), and every wait ends within the bound.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use gpunvme_serve_proto::limits::{MAX_BODY, MAX_FDS, MAX_FRAME};
use gpunvme_serve_proto::socket::{Channel, SocketError};
use gpunvme_serve_proto::{Frame, Message, ProtoError, Reply, Request};
use rustix::fs::{MemfdFlags, memfd_create};

/// Short enough for quick tests, long enough for a loaded machine to answer a ready socket.
const BOUND: Duration = Duration::from_millis(200);
/// What a wait of `BOUND` may overrun by before the test calls it unbounded.
const SLACK: Duration = Duration::from_secs(3);

fn pair() -> (Channel, Channel) {
    Channel::pair(BOUND).expect("a socket pair")
}

fn frame(request_id: u32, message: Message) -> Frame {
    Frame {
        request_id,
        message,
    }
}

fn done(request_id: u32) -> Frame {
    frame(
        request_id,
        Message::Reply(Reply::Done {
            status: 0,
            result: 0,
        }),
    )
}

fn arena(len: u64) -> Frame {
    frame(
        7,
        Message::Reply(Reply::Arena {
            id: 3,
            device_address: 0x10_0000,
            len,
        }),
    )
}

fn memfd(content: &[u8]) -> OwnedFd {
    let fd = memfd_create("gpunvme-serve-test", MemfdFlags::CLOEXEC).expect("memfd_create");
    let mut file = File::from(fd);
    file.write_all(content).unwrap();
    file.into()
}

#[track_caller]
fn expect_timeout<T: std::fmt::Debug>(r: Result<T, SocketError>, started: Instant) {
    let took = started.elapsed();
    match r {
        Err(SocketError::Timeout { after, .. }) => assert_eq!(after, BOUND),
        other => panic!("want a timeout, got {other:?}"),
    }
    assert!(
        took >= BOUND - Duration::from_millis(5),
        "gave up early: {took:?}"
    );
    assert!(
        took < BOUND + SLACK,
        "waited {took:?} for a bound of {BOUND:?}"
    );
}

/// A frame with no descriptors.
#[track_caller]
fn expect_frame(r: Result<(Frame, Vec<OwnedFd>), SocketError>, want: &Frame) {
    let (got, fds) = r.unwrap();
    assert_eq!(&got, want);
    assert!(fds.is_empty(), "{} descriptor(s) came with it", fds.len());
}

#[track_caller]
fn expect_proto<T: std::fmt::Debug>(r: Result<T, SocketError>, want: ProtoError) {
    match r {
        Err(SocketError::Proto(e)) => assert_eq!(e, want),
        other => panic!("want {want:?}, got {other:?}"),
    }
}

/// A Unix stream pair: the test sends copies of the second end; once every copy is closed
/// (ours, the kernel's in flight, the receiver's), the first end reads end-of-file.
fn witness() -> (UnixStream, UnixStream) {
    let (watch, sent) = UnixStream::pair().unwrap();
    watch.set_read_timeout(Some(SLACK)).unwrap();
    (watch, sent)
}

/// Every copy of the witness's sent end is closed.
#[track_caller]
fn all_closed(mut watch: UnixStream) {
    let mut b = [0u8; 1];
    match watch.read(&mut b) {
        Ok(0) => {}
        other => panic!("a copy of the descriptor is still open somewhere: {other:?}"),
    }
}

#[test]
fn a_frame_round_trips_both_ways() {
    let (client, daemon) = pair();
    let hello = frame(
        1,
        Message::Request(Request::Hello {
            version: 1,
            name: "test".into(),
        }),
    );
    client.send(&hello, &[]).unwrap();
    let (got, fds) = daemon.recv().unwrap();
    assert_eq!(got, hello);
    assert!(fds.is_empty());

    // Several queued frames keep their order and boundaries.
    for id in 10..20 {
        daemon.send(&done(id), &[]).unwrap();
    }
    for id in 10..20 {
        let (got, fds) = client.recv().unwrap();
        assert_eq!(got, done(id));
        assert!(fds.is_empty());
    }
}

#[test]
fn a_frame_of_exactly_max_frame_passes_the_receive_buffer() {
    let empty = serde_json::to_vec(&Message::Reply(Reply::Status {
        json: String::new(),
    }))
    .unwrap()
    .len();
    let json = "\"".repeat(MAX_BODY / 2 - empty) + &"a".repeat(empty);
    let big = frame(2, Message::Reply(Reply::Status { json }));
    assert_eq!(big.encode().unwrap().len(), MAX_FRAME);
    let (a, b) = pair();
    a.send(&big, &[]).unwrap();
    expect_frame(b.recv(), &big);
}

#[test]
fn an_arena_arrives_with_its_memory_file() {
    let (daemon, client) = pair();
    let content = b"arena bytes: \x00\x01\x02 the daemon wrote";
    let fd = memfd(content);
    let reply = arena(2 << 20);
    daemon.send(&reply, &[fd.as_fd()]).unwrap();
    drop(fd);

    let (got, fds) = client.recv().unwrap();
    assert_eq!(got, reply);
    assert_eq!(fds.len(), 1);
    let file = File::from(fds.into_iter().next().unwrap());
    let mut back = vec![0u8; content.len()];
    file.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(&back, content);
    // It is the same file, not a copy: a write through the received descriptor is seen by
    // another received later.
    file.write_all_at(b"CLIENT", 0).unwrap();
    daemon.send(&reply, &[file.as_fd()]).unwrap();
    let (_, again) = client.recv().unwrap();
    let mut head = [0u8; 6];
    File::from(again.into_iter().next().unwrap())
        .read_exact_at(&mut head, 0)
        .unwrap();
    assert_eq!(&head, b"CLIENT");
}

#[test]
fn queues_arrive_with_the_doorbell_page() {
    let (daemon, client) = pair();
    let reply = frame(
        8,
        Message::Reply(Reply::Queues {
            queues: vec![gpunvme_serve_proto::msg::QueueGrant {
                qid: 1,
                sq_doorbell: 8,
                cq_doorbell: 12,
                sq: 0,
                cq: 4096,
                slots: 8192,
                prp_lists: 12288,
            }],
        }),
    );
    let page = memfd(&[0xdb; 64]);
    daemon.send(&reply, &[page.as_fd()]).unwrap();
    let (got, fds) = client.recv().unwrap();
    assert_eq!(got, reply);
    assert_eq!(fds.len(), 1);
}

#[test]
fn send_with_the_wrong_descriptors_sends_nothing() {
    let (a, b) = pair();
    let fd = memfd(b"x");
    // An arena without its file, with two; a reply that carries none, with one.
    for (f, fds) in [
        (arena(4096), vec![]),
        (arena(4096), vec![fd.as_fd(), fd.as_fd()]),
        (done(1), vec![fd.as_fd()]),
    ] {
        let want = f.message.descriptors();
        let got = fds.len();
        let kind = f.message.kind().name();
        expect_proto(
            a.send(&f, &fds),
            ProtoError::Descriptors { kind, want, got },
        );
    }
    // A message out of its limits is refused by encode, before sending, too.
    let bad = arena(4095);
    assert!(matches!(
        a.send(&bad, &[fd.as_fd()]),
        Err(SocketError::Proto(ProtoError::Body { kind: "arena", .. }))
    ));
    let started = Instant::now();
    expect_timeout(b.recv(), started);
}

#[test]
fn garbage_is_refused_by_the_receiver_and_the_connection_goes_on() {
    let (a, b) = pair();
    a.send_raw(b"hello", &[]).unwrap();
    expect_proto(b.recv(), ProtoError::Truncated(5));
    a.send_raw(&[0xee; 64], &[]).unwrap();
    expect_proto(b.recv(), ProtoError::BadMagic([0xee; 4]));
    // An empty datagram is a frame too short, not the end of the connection.
    a.send_raw(&[], &[]).unwrap();
    expect_proto(b.recv(), ProtoError::Truncated(0));
    // A frame with the wrong descriptor count, sent raw: refused, its descriptor closed.
    let (watch, sent) = witness();
    a.send_raw(&done(4).encode().unwrap(), &[sent.as_fd()])
        .unwrap();
    drop(sent);
    expect_proto(
        b.recv(),
        ProtoError::Descriptors {
            kind: "done",
            want: 0,
            got: 1,
        },
    );
    all_closed(watch);
    // After all that, a good frame still arrives.
    a.send(&done(5), &[]).unwrap();
    expect_frame(b.recv(), &done(5));
}

#[test]
fn a_datagram_over_max_frame_is_too_large_and_consumed() {
    let (a, b) = pair();
    a.send_raw(&vec![b'G'; MAX_FRAME + 1], &[]).unwrap();
    a.send(&done(6), &[]).unwrap();
    expect_proto(b.recv(), ProtoError::TooLarge(MAX_FRAME + 1));
    expect_frame(b.recv(), &done(6));
    // recv_raw refuses it the same way, not cut short.
    a.send_raw(&vec![0; MAX_FRAME + 100], &[]).unwrap();
    expect_proto(b.recv_raw(), ProtoError::TooLarge(MAX_FRAME + 100));
}

#[test]
fn a_peer_that_never_reads_makes_send_time_out() {
    let (a, b) = pair();
    // 16 KiB frames: the socket buffer (a few hundred KiB at most here) fills within a few
    // dozen; the loop is bounded all the same.
    let filler = |id| {
        frame(
            id,
            Message::Reply(Reply::Status {
                json: "f".repeat(16 << 10),
            }),
        )
    };
    let mut sent = 0u32;
    let outcome = loop {
        assert!(sent < 10_000, "the socket never filled");
        let started = Instant::now();
        match a.send(&filler(sent), &[]) {
            Ok(()) => sent += 1,
            Err(e) => break (e, started),
        }
    };
    let (err, started) = outcome;
    expect_timeout(Err::<(), _>(err), started);
    assert!(sent > 0, "not even one frame fitted");
    // What was sent arrives whole and in order once the peer reads.
    for id in 0..sent {
        assert_eq!(b.recv().unwrap().0, filler(id));
    }
    let started = Instant::now();
    expect_timeout(b.recv(), started);
    // And the sender can send again.
    a.send(&done(1), &[]).unwrap();
    assert_eq!(b.recv().unwrap().0, done(1));
}

#[test]
fn a_dropped_peer_is_closed_both_ways() {
    let (a, b) = pair();
    drop(b);
    let started = Instant::now();
    assert!(matches!(a.recv(), Err(SocketError::Closed)));
    assert!(matches!(a.recv_raw(), Err(SocketError::Closed)));
    assert!(matches!(a.send(&done(1), &[]), Err(SocketError::Closed)));
    assert!(matches!(a.send_raw(b"x", &[]), Err(SocketError::Closed)));
    assert!(
        started.elapsed() < BOUND,
        "closed must not wait for the bound"
    );
}

#[test]
fn frames_sent_before_the_peer_went_away_are_still_received() {
    let (a, b) = pair();
    a.send(&done(1), &[]).unwrap();
    a.send(&done(2), &[]).unwrap();
    drop(a);
    assert_eq!(b.recv().unwrap().0, done(1));
    assert_eq!(b.recv().unwrap().0, done(2));
    assert!(matches!(b.recv(), Err(SocketError::Closed)));
}

#[test]
fn a_peer_that_drops_with_unread_frames_is_closed_for_the_sender() {
    let (a, b) = pair();
    b.send(&done(1), &[]).unwrap();
    a.send(&done(2), &[]).unwrap();
    // `a` goes away with a frame of `b`'s unread: b's side sees a reset.
    drop(a);
    assert!(matches!(b.send(&done(3), &[]), Err(SocketError::Closed)));
}

#[test]
fn a_peer_that_shuts_its_sending_side_is_closed_for_the_receiver() {
    let (a, b) = pair();
    rustix::net::shutdown(a.fd(), rustix::net::Shutdown::Write).unwrap();
    let started = Instant::now();
    assert!(matches!(b.recv(), Err(SocketError::Closed)));
    assert!(started.elapsed() < BOUND);
    // The other direction still works.
    b.send(&done(1), &[]).unwrap();
    assert_eq!(a.recv().unwrap().0, done(1));
}

#[test]
fn recv_with_nothing_sent_times_out_after_the_bound() {
    let (a, b) = pair();
    let started = Instant::now();
    expect_timeout(a.recv(), started);
    let started = Instant::now();
    expect_timeout(a.recv_raw(), started);
    drop(b);
}

#[test]
fn more_than_max_fds_descriptors_are_refused_and_closed() {
    let (a, b) = pair();
    let good = arena(4096).encode().unwrap();
    for n in [MAX_FDS + 1, MAX_FDS + 2, MAX_FDS + 3, 16, 64] {
        let (watch, sent) = witness();
        let fds: Vec<BorrowedFd<'_>> = (0..n).map(|_| sent.as_fd()).collect();
        a.send_raw(&good, &fds).unwrap();
        drop(fds);
        drop(sent);
        match b.recv() {
            Err(SocketError::Proto(ProtoError::Descriptors { kind, want, got })) => {
                assert_eq!(kind, "a frame");
                assert_eq!(want, MAX_FDS);
                assert!(got > MAX_FDS && got <= n, "{got} of {n}");
            }
            other => panic!("{n} descriptors: want a refusal, got {other:?}"),
        }
        // Neither the ones received nor the ones cut off are left open.
        all_closed(watch);
    }
    // recv_raw refuses them the same way.
    let (watch, sent) = witness();
    a.send_raw(&good, &[sent.as_fd(); MAX_FDS + 1]).unwrap();
    drop(sent);
    assert!(matches!(
        b.recv_raw(),
        Err(SocketError::Proto(ProtoError::Descriptors { .. }))
    ));
    all_closed(watch);
    // MAX_FDS itself passes recv_raw (and the decoder then judges the count).
    let (watch, sent) = witness();
    a.send_raw(&good, &[sent.as_fd(); MAX_FDS]).unwrap();
    drop(sent);
    let (bytes, fds) = b.recv_raw().unwrap();
    assert_eq!(bytes, good);
    assert_eq!(fds.len(), MAX_FDS);
    assert_eq!(
        Frame::decode(&bytes, fds.len()),
        Err(ProtoError::Descriptors {
            kind: "arena",
            want: 1,
            got: MAX_FDS
        })
    );
    drop(fds);
    all_closed(watch);
    // And the connection goes on.
    let fd = memfd(b"ok");
    a.send(&arena(4096), &[fd.as_fd()]).unwrap();
    let (got, fds) = b.recv().unwrap();
    assert_eq!(got, arena(4096));
    assert_eq!(fds.len(), 1);
}

#[test]
fn descriptors_of_a_refused_frame_are_closed() {
    let (a, b) = pair();
    // An arena reply whose body is out of its limits, sent raw with its one descriptor.
    let mut bytes = arena(4096).encode().unwrap();
    let at = bytes.len() - 7;
    assert_eq!(&bytes[at..], b"4096}}}");
    bytes[at..at + 4].copy_from_slice(b"4097");
    let (watch, sent) = witness();
    a.send_raw(&bytes, &[sent.as_fd()]).unwrap();
    drop(sent);
    assert!(matches!(
        b.recv(),
        Err(SocketError::Proto(ProtoError::Body { kind: "arena", .. }))
    ));
    all_closed(watch);
}
