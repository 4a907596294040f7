//! Several controller threads: queue pairs served concurrently from several host threads, a
//! completion queue shared by two submission queues, which thread touches which memory,
//! deletion and reset while commands are in flight, fatal errors and external doorbells on a
//! thread other than 0.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use nvme::Device;
use nvme_emu::{
    DoorbellWord, EmuConfig, MemoryRegion, RegionError, config::MAX_CONTROLLER_THREADS,
    controller_thread_index,
};
use nvme_spec::registers::sq_tail_doorbell;
use nvme_spec::status::{StatusCodeType as Sct, command_specific, generic};
use nvme_spec::{AdminOpcode, Command, NvmOpcode};

const READ: u8 = NvmOpcode::READ.0;
const WRITE: u8 = NvmOpcode::WRITE.0;

fn config(threads: usize) -> EmuConfig {
    EmuConfig {
        controller_threads: threads,
        max_io_queue_pairs: 8,
        ..small_config(64 * 1024, 512)
    }
}

#[test]
fn thread_counts_are_resolved_and_validated() {
    for (asked, pairs, expect) in [(1, 8, 1), (2, 8, 2), (4, 8, 4), (4, 2, 2), (64, 64, 64)] {
        let dev = nvme_emu::EmuDevice::start(EmuConfig {
            controller_threads: asked,
            max_io_queue_pairs: pairs,
            ..small_config(64, 512)
        })
        .unwrap();
        assert_eq!(
            dev.controller_threads(),
            expect,
            "{asked} asked, {pairs} pairs"
        );
        assert_eq!(dev.thread_for_cq(0), 0);
        assert_eq!(dev.thread_for_cq(expect as u16 + 1), 0);
        assert!(
            dev.describe()
                .contains(&format!("{expect} controller thread"))
        );
        dev.stop();
    }
    // Automatic: at least one thread, and never more than the queue pairs.
    let auto = EmuConfig {
        max_io_queue_pairs: 1,
        ..small_config(64, 512)
    };
    assert_eq!(auto.resolved_controller_threads(), 1);
    assert!(EmuConfig::default().resolved_controller_threads() >= 1);
    let bad = EmuConfig {
        controller_threads: MAX_CONTROLLER_THREADS + 1,
        ..EmuConfig::default()
    };
    assert!(nvme_emu::EmuDevice::start(bad).is_err());
    // Not a controller thread.
    assert_eq!(controller_thread_index(), None);
}

/// Runs `rounds` rounds of 32 writes then 32 reads (8 blocks each, LBAs owned by the queue)
/// on `q`, checking that every command completes exactly once, successfully, and every byte.
fn hammer(dev: &nvme_emu::EmuDevice, q: &mut QueuePair, rounds: u64) -> u64 {
    let qid = q.qid as u64;
    let bufs: Vec<_> = (0..32).map(|_| dev.alloc_dma(4096).unwrap()).collect();
    let mut commands = 0;
    for round in 0..rounds {
        for write in [true, false] {
            for (i, b) in bufs.iter().enumerate() {
                if write {
                    b.write(0, &pattern(4096, qid << 32 | round << 8 | i as u64));
                } else {
                    b.fill(0, 4096, 0);
                }
                let op = if write { WRITE } else { READ };
                let mut cmd = rw(op, 1, qid * 2048 + i as u64 * 8, 8, b.device_address(0), 0);
                cmd.cdw0 = cmd.cdw0.with_cid((round as u16) << 8 | i as u16);
                q.push(&cmd);
                // Ring now and then, so batches of different sizes meet the controller.
                if i % 11 == 10 {
                    q.ring(dev);
                }
            }
            q.ring(dev);
            let mut seen = [0u8; 32];
            for _ in 0..32 {
                let c = q.wait(dev);
                assert_ok(&c);
                assert_eq!(c.sqid, q.qid);
                assert_eq!(c.cid >> 8, round as u16, "queue {qid}: a stale completion");
                seen[(c.cid & 0xff) as usize] += 1;
            }
            assert!(seen.iter().all(|&n| n == 1), "queue {qid}: {seen:?}");
            assert!(q.peek().is_none(), "queue {qid}: an extra completion");
            commands += 32;
        }
        for (i, b) in bufs.iter().enumerate() {
            let mut back = vec![0u8; 4096];
            b.read(0, &mut back);
            assert!(
                back == pattern(4096, qid << 32 | round << 8 | i as u64),
                "queue {qid} round {round} buffer {i}"
            );
        }
    }
    commands
}

