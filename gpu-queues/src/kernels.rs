//! The project's kernels, loaded from the embedded PTX: the runtime's module
//! (`ptx/kernels/gpunvme_kernels.cu`: batches, the perf pattern, files, CRC-32C, the page cache's
//! write-back), which every queue set loads ([`Kernels`]), and the tools' module
//! (`ptx/kernels/gpunvme_tool_kernels.cu`: the perf kernel, the tests', benchmarks' and examples'
//! kernels), loaded only by those who launch them ([`Kernels::tools`], [`ToolKernels`]). The
//! emulated controllers load their own module (`gpu_emu::kernels`).
//!
//! Every kernel is loaded (and launched once, empty) before any kernel that spins is started:
//! with lazy loading, the first launch of a kernel while a persistent kernel holds the GPU was
//! seen never to run (../shared/design/gpu.md, "Deadlocks seen"). The runtime's module is
//! warmed when a queue set is built ([`Kernels::warm_up_clients`]); the tools' module by
//! whoever starts a persistent kernel beside clients that may use it (the GPU-resident
//! controller model calls [`ToolKernels::warm_up_clients`] before it spins), or at its first
//! use, where nothing spins (`CUDA_MODULE_LOADING=EAGER`, which [`Cuda::open`] sets, loads every
//! kernel of a module with it).
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use zerocopy::IntoBytes;

use crate::desc::{DeviceStatus, IoReq, KERNELS_PTX, TOOL_KERNELS_PTX};
use crate::error::GpuError;
use crate::ffi::{Arg, Cuda, DeviceMemory, Kernel, Library, Stream};

/// The loaded kernels of `ptx/kernels/gpunvme_kernels.cu`: what the runtime and every embedder
/// launch. The tools' kernels come from [`Kernels::tools`].
pub struct Kernels {
    _lib: Library,
    cuda: Arc<Cuda>,
    /// The tools' module, loaded at the first [`Kernels::tools`].
    tools: OnceLock<ToolKernels>,
    /// Held while the tools' module loads, so that it loads once.
    tools_loading: Mutex<()>,
    /// `gpunvme_io_batch`.
    pub io_batch: Kernel,
    /// `gpunvme_pattern`.
    pub pattern: Kernel,
    /// `gpunvme_warmup`.
    pub warmup: Kernel,
    /// `gpunvme_file_rw` (batched byte ranges of blockfs files).
    pub file_rw: Kernel,
    /// `gpunvme_crc32c` (segment CRCs).
    pub crc32c: Kernel,
    /// `gpunvme_crc32c_combine`.
    pub crc32c_combine: Kernel,
    /// `gpunvme_cache_flush` (every dirty page written back).
    pub cache_flush: Kernel,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("tools_loaded", &self.tools.get().is_some())
            .finish_non_exhaustive()
    }
}

/// The same kernels, with null arguments: a parameter list spelled as a string, 'u' a u32,
/// anything else a u64 or pointer.
fn nulls(sig: &str) -> Vec<Arg> {
    sig.bytes()
        .map(|b| if b == b'u' { Arg::U32(0) } else { Arg::U64(0) })
        .collect()
}

impl Kernels {
    /// JIT-loads the runtime's embedded PTX and looks up every kernel. The tools' module is not
    /// loaded ([`Kernels::tools`]).
    pub fn load(cuda: &Arc<Cuda>) -> Result<Arc<Self>, GpuError> {
        let lib = Library::load_ptx(cuda, KERNELS_PTX)?;
        Ok(Arc::new(Self {
            io_batch: lib.kernel("gpunvme_io_batch")?,
            pattern: lib.kernel("gpunvme_pattern")?,
            warmup: lib.kernel("gpunvme_warmup")?,
            file_rw: lib.kernel("gpunvme_file_rw")?,
            crc32c: lib.kernel("gpunvme_crc32c")?,
            crc32c_combine: lib.kernel("gpunvme_crc32c_combine")?,
            cache_flush: lib.kernel("gpunvme_cache_flush")?,
            cuda: cuda.clone(),
            tools: OnceLock::new(),
            tools_loading: Mutex::new(()),
            _lib: lib,
        }))
    }

    /// The tools' kernels (the perf kernel, the tests', benchmarks' and examples' kernels):
    /// their module is loaded at the first call (JIT-compiled from the embedded PTX), then
    /// kept with these kernels. Beside a persistent kernel (a GPU-resident controller), call
    /// it, and [`ToolKernels::warm_up_clients`], before that kernel starts: the controller
    /// model does.
    pub fn tools(&self) -> Result<&ToolKernels, GpuError> {
        if let Some(t) = self.tools.get() {
            return Ok(t);
        }
        let _loading = self
            .tools_loading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(t) = self.tools.get() {
            return Ok(t);
        }
        let t = ToolKernels::load(&self.cuda)?;
        Ok(self.tools.get_or_init(|| t))
    }

