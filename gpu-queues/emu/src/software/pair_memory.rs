//! Where a queue pair's rings, PRP-list pages and slot buffers live ([`RingPlacement`]), and
//! their allocation and registration for either placement ([`PairMemory`]).

use std::sync::Arc;

use gpu_queues::GpuError;
use gpu_queues::ffi::os::HostArena;
use gpu_queues::ffi::{Cuda, DeviceMemory, PinnedMemory};
use gpu_queues::queues::{PRP_LIST_PITCH, Plan, prebuilt_prp_lists, prebuilt_prp_rows};
use gpu_queues::transport::QueueLayout;
use nvme::DmaRegion;
use nvme_emu::EmuDevice;
use zerocopy::IntoBytes;

use crate::env_choice;

use super::engine::GpuDma;
use super::regions::{HostCqRegion, map_region};

/// Where the software controller's GPU queues keep their rings, PRP-list pages and slot
/// buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingPlacement {
    /// In GPU memory, reached by the controller through its copy engines: every SQE fetch is
    /// a copy and a wait, every completion a piece of a scatter kernel.
    Gpu,
    /// In pinned host memory the controller reads and writes directly, mapped into the GPU (the
    /// host-memory transport's layout on a real SSD; the CQ in pinned memory of its own, see
    /// [`HostCqRegion`]): GPU threads write SQEs and read CQEs and slot buffer data over PCIe;
    /// no copy or kernel per command. Buffers from [`GpuQueues::alloc_buffer`] stay in GPU
    /// memory (copies for data only).
    ///
    /// [`GpuQueues::alloc_buffer`]: gpu_queues::queues::GpuQueues::alloc_buffer
    Host,
}

impl RingPlacement {
    /// The placement `GPUNVME_EMU_RINGS` asks for (`host` or `gpu`); unset, what the caller
    /// asked for ([`GpuQueueOptions::host_rings`]), and GPU memory if it did not.
    ///
    /// [`GpuQueueOptions::host_rings`]: gpu_queues::queues::GpuQueueOptions::host_rings
    pub fn from_env(host_rings: Option<bool>) -> Result<Self, GpuError> {
        Self::choose(gpunvme_settings::EMU_RINGS.value().as_deref(), host_rings)
    }

    pub(super) fn choose(var: Option<&str>, host_rings: Option<bool>) -> Result<Self, GpuError> {
        let c = [("host", Self::Host), ("gpu", Self::Gpu)];
        let asked = if host_rings == Some(true) {
            Self::Host
        } else {
            Self::Gpu
        };
        Ok(env_choice::choice(gpunvme_settings::EMU_RINGS.name, var, &c)?.unwrap_or(asked))
    }

    /// `"gpu"` or `"host"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Host => "host",
        }
    }
}

/// One queue pair's memory as the controller (device addresses) and GPU threads (GPU
/// addresses) see it.
pub(super) struct PairMemory {
    pub(super) sq_region: Arc<DmaRegion>,
    pub(super) cq_region: Arc<DmaRegion>,
    /// GPU addresses of the rings.
    pub(super) sq: u64,
    pub(super) cq: u64,
    /// (GPU, device) addresses of the PRP-list pages and of the slot buffers.
    pub(super) prp_lists: (u64, u64),
    pub(super) slot_buffers: (u64, u64),
    /// Keeps all of it allocated and mapped.
    pub(super) keep: Box<dyn Send + Sync>,
}

/// [`RingPlacement::Gpu`]: every pair's rings, PRP-list pages (two per slot: the slot buffer's
/// pre-built list, and one for `build_prps`) and slot buffers in one allocation of GPU memory
/// (one `cuMemAlloc` and one zeroing for the whole set, not four per pair), each pair's parts
/// registered in the controller's address map behind the copy engines ([`GpuPairArena::pair`]).
pub(super) struct GpuPairArena {
    mem: Arc<DeviceMemory>,
    /// Bytes of one pair's part, and of its pieces, in this order.
    stride: usize,
    sq_len: usize,
    cq_len: usize,
    prp_len: usize,
    bufs_len: usize,
    depth: u32,
    slot_buffer_bytes: u32,
}

impl GpuPairArena {
    /// GPU memory for `count` pairs of plan `p`, zeroed.
    pub(super) fn alloc(cuda: &Arc<Cuda>, p: &Plan, count: usize) -> Result<Self, GpuError> {
        let depth = p.depth as usize;
        let sq_len = (depth * 64).next_multiple_of(4096);
        let cq_len = (depth * 16).next_multiple_of(4096);
        let prp_len = depth * PRP_LIST_PITCH;
        let bufs_len = depth * p.slot_buffer_bytes as usize;
        let stride = sq_len + cq_len + prp_len + bufs_len;
        Ok(Self {
            mem: Arc::new(DeviceMemory::alloc(cuda, stride * count.max(1))?),
            stride,
            sq_len,
            cq_len,
            prp_len,
            bufs_len,
            depth: p.depth,
            slot_buffer_bytes: p.slot_buffer_bytes,
        })
    }

