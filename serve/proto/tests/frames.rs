//! Framing and message limits: every message round-trips, every malformed frame and every field
//! out of its limit is refused by name (by `encode` and, fed hand-built bytes, by `decode`), and
//! a seeded loop of random and mutated datagrams never makes the decoder panic.

use gpunvme_serve_proto::limits::{HEADER_LEN, MAGIC, MAX_BODY, MAX_FRAME, PROTOCOL_VERSION};
use gpunvme_serve_proto::msg::{
    ADMIN_ALLOWLIST, Kind, MAX_ARENA_BYTES, MAX_CONTROLLERS, MAX_NAME, MAX_NAMESPACES,
    MAX_QUEUES_PER_REQUEST, MAX_SLOT_BYTES, MAX_TEXT, NamespaceInfo, PAGE, QueueGrant, RefusalKind,
    allowed_admin,
};
use gpunvme_serve_proto::{Event, Frame, Message, ProtoError, Reply, Request};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A datagram built by hand: the header's fields as given, then `body`.
fn raw(version: u16, kind: u16, request_id: u32, body_len: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(&body_len.to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// A well-formed header for `message` (its kind, its body length) over its unchecked JSON: how a
/// peer that skips [`Message::check`] would send it.
fn unchecked(message: &Message, request_id: u32) -> Vec<u8> {
    let body = serde_json::to_vec(message).unwrap();
    raw(
        PROTOCOL_VERSION,
        message.kind().code(),
        request_id,
        body.len() as u32,
        &body,
    )
}

fn req(r: Request) -> Message {
    Message::Request(r)
}
fn rep(r: Reply) -> Message {
    Message::Reply(r)
}
fn ev(e: Event) -> Message {
    Message::Event(e)
}

fn grant(qid: u16) -> QueueGrant {
    QueueGrant {
        qid,
        sq_doorbell: 0x1000 + 8 * u32::from(qid),
        cq_doorbell: 0x1004 + 8 * u32::from(qid),
        sq: 0,
        cq: 64 << 10,
        slots: 128 << 10,
        prp_lists: 256 << 10,
    }
}

fn create_queues(count: u16, depth: u32, slot_bytes: u32) -> Message {
    req(Request::CreateQueues {
        controller: "nvme0".into(),
        arena: 1,
        count,
        depth,
        slot_bytes,
    })
}

fn admin(opcode: u8, offset: u64) -> Message {
    req(Request::Admin {
        controller: "nvme0".into(),
        opcode,
        nsid: 1,
        cdw: [1, 2, 3, 4, 5, 6],
        arena: 7,
        offset,
    })
}

/// One of each message, with fields that exercise the encoding (escapes, non-ASCII, the
/// extremes of the numbers).
fn samples() -> Vec<Message> {
    vec![
        req(Request::Hello {
            version: PROTOCOL_VERSION,
            name: "bench \"π\" client".into(),
        }),
        req(Request::OpenController {
            controller: "0000:01:00.0".into(),
        }),
        req(Request::AllocArena {
            controller: "nvme0".into(),
            bytes: MAX_ARENA_BYTES,
        }),
        create_queues(4, 1024, 128 << 10),
        req(Request::DeleteQueues {
            controller: "nvme0".into(),
            qids: vec![1, 2, u16::MAX],
        }),
        req(Request::FreeArena { arena: u64::MAX }),
        admin(0x06, 8 * PAGE),
        req(Request::Status),
        req(Request::FsView {
            controller: "nvme0".into(),
            nsid: 1,
            held: Some(4),
        }),
        req(Request::FsCreate {
            controller: "nvme0".into(),
            nsid: 1,
            name: "model/shard-00001.safetensors".into(),
            bytes: 4 << 30,
            replace: true,
        }),
        req(Request::FsCommit {
            lease: 3,
            len: 4 << 30,
            crc: Some(0xdead_beef),
        }),
        req(Request::FsAbort { lease: 3 }),
        req(Request::FsGrow {
            lease: 3,
            bytes: 1 << 40,
        }),
        req(Request::FsRemove {
            controller: "nvme0".into(),
            nsid: 1,
            name: "a".into(),
        }),
        req(Request::FsRename {
            controller: "nvme0".into(),
            nsid: 1,
            from: "a".into(),
            to: "b".into(),
            replace: false,
        }),
        rep(Reply::Fs { generation: 12 }),
        rep(Reply::FsReserved {
            lease: 3,
            table_bytes: 136,
        }),
        rep(Reply::Welcome {
            version: PROTOCOL_VERSION,
            daemon: "gpunvme serve 0.1.0".into(),
            trust: "clients are trusted with their own queues;\nnot with the controller".into(),
            controllers: vec!["nvme0".into(), "nvme1".into()],
        }),
        rep(Reply::Controller {
            controller_threads: Some(16),
            name: "nvme0".into(),
            queues_free: 63,
            max_transfer_bytes: 1 << 20,
            namespaces: vec![
                NamespaceInfo {
                    nsid: 1,
                    blocks: u64::MAX,
                    lba_size: 4096,
                },
                NamespaceInfo {
                    nsid: 2,
                    blocks: 0,
                    lba_size: 512,
                },
            ],
        }),
        rep(Reply::Arena {
            id: 3,
            device_address: 0xdead_beef_0000,
            len: 2 << 20,
        }),
        rep(Reply::Queues {
            queues: vec![grant(1), grant(2)],
        }),
        rep(Reply::Done {
            status: 0x4002,
            result: 0,
        }),
        rep(Reply::Refused {
            kind: RefusalKind::Budget,
            message: "3 arenas of 1 GiB is past the budget of 2 GiB\t\u{1}".into(),
        }),
        rep(Reply::Status {
            json: r#"{"clients":[{"pid":1,"queues":[1,2]}]}"#.into(),
        }),
        ev(Event::QueuesRevoked {
            controller: "nvme0".into(),
            qids: vec![5],
            why: "the controller reset".into(),
        }),
        ev(Event::ControllerFailed {
            controller: "nvme1".into(),
            why: "CSTS.CFS".into(),
        }),
        ev(Event::Shutdown),
    ]
}

/// Every kind a header may name.
fn all_kinds() -> Vec<Kind> {
    (0..=u16::MAX).filter_map(Kind::from_code).collect()
}

/// Every kind's code, found once.
fn kind_codes() -> &'static [u16] {
    static CODES: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    CODES.get_or_init(|| all_kinds().iter().map(|k| k.code()).collect())
}

#[track_caller]
fn expect_body(r: Result<impl std::fmt::Debug, ProtoError>, want_kind: &str, why_has: &str) {
    match r {
        Err(ProtoError::Body { kind, why }) => {
            assert_eq!(kind, want_kind, "the refusal's kind ({why})");
            assert!(
                why.contains(why_has),
                "the refusal {why:?} should mention {why_has:?}"
            );
        }
        other => panic!("want a {want_kind} Body refusal mentioning {why_has:?}, got {other:?}"),
    }
}

/// A message out of its limits: refused by `encode`, and by `decode` of its unchecked bytes.
#[track_caller]
fn refused_both_ways(message: Message, why_has: &str) {
    let kind = message.kind().name();
    let fds = message.descriptors();
    let frame = Frame {
        request_id: 77,
        message: message.clone(),
    };
    expect_body(frame.encode(), kind, why_has);
    expect_body(message.check(), kind, why_has);
    let bytes = unchecked(&message, 77);
    assert!(
        bytes.len() <= MAX_FRAME,
        "the case must reach the body check"
    );
    expect_body(Frame::decode(&bytes, fds), kind, why_has);
}

/// A message inside its limits: encoded, and decoded to itself.
#[track_caller]
fn accepted(message: Message) {
    let fds = message.descriptors();
    let frame = Frame {
        request_id: 9,
        message,
    };
    let bytes = frame
        .encode()
        .unwrap_or_else(|e| panic!("{frame:?} refused: {e}"));
    assert_eq!(Frame::decode(&bytes, fds), Ok(frame));
}

// ---------------------------------------------------------------------------------------------
// Round trips and the wire layout
// ---------------------------------------------------------------------------------------------

#[test]
fn samples_cover_every_kind() {
    let kinds = all_kinds();
    assert_eq!(kinds.len(), 27, "the kinds! table");
    let covered: Vec<Kind> = samples().iter().map(Message::kind).collect();
    for k in &kinds {
        assert!(covered.contains(k), "no sample of {k:?}");
        assert_eq!(Kind::from_code(k.code()), Some(*k));
    }
    // Codes and names are each unique.
    for (i, a) in kinds.iter().enumerate() {
        for b in &kinds[i + 1..] {
            assert_ne!(a.code(), b.code());
            assert_ne!(a.name(), b.name());
        }
    }
}

#[test]
fn every_message_round_trips_with_its_request_id() {
    for (i, message) in samples().into_iter().enumerate() {
        for request_id in [0, 1, 0x8000_0000 + i as u32, u32::MAX] {
            let frame = Frame {
                request_id,
                message: message.clone(),
            };
            let bytes = frame.encode().unwrap();
            let fds = message.descriptors();
            let back = Frame::decode(&bytes, fds).unwrap();
            assert_eq!(back, frame);
            assert_eq!(back.request_id, request_id);
            // The same frame, re-encoded, is the same bytes.
            assert_eq!(back.encode().unwrap(), bytes);
        }
    }
}

#[test]
fn the_header_is_little_endian_magic_version_kind_id_length() {
    let frame = Frame {
        request_id: 0x0102_0304,
        message: rep(Reply::Done {
            status: 5,
            result: 0,
        }),
    };
    let bytes = frame.encode().unwrap();
    assert_eq!(&bytes[0..4], b"GNVS");
    assert_eq!(&bytes[4..6], &PROTOCOL_VERSION.to_le_bytes());
    assert_eq!(&bytes[6..8], &105u16.to_le_bytes());
    assert_eq!(&bytes[8..12], &[4, 3, 2, 1]);
    let body = &bytes[HEADER_LEN..];
    assert_eq!(&bytes[12..16], &(body.len() as u32).to_le_bytes());
    assert_eq!(body, br#"{"Reply":{"Done":{"status":5,"result":0}}}"#);

    let header = Frame::header(&bytes).unwrap();
    assert_eq!(header.magic, MAGIC);
    assert_eq!(header.version.get(), PROTOCOL_VERSION);
    assert_eq!(header.kind.get(), Kind::Done.code());
    assert_eq!(header.request_id.get(), 0x0102_0304);
    assert_eq!(header.body_len.get() as usize, body.len());
    // The header alone is read even where the body is garbage.
    let garbage = raw(PROTOCOL_VERSION, 999, 42, 3, b"\xff\xfe\xfd");
    assert_eq!(Frame::header(&garbage).unwrap().request_id.get(), 42);
}

#[test]
fn descriptors_per_message() {
    for m in samples() {
        let want = match m {
            Message::Reply(
                Reply::Arena { .. } | Reply::Queues { .. } | Reply::FsReserved { .. },
            ) => 1,
            _ => 0,
        };
        assert_eq!(m.descriptors(), want, "{:?}", m.kind());
    }
}

#[test]
fn decode_takes_the_unit_variants_spelled_either_way() {
    let body = br#"{"Request":{"Status":null}}"#;
    let bytes = raw(
        PROTOCOL_VERSION,
        Kind::StatusRequest.code(),
        3,
        body.len() as u32,
        body,
    );
    let frame = Frame::decode(&bytes, 0).unwrap();
    assert_eq!(frame.message, req(Request::Status));
    // And, re-encoded, it is the canonical spelling.
    assert_eq!(
        &frame.encode().unwrap()[HEADER_LEN..],
        br#"{"Request":"Status"}"#
    );
}

#[test]
fn a_frame_of_exactly_max_frame_is_accepted() {
    let frame = max_frame();
    let bytes = frame.encode().unwrap();
    assert_eq!(bytes.len(), MAX_FRAME);
    assert_eq!(Frame::decode(&bytes, 0), Ok(frame));
}

/// A Status reply whose body is exactly [`MAX_BODY`] bytes (its text within its own limit,
/// escapes doubling part of it).
fn max_frame() -> Frame {
    let empty = serde_json::to_vec(&rep(Reply::Status {
        json: String::new(),
    }))
    .unwrap()
    .len();
    let quotes = MAX_BODY / 2 - empty;
    let json = "\"".repeat(quotes) + &"a".repeat(empty);
    assert_eq!(json.len(), MAX_BODY / 2);
    Frame {
        request_id: 1,
        message: rep(Reply::Status { json }),
    }
}

// ---------------------------------------------------------------------------------------------
// Malformed frames
// ---------------------------------------------------------------------------------------------

#[test]
fn fewer_than_16_bytes_is_truncated() {
    let whole = Frame {
        request_id: 1,
        message: req(Request::Status),
    }
    .encode()
    .unwrap();
    for n in 0..HEADER_LEN {
        assert_eq!(Frame::decode(&whole[..n], 0), Err(ProtoError::Truncated(n)));
        assert_eq!(
            Frame::header(&whole[..n]).unwrap_err(),
            ProtoError::Truncated(n)
        );
    }
    // A header and no body: the header's length says more.
    assert_eq!(
        Frame::decode(&whole[..HEADER_LEN], 0),
        Err(ProtoError::BodyLength {
            declared: (whole.len() - HEADER_LEN) as u32,
            actual: 0,
        })
    );
}

#[test]
fn wrong_magic_is_bad_magic() {
    let mut bytes = Frame {
        request_id: 1,
        message: req(Request::Status),
    }
    .encode()
    .unwrap();
    bytes[..4].copy_from_slice(b"GNVT");
    assert_eq!(
        Frame::decode(&bytes, 0),
        Err(ProtoError::BadMagic(*b"GNVT"))
    );
    bytes[..4].copy_from_slice(b"\0\0\0\0");
    assert_eq!(Frame::decode(&bytes, 0), Err(ProtoError::BadMagic([0; 4])));
    // The magic is checked before the version.
    let mut other = raw(7, 1, 1, 0, b"");
    other[0] = b'g';
    assert_eq!(
        Frame::decode(&other, 0),
        Err(ProtoError::BadMagic(*b"gNVS"))
    );
}

#[test]
fn another_version_names_both() {
    let body = serde_json::to_vec(&req(Request::Status)).unwrap();
    for v in [0, PROTOCOL_VERSION + 1, u16::MAX] {
        let bytes = raw(v, Kind::StatusRequest.code(), 5, body.len() as u32, &body);
        let want = || ProtoError::Version {
            got: v,
            want: PROTOCOL_VERSION,
        };
        assert_eq!(Frame::decode(&bytes, 0), Err(want()));
        assert_eq!(Frame::header(&bytes), Err(want()));
    }
}

#[test]
fn a_body_length_other_than_the_datagrams_is_refused() {
    let body = serde_json::to_vec(&req(Request::Status)).unwrap();
    let n = body.len() as u32;
    for declared in [0, n - 1, n + 1, u32::MAX] {
        let bytes = raw(
            PROTOCOL_VERSION,
            Kind::StatusRequest.code(),
            1,
            declared,
            &body,
        );
        assert_eq!(
            Frame::decode(&bytes, 0),
            Err(ProtoError::BodyLength {
                declared,
                actual: body.len(),
            })
        );
    }
    // Trailing bytes after a whole frame are a body length mismatch too.
    let mut bytes = raw(PROTOCOL_VERSION, Kind::StatusRequest.code(), 1, n, &body);
    bytes.push(b' ');
    assert_eq!(
        Frame::decode(&bytes, 0),
        Err(ProtoError::BodyLength {
            declared: n,
            actual: body.len() + 1,
        })
    );
}

#[test]
fn a_frame_over_max_frame_is_too_large() {
    // Consistent header and all: the size alone refuses it.
    let body = vec![b' '; MAX_BODY + 1];
    let bytes = raw(
        PROTOCOL_VERSION,
        Kind::StatusRequest.code(),
        1,
        body.len() as u32,
        &body,
    );
    assert_eq!(bytes.len(), MAX_FRAME + 1);
    assert_eq!(
        Frame::decode(&bytes, 0),
        Err(ProtoError::TooLarge(MAX_FRAME + 1))
    );
    // Even garbage is refused for its size first.
    let junk = vec![0xa5; 3 * MAX_FRAME];
    assert_eq!(
        Frame::decode(&junk, 0),
        Err(ProtoError::TooLarge(3 * MAX_FRAME))
    );
    // Encode refuses a message within its field limits whose body escapes past MAX_BODY.
    let json = "\"".repeat(MAX_BODY / 2);
    let frame = Frame {
        request_id: 1,
        message: rep(Reply::Status { json }),
    };
    match frame.encode() {
        Err(ProtoError::TooLarge(n)) => assert!(n > MAX_FRAME, "{n}"),
        other => panic!("want TooLarge, got {other:?}"),
    }
}

#[test]
fn an_unknown_kind_is_refused() {
    let body = serde_json::to_vec(&req(Request::Status)).unwrap();
    for code in [0, 16, 100, 110, 200, 204, 1000, u16::MAX] {
        assert!(Kind::from_code(code).is_none());
        let bytes = raw(PROTOCOL_VERSION, code, 1, body.len() as u32, &body);
        assert_eq!(Frame::decode(&bytes, 0), Err(ProtoError::UnknownKind(code)));
    }
}

#[test]
fn a_body_that_is_not_json_is_refused() {
    let cases: [&[u8]; 6] = [
        b"",
        b"not json",
        b"\xff\xfe",
        br#"{"Request":"Status""#,
        br#"{"Request":"Status"} {"Request":"Status"}"#,
        b"null",
    ];
    for body in cases {
        let bytes = raw(
            PROTOCOL_VERSION,
            Kind::StatusRequest.code(),
            1,
            body.len() as u32,
            body,
        );
        expect_body(Frame::decode(&bytes, 0), "status", "");
    }
}

#[test]
fn a_body_with_an_unknown_field_is_refused() {
    let cases: [(Kind, &str); 6] = [
        (
            Kind::Hello,
            r#"{"Request":{"Hello":{"version":1,"name":"a","extra":0}}}"#,
        ),
        (
            Kind::FreeArena,
            r#"{"Request":{"FreeArena":{"arena":1,"arena2":2}}}"#,
        ),
        (
            Kind::Controller,
            r#"{"Reply":{"Controller":{"name":"n","queues_free":1,"max_transfer_bytes":1,
                "namespaces":[{"nsid":1,"blocks":1,"lba_size":512,"secret":1}]}}}"#,
        ),
        (
            Kind::Queues,
            r#"{"Reply":{"Queues":{"queues":[{"qid":1,"sq_doorbell":0,"cq_doorbell":0,
                "sq":0,"cq":0,"slots":0,"priority":3}]}}}"#,
        ),
        // An unknown variant, and a second message in the same envelope.
        (Kind::Admin, r#"{"Request":{"Format":{"controller":"a"}}}"#),
        (
            Kind::StatusRequest,
            r#"{"Request":"Status","Reply":{"Done":{"status":0,"result":0}}}"#,
        ),
    ];
    for (kind, body) in cases {
        let fds = if matches!(kind, Kind::Queues) { 1 } else { 0 };
        let bytes = raw(
            PROTOCOL_VERSION,
            kind.code(),
            1,
            body.len() as u32,
            body.as_bytes(),
        );
        expect_body(Frame::decode(&bytes, fds), kind.name(), "");
    }
    // And the unknown field's name is in the refusal.
    let body = br#"{"Request":{"Hello":{"version":1,"name":"a","extra":0}}}"#;
    let bytes = raw(PROTOCOL_VERSION, 1, 1, body.len() as u32, body);
    expect_body(Frame::decode(&bytes, 0), "hello", "extra");
}

