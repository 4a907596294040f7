//! [`GpuQueues`]: NVMe I/O queue pairs in GPU memory, created through the CPU admin queue of
//! the same [`nvme::Controller`] that serves CPU queues, described to kernels by a
//! [`QueueDesc`] array in GPU memory.
//!
//! Who serves the queues is a [`QueueTransport`]: the real-SSD transports of
//! [`crate::transport`], or an emulated controller (the `gpu_emu` crate). A transport builds
//! its pairs with the helpers here ([`Plan`], [`DescCommon`], [`alloc_protocol_state`],
//! [`prebuilt_prp_lists`], [`aligned_arena`]) and hands them to [`GpuQueues::assemble`]; this
//! module never knows which controller it talks to.
//!
//! For every queue pair this allocates, in GPU memory: the SQ and CQ rings (`depth` entries
//! each, `depth` a power of two so tickets wrap cleanly), the protocol state
//! ([`QueueState`], [`SlotState`]s), one PRP-list page per slot and one data buffer per slot
//! whose PRP list is pre-built at creation (so the hot path builds none). The controller learns
//! the rings' device addresses through Create I/O CQ/SQ on the CPU admin queue.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvme::{CreatedQueuePair, DmaRegion};
use zerocopy::IntoBytes;

use crate::desc::{QueueDesc, QueueState, SlotState};
use crate::error::GpuError;
use crate::ffi::{Cuda, DeviceMemory, GreenPartition, PinnedMemory, Placement, Stream};
use crate::kernels::Kernels;
pub use crate::transport_kind::TransportKind;
/// Deepest queue created by default (memory: SQ 64 B + CQ 16 B + PRP page 4 KiB + slot buffer
/// per entry).
const DEFAULT_MAX_DEPTH: u32 = 1024;

/// How to build the queues.
#[derive(Clone, Debug)]
pub struct GpuQueueOptions {
    /// Queue pairs (default: every one the controller has left).
    pub queues: Option<u16>,
    /// Entries per ring, rounded down to a power of two (default: CAP.MQES + 1, at most 1024).
    pub depth: Option<u32>,
    /// Bytes of each slot's data buffer (default: the controller's maximum transfer).
    pub slot_buffer_bytes: Option<u32>,
    /// Bound of every device-side wait. `None` (the default): decided when the queues are
    /// made ([`GpuQueueOptions::timeout`]): the setting `GPUNVME_GPU_TIMEOUT_S`
    /// (docs/settings.md), else 10 s on an emulated controller and [`REAL_SSD_TIMEOUT`] on a
    /// real SSD, 120 s under compute-sanitizer, which slows kernels many times.
    pub timeout: Option<Duration>,
    /// SMs reserved for the controller's own kernels (green context; default 8, the minimum
    /// partition on Hopper).
    pub controller_sms: u32,
    /// For a controller that can keep the rings either in GPU memory or in host memory (the
    /// software controller): `Some(true)` host memory, the lowest latency per command (GPU
    /// threads poll completions over PCIe); `Some(false)` GPU memory, for bulk transfers into
    /// GPU buffers (no PCIe reads of pollers queue behind the data); `None` the transport's
    /// default (the software controller: GPU memory). `GPUNVME_EMU_RINGS` overrides it.
    /// Ignored by every other transport.
    pub host_rings: Option<bool>,
}

impl Default for GpuQueueOptions {
    fn default() -> Self {
        Self {
            queues: None,
            depth: None,
            slot_buffer_bytes: None,
            timeout: None,
            controller_sms: 8,
            host_rings: None,
        }
    }
}

/// Bounds of a device-side wait's timeout ([`DescCommon::new`] clamps into them).
pub const TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_millis(1), Duration::from_secs(3600));

/// The default bound of a wait on a real SSD's queues (the vfio-p2p, host-memory and vfio-user
/// transports): 30 s, as the Linux driver's I/O timeout, where an emulated controller's 10 s is
/// the default.
pub const REAL_SSD_TIMEOUT: Duration = Duration::from_secs(30);

impl GpuQueueOptions {
    /// The bound of every device-side wait on an emulated controller's queues: the options'
    /// own, else the setting `GPUNVME_GPU_TIMEOUT_S` (an error when it holds anything but
    /// whole seconds from 1 to 3600), else 10 s (120 s under compute-sanitizer).
    pub fn timeout(&self) -> Result<Duration, GpuError> {
        self.timeout_or(Duration::from_secs(10))
    }

    /// The bound on a real SSD's queues: as [`GpuQueueOptions::timeout`], with
    /// [`REAL_SSD_TIMEOUT`] for the plain default.
    pub fn real_ssd_timeout(&self) -> Result<Duration, GpuError> {
        self.timeout_or(REAL_SSD_TIMEOUT)
    }

    fn timeout_or(&self, plain: Duration) -> Result<Duration, GpuError> {
        if let Some(t) = self.timeout {
            return Ok(t);
        }
        let var = gpunvme_settings::GPU_TIMEOUT_S.value();
        timeout_from(
            var.as_deref(),
            gpunvme_settings::under_compute_sanitizer(),
            plain,
        )
    }
}

