//! The controller threads: the enable/reset state machine, doorbell polling, command fetch,
//! completion posting, asynchronous events and the error log.
//!
//! # Threads
//! The controller runs `n` threads ([`crate::EmuConfig::controller_threads`]), numbered
//! `0..n` ([`controller_thread_index`]). Each owns a [`worker::Worker`]: the queues it serves, its
//! translation cache, its delayed and dropped completions and its scratch space, touched by no
//! other thread. Thread 0 is also the [`Controller`]: it samples CC, runs the admin queue
//! (whose queues its core holds), keeps the features and the asynchronous events, and turns
//! refused register-window doorbell writes into error reports.
//!
//! An I/O completion queue, and every submission queue posting to it, belongs to thread
//! `(cqid - 1) % n` ([`thread_for_cq`]), so one thread writes a command's data and then its
//! completion entry, and flushes them in that order. Admin commands hand queues to the owning
//! thread and take them back through its mailbox ([`handoff`]), and wait for the answer:
//! Create returns once the owner serves the queue, Delete once the owner no longer touches it
//! (after it has posted the completions that the deletion owes), a reset (CC.EN 1 to 0) once
//! every thread dropped its queues, before CSTS.RDY clears.
//!
//! State the threads share is in [`Shared`]: the register window, the device-address map,
//! fault knobs, one set of counters per thread (written by that thread only), the Error
//! Information log (a mutex, taken on failures only), the Controller Fatal flag, and an inbox
//! of asynchronous events that threads other than 0 raise (external doorbell errors) for
//! thread 0 to report.
//!
//! # A pass
//! Each pass a thread takes a mailbox request if one is waiting, then CQ head doorbells, due
//! delayed completions and up to [`BATCH`] commands from each of its submission queues in turn
//! (the starting queue rotates, so no queue starves another); thread 0 first samples CC and
//! serves the admin queue. A queue is fetched from only as far as its completion queue has
//! room for the results, so completions never overwrite entries the host has not consumed; a
//! completion that still finds its queue full (an Abort of a dropped command, an asynchronous
//! event) is held until the host moves the CQ head.
//!
//! Queues created while their id had external doorbells attached ([`crate::DoorbellWord`])
//! take their SQ tail or CQ head from those words, validated as register-window doorbell writes
//! are, and fetch up to `EmuConfig::external_batch` commands per pass.
//!
//! Before executing a batch of I/O commands a thread announces the reads it will make
//! ([`crate::MemoryRegion::prefetch`]): the PRP list pages of the batch's Read and Write
//! commands, then the data of its Write commands.
//!
//! Writes go through regions that may defer them ([`crate::MemoryRegion::flush`]): every
//! region a thread wrote through is flushed at the end of each submission queue's batch (after
//! its completions are written) and at the end of every pass, so nothing stays staged while the
//! thread is idle. A failed flush is controller fatal.
//!
//! When there is nothing to do a thread spins briefly, then parks for at most [`PARK_MAX`];
//! writes to CC wake thread 0, doorbell writes wake the queue's thread. While a thread serves a
//! queue with external doorbells nothing can unpark it (a GPU's write to a word raises no
//! wakeup), so it keeps polling instead, yielding its CPU now and then.

mod admin;
mod forwarding;
pub(crate) mod handoff;
mod nvm;
pub(crate) mod pages;
mod prefetch;
pub(crate) mod worker;

use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use nvme_spec::log::ErrorInformationLogEntry;
use nvme_spec::status::generic;
use nvme_spec::{Aqa, Cc, Command, Csts, Status};
use zerocopy::FromZeros;

use self::handoff::{Mailbox, Request};
use self::worker::{Fetch, Idle, Worker};
use crate::config::EmuConfig;
use crate::doorbells::ExternalDoorbells;
use crate::faults::Faults;
use crate::memory::DeviceAddressMap;
use crate::prp::PAGE;
use crate::queue_server::QueueServer;
use crate::queues::PendingCompletion;
use crate::registers::{DoorbellError, DoorbellErrorKind, RegisterWindow};
use crate::stats::Counters;
use crate::storage::Namespace;

/// Most commands fetched from one submission queue with register-window doorbells per pass
/// (queues with external doorbells use `EmuConfig::external_batch`).
pub(crate) const BATCH: u32 = 64;
/// Longest an idle thread parks before looking at its registers again.
pub(crate) const PARK_MAX: Duration = Duration::from_millis(1);
/// Asynchronous events queued while none can be reported; later ones are lost.
const EVENT_BACKLOG: usize = 16;

