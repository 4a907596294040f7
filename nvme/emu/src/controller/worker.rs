//! One controller thread's share of the work: the queues it serves, fetching and executing
//! their commands, posting completions (held, delayed, dropped), and parking when idle.
//!
//! A [`Worker`] is owned by its thread: nothing in it is shared. Thread 0's worker also holds
//! the admin queues (whose commands [`super::Controller`] executes); every other thread runs
//! [`Worker::run`] and gets its queues through its mailbox ([`super::handoff`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nvme_spec::log::ErrorInformationLogEntry;
use nvme_spec::status::{StatusCodeType, generic};
use nvme_spec::{Command, Completion, CqeStatus, NvmOpcode, Status};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use super::handoff::Request;
use super::{BATCH, CmdResult, Fail, Outcome, PARK_MAX, Shared, log_doorbell_error, run_thread};
use crate::config::EmuConfig;
use crate::memory::MapCache;
use crate::prp::{PAGE, Segment};
use crate::queues::{CompQueue, PendingCompletion, SubQueue};
use crate::registers::{DoorbellError, DoorbellErrorKind};
use crate::stats::Counters;
use crate::storage::Namespace;

/// [`crate::Hostile::poison_sq`]: the opcode (reserved in both command sets) and command id a
/// fetched SQE is overwritten with.
const POISON_OPCODE: u8 = 0x7f;
/// See [`POISON_OPCODE`]; also the command id of a [`crate::Hostile::stale_cq`] garbage entry.
const POISON_CID: u16 = 0xffff;
/// How long a thread spins after its last piece of work before parking.
const SPIN_TIME: Duration = Duration::from_micros(50);
/// Longest a thread other than 0 that serves no queue parks: only its mailbox (which unparks
/// it) or stopping (likewise) can give it work.
const EMPTY_PARK_MAX: Duration = Duration::from_millis(100);

/// A thread polling external doorbells (which nothing can wake it for) that has found nothing
/// for this long naps [`POLL_NAP`] between passes instead of yielding: GPU queues kept up by
/// an idle embedder (a Python handle between calls) then cost a few wake-ups per millisecond,
/// not a core per thread. The first GPU-issued command after such a lull waits up to one nap
/// longer; a register doorbell write (a CPU queue's command) unparks the nap at once.
const POLL_NAP_AFTER: Duration = Duration::from_millis(20);

/// How long such a thread naps (parked) per pass.
const POLL_NAP: Duration = Duration::from_micros(200);
/// Dropped commands remembered for Abort; older ones are forgotten.
const DROPPED_MEMORY: usize = 4096;
/// Size of a submission queue entry.
pub(super) const SQE: usize = size_of::<Command>();

/// A completion held back by the completion-delay fault.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Delayed {
    due: Instant,
    seq: u64,
    cqid: u16,
    sqid: u16,
    cid: u16,
    dw0: u32,
    status: u16,
}

impl Delayed {
    fn completion(&self) -> PendingCompletion {
        PendingCompletion {
            sqid: self.sqid,
            cid: self.cid,
            dw0: self.dw0,
            status: self.status,
        }
    }
}

/// What [`Worker::fetch`] found.
pub(crate) enum Fetch {
    /// Nothing to do.
    Idle,
    /// Something happened (an invalid doorbell value, a fatal error) but nothing to execute.
    Handled,
    /// `n` commands are in the fetch buffer ([`Worker::sqe`]), completing to `cqid`.
    Batch { n: usize, cqid: u16 },
}

/// What [`Worker::poll_sq`] found.
enum Poll {
    /// Nothing to do.
    Idle,
    /// Something happened (an invalid doorbell value, a fatal error) but nothing to fetch.
    Handled,
    /// `n` commands can be fetched now, completing to `cqid`.
    Ready { n: u32, cqid: u16 },
}