/// `timeout` clamped into [`TIMEOUT_RANGE`], in nanoseconds.
fn clamp_timeout(timeout: Duration) -> u64 {
    timeout.clamp(TIMEOUT_RANGE.0, TIMEOUT_RANGE.1).as_nanos() as u64
}

/// The default bound from the setting's value (`var`), whether the sanitizer runs, and the
/// plain default.
fn timeout_from(var: Option<&str>, sanitizer: bool, plain: Duration) -> Result<Duration, GpuError> {
    let set = gpunvme_settings::GPU_TIMEOUT_S
        .number_in(var, 1, 3600)
        .map_err(|e| GpuError::InvalidArgument(e.to_string()))?;
    Ok(match set {
        Some(s) => Duration::from_secs(s),
        None if sanitizer => Duration::from_secs(120),
        None => plain,
    })
}

/// Bound of a host wait for a kernel whose work takes milliseconds on a GPU (a CRC, a staging
/// copy, a handful of commands): a minute on a GPU; ten times that where kernels run many
/// times slower, on CPU threads (the `host-gpu` build, whose persistent kernels, the modelled
/// controllers', share a few cores with it) or under compute-sanitizer.
pub fn compute_wait_bound() -> Duration {
    compute_wait_from(cfg!(feature = "host-gpu"), under_compute_sanitizer())
}

/// [`compute_wait_bound`] from whether kernels run on CPU threads and under the sanitizer.
fn compute_wait_from(host_gpu: bool, sanitizer: bool) -> Duration {
    let base = Duration::from_secs(60);
    if host_gpu || sanitizer {
        base * 10
    } else {
        base
    }
}

/// Whether this process runs under NVIDIA's compute-sanitizer (its own injection
/// environment): waits get a longer default bound, and the software controller copies without
/// kernels of its own.
pub use gpunvme_settings::under_compute_sanitizer;

/// Queue geometry every transport derives the same way from the controller and the options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Entries per ring (a power of two).
    pub depth: u32,
    /// Bytes of each slot's data buffer.
    pub slot_buffer_bytes: u32,
    /// Queue pairs to create.
    pub count: u16,
    /// Most bytes one command moves.
    pub max_transfer: u32,
}

/// Checks the options against the controller: depth a power of two in 2..=min(CAP.MQES + 1,
/// 65536), slot buffers whole pages up to the maximum transfer, at least one queue.
pub fn plan(info: &nvme::ControllerInfo, opts: &GpuQueueOptions) -> Result<Plan, GpuError> {
    let max_entries = info.mqes_entries.min(65536);
    let depth = pow2_floor(opts.depth.unwrap_or(DEFAULT_MAX_DEPTH).min(max_entries));
    if depth < 2 {
        return Err(GpuError::InvalidArgument(format!(
            "queue depth {:?} (the controller allows up to {max_entries} entries)",
            opts.depth
        )));
    }
    let max_transfer = info.max_transfer_bytes as u32;
    let slot_buffer_bytes = opts.slot_buffer_bytes.unwrap_or(max_transfer);
    if slot_buffer_bytes == 0 || slot_buffer_bytes % 4096 != 0 || slot_buffer_bytes > max_transfer {
        return Err(GpuError::InvalidArgument(format!(
            "slot buffer of {slot_buffer_bytes} bytes (whole 4 KiB pages, at most the \
             maximum transfer of {max_transfer})"
        )));
    }
    let count = opts.queues.unwrap_or(info.max_io_queue_pairs);
    if count == 0 {
        return Err(GpuError::InvalidArgument("zero GPU queues".into()));
    }
    Ok(Plan {
        depth,
        slot_buffer_bytes,
        count,
        max_transfer,
    })
}

/// The pre-built PRP lists of a queue's slot buffers (two list pages per slot; slot s's first
/// page names pages 1.. of its buffer), or `None` when buffers need no list (≤ 2 pages).
pub fn prebuilt_prp_lists(depth: u32, slot_buffer_bytes: u32, buf_bus: u64) -> Option<Vec<u64>> {
    let rows = prebuilt_prp_rows(depth, slot_buffer_bytes, buf_bus)?;
    let row = rows.len() / depth as usize;
    let mut lists = vec![0u64; depth as usize * 2 * 512];
    for (s, r) in rows.chunks(row).enumerate() {
        lists[s * 2 * 512..s * 2 * 512 + row].copy_from_slice(r);
    }
    Some(lists)
}

/// [`prebuilt_prp_lists`] without the zeros: one row per slot of the entries its list page
/// starts with (`slot_buffer_bytes / 4096 - 1` of them), for memory zeroed already whose rows
/// are [`PRP_LIST_PITCH`] bytes apart (written with one strided copy, not 2 MiB per queue).
pub fn prebuilt_prp_rows(depth: u32, slot_buffer_bytes: u32, buf_bus: u64) -> Option<Vec<u64>> {
    let pages_per_slot = slot_buffer_bytes as usize / 4096;
    if pages_per_slot <= 2 {
        return None;
    }
    let mut rows = Vec::with_capacity(depth as usize * (pages_per_slot - 1));
    for s in 0..depth as usize {
        let base = buf_bus + (s * slot_buffer_bytes as usize) as u64;
        rows.extend((1..pages_per_slot).map(|k| base + (k * 4096) as u64));
    }
    Some(rows)
}

