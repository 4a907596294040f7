//! Queue pairs against the fake controller (`fake/`): Read and Write through slot buffers and
//! PRPs of every shape, many commands in flight, the rings wrapping many times, and a
//! controller that stops completing, posts a command id nobody sent, or fails a command.

mod fake;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fake::{BLOCKS, CONTROLLER, LBA_SIZE, NSID};
use gpunvme_serve_client::layout::arena_bytes_for;
use gpunvme_serve_client::{ClientError, Connection, IoOp, QueuePair};
use nvme_spec::StatusCodeType;
use nvme_spec::status::generic;

/// `count` pairs of `depth` with `slot_bytes` slots in a new arena just big enough.
fn pairs(conn: &Connection, count: u16, depth: u32, slot_bytes: u32) -> Vec<QueuePair> {
    let bytes = arena_bytes_for(count, depth, slot_bytes);
    let arena = Arc::new(conn.alloc_arena(CONTROLLER, bytes).unwrap());
    conn.create_queues(CONTROLLER, &arena, count, depth, slot_bytes)
        .unwrap()
}

/// Bytes no two (lba, salt) pairs share.
fn pattern(lba: u64, len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (lba as usize * 31 + i * 7 + salt as usize) as u8 ^ (i >> 9) as u8)
        .collect()
}

/// A small deterministic generator (xorshift64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn writes_read_back_through_prps_of_every_shape() {
    let (conn, fake) = fake::start();
    let mut qp = pairs(&conn, 1, 8, 64 << 10).pop().unwrap();
    // 1 block; one page; 2 pages; 3 pages (a PRP list); 16 pages; a whole 64 KiB slot.
    for (lba, blocks) in [
        (0, 1),
        (9, 8),
        (100, 16),
        (1000, 24),
        (2000, 128),
        (5000, 128),
    ] {
        let len = (blocks * LBA_SIZE) as usize;
        let data = pattern(lba, len, 1);
        qp.write(NSID, lba, blocks, LBA_SIZE, &data).unwrap();
        let on_disk =
            fake.disk.lock().unwrap()[(lba * u64::from(LBA_SIZE)) as usize..][..len].to_vec();
        assert_eq!(
            on_disk, data,
            "the disk after writing {blocks} blocks at {lba}"
        );
        let mut back = vec![0u8; len];
        qp.read(NSID, lba, blocks, LBA_SIZE, &mut back).unwrap();
        assert_eq!(back, data, "reading {blocks} blocks at {lba} back");
    }
    // Data written by the controller's side shows up in reads.
    fake.disk.lock().unwrap()[..512].fill(0x5a);
    let mut back = vec![0u8; 512];
    qp.read(NSID, 0, 1, LBA_SIZE, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a));
    assert_eq!(qp.in_flight(), 0);
}

#[test]
fn reads_land_in_arena_memory_at_any_dword_offset() {
    let (conn, fake) = fake::start();
    // The pairs take the arena's first bytes; the rest is this client's, read into directly.
    let (depth, slot) = (8, 4096);
    let pair_bytes = arena_bytes_for(1, depth, slot);
    let arena = Arc::new(
        conn.alloc_arena(CONTROLLER, pair_bytes + (4 << 20))
            .unwrap(),
    );
    let mut qp = conn
        .create_queues(CONTROLLER, &arena, 1, depth, slot)
        .unwrap()
        .pop()
        .unwrap();
    let data = pattern(300, 1 << 20, 9);
    fake.disk.lock().unwrap()[300 * LBA_SIZE as usize..][..data.len()].copy_from_slice(&data);
    // Inside a page, crossing one, a PRP list from an offset, 1 MiB (more than the 4 KiB
    // slots hold) from the second dword of a page, and two pages from the last dword of one.
    for (blocks, at) in [(1u32, 512u64), (2, 3584), (24, 512), (2048, 4), (1, 4092)] {
        let at = pair_bytes + at;
        let len = (blocks * LBA_SIZE) as usize;
        let cid = qp
            .submit_read_into(NSID, 300, blocks, LBA_SIZE, &arena, at)
            .unwrap();
        let done = qp.reap(Duration::from_secs(5)).unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].slot, cid);
        done[0].check().unwrap();
        let mut got = vec![0u8; len];
        arena.mem.read(at as usize, &mut got).unwrap();
        assert_eq!(
            got,
            data[..len],
            "{blocks} blocks read into arena byte {at}"
        );
    }
    // Outside the arena, not dword-aligned, or past one PRP list: refused, nothing sent.
    let end = arena.len();
    for (blocks, at) in [
        (1u32, end - 256),
        (1, pair_bytes + 2),
        (4104, pair_bytes + 8),
    ] {
        let e = qp
            .submit_read_into(NSID, 0, blocks, LBA_SIZE, &arena, at)
            .unwrap_err();
        assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
    }
    assert_eq!(qp.in_flight(), 0);
}

