//! The vfio-user transport: a controller another process serves over vfio-user (SPDK's NVMe-oF
//! target), driven by GPU threads.
//!
//! The host-memory transport's layout on ordinary shared memory: every queue pair's rings,
//! PRP-list pages and slot buffers in one arena of the controller's own DMA memory
//! (`nvme::Device::alloc_dma`, here a memfd shared with the server by descriptor) registered
//! with CUDA (DEVICEMAP | PORTABLE), and the doorbell page the server shares and polls,
//! registered likewise. GPU threads write SQEs, ring doorbells and read CQEs with system-scope
//! stores and loads over PCIe; the server reads and writes the same pages from its CPU. Nothing
//! here is peer to peer, so neither root nor an untranslated GPU is needed.
//!
//! One arena for all pairs, because libvfio-user accepts 16 DMA regions per client: a region
//! per pair would cap the queue count.
//!
//! Buffers for commands into "GPU memory" ([`GpuQueues::alloc_buffer`]: files read with
//! `fs get --gpu`, the page cache's frames) are host memory here too, shared with the server
//! and registered with CUDA: the server cannot reach GPU memory, so GPU threads read the data
//! over PCIe where they use it. Each buffer is a DMA region of its own (at least half a
//! 64 MiB chunk), so about a dozen can be live at once.
#![forbid(unsafe_code)]

use std::sync::Arc;

use nvme::Controller;

use crate::error::GpuError;
use crate::ffi::Cuda;
use crate::ffi::os::{Bar0Doorbells, HostArena};
use crate::queues::{GpuBuffer, GpuQueueOptions, GpuQueues, QueueTransport, TransportKind, plan};
use crate::transport::build::{Arena, QueueLayout, Transport, build_queues};

/// Builds GPU queues on the controller served at `dev`'s socket.
pub fn build(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    dev: Arc<vfio::VfioUserNvme>,
    opts: &GpuQueueOptions,
) -> Result<GpuQueues, GpuError> {
    let doorbells = Bar0Doorbells::register_shared(cuda, dev.clone())?;
    let p = plan(controller.info(), opts)?;
    let layout = QueueLayout::new(p.depth, p.slot_buffer_bytes, 4096);
    let total = layout
        .len
        .checked_mul(p.count as usize)
        .ok_or_else(|| GpuError::InvalidArgument("queue memory overflows".into()))?;
    // Larger than half a chunk: a chunk of its own, so the CUDA registration shares no page
    // with the driver's other buffers.
    let arena = shared_arena(cuda, dev.as_ref(), total)?;
    tracing::info!(
        queues = p.count,
        bytes = total,
        gpu_ptr = format_args!("{:#x}", arena.gpu_ptr()),
        "vfio-user queue memory registered with CUDA"
    );
    let mut next = 0usize;
    build_queues(
        cuda,
        controller,
        Transport {
            kind: TransportKind::VfioUser,
            doorbells,
            align: 4096,
            backend: Arc::new(SharedBuffers { dev }),
        },
        opts,
        |len| {
            let base = next;
            let end = base
                .checked_add(len)
                .filter(|&e| e <= arena.memory().len())
                .ok_or_else(|| {
                    GpuError::InvalidArgument(format!(
                        "queue pair memory {base:#x}+{len:#x} past the {:#x}-byte arena",
                        arena.memory().len()
                    ))
                })?;
            next = end;
            let writer = arena.clone();
            Ok(Arena {
                gpu: arena.gpu_ptr() + base as u64,
                bus: arena.memory().device_address(base),
                len,
                owner: arena.clone(),
                write: Box::new(move |off, data| {
                    if off.checked_add(data.len()).is_none_or(|e| e > len) {
                        return Err(GpuError::InvalidArgument(format!(
                            "write {off:#x}+{:#x} outside a {len:#x}-byte queue pair arena",
                            data.len()
                        )));
                    }
                    writer.memory().write(base + off, data);
                    Ok(())
                }),
            })
        },
    )
}

/// `len` bytes (at least) of memory shared with the server, in a DMA region of its own, and
/// registered with CUDA.
fn shared_arena(
    cuda: &Arc<Cuda>,
    dev: &vfio::VfioUserNvme,
    len: usize,
) -> Result<Arc<HostArena>, GpuError> {
    // Larger than half a chunk: a chunk of its own, so the CUDA registration shares no page
    // with the driver's other buffers.
    Ok(Arc::new(HostArena::alloc_contiguous(
        cuda,
        dev,
        len.max(vfio::user::CHUNK_SIZE / 2 + 4096),
        " (vfio-user)",
    )?))
}

/// Buffers for the vfio-user transport: host memory shared with the server, registered with CUDA.
struct SharedBuffers {
    dev: Arc<vfio::VfioUserNvme>,
}

impl QueueTransport for SharedBuffers {
    fn alloc_buffer(&self, cuda: &Arc<Cuda>, len: usize) -> Result<GpuBuffer, GpuError> {
        let len = len.max(1).next_multiple_of(4096);
        let arena = shared_arena(cuda, &self.dev, len)?;
        let mem = Arc::new(arena.as_device_memory(cuda, len)?);
        let region = nvme::DmaRegion::contiguous(
            arena.memory().device_address(0),
            len,
            Box::new(arena.clone()),
        );
        Ok(GpuBuffer::new(mem, 0, region))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