#[test]
fn queue_pairs_from_several_host_threads_on_1_2_and_4_controller_threads() {
    for threads in [1, 2, 4] {
        let mut h = Host::enabled(config(threads));
        assert_eq!(h.dev.controller_threads(), threads);
        let queues: Vec<QueuePair> = (1..=6).map(|qid| h.create_io_pair(qid, 64, 64)).collect();
        let dev = h.dev.clone();
        let before = dev.stats();
        let host_threads: Vec<_> = queues
            .into_iter()
            .map(|mut q| {
                let dev = dev.clone();
                std::thread::spawn(move || hammer(&dev, &mut q, 6))
            })
            .collect();
        let total: u64 = host_threads.into_iter().map(|t| t.join().unwrap()).sum();
        let after = dev.stats();
        assert_eq!(total, 6 * 6 * 64);
        assert_eq!(after.io_commands - before.io_commands, total);
        assert_eq!(
            after.completions_posted - before.completions_posted,
            total,
            "every command completed exactly once ({threads} threads)"
        );
        assert_eq!(after.errors, 0);
        assert_eq!(after.fatal_errors, 0);
        // The bytes on the device, read back through the admin-created queue of another
        // thread: queue 6 reads what queue 1 wrote last.
        let mut q = h.create_io_pair(7, 16, 16);
        let buf = h.dev.alloc_dma(4096).unwrap();
        for i in [0u64, 13, 31] {
            assert_ok(&q.run(
                &h.dev,
                &rw(READ, 1, 2048 + i * 8, 8, buf.device_address(0), 0),
            ));
            let mut back = vec![0u8; 4096];
            buf.read(0, &mut back);
            assert!(back == pattern(4096, 1 << 32 | 5 << 8 | i));
        }
        // Queues come and go on every thread.
        for qid in 1..=7 {
            assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, qid));
            assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, qid));
        }
        let mut q = h.create_io_pair(3, 16, 16);
        assert_ok(&q.run(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0)));
    }
}

#[test]
fn submission_queues_sharing_a_completion_queue() {
    for threads in [1, 2, 4] {
        let mut h = Host::enabled(config(threads));
        // CQ 2 (thread 1 of 2 and 4) takes the completions of SQs 2, 3 and 5.
        let mut cq = QueuePair::new(&h.dev, 2, 2, 128);
        assert_ok(&h.create_cq_raw(2, 127, cq.cq.device_address(0), true, 0));
        let mut sqs: Vec<QueuePair> = [2u16, 3, 5]
            .iter()
            .map(|&qid| {
                let sq = QueuePair::new(&h.dev, qid, 64, 2);
                assert_ok(&h.create_sq_raw(qid, 63, sq.sq.device_address(0), 2));
                sq
            })
            .collect();
        // SQ 3's own id, as a CQ id, would belong to another thread: it must not matter.
        if threads > 1 {
            assert_ne!(h.dev.thread_for_cq(3), h.dev.thread_for_cq(2));
        }
        let buf = h.dev.alloc_dma(4096).unwrap();
        buf.write(0, &pattern(4096, 9));
        let mut outstanding: HashMap<(u16, u16), u32> = HashMap::new();
        for round in 0..20u16 {
            for sq in &mut sqs {
                for i in 0..40u16 {
                    let op = if i % 2 == 0 { WRITE } else { READ };
                    let lba = sq.qid as u64 * 1024 + i as u64 * 8;
                    let mut cmd = rw(op, 1, lba, 8, buf.device_address(0), 0);
                    let cid = round << 8 | i;
                    cmd.cdw0 = cmd.cdw0.with_cid(cid);
                    sq.push(&cmd);
                    outstanding.insert((sq.qid, cid), 0);
                }
                sq.ring(&h.dev);
            }
            for _ in 0..120 {
                let c = cq.wait(&h.dev);
                assert_ok(&c);
                let n = outstanding
                    .get_mut(&(c.sqid, c.cid))
                    .unwrap_or_else(|| panic!("unexpected completion {c:?}"));
                *n += 1;
                assert_eq!(*n, 1, "completed twice: {c:?}");
            }
            assert!(cq.peek().is_none());
            assert!(outstanding.values().all(|&n| n == 1));
            outstanding.clear();
        }
        // A CQ with SQs cannot go; without them it can.
        let c = h.delete_queue(AdminOpcode::DELETE_IO_CQ, 2);
        assert_status(
            &c,
            Sct::COMMAND_SPECIFIC,
            command_specific::INVALID_QUEUE_DELETION,
        );
        for qid in [2, 3, 5] {
            assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, qid));
        }
        assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 2));
    }
}

