//! [`CpuQueue`]: the queue protocol of the device header (`ptx/include/gpunvme.cuh`) transliterated to
//! Rust for CPU threads, so that the protocol itself is tested on machines with no GPU, against
//! the software controller and, through VFIO, against QEMU's NVMe controller.
//!
//! The point is the same algorithm run against controllers other than our own. The queue pair
//! is created with [`nvme::Controller::create_queue_pair_on`] on rings this module allocates
//! (the driver never allocated them for an [`nvme::IoQueuePair`]), and from then on the
//! functions below drive them as GPU threads would. Each one has the header's name and body:
//! - the ring layout: `depth` SQ and CQ entries, `depth` a power of two, command id = slot =
//!   `ticket & (depth - 1)`, SQEs written field by field at the [`nvme_spec::wire`] offsets;
//! - slot reservation ([`CpuQueue::reserve`]): one relaxed `fetch_add` on the ticket counter,
//!   then a bounded wait until the slot's `released` word names the ticket;
//!   [`CpuQueue::reserve_many`] is the warp variant: n consecutive tickets with ONE atomic;
//! - submission ([`CpuQueue::fill_slot`]): the SQE, then a Release store of the slot's ticket;
//! - doorbell coalescing ([`CpuQueue::try_publish`]): a try-lock holder loads the tickets of
//!   consecutive slots, never more than `depth - 1` past the completions consumed, issues one
//!   AcqRel fence (the acquire of those SQEs and their release) and ONE tail doorbell write;
//! - completion ([`CpuQueue::try_reap`]): a try-lock holder drains the CQ in ring order, loads
//!   the dword with the phase tag first (Acquire), then the rest; a CID that names no slot in
//!   flight fails the queue ([`ClientError::BadCompletion`]); it stores `DONE_BIT | status` in
//!   the slot (Release) and rings the CQ head doorbell once per drain, with no fence before it
//!   (every read of the entries was an Acquire load);
//! - release ([`CpuQueue::complete`]): the waiter reads its status, clears `done` and stores
//!   `released = ticket + depth`;
//! - bounds: every wait has a deadline and watches an abort word ([`CpuQueue::abort`], the
//!   header's `host_flags`); a timeout, an abort or a bad completion fails the queue, and every
//!   later call returns [`ClientError::QueueFailed`] at once.
//!
//! Deadlock rule (the header's): a thread holds at most one ticket at a time, or one batch of
//! consecutive tickets taken with one atomic ([`CpuQueue::reserve_many`], at most `depth`), as
//! a warp does. Ticket t waits only on tickets below it, so the wait-for graph has no cycle.
//!
//! # Translation table
//! | header (CUDA) | here |
//! |---|---|
//! | `cuda::atomic_ref<uint32_t, scope>` + `memory_order_X` | `AtomicU32` + `Ordering::X` |
//! | `queue_state`, `slot_state` in GPU memory | the same layout in host atomics (tested) |
//! | `fence.acq_rel.sys` + `st.mmio` doorbell | `fence(AcqRel)` + BAR0 `RegisterIo::write_u32` |
//! | `%globaltimer`, `__nanosleep` | `Instant`, spin / yield / short sleep |
//! | `slot_buffers_bus + s * bytes + k * 4096` | the device address of that page of host DMA memory |
//! | one lane per ticket of a warp | one thread plays every lane of its batch |
//!
//! Device addresses are taken per 4 KiB page, which equals the header's arithmetic on
//! contiguous memory (IOMMU mappings, the software controller) and stays right where pages are
//! not contiguous (VFIO without an IOMMU). Transfers longer than one slot buffer
//! ([`CpuQueue::write_range`], [`CpuQueue::read_range`]) are split as the header's `rw_warp`
//! splits them, one piece per ticket of a batch, but through the slot buffers and their
//! pre-built PRP lists rather than `build_prps` on caller memory (which would overwrite a
//! slot's pre-built list). [`CpuQueue::complete`] is split into [`CpuQueue::wait_done`] and
//! [`CpuQueue::release`] so that a read's data can be taken out of the slot buffer before the
//! slot goes to its next owner, as the header's perf kernel does inline.
//! [`CpuQueue::completions_out_of_order`] counts completions that did not arrive in ticket
//! order: proof that matching by command id was exercised.
//!
//! [`run_stress`] drives several such queues from several threads each (half of them with the
//! batch variant), writing and reading back LBA-stamped data ([`crate::pattern`], the same
//! function as the header's `pattern_word`) and checking every byte; `gpunvme protocol-check`
//! runs it.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use nvme::nvme_spec::wire::{
    CQE_DW0, CQE_SIZE, CQE_STATUS_DWORD, SQE_CDW0, SQE_CDW2, SQE_CDW3, SQE_CDW10, SQE_CDW11,
    SQE_CDW12, SQE_CDW13, SQE_CDW14, SQE_CDW15, SQE_MPTR, SQE_NSID, SQE_PRP1, SQE_PRP2, SQE_SIZE,
};
use nvme::nvme_spec::{CqeStatus, Status};
use nvme::{Controller, CreatedQueuePair, Device, DmaMemory, QueueRegions};

use crate::desc::{DONE_BIT, DeviceStatus, HOST_ABORT, IoReq, QueueState, SlotState};
use crate::error::GpuError;

mod stress;
pub use stress::{QueueReport, StressConfig, StressReport, run_stress};

/// Whether a command's completion dword 0 means anything (the header's `wants_dw0`): not for
/// Flush, Write, Read and Write Zeroes, whose completions are reaped without reading it.
pub fn wants_dw0(opcode: u8) -> bool {
    !matches!(opcode, OPC_FLUSH | OPC_WRITE | OPC_READ | OPC_WRITE_ZEROES)
}

/// NVM opcode Flush (the header's `OPC_FLUSH`).
pub const OPC_FLUSH: u8 = 0x00;
/// NVM opcode Write (`OPC_WRITE`).
pub const OPC_WRITE: u8 = 0x01;
/// NVM opcode Read (`OPC_READ`).
pub const OPC_READ: u8 = 0x02;
/// NVM opcode Write Zeroes (`OPC_WRITE_ZEROES`).
pub const OPC_WRITE_ZEROES: u8 = 0x08;