    /// Pair `q`'s memory, registered through `register_as` (its PRP lists pre-built).
    pub(super) fn pair(
        &self,
        q: usize,
        register_as: impl Fn(Arc<DeviceMemory>, bool) -> Result<DmaRegion, GpuError>,
    ) -> Result<PairMemory, GpuError> {
        let at = q * self.stride;
        let part = |off: usize, len: usize| -> Result<Arc<DeviceMemory>, GpuError> {
            Ok(Arc::new(DeviceMemory::view(&self.mem, at + off, len)?))
        };
        let sq = part(0, self.sq_len)?;
        let cq = part(self.sq_len, self.cq_len)?;
        let prp = part(self.sq_len + self.cq_len, self.prp_len)?;
        let bufs = part(self.sq_len + self.cq_len + self.prp_len, self.bufs_len)?;
        let sq_region = Arc::new(register_as(sq.clone(), true)?);
        let cq_region = Arc::new(register_as(cq.clone(), false)?);
        let prp_region = register_as(prp.clone(), false)?;
        let buf_region = register_as(bufs.clone(), false)?;
        let prp_bus = prp_region.device_address(0);
        let buf_bus = buf_region.device_address(0);
        // Pre-built PRP lists: slot s's list names pages 1.. of slot s's buffer (the rest of
        // the pages is zero already).
        if let Some(rows) = prebuilt_prp_rows(self.depth, self.slot_buffer_bytes, buf_bus) {
            let row = rows.len() / self.depth as usize * size_of::<u64>();
            prp.write_rows(0, rows.as_bytes(), row, PRP_LIST_PITCH)?;
        }
        Ok(PairMemory {
            sq: sq.ptr(),
            cq: cq.ptr(),
            prp_lists: (prp.ptr(), prp_bus),
            slot_buffers: (bufs.ptr(), buf_bus),
            sq_region,
            cq_region,
            keep: Box::new((prp_region, buf_region, vec![sq, cq, prp, bufs])),
        })
    }
}

/// [`RingPlacement::Host`]: the pair's rings, PRP-list pages and slot buffers in one arena of
/// the controller's own host DMA memory ([`QueueLayout`], as the host-memory transport lays them
/// out on a real SSD), registered with CUDA so that GPU threads reach it over PCIe.
pub(super) fn host_pair_memory(
    cuda: &Arc<Cuda>,
    emu: &Arc<EmuDevice>,
    engine: &Arc<GpuDma>,
    p: &Plan,
) -> Result<PairMemory, GpuError> {
    let layout = QueueLayout::new(p.depth, p.slot_buffer_bytes, 4096);
    let arena = Arc::new(HostArena::alloc_contiguous(
        cuda,
        emu.as_ref(),
        layout.len,
        " (the software controller's host memory)",
    )?);
    let (gpu, bus) = (arena.gpu_ptr(), arena.memory().device_address(0));
    // The CQ: pinned memory of its own (zeroed: phase 0 everywhere) behind a region that
    // orders its entries after data the copy engines still move ([`HostCqRegion`]).
    let cq_mem = Arc::new(PinnedMemory::alloc(cuda, layout.cq_len)?);
    let cq_region = Arc::new(map_region(
        emu.address_map(),
        Arc::new(HostCqRegion {
            engine: engine.clone(),
            mem: cq_mem.clone(),
        }),
        layout.cq_len,
        Box::new(cq_mem.clone()),
    )?);
    let buf_bus = bus + layout.bufs as u64;
    if let Some(lists) = prebuilt_prp_lists(p.depth, p.slot_buffer_bytes, buf_bus) {
        arena.memory().write(layout.prp, lists.as_bytes());
    }
    let region = |off: usize, len: usize| {
        Arc::new(DmaRegion::contiguous(
            bus + off as u64,
            len,
            Box::new(arena.clone()),
        ))
    };
    Ok(PairMemory {
        sq_region: region(layout.sq, layout.sq_len),
        cq_region,
        sq: gpu + layout.sq as u64,
        cq: cq_mem.device_ptr(),
        prp_lists: (gpu + layout.prp as u64, bus + layout.prp as u64),
        slot_buffers: (gpu + layout.bufs as u64, buf_bus),
        keep: Box::new(arena),
    })
}