thread_local! {
    /// This thread's index among its controller's threads, if it is a controller thread.
    static THREAD_INDEX: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The index of the calling thread among its software controller's threads: `Some(i)` on
/// controller thread `i` (`0 <= i <` [`crate::EmuDevice::controller_threads`]), `None` on any
/// other thread.
///
/// Every call a controller thread makes into a [`crate::MemoryRegion`] is made on such a
/// thread, with the same index for the thread's whole life, so a region can pick per-thread
/// resources (a copy engine with its own staging area and stream) by it.
pub fn controller_thread_index() -> Option<usize> {
    THREAD_INDEX.with(Cell::get)
}

/// The controller thread that serves I/O completion queue `cqid` (and every submission queue
/// posting to it) among `threads` threads; the admin queues (0) belong to thread 0.
pub(crate) fn thread_for_cq(cqid: u16, threads: usize) -> usize {
    match cqid {
        0 => 0,
        q => (q as usize - 1) % threads.max(1),
    }
}

/// The Error Information log (newest first) and the count of errors ever logged.
pub(crate) struct ErrorLog {
    pub(crate) entries: VecDeque<ErrorInformationLogEntry>,
    capacity: usize,
    pub(crate) count: u64,
}

impl ErrorLog {
    fn push(&mut self, mut entry: ErrorInformationLogEntry) {
        self.count += 1;
        entry.error_count = self.count;
        if self.entries.len() == self.capacity {
            self.entries.pop_back();
        }
        self.entries.push_front(entry);
    }
}

/// State shared by the controller threads and the [`crate::EmuDevice`] handle.
pub(crate) struct Shared {
    pub(crate) regs: Arc<RegisterWindow>,
    pub(crate) map: Arc<DeviceAddressMap>,
    pub(crate) faults: Faults,
    /// One set per controller thread, written by that thread only.
    pub(crate) counters: Box<[Counters]>,
    /// Set to make every thread exit (the device is stopping, or a thread panicked).
    pub(crate) stop: AtomicBool,
    /// External doorbell attachments and which of their queues exist.
    pub(crate) doorbells: ExternalDoorbells,
    /// The controller is in Controller Fatal Status: no thread fetches or completes commands.
    /// Any thread sets it; thread 0 clears it when it resets the controller.
    pub(crate) fatal: AtomicBool,
    pub(crate) error_log: Mutex<ErrorLog>,
    /// Asynchronous events (completion Dword 0) raised by any thread, for thread 0 to report.
    events: Mutex<Vec<u32>>,
    events_waiting: AtomicBool,
    /// The Volatile Write Cache feature (thread 0 sets it, writes on any thread read it).
    pub(crate) volatile_write_cache: AtomicBool,
    /// Thread `i`'s mailbox (index 0 is unused: thread 0 is the one that sends).
    pub(crate) mailboxes: Box<[Mailbox]>,
    /// Where I/O queues created from now on go instead of the controller threads.
    pub(crate) queue_server: RwLock<Option<Arc<dyn QueueServer>>>,
}

impl Shared {
    /// The installed queue server, if any.
    pub(crate) fn queue_server(&self) -> Option<Arc<dyn QueueServer>> {
        self.queue_server
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn new(
        regs: Arc<RegisterWindow>,
        threads: usize,
        max_qid: u16,
        error_log_entries: usize,
    ) -> Self {
        Self {
            map: Arc::new(DeviceAddressMap::new()),
            faults: Faults::new(regs.clone()),
            regs,
            counters: (0..threads).map(|_| Counters::default()).collect(),
            stop: AtomicBool::new(false),
            doorbells: ExternalDoorbells::new(max_qid),
            fatal: AtomicBool::new(false),
            error_log: Mutex::new(ErrorLog {
                entries: VecDeque::with_capacity(error_log_entries),
                capacity: error_log_entries,
                count: 0,
            }),
            events: Mutex::new(Vec::new()),
            events_waiting: AtomicBool::new(false),
            volatile_write_cache: AtomicBool::new(true),
            mailboxes: (0..threads).map(|_| Mailbox::default()).collect(),
            queue_server: RwLock::new(None),
        }
    }

    /// Number of controller threads.
    pub(crate) fn threads(&self) -> usize {
        self.counters.len()
    }

    /// Whether the controller is in Controller Fatal Status.
    pub(crate) fn is_fatal(&self) -> bool {
        self.fatal.load(Ordering::Acquire)
    }

    /// Enters Controller Fatal Status (from thread `thread`); counted once per entry.
    pub(crate) fn enter_fatal(&self, thread: usize, why: &str) {
        if !self.fatal.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                reason = why,
                thread,
                "software NVMe controller: controller fatal status"
            );
            Counters::add(&self.counters[thread].fatal_errors, 1);
        }
        self.regs.csts_set(u32::from(Csts::new().with_cfs(true)));
    }

    /// Adds an entry to the Error Information log.
    pub(crate) fn log_error_entry(&self, entry: ErrorInformationLogEntry) {
        self.error_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(entry);
    }

    /// Queues an asynchronous event for thread 0 to report, and wakes it.
    pub(crate) fn post_event(&self, dw0: u32) {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(dw0);
        self.events_waiting.store(true, Ordering::Release);
        self.regs.wake();
    }

    /// Takes the events queued by [`Shared::post_event`], oldest first.
    fn take_events(&self, out: &mut Vec<u32>) -> bool {
        if !self.events_waiting.load(Ordering::Acquire) {
            return false;
        }
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        self.events_waiting.store(false, Ordering::Release);
        out.append(&mut events);
        true
    }

    /// A thread died of a panic (a bug, never device input): the controller is fatal for
    /// good and every thread stops, so the driver sees a dead device rather than waiting.
    fn halt(&self) {
        self.regs.csts_set(u32::from(Csts::new().with_cfs(true)));
        self.stop.store(true, Ordering::Release);
        self.regs.wake_all();
    }
}