#[test]
fn a_body_of_another_kind_than_the_header_is_refused() {
    let samples = samples();
    for header_kind in all_kinds() {
        for m in &samples {
            if m.kind() == header_kind {
                continue;
            }
            let mut bytes = unchecked(m, 1);
            bytes[6..8].copy_from_slice(&header_kind.code().to_le_bytes());
            // The descriptor count is the body's: the kind mismatch is found first.
            expect_body(
                Frame::decode(&bytes, m.descriptors()),
                header_kind.name(),
                m.kind().name(),
            );
        }
    }
}

#[test]
fn a_descriptor_count_mismatch_is_refused_both_ways() {
    for m in samples() {
        let frame = Frame {
            request_id: 1,
            message: m.clone(),
        };
        let bytes = frame.encode().unwrap();
        let want = m.descriptors();
        for got in 0..=5 {
            let r = Frame::decode(&bytes, got);
            if got == want {
                assert_eq!(r, Ok(frame.clone()));
            } else {
                assert_eq!(
                    r,
                    Err(ProtoError::Descriptors {
                        kind: m.kind().name(),
                        want,
                        got,
                    })
                );
            }
        }
    }
    // Named explicitly: an arena with none, and a reply that carries none with one.
    let arena = Frame {
        request_id: 2,
        message: rep(Reply::Arena {
            id: 1,
            device_address: 0,
            len: PAGE,
        }),
    }
    .encode()
    .unwrap();
    assert_eq!(
        Frame::decode(&arena, 0),
        Err(ProtoError::Descriptors {
            kind: "arena",
            want: 1,
            got: 0
        })
    );
    let done = Frame {
        request_id: 2,
        message: rep(Reply::Done {
            status: 0,
            result: 0,
        }),
    }
    .encode()
    .unwrap();
    assert_eq!(
        Frame::decode(&done, 1),
        Err(ProtoError::Descriptors {
            kind: "done",
            want: 0,
            got: 1
        })
    );
}