/// The header's `GPUNVME_PAGE_SIZE`.
const PAGE: usize = 4096;
/// Ticks between two looks at the abort word and the clock (the header's `GPUNVME_ABORT_POLL`,
/// smaller because a CPU tick yields or sleeps).
const ABORT_POLL: u32 = 16;
/// Ticks spent spinning, then yielding, before a waiter starts sleeping between polls.
const SPIN_TICKS: u32 = 16;
const YIELD_TICKS: u32 = 256;
/// Sleep between polls of a long wait (the header's `__nanosleep`, at CPU scale).
const WAIT_SLEEP: Duration = Duration::from_micros(20);
/// Largest slot buffer chosen by default.
const DEFAULT_SLOT_BUFFER_MAX: usize = 64 << 10;

/// Why a protocol operation failed (the header's `GPUNVME_*` statuses other than `OK`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// A bounded wait ran out (`GPUNVME_TIMEOUT`); the queue is failed from now on.
    #[error("queue {qid}: a wait did not end within {timeout:?} (GPUNVME_TIMEOUT)")]
    Timeout {
        /// Queue id.
        qid: u16,
        /// The bound.
        timeout: Duration,
    },
    /// The host set the abort word (`GPUNVME_ABORTED`); the queue is failed from now on.
    #[error("queue {qid}: aborted by the host (GPUNVME_ABORTED)")]
    Aborted {
        /// Queue id.
        qid: u16,
    },
    /// The queue failed earlier and takes no commands (`GPUNVME_QUEUE_FAILED`).
    #[error("queue {qid} failed earlier ({why}) and takes no commands (GPUNVME_QUEUE_FAILED)")]
    QueueFailed {
        /// Queue id.
        qid: u16,
        /// What failed it.
        why: DeviceStatus,
    },
    /// The controller posted a completion whose command id names no command in flight
    /// (`GPUNVME_BAD_COMPLETION`); the queue is failed from now on.
    #[error(
        "queue {qid}: completion with command id {cid:#x} for no command in flight \
         (GPUNVME_BAD_COMPLETION)"
    )]
    BadCompletion {
        /// Queue id.
        qid: u16,
        /// The command id the controller posted.
        cid: u16,
    },
    /// The controller completed the command with an error status (`GPUNVME_NVME_ERROR`).
    #[error("queue {qid} cid {cid}: {status}")]
    Nvme {
        /// Queue id.
        qid: u16,
        /// Command id (= slot).
        cid: u16,
        /// The decoded status.
        status: Status,
        /// The CQE status field with the phase tag cleared (SC in 8:1, SCT in 11:9).
        status_field: u16,
    },
    /// A request this queue cannot carry (`GPUNVME_INVALID_ARGUMENT`); nothing was issued.
    #[error("invalid argument: {0} (GPUNVME_INVALID_ARGUMENT)")]
    InvalidArgument(String),
}

impl ClientError {
    /// The header's status code for this error.
    pub fn device_status(&self) -> DeviceStatus {
        match self {
            Self::Timeout { .. } => DeviceStatus::Timeout,
            Self::Aborted { .. } => DeviceStatus::Aborted,
            Self::QueueFailed { .. } => DeviceStatus::QueueFailed,
            Self::BadCompletion { .. } => DeviceStatus::BadCompletion,
            Self::Nvme { .. } => DeviceStatus::NvmeError,
            Self::InvalidArgument(_) => DeviceStatus::InvalidArgument,
        }
    }

    /// Whether the queue is unusable after this error (everything but an NVMe status and an
    /// invalid argument).
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Self::Nvme { .. } | Self::InvalidArgument(_))
    }
}

/// `gpunvme::queue_state` as host atomics, at the header's offsets (checked by a test).
#[repr(C, align(128))]
#[derive(Default)]
struct HostQueueState {
    ticket: AtomicU32,
    _pad0: [u32; 7],
    sq_published: AtomicU32,
    sq_lock: AtomicU32,
    _pad1: [u32; 6],
    cq_lock: AtomicU32,
    cq_head: AtomicU32,
    cq_phase: AtomicU32,
    cq_reaped: AtomicU32,
    _pad2: [u32; 4],
    failed: AtomicU32,
    _pad3: [u32; 7],
}

/// `gpunvme::slot_state` as host atomics.
#[repr(C)]
#[derive(Default)]
struct HostSlotState {
    released: AtomicU32,
    ticket: AtomicU32,
    done: AtomicU32,
    dw0: AtomicU32,
}

/// A reserved ticket: its slot (and command id) is `value & (depth - 1)`. Fill it, publish it,
/// then complete it (or `wait_done` and `release` it); a ticket dropped on the way stalls the
/// ring until the queue times out.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reserved ticket must be filled, published and completed, or the ring stalls"]
pub struct Ticket(u32);

impl Ticket {
    /// The ticket number (wraps at 2^32).
    pub fn value(&self) -> u32 {
        self.0
    }
}

/// A completion as the reaper stored it in the slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    /// The CQE status field with the phase tag cleared (0: success).
    pub status_field: u16,
    /// CQE dword 0 for a command that wants it ([`wants_dw0`]), else 0.
    pub dw0: u32,
}

impl Done {
    /// The decoded status.
    pub fn status(&self) -> Status {
        CqeStatus::from(self.status_field).status()
    }
}

/// How to build a [`CpuQueue`].
#[derive(Clone, Debug)]
pub struct CpuQueueOptions {
    /// Entries of the SQ and of the CQ: a power of two, 2..=CAP.MQES + 1.
    pub depth: u32,
    /// Bytes of each slot's data buffer: whole 4 KiB pages, at most the controller's maximum
    /// transfer (default: that maximum, at most 64 KiB).
    pub slot_buffer_bytes: Option<u32>,
    /// Bound of every wait.
    pub timeout: Duration,
}

impl Default for CpuQueueOptions {
    fn default() -> Self {
        Self {
            depth: 16,
            slot_buffer_bytes: None,
            timeout: Duration::from_secs(10),
        }
    }
}

/// One I/O queue pair on caller-supplied rings, driven by the header's protocol from any
/// number of CPU threads (`Send + Sync`; share it by reference or `Arc`).
pub struct CpuQueue {
    // Drop order: the queues are deleted on the controller before the memory goes.
    created: Option<CreatedQueuePair>,
    device: Arc<dyn Device>,
    sq: DmaMemory,
    cq: DmaMemory,
    prp_lists: DmaMemory,
    slot_buffers: DmaMemory,
    state: HostQueueState,
    slots: Box<[HostSlotState]>,
    host_flags: AtomicU32,
    sq_doorbell: usize,
    cq_doorbell: usize,
    qid: u16,
    depth: u32,
    slot_buffer_bytes: u32,
    max_transfer: u32,
    timeout: Duration,
    sq_doorbells: AtomicU64,
    cq_doorbells: AtomicU64,
    out_of_order: AtomicU64,
}