#[test]
fn a_two_mib_transfer_uses_a_full_prp_list() {
    let (conn, fake) = fake::start();
    let mut qp = pairs(&conn, 1, 2, 2 << 20).pop().unwrap();
    let blocks = (2 << 20) / LBA_SIZE;
    let data = pattern(7, 2 << 20, 9);
    qp.write(NSID, 4096, blocks, LBA_SIZE, &data).unwrap();
    assert_eq!(
        &fake.disk.lock().unwrap()[4096 * 512..][..2 << 20],
        &data[..]
    );
    let mut back = vec![0u8; 2 << 20];
    qp.read(NSID, 4096, blocks, LBA_SIZE, &mut back).unwrap();
    assert!(back == data);
}

#[test]
fn sequential_commands_wrap_the_rings_many_times() {
    let (conn, _fake) = fake::start();
    // Depth 4: 3 in flight at most; 400 commands go round the rings 100 times.
    let mut qp = pairs(&conn, 1, 4, 4096).pop().unwrap();
    for i in 0..200u64 {
        let lba = (i * 13) % (BLOCKS - 8);
        let data = pattern(lba, 4096, i as u8);
        qp.write(NSID, lba, 8, LBA_SIZE, &data).unwrap();
        let mut back = vec![0u8; 4096];
        qp.read(NSID, lba, 8, LBA_SIZE, &mut back).unwrap();
        assert_eq!(back, data, "command pair {i}");
    }
}

#[test]
fn many_in_flight_completed_out_of_order() {
    let (conn, fake) = fake::start();
    fake.knobs.reverse.store(true, Ordering::Relaxed);
    let depth = 32;
    let mut qp = pairs(&conn, 1, depth, 4096).pop().unwrap();
    assert_eq!(qp.capacity(), 31);
    let chunks = BLOCKS / 8;
    let mut max_in_flight = 0;
    // Every chunk written, keeping the queue full...
    let mut next = 0;
    let mut done = 0;
    while done < chunks {
        while next < chunks && qp.in_flight() < qp.capacity() {
            let data = pattern(next * 8, 4096, 3);
            qp.submit_write(NSID, next * 8, 8, LBA_SIZE, &data).unwrap();
            next += 1;
        }
        max_in_flight = max_in_flight.max(qp.in_flight());
        for c in qp.reap(fake::BOUND).unwrap() {
            c.check().unwrap();
            assert_eq!(c.op, IoOp::Write);
            done += 1;
        }
    }
    assert_eq!(max_in_flight, 31);
    // ...then every chunk read back, each checked from its slot as it completes.
    let (mut next, mut done) = (0, 0);
    let mut seen = vec![false; chunks as usize];
    while done < chunks {
        while next < chunks && qp.in_flight() < qp.capacity() {
            qp.submit_read(NSID, next * 8, 8, LBA_SIZE).unwrap();
            next += 1;
        }
        for c in qp.reap(fake::BOUND).unwrap() {
            c.check().unwrap();
            assert_eq!((c.op, c.blocks, c.nsid), (IoOp::Read, 8, NSID));
            let mut got = vec![0u8; 4096];
            qp.slot_data(c.slot, &mut got).unwrap();
            assert_eq!(got, pattern(c.lba, 4096, 3), "chunk at lba {}", c.lba);
            assert!(!std::mem::replace(&mut seen[(c.lba / 8) as usize], true));
            done += 1;
        }
    }
    assert!(seen.iter().all(|&s| s));
    // 4096 commands through a 32-entry ring: 128 times round.
    assert_eq!(fake.knobs.commands.load(Ordering::Relaxed), 2 * chunks);
}

#[test]
fn random_mixed_traffic_on_several_pairs_matches_a_model() {
    let (conn, fake) = fake::start();
    let mut qps = pairs(&conn, 3, 16, 16384);
    let mut model = vec![0u8; (BLOCKS * u64::from(LBA_SIZE)) as usize];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..300u64 {
        // Each pair gets a batch of commands on LBA ranges of its own (no two in flight
        // overlap), then all are reaped.
        for (p, qp) in qps.iter_mut().enumerate() {
            let region = p as u64 * (BLOCKS / 3);
            for k in 0..(1 + rng.next() % 15) {
                let blocks = 1 + (rng.next() % 32) as u32;
                let lba = region + k * 32 + (round % 4) * 512;
                let len = (blocks * LBA_SIZE) as usize;
                if rng.next() % 2 == 0 {
                    let data = pattern(lba, len, round as u8);
                    qp.submit_write(NSID, lba, blocks, LBA_SIZE, &data).unwrap();
                    model[(lba * 512) as usize..][..len].copy_from_slice(&data);
                } else {
                    qp.submit_read(NSID, lba, blocks, LBA_SIZE).unwrap();
                }
            }
        }
        for qp in &mut qps {
            while qp.in_flight() > 0 {
                for c in qp.reap(fake::BOUND).unwrap() {
                    c.check().unwrap();
                    if c.op == IoOp::Read {
                        let len = (c.blocks * LBA_SIZE) as usize;
                        let mut got = vec![0u8; len];
                        qp.slot_data(c.slot, &mut got).unwrap();
                        assert_eq!(got, model[(c.lba * 512) as usize..][..len]);
                    }
                }
            }
        }
    }
    assert!(*fake.disk.lock().unwrap() == model);
}