// ---------------------------------------------------------------------------------------------
// Field limits (Message::check), refused by encode and by decode
// ---------------------------------------------------------------------------------------------

/// Each name-carrying message with its name set to `n`.
fn with_name(n: &str) -> Vec<Message> {
    let s = || n.to_string();
    vec![
        req(Request::Hello {
            version: 1,
            name: s(),
        }),
        req(Request::OpenController { controller: s() }),
        req(Request::AllocArena {
            controller: s(),
            bytes: PAGE,
        }),
        req(Request::CreateQueues {
            controller: s(),
            arena: 1,
            count: 1,
            depth: 2,
            slot_bytes: PAGE as u32,
        }),
        req(Request::DeleteQueues {
            controller: s(),
            qids: vec![1],
        }),
        req(Request::Admin {
            controller: s(),
            opcode: 0x06,
            nsid: 0,
            cdw: [0; 6],
            arena: 1,
            offset: 0,
        }),
        rep(Reply::Welcome {
            version: 1,
            daemon: s(),
            trust: String::new(),
            controllers: vec![],
        }),
        rep(Reply::Welcome {
            version: 1,
            daemon: "d".into(),
            trust: String::new(),
            controllers: vec!["ok".into(), s()],
        }),
        rep(Reply::Controller {
            controller_threads: None,
            name: s(),
            queues_free: 0,
            max_transfer_bytes: 0,
            namespaces: vec![],
        }),
        ev(Event::ControllerFailed {
            controller: s(),
            why: String::new(),
        }),
    ]
}

