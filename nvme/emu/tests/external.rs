//! External doorbells and deferred writes: I/O queues whose rings and data live in a memory
//! region that stages its writes until flushed (as GPU memory behind batched copies will),
//! driven through doorbell words outside the register window (as GPU threads will ring them).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use nvme::Device;
use nvme_emu::{
    AttachRefusal, DoorbellWord, EmuConfig, EmuDevice, EmuError, MemoryRegion, RegionError,
};
use nvme_spec::log::ErrorInformationLogEntry;
use nvme_spec::registers::{cq_head_doorbell, sq_tail_doorbell};
use nvme_spec::{AdminOpcode, Command, Completion, NvmOpcode};
use zerocopy::{FromBytes, IntoBytes};

const READ: u8 = NvmOpcode::READ.0;
const WRITE: u8 = NvmOpcode::WRITE.0;
const PAGE: usize = 4096;

/// A doorbell word in ordinary memory, standing in for a pinned host page a GPU writes.
#[derive(Default)]
struct Word(AtomicU32);

impl Word {
    fn store(&self, value: u32) {
        // Release: the entries written before ringing are visible to the controller's Acquire
        // load.
        self.0.store(value, Ordering::Release);
    }
}

impl DoorbellWord for Word {
    fn load(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
}

/// What the region holds: the bytes other agents see, and the writes staged since the last
/// flush.
struct RegionState {
    visible: Vec<u8>,
    pending: Vec<(usize, Vec<u8>)>,
}

/// A memory region that defers every controller write until `flush` (applying them in issue
/// order), and applies pending writes before a controller read. The host side
/// (`host_read`/`host_write`) sees only what was applied.
struct DeferringRegion {
    state: Mutex<RegionState>,
    /// Range holding completion queues, to catch a completion applied other than by a flush.
    cq_range: std::ops::Range<usize>,
    flushes: AtomicU64,
    /// Completion-queue writes applied by a read instead of a flush.
    early_cqe_applies: AtomicU64,
    /// While closed, `flush` waits (bounded) for it to open.
    gate: Mutex<bool>,
    gate_changed: Condvar,
    flush_waiting: AtomicBool,
    /// Makes `flush` fail (without applying anything).
    fail_flush: AtomicBool,
}

impl DeferringRegion {
    fn new(len: usize, cq_range: std::ops::Range<usize>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(RegionState {
                visible: vec![0; len],
                pending: Vec::new(),
            }),
            cq_range,
            flushes: AtomicU64::new(0),
            early_cqe_applies: AtomicU64::new(0),
            gate: Mutex::new(true),
            gate_changed: Condvar::new(),
            flush_waiting: AtomicBool::new(false),
            fail_flush: AtomicBool::new(false),
        })
    }

    fn apply(&self, state: &mut RegionState, by_flush: bool) {
        for (offset, data) in state.pending.drain(..) {
            if !by_flush && self.cq_range.contains(&offset) {
                self.early_cqe_applies.fetch_add(1, Ordering::Relaxed);
            }
            state.visible[offset..offset + data.len()].copy_from_slice(&data);
        }
    }

    fn host_write(&self, offset: usize, data: &[u8]) {
        let mut s = self.state.lock().unwrap();
        s.visible[offset..offset + data.len()].copy_from_slice(data);
    }

    fn host_read(&self, offset: usize, buf: &mut [u8]) {
        let s = self.state.lock().unwrap();
        buf.copy_from_slice(&s.visible[offset..offset + buf.len()]);
    }

    fn pending_writes(&self) -> usize {
        self.state.lock().unwrap().pending.len()
    }

    fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Acquire)
    }

    fn set_gate(&self, open: bool) {
        *self.gate.lock().unwrap() = open;
        self.gate_changed.notify_all();
    }
}

impl MemoryRegion for DeferringRegion {
    fn len(&self) -> usize {
        self.state.lock().unwrap().visible.len()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        let mut s = self.state.lock().unwrap();
        self.apply(&mut s, false);
        let offset = offset as usize;
        buf.copy_from_slice(&s.visible[offset..offset + buf.len()]);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let mut s = self.state.lock().unwrap();
        s.pending.push((offset as usize, data.to_vec()));
        Ok(())
    }