/// The queues one controller thread serves, and everything it needs to serve them.
pub(crate) struct Worker {
    /// This thread's index (0 is the thread that also runs the admin command set).
    pub(super) index: usize,
    pub(super) shared: Arc<Shared>,
    pub(super) namespaces: Arc<[Namespace]>,
    /// MDTS in bytes; `u64::MAX` when unlimited.
    pub(super) max_transfer: u64,
    reorder: bool,
    /// [`crate::Hostile`] modes.
    hostile: crate::Hostile,
    external_batch: u32,
    pub(super) cache: MapCache,
    sqs: Vec<Option<SubQueue>>,
    cqs: Vec<Option<CompQueue>>,
    /// I/O submission queue ids served here, ascending.
    io_sqs: Vec<u16>,
    /// Completion queue ids served here (0 on thread 0 while enabled), ascending.
    cq_ids: Vec<u16>,
    /// Round-robin start among `io_sqs`.
    rr: usize,
    /// Queues served here that take a doorbell from an external word.
    external: usize,
    delayed: BinaryHeap<Reverse<Delayed>>,
    delay_seq: u64,
    dropped: VecDeque<(u16, u16)>,
    // Scratch space reused by every command, so that the I/O path does not allocate.
    sqe_buf: Vec<u8>,
    batch: Vec<(u16, PendingCompletion)>,
    pub(super) segments: Vec<Segment>,
    pub(super) list_page: Box<[u8; PAGE as usize]>,
    pub(super) bounce: Vec<u8>,
    /// Scratch of the prefetch pre-pass: ranges, PRP lists still to follow, segments.
    pub(super) pf_ranges: Vec<(u64, usize)>,
    pub(super) pf_lists: Vec<(u64, u64)>,
    pub(super) pf_next: Vec<(u64, u64)>,
    pub(super) pf_segments: Vec<Segment>,
    /// Write commands of the batch (index, length) whose data is announced.
    pub(super) pf_writes: Vec<(usize, u64)>,
    /// Commands sent on to forwarded namespaces ([`crate::forward`]).
    pub(super) fwd: super::forwarding::Forwarding,
}

impl Worker {
    /// Thread `index`'s worker for a validated configuration, serving nothing yet.
    pub(crate) fn new(
        index: usize,
        shared: Arc<Shared>,
        config: &EmuConfig,
        namespaces: Arc<[Namespace]>,
    ) -> Self {
        let max_qid = config.max_io_queue_pairs as usize;
        let max_batch = BATCH.max(config.external_batch) as usize;
        Self {
            index,
            cache: MapCache::new(shared.map.clone()),
            shared,
            namespaces,
            max_transfer: if config.mdts == 0 {
                u64::MAX
            } else {
                PAGE << config.mdts
            },
            reorder: config.reorder_completions,
            hostile: config.hostile,
            external_batch: config.external_batch,
            sqs: (0..=max_qid).map(|_| None).collect(),
            cqs: (0..=max_qid).map(|_| None).collect(),
            io_sqs: Vec::new(),
            cq_ids: Vec::new(),
            rr: 0,
            external: 0,
            delayed: BinaryHeap::new(),
            delay_seq: 0,
            dropped: VecDeque::new(),
            sqe_buf: vec![0; max_batch * SQE],
            batch: Vec::with_capacity(max_batch),
            segments: Vec::with_capacity(64),
            list_page: Box::new([0; PAGE as usize]),
            bounce: Vec::new(),
            pf_ranges: Vec::with_capacity(max_batch),
            pf_lists: Vec::new(),
            pf_next: Vec::new(),
            pf_segments: Vec::with_capacity(64),
            pf_writes: Vec::with_capacity(max_batch),
            fwd: Default::default(),
        }
    }

    /// The body of a thread other than 0: runs until the controller stops.
    pub(crate) fn run(mut self) {
        let shared = self.shared.clone();
        let index = self.index;
        run_thread(shared, index, || self.run_loop());
    }

    fn run_loop(&mut self) {
        let mut idle = Idle::default();
        while !self.shared.stop.load(Ordering::Acquire) {
            if self.pass() {
                idle.worked();
                continue;
            }
            let polls = self.polls_external_doorbells();
            idle.wait(self, polls);
        }
    }

    /// One pass of a thread other than 0: its mailbox, then its queues, then a flush of every
    /// region written through; returns whether anything happened.
    fn pass(&mut self) -> bool {
        let mut worked = false;
        if let Some(request) = self.shared.mailboxes[self.index].take() {
            let answer = self.handle(request);
            self.shared.mailboxes[self.index].answer(answer);
            self.shared.regs.wake();
            worked = true;
        }
        if !self.cq_ids.is_empty() && self.live() {
            worked |= self.update_cq_heads();
            worked |= self.post_due_delayed();
            worked |= self.service_io_queues();
            if self.fwd.in_flight() > 0 {
                worked |= self.poll_forwarded(Duration::ZERO);
            }
        }
        if self.cache.has_unflushed() {
            self.flush_regions(true);
        }
        worked
    }

    fn counters(&self) -> &Counters {
        &self.shared.counters[self.index]
    }

    /// Whether commands may be processed (the controller is not in Controller Fatal Status).
    pub(super) fn live(&self) -> bool {
        !self.shared.is_fatal()
    }

