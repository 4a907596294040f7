//! The page cache's example workloads (`examples/gpu_bfs.rs`, `examples/gpu_embedding.rs`,
//! `scripts/gpu-cache-bench.sh`): their data, their CPU references, and the host side of their
//! GPU kernels (`gpunvme_cache_bfs_level`, `gpunvme_cache_gather` in
//! `ptx/kernels/gpunvme_cache_kernels.cu`), which read through a [`GpuCache`] or from a plain
//! pointer (GPU memory, or unified memory: the baselines) with one source.
//!
//! - [`graph`]: seeded R-MAT graphs in CSR form, BFS on the CPU and on the GPU;
//! - [`embedding`]: an embedding table that is a function of its position, Zipf-distributed
//!   lookups, and gathers on the GPU checked row by row.

pub mod embedding;
pub mod graph;

use std::time::Duration;

use anyhow::{Context, Result};
use gpu_queues::GpuQueues;
use gpu_queues::cache::{GpuCache, RangeId};

/// Where a GPU workload reads its data.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// Through a page cache: the ranges bound for the workload's arrays.
    Cache(&'a GpuCache<'a>, &'a [RangeId]),
    /// Plain pointers to the arrays (GPU memory, or unified memory), one per array.
    Plain(&'a [u64]),
}

impl Source<'_> {
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