#[test]
fn names_are_1_to_max_name_bytes_without_control_characters() {
    let longest = "n".repeat(MAX_NAME);
    // Multi-byte characters count as bytes: 64 two-byte characters fit, 65 do not.
    let wide = "é".repeat(MAX_NAME / 2);
    for ok in [longest.as_str(), "a", wide.as_str(), "nvme0 (0000:01:00.0)"] {
        with_name(ok).into_iter().for_each(accepted);
    }
    let over = "n".repeat(MAX_NAME + 1);
    let wide_over = "é".repeat(MAX_NAME / 2 + 1);
    let bad = [
        "",
        over.as_str(),
        wide_over.as_str(),
        "a\nb",
        "tab\there",
        "nul\0",
        "del\u{7f}",
        "c1\u{85}",
        "\u{1b}[31mred",
    ];
    for n in bad {
        for m in with_name(n) {
            refused_both_ways(m, "without control characters");
        }
    }
}

#[test]
fn arena_bytes_are_whole_pages_up_to_the_limit() {
    let alloc = |bytes| {
        req(Request::AllocArena {
            controller: "nvme0".into(),
            bytes,
        })
    };
    for ok in [PAGE, 2 * PAGE, MAX_ARENA_BYTES - PAGE, MAX_ARENA_BYTES] {
        accepted(alloc(ok));
    }
    for bad in [
        0,
        1,
        PAGE - 1,
        PAGE + 1,
        PAGE + 512,
        MAX_ARENA_BYTES + PAGE,
        MAX_ARENA_BYTES + 1,
        u64::MAX,
        u64::MAX - PAGE + 1,
    ] {
        refused_both_ways(alloc(bad), &format!("an arena of {bad} bytes"));
    }
    // The reply's length is held to the same rule.
    let arena = |len| {
        rep(Reply::Arena {
            id: 1,
            device_address: 0,
            len,
        })
    };
    accepted(arena(MAX_ARENA_BYTES));
    for bad in [0, 100, MAX_ARENA_BYTES + PAGE] {
        refused_both_ways(arena(bad), &format!("an arena of {bad} bytes"));
    }
}