/// Bytes from one slot's pre-built PRP list to the next (two list pages per slot).
pub const PRP_LIST_PITCH: usize = 2 * 4096;

/// Slot states before the first command: slot s is free for ticket s.
pub fn initial_slots(depth: u32) -> Vec<SlotState> {
    (0..depth)
        .map(|s| SlotState {
            released: s,
            ticket: s.wrapping_sub(depth),
            done: 0,
            dw0: 0,
        })
        .collect()
}

/// A queue's protocol state before the first command (the CQ's first phase is 1).
pub fn initial_state() -> QueueState {
    QueueState {
        cq_phase: 1,
        ..Default::default()
    }
}

/// A queue's protocol state and slot states in GPU memory, initialised for the first command.
pub fn alloc_protocol_state(cuda: &Arc<Cuda>, depth: u32) -> Result<ProtocolState, GpuError> {
    Ok(alloc_protocol_states(cuda, depth, 1)?.remove(0))
}

/// A queue's protocol state and its slot states in GPU memory ([`alloc_protocol_state`]).
pub type ProtocolState = (Arc<DeviceMemory>, Arc<DeviceMemory>);

/// [`alloc_protocol_state`] for `count` queues at once: two allocations and two copies in
/// all, not two of each per queue.
pub fn alloc_protocol_states(
    cuda: &Arc<Cuda>,
    depth: u32,
    count: usize,
) -> Result<Vec<ProtocolState>, GpuError> {
    // Each queue's part on its own 256-byte boundary, as its own allocation's would be.
    let state_len = size_of::<QueueState>().next_multiple_of(256);
    let slots_len = (depth as usize * size_of::<SlotState>()).next_multiple_of(256);
    let states = Arc::new(DeviceMemory::alloc(cuda, state_len * count.max(1))?);
    let slots = Arc::new(DeviceMemory::alloc(cuda, slots_len * count.max(1))?);
    let mut state_bytes = vec![0u8; state_len * count];
    let mut slot_bytes = vec![0u8; slots_len * count];
    let (state0, slots0) = (initial_state(), initial_slots(depth));
    for q in 0..count {
        let st = state0.as_bytes();
        state_bytes[q * state_len..q * state_len + st.len()].copy_from_slice(st);
        let sl = slots0.as_bytes();
        slot_bytes[q * slots_len..q * slots_len + sl.len()].copy_from_slice(sl);
    }
    states.write(0, &state_bytes)?;
    slots.write(0, &slot_bytes)?;
    (0..count)
        .map(|q| {
            Ok((
                Arc::new(DeviceMemory::view(
                    &states,
                    q * state_len,
                    size_of::<QueueState>(),
                )?),
                Arc::new(DeviceMemory::view(
                    &slots,
                    q * slots_len,
                    depth as usize * size_of::<SlotState>(),
                )?),
            ))
        })
        .collect()
}

/// The queues' descriptors, in GPU memory for kernels (`const queue_desc*`).
fn upload_descs(cuda: &Arc<Cuda>, pairs: &[GpuQueuePair]) -> Result<DeviceMemory, GpuError> {
    let all: Vec<QueueDesc> = pairs.iter().map(|p| p.desc).collect();
    let descs = DeviceMemory::alloc(cuda, all.as_bytes().len())?;
    descs.write(0, all.as_bytes())?;
    Ok(descs)
}

/// What every queue of a set shares in its descriptor.
#[derive(Clone, Copy, Debug)]
pub struct DescCommon {
    /// GPU pointer of the host's abort word.
    pub host_flags: u64,
    /// Bound of every device-side wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Entries per ring.
    pub depth: u32,
    /// `QF_*` bits ([`crate::desc::QF_LOCAL_PEER`] for a controller inside the GPU).
    pub flags: u16,
    /// Bytes of each slot buffer.
    pub slot_buffer_bytes: u32,
    /// Most bytes one command moves.
    pub max_transfer: u32,
    /// The namespace with 8-byte protection information and its PRINFO ([`QueueDesc::pi_nsid`]).
    pub pi: (u32, u8),
}

/// Where one queue's pieces are: GPU pointers, and device addresses where they differ.
#[derive(Clone, Copy, Debug)]
pub struct DescParts {
    /// GPU pointer of the SQ ring.
    pub sq: u64,
    /// GPU pointer of the CQ ring.
    pub cq: u64,
    /// GPU pointers of the SQ tail and CQ head doorbells.
    pub doorbells: (u64, u64),
    /// GPU pointer of the [`QueueState`].
    pub state: u64,
    /// GPU pointer of the [`SlotState`]s.
    pub slots: u64,
    /// PRP-list pages: GPU pointer and device address.
    pub prp_lists: (u64, u64),
    /// Slot buffers: GPU pointer and device address.
    pub slot_buffers: (u64, u64),
    /// NVMe queue id.
    pub qid: u16,
}