    fn flush(&self) -> Result<(), RegionError> {
        if self.fail_flush.load(Ordering::Acquire) {
            return Err(RegionError::new("injected flush failure"));
        }
        let deadline = Instant::now() + WAIT;
        let mut open = self.gate.lock().unwrap();
        while !*open && Instant::now() < deadline {
            self.flush_waiting.store(true, Ordering::Release);
            open = self
                .gate_changed
                .wait_timeout(open, Duration::from_millis(10))
                .unwrap()
                .0;
        }
        drop(open);
        self.flush_waiting.store(false, Ordering::Release);
        let mut s = self.state.lock().unwrap();
        self.apply(&mut s, true);
        self.flushes.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// Where things are in the region: the SQ at 0, the CQ on the next page boundary, then data.
struct Layout {
    sq_entries: u16,
    cq_entries: u16,
    cq_off: usize,
    data_off: usize,
    data_pages: usize,
}

impl Layout {
    fn new(sq_entries: u16, cq_entries: u16, data_pages: usize) -> Self {
        let cq_off = (sq_entries as usize * 64).next_multiple_of(PAGE);
        let data_off = cq_off + (cq_entries as usize * 16).next_multiple_of(PAGE);
        Self {
            sq_entries,
            cq_entries,
            cq_off,
            data_off,
            data_pages,
        }
    }

    fn len(&self) -> usize {
        self.data_off + self.data_pages * PAGE
    }
}

/// An I/O queue pair in a deferring region, rung through external doorbell words.
struct ExtQueue {
    qid: u16,
    region: Arc<DeferringRegion>,
    base: u64,
    layout: Layout,
    sq_word: Arc<Word>,
    cq_word: Arc<Word>,
    sq_tail: u16,
    cq_head: u16,
    phase: bool,
}

impl ExtQueue {
    /// Maps a region for the queue pair `qid`, attaches doorbell words and creates the
    /// queues with raw admin commands.
    fn create(h: &mut Host, qid: u16, layout: Layout) -> Self {
        let q = Self::attach(&h.dev, qid, layout);
        assert_ok(&h.create_cq_raw(qid, q.layout.cq_entries - 1, q.cq_addr(), true, 0));
        assert_ok(&h.create_sq_raw(qid, q.layout.sq_entries - 1, q.base, qid));
        q
    }

    /// Maps a region and attaches zeroed doorbell words, without creating the queues.
    fn attach(dev: &EmuDevice, qid: u16, layout: Layout) -> Self {
        let cq_range = layout.cq_off..layout.data_off;
        let region = DeferringRegion::new(layout.len(), cq_range);
        let base = dev.address_map().register_region(region.clone()).unwrap();
        let sq_word = Arc::new(Word::default());
        let cq_word = Arc::new(Word::default());
        dev.attach_external_doorbells(qid, sq_word.clone(), cq_word.clone())
            .unwrap();
        Self {
            qid,
            region,
            base,
            layout,
            sq_word,
            cq_word,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
        }
    }

    fn cq_addr(&self) -> u64 {
        self.base + self.layout.cq_off as u64
    }

    /// Device address of data page `i`.
    fn data_addr(&self, i: usize) -> u64 {
        self.base + (self.layout.data_off + i * PAGE) as u64
    }

    fn data_off(&self, i: usize) -> usize {
        self.layout.data_off + i * PAGE
    }

    /// Writes a command into the next SQ slot without ringing.
    fn push(&mut self, cmd: &Command) {
        self.region
            .host_write(self.sq_tail as usize * 64, cmd.as_bytes());
        self.sq_tail = (self.sq_tail + 1) % self.layout.sq_entries;
    }

    fn ring(&self) {
        self.sq_word.store(self.sq_tail as u32);
    }

    /// The completion at the CQ head, if the phase tag says it is new.
    fn peek(&self) -> Option<Completion> {
        let mut raw = [0u8; 16];
        self.region
            .host_read(self.layout.cq_off + self.cq_head as usize * 16, &mut raw);
        let c = Completion::read_from_bytes(&raw[..]).unwrap();
        (c.status.p() == self.phase).then_some(c)
    }

    /// Waits (bounded) for the next completion and consumes it, without moving the head word.
    fn wait_no_ring(&mut self, dev: &EmuDevice) -> Completion {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(c) = self.peek() {
                self.cq_head += 1;
                if self.cq_head == self.layout.cq_entries {
                    self.cq_head = 0;
                    self.phase = !self.phase;
                }
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "no completion on external queue {} (csts {:?}, {:?})",
                self.qid,
                dev.csts(),
                dev.stats()
            );
            std::thread::yield_now();
        }
    }

    fn ring_cq(&self) {
        self.cq_word.store(self.cq_head as u32);
    }

    fn wait(&mut self, dev: &EmuDevice) -> Completion {
        let c = self.wait_no_ring(dev);
        self.ring_cq();
        c
    }

    fn run(&mut self, dev: &EmuDevice, cmd: &Command) -> Completion {
        self.push(cmd);
        self.ring();
        self.wait(dev)
    }
}

fn config() -> EmuConfig {
    EmuConfig {
        max_io_queue_pairs: 4,
        ..small_config(4096, 512)
    }
}

/// The newest Error Information log entry (read with RAE, so events stay masked).
fn newest_error(h: &mut Host) -> ErrorInformationLogEntry {
    let (c, raw) = h.get_log(0x01, 0, 64, 0, true);
    assert_ok(&c);
    ErrorInformationLogEntry::read_from_bytes(&raw[..]).unwrap()
}

/// Waits (bounded) until the controller has counted `n` invalid doorbell values in all.
fn wait_invalid_doorbells(dev: &EmuDevice, n: u64) {
    let deadline = Instant::now() + WAIT;
    while dev.stats().invalid_doorbell_writes < n {
        assert!(Instant::now() < deadline, "doorbell error not counted");
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn reads_and_writes_through_external_doorbells_and_a_deferring_region() {
    // One thread, so that the park count below is the count of the thread serving the queue.
    let mut h = Host::enabled(EmuConfig {
        controller_threads: 1,
        ..config()
    });
    // SQ and CQ of different sizes, both wrapping many times.
    let mut q = ExtQueue::create(&mut h, 1, Layout::new(16, 8, 8));
    let parks = h.dev.stats().idle_parks;
    // 480 commands: 30 passes through the SQ, 60 through the CQ.
    for round in 0..60u64 {
        // Four writes from data pages 0..4, then four reads into pages 4..8, in one batch each.
        let mut expected = Vec::new();
        for i in 0..4 {
            let data = pattern(PAGE, round * 8 + i as u64);
            q.region.host_write(q.data_off(i), &data);
            let slba = (round % 16) * 64 + i as u64 * 8;
            let cid = (round * 8 + i as u64) as u16;
            let mut cmd = rw(WRITE, 1, slba, 8, q.data_addr(i), 0);
            cmd.cdw0 = cmd.cdw0.with_cid(cid);
            q.push(&cmd);
            expected.push((slba, data));
        }
        q.ring();
        for _ in 0..4 {
            let c = q.wait(&h.dev);
            assert_ok(&c);
            assert_eq!(c.sqid, 1);
        }
        for (i, (slba, _)) in expected.iter().enumerate() {
            let mut cmd = rw(READ, 1, *slba, 8, q.data_addr(4 + i), 0);
            cmd.cdw0 = cmd.cdw0.with_cid(1000 + i as u16);
            q.push(&cmd);
        }
        q.ring();
        let mut cids = Vec::new();
        for _ in 0..4 {
            let c = q.wait(&h.dev);
            assert_ok(&c);
            cids.push(c.cid);
        }
        cids.sort();
        assert_eq!(cids, [1000, 1001, 1002, 1003]);
        for (i, (_, data)) in expected.iter().enumerate() {
            let mut back = vec![0u8; PAGE];
            q.region.host_read(q.data_off(4 + i), &mut back);
            assert_eq!(&back, data, "round {round} buffer {i}");
        }
    }
    // An idle pause, then one more command: it completes though nothing woke the thread.
    std::thread::sleep(Duration::from_millis(30));
    let c = q.run(&h.dev, &rw(READ, 1, 0, 1, q.data_addr(0), 0));
    assert_ok(&c);
    let s = h.dev.stats();
    assert_eq!(
        s.idle_parks, parks,
        "the controller parked with external queues"
    );
    assert_eq!(s.fatal_errors, 0);
    assert_eq!(s.writes, 240);
    assert!(q.region.flushes() >= 120, "one flush per batch at least");
    assert_eq!(q.region.early_cqe_applies.load(Ordering::Relaxed), 0);
    assert_eq!(
        q.region.pending_writes(),
        0,
        "nothing left staged while idle"
    );

    // Deleting the queues stops the controller polling: it parks again, and a wild word value
    // is not looked at.
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 1));
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1));
    let errors = h.dev.stats().invalid_doorbell_writes;
    q.sq_word.store(9999);
    q.cq_word.store(9999);
    let deadline = Instant::now() + WAIT;
    while h.dev.stats().idle_parks == parks {
        assert!(
            Instant::now() < deadline,
            "the controller never parked again"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(h.dev.stats().invalid_doorbell_writes, errors);
    h.dev.detach_external_doorbells(1);
}

#[test]
fn large_batches_are_fetched_and_flushed_together() {
    let mut h = Host::enabled(EmuConfig {
        external_batch: 256,
        ..config()
    });
    let mut q = ExtQueue::create(&mut h, 2, Layout::new(1024, 1024, 2));
    q.region.host_write(q.data_off(0), &pattern(512, 3));
    assert_ok(&q.run(&h.dev, &rw(WRITE, 1, 7, 1, q.data_addr(0), 0)));
    let before = q.region.flushes();
    // 1000 commands, one doorbell: four batches of at most 256.
    for i in 0..1000u16 {
        let mut cmd = rw(READ, 1, 7, 1, q.data_addr(1) + (i as u64 % 8) * 512, 0);
        cmd.cdw0 = cmd.cdw0.with_cid(i);
        q.push(&cmd);
    }
    q.ring();
    let mut seen = vec![false; 1000];
    for _ in 0..1000 {
        let c = q.wait_no_ring(&h.dev);
        assert_ok(&c);
        assert!(!std::mem::replace(&mut seen[c.cid as usize], true));
    }
    q.ring_cq();
    let flushes = q.region.flushes() - before;
    assert!(
        (4..=5).contains(&flushes),
        "{flushes} flushes for 1000 commands in batches of 256"
    );
    let mut back = vec![0u8; 512];
    q.region.host_read(q.data_off(1) + 7 * 512, &mut back);
    assert_eq!(back, pattern(512, 3));
    assert_eq!(q.region.early_cqe_applies.load(Ordering::Relaxed), 0);
}

#[test]
fn completions_become_visible_only_when_flushed() {
    let mut h = Host::enabled(config());
    let mut q = ExtQueue::create(&mut h, 1, Layout::new(8, 8, 1));
    q.region.set_gate(false);
    q.push(&rw(READ, 1, 0, 1, q.data_addr(0), 0));
    q.ring();
    // The controller executes the command, writes data and completion, and flushes: the flush
    // waits at the gate with the writes staged.
    let deadline = Instant::now() + WAIT;
    while !q.region.flush_waiting.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "flush never called");
        std::thread::yield_now();
    }
    assert!(
        q.region.pending_writes() >= 2,
        "data and completion are staged"
    );
    assert!(
        q.peek().is_none(),
        "a completion is visible before the flush"
    );
    q.region.set_gate(true);
    assert_ok(&q.wait(&h.dev));
    assert!(q.region.flushes() >= 1);
    assert_eq!(q.region.early_cqe_applies.load(Ordering::Relaxed), 0);
}