#[test]
fn a_full_queue_is_refused_and_sync_calls_make_room() {
    let (conn, fake) = fake::start();
    let mut qp = pairs(&conn, 1, 4, 4096).pop().unwrap();
    fake.knobs.stop_completing.store(true, Ordering::Release);
    for _ in 0..3 {
        qp.submit_read(NSID, 0, 1, LBA_SIZE).unwrap();
    }
    let e = qp.submit_read(NSID, 0, 1, LBA_SIZE).unwrap_err();
    assert!(
        matches!(e, ClientError::QueueFull { in_flight: 3, .. }),
        "{e}"
    );
    fake.knobs.stop_completing.store(false, Ordering::Release);
    // A synchronous write waits for a slot; the completions it saw are kept for reap.
    qp.write(NSID, 8, 1, LBA_SIZE, &[7; 512]).unwrap();
    let mut reaped = 0;
    while reaped < 3 {
        reaped += qp.reap(fake::BOUND).unwrap().len();
    }
    assert_eq!(reaped, 3);
    assert_eq!(qp.in_flight(), 0);
    assert!(qp.reap(Duration::ZERO).unwrap().is_empty());
}

#[test]
fn a_controller_that_stops_completing_times_out_by_qid_and_cid() {
    let (conn, fake) = fake::start();
    let mut qp = pairs(&conn, 1, 8, 4096).pop().unwrap();
    qp.write(NSID, 0, 8, LBA_SIZE, &[1; 4096]).unwrap();
    fake.knobs.stop_completing.store(true, Ordering::Release);
    qp.set_bound(Duration::from_millis(150));
    let t = Instant::now();
    let mut buf = vec![0u8; 4096];
    let e = qp.read(NSID, 0, 8, LBA_SIZE, &mut buf).unwrap_err();
    let took = t.elapsed();
    let ClientError::Timeout { qid, cid, after } = e else {
        panic!("want a timeout, got {e}")
    };
    assert_eq!((qid, after), (qp.qid(), Duration::from_millis(150)));
    assert!(
        took >= after && took < after + Duration::from_secs(2),
        "{took:?}"
    );
    // The command stays in flight; an async wait names the oldest one.
    let second = qp.submit_read(NSID, 8, 1, LBA_SIZE).unwrap();
    assert_ne!(second, cid);
    let t = Instant::now();
    let e = qp.reap(Duration::from_millis(50)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(e, ClientError::Timeout { cid: c, .. } if c == cid),
        "{e}"
    );
    assert!(e.to_string().contains(&format!("command {cid}")), "{e}");
    // The controller comes back: both complete, and the pair goes on.
    fake.knobs.stop_completing.store(false, Ordering::Release);
    let mut slots = Vec::new();
    while slots.len() < 2 {
        slots.extend(qp.reap(fake::BOUND).unwrap().iter().map(|c| c.slot));
    }
    slots.sort();
    let mut want = vec![cid, second];
    want.sort();
    assert_eq!(slots, want);
    qp.read(NSID, 0, 8, LBA_SIZE, &mut buf).unwrap();
    assert_eq!(buf, vec![1; 4096]);
}

#[test]
fn a_completion_for_a_command_not_in_flight_is_a_protocol_error() {
    let (conn, fake) = fake::start();
    let mut qps = pairs(&conn, 2, 8, 4096);
    let mut buf = vec![0u8; 512];
    qps[0].read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap();
    fake.knobs.bad_cid.store(true, Ordering::Relaxed);
    let e = qps[0].read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap_err();
    let ClientError::Protocol(why) = &e else {
        panic!("want a protocol error, got {e}")
    };
    assert!(
        why.contains("command id 65520, which is not in flight"),
        "{why}"
    );
    assert!(why.contains(&format!("queue {}", qps[0].qid())), "{why}");
    // The pair is broken for good; the other is not.
    assert!(matches!(
        qps[0].submit_read(NSID, 0, 1, LBA_SIZE),
        Err(ClientError::Protocol(_))
    ));
    qps[1].read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap();
}

