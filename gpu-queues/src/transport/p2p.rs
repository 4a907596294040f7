//! The vfio-p2p transport: a real SSD behind VFIO, with rings and data in GPU memory.
//!
//! Per queue pair, one arena of GPU memory (`cuMemAlloc`, 2 MiB multiples, 64 KiB aligned)
//! is mapped for the CPU through BAR1 ([`bar1::probe_bar1`]) and that CPU mapping for the SSD
//! with `VFIO_IOMMU_MAP_DMA` (type1 follows the PFNMAP's page tables), so the SSD reads SQEs and
//! PRP lists and writes CQEs and data peer to peer; GPU threads ring the SSD's BAR0 doorbells,
//! registered with CUDA ([`Bar0Doorbells`]). Refused unless the GPU's DMA is untranslated
//! ([`iommu::check_gpu_iommu`]) and the SSD is in a type1 container.
#![forbid(unsafe_code)]

use std::sync::Arc;

use nvme::Controller;

use crate::error::GpuError;
use crate::ffi::os::{Bar0Doorbells, SsdMapping};
use crate::ffi::{Cuda, DeviceMemory};
use crate::queues::{FixedMemory, GpuQueueOptions, GpuQueues, TransportKind};
use crate::transport::TransportOptions;
use crate::transport::bar1::{self, Bar1Env, GPU_PAGE};
use crate::transport::build::{Arena, Transport, build_queues};
use crate::transport::iommu;
use crate::transport::probe::{PROBE_BOUND, probe_read};

/// Arena granularity: cuMemAlloc of whole 2 MiB pages comes back 2 MiB aligned.
const ARENA_UNIT: usize = 2 << 20;

/// Checks what vfio-p2p and host-memory share: the GPU may write the SSD's doorbells. Returns
/// the GPU's PCI address.
pub(crate) fn check_gpu_doorbells(
    cuda: &Arc<Cuda>,
    topts: &TransportOptions,
) -> Result<String, GpuError> {
    let gpu = cuda.pci_bus_id()?;
    let state = iommu::check_gpu_iommu(&topts.sys_root, &gpu)?;
    tracing::info!(%gpu, iommu = %state, "GPU doorbell writes are not translated");
    Ok(gpu)
}

/// `CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER`.
const WRITES_ORDERING_OWNER: i32 = 100;

/// Refuses a GPU that does not keep an SSD's writes into its memory in order for its own
/// threads (below OWNER): the SSD's data writes could land after its completion entry, and a
/// GPU thread that saw the entry would read stale data, silently (review M1).
fn check_write_ordering(ordering: i32) -> Result<(), GpuError> {
    if ordering >= WRITES_ORDERING_OWNER {
        return Ok(());
    }
    Err(GpuError::Unsupported(format!(
        "the GPU orders peer-to-peer writes into its memory at level {ordering} \
         (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING below OWNER, {WRITES_ORDERING_OWNER}): \
         an SSD's data could land after its completion entry and GPU threads would read stale \
         data; the host-memory transport, with data in host memory, does not depend on it"
    )))
}

/// Builds GPU queues with rings and data in GPU memory on the SSD behind `vfio`.
pub fn build(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    vfio: Arc<vfio::VfioNvme>,
    opts: &GpuQueueOptions,
    topts: &TransportOptions,
) -> Result<GpuQueues, GpuError> {
    if vfio.iommu_mode() != vfio::IommuMode::Type1 {
        return Err(GpuError::Unsupported(format!(
            "{} is in {} mode; mapping GPU memory for it needs the type1 IOMMU",
            vfio.address(),
            vfio.iommu_mode()
        )));
    }
    let gpu = check_gpu_doorbells(cuda, topts)?;
    check_write_ordering(cuda.p2p_write_ordering()?)?;
    let env = Bar1Env {
        dev_root: topts.dev_root.clone(),
        sys_root: topts.sys_root.clone(),
        gpu,
        resource1_offset: topts.resource1_offset,
    };
    let doorbells = Bar0Doorbells::register(cuda, vfio.clone())?;
    let queues = build_queues(
        cuda,
        controller,
        Transport {
            kind: TransportKind::VfioP2p,
            doorbells,
            align: GPU_PAGE as usize,
            backend: Arc::new(FixedMemory),
        },
        opts,
        |len| gpu_arena(cuda, &vfio, &env, len),
    )?;
    // Set-up succeeding does not prove the SSD's writes reach GPU memory: one Read must.
    probe_read(&queues, controller, PROBE_BOUND).map_err(|why| {
        GpuError::Unsupported(format!(
            "the queues were built, but {why}; peer-to-peer DMA into GPU memory does not work              on this platform"
        ))
    })?;
    Ok(queues)
}

fn gpu_arena(
    cuda: &Arc<Cuda>,
    vfio: &vfio::VfioNvme,
    env: &Bar1Env,
    len: usize,
) -> Result<Arena, GpuError> {
    let mem = Arc::new(DeviceMemory::alloc(cuda, len.next_multiple_of(ARENA_UNIT))?);
    mem.set_sync_memops()?;
    let bar1 = bar1::probe_bar1(env, &*mem).map_err(|f| {
        GpuError::Unsupported(format!(
            "no CPU mapping of GPU memory that VFIO could map for the SSD: {f}"
        ))
    })?;
    let method = bar1.method();
    let map = bar1.mapping().clone();
    // Drop order inside: VFIO unmap, CPU unmap (last Arc), unpin, GPU memory free.
    let ssd = SsdMapping::new(vfio, map, Box::new((bar1, mem.clone())))?;
    tracing::debug!(%method, bus = format_args!("{:#x}", ssd.bus()), "GPU arena mapped for the SSD");
    let writer = mem.clone();
    Ok(Arena {
        gpu: mem.ptr(),
        bus: ssd.bus(),
        len: ssd.len(),
        owner: Arc::new(ssd),
        write: Box::new(move |off, data| writer.write(off, data)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_that_reorder_peer_writes_are_refused() {
        assert!(check_write_ordering(100).is_ok());
        assert!(check_write_ordering(200).is_ok());
        let e = check_write_ordering(0).unwrap_err();
        assert!(
            matches!(&e, GpuError::Unsupported(m) if m.contains("below OWNER")),
            "{e}"
        );
    }
}