#[test]
fn invalid_external_doorbell_values_are_reported_once_and_ignored() {
    let mut h = Host::enabled(config());
    let mut q = ExtQueue::create(&mut h, 1, Layout::new(8, 8, 1));
    let aer = |cid| Command::new(AdminOpcode::ASYNC_EVENT_REQUEST.0, cid, 0);
    let aer_a = h.cid();
    h.admin.submit(&h.dev, &aer(aer_a));
    let errors = h.dev.stats().invalid_doorbell_writes;

    // An SQ tail not below the queue size.
    q.sq_word.store(8);
    let c = h.admin.wait(&h.dev);
    assert_eq!(c.cid, aer_a);
    assert_eq!(
        c.dw0, 0x0001_0100,
        "Error status, Invalid Doorbell Write Value"
    );
    let e = newest_error(&mut h);
    assert_eq!((e.sqid, e.cid), (0xffff, 0xffff));
    assert_eq!(e.csi, 1 | 1 << 16 | 8 << 32, "SQ 1 tail, value 8");
    // Reported once, though the word keeps the value.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(h.dev.stats().invalid_doorbell_writes, errors + 1);

    // Unmask events (read the log without RAE) and arm another request.
    let (c, _) = h.get_log(0x01, 0, 64, 0, false);
    assert_ok(&c);
    let aer_b = h.cid();
    h.admin.submit(&h.dev, &aer(aer_b));

    // The queue still works with a valid value.
    q.push(&rw(READ, 1, 0, 1, q.data_addr(0), 0));
    q.ring();
    assert_ok(&q.wait_no_ring(&h.dev));
    assert_eq!(q.cq_head, 1);

    // A CQ head that passes entries not yet posted.
    q.cq_word.store(5);
    let c = h.admin.wait(&h.dev);
    assert_eq!(c.cid, aer_b);
    assert_eq!(c.dw0, 0x0001_0100);
    let e = newest_error(&mut h);
    assert_eq!(e.csi, 1 | 5 << 32, "CQ 1 head, value 5");
    assert_eq!(h.dev.stats().invalid_doorbell_writes, errors + 2);
    q.ring_cq();

    // The register-window doorbells of an external queue are refused.
    h.regs().write_u32(sq_tail_doorbell(1, 0), 1);
    h.regs().write_u32(cq_head_doorbell(1, 0), 1);
    wait_invalid_doorbells(&h.dev, errors + 4);

    // The queue keeps working, through wrap-arounds.
    for i in 0..20u64 {
        q.region.host_write(q.data_off(0), &pattern(512, i));
        assert_ok(&q.run(&h.dev, &rw(WRITE, 1, i, 1, q.data_addr(0), 0)));
        assert_ok(&q.run(&h.dev, &rw(READ, 1, i, 1, q.data_addr(0) + 512, 0)));
        let mut back = vec![0u8; 512];
        q.region.host_read(q.data_off(0) + 512, &mut back);
        assert_eq!(back, pattern(512, i));
    }
    let s = h.dev.stats();
    assert_eq!(s.fatal_errors, 0);
    assert_eq!(s.invalid_doorbell_writes, errors + 4);
}