/// Memory standing in for GPU memory: records which controller thread calls it.
struct ThreadRecordingRegion {
    bytes: Mutex<Vec<u8>>,
    /// Per thread index (and one slot for "not a controller thread"): calls made.
    calls: Vec<AtomicU32>,
}

impl ThreadRecordingRegion {
    fn new(len: usize) -> Arc<Self> {
        Arc::new(Self {
            bytes: Mutex::new(vec![0; len]),
            calls: (0..=MAX_CONTROLLER_THREADS)
                .map(|_| AtomicU32::new(0))
                .collect(),
        })
    }

    fn note(&self) {
        let slot = controller_thread_index().unwrap_or(MAX_CONTROLLER_THREADS);
        self.calls[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// The threads that called, as (index, calls); index MAX means no controller thread.
    fn callers(&self) -> Vec<(usize, u32)> {
        self.calls
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.load(Ordering::Relaxed)))
            .filter(|&(_, c)| c > 0)
            .collect()
    }
}

impl MemoryRegion for ThreadRecordingRegion {
    fn len(&self) -> usize {
        self.bytes.lock().unwrap().len()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        self.note();
        let m = self.bytes.lock().unwrap();
        buf.copy_from_slice(&m[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.note();
        let mut m = self.bytes.lock().unwrap();
        m[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> Result<(), RegionError> {
        self.note();
        Ok(())
    }
    fn prefetch(&self, _ranges: &[(u64, usize)]) -> Result<(), RegionError> {
        self.note();
        Ok(())
    }
}

#[test]
fn each_queue_s_memory_is_touched_by_its_thread_only() {
    const SQ: u64 = 0;
    const CQ: u64 = 4096;
    const DATA: u64 = 8192;
    for threads in [1, 2, 4] {
        let mut h = Host::enabled(config(threads));
        let map = h.dev.address_map().clone();
        let regions: Vec<(u16, Arc<ThreadRecordingRegion>, u64)> = (1..=6u16)
            .map(|qid| {
                let r = ThreadRecordingRegion::new(16 * 4096);
                let base = map.register_region(r.clone()).unwrap();
                assert_ok(&h.create_cq_raw(qid, 63, base + CQ, true, 0));
                assert_ok(&h.create_sq_raw(qid, 63, base + SQ, qid));
                (qid, r, base)
            })
            .collect();
        // 20 commands per queue, alternating write and read, each with a two-page PRP list.
        for (qid, r, base) in &regions {
            for i in 0..20u64 {
                let op = if i % 2 == 0 { WRITE } else { READ };
                let mut cmd = rw(op, 1, *qid as u64 * 512, 24, base + DATA, 0);
                // PRP2 points to a list in the region naming two more data pages.
                let list = DATA + 8 * 4096;
                cmd.prp2 = base + list;
                for (k, page) in [DATA + 4096, DATA + 2 * 4096].iter().enumerate() {
                    map.write(base + list + k as u64 * 8, &(base + page).to_le_bytes())
                        .unwrap();
                }
                cmd.cdw0 = cmd.cdw0.with_cid(i as u16);
                let bytes = zerocopy::IntoBytes::as_bytes(&cmd).to_vec();
                map.write(base + SQ + i * 64, &bytes).unwrap();
            }
            assert!(r.callers().iter().all(|c| c.0 == MAX_CONTROLLER_THREADS));
            h.regs().write_u32(sq_tail_doorbell(*qid, 0), 20);
        }
        for (qid, _, base) in &regions {
            let deadline = Instant::now() + WAIT;
            for slot in 0..20u64 {
                loop {
                    let mut raw = [0u8; 16];
                    map.read(base + CQ + slot * 16, &mut raw).unwrap();
                    if raw[14] & 1 == 1 {
                        let c: nvme_spec::Completion =
                            zerocopy::FromBytes::read_from_bytes(&raw[..]).unwrap();
                        assert_ok(&c);
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "queue {qid}: no completion {slot}"
                    );
                    std::thread::yield_now();
                }
            }
        }
        // The test's own map accesses ran on this thread (no controller index); every
        // controller call came from the queue's thread.
        for (qid, r, _) in &regions {
            let owner = h.dev.thread_for_cq(*qid);
            let callers = r.callers();
            let controller: Vec<_> = callers
                .iter()
                .filter(|c| c.0 != MAX_CONTROLLER_THREADS)
                .collect();
            assert_eq!(controller.len(), 1, "queue {qid}: {callers:?}");
            assert_eq!(controller[0].0, owner, "queue {qid}: {callers:?}");
            assert!(controller[0].1 > 20, "queue {qid}: {callers:?}");
            assert!(owner < threads);
        }
    }
}

#[test]
fn deleting_a_queue_of_another_thread_completes_its_commands_first() {
    let mut h = Host::enabled(config(2));
    // Queue 2 is served by thread 1.
    assert_eq!(h.dev.thread_for_cq(2), 1);
    let _q1 = h.create_io_pair(1, 16, 16);
    let mut q = h.create_io_pair(2, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    // One dropped, one delayed for far longer than the test.
    h.dev.faults().drop_completions(1);
    let mut cmd = rw(READ, 1, 0, 1, buf.device_address(0), 0);
    cmd.cdw0 = cmd.cdw0.with_cid(55);
    q.submit(&h.dev, &cmd);
    let deadline = Instant::now() + WAIT;
    while h.dev.stats().completions_dropped == 0 {
        assert!(Instant::now() < deadline);
        std::thread::yield_now();
    }
    h.dev.faults().set_completion_delay(Duration::from_secs(60));
    cmd.cdw0 = cmd.cdw0.with_cid(56);
    q.submit(&h.dev, &cmd);
    let deadline = Instant::now() + WAIT;
    while h.dev.stats().io_commands < 2 {
        assert!(Instant::now() < deadline);
        std::thread::yield_now();
    }
    assert!(q.peek().is_none());
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 2));
    h.dev.faults().set_completion_delay(Duration::ZERO);
    // Both completions are in the CQ already when the deletion completes.
    let mut got: Vec<_> = (0..2)
        .map(|_| q.take().expect("completion posted before the deletion's"))
        .collect();
    got.sort_by_key(|c| c.cid);
    assert_eq!(got[0].cid, 55);
    assert_status(&got[0], Sct::GENERIC, generic::ABORTED_SQ_DELETION);
    assert_eq!(got[1].cid, 56);
    assert_ok(&got[1]);
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 2));
}

#[test]
fn abort_reaches_the_queue_s_thread() {
    let mut h = Host::enabled(config(4));
    let mut q = h.create_io_pair(3, 16, 16);
    assert_eq!(h.dev.thread_for_cq(3), 2);
    let buf = h.dev.alloc_dma(4096).unwrap();
    h.dev.faults().set_completion_delay(Duration::from_secs(60));
    let mut cmd = rw(WRITE, 1, 0, 1, buf.device_address(0), 0);
    cmd.cdw0 = cmd.cdw0.with_cid(7);
    q.submit(&h.dev, &cmd);
    let deadline = Instant::now() + WAIT;
    while h.dev.stats().io_commands < 1 {
        assert!(Instant::now() < deadline);
        std::thread::yield_now();
    }
    let abort = || {
        let mut cmd = Command::new(AdminOpcode::ABORT.0, 0, 0);
        cmd.cdw10 = 3 | 7 << 16;
        cmd
    };
    let c = h.admin(abort());
    assert_ok(&c);
    assert_eq!(c.dw0 & 1, 0, "aborted");
    let c = q
        .take()
        .expect("the aborted command's completion came first");
    assert_eq!(c.cid, 7);
    assert_status(&c, Sct::GENERIC, generic::COMMAND_ABORT_REQUESTED);
    // Nothing left to abort.
    let c = h.admin(abort());
    assert_eq!(c.dw0 & 1, 1, "not aborted");
    h.dev.faults().set_completion_delay(Duration::ZERO);
}

#[test]
fn reset_stops_every_thread_s_queues_before_ready_clears() {
    for threads in [2, 4] {
        let mut h = Host::enabled(config(threads));
        let mut queues: Vec<QueuePair> = (1..=4).map(|qid| h.create_io_pair(qid, 64, 64)).collect();
        let buf = h.dev.alloc_dma(4096).unwrap();
        // Every queue has commands in flight, their completions delayed.
        h.dev
            .faults()
            .set_completion_delay(Duration::from_millis(30));
        for q in &mut queues {
            for i in 0..20u16 {
                let mut cmd = rw(READ, 1, i as u64, 1, buf.device_address(0), 0);
                cmd.cdw0 = cmd.cdw0.with_cid(i);
                q.push(&cmd);
            }
            q.ring(&h.dev);
        }
        let deadline = Instant::now() + WAIT;
        while h.dev.stats().io_commands < 80 {
            assert!(Instant::now() < deadline);
            std::thread::yield_now();
        }
        h.disable();
        // Once RDY is clear, no thread writes a completion any more.
        let snapshot: Vec<Vec<u8>> = queues
            .iter()
            .map(|q| {
                let mut v = vec![0u8; q.cq.len()];
                q.cq.read(0, &mut v);
                v
            })
            .collect();
        let posted = h.dev.stats().completions_posted;
        std::thread::sleep(Duration::from_millis(60));
        for (q, before) in queues.iter().zip(&snapshot) {
            let mut now = vec![0u8; q.cq.len()];
            q.cq.read(0, &mut now);
            assert!(&now == before, "queue {} written after reset", q.qid);
        }
        assert_eq!(h.dev.stats().completions_posted, posted);
        h.dev.faults().set_completion_delay(Duration::ZERO);
        // Enabled again, the same queue ids work on every thread.
        h.enable();
        for qid in 1..=4 {
            let mut q = h.create_io_pair(qid, 16, 16);
            assert_ok(&q.run(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0)));
        }
    }
}

