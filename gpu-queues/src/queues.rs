//! [`GpuQueues`]: NVMe I/O queue pairs in GPU memory, created through the CPU admin queue of
//! the same [`nvme::Controller`] that serves CPU queues, described to kernels by a
//! [`QueueDesc`] array in GPU memory.
//!
//! For every queue pair this allocates, in GPU memory: the SQ and CQ rings (`depth` entries
//! each, `depth` a power of two so tickets wrap cleanly), the protocol state
//! ([`QueueState`], [`SlotState`]s), one PRP-list page per slot and one data buffer per slot
//! whose PRP list is pre-built at creation (so the hot path builds none). The controller learns
//! the rings' device addresses through Create I/O CQ/SQ on the CPU admin queue.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use nvme::{Controller, CreatedQueuePair, DmaRegion, QueueRegions};
use nvme_emu::{DeviceAddressMap, EmuDevice};
use zerocopy::IntoBytes;

use crate::desc::{QF_LOCAL_PEER, QueueDesc, QueueState, SlotState};
use crate::emu_dma::{CopyMode, DmaStats, GpuDma, GpuRegion, PinnedDoorbell};
use crate::error::GpuError;
use crate::ffi::{Cuda, DeviceMemory, GreenPartition, PinnedMemory, Placement, Stream};
use crate::gpu_controller::GpuController;
use crate::kernels::Kernels;

/// Bytes between two queues' doorbell pairs in the pinned doorbell page (a cache line each,
/// so the controller's polling of one queue does not share a line with another's writes).
const DOORBELL_STRIDE: usize = 64;
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
    /// Bound of every device-side wait (default 10 s, or `GPUNVME_GPU_TIMEOUT_S` seconds: tools
    /// that slow kernels down many times, compute-sanitizer or the `host-gpu` build, need
    /// more).
    pub timeout: Duration,
    /// SMs reserved for the controller's own kernels (green context; default 8, the minimum
    /// partition on Hopper).
    pub controller_sms: u32,
}

impl Default for GpuQueueOptions {
    fn default() -> Self {
        Self {
            queues: None,
            depth: None,
            slot_buffer_bytes: None,
            timeout: default_timeout(),
            controller_sms: 8,
        }
    }
}

/// The environment variable that sets [`GpuQueueOptions::timeout`]'s default, in seconds.
pub const TIMEOUT_ENV: &str = "GPUNVME_GPU_TIMEOUT_S";

/// 10 s, or [`TIMEOUT_ENV`] when it holds a number of seconds from 1 to 3600 (anything else is
/// reported once and ignored: an options default cannot fail).
fn default_timeout() -> Duration {
    const DEFAULT: Duration = Duration::from_secs(10);
    match std::env::var(TIMEOUT_ENV) {
        Err(_) => DEFAULT,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(s) if (1..=3600).contains(&s) => Duration::from_secs(s),
            _ => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "{TIMEOUT_ENV}={v:?} ignored: expected whole seconds, 1 to 3600"
                    );
                });
                DEFAULT
            }
        },
    }
}

/// Which path carries doorbells and data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// (a) The software controller: rings and data in GPU memory reached with batched CUDA
    /// copies, doorbells in pinned host memory.
    SoftwareController,
    /// (b) A real SSD behind VFIO: rings and data in GPU memory, mapped for the SSD through a
    /// CPU mapping of the GPU's BAR1; the SSD's BAR0 doorbells registered with CUDA.
    VfioP2p,
    /// (c) A real SSD behind VFIO: rings and data in hugepage host memory mapped for the SSD and
    /// registered with CUDA; only the doorbell write goes peer to peer.
    HostMemory,
    /// The GPU-resident controller model ([`crate::gpu_controller`]): rings, doorbells and
    /// media in GPU memory, served by a persistent kernel on reserved SMs.
    GpuController,
}

impl TransportKind {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::SoftwareController => "software-controller",
            Self::VfioP2p => "vfio-p2p",
            Self::HostMemory => "host-memory",
            Self::GpuController => "gpu-controller",
        }
    }

    /// The letter the design gives it: "(a)", "(b)", "(c)".
    pub fn label(self) -> &'static str {
        match self {
            Self::SoftwareController => "(a)",
            Self::VfioP2p => "(b)",
            Self::HostMemory => "(c)",
            Self::GpuController => "(model)",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.label(), self.name())
    }
}