    pub(super) fn enter_fatal(&self, why: &str) {
        self.shared.enter_fatal(self.index, why);
    }

    /// Whether this thread serves a queue whose doorbell is an external word (so it must poll
    /// rather than park).
    pub(super) fn polls_external_doorbells(&self) -> bool {
        self.external > 0
    }

    /// When the earliest delayed completion is due.
    fn next_due(&self) -> Option<Instant> {
        self.delayed.peek().map(|d| d.0.due)
    }

    /// Flushes every region written through since the last flush. A failure is controller
    /// fatal when `fatal_on_error` (completions may be among the writes, so no command can be
    /// failed instead).
    pub(super) fn flush_regions(&mut self, fatal_on_error: bool) {
        if let Err(e) = self.cache.flush() {
            tracing::warn!(error = %e, thread = self.index, "memory region flush failed");
            if fatal_on_error {
                self.enter_fatal("DMA error flushing writes to a memory region");
            }
        }
    }

    /// Acts on a request from thread 0; the answer matters only for Abort.
    pub(super) fn handle(&mut self, request: Request) -> bool {
        let answer = match request {
            Request::AddCq { qid, cq } => {
                self.external += usize::from(cq.doorbell.is_some());
                self.cqs[qid as usize] = Some(cq);
                let at = self.cq_ids.partition_point(|&q| q < qid);
                self.cq_ids.insert(at, qid);
                true
            }
            Request::AddSq { qid, sq } => {
                self.external += usize::from(sq.doorbell.is_some());
                if let Some(cq) = self.cqs[sq.cqid as usize].as_mut() {
                    cq.sq_count += 1;
                }
                self.sqs[qid as usize] = Some(sq);
                let at = self.io_sqs.partition_point(|&q| q < qid);
                self.io_sqs.insert(at, qid);
                true
            }
            Request::DeleteSq(qid) => {
                self.delete_sq(qid);
                true
            }
            Request::DeleteCq(qid) => {
                if let Some(cq) = self.cqs[qid as usize].take() {
                    self.external -= usize::from(cq.doorbell.is_some());
                }
                self.cq_ids.retain(|&q| q != qid);
                true
            }
            Request::Abort { sqid, cid } => self.abort(sqid, cid),
            Request::Reset => {
                self.reset();
                true
            }
        };
        // What the request posted (completions owed by a deletion or an abort) is visible
        // before thread 0 goes on.
        if self.cache.has_unflushed() {
            let fatal_on_error = self.live() && !self.cq_ids.is_empty();
            self.flush_regions(fatal_on_error);
        }
        answer
    }

    /// Creates the admin queues (thread 0, on enable).
    pub(super) fn install_admin(&mut self, asq: u64, sq_entries: u32, acq: u64, cq_entries: u32) {
        let mut cq = CompQueue::new(acq, cq_entries);
        cq.sq_count = 1;
        self.cqs[0] = Some(cq);
        self.sqs[0] = Some(SubQueue::new(asq, sq_entries, 0, None));
        self.cq_ids = vec![0];
    }

    /// Forgets every queue and outstanding command (controller reset).
    pub(super) fn reset(&mut self) {
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.cqs.iter_mut().for_each(|q| *q = None);
        self.io_sqs.clear();
        self.cq_ids.clear();
        self.rr = 0;
        self.external = 0;
        self.delayed.clear();
        self.dropped.clear();
        self.fwd.forget_all();
        self.cache.clear();
    }