impl std::fmt::Debug for CpuQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuQueue")
            .field("qid", &self.qid)
            .field("depth", &self.depth)
            .field("slot_buffer_bytes", &self.slot_buffer_bytes)
            .field("failed", &self.failed())
            .finish()
    }
}

/// A bounded wait: the deadline, the abort word, and a backoff between polls (the header's
/// `waiter`).
struct Waiter {
    deadline: Instant,
    spins: u32,
}

impl Waiter {
    fn new(q: &CpuQueue) -> Self {
        Self {
            deadline: Instant::now() + q.timeout,
            spins: 0,
        }
    }

    /// `None` to keep waiting, else why to stop.
    fn tick(&mut self, q: &CpuQueue) -> Option<DeviceStatus> {
        self.spins = self.spins.wrapping_add(1);
        if self.spins % ABORT_POLL == 0 {
            if q.host_flags.load(Ordering::Relaxed) & HOST_ABORT != 0 {
                return Some(DeviceStatus::Aborted);
            }
            if Instant::now() > self.deadline {
                return Some(DeviceStatus::Timeout);
            }
        }
        if self.spins < SPIN_TICKS {
            std::hint::spin_loop();
        } else if self.spins < YIELD_TICKS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(WAIT_SLEEP);
        }
        None
    }
}

impl CpuQueue {
    /// Allocates the rings, one PRP-list page and one data buffer per slot with
    /// `controller.device().alloc_dma`, pre-builds every slot's PRP list, initialises the
    /// protocol state as the host does for GPU queues, and creates the queue pair on the
    /// controller with [`Controller::create_queue_pair_on`].
    pub fn create(controller: &Controller, opts: &CpuQueueOptions) -> Result<Self, GpuError> {
        let info = controller.info();
        let depth = opts.depth;
        let max_entries = info.mqes_entries.min(65536);
        if !depth.is_power_of_two() || !(2..=max_entries).contains(&depth) {
            return Err(GpuError::InvalidArgument(format!(
                "queue depth {depth}: a power of two in 2..={max_entries} (CAP.MQES + 1)"
            )));
        }
        let max_transfer = u32::try_from(info.max_transfer_bytes).unwrap_or(u32::MAX);
        let slot_buffer_bytes = match opts.slot_buffer_bytes {
            Some(b) => b,
            None => ((max_transfer as usize).min(DEFAULT_SLOT_BUFFER_MAX) / PAGE * PAGE) as u32,
        };
        if slot_buffer_bytes == 0
            || slot_buffer_bytes as usize % PAGE != 0
            || slot_buffer_bytes > max_transfer
        {
            return Err(GpuError::InvalidArgument(format!(
                "slot buffer of {slot_buffer_bytes} bytes (whole 4 KiB pages, at most the \
                 maximum transfer of {max_transfer})"
            )));
        }
        let dev = controller.device().clone();
        let alloc = |len: usize| dev.alloc_dma(len).map_err(nvme::Error::from);
        let d = depth as usize;
        let sq = alloc(d * SQE_SIZE)?;
        let cq = alloc(d * CQE_SIZE)?;
        // Two list pages per slot, as the header lays them out (the second is `build_prps`').
        let prp_lists = alloc(d * 2 * PAGE)?;
        let slot_buffers = alloc(d * slot_buffer_bytes as usize)?;

        // Pre-built PRP lists, as gpu-queues/src/queues.rs builds them for the GPU: slot s's
        // list names pages 1.. of slot s's buffer.
        let pages_per_slot = slot_buffer_bytes as usize / PAGE;
        if pages_per_slot > 2 {
            for s in 0..d {
                let base = s * slot_buffer_bytes as usize;
                for k in 1..pages_per_slot {
                    prp_lists.store_u64(
                        s * 2 * PAGE + (k - 1) * 8,
                        slot_buffers.device_address(base + k * PAGE),
                        Ordering::Relaxed,
                    );
                }
            }
        }
        // The host's initial protocol state: slot s free for ticket s, its "previous round"
        // ticket s - depth; the CQ's first phase is 1.
        let slots: Box<[HostSlotState]> = (0..depth)
            .map(|s| HostSlotState {
                released: AtomicU32::new(s),
                ticket: AtomicU32::new(s.wrapping_sub(depth)),
                ..Default::default()
            })
            .collect();
        let state = HostQueueState::default();
        state.cq_phase.store(1, Ordering::Relaxed);

        let created = controller.create_queue_pair_on(QueueRegions {
            sq: sq.region().clone(),
            sq_entries: depth,
            cq: cq.region().clone(),
            cq_entries: depth,
        })?;
        tracing::debug!(
            qid = created.qid(),
            depth,
            slot_buffer_bytes,
            "CPU client queue pair created on caller-supplied rings"
        );
        Ok(Self {
            sq_doorbell: created.sq_tail_doorbell(),
            cq_doorbell: created.cq_head_doorbell(),
            qid: created.qid(),
            created: Some(created),
            device: dev,
            sq,
            cq,
            prp_lists,
            slot_buffers,
            state,
            slots,
            host_flags: AtomicU32::new(0),
            depth,
            slot_buffer_bytes,
            max_transfer,
            timeout: opts.timeout,
            sq_doorbells: AtomicU64::new(0),
            cq_doorbells: AtomicU64::new(0),
            out_of_order: AtomicU64::new(0),
        })
    }

    /// NVMe queue id of the SQ and the CQ.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Entries per ring.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Bytes of each slot buffer.
    pub fn slot_buffer_bytes(&self) -> u32 {
        self.slot_buffer_bytes
    }

    /// Most bytes one command may move.
    pub fn max_transfer(&self) -> u32 {
        self.max_transfer
    }

    /// Bound of every wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Makes every wait on this queue stop with [`ClientError::Aborted`] at its next poll (the
    /// header's `host_flags` abort bit: set it on controller fatal status, device loss or
    /// shutdown). The queue is failed by the first waiter that sees it.
    pub fn abort(&self) {
        self.host_flags.fetch_or(HOST_ABORT, Ordering::Relaxed);
    }