#[test]
fn queue_counts_are_1_to_max_queues_per_request() {
    let max = MAX_QUEUES_PER_REQUEST as u16;
    for ok in [1, 2, max] {
        accepted(create_queues(ok, 64, PAGE as u32));
    }
    for bad in [0, max + 1, u16::MAX] {
        refused_both_ways(create_queues(bad, 64, PAGE as u32), "queue pairs");
    }
}

#[test]
fn depths_are_2_to_65536() {
    for ok in [2, 3, 1024, 65536] {
        accepted(create_queues(1, ok, PAGE as u32));
    }
    for bad in [0, 1, 65537, u32::MAX] {
        refused_both_ways(create_queues(1, bad, PAGE as u32), "a depth of");
    }
}

#[test]
fn slot_bytes_are_whole_pages_up_to_the_limit() {
    for ok in [PAGE as u32, 2 * PAGE as u32, MAX_SLOT_BYTES] {
        accepted(create_queues(1, 2, ok));
    }
    for bad in [
        0,
        1,
        512,
        PAGE as u32 + 1,
        MAX_SLOT_BYTES + PAGE as u32,
        MAX_SLOT_BYTES - 1,
        u32::MAX,
    ] {
        refused_both_ways(create_queues(1, 2, bad), "slot buffers");
    }
}