impl DescCommon {
    /// What every queue of a set built to `plan` shares: the host's abort word at
    /// `host_flags`, every device-side wait bounded by `timeout`, `flags` (`QF_*`).
    /// `timeout` is clamped to 1 ms..=1 h: 0 would time out at once, and a huge one would
    /// overflow the device's deadline arithmetic into an immediate timeout.
    pub fn new(plan: &Plan, host_flags: &PinnedMemory, timeout: Duration, flags: u16) -> Self {
        Self {
            host_flags: host_flags.device_ptr(),
            timeout_ns: clamp_timeout(timeout),
            depth: plan.depth,
            flags,
            slot_buffer_bytes: plan.slot_buffer_bytes,
            max_transfer: plan.max_transfer,
            pi: (0, 0),
        }
    }

    /// Makes the queues' Reads and Writes on `controller`'s namespace with 8-byte protection
    /// information carry its PRINFO (PRACT: the controller generates and strips the PI), as
    /// the driver's CPU queues do. The descriptor has room for one such namespace: a controller
    /// with several is refused.
    pub fn with_protection(mut self, controller: &nvme::Controller) -> Result<Self, GpuError> {
        let mut pi = controller
            .namespaces()
            .iter()
            .filter(|n| n.protection.is_some());
        if let Some(ns) = pi.next() {
            if let Some(other) = pi.next() {
                return Err(GpuError::Unsupported(format!(
                    "namespaces {} and {} are both formatted with protection information; GPU \
                     queues carry PRINFO for one namespace",
                    ns.nsid, other.nsid
                )));
            }
            self.pi = (ns.nsid, ns.prinfo());
        }
        Ok(self)
    }

    /// Makes the queues' Reads and Writes on namespace `nsid` carry `prinfo` (the namespace
    /// formatted with protection information), where the controller is described by someone
    /// else (a serving daemon) rather than an [`nvme::Controller`] of this process.
    pub fn with_protection_info(mut self, nsid: u32, prinfo: u8) -> Self {
        self.pi = (nsid, prinfo);
        self
    }

    /// The descriptor of one queue.
    pub fn desc(&self, p: DescParts) -> QueueDesc {
        QueueDesc {
            sq: p.sq,
            cq: p.cq,
            sq_doorbell: p.doorbells.0,
            cq_doorbell: p.doorbells.1,
            state: p.state,
            slots: p.slots,
            prp_lists: p.prp_lists.0,
            prp_lists_bus: p.prp_lists.1,
            slot_buffers: p.slot_buffers.0,
            slot_buffers_bus: p.slot_buffers.1,
            host_flags: self.host_flags,
            timeout_ns: self.timeout_ns,
            depth: self.depth,
            qid: p.qid,
            flags: self.flags,
            slot_buffer_bytes: self.slot_buffer_bytes,
            max_transfer: self.max_transfer,
            pi_nsid: self.pi.0,
            pi_prinfo: self.pi.1,
            pad1: [0; 3],
            reserved1: 0,
        }
    }
}

/// A GPU buffer the controller can reach: its GPU pointer and its device (bus) address.
pub struct GpuBuffer {
    mem: Arc<DeviceMemory>,
    /// Where the buffer starts in `mem`.
    offset: usize,
    region: DmaRegion,
    /// Where the buffer starts in `region` (0 unless the memory starts inside a page: a
    /// caller's tensor mapped where device addresses are GPU pointers).
    lead: usize,
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuffer({:?} at {:#x})", self.mem, self.bus())
    }
}

impl GpuBuffer {
    /// A buffer of `mem` from byte `offset` on, which the controller reaches through `region`
    /// (contiguous device addresses, page aligned). For transports.
    pub fn new(mem: Arc<DeviceMemory>, offset: usize, region: DmaRegion) -> Self {
        Self::starting_at(mem, offset, region, 0)
    }

    /// A buffer of `mem` from byte `offset` on, whose first byte the controller reaches at
    /// byte `lead` of `region` (regions are whole pages; memory allocated elsewhere may start
    /// inside one). For transports.
    pub fn starting_at(
        mem: Arc<DeviceMemory>,
        offset: usize,
        region: DmaRegion,
        lead: usize,
    ) -> Self {
        let lead = lead.min(region.len());
        Self {
            mem,
            offset,
            region,
            lead,
        }
    }

    /// GPU pointer of the first byte.
    pub fn ptr(&self) -> u64 {
        self.mem.ptr() + self.offset as u64
    }

    /// Copies `data` into the buffer at `offset` (synchronous; tests and tools).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), GpuError> {
        self.mem.write(self.offset + offset, data)
    }