    /// Why the queue failed, or `None` while it works.
    pub fn failed(&self) -> Option<DeviceStatus> {
        match self.state.failed.load(Ordering::Relaxed) {
            0 => None,
            f => Some(DeviceStatus::from_code(f)),
        }
    }

    /// Doorbell writes so far: (SQ tail, CQ head). Fewer than commands means coalescing.
    pub fn doorbell_counts(&self) -> (u64, u64) {
        (
            self.sq_doorbells.load(Ordering::Relaxed),
            self.cq_doorbells.load(Ordering::Relaxed),
        )
    }

    /// Completions reaped whose command id was not the next one in ticket order: the
    /// controller completed commands out of submission order (diagnostics: every one of them
    /// went through matching by command id).
    pub fn completions_out_of_order(&self) -> u64 {
        self.out_of_order.load(Ordering::Relaxed)
    }

    /// A snapshot of the protocol state, in the header's struct (diagnostics and tests).
    pub fn state(&self) -> QueueState {
        let s = &self.state;
        QueueState {
            ticket: s.ticket.load(Ordering::Acquire),
            sq_published: s.sq_published.load(Ordering::Acquire),
            sq_lock: s.sq_lock.load(Ordering::Acquire),
            cq_lock: s.cq_lock.load(Ordering::Acquire),
            cq_head: s.cq_head.load(Ordering::Acquire),
            cq_phase: s.cq_phase.load(Ordering::Acquire),
            cq_reaped: s.cq_reaped.load(Ordering::Acquire),
            failed: s.failed.load(Ordering::Acquire),
            ..QueueState::default()
        }
    }

    /// A snapshot of slot `s`'s state (diagnostics and tests).
    pub fn slot_state(&self, s: u32) -> SlotState {
        let slot = &self.slots[(s & self.mask()) as usize];
        SlotState {
            released: slot.released.load(Ordering::Acquire),
            ticket: slot.ticket.load(Ordering::Acquire),
            done: slot.done.load(Ordering::Acquire),
            dw0: slot.dw0.load(Ordering::Acquire),
        }
    }

    /// Deletes the queues on the controller now (dropping the queue does it too).
    pub fn delete(mut self) -> Result<(), GpuError> {
        match self.created.take() {
            Some(c) => Ok(c.delete()?),
            None => Ok(()),
        }
    }

    fn mask(&self) -> u32 {
        self.depth - 1
    }

    /// The slot (and command id) of a ticket.
    pub fn slot_of(&self, t: &Ticket) -> u32 {
        t.0 & self.mask()
    }

    // ---- primitives -----------------------------------------------------------------------

    /// Marks the queue failed with `why` (the first reason sticks) and returns the error.
    fn fail_queue(&self, why: DeviceStatus) -> ClientError {
        let _ =
            self.state
                .failed
                .compare_exchange(0, why.code(), Ordering::Relaxed, Ordering::Relaxed);
        match why {
            DeviceStatus::Timeout => ClientError::Timeout {
                qid: self.qid,
                timeout: self.timeout,
            },
            DeviceStatus::Aborted => ClientError::Aborted { qid: self.qid },
            why => ClientError::QueueFailed { qid: self.qid, why },
        }
    }

    fn queue_failed(&self) -> Result<(), ClientError> {
        match self.failed() {
            None => Ok(()),
            Some(why) => Err(ClientError::QueueFailed { qid: self.qid, why }),
        }
    }

