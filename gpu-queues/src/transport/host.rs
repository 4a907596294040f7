//! The host-memory transport: a real SSD behind VFIO, with rings and data in host memory.
//!
//! Per queue pair, one arena of the SSD's own DMA memory (`nvme::Device::alloc_dma`: hugepages
//! mapped by VFIO, a chunk of its own) registered with CUDA (`cuMemHostRegister`, DEVICEMAP):
//! GPU threads write SQEs and read CQEs and data over PCIe, the SSD reaches the memory as any
//! DMA buffer, and only the doorbell write goes peer to peer (BAR0 registered with CUDA, as in
//! vfio-p2p). Works without P2P-capable GPU memory; still refused unless the GPU's DMA is
//! untranslated, since the doorbell write is the GPU's.
#![forbid(unsafe_code)]

use std::sync::Arc;

use nvme::Controller;

use crate::error::GpuError;
use crate::ffi::Cuda;
use crate::ffi::os::{Bar0Doorbells, HostArena};
use crate::queues::{FixedMemory, GpuQueueOptions, GpuQueues, TransportKind};
use crate::transport::TransportOptions;
use crate::transport::build::{Arena, Transport, build_queues};
use crate::transport::p2p::check_gpu_doorbells;

/// Smallest request that gets a VFIO DMA chunk of its own (vfio's `DEDICATED_ABOVE` + a page),
/// so no two registrations with CUDA share a page.
pub const MIN_ARENA: usize = (1 << 20) + 4096;

/// Builds GPU queues with rings and data in host memory on the SSD behind `vfio`.
pub fn build(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    vfio: Arc<vfio::VfioNvme>,
    opts: &GpuQueueOptions,
    topts: &TransportOptions,
) -> Result<GpuQueues, GpuError> {
    check_gpu_doorbells(cuda, topts)?;
    let doorbells = Bar0Doorbells::register(cuda, vfio)?;
    build_queues(
        cuda,
        controller,
        Transport {
            kind: TransportKind::HostMemory,
            doorbells,
            align: 4096,
            backend: Arc::new(FixedMemory),
        },
        opts,
        |len| host_arena(cuda, controller, len),
    )
}

fn host_arena(cuda: &Arc<Cuda>, controller: &Controller, len: usize) -> Result<Arena, GpuError> {
    let arena = Arc::new(HostArena::alloc_contiguous(
        cuda,
        controller.device().as_ref(),
        len.max(MIN_ARENA),
        " (no-IOMMU mode without hugepages?)",
    )?);
    let (gpu, bus, total) = (
        arena.gpu_ptr(),
        arena.memory().device_address(0),
        arena.memory().len(),
    );
    let writer = arena.clone();
    Ok(Arena {
        gpu,
        bus,
        len: total,
        owner: arena,
        write: Box::new(move |off, data| {
            if off
                .checked_add(data.len())
                .is_none_or(|e| e > writer.memory().len())
            {
                return Err(GpuError::InvalidArgument(format!(
                    "write {off:#x}+{:#x} outside the arena",
                    data.len()
                )));
            }
            writer.memory().write(off, data);
            Ok(())
        }),
    })
}
