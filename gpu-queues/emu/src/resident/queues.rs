//! Queue pairs in GPU memory served by the GPU-resident controller model: rings, PRP-list
//! pages and slot buffers in four arenas registered as the model's windows, doorbells the
//! model's words in GPU memory, device addresses GPU pointers ([`queues`]); and the model as the
//! runtime's [`QueueTransport`] ([`ModelTransport`]).
#![forbid(unsafe_code)]

use std::sync::Arc;

use gpu_queues::GpuError;
use gpu_queues::desc::QF_LOCAL_PEER;
use gpu_queues::ffi::{Cuda, DeviceMemory, PinnedMemory, Placement, Stream};
use gpu_queues::queues::{
    DescCommon, DescParts, GpuBuffer, GpuQueueOptions, GpuQueuePair, GpuQueues, PRP_LIST_PITCH,
    Plan, QueueSetParts, QueueTransport, SetupPhases, TransportKind, aligned_arena,
    alloc_protocol_states, plan, prebuilt_prp_rows,
};
use nvme::{Controller, DmaRegion, QueueRegions};
use zerocopy::IntoBytes;

use super::GpuController;

/// The GPU-resident controller model as the runtime sees it.
#[derive(Debug)]
pub struct ModelTransport {
    gpu: Arc<GpuController>,
}

impl ModelTransport {
    /// The transport of `queues`, when it is the model.
    pub fn of(queues: &gpu_queues::GpuQueues) -> Option<&Self> {
        queues.backend().as_any().downcast_ref::<Self>()
    }

    /// The model serving the queues.
    pub fn controller(&self) -> &Arc<GpuController> {
        &self.gpu
    }
}

impl QueueTransport for ModelTransport {
    fn alloc_buffer(&self, cuda: &Arc<Cuda>, len: usize) -> Result<GpuBuffer, GpuError> {
        let len = len.next_multiple_of(4096);
        let (mem, base) = aligned_arena(cuda, len)?;
        let guard = self.gpu.register_window(base, len as u64)?;
        let region = DmaRegion::contiguous(base, len, Box::new((guard, mem.clone())));
        let offset = (base - mem.ptr()) as usize;
        Ok(GpuBuffer::new(mem, offset, region))
    }

    fn map_memory(&self, _: &Arc<Cuda>, mem: Arc<DeviceMemory>) -> Result<GpuBuffer, GpuError> {
        // Device addresses are GPU pointers here: the window is the memory itself (its exact
        // range, so the controller reaches no byte outside the caller's allocation). The DMA
        // region is whole pages, and memory allocated elsewhere may start inside one (a
        // framework's small tensors are 512-byte aligned): the buffer starts `lead` bytes in.
        let guard = self.gpu.register_window(mem.ptr(), mem.len() as u64)?;
        let base = mem.ptr() & !4095;
        let lead = (mem.ptr() - base) as usize;
        let pages = (lead + mem.len()).next_multiple_of(4096);
        let region = DmaRegion::contiguous(base, pages, Box::new((guard, mem.clone())));
        Ok(GpuBuffer::starting_at(mem, 0, region, lead))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Builds queue pairs in GPU memory on `controller`, whose I/O queues the GPU-resident
/// controller model `gpu` serves (it must have been started on the same software
/// controller, before this call). Rings, PRP-list pages and slot buffers come from four
/// arenas registered as the model's windows; doorbells are the model's words in GPU
/// memory; device addresses are GPU pointers.
pub fn queues(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    gpu: &Arc<GpuController>,
    opts: &GpuQueueOptions,
) -> Result<GpuQueues, GpuError> {
    let plan = plan(controller.info(), opts)?;
    let Plan {
        depth,
        slot_buffer_bytes,
        count,
        ..
    } = plan;
    let n = count as usize;
    let d = depth as usize;
    let sq_bytes = (d * 64).next_multiple_of(4096);
    let cq_bytes = (d * 16).next_multiple_of(4096);
    let prp_bytes = d * PRP_LIST_PITCH;
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
    let common = DescCommon::new(&plan, &host_flags, opts.timeout()?, QF_LOCAL_PEER);
    let client_stream = Stream::new(cuda, Placement::Client, Some(gpu.partition()))?;
    let region = |mem: &Arc<DeviceMemory>, base: u64, off: usize, len: usize| {
        DmaRegion::contiguous(base + off as u64, len, Box::new(mem.clone()))
    };
    let states = alloc_protocol_states(cuda, depth, n)?;
    let mut pairs = Vec::with_capacity(n);
    for (q, (state, slots)) in states.into_iter().enumerate() {
        let (sq_off, cq_off) = (q * sq_bytes, q * cq_bytes);
        let (prp_bus, buf_bus) = (
            prp_base + (q * prp_bytes) as u64,
            buf_base + (q * buf_bytes) as u64,
        );
        // The arena is zeroed: only each slot's entries are written.
        if let Some(rows) = prebuilt_prp_rows(depth, slot_buffer_bytes, buf_bus) {
            let row = rows.len() / depth as usize * size_of::<u64>();
            prps.write_rows(
                (prp_bus - prps.ptr()) as usize,
                rows.as_bytes(),
                row,
                PRP_LIST_PITCH,
            )?;
        }
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
            keep: vec![Box::new(vec![state, slots])],
        });
    }
    tracing::info!(
        queues = count,
        depth,
        slot_buffer_bytes,
        "GPU queues created on the GPU controller"
    );
    GpuQueues::assemble(
        cuda,
        QueueSetParts {
            setup: SetupPhases::default(),
            kind: TransportKind::GpuController,
            pairs,
            host_flags,
            // Dropped after the queues are deleted: the windows, then the arenas.
            keep: Box::new((windows, vec![sqs, cqs, prps, bufs])),
            client_stream,
            kernels: gpu.kernels().clone(),
            partition: gpu.partition().clone(),
            plan,
            backend: Arc::new(ModelTransport { gpu: gpu.clone() }),
        },
    )
}
