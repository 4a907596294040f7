//! The controller thread: the enable/reset state machine, doorbell polling, command fetch,
//! completion posting, asynchronous events and the error log.
//!
//! One thread serves every queue. Each pass it samples CC (enable, disable, shutdown), takes in
//! refused doorbell writes, CQ head doorbells and due delayed completions, then fetches up to
//! [`BATCH`] commands from the admin queue and from each I/O submission queue in turn (the
//! starting queue rotates, so no queue starves another). A queue is fetched from only as far as
//! its completion queue has room for the results, so completions never overwrite entries the
//! host has not consumed; a completion that still finds its queue full (an Abort of a dropped
//! command, an asynchronous event) is held until the host moves the CQ head.
//!
//! Queues created while their id had external doorbells attached ([`crate::DoorbellWord`])
//! take their SQ tail or CQ head from those words, validated as register-window doorbell writes
//! are, and fetch up to `EmuConfig::external_batch` commands per pass.
//!
//! Writes go through regions that may defer them ([`crate::MemoryRegion::flush`]): every
//! region written through is flushed at the end of each submission queue's batch (after its
//! completions are written) and at the end of every pass, so nothing stays staged while the
//! thread is idle. A failed flush is controller fatal.
//!
//! When there is nothing to do the thread spins briefly, then parks for at most
//! [`PARK_MAX`]; writes to CC and to doorbells unpark it. While a queue with external
//! doorbells exists nothing can unpark it (a GPU's write to a word raises no wakeup), so it
//! keeps polling instead, yielding its CPU now and then.

mod admin;
mod nvm;
pub(crate) mod pages;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nvme_spec::log::ErrorInformationLogEntry;
use nvme_spec::status::{StatusCodeType, generic};
use nvme_spec::{Aqa, Cc, Command, Completion, CqeStatus, Csts, Status};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::config::EmuConfig;
use crate::doorbells::ExternalDoorbells;
use crate::faults::Faults;
use crate::memory::{DeviceAddressMap, MapCache};
use crate::prp::{PAGE, Segment};
use crate::queues::{CompQueue, PendingCompletion, SubQueue};
use crate::registers::{DoorbellError, DoorbellErrorKind, RegisterWindow};
use crate::stats::Counters;
use crate::storage::Namespace;

/// Most commands fetched from one submission queue with register-window doorbells per pass
/// (queues with external doorbells use `EmuConfig::external_batch`).
pub(crate) const BATCH: u32 = 64;
/// Longest the idle thread parks before looking at its registers again.
pub(crate) const PARK_MAX: Duration = Duration::from_millis(1);
/// How long the thread spins after its last piece of work before parking.
const SPIN_TIME: Duration = Duration::from_micros(50);
/// Dropped commands remembered for Abort; older ones are forgotten.
const DROPPED_MEMORY: usize = 4096;
/// Asynchronous events queued while none can be reported; later ones are lost.
const EVENT_BACKLOG: usize = 16;
/// Size of a submission queue entry.
const SQE: usize = size_of::<Command>();

/// State shared by the controller thread and the [`crate::EmuDevice`] handle.
pub(crate) struct Shared {
    pub(crate) regs: Arc<RegisterWindow>,
    pub(crate) map: Arc<DeviceAddressMap>,
    pub(crate) faults: Faults,
    pub(crate) counters: Counters,
    pub(crate) stop: AtomicBool,
    /// External doorbell attachments and which of their queues exist.
    pub(crate) doorbells: ExternalDoorbells,
}

/// Where the controller is in its life cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// CC.EN = 0 (or not yet observed as 1): no queues.
    Disabled,
    /// CSTS.RDY = 1: processing commands.
    Enabled,
    /// CSTS.CFS = 1: nothing is processed until the host clears CC.EN.
    Fatal,
}

/// Why a command failed: the status to post, plus what goes in the Error Information log.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fail {
    pub(crate) status: Status,
    /// Parameter Error Location: byte in the command (bits 7:0) and bit (10:8), or 0xffff.
    pub(crate) pel: u16,
    /// First failing LBA, for media errors.
    pub(crate) lba: u64,
}

impl Fail {
    /// A failure with Do Not Retry set (retrying the same command cannot succeed).
    pub(crate) fn new(status: Status) -> Self {
        Self {
            status: status.with_dnr(true),
            pel: 0xffff,
            lba: 0,
        }
    }