    /// Deletes I/O submission queue `qid`. Commands of this queue still outstanding complete
    /// before the deletion does: delayed ones with their result, dropped ones as aborted by
    /// the deletion.
    fn delete_sq(&mut self, qid: u16) {
        let Some(sq) = self.sqs[qid as usize].take() else {
            return;
        };
        self.external -= usize::from(sq.doorbell.is_some());
        self.io_sqs.retain(|&q| q != qid);
        self.rr = 0;
        if let Some(cq) = self.cqs[sq.cqid as usize].as_mut() {
            cq.sq_count -= 1;
        }
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut self.delayed)
            .into_iter()
            .partition(|d| d.0.sqid == qid);
        self.delayed = others.into_iter().collect();
        let mut mine: Vec<Delayed> = mine.into_iter().map(|d| d.0).collect();
        mine.sort();
        for d in mine {
            self.finish(d.cqid, d.completion());
        }
        self.forget_forwarded_of(qid, sq.cqid);
        let aborted = CqeStatus::from_status(Status::generic(generic::ABORTED_SQ_DELETION), false);
        let dropped: Vec<(u16, u16)> = self
            .dropped
            .iter()
            .copied()
            .filter(|d| d.0 == qid)
            .collect();
        self.dropped.retain(|d| d.0 != qid);
        for (sqid, cid) in dropped {
            let pc = PendingCompletion {
                sqid,
                cid,
                dw0: 0,
                status: aborted.into_bits(),
            };
            self.complete(sq.cqid, pc);
        }
    }

    /// Abort: a command whose completion was dropped or is being delayed completes now with
    /// Command Abort Requested; returns whether there was one.
    fn abort(&mut self, sqid: u16, cid: u16) -> bool {
        let status =
            CqeStatus::from_status(Status::generic(generic::COMMAND_ABORT_REQUESTED), false)
                .into_bits();
        let pc = PendingCompletion {
            sqid,
            cid,
            dw0: 0,
            status,
        };
        if self.abort_forwarded(sqid, cid, status) {
            return true;
        }
        if let Some(pos) = self.dropped.iter().position(|&d| d == (sqid, cid)) {
            self.dropped.remove(pos);
            if let Some(sq) = self.sqs.get(sqid as usize).and_then(|q| q.as_ref()) {
                let cqid = sq.cqid;
                self.complete(cqid, pc);
                return true;
            }
        }
        if self
            .delayed
            .iter()
            .any(|d| d.0.sqid == sqid && d.0.cid == cid)
        {
            let mut all = std::mem::take(&mut self.delayed).into_vec();
            let pos = all
                .iter()
                .position(|d| d.0.sqid == sqid && d.0.cid == cid)
                .expect("found");
            let victim = all.swap_remove(pos).0;
            self.delayed = all.into();
            self.finish(victim.cqid, pc);
            return true;
        }
        false
    }

    /// Takes in CQ head doorbells (register window or external word), posting held
    /// completions into the space freed.
    pub(super) fn update_cq_heads(&mut self) -> bool {
        let mut worked = false;
        for i in 0..self.cq_ids.len() {
            let qid = self.cq_ids[i];
            let Some(cq) = self.cqs[qid as usize].as_mut() else {
                continue;
            };
            let raw = match &cq.doorbell {
                None => self.shared.regs.cq_head(qid),
                Some(word) => word.load(),
            };
            if raw == cq.seen_doorbell {
                continue;
            }
            cq.seen_doorbell = raw;
            worked = true;
            if !cq.head_is_valid(raw) {
                self.invalid_doorbell_value(qid, false, raw);
                continue;
            }
            let freed = cq.head;
            cq.head = raw;
            if self.hostile.stale_cq {
                self.stale_cq_entries(qid, freed, raw);
            }
            self.flush_held(qid);
        }
        worked
    }

    /// [`crate::Hostile::stale_cq`]: rewrites entries `from..to` of CQ `qid`, just freed by
    /// the host, with the phase each had and garbage.
    fn stale_cq_entries(&mut self, qid: u16, from: u32, to: u32) {
        let Some(cq) = self.cqs[qid as usize].as_mut() else {
            return;
        };
        let mut slot = from;
        while slot != to {
            // Slots before the tail were written in this pass, the others in the last one.
            let phase = if slot < cq.tail { cq.phase } else { !cq.phase };
            let entry = Completion {
                dw0: 0xdead_beef,
                dw1: 0xdead_beef,
                sqhd: 0xffff,
                sqid: 0xffff,
                cid: POISON_CID,
                status: CqeStatus::from_bits(0x7ffe).with_p(phase),
            };
            let addr = cq.base + slot as u64 * size_of::<Completion>() as u64;
            if let Err(e) = self.cache.write(addr, entry.as_bytes()) {
                tracing::warn!(qid, error = %e, "rewriting a freed CQ entry failed");
                self.enter_fatal("DMA error writing a completion queue");
                return;
            }
            slot = (slot + 1) % cq.entries;
        }
    }

    /// Posts held completions of CQ `qid` while it has room.
    fn flush_held(&mut self, qid: u16) {
        loop {
            let Some(cq) = self.cqs[qid as usize].as_mut() else {
                return;
            };
            if cq.free() == 0 {
                return;
            }
            let Some(pc) = cq.held.pop_front() else {
                return;
            };
            self.write_cqe(qid, pc);
            if !self.live() {
                return;
            }
        }
    }

    /// Posts delayed completions whose time has come.
    pub(super) fn post_due_delayed(&mut self) -> bool {
        let Some(Reverse(first)) = self.delayed.peek() else {
            return false;
        };
        let now = Instant::now();
        if first.due > now {
            return false;
        }
        while let Some(Reverse(d)) = self.delayed.peek() {
            if d.due > now {
                break;
            }
            let Reverse(d) = self.delayed.pop().expect("peeked");
            self.finish(d.cqid, d.completion());
        }
        true
    }

    /// Serves a batch from each I/O submission queue of this thread, starting from a rotating
    /// one.
    pub(super) fn service_io_queues(&mut self) -> bool {
        let mut worked = false;
        let n = self.io_sqs.len();
        for k in 0..n {
            if !self.live() {
                break;
            }
            let qid = self.io_sqs[(self.rr + k) % n];
            worked |= self.service_io_sq(qid);
        }
        if n > 0 {
            self.rr = (self.rr + 1) % n;
        }
        worked
    }

    /// Fetches, announces ([`Worker::prefetch_batch`]) and executes up to [`BATCH`] commands
    /// of I/O submission queue `qid` (up to `external_batch` for a queue with an external
    /// doorbell), then posts their completions and flushes the regions written.
    fn service_io_sq(&mut self, qid: u16) -> bool {
        match self.poll_sq(qid) {
            Poll::Idle => false,
            Poll::Handled => true,
            Poll::Ready { n, cqid } => {
                self.serve_batch(qid, n, cqid);
                true
            }
        }
    }

    /// Everything the controller does for a batch of `n` I/O commands found on submission
    /// queue `qid`: fetch, execute, complete, flush. Never inlined, so that its cost per
    /// command can be counted on its own (`scripts/hot-path-bench.sh` has callgrind collect
    /// only inside it): the polling around it depends on timing, this does not.
    #[inline(never)]
    fn serve_batch(&mut self, qid: u16, n: u32, cqid: u16) {
        let n = match self.fetch_sqes(qid, n, cqid) {
            Fetch::Batch { n, .. } => n,
            Fetch::Idle | Fetch::Handled => return,
        };
        self.prefetch_batch(n);
        for i in 0..n {
            let cmd = self.sqe(i);
            // Reads two commands ahead start moving their blocks towards the cache while this
            // one runs (the first command starts the next two): a 4 KiB Read from a mapped
            // image is otherwise a copy that waits on memory (one queue, QD 32: 1.16 M IOPS
            // without, 1.43 M one ahead, 1.43-1.50 M two ahead; 2-core CPU machine).
            let ahead = if i == 0 { 1..3 } else { i + 2..i + 3 };
            for j in ahead.take_while(|&j| j < n) {
                self.prefetch_read(&self.sqe(j));
            }
            let result = self.io(&cmd);
            self.conclude(qid, cqid, &cmd, result);
        }
        self.post_batch();
    }

    /// Fetches up to a batch of commands from submission queue `qid` into the fetch buffer.
    pub(super) fn fetch(&mut self, qid: u16) -> Fetch {
        match self.poll_sq(qid) {
            Poll::Idle => Fetch::Idle,
            Poll::Handled => Fetch::Handled,
            Poll::Ready { n, cqid } => self.fetch_sqes(qid, n, cqid),
        }
    }

    /// Looks at submission queue `qid`'s doorbell: how many commands to fetch now (at most a
    /// batch, and no more than its completion queue can take), without fetching them.
    fn poll_sq(&mut self, qid: u16) -> Poll {
        let Some(sq) = self.sqs[qid as usize].as_mut() else {
            return Poll::Idle;
        };
        let (raw, limit) = match &sq.doorbell {
            None => (self.shared.regs.sq_tail(qid), BATCH),
            Some(word) => (word.load(), self.external_batch),
        };
        if raw != sq.seen_doorbell {
            if raw >= sq.entries && sq.doorbell.is_none() {
                // Only possible for a register write that raced the queue's re-creation (the
                // window refuses out-of-range values and reports them itself); ignore it.
                return Poll::Idle;
            }
            sq.seen_doorbell = raw;
            if raw >= sq.entries
                || (self.hostile.flag_backward_tail && sq.pending(raw) < sq.pending(sq.tail))
            {
                self.invalid_doorbell_value(qid, true, raw);
                return Poll::Handled;
            }
            sq.tail = raw;
        }
        let tail = sq.tail;
        let pending = sq.pending(tail);
        if pending == 0 {
            return Poll::Idle;
        }
        let cqid = sq.cqid;
        // A fatal fault injected before the host rang this doorbell must stop this fetch (the
        // Acquire load of the doorbell makes the earlier fault request visible; thread 0
        // enters the fatal state before it takes the request).
        if self.shared.faults.fatal_pending() {
            self.enter_fatal("injected fault");
            return Poll::Handled;
        }
        if !self.live() {
            return Poll::Idle;
        }
        let Some(cq) = self.cqs[cqid as usize].as_ref() else {
            return Poll::Idle;
        };
        let n = pending.min(cq.fetch_budget()).min(limit);
        if n == 0 {
            // Waiting for the host to consume completions.
            return Poll::Idle;
        }
        Poll::Ready { n, cqid }
    }

    /// Fetches `n` commands (found by [`Worker::poll_sq`]) from submission queue `qid` into
    /// the fetch buffer.
    fn fetch_sqes(&mut self, qid: u16, n: u32, cqid: u16) -> Fetch {
        let Some(sq) = self.sqs[qid as usize].as_mut() else {
            return Fetch::Idle;
        };
        let (base, entries, head) = (sq.base, sq.entries, sq.head);
        // Fetch: at most two reads (the batch may wrap around the ring end).
        let first = n.min(entries - head) as usize;
        let rest = n as usize - first;
        let n = n as usize;
        let cache = &mut self.cache;
        let fetched = cache
            .read_at(
                base + head as u64 * SQE as u64,
                &mut self.sqe_buf[..first * SQE],
                &mut sq.map_hint,
            )
            .and_then(|()| {
                if rest > 0 {
                    cache.read_at(
                        base,
                        &mut self.sqe_buf[first * SQE..n * SQE],
                        &mut sq.map_hint,
                    )
                } else {
                    Ok(())
                }
            });
        if let Err(e) = fetched {
            tracing::warn!(qid, error = %e, "submission queue fetch failed");
            self.enter_fatal("DMA error fetching from a submission queue");
            return Fetch::Handled;
        }
        if self.hostile.poison_sq {
            // Before any completion can tell the host these slots are free again.
            let mut poison = [0u8; SQE];
            poison[0] = POISON_OPCODE;
            poison[2..4].copy_from_slice(&POISON_CID.to_le_bytes());
            for i in 0..n as u32 {
                let slot = (head + i) % entries;
                if let Err(e) = self.cache.write(base + slot as u64 * SQE as u64, &poison) {
                    tracing::warn!(qid, error = %e, "poisoning a fetched SQE failed");
                    self.enter_fatal("DMA error writing a submission queue");
                    return Fetch::Handled;
                }
            }
        }
        self.sqs[qid as usize]
            .as_mut()
            .expect("checked")
            .advance(n as u32);
        self.cqs[cqid as usize].as_mut().expect("checked").owed += n as u32;
        let c = self.counters();
        let counter = if qid == 0 {
            &c.admin_commands
        } else {
            &c.io_commands
        };
        Counters::add(counter, n as u64);
        Fetch::Batch { n, cqid }
    }

    /// Command `i` of the fetch buffer.
    pub(super) fn sqe(&self, i: usize) -> Command {
        Command::read_from_bytes(&self.sqe_buf[i * SQE..(i + 1) * SQE]).expect("an SQE is 64 bytes")
    }

    /// Turns the result of a command of submission queue `qid` into a completion for the
    /// batch (or for later: deferred, dropped, delayed).
    pub(super) fn conclude(&mut self, qid: u16, cqid: u16, cmd: &Command, result: CmdResult) {
        let (dw0, status) = match result {
            Ok(Outcome::Done(dw0)) => (dw0, 0),
            Ok(Outcome::Deferred) => {
                if let Some(cq) = self.cqs[cqid as usize].as_mut() {
                    cq.owed -= 1;
                }
                return;
            }
            Ok(Outcome::Forwarded { tag, ns, read_len }) => {
                // Completed (and `owed` paid) when the far controller answers.
                self.track_forwarded(qid, cqid, cmd, (tag, ns, read_len));
                return;
            }
            Err(fail) => (0, self.log_error(qid, cmd, fail)),
        };
        let pc = PendingCompletion {
            sqid: qid,
            cid: cmd.cdw0.cid(),
            dw0,
            status,
        };
        if qid != 0 && self.divert_io_completion(cqid, pc) {
            return;
        }
        self.batch.push((cqid, pc));
    }

    /// Posts the batch's completions, then flushes the regions written.
    pub(super) fn post_batch(&mut self) {
        let mut batch = std::mem::take(&mut self.batch);
        if self.reorder {
            batch.reverse();
        }
        for (cqid, pc) in batch.drain(..) {
            if !self.live() {
                break;
            }
            self.finish(cqid, pc);
        }
        batch.clear();
        self.batch = batch;
        // The batch's completions are written: regions deferring writes perform them now.
        if self.cache.has_unflushed() {
            self.flush_regions(true);
        }
    }

    /// Applies the drop and delay faults to an I/O completion; returns whether it was taken
    /// (dropped or delayed) instead of being posted now.
    fn divert_io_completion(&mut self, cqid: u16, pc: PendingCompletion) -> bool {
        if self.shared.faults.take_drop() {
            if let Some(cq) = self.cqs[cqid as usize].as_mut() {
                cq.owed -= 1;
            }
            if self.dropped.len() == DROPPED_MEMORY {
                self.dropped.pop_front();
            }
            self.dropped.push_back((pc.sqid, pc.cid));
            Counters::add(&self.counters().completions_dropped, 1);
            return true;
        }
        if !self.shared.faults.delays_completions() {
            return false;
        }
        let delay = self.shared.faults.completion_delay();
        if delay.is_zero() {
            return false;
        }
        self.delay_seq += 1;
        self.delayed.push(Reverse(Delayed {
            due: Instant::now() + delay,
            seq: self.delay_seq,
            cqid,
            sqid: pc.sqid,
            cid: pc.cid,
            dw0: pc.dw0,
            status: pc.status,
        }));
        true
    }

    /// Completes a command counted in its CQ's `owed`.
    pub(super) fn finish(&mut self, cqid: u16, pc: PendingCompletion) {
        if let Some(cq) = self.cqs[cqid as usize].as_mut() {
            cq.owed = cq.owed.saturating_sub(1);
        }
        self.complete(cqid, pc);
    }

    /// Posts a completion, or holds it if the queue is full.
    pub(super) fn complete(&mut self, cqid: u16, pc: PendingCompletion) {
        let Some(cq) = self.cqs[cqid as usize].as_mut() else {
            return;
        };
        if !cq.held.is_empty() || cq.free() == 0 {
            cq.held.push_back(pc);
            Counters::add(&self.counters().cq_full_waits, 1);
            return;
        }
        self.write_cqe(cqid, pc);
    }

    /// Writes a completion queue entry: dwords 0 to 2, then (Release) the dword with the phase
    /// tag. The queue has room (checked by the caller).
    fn write_cqe(&mut self, cqid: u16, pc: PendingCompletion) {
        let sqhd = self.sqs[pc.sqid as usize]
            .as_ref()
            .map_or(0, |sq| sq.head as u16);
        let Some(cq) = self.cqs[cqid as usize].as_mut() else {
            return;
        };
        let (addr, phase) = cq.next_slot();
        let entry = Completion {
            dw0: pc.dw0,
            dw1: 0,
            sqhd,
            sqid: pc.sqid,
            cid: pc.cid,
            status: CqeStatus::from_bits(pc.status).with_p(phase),
        };
        let written =
            self.cache
                .write_last_dword_release_at(addr, entry.as_bytes(), &mut cq.map_hint);
        if let Err(e) = written {
            tracing::warn!(cqid, error = %e, "completion queue write failed");
            self.enter_fatal("DMA error writing a completion queue entry");
            return;
        }
        Counters::add(&self.counters().completions_posted, 1);
    }

    /// Records a failed command in the Error Information log and returns the status field to
    /// post (with More set: the log has an entry for it).
    pub(super) fn log_error(&mut self, sqid: u16, cmd: &Command, fail: Fail) -> u16 {
        let c = self.counters();
        Counters::add(&c.errors, 1);
        if fail.status.sct == StatusCodeType::MEDIA_AND_DATA_INTEGRITY {
            Counters::add(&c.media_errors, 1);
        }
        let status = CqeStatus::from_status(fail.status.with_more(true), false);
        let mut entry = ErrorInformationLogEntry::new_zeroed();
        entry.sqid = sqid;
        entry.cid = cmd.cdw0.cid();
        entry.status = status.into_bits();
        entry.parameter_error_location = fail.pel;
        entry.lba = fail.lba;
        entry.nsid = cmd.nsid;
        self.shared.log_error_entry(entry);
        status.into_bits()
    }

    /// A doorbell value this thread found invalid (an external word's value, or a CQ head
    /// that passes entries not yet posted): counted, logged, and reported to thread 0 as a
    /// refused register-window write is. The value is ignored.
    fn invalid_doorbell_value(&mut self, qid: u16, is_sq: bool, value: u32) {
        Counters::add(&self.counters().invalid_doorbell_values, 1);
        let event = log_doorbell_error(
            &self.shared,
            DoorbellError {
                kind: DoorbellErrorKind::InvalidValue,
                qid,
                is_sq,
                value,
            },
        );
        self.shared.post_event(event);
    }

    /// Walks a command's PRPs for a transfer of `len` bytes into `self.segments`.
    pub(super) fn walk_prps(&mut self, cmd: &Command, len: u64) -> Result<(), Fail> {
        crate::prp::walk(
            &mut self.cache,
            cmd.prp1,
            cmd.prp2,
            len,
            &mut self.segments,
            &mut self.list_page,
        )
        .map_err(|e| match e {
            crate::prp::PrpError::OffsetInvalid { field } => {
                Fail::generic(generic::PRP_OFFSET_INVALID).at(field)
            }
            crate::prp::PrpError::Dma(e) => {
                tracing::debug!(error = %e, "PRP list read failed");
                Fail::data_transfer()
            }
        })
    }

    /// Transfers `data` to the host through the command's PRPs (walked for `data.len()`).
    pub(super) fn send(&mut self, cmd: &Command, data: &[u8]) -> Result<(), Fail> {
        self.walk_prps(cmd, data.len() as u64)?;
        crate::prp::copy_to_host(&mut self.cache, &self.segments, data)
            .map_err(|_| Fail::data_transfer())
    }

    /// The transfer length of a Read or Write command whose fields allow one (else `None`),
    /// and whether it is a Write. Used by the prefetch pre-pass, which must not fail commands.
    pub(super) fn read_write_len(&self, cmd: &Command) -> Option<(u64, bool)> {
        let write = match NvmOpcode(cmd.cdw0.opcode()) {
            NvmOpcode::READ => false,
            NvmOpcode::WRITE => true,
            _ => return None,
        };
        if cmd.cdw0.fuse() != 0 || cmd.cdw0.psdt() != 0 {
            return None;
        }
        let ns = self.namespaces.get((cmd.nsid as usize).checked_sub(1)?)?;
        let len = ((cmd.cdw12 & 0xffff) as u64 + 1) << ns.lba_shift;
        (len <= self.max_transfer).then_some((len, write))
    }
}