/// Records a doorbell error (a refused register-window write, or an invalid value the
/// controller found): an Error Information log entry (SQID and CID 0xffff, as for errors not
/// tied to a command; Command Specific Information holds the queue id in bits 15:0, 1 in bit
/// 16 for an SQ tail doorbell, and the value written in bits 63:32). Returns the Error status
/// asynchronous event to raise.
pub(crate) fn log_doorbell_error(shared: &Shared, e: DoorbellError) -> u32 {
    let mut entry = ErrorInformationLogEntry::new_zeroed();
    entry.sqid = 0xffff;
    entry.cid = 0xffff;
    entry.parameter_error_location = 0xffff;
    entry.csi = e.qid as u64 | ((e.is_sq as u64) << 16) | ((e.value as u64) << 32);
    shared.log_error_entry(entry);
    let info = match e.kind {
        DoorbellErrorKind::InvalidRegister => 0x00,
        DoorbellErrorKind::InvalidValue => 0x01,
    };
    // Asynchronous event: type 0 (Error status), the info code, log page 01h.
    info << 8 | 0x01 << 16
}

/// Runs `body` as controller thread `index`: sets the thread's index, and halts the whole
/// controller if `body` panics.
pub(crate) fn run_thread(shared: Arc<Shared>, index: usize, body: impl FnOnce()) {
    THREAD_INDEX.with(|c| c.set(Some(index)));
    if catch_unwind(AssertUnwindSafe(body)).is_err() {
        tracing::error!(
            thread = index,
            "software NVMe controller thread panicked; controller is fatal"
        );
        shared.halt();
    }
}

/// Where the controller is in its life cycle (thread 0's view).
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
    /// Sent on to namespace index `ns`'s far controller with `tag`; completes when it answers
    /// (a read of `read_len` bytes lands then).
    Forwarded {
        tag: u64,
        ns: usize,
        read_len: Option<usize>,
    },
}

/// Result of executing one command.
pub(crate) type CmdResult = Result<Outcome, Fail>;

/// Checks the parts of Command Dword 0 every command shares: no fused operation, PRPs.
pub(crate) fn check_cdw0(cmd: &Command) -> Result<(), Fail> {
    if cmd.cdw0.fuse() != 0 {
        return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(1));
    }
    if cmd.cdw0.psdt() != 0 {
        return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(1 | 6 << 8));
    }
    Ok(())
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

/// The I/O queues that exist, on every thread, as the admin side tracks them.
#[derive(Debug)]
struct Directory {
    /// Per submission queue id: the completion queue it posts to, if it exists.
    sq_cq: Vec<Option<u16>>,
    /// Per completion queue id: the number of submission queues posting to it, if it exists.
    cq_sqs: Vec<Option<u32>>,
    /// Per queue id: completion queue `qid` (and every submission queue posting to it) is
    /// served by the [`QueueServer`] rather than by a controller thread.
    served: Vec<bool>,
    io_sqs: usize,
    io_cqs: usize,
}