    /// A Generic Command Status failure with DNR.
    pub(crate) fn generic(sc: u8) -> Self {
        Self::new(Status::generic(sc))
    }

    /// A Command Specific Status failure with DNR.
    pub(crate) fn specific(sc: u8) -> Self {
        Self::new(Status::command_specific(sc))
    }

    /// A Media and Data Integrity Error at `lba` with DNR.
    pub(crate) fn media(sc: u8, lba: u64) -> Self {
        Self {
            lba,
            ..Self::new(Status::media(sc))
        }
    }

    /// Data Transfer Error (retryable: the host may fix its mapping).
    pub(crate) fn data_transfer() -> Self {
        Self::new(Status::generic(generic::DATA_TRANSFER_ERROR)).retryable()
    }

    /// Clears Do Not Retry.
    pub(crate) fn retryable(mut self) -> Self {
        self.status = self.status.with_dnr(false);
        self
    }

    /// Names the byte of the command holding the offending field.
    pub(crate) fn at(mut self, byte: u16) -> Self {
        self.pel = byte;
        self
    }
}

/// What executing a command produced.
pub(crate) enum Outcome {
    /// Complete with this Dword 0.
    Done(u32),
    /// Completes later (an Asynchronous Event Request).
    Deferred,
}

/// Result of executing one command.
pub(crate) type CmdResult = Result<Outcome, Fail>;

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

/// Feature values (Set/Get Features), reset with the controller.
#[derive(Clone, Copy, Debug)]
struct Features {
    arbitration: u32,
    power_management: u32,
    temp_over: u16,
    temp_under: u16,
    error_recovery: u32,
    volatile_write_cache: bool,
    /// Allocated I/O submission / completion queues, zero-based.
    nsqa_z: u16,
    ncqa_z: u16,
    interrupt_coalescing: u32,
    interrupt_vector_cd: bool,
    write_atomicity: u32,
    async_event_config: u32,
}

/// Composite temperature the controller reports, kelvin (40 degrees Celsius).
pub(crate) const TEMPERATURE_K: u16 = 313;
/// Warning composite temperature threshold, kelvin.
pub(crate) const WCTEMP_K: u16 = 343;
/// Critical composite temperature threshold, kelvin.
pub(crate) const CCTEMP_K: u16 = 353;

impl Features {
    fn defaults(max_io_queue_pairs: u16) -> Self {
        Self {
            arbitration: 0,
            power_management: 0,
            temp_over: WCTEMP_K,
            temp_under: 0,
            error_recovery: 0,
            volatile_write_cache: true,
            nsqa_z: max_io_queue_pairs - 1,
            ncqa_z: max_io_queue_pairs - 1,
            interrupt_coalescing: 0,
            interrupt_vector_cd: false,
            write_atomicity: 0,
            async_event_config: 0,
        }
    }
}

/// Asynchronous event bookkeeping.
#[derive(Debug, Default)]
struct Events {
    /// Command ids of outstanding Asynchronous Event Request commands.
    outstanding: Vec<u16>,
    /// Events (completion Dword 0) not yet reported.
    pending: VecDeque<u32>,
    /// Error status events are masked: one was reported and the host has not yet read the
    /// Error Information log with RAE cleared.
    error_masked: bool,
}

/// Lifetime counters for the SMART / Health log.
#[derive(Debug, Default)]
struct Smart {
    /// Bytes read and written by successful commands.
    bytes_read: u64,
    bytes_written: u64,
    read_commands: u64,
    write_commands: u64,
    media_errors: u64,
}

/// The controller, owned by its thread.
pub(crate) struct Controller {
    shared: Arc<Shared>,
    config: EmuConfig,
    /// MDTS in bytes; `u64::MAX` when unlimited.
    max_transfer: u64,
    namespaces: Vec<Namespace>,
    cache: MapCache,
    state: State,
    shutdown_done: bool,
    sqs: Vec<Option<SubQueue>>,
    cqs: Vec<Option<CompQueue>>,
    /// Existing I/O submission queue ids, ascending.
    io_sqs: Vec<u16>,
    /// Existing completion queue ids (including 0), ascending.
    cq_ids: Vec<u16>,
    /// Round-robin start among `io_sqs`.
    rr: usize,
    features: Features,
    events: Events,
    error_log: VecDeque<ErrorInformationLogEntry>,
    error_count: u64,
    smart: Smart,
    delayed: BinaryHeap<Reverse<Delayed>>,
    delay_seq: u64,
    dropped: VecDeque<(u16, u16)>,
    doorbell_errors_seen: u64,
    started: Instant,
    // Scratch space reused by every command, so that the I/O path does not allocate.
    sqe_buf: Vec<u8>,
    batch: Vec<(u16, PendingCompletion)>,
    segments: Vec<Segment>,
    list_page: Box<[u8; PAGE as usize]>,
    bounce: Vec<u8>,
}