#[test]
fn a_stale_word_at_queue_creation_is_reported_not_taken() {
    let mut h = Host::enabled(config());
    let mut q = ExtQueue::attach(&h.dev, 3, Layout::new(8, 8, 1));
    // A leftover command in slot 0 and a tail of 1 that the host forgot to zero.
    q.push(&rw(READ, 1, 0, 1, q.data_addr(0), 0));
    q.sq_word.store(1);
    let errors = h.dev.stats().invalid_doorbell_writes;
    assert_ok(&h.create_cq_raw(3, 7, q.cq_addr(), true, 0));
    assert_ok(&h.create_sq_raw(3, 7, q.base, 3));
    wait_invalid_doorbells(&h.dev, errors + 1);
    let e = newest_error(&mut h);
    assert_eq!(e.csi, 3 | 1 << 16 | 1 << 32, "SQ 3 tail, value 1");
    std::thread::sleep(Duration::from_millis(20));
    assert!(q.peek().is_none(), "the stale entry was not fetched");
    assert_eq!(h.dev.stats().io_commands, 0);
    // The host starts over from slot 0 with a value other than the stale one (the stale
    // value is ignored until the word changes).
    q.sq_tail = 0;
    q.push(&rw(READ, 1, 0, 1, q.data_addr(0), 0));
    q.push(&rw(READ, 1, 1, 1, q.data_addr(0), 0));
    q.ring();
    assert_ok(&q.wait(&h.dev));
    assert_ok(&q.wait(&h.dev));
    assert_eq!(h.dev.stats().io_commands, 2);
}