impl Directory {
    fn new(max_qid: u16) -> Self {
        Self {
            sq_cq: vec![None; max_qid as usize + 1],
            cq_sqs: vec![None; max_qid as usize + 1],
            served: vec![false; max_qid as usize + 1],
            io_sqs: 0,
            io_cqs: 0,
        }
    }

    fn clear(&mut self) {
        self.sq_cq.fill(None);
        self.cq_sqs.fill(None);
        self.served.fill(false);
        self.io_sqs = 0;
        self.io_cqs = 0;
    }

    fn cq_exists(&self, qid: u16) -> bool {
        self.cq_sqs.get(qid as usize).is_some_and(Option::is_some)
    }

    fn sq_cq(&self, qid: u16) -> Option<u16> {
        self.sq_cq.get(qid as usize).copied().flatten()
    }

    fn is_served(&self, cqid: u16) -> bool {
        self.served.get(cqid as usize).copied().unwrap_or(false)
    }
}

/// Thread 0: the register state machine, the admin command set and the asynchronous events,
/// plus its own [`Worker`] (the admin queues and its share of the I/O queues).
pub(crate) struct Controller {
    shared: Arc<Shared>,
    config: EmuConfig,
    namespaces: Arc<[Namespace]>,
    core: Worker,
    state: State,
    shutdown_done: bool,
    features: Features,
    events: Events,
    queues: Directory,
    doorbell_errors_seen: u64,
    started: Instant,
    event_scratch: Vec<u32>,
}

impl Controller {
    /// Builds thread 0 for a validated configuration with opened namespaces.
    pub(crate) fn new(
        shared: Arc<Shared>,
        config: EmuConfig,
        namespaces: Arc<[Namespace]>,
    ) -> Self {
        Self {
            core: Worker::new(0, shared.clone(), &config, namespaces.clone()),
            shared,
            namespaces,
            state: State::Disabled,
            shutdown_done: false,
            features: Features::defaults(config.max_io_queue_pairs),
            events: Events::default(),
            queues: Directory::new(config.max_io_queue_pairs),
            doorbell_errors_seen: 0,
            started: Instant::now(),
            event_scratch: Vec::new(),
            config,
        }
    }

    /// The thread body: runs until asked to stop.
    pub(crate) fn run(mut self) {
        let shared = self.shared.clone();
        run_thread(shared, 0, || self.run_loop());
    }

    fn run_loop(&mut self) {
        let mut idle = Idle::default();
        while !self.shared.stop.load(Ordering::Acquire) {
            if self.pass() {
                idle.worked();
                continue;
            }
            let polls = self.state == State::Enabled && self.core.polls_external_doorbells();
            idle.wait(&mut self.core, polls);
        }
    }

    /// One pass over registers and queues, then a flush of every region written through;
    /// returns whether anything happened.
    fn pass(&mut self) -> bool {
        let worked = self.serve();
        if self.core.cache.has_unflushed() {
            let enabled = self.state == State::Enabled;
            self.core.flush_regions(enabled);
        }
        worked
    }