    /// Copies bytes at `offset` out into `buf` (synchronous; tests and tools).
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), GpuError> {
        self.mem.read(self.offset + offset, buf)
    }
    /// Device address of the first byte (contiguous for the whole buffer).
    pub fn bus(&self) -> u64 {
        self.region.device_address(0) + self.lead as u64
    }
    /// Length in bytes: the device-address range's (whole pages), but never past the end of
    /// the memory (GPU memory allocated elsewhere and mapped for the controller may end
    /// inside its last page).
    pub fn len(&self) -> usize {
        (self.region.len() - self.lead).min(self.mem.len().saturating_sub(self.offset))
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The GPU memory (for host-side copies in tests and tools).
    pub fn memory(&self) -> &DeviceMemory {
        &self.mem
    }
    /// The GPU memory, shared (to map it for another controller:
    /// [`GpuQueues::map_memory`]); the buffer starts [`GpuBuffer::ptr`] - its `ptr()` into it.
    pub fn shared_memory(&self) -> &Arc<DeviceMemory> {
        &self.mem
    }
}

/// One queue pair of a set: created on the controller, described for kernels.
pub struct GpuQueuePair {
    // Field order is drop order: the queues are deleted on the controller before their memory
    // is released and freed (`keep` drops its elements in order).
    /// The pair on the controller (deleted when [`GpuQueues`] drops).
    pub created: Option<CreatedQueuePair>,
    /// Its descriptor.
    pub desc: QueueDesc,
    /// The queue's [`QueueState`] (read back by [`GpuQueues::queue_states`]).
    pub state: Arc<DeviceMemory>,
    /// Whatever keeps the pair's memory alive and reachable by the controller.
    pub keep: Vec<Box<dyn Send + Sync>>,
}

/// What serves a set of GPU queues, beyond the rings: implemented by the real-SSD transports
/// ([`crate::transport`]) and by the emulated controllers (`gpu_emu`).
pub trait QueueTransport: Send + Sync {
    /// `len` bytes of GPU memory the controller can reach, for commands into arbitrary GPU
    /// buffers; [`GpuError::Unsupported`] where the transport cannot map memory after set-up.
    fn alloc_buffer(&self, cuda: &Arc<Cuda>, len: usize) -> Result<GpuBuffer, GpuError>;
    /// Makes GPU memory allocated elsewhere (a framework's tensor, [`DeviceMemory::borrowed`])
    /// reachable by the controller for as long as the returned buffer lives, so commands move
    /// data straight in and out of it. The default, for transports whose controller reaches
    /// only memory mapped when the queues were built (or host memory), is
    /// [`GpuError::Unsupported`]: callers then stage through [`QueueTransport::alloc_buffer`].
    fn map_memory(&self, cuda: &Arc<Cuda>, mem: Arc<DeviceMemory>) -> Result<GpuBuffer, GpuError> {
        let _ = (cuda, mem);
        Err(GpuError::Unsupported(
            "mapping GPU memory allocated elsewhere on this transport".into(),
        ))
    }
    /// Whether [`QueueTransport::alloc_buffer`]'s memory is host memory mapped into the GPU
    /// (which GPU threads reach over PCIe) rather than GPU memory: callers that want the bytes
    /// in GPU memory stage through such a buffer and copy ([`GpuQueues::buffers_in_host_memory`]).
    /// The default is false.
    fn buffers_in_host_memory(&self) -> bool {
        false
    }
    /// Called after queue pair `qid` was deleted on the controller (an emulator stops reading
    /// its doorbells). The default does nothing.
    fn queue_deleted(&self, qid: u16) {
        let _ = qid;
    }
    /// Called once when the queue set drops, after the pairs it created were deleted:
    /// `kernels_idle` is false when a client kernel may still be running (its wait outlived
    /// the teardown bound), so memory it may touch must stay mapped. A transport whose pairs
    /// someone else created (a serving daemon's) gives them back here. The default does
    /// nothing.
    fn queues_dropped(&self, kernels_idle: bool) {
        let _ = kernels_idle;
    }
    /// A hint that Reads of `runs` (first LBA, LBAs) of namespace `nsid`, LBAs of
    /// `1 << lba_shift` bytes, will come soon: the transport may prepare for them while the
    /// caller gets ready and while they run (the software controller has the kernel read the
    /// parts of its image not in the page cache ahead of its threads) until the returned
    /// [`ReadAhead`] is dropped. Only a hint: nothing depends on it, and a Read that comes
    /// first is served as ever. The default does nothing.
    fn will_read(&self, nsid: u32, lba_shift: u32, runs: &[(u64, u64)]) -> ReadAhead {
        let _ = (nsid, lba_shift, runs);
        ReadAhead::none()
    }
    /// The transport as [`std::any::Any`], for callers that know its type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// What a transport does on a [`QueueTransport::will_read`] hint, running until this is dropped.
/// The drop stops it without waiting: a step in progress (the software controller's
/// `posix_fadvise` of one block) may end in the background, no further step starts.
#[must_use = "the preparation stops when this is dropped"]
pub struct ReadAhead(Option<Box<dyn Send>>);

impl ReadAhead {
    /// Nothing prepared.
    pub fn none() -> Self {
        Self(None)
    }

    /// `work` runs until dropped (its `Drop` stops it, without waiting on hardware).
    pub fn running(work: Box<dyn Send>) -> Self {
        Self(Some(work))
    }