impl Controller {
    /// Builds the controller for a validated configuration with opened namespaces.
    pub(crate) fn new(shared: Arc<Shared>, config: EmuConfig, namespaces: Vec<Namespace>) -> Self {
        let max_qid = config.max_io_queue_pairs as usize;
        let max_transfer = if config.mdts == 0 {
            u64::MAX
        } else {
            PAGE << config.mdts
        };
        let max_batch = BATCH.max(config.external_batch) as usize;
        Self {
            cache: MapCache::new(shared.map.clone()),
            shared,
            max_transfer,
            namespaces,
            state: State::Disabled,
            shutdown_done: false,
            sqs: (0..=max_qid).map(|_| None).collect(),
            cqs: (0..=max_qid).map(|_| None).collect(),
            io_sqs: Vec::new(),
            cq_ids: Vec::new(),
            rr: 0,
            features: Features::defaults(config.max_io_queue_pairs),
            events: Events::default(),
            error_log: VecDeque::with_capacity(config.error_log_entries as usize),
            error_count: 0,
            smart: Smart::default(),
            delayed: BinaryHeap::new(),
            delay_seq: 0,
            dropped: VecDeque::new(),
            doorbell_errors_seen: 0,
            started: Instant::now(),
            sqe_buf: vec![0; max_batch * SQE],
            batch: Vec::with_capacity(max_batch),
            segments: Vec::with_capacity(64),
            list_page: Box::new([0; PAGE as usize]),
            bounce: Vec::new(),
            config,
        }
    }

    /// The thread body: runs until asked to stop. A panic (a bug, never device input) puts the
    /// controller in Controller Fatal Status, so the driver sees a dead device rather than
    /// waiting forever.
    pub(crate) fn run(mut self) {
        let shared = self.shared.clone();
        if catch_unwind(AssertUnwindSafe(|| self.run_loop())).is_err() {
            shared.regs.csts_set(u32::from(Csts::new().with_cfs(true)));
            tracing::error!("software NVMe controller thread panicked; controller is fatal");
        }
    }

