//! Queue pairs for the real-SSD transports (vfio-p2p, host-memory), on one arena of
//! SSD-reachable memory per pair; the geometry, PRP lists and initial state come from the same
//! helpers as the software-controller transport's.
#![forbid(unsafe_code)]

use std::sync::Arc;

use nvme::{Controller, DmaRegion, QueueRegions};
use zerocopy::IntoBytes;

use crate::error::GpuError;
use crate::ffi::os::Bar0Doorbells;
use crate::ffi::{Cuda, GreenPartition, PinnedMemory, Placement, Stream};
use crate::kernels::Kernels;
use crate::queues::{
    DescCommon, DescParts, GpuQueueOptions, GpuQueuePair, GpuQueues, QueueSetParts, QueueTransport,
    SetupPhases, TransportKind, alloc_protocol_state, plan, prebuilt_prp_lists,
};

/// Where one queue pair's SSD-visible pieces sit in its arena (byte offsets, each aligned to
/// `align`, which is a multiple of 4 KiB).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueLayout {
    /// SQ ring.
    pub sq: usize,
    /// CQ ring.
    pub cq: usize,
    /// PRP-list pages (two per slot).
    pub prp: usize,
    /// Slot buffers.
    pub bufs: usize,
    /// Bytes of the SQ ring (whole pages).
    pub sq_len: usize,
    /// Bytes of the CQ ring (whole pages).
    pub cq_len: usize,
    /// Bytes of the arena.
    pub len: usize,
}

impl QueueLayout {
    /// The layout for `depth` entries and slot buffers of `slot_buffer_bytes`.
    ///
    /// # Panics
    /// If `align` is not a multiple of 4 KiB (a caller bug).
    pub fn new(depth: u32, slot_buffer_bytes: u32, align: usize) -> Self {
        assert!(
            align >= 4096 && align % 4096 == 0,
            "arena alignment {align}"
        );
        let d = depth as usize;
        let sq_len = (d * 64).next_multiple_of(4096);
        let cq_len = (d * 16).next_multiple_of(4096);
        let sq = 0;
        let cq = (sq + sq_len).next_multiple_of(align);
        let prp = (cq + cq_len).next_multiple_of(align);
        let bufs = (prp + d * 2 * 4096).next_multiple_of(align);
        let len = (bufs + d * slot_buffer_bytes as usize).next_multiple_of(align);
        Self {
            sq,
            cq,
            prp,
            bufs,
            sq_len,
            cq_len,
            len,
        }
    }
}

/// Copies bytes into an arena at an offset (set-up only).
pub(crate) type ArenaWriter = Box<dyn Fn(usize, &[u8]) -> Result<(), GpuError>>;

/// One pair's memory, reachable by the SSD at `bus..bus + len` (contiguous) and by GPU threads
/// at `gpu..gpu + len`.
pub(crate) struct Arena {
    pub(crate) gpu: u64,
    pub(crate) bus: u64,
    pub(crate) len: usize,
    /// Keeps the memory alive and mapped for the SSD and the GPU.
    pub(crate) owner: Arc<dyn Send + Sync>,
    /// Copies bytes in at an offset (set-up only).
    pub(crate) write: ArenaWriter,
}

/// What a transport brings to [`build_queues`] besides the pairs' memory.
pub(crate) struct Transport {
    /// Which transport.
    pub(crate) kind: TransportKind,
    /// The controller's doorbells, registered with CUDA.
    pub(crate) doorbells: Bar0Doorbells,
    /// Alignment of each piece of a pair's arena (a multiple of 4 KiB).
    pub(crate) align: usize,
    /// Buffers for commands into arbitrary memory, where the transport has them.
    pub(crate) backend: Arc<dyn QueueTransport>,
}