/// Each qid-carrying message with `qids`.
fn with_qids(qids: &[u16]) -> Vec<Message> {
    vec![
        req(Request::DeleteQueues {
            controller: "nvme0".into(),
            qids: qids.to_vec(),
        }),
        rep(Reply::Queues {
            queues: qids.iter().map(|&q| grant(q)).collect(),
        }),
        ev(Event::QueuesRevoked {
            controller: "nvme0".into(),
            qids: qids.to_vec(),
            why: "reset".into(),
        }),
    ]
}

#[test]
fn qids_are_1_to_max_per_message_and_never_0() {
    let max: Vec<u16> = (1..=MAX_QUEUES_PER_REQUEST as u16).collect();
    for ok in [&[1u16][..], &[u16::MAX], &max] {
        with_qids(ok).into_iter().for_each(accepted);
    }
    for m in with_qids(&[0]) {
        refused_both_ways(m, "queue id 0");
    }
    for m in with_qids(&[3, 0, 4]) {
        refused_both_ways(m, "queue id 0");
    }
    let over: Vec<u16> = (1..=MAX_QUEUES_PER_REQUEST as u16 + 1).collect();
    for m in with_qids(&over) {
        refused_both_ways(m, &format!("{} queue ids", MAX_QUEUES_PER_REQUEST + 1));
    }
    for m in with_qids(&[]) {
        refused_both_ways(m, "0 queue ids");
    }
}

#[test]
fn admin_opcodes_outside_the_allowlist_are_refused() {
    let allowed: Vec<u8> = ADMIN_ALLOWLIST.iter().map(|(op, _)| *op).collect();
    assert_eq!(allowed, [0x02, 0x06, 0x0a]);
    for (op, name) in ADMIN_ALLOWLIST {
        assert_eq!(allowed_admin(op), Ok(name));
        accepted(admin(op, 0));
    }
    // Named: Format NVM, Sanitize, Namespace Management, Namespace Attachment, Firmware
    // Commit and Image Download, Delete/Create I/O queues (the daemon's), Set Features.
    for op in [
        0x80u8, 0x84, 0x0d, 0x15, 0x10, 0x11, 0x00, 0x01, 0x04, 0x05, 0x09,
    ] {
        refused_both_ways(admin(op, 0), &format!("admin opcode {op:#04x}"));
        let why = allowed_admin(op).unwrap_err();
        assert!(why.contains("Identify (0x06)"), "{why}");
    }
    // Every other opcode too.
    for op in 0..=u8::MAX {
        assert_eq!(
            allowed_admin(op).is_ok(),
            allowed.contains(&op),
            "{op:#04x}"
        );
        assert_eq!(
            admin(op, 0).check().is_ok(),
            allowed.contains(&op),
            "{op:#04x}"
        );
    }
}

#[test]
fn admin_data_offsets_are_page_aligned() {
    for ok in [0, PAGE, 1 << 30] {
        accepted(admin(0x02, ok));
    }
    for bad in [1, 512, PAGE - 1, PAGE + 8, u64::MAX] {
        refused_both_ways(
            admin(0x02, bad),
            &format!("data offset {bad} is not page-aligned"),
        );
    }
}

/// Each text-carrying message with its text set to `t`.
fn with_text(t: &str) -> Vec<Message> {
    let s = || t.to_string();
    vec![
        rep(Reply::Welcome {
            version: 1,
            daemon: "d".into(),
            trust: s(),
            controllers: vec![],
        }),
        rep(Reply::Refused {
            kind: RefusalKind::InvalidArgument,
            message: s(),
        }),
        ev(Event::QueuesRevoked {
            controller: "nvme0".into(),
            qids: vec![1],
            why: s(),
        }),
        ev(Event::ControllerFailed {
            controller: "nvme0".into(),
            why: s(),
        }),
    ]
}