    /// Whether the transport prepares anything.
    pub fn is_running(&self) -> bool {
        self.0.is_some()
    }
}

impl std::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReadAhead")
            .field(&self.is_running())
            .finish()
    }
}

/// A transport that maps no memory after set-up (vfio-p2p and host-memory: every buffer the SSD
/// reaches is mapped when the queues are built).
#[derive(Debug)]
pub struct FixedMemory;

impl QueueTransport for FixedMemory {
    fn alloc_buffer(&self, _: &Arc<Cuda>, _: usize) -> Result<GpuBuffer, GpuError> {
        Err(GpuError::Unsupported("buffers on this transport".into()))
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Everything a transport built, for [`GpuQueues::assemble`].
pub struct QueueSetParts {
    /// Which transport.
    pub kind: TransportKind,
    /// Where bringing the queues up took its time, so far ([`SetupPhases`]; empty where the
    /// transport does not say).
    pub setup: SetupPhases,
    /// The queue pairs, in the order kernels index them.
    pub pairs: Vec<GpuQueuePair>,
    /// The host's abort word (a pinned page).
    pub host_flags: PinnedMemory,
    /// Whatever keeps the doorbells (and shared arenas) reachable, dropped after the queues
    /// are deleted.
    pub keep: Box<dyn Send + Sync>,
    /// The stream client kernels run on.
    pub client_stream: Stream,
    /// The loaded kernels.
    pub kernels: Arc<Kernels>,
    /// The SM partition (controller's, clients').
    pub partition: Arc<GreenPartition>,
    /// The geometry the pairs were built with.
    pub plan: Plan,
    /// The transport itself.
    pub backend: Arc<dyn QueueTransport>,
}

/// Where bringing a set of queues up took its time: named phases in order, each's seconds
/// (`mark` closes the phase that ran since the last mark).
#[derive(Clone, Debug)]
pub struct SetupPhases {
    last: Instant,
    phases: Vec<(&'static str, f64)>,
}

impl Default for SetupPhases {
    fn default() -> Self {
        Self::start()
    }
}

impl SetupPhases {
    /// Starts timing now.
    pub fn start() -> Self {
        Self {
            last: Instant::now(),
            phases: Vec::new(),
        }
    }

    /// Ends phase `name` (the time since the last mark, or the start).
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.phases
            .push((name, now.duration_since(self.last).as_secs_f64()));
        self.last = now;
    }

    /// Records `name`, work that ran on another thread beside the phases marked here (its own
    /// duration, not part of their sum), without moving the mark.
    pub fn record(&mut self, name: &'static str, took: std::time::Duration) {
        self.phases.push((name, took.as_secs_f64()));
    }

    /// The phases, in order: (name, seconds).
    pub fn phases(&self) -> &[(&'static str, f64)] {
        &self.phases
    }
}

/// A set of I/O queue pairs in GPU memory on one controller, and what kernels need to use them.
pub struct GpuQueues {
    // Field order is drop order: after `Drop::drop` deleted the queues, their memory goes,
    // then whatever kept doorbells reachable, then the transport.
    pairs: Vec<GpuQueuePair>,
    descs: DeviceMemory,
    host_flags: PinnedMemory,
    _keep: Box<dyn Send + Sync>,
    backend: Arc<dyn QueueTransport>,
    client_stream: Stream,
    kernels: Arc<Kernels>,
    partition: Arc<GreenPartition>,
    transport: TransportKind,
    depth: u32,
    slot_buffer_bytes: u32,
    max_transfer: u32,
    cuda: Arc<Cuda>,
    setup: SetupPhases,
}

impl std::fmt::Debug for GpuQueues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuQueues")
            .field("queues", &self.pairs.len())
            .field("depth", &self.depth)
            .field("transport", &self.transport)
            .finish()
    }
}

/// `len` bytes of GPU memory starting at a page boundary: the allocation (one page larger) and
/// the aligned address.
pub fn aligned_arena(cuda: &Arc<Cuda>, len: usize) -> Result<(Arc<DeviceMemory>, u64), GpuError> {
    let mem = Arc::new(DeviceMemory::alloc(cuda, len + 4096)?);
    let base = mem.ptr().next_multiple_of(4096);
    Ok((mem, base))
}

fn pow2_floor(v: u32) -> u32 {
    if v == 0 {
        0
    } else {
        1 << (31 - v.leading_zeros())
    }
}

impl GpuQueues {
    /// Assembles the queues a transport built ([`QueueSetParts`]): uploads their descriptors
    /// for kernels. Every transport ends here: the real-SSD transports of
    /// [`crate::transport`] and the emulated controllers of the `gpu_emu` crate.
    pub fn assemble(cuda: &Arc<Cuda>, parts: QueueSetParts) -> Result<Self, GpuError> {
        let QueueSetParts {
            kind,
            mut setup,
            pairs,
            host_flags,
            keep,
            client_stream,
            kernels,
            partition,
            plan,
            backend,
        } = parts;
        let descs = upload_descs(cuda, &pairs)?;
        setup.mark("descriptors");
        Ok(Self {
            pairs,
            descs,
            host_flags,
            _keep: keep,
            backend,
            client_stream,
            kernels,
            partition,
            transport: kind,
            depth: plan.depth,
            slot_buffer_bytes: plan.slot_buffer_bytes,
            max_transfer: plan.max_transfer,
            cuda: cuda.clone(),
            setup,
        })
    }