/// Builds the queues of `t.kind`: `arena(len)` supplies each pair's memory; doorbells are the
/// controller's own, registered in `t.doorbells`.
pub(crate) fn build_queues(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    t: Transport,
    opts: &GpuQueueOptions,
    mut arena: impl FnMut(usize) -> Result<Arena, GpuError>,
) -> Result<GpuQueues, GpuError> {
    let Transport {
        kind,
        doorbells,
        align,
        backend,
    } = t;
    let p = plan(controller.info(), opts)?;
    let kernels = Kernels::load(cuda)?;
    let partition = GreenPartition::split(cuda, opts.controller_sms)?;
    let client_stream = Stream::new(cuda, Placement::Client, Some(&partition))?;
    // Every client kernel loaded before any of them spins (lazy loading: see
    // `Kernels::warm_up_clients`).
    kernels.warm_up_clients(cuda, &client_stream)?;
    let host_flags = PinnedMemory::alloc(cuda, 4096)?;
    // An SSD across PCIe: system-scope fences (no QF_LOCAL_PEER).
    // A real SSD: 30 s per wait unless the caller chose a bound (the emulators' 10 s is short
    // for an SSD busy with garbage collection).
    let timeout = opts.real_ssd_timeout()?;
    let common = DescCommon::new(&p, &host_flags, timeout, 0).with_protection(controller)?;
    let layout = QueueLayout::new(p.depth, p.slot_buffer_bytes, align);

    let mut pairs = Vec::with_capacity(p.count as usize);
    for _ in 0..p.count {
        let a = arena(layout.len)?;
        if a.len < layout.len {
            return Err(GpuError::InvalidArgument(format!(
                "arena of {:#x} bytes for a layout of {:#x}",
                a.len, layout.len
            )));
        }
        let region = |off: usize, len: usize| {
            Arc::new(DmaRegion::contiguous(
                a.bus + off as u64,
                len,
                Box::new(a.owner.clone()),
            ))
        };
        let prp_bus = a.bus + layout.prp as u64;
        let buf_bus = a.bus + layout.bufs as u64;
        // The arena may hold earlier contents (GPU memory is zeroed by `DeviceMemory::alloc`,
        // host DMA memory by the pool): the CQ must start with phase 0 everywhere.
        (a.write)(layout.cq, &vec![0u8; layout.cq_len])?;
        if let Some(lists) = prebuilt_prp_lists(p.depth, p.slot_buffer_bytes, buf_bus) {
            (a.write)(layout.prp, lists.as_bytes())?;
        }
        let (state, slots) = alloc_protocol_state(cuda, p.depth)?;

        let created = controller.create_queue_pair_on(QueueRegions {
            sq: region(layout.sq, layout.sq_len),
            sq_entries: p.depth,
            cq: region(layout.cq, layout.cq_len),
            cq_entries: p.depth,
        })?;
        let desc = common.desc(DescParts {
            sq: a.gpu + layout.sq as u64,
            cq: a.gpu + layout.cq as u64,
            doorbells: (
                doorbells.doorbell(created.sq_tail_doorbell())?,
                doorbells.doorbell(created.cq_head_doorbell())?,
            ),
            state: state.ptr(),
            slots: slots.ptr(),
            prp_lists: (a.gpu + layout.prp as u64, prp_bus),
            slot_buffers: (a.gpu + layout.bufs as u64, buf_bus),
            qid: created.qid(),
        });
        pairs.push(GpuQueuePair {
            created: Some(created),
            desc,
            state: state.clone(),
            keep: vec![Box::new(a.owner), Box::new((state, slots))],
        });
    }
    tracing::info!(
        transport = %kind,
        queues = p.count,
        depth = p.depth,
        slot_buffer_bytes = p.slot_buffer_bytes,
        doorbell_pages_touched = doorbells.pages_touched(),
        "GPU queues created on a VFIO controller"
    );
    GpuQueues::assemble(
        cuda,
        QueueSetParts {
            setup: SetupPhases::default(),
            kind,
            pairs,
            host_flags,
            keep: Box::new(doorbells),
            client_stream,
            kernels,
            partition,
            plan: p,
            backend,
        },
    )
}