    /// Tries to take a lock word without waiting.
    fn try_lock(word: &AtomicU32) -> bool {
        word.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    fn unlock(word: &AtomicU32) {
        word.store(0, Ordering::Release);
    }

    // ---- doorbell coalescing and completion draining ------------------------------------

    /// Publishes every consecutive ready SQE (up to `depth - 1` past the completions consumed)
    /// and rings the SQ tail doorbell once. Returns whether this thread held the lock.
    pub fn try_publish(&self) -> bool {
        let st = &self.state;
        // No ticket taken past the published ones: nothing to publish, no lock to take.
        if st.ticket.load(Ordering::Relaxed) == st.sq_published.load(Ordering::Relaxed) {
            return false;
        }
        if !Self::try_lock(&st.sq_lock) {
            return false;
        }
        if self.failed().is_some() {
            // No doorbell on a failed queue.
            Self::unlock(&st.sq_lock);
            return true;
        }
        let mask = self.mask();
        let mut p = st.sq_published.load(Ordering::Relaxed);
        // Relaxed loads: the fence below orders them (the header's publish step).
        let limit = st.cq_reaped.load(Ordering::Relaxed).wrapping_add(mask);
        let start = p;
        while p != limit {
            let t = self.slots[(p & mask) as usize]
                .ticket
                .load(Ordering::Relaxed);
            if t != p {
                break;
            }
            p = p.wrapping_add(1);
        }
        if p != start {
            // Acquire and release in one fence (the header's fence.acq_rel.sys before
            // st.mmio): the SQE stores of every ticket seen above happen before it, and it
            // before the doorbell that says they are there.
            fence(Ordering::AcqRel);
            self.device.write_doorbell(self.sq_doorbell, p & mask);
            self.sq_doorbells.fetch_add(1, Ordering::Relaxed);
            st.sq_published.store(p, Ordering::Relaxed);
        }
        Self::unlock(&st.sq_lock);
        true
    }

    /// Drains the CQ into the slots and rings the CQ head doorbell once. A completion whose CID
    /// names no slot in flight fails the queue: [`ClientError::BadCompletion`].
    pub fn try_reap(&self) -> Result<(), ClientError> {
        let st = &self.state;
        if !Self::try_lock(&st.cq_lock) {
            return Ok(());
        }
        let mask = self.mask();
        let mut head = st.cq_head.load(Ordering::Relaxed);
        let mut phase = st.cq_phase.load(Ordering::Relaxed);
        let mut n = 0u32;
        let mut reordered = 0u64;
        // Completions consumed before this drain: completing in submission order, the
        // controller's n-th entry here would be ticket `reaped + n` (diagnostics only).
        let reaped = st.cq_reaped.load(Ordering::Relaxed);
        let mut result = Ok(());
        while n < self.depth {
            let cqe = head as usize * CQE_SIZE;
            // The phase dword first (the device may still be writing the rest of the entry),
            // with Acquire: only then the rest of the entry and the command's data.
            let dw3 = self.cq.load_u32(cqe + CQE_STATUS_DWORD, Ordering::Acquire);
            if (dw3 >> 16) & 1 != phase {
                break;
            }
            let cid = dw3 & 0xffff;
            let status_field = (dw3 >> 16) & 0xfffe;
            let slot = self.slots.get(cid as usize);
            let in_flight = slot.is_some_and(|slot| {
                let rel = slot.released.load(Ordering::Relaxed);
                let tk = slot.ticket.load(Ordering::Relaxed);
                let dn = slot.done.load(Ordering::Relaxed);
                rel == tk && (tk & mask) == cid && dn == 0
            });
            let Some(slot) = slot.filter(|_| in_flight) else {
                self.fail_queue(DeviceStatus::BadCompletion);
                result = Err(ClientError::BadCompletion {
                    qid: self.qid,
                    cid: cid as u16,
                });
                break;
            };
            if cid != reaped.wrapping_add(n) & mask {
                reordered += 1;
            }
            // Dword 0 only for a command that wants it (the header's wants_dw0, recorded by
            // fill_slot); the others keep 0 there.
            if slot.dw0.load(Ordering::Relaxed) != 0 {
                // Acquire: read before the head doorbell below hands the entry back.
                let dw0 = self.cq.load_u32(cqe + CQE_DW0, Ordering::Acquire);
                slot.dw0.store(dw0, Ordering::Relaxed);
            }
            slot.done.store(DONE_BIT | status_field, Ordering::Release);
            n += 1;
            head = (head + 1) & mask;
            if head == 0 {
                phase ^= 1;
            }
        }
        if n != 0 {
            st.cq_head.store(head, Ordering::Relaxed);
            st.cq_phase.store(phase, Ordering::Relaxed);
            // No fence before the head doorbell (as in the header): every read of the entries
            // it hands back was an Acquire load, so none is performed after it.
            self.device.write_doorbell(self.cq_doorbell, head);
            st.cq_reaped.fetch_add(n, Ordering::Release);
            self.cq_doorbells.fetch_add(1, Ordering::Relaxed);
            if reordered != 0 {
                self.out_of_order.fetch_add(reordered, Ordering::Relaxed);
            }
        }
        Self::unlock(&st.cq_lock);
        result
    }

    // ---- building commands ----------------------------------------------------------------

    /// Writes the 64-byte SQE for `r` with command id `slot`, field by field at the
    /// [`nvme_spec::wire`](nvme::nvme_spec::wire) offsets (stores of 8 bytes or less).
    fn write_sqe(&self, slot: u32, r: &IoReq) {
        let base = slot as usize * SQE_SIZE;
        let sq = &self.sq;
        let w32 = |off: usize, v: u32| sq.store_u32(base + off, v, Ordering::Relaxed);
        let w64 = |off: usize, v: u64| sq.store_u64(base + off, v, Ordering::Relaxed);
        // Dword 0: opcode, flags (no fusing, PRPs), command id.
        w32(SQE_CDW0, r.opcode as u32 | (slot << 16));
        w32(SQE_NSID, r.nsid);
        w32(SQE_CDW2, 0);
        w32(SQE_CDW3, 0);
        w64(SQE_MPTR, 0);
        w64(SQE_PRP1, r.prp1);
        w64(SQE_PRP2, r.prp2);
        w32(SQE_CDW10, r.slba as u32);
        w32(SQE_CDW11, (r.slba >> 32) as u32);
        w32(SQE_CDW12, r.nlb_z as u32);
        w32(SQE_CDW13, 0);
        w32(SQE_CDW14, 0);
        w32(SQE_CDW15, 0);
    }

    /// Data pointer for `bytes` in `slot`'s own buffer: PRP1 only, PRP1 + PRP2, or PRP2 naming
    /// the slot's pre-built PRP list (the header's `slot_buffer_prps`).
    pub fn slot_buffer_prps(&self, slot: u32, bytes: u32) -> (u64, u64) {
        let base = (slot & self.mask()) as usize * self.slot_buffer_bytes as usize;
        let prp1 = self.slot_buffers.device_address(base);
        let prp2 = if bytes as usize <= PAGE {
            0
        } else if bytes as usize <= 2 * PAGE {
            self.slot_buffers.device_address(base + PAGE)
        } else {
            self.prp_lists
                .device_address((slot & self.mask()) as usize * 2 * PAGE)
        };
        (prp1, prp2)
    }

    /// Copies `data` into the ticket's slot buffer at `offset`.
    ///
    /// # Panics
    /// If the range does not fit the slot buffer (a caller bug).
    pub fn write_slot_buffer(&self, t: &Ticket, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.slot_buffer_bytes as usize);
        let base = self.slot_of(t) as usize * self.slot_buffer_bytes as usize;
        self.slot_buffers.write(base + offset, data);
    }