    /// Where bringing these queues up took its time ([`SetupPhases`]).
    pub fn setup_phases(&self) -> &SetupPhases {
        &self.setup
    }

    /// Allocates `len` bytes of GPU memory the controller can reach (for reads and writes of
    /// LBA ranges into arbitrary GPU buffers); [`GpuError::Unsupported`] where the transport
    /// cannot map more memory for the controller after set-up.
    pub fn alloc_buffer(&self, len: usize) -> Result<GpuBuffer, GpuError> {
        self.backend.alloc_buffer(&self.cuda, len)
    }

    /// Whether [`GpuQueues::alloc_buffer`] gives host memory mapped into the GPU, not GPU
    /// memory ([`QueueTransport::buffers_in_host_memory`]): a served controller's, whose
    /// daemon lends host memory. (A vfio-user target's are host memory too, but staging there
    /// is not yet correct: SPDK's target stopped answering under it, so it keeps reading into
    /// its mapped buffers.)
    pub fn buffers_in_host_memory(&self) -> bool {
        self.backend.buffers_in_host_memory()
    }

    /// `mem` (GPU memory allocated elsewhere) made reachable by the controller while the
    /// returned buffer lives ([`QueueTransport::map_memory`]; [`GpuError::Unsupported`] on
    /// transports that cannot, where callers stage through [`GpuQueues::alloc_buffer`]).
    pub fn map_memory(&self, mem: Arc<DeviceMemory>) -> Result<GpuBuffer, GpuError> {
        self.backend.map_memory(&self.cuda, mem)
    }

    /// Hints that Reads of `runs` (first LBA, LBAs) of namespace `nsid` will come soon
    /// ([`QueueTransport::will_read`]); the preparation lasts until the result is dropped.
    pub fn will_read(&self, nsid: u32, lba_shift: u32, runs: &[(u64, u64)]) -> ReadAhead {
        self.backend.will_read(nsid, lba_shift, runs)
    }

    /// What serves these queues, for callers that know its type (an emulated controller's
    /// statistics: `backend().as_any().downcast_ref::<T>()`).
    pub fn backend(&self) -> &Arc<dyn QueueTransport> {
        &self.backend
    }

    /// GPU pointer of the `[QueueDesc]` array kernels take.
    pub fn descriptors(&self) -> u64 {
        self.descs.ptr()
    }

    /// The descriptors, as the host built them.
    pub fn descs(&self) -> Vec<QueueDesc> {
        self.pairs.iter().map(|p| p.desc).collect()
    }

    /// Queue pairs.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Entries per ring.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Bytes of each slot buffer.
    pub fn slot_buffer_bytes(&self) -> u32 {
        self.slot_buffer_bytes
    }

    /// Most bytes per command.
    pub fn max_transfer(&self) -> u32 {
        self.max_transfer
    }

    /// The transport in use.
    pub fn transport(&self) -> TransportKind {
        self.transport
    }

    /// One line for humans: transport, GPU, partition.
    pub fn describe(&self) -> String {
        format!(
            "{} on {} ({} SMs for the controller's kernels, {} for clients)",
            self.transport.name(),
            self.cuda.name(),
            self.partition.controller_sms(),
            self.partition.client_sms()
        )
    }

    /// The stream client kernels run on (the clients' SM partition).
    pub fn client_stream(&self) -> &Stream {
        &self.client_stream
    }

    /// A new stream in the clients' SM partition, for work of a caller's own that must be
    /// ordered with GPU file transfers (`blockfs_gpu::GpuFiles::submit_on`). Client kernels
    /// that wait on the queues must run there, not on the SMs reserved for the controller.
    pub fn new_client_stream(&self) -> Result<Stream, GpuError> {
        Stream::new(&self.cuda, Placement::Client, Some(&self.partition))
    }

    /// The loaded kernels.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }

    /// The GPU.
    pub fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    /// Tells every device-side wait on these queues to stop with `GPUNVME_ABORTED`.
    pub fn abort(&self) {
        self.host_flags.store_u32(0, crate::desc::HOST_ABORT);
    }

    /// Clears the abort flag.
    pub fn clear_abort(&self) {
        self.host_flags.store_u32(0, 0);
    }