#[test]
fn a_dma_error_on_another_thread_is_fatal_for_the_whole_controller() {
    let mut h = Host::enabled(config(2));
    let mut q1 = h.create_io_pair(1, 16, 16);
    // CQ 2 (thread 1) in memory that goes away.
    let cq = h.dev.alloc_dma(4096).unwrap();
    assert_ok(&h.create_cq_raw(2, 15, cq.device_address(0), true, 0));
    let q2 = QueuePair::new(&h.dev, 2, 16, 16);
    assert_ok(&h.create_sq_raw(2, 15, q2.sq.device_address(0), 2));
    drop(cq);
    let buf = h.dev.alloc_dma(4096).unwrap();
    let mut q2 = q2;
    q2.submit(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0));
    assert!(
        h.wait_csts(|c| c.cfs()),
        "CQE write to unmapped memory is fatal"
    );
    assert_eq!(h.dev.stats().fatal_errors, 1);
    // Thread 0's queues stop too.
    q1.submit(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0));
    std::thread::sleep(Duration::from_millis(20));
    assert!(q1.peek().is_none(), "a fatal controller completes nothing");
    h.disable();
    h.enable();
    let mut q = h.create_io_pair(2, 16, 16);
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0)));
}

#[test]
fn injected_fatal_stops_every_thread() {
    let mut h = Host::enabled(config(4));
    let mut queues: Vec<QueuePair> = (1..=4).map(|qid| h.create_io_pair(qid, 16, 16)).collect();
    let buf = h.dev.alloc_dma(4096).unwrap();
    h.dev.faults().fatal();
    for q in &mut queues {
        q.submit(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0));
    }
    assert!(h.csts().cfs());
    std::thread::sleep(Duration::from_millis(20));
    for q in &queues {
        assert!(q.peek().is_none(), "queue {} completed after fatal", q.qid);
    }
    h.disable();
    assert!(!h.csts().cfs());
}