    /// The body of [`Controller::pass`]: CC, doorbell errors and events, then the core's
    /// queues with the admin queue first.
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
        if self.state == State::Enabled && self.shared.is_fatal() {
            // Another thread entered Controller Fatal Status.
            self.state = State::Fatal;
        }
        if self.shared.faults.fatal_pending() {
            // Enter the fatal state before taking the request, so that a thread that finds no
            // request pending finds the fatal state instead.
            if self.state != State::Disabled {
                self.enter_fatal("injected fault");
            }
            self.shared.faults.take_fatal();
            if self.state == State::Disabled {
                self.shared
                    .regs
                    .csts_clear(u32::from(Csts::new().with_cfs(true)));
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
        worked |= self.take_events();
        worked |= self.core.update_cq_heads();
        worked |= self.core.post_due_delayed();
        worked |= self.service_admin();
        worked |= self.core.service_io_queues();
        if self.core.fwd.in_flight() > 0 {
            worked |= self.core.poll_forwarded(std::time::Duration::ZERO);
        }
        worked |= self.take_events();
        worked
    }

    /// Fetches and executes a batch of admin commands.
    fn service_admin(&mut self) -> bool {
        let (n, cqid) = match self.core.fetch(0) {
            Fetch::Idle => return false,
            Fetch::Handled => return true,
            Fetch::Batch { n, cqid } => (n, cqid),
        };
        for i in 0..n {
            let cmd = self.core.sqe(i);
            let result = self.admin(&cmd);
            self.core.conclude(0, cqid, &cmd, result);
        }
        self.core.post_batch();
        true
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
        self.core.install_admin(asq, sq_entries, acq, cq_entries);
        regs.set_queue(0, true, sq_entries, 0);
        regs.set_queue(0, false, cq_entries, 0);
        // Enabling is a fresh start after any earlier shutdown.
        if cc.shn() == 0 {
            self.shutdown_done = false;
            regs.set_shst(Csts::SHST_NORMAL);
        }
        self.state = State::Enabled;
        regs.csts_set(u32::from(Csts::new().with_rdy(true)));
    }

    /// CC.EN 1 to 0: a controller reset. Every thread deletes its queues and forgets its
    /// outstanding commands (their completions are never posted, as on hardware), before
    /// CSTS.RDY and CSTS.CFS clear; feature defaults return and CSTS.SHST clears. Media, the
    /// error log and SMART counters survive.
    fn reset(&mut self) {
        for worker in 1..self.shared.threads() {
            handoff::call(&self.shared, worker, Request::Reset);
        }
        self.core.reset();
        if let Some(server) = self.shared.queue_server() {
            server.reset();
        }
        let regs = self.shared.regs.clone();
        regs.reset_queues();
        self.shared.doorbells.reset();
        self.queues.clear();
        self.events = Events::default();
        self.features = Features::defaults(self.config.max_io_queue_pairs);
        self.shared
            .volatile_write_cache
            .store(true, Ordering::Release);
        self.shutdown_done = false;
        self.state = State::Disabled;
        while regs.pop_doorbell_error().is_some() {}
        self.doorbell_errors_seen = regs.doorbell_error_count();
        // Events raised before the reset are not reported after it.
        self.event_scratch.clear();
        self.shared.take_events(&mut self.event_scratch);
        self.event_scratch.clear();
        self.shared.fatal.store(false, Ordering::Release);
        regs.csts_clear(u32::from(Csts::new().with_rdy(true).with_cfs(true)));
        regs.set_shst(Csts::SHST_NORMAL);
        Counters::add(&self.shared.counters[0].resets, 1);
    }

    /// CC.SHN set: makes every namespace durable and reports shutdown complete.
    fn shutdown(&mut self) {
        let regs = self.shared.regs.clone();
        regs.set_shst(Csts::SHST_OCCURRING);
        if let Some(server) = self.shared.queue_server() {
            server.shutdown();
        }
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
        self.state = State::Fatal;
        self.shared.enter_fatal(0, why);
    }

    /// Hands a request to the thread that serves the queue (thread 0's own core directly) and
    /// returns its answer once it has acted.
    fn give(&mut self, thread: usize, request: Request) -> bool {
        if thread == 0 {
            self.core.handle(request)
        } else {
            handoff::call(&self.shared, thread, request)
        }
    }

    /// The thread serving completion queue `cqid`.
    fn owner(&self, cqid: u16) -> usize {
        thread_for_cq(cqid, self.shared.threads())
    }

    /// A refused register-window doorbell write: logged, and an Error status event.
    fn doorbell_error(&mut self, e: DoorbellError) {
        let event = log_doorbell_error(&self.shared, e);
        self.raise_event(event);
    }

    /// A doorbell value found invalid on thread 0 (a stale external word at queue creation):
    /// counted, logged and reported as a refused register-window write is. The value is
    /// ignored.
    fn invalid_doorbell_value(&mut self, qid: u16, is_sq: bool, value: u32) {
        Counters::add(&self.shared.counters[0].invalid_doorbell_values, 1);
        self.doorbell_error(DoorbellError {
            kind: DoorbellErrorKind::InvalidValue,
            qid,
            is_sq,
            value,
        });
    }

    /// Takes the events other threads raised; returns whether there were any.
    fn take_events(&mut self) -> bool {
        let mut events = std::mem::take(&mut self.event_scratch);
        let any = self.shared.take_events(&mut events);
        for dw0 in events.drain(..) {
            self.raise_event(dw0);
        }
        self.event_scratch = events;
        any
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
            self.core.complete(
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_assignment() {
        assert_eq!(thread_for_cq(0, 4), 0);
        let owners: Vec<usize> = (1..=9).map(|q| thread_for_cq(q, 4)).collect();
        assert_eq!(owners, [0, 1, 2, 3, 0, 1, 2, 3, 0]);
        assert!((1..100).all(|q| thread_for_cq(q, 1) == 0));
        assert_eq!(controller_thread_index(), None);
    }
}