#[test]
fn attach_is_refused_for_bad_or_live_queue_ids_and_survives_reset() {
    let mut h = Host::enabled(config());
    let word = || -> Arc<dyn DoorbellWord> { Arc::new(Word::default()) };
    let refusal = |r: Result<(), EmuError>| match r {
        Err(EmuError::AttachDoorbells { reason, .. }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let bad_id = AttachRefusal::InvalidQueueId { max: 4 };
    assert_eq!(
        refusal(h.dev.attach_external_doorbells(0, word(), word())),
        bad_id
    );
    assert_eq!(
        refusal(h.dev.attach_external_doorbells(5, word(), word())),
        bad_id
    );
    // A live queue (register-window doorbells).
    let _plain = h.create_io_pair(1, 8, 8);
    assert_eq!(
        refusal(h.dev.attach_external_doorbells(1, word(), word())),
        AttachRefusal::QueueExists
    );
    // Only a CQ with the id exists: refused too.
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 1));
    assert_eq!(
        refusal(h.dev.attach_external_doorbells(1, word(), word())),
        AttachRefusal::QueueExists
    );
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1));

    let mut q = ExtQueue::create(&mut h, 2, Layout::new(8, 8, 1));
    assert_eq!(
        refusal(h.dev.attach_external_doorbells(2, word(), word())),
        AttachRefusal::QueueExists
    );
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 0, 1, q.data_addr(0), 0)));

    // Reset forgets the queues, not the attachment.
    h.disable();
    h.enable();
    assert_eq!(
        refusal(h.dev.attach_external_doorbells(2, word(), word())),
        AttachRefusal::AlreadyAttached
    );
    q.sq_word.store(0);
    q.cq_word.store(0);
    (q.sq_tail, q.cq_head, q.phase) = (0, 0, true);
    q.region.host_write(q.layout.cq_off, &[0; 8 * 16]);
    assert_ok(&h.create_cq_raw(2, 7, q.cq_addr(), true, 0));
    assert_ok(&h.create_sq_raw(2, 7, q.base, 2));
    for _ in 0..10 {
        assert_ok(&q.run(&h.dev, &rw(READ, 1, 0, 1, q.data_addr(0), 0)));
    }

    // Delete, detach, and the id takes register-window doorbells again.
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 2));
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 2));
    h.dev.detach_external_doorbells(2);
    let mut plain = h.create_io_pair(2, 8, 8);
    let buf = h.dev.alloc_dma(4096).unwrap();
    assert_ok(&plain.run(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0)));
    // And attaching to a fresh id after the detach works.
    h.dev.attach_external_doorbells(3, word(), word()).unwrap();
}