/// A doorbell word the test writes.
struct Word(AtomicU32);

impl DoorbellWord for Word {
    fn load(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
}

#[test]
fn external_doorbells_on_another_thread_and_their_errors_reach_thread_0() {
    let mut h = Host::enabled(config(2));
    let sq_word = Arc::new(Word(AtomicU32::new(0)));
    let cq_word = Arc::new(Word(AtomicU32::new(0)));
    h.dev
        .attach_external_doorbells(2, sq_word.clone(), cq_word.clone())
        .unwrap();
    let mut q = h.create_io_pair(2, 8, 8);
    let aer = h.cid();
    h.admin.submit(
        &h.dev,
        &Command::new(AdminOpcode::ASYNC_EVENT_REQUEST.0, aer, 0),
    );
    let buf = h.dev.alloc_dma(4096).unwrap();
    for i in 0..20u16 {
        let mut cmd = rw(READ, 1, 0, 1, buf.device_address(0), 0);
        cmd.cdw0 = cmd.cdw0.with_cid(i);
        q.push(&cmd);
        sq_word.0.store(q.sq_tail as u32, Ordering::Release);
        let c = q.wait_no_ring(&h.dev);
        assert_eq!(c.cid, i);
        assert_ok(&c);
        cq_word.0.store(q.cq_head as u32, Ordering::Release);
    }
    // An invalid tail on thread 1's queue: reported through thread 0's event.
    sq_word.0.store(99, Ordering::Release);
    let c = h.admin.wait(&h.dev);
    assert_eq!(c.cid, aer);
    assert_eq!(c.dw0, 0x0001_0100, "Invalid Doorbell Write Value");
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 2));
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 2));
    h.dev.detach_external_doorbells(2);
}

