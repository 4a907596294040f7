//! Hostile modes (`EmuConfig::hostile`): each one catches a deliberately broken client that a
//! friendly controller lets pass, because stale memory happens to hold the right bytes. Every
//! test runs the same broken client twice: friendly (the bug goes unseen) and hostile (it fails
//! deterministically).

mod common;

use std::time::{Duration, Instant};

use common::*;
use nvme::Device;
use nvme_emu::{EmuConfig, Hostile};
use nvme_spec::status::{StatusCodeType as Sct, generic};
use nvme_spec::{Completion, NvmOpcode};

const READ: u8 = NvmOpcode::READ.0;

fn host(hostile: Hostile) -> Host {
    Host::enabled(EmuConfig {
        hostile,
        ..small_config(1024, 512)
    })
}

/// Waits (bounded) until `f` holds.
fn until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A client that rings the SQ doorbell one slot early: it writes one new command but moves
/// the tail by two, over a slot still holding a command it submitted before. Returns the two
/// completions of that second submission.
fn doorbell_over_an_unwritten_slot(h: &mut Host) -> (Completion, Completion) {
    let mut q = h.create_io_pair(1, 4, 8);
    let buf = h.dev.alloc_dma(4096).unwrap();
    let addr = buf.device_address(0);
    // Fill every slot once, properly.
    for lba in 0..4 {
        let mut cmd = rw(READ, 1, lba, 1, addr, 0);
        cmd.cdw0 = cmd.cdw0.with_cid(10 + lba as u16);
        assert_ok(&q.run(&h.dev, &cmd));
    }
    // The bug: slot 0 rewritten, the tail moved to 2.
    let mut cmd = rw(READ, 1, 7, 1, addr, 0);
    cmd.cdw0 = cmd.cdw0.with_cid(20);
    q.push(&cmd);
    q.sq_tail = 2;
    q.ring(&h.dev);
    let first = q.wait(&h.dev);
    let second = q.wait(&h.dev);
    (first, second)
}

#[test]
fn poisoned_sq_catches_a_doorbell_over_an_unwritten_slot() {
    // Friendly: slot 1 still holds the read of cid 11, which runs again and succeeds.
    let (a, b) = doorbell_over_an_unwritten_slot(&mut host(Hostile::default()));
    let mut cids = [a.cid, b.cid];
    cids.sort();
    assert_eq!(cids, [11, 20], "the stale command ran again unnoticed");
    assert_ok(&a);
    assert_ok(&b);
    // Hostile: slot 1 holds poison, which fails under a command id never issued.
    let (a, b) = doorbell_over_an_unwritten_slot(&mut host(Hostile {
        poison_sq: true,
        ..Hostile::default()
    }));
    let (good, bad) = if a.cid == 20 { (a, b) } else { (b, a) };
    assert_ok(&good);
    assert_eq!(bad.cid, 0xffff);
    assert_status(&bad, Sct::GENERIC, generic::INVALID_COMMAND_OPCODE);
}

/// A client whose tail doorbell moves backwards over commands the controller has not fetched
/// (held back here by a full completion queue). Returns the invalid doorbell writes counted.
fn tail_moved_backwards(h: &mut Host) -> u64 {
    // CQ of 2 entries: holds one completion; the SQ's other commands wait unfetched.
    let mut q = h.create_io_pair(1, 8, 2);
    let buf = h.dev.alloc_dma(4096).unwrap();
    let addr = buf.device_address(0);
    for lba in 0..3 {
        q.push(&rw(READ, 1, lba, 1, addr, 0));
    }
    q.ring(&h.dev);
    until("the first completion", || q.peek().is_some());
    // The bug: tail 3 -> 2 while two commands are still unfetched.
    q.sq_tail = 2;
    q.ring(&h.dev);
    let before = h.dev.stats().invalid_doorbell_writes;
    // Give the controller time to look at the doorbell (it polls).
    let deadline = Instant::now() + Duration::from_millis(300);
    while Instant::now() < deadline && h.dev.stats().invalid_doorbell_writes == before {
        std::thread::sleep(Duration::from_millis(1));
    }
    h.dev.stats().invalid_doorbell_writes
}

#[test]
fn a_backward_tail_is_an_invalid_doorbell_write() {
    assert_eq!(
        tail_moved_backwards(&mut host(Hostile::default())),
        0,
        "friendly: a smaller tail just submits less"
    );
    assert_eq!(
        tail_moved_backwards(&mut host(Hostile {
            flag_backward_tail: true,
            ..Hostile::default()
        })),
        1
    );
}

/// A client that rings the CQ head doorbell past an entry before reading it. Returns the
/// entry it then reads.
fn head_rung_before_reading(h: &mut Host) -> Completion {
    let mut q = h.create_io_pair(1, 8, 8);
    let buf = h.dev.alloc_dma(4096).unwrap();
    let addr = buf.device_address(0);
    for (lba, cid) in [(0u64, 30u16), (1, 31)] {
        let mut cmd = rw(READ, 1, lba, 1, addr, 0);
        cmd.cdw0 = cmd.cdw0.with_cid(cid);
        q.push(&cmd);
    }
    q.ring(&h.dev);
    until("both completions", || {
        peek_slot(&q.cq, 1, q.phase).is_some() && q.peek().is_some()
    });
    // The bug: head doorbell 0 -> 2, then the entries are read.
    q.cq_head = 2;
    q.ring_cq(&h.dev);
    // Let the controller see the doorbell.
    std::thread::sleep(Duration::from_millis(100));
    peek_slot(&q.cq, 1, q.phase).expect("the phase still says new")
}

#[test]
fn a_stale_cq_catches_a_head_rung_before_the_entry_was_read() {
    let c = head_rung_before_reading(&mut host(Hostile::default()));
    assert_eq!(c.cid, 31, "friendly: the freed entry still reads right");
    let c = head_rung_before_reading(&mut host(Hostile {
        stale_cq: true,
        ..Hostile::default()
    }));
    assert_eq!((c.cid, c.sqid), (0xffff, 0xffff), "hostile: garbage");
}

#[test]
fn an_honest_client_passes_with_every_mode_on() {
    let mut h = host(Hostile::ALL);
    let mut q = h.create_io_pair(1, 4, 4);
    let buf = h.dev.alloc_dma(4096).unwrap();
    let data = pattern(512, 9);
    buf.write(0, &data);
    // Several wraps of both rings, writes and reads.
    for i in 0..40u64 {
        let op = if i % 2 == 0 { NvmOpcode::WRITE.0 } else { READ };
        assert_ok(&q.run(&h.dev, &rw(op, 1, i / 2, 1, buf.device_address(0), 0)));
    }
    let mut back = vec![0u8; 512];
    buf.read(0, &mut back);
    assert_eq!(back, data);
    assert_eq!(h.dev.stats().invalid_doorbell_writes, 0);
}