/// Queue geometry every transport derives the same way from the controller and the options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) depth: u32,
    pub(crate) slot_buffer_bytes: u32,
    pub(crate) count: u16,
    pub(crate) max_transfer: u32,
}

/// Checks the options against the controller: depth a power of two in 2..=min(CAP.MQES + 1,
/// 65536), slot buffers whole pages up to the maximum transfer, at least one queue.
pub(crate) fn plan(info: &nvme::ControllerInfo, opts: &GpuQueueOptions) -> Result<Plan, GpuError> {
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
pub(crate) fn prebuilt_prp_lists(
    depth: u32,
    slot_buffer_bytes: u32,
    buf_bus: u64,
) -> Option<Vec<u64>> {
    let pages_per_slot = slot_buffer_bytes as usize / 4096;
    if pages_per_slot <= 2 {
        return None;
    }
    let mut lists = vec![0u64; depth as usize * 2 * 512];
    for s in 0..depth as usize {
        let base = buf_bus + (s * slot_buffer_bytes as usize) as u64;
        for k in 1..pages_per_slot {
            lists[s * 2 * 512 + k - 1] = base + (k * 4096) as u64;
        }
    }
    Some(lists)
}

/// Slot states before the first command: slot s is free for ticket s.
pub(crate) fn initial_slots(depth: u32) -> Vec<SlotState> {
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
pub(crate) fn initial_state() -> QueueState {
    QueueState {
        cq_phase: 1,
        ..Default::default()
    }
}

/// A queue's protocol state and slot states in GPU memory, initialised for the first command.
pub(crate) fn alloc_protocol_state(
    cuda: &Arc<Cuda>,
    depth: u32,
) -> Result<(Arc<DeviceMemory>, Arc<DeviceMemory>), GpuError> {
    let state = Arc::new(DeviceMemory::alloc(cuda, size_of::<QueueState>())?);
    let slots = Arc::new(DeviceMemory::alloc(
        cuda,
        depth as usize * size_of::<SlotState>(),
    )?);
    slots.write(0, initial_slots(depth).as_bytes())?;
    state.write(0, initial_state().as_bytes())?;
    Ok((state, slots))
}

/// The queues' descriptors, in GPU memory for kernels (`const queue_desc*`).
fn upload_descs(cuda: &Arc<Cuda>, pairs: &[GpuQueuePair]) -> Result<DeviceMemory, GpuError> {
    let all: Vec<QueueDesc> = pairs.iter().map(|p| p.desc).collect();
    let descs = DeviceMemory::alloc(cuda, all.as_bytes().len())?;
    descs.write(0, all.as_bytes())?;
    Ok(descs)
}

/// What every queue of a set shares in its descriptor.
pub(crate) struct DescCommon {
    pub(crate) host_flags: u64,
    pub(crate) timeout_ns: u64,
    pub(crate) depth: u32,
    pub(crate) flags: u16,
    pub(crate) slot_buffer_bytes: u32,
    pub(crate) max_transfer: u32,
}

/// Where one queue's pieces are: GPU pointers, and device addresses where they differ.
pub(crate) struct DescParts {
    pub(crate) sq: u64,
    pub(crate) cq: u64,
    pub(crate) doorbells: (u64, u64),
    pub(crate) state: u64,
    pub(crate) slots: u64,
    pub(crate) prp_lists: (u64, u64),
    pub(crate) slot_buffers: (u64, u64),
    pub(crate) qid: u16,
}

impl DescCommon {
    pub(crate) fn desc(&self, p: DescParts) -> QueueDesc {
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
            reserved1: [0; 2],
        }
    }
}

/// A GPU buffer the controller can reach: its GPU pointer and its device (bus) address.
pub struct GpuBuffer {
    mem: Arc<DeviceMemory>,
    /// Where the buffer starts in `mem` (its device address is page aligned).
    offset: usize,
    region: DmaRegion,
}

impl std::fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuBuffer({:?} at {:#x})", self.mem, self.bus())
    }
}

impl GpuBuffer {
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
        self.region.device_address(0)
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }
    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.region.len() == 0
    }
    /// The GPU memory (for host-side copies in tests and tools).
    pub fn memory(&self) -> &DeviceMemory {
        &self.mem
    }
}