    /// Launches the empty kernel on `stream` and waits for it: after this, nothing needs
    /// loading on that stream's context.
    pub fn warm_up(&self, stream: &Stream) -> Result<(), GpuError> {
        stream.launch(self.warmup, 1, 32, &[Arg::U64(0)])?;
        stream.wait_idle(Duration::from_secs(10))
    }

    /// Launches every client kernel of this module once on `stream`, each with arguments that
    /// make it return at once (no queues, no requests, no blocks), and waits: with lazy loading
    /// a kernel is loaded into a context on its first launch there, and that first launch must
    /// not come while a persistent kernel (the GPU-resident controller) holds the GPU. (The
    /// tools' module: [`ToolKernels::warm_up_clients`].)
    pub fn warm_up_clients(&self, cuda: &Arc<Cuda>, stream: &Stream) -> Result<(), GpuError> {
        // Zeroed scratch: result words.
        let scratch = DeviceMemory::alloc(cuda, 4096)?;
        let p = scratch.ptr();
        stream.launch(self.warmup, 1, 32, &[Arg::U64(0)])?;
        let none = [
            Arg::U64(p),
            Arg::U32(0),
            Arg::U64(p),
            Arg::U32(0),
            Arg::U64(p + 2048),
            Arg::U32(0),
        ];
        stream.launch(self.io_batch, 1, 32, &none)?;
        let pattern = [
            Arg::U64(p),
            Arg::U64(0),
            Arg::U32(1),
            Arg::U64(0),
            Arg::U64(0),
            Arg::U32(9),
            Arg::U32(1),
            Arg::U64(p + 2048),
        ];
        stream.launch(self.pattern, 1, 32, &pattern)?;
        // A file_params with nios = 0; segment size 0; no segments to combine.
        stream.launch(self.file_rw, 1, 32, &[Arg::U64(p)])?;
        stream.launch(
            self.crc32c,
            1,
            32,
            &[Arg::U64(p), Arg::U64(0), Arg::U32(0), Arg::U64(p + 2048)],
        )?;
        stream.launch(
            self.crc32c_combine,
            1,
            32,
            &[
                Arg::U64(p),
                Arg::U64(0),
                Arg::U32(4096),
                Arg::U64(0),
                Arg::U64(p + 2048),
            ],
        )?;
        // The cache's kernel with a null cache returns at once.
        stream.launch(self.cache_flush, 1, 32, &nulls("pp"))?;
        stream.wait_idle(Duration::from_secs(10))
    }
}

/// The loaded kernels of `ptx/kernels/gpunvme_tool_kernels.cu` (with the page cache's tool
/// kernels of `gpunvme_cache_kernels.cu`): what `gpunvme perf --gpu`, the tests, the benchmarks
/// and the examples launch, and no embedder needs. Usually reached through a queue set's
/// [`Kernels::tools`].
pub struct ToolKernels {
    _lib: Library,
    /// `gpunvme_perf`.
    pub perf: Kernel,
    /// `gpunvme_rw_range`.
    pub rw_range: Kernel,
    /// `gpunvme_cache_test` (element reads through a page cache, for tests and tools).
    pub cache_test: Kernel,
    /// `gpunvme_cache_pin_test` (a cache whose every frame is referenced).
    pub cache_pin_test: Kernel,
    /// `gpunvme_cache_bench` (element loads through a cache or from a plain buffer).
    pub cache_bench: Kernel,
    /// `gpunvme_cache_bench_scan` (warps scanning through a cache, with or without a cursor,
    /// or a plain buffer).
    pub cache_bench_scan: Kernel,
    /// `gpunvme_cache_bfs_level` (one BFS level through a cache or over plain pointers).
    pub cache_bfs_level: Kernel,
    /// `gpunvme_cache_gather` (embedding rows through a cache or from a plain pointer).
    pub cache_gather: Kernel,
    /// `gpunvme_cache_bfs_heavy` (a BFS level's high-degree vertices, split over the grid).
    pub cache_bfs_heavy: Kernel,
    /// `gpunvme_cache_bfs_up` (one bottom-up BFS level).
    pub cache_bfs_up: Kernel,
}

impl std::fmt::Debug for ToolKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolKernels").finish_non_exhaustive()
    }
}

impl ToolKernels {
    /// JIT-loads the tools' embedded PTX and looks up every kernel.
    pub fn load(cuda: &Arc<Cuda>) -> Result<Self, GpuError> {
        let lib = Library::load_ptx(cuda, TOOL_KERNELS_PTX)?;
        Ok(Self {
            perf: lib.kernel("gpunvme_perf")?,
            rw_range: lib.kernel("gpunvme_rw_range")?,
            cache_test: lib.kernel("gpunvme_cache_test")?,
            cache_pin_test: lib.kernel("gpunvme_cache_pin_test")?,
            cache_bench: lib.kernel("gpunvme_cache_bench")?,
            cache_bench_scan: lib.kernel("gpunvme_cache_bench_scan")?,
            cache_bfs_level: lib.kernel("gpunvme_cache_bfs_level")?,
            cache_gather: lib.kernel("gpunvme_cache_gather")?,
            cache_bfs_heavy: lib.kernel("gpunvme_cache_bfs_heavy")?,
            cache_bfs_up: lib.kernel("gpunvme_cache_bfs_up")?,
            _lib: lib,
        })
    }