#[test]
fn texts_are_at_most_max_text_bytes() {
    for ok in [
        String::new(),
        "x".repeat(MAX_TEXT),
        "line\nline\t\u{1}".into(),
    ] {
        with_text(&ok).into_iter().for_each(accepted);
    }
    let over = "x".repeat(MAX_TEXT + 1);
    for m in with_text(&over) {
        refused_both_ways(m, &format!("of {} bytes is over {MAX_TEXT}", MAX_TEXT + 1));
    }
    // Counted in bytes, not characters.
    let wide = "€".repeat(MAX_TEXT / 3 + 1);
    for m in with_text(&wide) {
        refused_both_ways(m, "is over");
    }
    // The status text has its own limit, half a body.
    accepted(rep(Reply::Status {
        json: "s".repeat(MAX_BODY / 2),
    }));
    refused_both_ways(
        rep(Reply::Status {
            json: "s".repeat(MAX_BODY / 2 + 1),
        }),
        &format!("a status of {} bytes", MAX_BODY / 2 + 1),
    );
}

#[test]
fn lists_are_held_to_their_limits() {
    let welcome = |n: usize| {
        rep(Reply::Welcome {
            version: 1,
            daemon: "d".into(),
            trust: String::new(),
            controllers: (0..n).map(|i| format!("nvme{i}")).collect(),
        })
    };
    accepted(welcome(MAX_CONTROLLERS));
    refused_both_ways(
        welcome(MAX_CONTROLLERS + 1),
        &format!("{} controllers", MAX_CONTROLLERS + 1),
    );
    let controller = |n: usize| {
        rep(Reply::Controller {
            controller_threads: None,
            name: "nvme0".into(),
            queues_free: 1,
            max_transfer_bytes: 1 << 20,
            namespaces: (0..n)
                .map(|i| NamespaceInfo {
                    nsid: i as u32 + 1,
                    blocks: 1,
                    lba_size: 512,
                })
                .collect(),
        })
    };
    accepted(controller(MAX_NAMESPACES));
    refused_both_ways(
        controller(MAX_NAMESPACES + 1),
        &format!("{} namespaces", MAX_NAMESPACES + 1),
    );
}

// ---------------------------------------------------------------------------------------------
// Random and mutated datagrams
// ---------------------------------------------------------------------------------------------

/// Which refusal it was, for the tally.
fn variant(e: &ProtoError) -> usize {
    match e {
        ProtoError::Truncated(_) => 0,
        ProtoError::BadMagic(_) => 1,
        ProtoError::Version { .. } => 2,
        ProtoError::BodyLength { .. } => 3,
        ProtoError::TooLarge(_) => 4,
        ProtoError::UnknownKind(_) => 5,
        ProtoError::Body { .. } => 6,
        ProtoError::Descriptors { .. } => 7,
    }
}

/// Bytes that are likely to keep a JSON body parseable, or to break it interestingly.
const JSONISH: &[u8] = b"{}[]\":,0123456789-+.eEtrufalsn \\u\x00\x1f\x7f\xc3\xa9\xff";

fn mutate(rng: &mut SmallRng, valid: &[Vec<u8>]) -> Vec<u8> {
    let mut b = valid[rng.random_range(0..valid.len())].clone();
    for _ in 0..rng.random_range(1..=3) {
        match rng.random_range(0..9) {
            // A bit flip anywhere.
            0 => {
                let i = rng.random_range(0..b.len());
                b[i] ^= 1 << rng.random_range(0..8);
            }
            // Cut short (a header kept whole or not).
            1 => {
                let n = rng.random_range(0..=b.len());
                b.truncate(n);
            }
            // Another version.
            2 if b.len() >= 6 => {
                let v: u16 = if rng.random_bool(0.5) {
                    rng.random()
                } else {
                    PROTOCOL_VERSION
                };
                b[4..6].copy_from_slice(&v.to_le_bytes());
            }
            // Another kind: a real one, or any number.
            3 if b.len() >= 8 => {
                let k: u16 = if rng.random_bool(0.7) {
                    let codes = kind_codes();
                    codes[rng.random_range(0..codes.len())]
                } else {
                    rng.random()
                };
                b[6..8].copy_from_slice(&k.to_le_bytes());
            }
            // Another request id: still a valid frame.
            4 if b.len() >= 12 => {
                let id: u32 = rng.random();
                b[8..12].copy_from_slice(&id.to_le_bytes());
            }
            // Another body length, near the real one or anything.
            5 if b.len() >= 16 => {
                let real = (b.len() - HEADER_LEN) as i64;
                let l = if rng.random_bool(0.7) {
                    (real + rng.random_range(-3..=3)).max(0) as u32
                } else {
                    rng.random()
                };
                b[12..16].copy_from_slice(&l.to_le_bytes());
            }
            // A body byte replaced by JSON punctuation, and the length kept consistent.
            6 if b.len() > HEADER_LEN => {
                let i = rng.random_range(HEADER_LEN..b.len());
                b[i] = JSONISH[rng.random_range(0..JSONISH.len())];
            }
            // Body bytes inserted or removed, the length fixed up (so the body is what fails).
            7 if b.len() > HEADER_LEN => {
                let i = rng.random_range(HEADER_LEN..=b.len());
                if rng.random_bool(0.5) || i == b.len() {
                    for _ in 0..rng.random_range(1..=4) {
                        b.insert(i, JSONISH[rng.random_range(0..JSONISH.len())]);
                    }
                } else {
                    b.remove(i);
                }
                let l = (b.len() - HEADER_LEN) as u32;
                b[12..16].copy_from_slice(&l.to_le_bytes());
            }
            // A random digit changed in a number (limits reached and passed).
            _ => {
                let digits: Vec<usize> = (HEADER_LEN..b.len())
                    .filter(|&i| b[i].is_ascii_digit())
                    .collect();
                if !digits.is_empty() {
                    let i = digits[rng.random_range(0..digits.len())];
                    b[i] = b'0' + rng.random_range(0..10u8);
                }
            }
        }
        if b.is_empty() {
            break;
        }
    }
    b
}