#[test]
fn concurrent_writes_to_the_same_blocks_leave_whole_blocks() {
    // Four queues on four threads write the same 64 blocks, across a 2 MiB stripe boundary of
    // the memory media (LBA 4096), again and again with their own pattern.
    let mut h = Host::enabled(config(4));
    let first_lba = 4096 - 32;
    let queues: Vec<QueuePair> = (1..=4).map(|qid| h.create_io_pair(qid, 64, 64)).collect();
    let dev = h.dev.clone();
    let writers: Vec<_> = queues
        .into_iter()
        .map(|mut q| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                // 16 KiB commands (32 blocks), two per round, the second across the boundary.
                let buf = dev.alloc_dma(16384).unwrap();
                buf.write(0, &pattern(16384, q.qid as u64));
                let list = dev.alloc_dma(4096).unwrap();
                for k in 1..4 {
                    list.write((k - 1) * 8, &buf.device_address(k * 4096).to_le_bytes());
                }
                for _ in 0..200 {
                    for lba in [first_lba, first_lba + 32] {
                        let cmd = rw(
                            WRITE,
                            1,
                            lba,
                            32,
                            buf.device_address(0),
                            list.device_address(0),
                        );
                        q.push(&cmd);
                    }
                    q.ring(&dev);
                    assert_ok(&q.wait(&dev));
                    assert_ok(&q.wait(&dev));
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let mut q = h.create_io_pair(5, 16, 16);
    let buf = h.dev.alloc_dma(64 * 512).unwrap();
    let list = h.dev.alloc_dma(4096).unwrap();
    for k in 1..8 {
        list.write((k - 1) * 8, &buf.device_address(k * 4096).to_le_bytes());
    }
    let cmd = rw(
        READ,
        1,
        first_lba,
        64,
        buf.device_address(0),
        list.device_address(0),
    );
    assert_ok(&q.run(&h.dev, &cmd));
    let mut back = vec![0u8; 64 * 512];
    buf.read(0, &mut back);
    let patterns: Vec<Vec<u8>> = (1..=4).map(|q| pattern(16384, q)).collect();
    for (b, block) in back.chunks(512).enumerate() {
        let at = (b % 32) * 512;
        assert!(
            patterns.iter().any(|p| p[at..at + 512] == *block),
            "block {b} is torn"
        );
    }
}