/// Spinning, yielding and parking of an idle thread.
#[derive(Default)]
pub(super) struct Idle {
    since: Option<Instant>,
    passes: u32,
}

impl Idle {
    /// A pass did something.
    pub(super) fn worked(&mut self) {
        self.since = None;
        self.passes = 0;
    }

    /// A pass did nothing: spins briefly, then yields (when `polls`: the thread serves a
    /// queue with external doorbells, which nothing could wake it for; after
    /// [`POLL_NAP_AFTER`] of nothing it naps [`POLL_NAP`] per pass) or parks for at most
    /// [`PARK_MAX`] (less when a delayed completion falls due sooner; longer for a thread
    /// other than 0 without queues).
    pub(super) fn wait(&mut self, worker: &mut Worker, polls: bool) {
        if worker.fwd.in_flight() > 0 {
            // Waiting on the far controller: in the channel's socket, not spinning beside the
            // host's and the target's threads.
            worker.poll_forwarded(super::forwarding::IDLE_WAIT);
            return;
        }
        self.passes += 1;
        if self.passes % 64 != 0 {
            std::hint::spin_loop();
            return;
        }
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        if now - since < SPIN_TIME {
            std::hint::spin_loop();
            return;
        }
        // Let go of cached regions while idle if any was unmapped since, so that freed buffers
        // do not linger (cached regions that are all still mapped keep nothing alive).
        worker.cache.release_stale();
        if polls {
            if now - since < POLL_NAP_AFTER {
                std::thread::yield_now();
            } else {
                // Parked, not asleep: a CPU queue's doorbell write (which unparks the thread
                // serving it) is not kept waiting for the nap's end. Blockfs's mount and a
                // load's header reads are a handful of such commands, each of which waited up
                // to a nap (0.2 ms) when the thread also served GPU queues.
                std::thread::park_timeout(POLL_NAP);
            }
            return;
        }
        let mut timeout = if worker.index != 0 && worker.cq_ids.is_empty() {
            EMPTY_PARK_MAX
        } else {
            PARK_MAX
        };
        if let Some(due) = worker.next_due() {
            timeout = timeout.min(due.saturating_duration_since(now));
        }
        Counters::add(&worker.counters().idle_parks, 1);
        std::thread::park_timeout(timeout);
    }
}