#[test]
fn random_and_mutated_datagrams_never_panic_and_what_is_accepted_round_trips() {
    let mut rng = SmallRng::seed_from_u64(0x474e_5653_0001);
    let valid: Vec<Vec<u8>> = samples()
        .into_iter()
        .map(|message| Frame {
            request_id: 0x1234,
            message,
        })
        .map(|f| f.encode().unwrap())
        .collect();
    let mut accepted_n = 0usize;
    let mut tally = [0usize; 8];
    const ROUNDS: usize = 30_000;
    for round in 0..ROUNDS {
        let bytes = match round % 4 {
            // Pure noise, mostly short.
            0 => {
                let n = match rng.random_range(0..1000) {
                    0..900 => rng.random_range(0..40),
                    900..995 => rng.random_range(0..600),
                    // Now and then past the limit.
                    _ => MAX_FRAME + rng.random_range(1..100),
                };
                (0..n).map(|_| rng.random()).collect()
            }
            // Noise after a valid magic and version (reaching the later checks).
            1 => {
                let n = rng.random_range(0..200);
                let body: Vec<u8> = (0..n)
                    .map(|_| JSONISH[rng.random_range(0..JSONISH.len())])
                    .collect();
                let codes = kind_codes();
                let kind = codes[rng.random_range(0..codes.len())];
                let len = if rng.random_bool(0.8) {
                    body.len() as u32
                } else {
                    rng.random()
                };
                raw(PROTOCOL_VERSION, kind, rng.random(), len, &body)
            }
            _ => mutate(&mut rng, &valid),
        };
        // Half the time 0 or 1 (what messages carry), so that more are accepted.
        let fds = if rng.random_bool(0.5) {
            rng.random_range(0..=1usize)
        } else {
            rng.random_range(0..=5usize)
        };
        match Frame::decode(&bytes, fds) {
            Ok(frame) => {
                accepted_n += 1;
                assert_eq!(frame.message.descriptors(), fds);
                frame.message.check().unwrap();
                let again = frame
                    .encode()
                    .unwrap_or_else(|e| panic!("accepted {bytes:?} but cannot re-encode: {e}"));
                assert!(again.len() <= bytes.len(), "re-encoded larger");
                assert_eq!(Frame::decode(&again, fds).as_ref(), Ok(&frame));
                assert_eq!(
                    Frame::header(&again).unwrap().request_id.get(),
                    frame.request_id
                );
            }
            Err(e) => {
                tally[variant(&e)] += 1;
                // Every refusal says something.
                assert!(!e.to_string().is_empty());
            }
        }
    }
    eprintln!("{ROUNDS} datagrams: {accepted_n} accepted, refusals by variant {tally:?}");
    // The loop reached every check, and accepted some (so the round trip was exercised).
    assert!(accepted_n > 200, "only {accepted_n} accepted");
    for (i, n) in tally.iter().enumerate() {
        assert!(*n > 0, "refusal variant {i} never reached: {tally:?}");
    }
}

#[test]
fn file_messages_out_of_their_limits_are_refused_both_ways() {
    let long = "n".repeat(gpunvme_serve_proto::msg::MAX_FILE_NAME + 1);
    for name in [String::new(), long] {
        refused_both_ways(
            req(Request::FsCreate {
                controller: "nvme0".into(),
                nsid: 1,
                name: name.clone(),
                bytes: 1,
                replace: false,
            }),
            "a file name",
        );
        refused_both_ways(
            req(Request::FsRename {
                controller: "nvme0".into(),
                nsid: 1,
                from: "a".into(),
                to: name,
                replace: false,
            }),
            "a file name",
        );
    }
    for table_bytes in [0, gpunvme_serve_proto::msg::MAX_TABLE_BYTES + 8] {
        refused_both_ways(
            rep(Reply::FsReserved {
                lease: 1,
                table_bytes,
            }),
            "extent table",
        );
    }
}