#[test]
fn external_batch_is_validated() {
    for bad in [0, 4097] {
        let r = EmuDevice::start(EmuConfig {
            external_batch: bad,
            ..EmuConfig::default()
        });
        assert!(
            matches!(r, Err(EmuError::InvalidConfig { .. })),
            "external_batch {bad}"
        );
    }
    let dev = EmuDevice::start(EmuConfig {
        external_batch: 4096,
        ..EmuConfig::default()
    })
    .unwrap();
    dev.stop();
}

#[test]
fn delayed_completions_are_flushed_too() {
    let mut h = Host::enabled(config());
    let mut q = ExtQueue::create(&mut h, 1, Layout::new(8, 8, 1));
    h.dev
        .faults()
        .set_completion_delay(Duration::from_millis(5));
    // The completion is written by the delayed-completion path, outside any fetch batch.
    for i in 0..12 {
        assert_ok(&q.run(&h.dev, &rw(READ, 1, i, 1, q.data_addr(0), 0)));
    }
    h.dev.faults().set_completion_delay(Duration::ZERO);
    assert_eq!(q.region.pending_writes(), 0);
    assert_eq!(q.region.early_cqe_applies.load(Ordering::Relaxed), 0);
}

#[test]
fn a_failed_flush_is_controller_fatal() {
    let mut h = Host::enabled(config());
    let mut q = ExtQueue::create(&mut h, 1, Layout::new(8, 8, 1));
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 0, 1, q.data_addr(0), 0)));
    q.region.fail_flush.store(true, Ordering::Release);
    q.push(&rw(READ, 1, 0, 1, q.data_addr(0), 0));
    q.ring();
    assert!(h.wait_csts(|c| c.cfs()), "no controller fatal status");
    assert_eq!(h.dev.stats().fatal_errors, 1);
    // A reset recovers the controller.
    q.region.fail_flush.store(false, Ordering::Release);
    h.disable();
    h.enable();
    let (c, _) = h.identify(1, 0);
    assert_ok(&c);
}