    /// Copies bytes out of the ticket's slot buffer at `offset` (after its completion was
    /// seen, before [`CpuQueue::release`]).
    ///
    /// # Panics
    /// If the range does not fit the slot buffer (a caller bug).
    pub fn read_slot_buffer(&self, t: &Ticket, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.slot_buffer_bytes as usize);
        let base = self.slot_of(t) as usize * self.slot_buffer_bytes as usize;
        self.slot_buffers.read(base + offset, out);
    }

    /// Fills `len` bytes of the ticket's slot buffer with `byte` (poison before a read).
    pub fn fill_slot_buffer(&self, t: &Ticket, len: usize, byte: u8) {
        assert!(len <= self.slot_buffer_bytes as usize);
        let base = self.slot_of(t) as usize * self.slot_buffer_bytes as usize;
        self.slot_buffers.fill(base, len, byte);
    }

    // ---- thread variants ------------------------------------------------------------------

    /// Takes a ticket and waits (bounded) until its slot is free (the header's
    /// `reserve_thread`).
    pub fn reserve(&self) -> Result<Ticket, ClientError> {
        self.queue_failed()?;
        let t = self.state.ticket.fetch_add(1, Ordering::Relaxed);
        self.wait_slot_free(t)?;
        Ok(Ticket(t))
    }

    /// Waits until ticket `t`'s slot is released to it, reaping and publishing meanwhile.
    fn wait_slot_free(&self, t: u32) -> Result<(), ClientError> {
        let slot = &self.slots[(t & self.mask()) as usize];
        let mut w = Waiter::new(self);
        while slot.released.load(Ordering::Acquire) != t {
            self.queue_failed()?;
            // As in the header: a bad completion found here fails the queue, which the next
            // round reports.
            let _ = self.try_reap();
            self.try_publish();
            if let Some(s) = w.tick(self) {
                return Err(self.fail_queue(s));
            }
        }
        Ok(())
    }

    /// Writes the SQE of an owned ticket and makes it publishable (no doorbell yet).
    pub fn fill_slot(&self, t: &Ticket, r: &IoReq) {
        let s = self.slot_of(t);
        self.write_sqe(s, r);
        self.slots[s as usize]
            .dw0
            .store(wants_dw0(r.opcode) as u32, Ordering::Relaxed);
        // Release: the SQE and the dword-0 flag are in place before anyone sees the ticket.
        self.slots[s as usize].ticket.store(t.0, Ordering::Release);
    }

    /// Waits (bounded) until ticket `t` is published, publishing it (and its neighbours)
    /// itself when it can: the doorbell-coalescing step (the header's `publish_thread`).
    pub fn publish(&self, t: &Ticket) -> Result<(), ClientError> {
        let st = &self.state;
        let mut w = Waiter::new(self);
        // The first pass goes straight to the publish step (try_publish rings no doorbell on a
        // failed queue).
        let mut first = true;
        loop {
            if !first {
                let p = st.sq_published.load(Ordering::Relaxed);
                if p.wrapping_sub(t.0) as i32 > 0 {
                    return Ok(());
                }
                self.queue_failed()?;
            }
            first = false;
            if !self.try_publish() {
                if let Some(s) = w.tick(self) {
                    return Err(self.fail_queue(s));
                }
            } else {
                // Published as far as the CQ allows; if t is still beyond that, completions
                // must be consumed first.
                let p = st.sq_published.load(Ordering::Relaxed);
                if p.wrapping_sub(t.0) as i32 > 0 {
                    return Ok(());
                }
                self.try_reap()?;
                if let Some(s) = w.tick(self) {
                    return Err(self.fail_queue(s));
                }
            }
        }
    }

    /// Waits (bounded) for ticket `t`'s completion without releasing the slot: the first half
    /// of the header's `complete_thread`. Read the slot buffer, then [`CpuQueue::release`].
    pub fn wait_done(&self, t: &Ticket) -> Result<Done, ClientError> {
        let slot = &self.slots[self.slot_of(t) as usize];
        let mut w = Waiter::new(self);
        let done = loop {
            let done = slot.done.load(Ordering::Acquire);
            if done != 0 {
                break done;
            }
            self.queue_failed()?;
            self.try_reap()?;
            let done = slot.done.load(Ordering::Acquire);
            if done != 0 {
                break done;
            }
            self.try_publish();
            if let Some(s) = w.tick(self) {
                return Err(self.fail_queue(s));
            }
        };
        Ok(Done {
            status_field: (done & 0xffff) as u16,
            dw0: slot.dw0.load(Ordering::Relaxed),
        })
    }

    /// Clears the slot's completion and releases it to ticket `t + depth` (Release: the
    /// caller's reads of the slot's data come first). The second half of `complete_thread`.
    pub fn release(&self, t: Ticket) {
        let slot = &self.slots[self.slot_of(&t) as usize];
        slot.done.store(0, Ordering::Relaxed);
        slot.released
            .store(t.0.wrapping_add(self.depth), Ordering::Release);
    }

    /// Waits (bounded) for ticket `t`'s completion and releases the slot (the header's
    /// `complete_thread`): CQE dword 0 on success, [`ClientError::Nvme`] with the status on an
    /// error status.
    pub fn complete(&self, t: Ticket) -> Result<u32, ClientError> {
        let cid = self.slot_of(&t) as u16;
        let done = self.wait_done(&t)?;
        self.release(t);
        self.outcome(cid, done)
    }

    fn outcome(&self, cid: u16, done: Done) -> Result<u32, ClientError> {
        if done.status_field == 0 {
            Ok(done.dw0)
        } else {
            Err(ClientError::Nvme {
                qid: self.qid,
                cid,
                status: done.status(),
                status_field: done.status_field,
            })
        }
    }

    /// One command from one thread: reserve, fill, publish, complete (the header's
    /// `io_thread`). CQE dword 0 on success.
    pub fn io(&self, r: &IoReq) -> Result<u32, ClientError> {
        let t = self.reserve()?;
        self.fill_slot(&t, r);
        self.publish(&t)?;
        self.complete(t)
    }

    // ---- warp variants: one thread plays every lane -----------------------------------------

    /// Reserves `n` consecutive tickets with ONE atomic (what a warp's leader lane does for its
    /// active lanes), then waits (bounded) until each one's slot is free, in ticket order.
    /// `n` is 1..=depth: the batch is one holder in the deadlock rule.
    pub fn reserve_many(&self, n: u32) -> Result<Vec<Ticket>, ClientError> {
        if n == 0 || n > self.depth {
            return Err(ClientError::InvalidArgument(format!(
                "a batch of {n} tickets on a queue of depth {} (1..=depth)",
                self.depth
            )));
        }
        self.queue_failed()?;
        let base = self.state.ticket.fetch_add(n, Ordering::Relaxed);
        let mut tickets = Vec::with_capacity(n as usize);
        for i in 0..n {
            let t = base.wrapping_add(i);
            self.wait_slot_free(t)?;
            tickets.push(Ticket(t));
        }
        Ok(tickets)
    }

    /// Issues `reqs` as one batch (the warp variant of `gpunvme_io_batch`): one atomic reserves
    /// every slot, every SQE is filled before any is published (so one doorbell usually covers
    /// them all), then each command is completed. One outcome per request, in order.
    pub fn io_batch(&self, reqs: &[IoReq]) -> Vec<Result<u32, ClientError>> {
        let n = u32::try_from(reqs.len()).unwrap_or(u32::MAX);
        if n == 0 {
            return Vec::new();
        }
        let tickets = match self.reserve_many(n) {
            Ok(t) => t,
            Err(e) => return vec![Err(e); reqs.len()],
        };
        for (t, r) in tickets.iter().zip(reqs) {
            self.fill_slot(t, r);
        }
        let mut published = Vec::with_capacity(tickets.len());
        for t in tickets {
            let p = self.publish(&t);
            published.push((t, p));
        }
        published
            .into_iter()
            .map(|(t, p)| {
                p?;
                self.complete(t)
            })
            .collect()
    }

    // ---- whole reads and writes through the slot buffer -----------------------------------

    fn rw_request(
        &self,
        t: &Ticket,
        opcode: u8,
        nsid: u32,
        slba: u64,
        lba_size: u32,
        bytes: usize,
    ) -> IoReq {
        let (prp1, prp2) = self.slot_buffer_prps(self.slot_of(t), bytes as u32);
        IoReq {
            slba,
            prp1,
            prp2,
            nsid,
            nlb_z: (bytes / lba_size as usize - 1) as u16,
            opcode,
            reserved: 0,
        }
    }

    fn check_lba_size(lba_size: u32) -> Result<(), ClientError> {
        if !(512..=4096).contains(&lba_size) || !lba_size.is_power_of_two() {
            return Err(ClientError::InvalidArgument(format!(
                "LBA size {lba_size} (512..=4096, a power of two)"
            )));
        }
        Ok(())
    }

    fn check_rw(&self, lba_size: u32, bytes: usize) -> Result<(), ClientError> {
        Self::check_lba_size(lba_size)?;
        if bytes == 0 || bytes % lba_size as usize != 0 || bytes > self.slot_buffer_bytes as usize {
            return Err(ClientError::InvalidArgument(format!(
                "{bytes} bytes: whole {lba_size}-byte blocks, 1..={} bytes (the slot buffer)",
                self.slot_buffer_bytes
            )));
        }
        Ok(())
    }

    /// Writes `data` (whole blocks of `lba_size` bytes, at most one slot buffer) at `slba` of
    /// `nsid` through the slot buffer of the ticket it reserves.
    pub fn write_blocks(
        &self,
        nsid: u32,
        lba_size: u32,
        slba: u64,
        data: &[u8],
    ) -> Result<(), ClientError> {
        self.check_rw(lba_size, data.len())?;
        let t = self.reserve()?;
        self.write_slot_buffer(&t, 0, data);
        let r = self.rw_request(&t, OPC_WRITE, nsid, slba, lba_size, data.len());
        self.fill_slot(&t, &r);
        self.publish(&t)?;
        self.complete(t).map(drop)
    }

    /// Reads `out.len()` bytes (whole blocks, at most one slot buffer) at `slba` of `nsid`
    /// into `out`, through the slot buffer of the ticket it reserves (poisoned first, so bytes
    /// the controller did not move cannot pass for data).
    pub fn read_blocks(
        &self,
        nsid: u32,
        lba_size: u32,
        slba: u64,
        out: &mut [u8],
    ) -> Result<(), ClientError> {
        self.check_rw(lba_size, out.len())?;
        let t = self.reserve()?;
        self.fill_slot_buffer(&t, out.len(), 0xa5);
        let r = self.rw_request(&t, OPC_READ, nsid, slba, lba_size, out.len());
        self.fill_slot(&t, &r);
        self.publish(&t)?;
        let cid = self.slot_of(&t) as u16;
        let done = self.wait_done(&t)?;
        if done.status_field == 0 {
            self.read_slot_buffer(&t, 0, out);
        }
        self.release(t);
        self.outcome(cid, done).map(drop)
    }

    /// Writes `data` (whole blocks of `lba_size` bytes, any length) at `slba` of `nsid`, split
    /// into commands of at most one slot buffer (itself at most the maximum transfer, so this
    /// is the split above MDTS).
    ///
    /// The header's `rw_warp` with the data going through slot buffers: the pieces go out in
    /// batches of at most `depth`, each batch's tickets taken with one atomic (so one holder in
    /// the deadlock rule) and usually published with one doorbell. Every piece of a batch is
    /// waited for; the first error in piece order is returned, and no later batch is issued.
    pub fn write_range(
        &self,
        nsid: u32,
        lba_size: u32,
        slba: u64,
        data: &[u8],
    ) -> Result<(), ClientError> {
        self.rw_range(
            OPC_WRITE,
            nsid,
            lba_size,
            slba,
            data.len(),
            |t, off, len| self.write_slot_buffer(t, 0, &data[off..off + len]),
            |_, _, _| {},
        )
    }

    /// Reads `out.len()` bytes (whole blocks, any length) at `slba` of `nsid` into `out`, split
    /// as [`CpuQueue::write_range`] splits. Slot buffers are poisoned before each read.
    pub fn read_range(
        &self,
        nsid: u32,
        lba_size: u32,
        slba: u64,
        out: &mut [u8],
    ) -> Result<(), ClientError> {
        let len = out.len();
        self.rw_range(
            OPC_READ,
            nsid,
            lba_size,
            slba,
            len,
            |t, _, len| self.fill_slot_buffer(t, len, 0xa5),
            |t, off, len| self.read_slot_buffer(t, 0, &mut out[off..off + len]),
        )
    }

    /// Pieces one slot buffer long, issued in batches of at most `depth`: `stage(ticket, offset,
    /// len)` prepares a piece's slot buffer before its SQE is written, `take` consumes a
    /// successful piece before its slot is released.
    #[expect(clippy::too_many_arguments)]
    fn rw_range(
        &self,
        opcode: u8,
        nsid: u32,
        lba_size: u32,
        slba: u64,
        len: usize,
        mut stage: impl FnMut(&Ticket, usize, usize),
        mut take: impl FnMut(&Ticket, usize, usize),
    ) -> Result<(), ClientError> {
        Self::check_lba_size(lba_size)?;
        if len == 0 || len % lba_size as usize != 0 {
            return Err(ClientError::InvalidArgument(format!(
                "{len} bytes: whole {lba_size}-byte blocks, at least one"
            )));
        }
        let piece = self.slot_buffer_bytes as usize / lba_size as usize * lba_size as usize;
        let pieces = len.div_ceil(piece);
        let span = |i: usize| (i * piece, piece.min(len - i * piece));
        let mut first = 0;
        while first < pieces {
            let n = (pieces - first).min(self.depth as usize);
            let tickets = self.reserve_many(n as u32)?;
            for (i, t) in tickets.iter().enumerate() {
                let (off, bytes) = span(first + i);
                stage(t, off, bytes);
                let lba = slba + (off / lba_size as usize) as u64;
                self.fill_slot(t, &self.rw_request(t, opcode, nsid, lba, lba_size, bytes));
            }
            for t in &tickets {
                self.publish(t)?;
            }
            let mut first_error = None;
            for (i, t) in tickets.into_iter().enumerate() {
                let (off, bytes) = span(first + i);
                let cid = self.slot_of(&t) as u16;
                let done = self.wait_done(&t)?;
                if done.status_field == 0 {
                    take(&t, off, bytes);
                }
                self.release(t);
                if let Err(e) = self.outcome(cid, done) {
                    first_error.get_or_insert(e);
                }
            }
            if let Some(e) = first_error {
                return Err(e);
            }
            first += n;
        }
        Ok(())
    }
}