#[test]
fn an_error_status_is_a_command_error_naming_the_status() {
    let (conn, _fake) = fake::start();
    let mut qp = pairs(&conn, 1, 8, 4096).pop().unwrap();
    let mut buf = vec![0u8; 1024];
    let e = qp
        .read(NSID, BLOCKS - 1, 2, LBA_SIZE, &mut buf)
        .unwrap_err();
    let ClientError::Command {
        qid,
        op,
        lba,
        status,
        ..
    } = &e
    else {
        panic!("want a command error, got {e}")
    };
    assert_eq!((*qid, *op, *lba), (qp.qid(), "Read", BLOCKS - 1));
    assert!(status.is(StatusCodeType::GENERIC, generic::LBA_OUT_OF_RANGE) && status.dnr);
    assert!(e.to_string().contains("LBA Out of Range"), "{e}");
    // Async: the completion carries it.
    let slot = qp.submit_write(NSID, 0, 1, LBA_SIZE, &[0; 512]).unwrap();
    let _ = slot;
    let e = qp
        .submit_read(7, 0, 1, LBA_SIZE)
        .and_then(|_| {
            let mut all = Vec::new();
            while all.len() < 2 {
                all.extend(qp.reap(fake::BOUND)?);
            }
            all.iter().try_for_each(|c| c.check())
        })
        .unwrap_err();
    assert!(e.to_string().contains("Invalid Namespace or Format"), "{e}");
    // And the pair goes on.
    qp.read(NSID, 0, 2, LBA_SIZE, &mut buf).unwrap();
}

#[test]
fn bad_arguments_are_refused_before_anything_is_written() {
    let (conn, fake) = fake::start();
    let mut qp = pairs(&conn, 1, 8, 8192).pop().unwrap();
    let mut buf = vec![0u8; 8192];
    let bad = [
        qp.read(NSID, 0, 0, LBA_SIZE, &mut buf[..0]),
        qp.read(NSID, 0, 2, LBA_SIZE, &mut buf[..512]),
        qp.read(NSID, 0, 17, LBA_SIZE, &mut vec![0; 17 * 512]),
        qp.read(NSID, u64::MAX, 1, LBA_SIZE, &mut buf[..512]),
        qp.read(NSID, 0, 1, 0, &mut buf[..0]),
        qp.write(NSID, 0, 1, LBA_SIZE, &buf[..511]),
        qp.write(NSID, 0, 32, LBA_SIZE, &vec![0; 32 * 512]),
        qp.submit_read(NSID, 0, 0, LBA_SIZE).map(drop),
        qp.submit_read(NSID, 0, 17, LBA_SIZE).map(drop),
        qp.submit_write(NSID, 0, 1, LBA_SIZE, &buf[..1024])
            .map(drop),
        qp.slot_data(8, &mut buf[..1]),
        qp.slot_data(0, &mut vec![0; 8193]),
    ];
    for (i, r) in bad.into_iter().enumerate() {
        assert!(
            matches!(r, Err(ClientError::InvalidArgument(_))),
            "case {i}: {r:?}"
        );
    }
    assert_eq!(qp.in_flight(), 0);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(fake.knobs.commands.load(Ordering::Relaxed), 0);
    // A slot in flight cannot be read.
    fake.knobs.stop_completing.store(true, Ordering::Release);
    let slot = qp.submit_read(NSID, 0, 1, LBA_SIZE).unwrap();
    assert!(matches!(
        qp.slot_data(slot, &mut buf[..512]),
        Err(ClientError::InvalidArgument(_))
    ));
}

#[test]
fn the_sq_head_field_is_checked_and_a_stale_one_does_not_stall_the_ring() {
    let (conn, fake) = fake::start();
    let mut qps = pairs(&conn, 2, 4, 4096);
    // SQHD always 0: the entries are known free from the completed commands themselves.
    fake.knobs.stale_sqhd.store(true, Ordering::Relaxed);
    let mut buf = vec![0u8; 512];
    for i in 0..40 {
        qps[0].read(NSID, i, 1, LBA_SIZE, &mut buf).unwrap();
    }
    for _ in 0..10 {
        for _ in 0..3 {
            qps[0].submit_read(NSID, 0, 1, LBA_SIZE).unwrap();
        }
        let mut n = 0;
        while n < 3 {
            n += qps[0].reap(fake::BOUND).unwrap().len();
        }
    }
    fake.knobs.stale_sqhd.store(false, Ordering::Relaxed);
    // An SQ head outside the ring breaks the pair.
    fake.knobs.sqhd_outside.store(true, Ordering::Relaxed);
    let e = qps[1].read(NSID, 0, 1, LBA_SIZE, &mut buf).unwrap_err();
    assert!(
        matches!(&e, ClientError::Protocol(why) if why.contains("SQ head 4 is outside")),
        "{e}"
    );
}