/// Removes a region from the software controller's address map when the last user goes.
struct Unregister {
    map: Arc<DeviceAddressMap>,
    base: u64,
}

impl Drop for Unregister {
    fn drop(&mut self) {
        self.map.unregister_region(self.base);
    }
}

pub(crate) struct GpuQueuePair {
    // Field order is drop order: the queues are deleted on the controller before their memory
    // is unregistered and freed (`_keep` drops its elements in order).
    pub(crate) created: Option<CreatedQueuePair>,
    pub(crate) desc: QueueDesc,
    /// The queue's [`QueueState`] (read back by [`GpuQueues::queue_states`]).
    pub(crate) state: Arc<DeviceMemory>,
    /// Whatever keeps the pair's memory alive and reachable by the controller.
    pub(crate) _keep: Vec<Box<dyn Send + Sync>>,
}

/// A set of I/O queue pairs in GPU memory on one controller, and what kernels need to use them.
pub struct GpuQueues {
    pairs: Vec<GpuQueuePair>,
    descs: DeviceMemory,
    host_flags: PinnedMemory,
    _doorbells: Box<dyn Send + Sync>,
    client_stream: Stream,
    kernels: Arc<Kernels>,
    engine: Option<Arc<GpuDma>>,
    emu: Option<Arc<EmuDevice>>,
    gpu_ctrl: Option<Arc<GpuController>>,
    partition: Arc<GreenPartition>,
    transport: TransportKind,
    depth: u32,
    slot_buffer_bytes: u32,
    max_transfer: u32,
    cuda: Arc<Cuda>,
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
fn aligned_arena(cuda: &Arc<Cuda>, len: usize) -> Result<(Arc<DeviceMemory>, u64), GpuError> {
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
    /// Builds queue pairs in GPU memory on `controller`, whose transport is the software
    /// controller `emu` (transport (a)): GPU memory is registered in its device-address map and
    /// each queue's doorbells are attached as pinned-host-page words before the queue exists.
    pub fn on_software_controller(
        cuda: &Arc<Cuda>,
        controller: &Controller,
        emu: &Arc<EmuDevice>,
        opts: &GpuQueueOptions,
    ) -> Result<Self, GpuError> {
        let Plan {
            depth,
            slot_buffer_bytes,
            count,
            max_transfer,
        } = plan(controller.info(), opts)?;

        let kernels = Kernels::load(cuda)?;
        let partition = GreenPartition::split(cuda, opts.controller_sms)?;
        let client_stream = Stream::new(cuda, Placement::Client, Some(&partition))?;
        kernels.warm_up(&client_stream)?;
        // One copy engine per controller thread, each warmed up on its own stream.
        let engine = GpuDma::new(cuda, &partition, emu.controller_threads(), kernels.clone())?;
        let doorbells = Arc::new(PinnedMemory::alloc(cuda, count as usize * DOORBELL_STRIDE)?);
        let host_flags = PinnedMemory::alloc(cuda, 4096)?;
        let common = DescCommon {
            host_flags: host_flags.device_ptr(),
            timeout_ns: opts.timeout.as_nanos().min(u64::MAX as u128) as u64,
            depth,
            flags: 0,
            slot_buffer_bytes,
            max_transfer,
        };
        let map = emu.address_map().clone();

        let register_as = |mem: Arc<DeviceMemory>, sq: bool| -> Result<DmaRegion, GpuError> {
            let region = Arc::new(if sq {
                GpuRegion::submission_queue(engine.clone(), mem.clone())
            } else {
                GpuRegion::new(engine.clone(), mem.clone())
            });
            let base = map.register_region(region)?;
            let len = mem.len().next_multiple_of(4096);
            Ok(DmaRegion::contiguous(
                base,
                len,
                Box::new((
                    Unregister {
                        map: map.clone(),
                        base,
                    },
                    mem,
                )),
            ))
        };

        let register = |mem: Arc<DeviceMemory>| register_as(mem, false);

        let mut pairs = Vec::with_capacity(count as usize);
        for q in 0..count as usize {
            let sq = Arc::new(DeviceMemory::alloc(
                cuda,
                (depth as usize * 64).next_multiple_of(4096),
            )?);
            let cq = Arc::new(DeviceMemory::alloc(
                cuda,
                (depth as usize * 16).next_multiple_of(4096),
            )?);
            // Two list pages per slot: the slot buffer's pre-built list, and one for `build_prps`.
            let prp = Arc::new(DeviceMemory::alloc(cuda, depth as usize * 2 * 4096)?);
            let bufs = Arc::new(DeviceMemory::alloc(
                cuda,
                depth as usize * slot_buffer_bytes as usize,
            )?);
            let (state, slots) = alloc_protocol_state(cuda, depth)?;

            let sq_region = Arc::new(register_as(sq.clone(), true)?);
            let cq_region = Arc::new(register(cq.clone())?);
            let prp_region = register(prp.clone())?;
            let buf_region = register(bufs.clone())?;
            let prp_bus = prp_region.device_address(0);
            let buf_bus = buf_region.device_address(0);

            // Pre-built PRP lists: slot s's list names pages 1.. of slot s's buffer.
            if let Some(lists) = prebuilt_prp_lists(depth, slot_buffer_bytes, buf_bus) {
                prp.write(0, lists.as_bytes())?;
            }
            let sq_word = Arc::new(PinnedDoorbell::new(doorbells.clone(), q * DOORBELL_STRIDE));
            let cq_word = Arc::new(PinnedDoorbell::new(
                doorbells.clone(),
                q * DOORBELL_STRIDE + 4,
            ));
            sq_word.reset();
            cq_word.reset();
            let (sq_db, cq_db) = (sq_word.device_ptr(), cq_word.device_ptr());
            let created = controller.create_queue_pair_on_with(
                QueueRegions {
                    sq: sq_region,
                    sq_entries: depth,
                    cq: cq_region,
                    cq_entries: depth,
                },
                |qid| {
                    emu.attach_external_doorbells(qid, sq_word, cq_word)
                        .map_err(|e| nvme::Error::Unsupported(format!("external doorbells: {e}")))
                },
            );
            let created = created?;
            let desc = common.desc(DescParts {
                sq: sq.ptr(),
                cq: cq.ptr(),
                doorbells: (sq_db, cq_db),
                state: state.ptr(),
                slots: slots.ptr(),
                prp_lists: (prp.ptr(), prp_bus),
                slot_buffers: (bufs.ptr(), buf_bus),
                qid: created.qid(),
            });
            pairs.push(GpuQueuePair {
                created: Some(created),
                desc,
                state: state.clone(),
                _keep: vec![
                    Box::new(prp_region),
                    Box::new(buf_region),
                    Box::new(vec![sq, cq, prp, bufs, state, slots]),
                ],
            });
        }
        let descs = upload_descs(cuda, &pairs)?;
        tracing::info!(
            queues = count,
            depth,
            slot_buffer_bytes,
            controller_sms = partition.controller_sms(),
            "GPU queues created on the software controller"
        );
        Ok(Self {
            pairs,
            descs,
            host_flags,
            _doorbells: Box::new(doorbells),
            client_stream,
            kernels,
            engine: Some(engine),
            emu: Some(emu.clone()),
            gpu_ctrl: None,
            partition,
            transport: TransportKind::SoftwareController,
            depth,
            slot_buffer_bytes,
            max_transfer,
            cuda: cuda.clone(),
        })
    }

    /// Builds queue pairs in GPU memory on `controller`, whose I/O queues the GPU-resident
    /// controller model `gpu` serves (it must have been started on the same software
    /// controller, before this call). Rings, PRP-list pages and slot buffers come from four
    /// arenas registered as the model's windows; doorbells are the model's words in GPU
    /// memory; device addresses are GPU pointers.
    pub fn on_gpu_controller(
        cuda: &Arc<Cuda>,
        controller: &Controller,
        gpu: &Arc<GpuController>,
        opts: &GpuQueueOptions,
    ) -> Result<Self, GpuError> {
        let plan = plan(controller.info(), opts)?;
        let Plan {
            depth,
            slot_buffer_bytes,
            count,
            max_transfer,
        } = plan;
        let n = count as usize;
        let d = depth as usize;
        let sq_bytes = (d * 64).next_multiple_of(4096);
        let cq_bytes = (d * 16).next_multiple_of(4096);
        let prp_bytes = d * 2 * 4096;
        let buf_bytes = d * slot_buffer_bytes as usize;
        // Four arenas, page aligned (device addresses of queues and PRP pages must be), each
        // one window of the model.
        let (sqs, sq_base) = aligned_arena(cuda, n * sq_bytes)?;
        let (cqs, cq_base) = aligned_arena(cuda, n * cq_bytes)?;
        let (prps, prp_base) = aligned_arena(cuda, n * prp_bytes)?;
        let (bufs, buf_base) = aligned_arena(cuda, n * buf_bytes)?;
        let windows: Vec<_> = [
            (sq_base, n * sq_bytes),
            (cq_base, n * cq_bytes),
            (prp_base, n * prp_bytes),
            (buf_base, n * buf_bytes),
        ]
        .into_iter()
        .map(|(base, len)| gpu.register_window(base, len as u64))
        .collect::<Result<_, _>>()?;
        let host_flags = PinnedMemory::alloc(cuda, 4096)?;
        let common = DescCommon {
            host_flags: host_flags.device_ptr(),
            timeout_ns: opts.timeout.as_nanos().min(u64::MAX as u128) as u64,
            depth,
            flags: QF_LOCAL_PEER,
            slot_buffer_bytes,
            max_transfer,
        };
        let client_stream = Stream::new(cuda, Placement::Client, Some(gpu.partition()))?;
        let region = |mem: &Arc<DeviceMemory>, base: u64, off: usize, len: usize| {
            DmaRegion::contiguous(base + off as u64, len, Box::new(mem.clone()))
        };
        let mut pairs = Vec::with_capacity(n);
        for q in 0..n {
            let (sq_off, cq_off) = (q * sq_bytes, q * cq_bytes);
            let (prp_bus, buf_bus) = (
                prp_base + (q * prp_bytes) as u64,
                buf_base + (q * buf_bytes) as u64,
            );
            if let Some(lists) = prebuilt_prp_lists(depth, slot_buffer_bytes, buf_bus) {
                prps.write((prp_bus - prps.ptr()) as usize, lists.as_bytes())?;
            }
            let (state, slots) = alloc_protocol_state(cuda, depth)?;
            let created = controller.create_queue_pair_on(QueueRegions {
                sq: Arc::new(region(&sqs, sq_base, sq_off, sq_bytes)),
                sq_entries: depth,
                cq: Arc::new(region(&cqs, cq_base, cq_off, cq_bytes)),
                cq_entries: depth,
            })?;
            // Identity device addresses: the model's windows are GPU pointers.
            let desc = common.desc(DescParts {
                sq: sq_base + sq_off as u64,
                cq: cq_base + cq_off as u64,
                doorbells: gpu.doorbells(created.qid())?,
                state: state.ptr(),
                slots: slots.ptr(),
                prp_lists: (prp_bus, prp_bus),
                slot_buffers: (buf_bus, buf_bus),
                qid: created.qid(),
            });
            pairs.push(GpuQueuePair {
                created: Some(created),
                desc,
                state: state.clone(),
                _keep: vec![Box::new(vec![state, slots])],
            });
        }
        let descs = upload_descs(cuda, &pairs)?;
        tracing::info!(
            queues = count,
            depth,
            slot_buffer_bytes,
            "GPU queues created on the GPU controller"
        );
        Ok(Self {
            pairs,
            descs,
            host_flags,
            // Dropped after the queues are deleted: the windows, then the arenas.
            _doorbells: Box::new((windows, vec![sqs, cqs, prps, bufs])),
            client_stream,
            kernels: gpu.kernels().clone(),
            engine: None,
            emu: None,
            gpu_ctrl: Some(gpu.clone()),
            partition: gpu.partition().clone(),
            transport: TransportKind::GpuController,
            depth,
            slot_buffer_bytes,
            max_transfer,
            cuda: cuda.clone(),
        })
    }

    /// Assembles queues a transport other than (a) built (`crate::transport`): no software
    /// controller, no copy engines; `doorbells` keeps the doorbells reachable by the GPU
    /// (dropped after the queues are deleted).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_parts(
        cuda: &Arc<Cuda>,
        transport: TransportKind,
        pairs: Vec<GpuQueuePair>,
        host_flags: PinnedMemory,
        doorbells: Box<dyn Send + Sync>,
        client_stream: Stream,
        kernels: Arc<Kernels>,
        partition: Arc<GreenPartition>,
        plan: Plan,
    ) -> Result<Self, GpuError> {
        let descs = upload_descs(cuda, &pairs)?;
        Ok(Self {
            pairs,
            descs,
            host_flags,
            _doorbells: doorbells,
            client_stream,
            kernels,
            engine: None,
            emu: None,
            gpu_ctrl: None,
            partition,
            transport,
            depth: plan.depth,
            slot_buffer_bytes: plan.slot_buffer_bytes,
            max_transfer: plan.max_transfer,
            cuda: cuda.clone(),
        })
    }