impl Drop for CpuQueue {
    fn drop(&mut self) {
        // Stop any straggling wait, then delete the queues (SQ, then CQ) on the controller
        // before the rings and buffers are freed.
        self.abort();
        if let Some(created) = self.created.take() {
            let qid = created.qid();
            if let Err(e) = created.delete() {
                tracing::warn!(qid, error = %e, "deleting a CPU client queue pair");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme::ControllerOptions;
    use nvme_emu::{EmuConfig, EmuDevice};
    use std::mem::offset_of;

    #[test]
    fn host_state_has_the_header_layout() {
        assert_eq!(size_of::<HostQueueState>(), size_of::<QueueState>());
        assert_eq!(size_of::<HostSlotState>(), size_of::<SlotState>());
        let pairs = [
            (
                offset_of!(HostQueueState, ticket),
                offset_of!(QueueState, ticket),
            ),
            (
                offset_of!(HostQueueState, sq_published),
                offset_of!(QueueState, sq_published),
            ),
            (
                offset_of!(HostQueueState, sq_lock),
                offset_of!(QueueState, sq_lock),
            ),
            (
                offset_of!(HostQueueState, cq_lock),
                offset_of!(QueueState, cq_lock),
            ),
            (
                offset_of!(HostQueueState, cq_head),
                offset_of!(QueueState, cq_head),
            ),
            (
                offset_of!(HostQueueState, cq_phase),
                offset_of!(QueueState, cq_phase),
            ),
            (
                offset_of!(HostQueueState, cq_reaped),
                offset_of!(QueueState, cq_reaped),
            ),
            (
                offset_of!(HostQueueState, failed),
                offset_of!(QueueState, failed),
            ),
            (
                offset_of!(HostSlotState, released),
                offset_of!(SlotState, released),
            ),
            (
                offset_of!(HostSlotState, ticket),
                offset_of!(SlotState, ticket),
            ),
            (offset_of!(HostSlotState, done), offset_of!(SlotState, done)),
            (offset_of!(HostSlotState, dw0), offset_of!(SlotState, dw0)),
        ];
        for (host, header) in pairs {
            assert_eq!(host, header);
        }
    }

    fn queue(depth: u32) -> (Arc<EmuDevice>, Controller, CpuQueue) {
        let emu = EmuDevice::start(EmuConfig::default()).expect("software controller");
        let ctrl = Controller::new(emu.clone(), ControllerOptions::default()).expect("bring-up");
        let q = CpuQueue::create(
            &ctrl,
            &CpuQueueOptions {
                depth,
                slot_buffer_bytes: Some(16384),
                timeout: Duration::from_secs(5),
            },
        )
        .expect("queue");
        (emu, ctrl, q)
    }

    /// A CQE the controller never posted, with the expected phase: the reaper must refuse it
    /// (CID out of range, and CID of an idle slot), fail the queue, and not ring the doorbell.
    #[test]
    fn garbage_completions_fail_the_queue() {
        for cid in [0xffffu32, 3] {
            let (_emu, _ctrl, q) = queue(8);
            // Phase 1, status 0, the given CID, at the head (entry 0).
            q.cq.store_u32(CQE_STATUS_DWORD, (1 << 16) | cid, Ordering::Release);
            assert_eq!(
                q.try_reap(),
                Err(ClientError::BadCompletion {
                    qid: q.qid(),
                    cid: cid as u16
                })
            );
            assert_eq!(q.failed(), Some(DeviceStatus::BadCompletion));
            assert_eq!(q.doorbell_counts(), (0, 0));
            assert_eq!(
                q.reserve().unwrap_err(),
                ClientError::QueueFailed {
                    qid: q.qid(),
                    why: DeviceStatus::BadCompletion
                }
            );
        }
    }

    /// A completion for a command that already completed (its slot's `done` is set) is a
    /// duplicate: bad completion, not a second wake-up.
    #[test]
    fn duplicate_completion_fails_the_queue() {
        let (_emu, _ctrl, q) = queue(8);
        let t = q.reserve().unwrap();
        q.fill_slot(
            &t,
            &IoReq {
                opcode: OPC_FLUSH,
                nsid: 1,
                ..IoReq::default()
            },
        );
        q.publish(&t).unwrap();
        let done = q.wait_done(&t).unwrap();
        assert_eq!(done.status_field, 0);
        // The controller's entry 0 was consumed; forge entry 1 with the same CID.
        q.cq.store_u32(
            CQE_SIZE + CQE_STATUS_DWORD,
            (1 << 16) | q.slot_of(&t),
            Ordering::Release,
        );
        assert!(matches!(
            q.try_reap(),
            Err(ClientError::BadCompletion { cid: 0, .. })
        ));
        q.release(t);
        assert_eq!(q.failed(), Some(DeviceStatus::BadCompletion));
    }

    #[test]
    fn depth_and_slot_buffer_are_checked() {
        let emu = EmuDevice::start(EmuConfig::default()).unwrap();
        let ctrl = Controller::new(emu, ControllerOptions::default()).unwrap();
        for depth in [0, 1, 12, 2048] {
            let e = CpuQueue::create(
                &ctrl,
                &CpuQueueOptions {
                    depth,
                    ..Default::default()
                },
            )
            .unwrap_err();
            assert!(matches!(e, GpuError::InvalidArgument(_)), "{depth}: {e}");
        }
        let e = CpuQueue::create(
            &ctrl,
            &CpuQueueOptions {
                slot_buffer_bytes: Some(1000),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(matches!(e, GpuError::InvalidArgument(_)), "{e}");
        let q = CpuQueue::create(&ctrl, &CpuQueueOptions::default()).unwrap();
        assert!(matches!(
            q.reserve_many(17),
            Err(ClientError::InvalidArgument(_))
        ));
        assert!(matches!(
            q.write_blocks(1, 512, 0, &[0; 100]),
            Err(ClientError::InvalidArgument(_))
        ));
        // Nothing was reserved by the refusals.
        assert_eq!(q.state().ticket, 0);
    }
}