    /// Reads back every queue's protocol state (diagnostics and tests).
    pub fn queue_states(&self) -> Result<Vec<QueueState>, GpuError> {
        let mut out = Vec::with_capacity(self.pairs.len());
        for p in &self.pairs {
            let mut st = QueueState::default();
            p.state
                .read(0, zerocopy::IntoBytes::as_mut_bytes(&mut st))?;
            out.push(st);
        }
        Ok(out)
    }
}

/// How long teardown waits for the queues' client stream after aborting every device-side
/// wait (each checks the abort word at least every 500 µs, so kernels end well within it).
const TEARDOWN_WAIT: Duration = Duration::from_secs(2);

impl Drop for GpuQueues {
    fn drop(&mut self) {
        // Make any straggling device-side wait give up and let the client stream's kernels end
        // (bounded), then delete the queues (CQ after SQ) through the admin queue, then tell
        // the transport (an emulator stops reading their doorbells). A kernel still running
        // after the bound could ring one of these doorbells later: the queue ids are then
        // retired, never handed to a newer pair on this controller (review M2). Kernels the
        // caller launched on streams of its own must have ended before the queues drop.
        self.abort();
        let idle = match self.client_stream.wait_idle(TEARDOWN_WAIT) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "GPU client kernels still running at queue teardown; retiring the queue ids");
                false
            }
        };
        // Every pair's deletions in flight together on the admin queue (a few round trips,
        // not two per pair).
        let created: Vec<CreatedQueuePair> = self
            .pairs
            .iter_mut()
            .filter_map(|p| p.created.take())
            .collect();
        let qids: Vec<u16> = created.iter().map(|c| c.qid()).collect();
        if let Err(e) = CreatedQueuePair::delete_all(created, !idle) {
            tracing::warn!(error = %e, "deleting GPU queue pairs");
        }
        for qid in qids {
            self.backend.queue_deleted(qid);
        }
        self.backend.queues_dropped(idle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_ssds_wait_thirty_seconds_unless_told_otherwise() {
        let ten = Duration::from_secs(10);
        assert_eq!(
            timeout_from(None, false, REAL_SSD_TIMEOUT).unwrap(),
            REAL_SSD_TIMEOUT
        );
        assert_eq!(timeout_from(None, false, ten).unwrap(), ten);
        let three = GpuQueueOptions {
            timeout: Some(Duration::from_secs(3)),
            ..Default::default()
        };
        assert_eq!(three.real_ssd_timeout().unwrap(), Duration::from_secs(3));
        assert_eq!(three.timeout().unwrap(), Duration::from_secs(3));
    }

    #[test]
    fn device_timeouts_are_clamped_to_one_millisecond_through_one_hour() {
        assert_eq!(clamp_timeout(Duration::ZERO), 1_000_000);
        assert_eq!(clamp_timeout(Duration::from_secs(10)), 10_000_000_000);
        assert_eq!(clamp_timeout(Duration::MAX), 3_600_000_000_000);
    }

    #[test]
    fn prebuilt_lists_name_pages_after_the_first_of_each_slot() {
        assert_eq!(prebuilt_prp_lists(4, 8192, 0x10_0000), None);
        let l = prebuilt_prp_lists(4, 16384, 0x10_0000).unwrap();
        assert_eq!(l.len(), 4 * 2 * 512);
        assert_eq!(&l[..4], &[0x10_1000, 0x10_2000, 0x10_3000, 0]);
        assert_eq!(
            &l[3 * 1024..3 * 1024 + 3],
            &[0x10_d000, 0x10_e000, 0x10_f000]
        );
        assert!(
            l[512..1024].iter().all(|&e| e == 0),
            "second page of a slot is left empty"
        );
        // The rows are the lists' non-zero starts, one per slot, in slot order.
        let rows = prebuilt_prp_rows(4, 16384, 0x10_0000).unwrap();
        assert_eq!(rows.len(), 4 * 3);
        for (s, r) in rows.chunks(3).enumerate() {
            let at = s * PRP_LIST_PITCH / 8;
            assert_eq!(r, &l[at..at + 3], "slot {s}");
        }
        assert_eq!(prebuilt_prp_rows(4, 8192, 0x10_0000), None);
    }

    #[test]
    fn the_default_bounds_follow_the_setting_and_the_sanitizer() {
        // The setting rules; the sanitizer lengthens the default; a bad value is an error.
        let ten = Duration::from_secs(10);
        assert_eq!(timeout_from(None, false, ten).unwrap(), ten);
        assert_eq!(
            timeout_from(None, true, ten).unwrap(),
            Duration::from_secs(120)
        );
        assert_eq!(
            timeout_from(Some("30"), true, ten).unwrap(),
            Duration::from_secs(30)
        );
        for bad in ["0", "x", "3601"] {
            let e = timeout_from(Some(bad), false, ten).unwrap_err().to_string();
            assert!(e.contains("GPUNVME_GPU_TIMEOUT_S="), "{e}");
        }
        // Compute kernels: a minute on a GPU, ten on CPU threads or under the sanitizer.
        assert_eq!(compute_wait_from(false, false), Duration::from_secs(60));
        assert_eq!(compute_wait_from(true, false), Duration::from_secs(600));
        assert_eq!(compute_wait_from(false, true), Duration::from_secs(600));
    }

    #[test]
    fn slots_start_free_for_their_first_ticket() {
        let s = initial_slots(4);
        assert_eq!(
            s.iter().map(|x| x.released).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(s[1].ticket, 1u32.wrapping_sub(4));
        assert_eq!(initial_state().cq_phase, 1);
    }
}
