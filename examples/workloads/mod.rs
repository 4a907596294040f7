//! The page cache's example workloads (`examples/gpu_bfs.rs`, `examples/gpu_embedding.rs`,
//! `scripts/gpu-cache-bench.sh`; the GPU tests include them too): their data, their CPU references, and the host side of their
//! GPU kernels (`gpunvme_cache_bfs_level`, `gpunvme_cache_gather` in
//! `ptx/kernels/gpunvme_cache_kernels.cu`, the tools' module: `Kernels::tools`), which read through a [`GpuCache`] or from a plain
//! pointer (GPU memory, or unified memory: the baselines) with one source.
//!
//! - [`graph`]: seeded R-MAT graphs in CSR form, BFS on the CPU and on the GPU;
//! - [`embedding`]: an embedding table that is a function of its position, Zipf-distributed
//!   lookups, and gathers on the GPU checked row by row.

#![allow(dead_code)] // each example uses part of it

pub mod embedding;
pub mod graph;

use std::time::Duration;

use anyhow::{Context, Result};
use gpu_queues::GpuQueues;
use gpunvme::gpu_cache::{GpuCache, RangeId};

/// Where a GPU workload reads its data.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// Through a page cache: the ranges bound for the workload's arrays.
    Cache(&'a GpuCache<'a>, &'a [RangeId]),
    /// Plain pointers to the arrays (GPU memory, or unified memory), one per array.
    Plain(&'a [u64]),
}

impl Source<'_> {
    /// What the cache says of its failures, for an error message: its first failed fill and
    /// its counters (empty for plain pointers).
    fn failure_detail(&self) -> String {
        match self {
            Source::Cache(c, _) => match c.stats() {
                Ok(s) => format!(
                    "; cache: first failure {:?}, quarantined frames {}, {:?}",
                    s.first_failure, s.quarantined, s.counters
                ),
                Err(e) => format!("; the cache's statistics could not be read: {e}"),
            },
            Source::Plain(_) => String::new(),
        }
    }

    /// The kernel's cache arguments: (descriptor, range of array `i`, plain pointer of `i`).
    fn array(&self, i: usize) -> (u64, u32, u64) {
        match self {
            Source::Cache(c, ranges) => (c.descriptor(), ranges[i].index(), 0),
            Source::Plain(ptrs) => (0, 0, ptrs[i]),
        }
    }
}

/// Threads per block of the workloads' kernels.
const BLOCK: u32 = 256;

/// Blocks for `warps_wanted` warps (one per item), at most 8 blocks per client SM (the kernels'
/// warps stride over the items).
fn grid_for(q: &GpuQueues, warps_wanted: u64) -> u32 {
    let most = q.cuda().sm_count().max(1) as u64 * 8;
    warps_wanted.div_ceil((BLOCK / 32) as u64).clamp(1, most) as u32
}

/// The host's bound on one workload kernel: a kernel whose fills time out ends within a few
/// queue timeouts; this is far beyond that.
const KERNEL_BOUND: Duration = Duration::from_secs(600);

/// Waits for the client stream (bounded).
fn wait(q: &GpuQueues, what: &str) -> Result<()> {
    q.client_stream()
        .wait_idle(KERNEL_BOUND)
        .with_context(|| format!("waiting for {what}"))
}

/// Where a baseline's arrays live (the same kernels read them through plain pointers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Wholly in GPU memory, copied there before the run: the upper bound.
    GpuMemory,
    /// In unified memory written by the CPU: pages migrate to the GPU on first touch.
    Unified,
    /// In unified memory with GPU memory limited to this many bytes (plus the run's own
    /// buffers) by a balloon allocation: pages fault in and are evicted as the run goes, the
    /// comparison BaM's paper makes.
    UnifiedOversubscribed(u64),
}

impl Placement {
    /// The name rows carry.
    pub fn name(&self) -> &'static str {
        match self {
            Placement::GpuMemory => "gpu_memory",
            Placement::Unified => "unified_memory",
            Placement::UnifiedOversubscribed(_) => "unified_memory_oversubscribed",
        }
    }
}

/// One placed array.
enum Array {
    Device(gpu_queues::ffi::DeviceMemory),
    Managed(gpu_queues::ffi::ManagedMemory),
}

/// Arrays placed for a baseline run; dropping it frees them (and the balloon).
pub struct Placed {
    _device: Vec<gpu_queues::ffi::DeviceMemory>,
    _managed: Vec<gpu_queues::ffi::ManagedMemory>,
    _balloon: Option<gpu_queues::ffi::DeviceMemory>,
    /// The arrays' addresses, in order (a [`Source::Plain`]).
    pub ptrs: Vec<u64>,
    /// Free GPU memory after placing (oversubscribed runs: what the unified pages can use).
    pub gpu_free_bytes: Option<u64>,
}

/// Places arrays of `sizes` bytes as `placement` says, their bytes from `fill(array, offset,
/// buf)` (in 16 MiB pieces, offsets multiples of 16 MiB). `headroom`: bytes the run allocates
/// itself, left free beside an oversubscribed run's limit.
pub fn place(
    q: &GpuQueues,
    sizes: &[u64],
    fill: &dyn Fn(usize, u64, &mut [u8]),
    placement: Placement,
    headroom: u64,
) -> Result<Placed> {
    use gpu_queues::ffi::{DeviceMemory, ManagedMemory};
    const PIECE: u64 = 16 << 20;
    let cuda = q.cuda();
    let mut placed = Placed {
        _device: Vec::new(),
        _managed: Vec::new(),
        _balloon: None,
        ptrs: Vec::new(),
        gpu_free_bytes: None,
    };
    let mut buf = vec![0u8; PIECE as usize];
    for (i, &size) in sizes.iter().enumerate() {
        let len = usize::try_from(size).context("array size")?;
        let mut array = if placement == Placement::GpuMemory {
            Array::Device(DeviceMemory::alloc(cuda, len)?)
        } else {
            Array::Managed(ManagedMemory::alloc(cuda, len)?)
        };
        let mut at = 0u64;
        while at < size {
            let n = (size - at).min(PIECE) as usize;
            fill(i, at, &mut buf[..n]);
            match &mut array {
                Array::Device(d) => d.write(at as usize, &buf[..n])?,
                Array::Managed(m) => m.write(at as usize, &buf[..n])?,
            }
            at += n as u64;
        }
        match array {
            Array::Device(d) => {
                placed.ptrs.push(d.ptr());
                placed._device.push(d);
            }
            Array::Managed(m) => {
                placed.ptrs.push(m.ptr());
                placed._managed.push(m);
            }
        }
    }
    if let Placement::UnifiedOversubscribed(limit) = placement {
        let (free, _) = cuda.memory_info()?;
        let keep = limit + headroom;
        if free > keep {
            placed._balloon = Some(
                DeviceMemory::alloc(cuda, (free - keep) as usize)
                    .context("the balloon that limits GPU memory")?,
            );
        }
    }
    if placement != Placement::GpuMemory {
        placed.gpu_free_bytes = cuda.memory_info().ok().map(|(f, _)| f);
    }
    Ok(placed)
}