    /// Launches every kernel of the module once on `stream`, each with arguments that make it
    /// return at once, and waits (as [`Kernels::warm_up_clients`] does for the runtime's).
    pub fn warm_up_clients(&self, cuda: &Arc<Cuda>, stream: &Stream) -> Result<(), GpuError> {
        // Zeroed scratch: a perf_params with nqueues = 0, and result words.
        let scratch = DeviceMemory::alloc(cuda, 4096)?;
        let p = scratch.ptr();
        stream.launch(self.perf, 1, 32, &[Arg::U64(p)])?;
        let range = [
            Arg::U64(p),
            Arg::U32(0),
            Arg::U32(1),
            Arg::U32(9),
            Arg::U64(0),
            Arg::U64(0),
            Arg::U64(0),
            Arg::U32(0),
            Arg::U64(p + 2048),
        ];
        stream.launch(self.rw_range, 1, 32, &range)?;
        // The cache's kernels with null pointers return at once.
        stream.launch(self.cache_test, 1, 32, &nulls("puuupppp"))?;
        stream.launch(self.cache_pin_test, 1, 32, &nulls("pupuppp"))?;
        // (elem_bytes 4 and n 1: valid even if the null check moved.)
        let mut bench = nulls("pupuuppppp");
        bench[4] = Arg::U32(4);
        bench[5] = Arg::U64(1);
        stream.launch(self.cache_bench, 1, 32, &bench)?;
        let mut scan = nulls("puppuupp");
        scan[4] = Arg::U32(4);
        scan[5] = Arg::U64(1);
        stream.launch(self.cache_bench_scan, 1, 32, &scan)?;
        stream.launch(self.cache_bfs_level, 1, 32, &nulls("puuppupupppupuu"))?;
        stream.launch(self.cache_bfs_heavy, 1, 32, &nulls("pupupuppp"))?;
        stream.launch(self.cache_bfs_up, 1, 32, &nulls("puuppupupppuup"))?;
        stream.launch(self.cache_gather, 1, 32, &nulls("pupupppp"))?;
        stream.wait_idle(Duration::from_secs(10))
    }
}

/// One batch of commands for `gpunvme_io_batch`: the requests and a result per request in GPU
/// memory, launched over a queue set's descriptors and read back as (status, NVMe status
/// field) pairs. The kernel's argument list is written here only.
pub struct IoBatch {
    reqs: DeviceMemory,
    results: DeviceMemory,
    n: u32,
}

impl IoBatch {
    /// Threads per block of the launch.
    const BLOCK: u32 = 128;

    /// Copies `reqs` (at least one) into GPU memory.
    pub fn new(cuda: &Arc<Cuda>, reqs: &[IoReq]) -> Result<Self, GpuError> {
        let n = u32::try_from(reqs.len())
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                GpuError::InvalidArgument(format!("a batch of {} requests", reqs.len()))
            })?;
        let r = DeviceMemory::alloc(cuda, std::mem::size_of_val(reqs))?;
        r.write(0, reqs.as_bytes())?;
        Ok(Self {
            reqs: r,
            results: DeviceMemory::alloc(cuda, reqs.len() * 8)?,
            n,
        })
    }

    /// Launches the batch on `stream` over the first `queues` descriptors at `descs` (the GPU
    /// address of a `queue_desc` array, e.g. `GpuQueues::descriptors`), one thread per
    /// request, submitting per thread or per warp (`warp`). Returns once queued.
    pub fn launch(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        descs: u64,
        queues: u32,
        warp: bool,
    ) -> Result<(), GpuError> {
        stream.launch(
            kernels.io_batch,
            self.n.div_ceil(Self::BLOCK),
            Self::BLOCK,
            &[
                Arg::U64(descs),
                Arg::U32(queues),
                Arg::U64(self.reqs.ptr()),
                Arg::U32(self.n),
                Arg::U64(self.results.ptr()),
                Arg::U32(warp as u32),
            ],
        )
    }

    /// Each request's outcome (device status, NVMe status field), once the launch has run.
    pub fn results(&self) -> Result<Vec<(DeviceStatus, u32)>, GpuError> {
        let mut out = vec![0u8; self.n as usize * 8];
        self.results.read(0, &mut out)?;
        Ok(out
            .chunks_exact(8)
            .map(|c| {
                let word = |i: usize| u32::from_le_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]);
                (DeviceStatus::from_code(word(0)), word(4))
            })
            .collect())
    }
}