    /// Allocates `len` bytes of GPU memory the controller can reach (for reads and writes of
    /// LBA ranges into arbitrary GPU buffers).
    pub fn alloc_buffer(&self, len: usize) -> Result<GpuBuffer, GpuError> {
        if let Some(ctrl) = &self.gpu_ctrl {
            let len = len.next_multiple_of(4096);
            let (mem, base) = aligned_arena(&self.cuda, len)?;
            let guard = ctrl.register_window(base, len as u64)?;
            let region = DmaRegion::contiguous(base, len, Box::new((guard, mem.clone())));
            let offset = (base - mem.ptr()) as usize;
            return Ok(GpuBuffer {
                mem,
                offset,
                region,
            });
        }
        let (Some(emu), Some(engine)) = (&self.emu, &self.engine) else {
            return Err(GpuError::Unsupported("buffers on this transport".into()));
        };
        let mem = Arc::new(DeviceMemory::alloc(&self.cuda, len.next_multiple_of(4096))?);
        let map = emu.address_map().clone();
        let base = map.register_region(Arc::new(GpuRegion::new(engine.clone(), mem.clone())))?;
        let region = DmaRegion::contiguous(
            base,
            mem.len(),
            Box::new((Unregister { map, base }, mem.clone())),
        );
        Ok(GpuBuffer {
            mem,
            offset: 0,
            region,
        })
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
    /// ordered with GPU file transfers ([`crate::files::GpuFiles::submit_on`]). Client kernels
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

    /// What the copy engines did (totals over the controller's threads), for transport (a).
    pub fn dma_stats(&self) -> Option<DmaStats> {
        self.engine.as_ref().map(|e| e.stats())
    }

    /// How the software controller moves batches, for transport (a).
    pub fn copy_mode(&self) -> Option<CopyMode> {
        self.engine.as_ref().map(|e| e.mode())
    }

    /// Controller threads with a copy engine of their own, for transport (a).
    pub fn controller_threads(&self) -> Option<usize> {
        self.engine.as_ref().map(|e| e.engines())
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

impl Drop for GpuQueues {
    fn drop(&mut self) {
        // Make any straggling device-side wait give up, then delete the queues (CQ after SQ)
        // through the admin queue, then stop the controller reading their doorbells.
        self.abort();
        for p in &mut self.pairs {
            if let Some(created) = p.created.take() {
                let qid = created.qid();
                if let Err(e) = created.delete() {
                    tracing::warn!(qid, error = %e, "deleting a GPU queue pair");
                }
                if let Some(emu) = &self.emu {
                    emu.detach_external_doorbells(qid);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