    fn run_loop(&mut self) {
        let mut idle_since: Option<Instant> = None;
        let mut idle_passes = 0u32;
        while !self.shared.stop.load(Ordering::Acquire) {
            if self.pass() {
                idle_since = None;
                idle_passes = 0;
                continue;
            }
            idle_passes += 1;
            if idle_passes % 64 != 0 {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            let since = *idle_since.get_or_insert(now);
            if now - since < SPIN_TIME {
                std::hint::spin_loop();
                continue;
            }
            if self.polls_external_doorbells() {
                // Nothing would unpark the thread for these queues: keep polling, but let go
                // of cached regions and of the CPU now and then.
                self.cache.clear();
                std::thread::yield_now();
                continue;
            }
            let mut timeout = PARK_MAX;
            if let Some(Reverse(d)) = self.delayed.peek() {
                timeout = timeout.min(d.due.saturating_duration_since(now));
            }
            // Let go of cached regions while idle, so freed buffers do not linger.
            self.cache.clear();
            Counters::add(&self.shared.counters.idle_parks, 1);
            std::thread::park_timeout(timeout);
        }
    }

    /// Whether a queue that takes its doorbell from an external word exists (and is served).
    fn polls_external_doorbells(&self) -> bool {
        self.state == State::Enabled
            && (self.io_sqs.iter().any(|&q| {
                self.sqs[q as usize]
                    .as_ref()
                    .is_some_and(|sq| sq.doorbell.is_some())
            }) || self.cq_ids.iter().any(|&q| {
                self.cqs[q as usize]
                    .as_ref()
                    .is_some_and(|cq| cq.doorbell.is_some())
            }))
    }

    /// One pass over registers and queues, then a flush of every region written through;
    /// returns whether anything happened.
    fn pass(&mut self) -> bool {
        let worked = self.serve();
        if self.cache.has_unflushed() {
            self.flush_regions();
        }
        worked
    }

    /// Flushes every region written through since the last flush. A failure is controller
    /// fatal: completions may be among the writes, so no command can be failed instead.
    fn flush_regions(&mut self) {
        if let Err(e) = self.cache.flush() {
            tracing::warn!(error = %e, "memory region flush failed");
            if self.state == State::Enabled {
                self.enter_fatal("DMA error flushing writes to a memory region");
            }
        }
    }

    /// The body of [`Controller::pass`]: CC, doorbells, held and delayed completions, and a
    /// batch from every submission queue.
    fn serve(&mut self) -> bool {
        let mut worked = false;
        if self.shared.regs.take_disable_latch() {
            self.reset();
            worked = true;
        }
        let cc = self.shared.regs.cc();
        match self.state {
            State::Disabled if cc.en() => {
                self.enable(cc);
                worked = true;
            }
            State::Enabled | State::Fatal if !cc.en() => {
                self.reset();
                worked = true;
            }
            _ => {}
        }
        if self.shared.faults.take_fatal() {
            if self.state == State::Disabled {
                self.shared
                    .regs
                    .csts_clear(u32::from(Csts::new().with_cfs(true)));
            } else {
                self.enter_fatal("injected fault");
            }
            worked = true;
        }
        if cc.shn() != 0 && !self.shutdown_done {
            self.shutdown();
            worked = true;
        }
        if self.state != State::Enabled {
            return worked;
        }
        let errors = self.shared.regs.doorbell_error_count();
        if errors != self.doorbell_errors_seen {
            self.doorbell_errors_seen = errors;
            while let Some(e) = self.shared.regs.pop_doorbell_error() {
                self.doorbell_error(e);
            }
            worked = true;
        }
        worked |= self.update_cq_heads();
        worked |= self.post_due_delayed();
        worked |= self.service_sq(0);
        let n = self.io_sqs.len();
        for k in 0..n {
            if self.state != State::Enabled {
                break;
            }
            let qid = self.io_sqs[(self.rr + k) % n];
            worked |= self.service_sq(qid);
        }
        if n > 0 {
            self.rr = (self.rr + 1) % n;
        }
        worked
    }

    /// CC.EN 0 to 1: validates the configuration and admin queue registers, creates the admin
    /// queues and sets CSTS.RDY; an invalid setting sets CSTS.CFS instead.
    fn enable(&mut self, cc: Cc) {
        let regs = self.shared.regs.clone();
        let aqa = Aqa::from(regs.aqa());
        let (asq, acq) = (regs.asq(), regs.acq());
        // Refused doorbell writes made while disabled are not errors of this enablement.
        while regs.pop_doorbell_error().is_some() {}
        self.doorbell_errors_seen = regs.doorbell_error_count();
        let problem = if cc.css() != Cc::CSS_NVM {
            Some("CC.CSS does not select the NVM command set")
        } else if cc.mps() != 0 {
            Some("CC.MPS selects a page size other than 4 KiB")
        } else if cc.ams() != 0 {
            Some("CC.AMS selects an unsupported arbitration mechanism")
        } else if !matches!(cc.iosqes(), 0 | 6) || !matches!(cc.iocqes(), 0 | 4) {
            Some("CC.IOSQES/IOCQES are not 64/16-byte entries")
        } else if aqa.asqs_z() == 0 || aqa.acqs_z() == 0 {
            Some("AQA sizes an admin queue with fewer than two entries")
        } else if asq % PAGE != 0 || acq % PAGE != 0 {
            Some("ASQ/ACQ is not 4 KiB aligned")
        } else {
            None
        };
        if let Some(problem) = problem {
            self.enter_fatal(problem);
            return;
        }
        let sq_entries = aqa.asqs_z() as u32 + 1;
        let cq_entries = aqa.acqs_z() as u32 + 1;
        let mut cq = CompQueue::new(acq, cq_entries);
        cq.sq_count = 1;
        self.cqs[0] = Some(cq);
        self.sqs[0] = Some(SubQueue::new(asq, sq_entries, 0, None));
        self.cq_ids = vec![0];
        regs.set_queue(0, true, sq_entries);
        regs.set_queue(0, false, cq_entries);
        // Enabling is a fresh start after any earlier shutdown.
        if cc.shn() == 0 {
            self.shutdown_done = false;
            regs.set_shst(Csts::SHST_NORMAL);
        }
        self.state = State::Enabled;
        regs.csts_set(u32::from(Csts::new().with_rdy(true)));
    }

    /// CC.EN 1 to 0: a controller reset. Deletes every queue, forgets outstanding commands
    /// (their completions are never posted, as on hardware), restores feature defaults and
    /// clears CSTS.RDY, CSTS.CFS and CSTS.SHST. Media, the error log and SMART counters survive.
    fn reset(&mut self) {
        let regs = self.shared.regs.clone();
        regs.reset_queues();
        self.shared.doorbells.reset();
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.cqs.iter_mut().for_each(|q| *q = None);
        self.io_sqs.clear();
        self.cq_ids.clear();
        self.rr = 0;
        self.delayed.clear();
        self.dropped.clear();
        self.events = Events::default();
        self.features = Features::defaults(self.config.max_io_queue_pairs);
        self.shutdown_done = false;
        self.state = State::Disabled;
        self.cache.clear();
        while regs.pop_doorbell_error().is_some() {}
        self.doorbell_errors_seen = regs.doorbell_error_count();
        regs.csts_clear(u32::from(Csts::new().with_rdy(true).with_cfs(true)));
        regs.set_shst(Csts::SHST_NORMAL);
        Counters::add(&self.shared.counters.resets, 1);
    }

    /// CC.SHN set: makes every namespace durable and reports shutdown complete.
    fn shutdown(&mut self) {
        let regs = self.shared.regs.clone();
        regs.set_shst(Csts::SHST_OCCURRING);
        for (i, ns) in self.namespaces.iter().enumerate() {
            if let Err(e) = ns.flush() {
                tracing::warn!(nsid = i + 1, error = %e, "flush at shutdown failed");
            }
        }
        regs.set_shst(Csts::SHST_COMPLETE);
        self.shutdown_done = true;
    }

    /// Enters Controller Fatal Status.
    fn enter_fatal(&mut self, why: &str) {
        tracing::warn!(
            reason = why,
            "software NVMe controller: controller fatal status"
        );
        self.state = State::Fatal;
        self.shared
            .regs
            .csts_set(u32::from(Csts::new().with_cfs(true)));
        Counters::add(&self.shared.counters.fatal_errors, 1);
    }

    /// Takes in CQ head doorbells (register window or external word), posting held
    /// completions into the space freed.
    fn update_cq_heads(&mut self) -> bool {
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
            cq.head = raw;
            self.flush_held(qid);
        }
        worked
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
            if self.state != State::Enabled {
                return;
            }
        }
    }

    /// Posts delayed completions whose time has come.
    fn post_due_delayed(&mut self) -> bool {
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
            let pc = PendingCompletion {
                sqid: d.sqid,
                cid: d.cid,
                dw0: d.dw0,
                status: d.status,
            };
            self.finish(d.cqid, pc);
        }
        true
    }

    /// Fetches and executes up to [`BATCH`] commands of submission queue `qid` (up to
    /// `external_batch` for a queue with an external doorbell), then flushes the regions
    /// written.
    fn service_sq(&mut self, qid: u16) -> bool {
        let Some(sq) = self.sqs[qid as usize].as_mut() else {
            return false;
        };
        let (tail, limit) = match &sq.doorbell {
            None => {
                let tail = self.shared.regs.sq_tail(qid);
                if tail >= sq.entries {
                    // Only possible for a write that raced the queue's re-creation (the
                    // window refuses out-of-range values); ignore it.
                    return false;
                }
                (tail, BATCH)
            }
            Some(word) => {
                let raw = word.load();
                if raw != sq.seen_doorbell {
                    sq.seen_doorbell = raw;
                    if raw >= sq.entries {
                        self.invalid_doorbell_value(qid, true, raw);
                        return true;
                    }
                    sq.tail = raw;
                }
                (sq.tail, self.config.external_batch)
            }
        };
        let pending = sq.pending(tail);
        if pending == 0 {
            return false;
        }
        let cqid = sq.cqid;
        // A fatal fault injected before the host rang this doorbell must stop this fetch (the
        // Acquire load of the doorbell makes the earlier fault request visible).
        if self.shared.faults.take_fatal() {
            self.enter_fatal("injected fault");
            return true;
        }
        let Some(cq) = self.cqs[cqid as usize].as_ref() else {
            return false;
        };
        let n = pending.min(cq.fetch_budget()).min(limit);
        if n == 0 {
            // Waiting for the host to consume completions.
            return false;
        }
        // Fetch: at most two reads (the batch may wrap around the ring end).
        let (base, entries, head) = (sq.base, sq.entries, sq.head);
        let first = n.min(entries - head) as usize;
        let rest = n as usize - first;
        let n = n as usize;
        let fetched = self
            .cache
            .read(
                base + head as u64 * SQE as u64,
                &mut self.sqe_buf[..first * SQE],
            )
            .and_then(|()| {
                if rest > 0 {
                    self.cache
                        .read(base, &mut self.sqe_buf[first * SQE..n * SQE])
                } else {
                    Ok(())
                }
            });
        if let Err(e) = fetched {
            tracing::warn!(qid, error = %e, "submission queue fetch failed");
            self.enter_fatal("DMA error fetching from a submission queue");
            return true;
        }
        self.sqs[qid as usize]
            .as_mut()
            .expect("checked")
            .advance(n as u32);
        self.cqs[cqid as usize].as_mut().expect("checked").owed += n as u32;
        let counter = if qid == 0 {
            &self.shared.counters.admin_commands
        } else {
            &self.shared.counters.io_commands
        };
        Counters::add(counter, n as u64);

        let mut batch = std::mem::take(&mut self.batch);
        for i in 0..n {
            let cmd = Command::read_from_bytes(&self.sqe_buf[i * SQE..(i + 1) * SQE])
                .expect("an SQE is 64 bytes");
            let cid = cmd.cdw0.cid();
            let result = if qid == 0 {
                self.admin(&cmd)
            } else {
                self.io(&cmd)
            };
            let (dw0, status) = match result {
                Ok(Outcome::Done(dw0)) => (dw0, 0),
                Ok(Outcome::Deferred) => {
                    if let Some(cq) = self.cqs[cqid as usize].as_mut() {
                        cq.owed -= 1;
                    }
                    continue;
                }
                Err(fail) => (0, self.log_error(qid, &cmd, fail)),
            };
            let pc = PendingCompletion {
                sqid: qid,
                cid,
                dw0,
                status,
            };
            if qid != 0 && self.divert_io_completion(cqid, pc) {
                continue;
            }
            batch.push((cqid, pc));
        }
        if self.config.reorder_completions {
            batch.reverse();
        }
        for (cqid, pc) in batch.drain(..) {
            if self.state != State::Enabled {
                break;
            }
            self.finish(cqid, pc);
        }
        self.batch = batch;
        // The batch's completions are written: regions deferring writes perform them now.
        if self.cache.has_unflushed() {
            self.flush_regions();
        }
        true
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
            Counters::add(&self.shared.counters.completions_dropped, 1);
            return true;
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
    fn finish(&mut self, cqid: u16, pc: PendingCompletion) {
        if let Some(cq) = self.cqs[cqid as usize].as_mut() {
            cq.owed = cq.owed.saturating_sub(1);
        }
        self.complete(cqid, pc);
    }

    /// Posts a completion, or holds it if the queue is full.
    fn complete(&mut self, cqid: u16, pc: PendingCompletion) {
        let Some(cq) = self.cqs[cqid as usize].as_mut() else {
            return;
        };
        if !cq.held.is_empty() || cq.free() == 0 {
            cq.held.push_back(pc);
            Counters::add(&self.shared.counters.cq_full_waits, 1);
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
        if let Err(e) = self.cache.write_last_dword_release(addr, entry.as_bytes()) {
            tracing::warn!(cqid, error = %e, "completion queue write failed");
            self.enter_fatal("DMA error writing a completion queue entry");
            return;
        }
        Counters::add(&self.shared.counters.completions_posted, 1);
    }

    /// Records a failed command in the Error Information log and returns the status field to
    /// post (with More set: the log has an entry for it).
    fn log_error(&mut self, sqid: u16, cmd: &Command, fail: Fail) -> u16 {
        Counters::add(&self.shared.counters.errors, 1);
        if fail.status.sct == StatusCodeType::MEDIA_AND_DATA_INTEGRITY {
            self.smart.media_errors += 1;
        }
        let status = CqeStatus::from_status(fail.status.with_more(true), false);
        let mut entry = ErrorInformationLogEntry::new_zeroed();
        entry.sqid = sqid;
        entry.cid = cmd.cdw0.cid();
        entry.status = status.into_bits();
        entry.parameter_error_location = fail.pel;
        entry.lba = fail.lba;
        entry.nsid = cmd.nsid;
        self.push_error_entry(entry);
        status.into_bits()
    }

    fn push_error_entry(&mut self, mut entry: ErrorInformationLogEntry) {
        self.error_count += 1;
        entry.error_count = self.error_count;
        if self.error_log.len() == self.config.error_log_entries as usize {
            self.error_log.pop_back();
        }
        self.error_log.push_front(entry);
    }

    /// A refused or invalid doorbell write: an Error Information log entry (SQID and CID
    /// 0xffff, as for errors not tied to a command; Command Specific Information holds the
    /// queue id in bits 15:0, 1 in bit 16 for an SQ tail doorbell, and the value written in
    /// bits 63:32) and an Error status asynchronous event.
    fn doorbell_error(&mut self, e: DoorbellError) {
        let mut entry = ErrorInformationLogEntry::new_zeroed();
        entry.sqid = 0xffff;
        entry.cid = 0xffff;
        entry.parameter_error_location = 0xffff;
        entry.csi = e.qid as u64 | ((e.is_sq as u64) << 16) | ((e.value as u64) << 32);
        self.push_error_entry(entry);
        let info = match e.kind {
            DoorbellErrorKind::InvalidRegister => 0x00,
            DoorbellErrorKind::InvalidValue => 0x01,
        };
        // Asynchronous event: type 0 (Error status), the info code, log page 01h.
        self.raise_event(info << 8 | 0x01 << 16);
    }

    /// A doorbell value the controller itself found invalid (an external word's value, or a
    /// CQ head that passes entries not yet posted): counted, logged and reported as a
    /// refused register-window write is. The value is ignored.
    pub(crate) fn invalid_doorbell_value(&mut self, qid: u16, is_sq: bool, value: u32) {
        Counters::add(&self.shared.counters.invalid_doorbell_values, 1);
        self.doorbell_error(DoorbellError {
            kind: DoorbellErrorKind::InvalidValue,
            qid,
            is_sq,
            value,
        });
    }

    fn raise_event(&mut self, dw0: u32) {
        if self.events.pending.len() < EVENT_BACKLOG {
            self.events.pending.push_back(dw0);
        }
        self.deliver_events();
    }

    /// Completes outstanding Asynchronous Event Requests with pending, unmasked events.
    fn deliver_events(&mut self) {
        while !self.events.error_masked
            && !self.events.outstanding.is_empty()
            && let Some(dw0) = self.events.pending.pop_front()
        {
            let cid = self.events.outstanding.remove(0);
            // Every event this controller raises is of type Error status.
            self.events.error_masked = true;
            self.complete(
                0,
                PendingCompletion {
                    sqid: 0,
                    cid,
                    dw0,
                    status: 0,
                },
            );
        }
    }

    /// The namespace `nsid` names, if active.
    fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.namespaces.get((nsid as usize).checked_sub(1)?)
    }

    /// Walks a command's PRPs for a transfer of `len` bytes into `self.segments`.
    fn walk_prps(&mut self, cmd: &Command, len: u64) -> Result<(), Fail> {
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

    /// Checks the parts of Command Dword 0 every command shares: no fused operation, PRPs.
    fn check_cdw0(cmd: &Command) -> Result<(), Fail> {
        if cmd.cdw0.fuse() != 0 {
            return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(1));
        }
        if cmd.cdw0.psdt() != 0 {
            return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(1 | 6 << 8));
        }
        Ok(())
    }

    /// Transfers `data` to the host through the command's PRPs (walked for `data.len()`).
    fn send(&mut self, cmd: &Command, data: &[u8]) -> Result<(), Fail> {
        self.walk_prps(cmd, data.len() as u64)?;
        crate::prp::copy_to_host(&mut self.cache, &self.segments, data)
            .map_err(|_| Fail::data_transfer())
    }
}
