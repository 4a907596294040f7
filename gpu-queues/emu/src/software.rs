//! Transport (a): the software controller (`nvme_emu`) serving queues that GPU threads drive —
//! an emulated controller standing in for an SSD, built on the runtime's [`QueueTransport`]
//! seam ([`queues`] builds the queue pairs, [`SoftwareTransport`] serves them).
//!
//! Where a pair's rings, PRP-list pages and slot buffers live is a [`RingPlacement`]:
//!
//! - **host** (`perf --gpu`'s choice, [`GpuQueueOptions::host_rings`]): one arena of the
//!   controller's own host DMA memory per pair, laid
//!   out as transport (c) lays them out on a real SSD and registered with CUDA. The controller
//!   reads SQEs and writes CQEs and slot-buffer data directly, as for CPU queues; GPU threads
//!   reach the arena over PCIe. No copy, kernel or wait per command: the latency of a command is
//!   the PCIe round trips and the controller's polling.
//! - **gpu** (the default): all of it in GPU memory, behind the copy engines below. Measured
//!   faster for bulk transfers into GPU buffers (`fs get --gpu` of 1 GiB, H100, 2026-11-26:
//!   19.4 GB/s against 13.4 with host rings; not profiled, the likely cause is that the
//!   pollers' PCIe reads of a host CQ wait behind the data moving to the GPU).
//!
//! Either way, buffers from [`GpuQueues::alloc_buffer`] (files, the page cache's frames) are GPU
//! memory behind the copy engines. With host rings the CQ is pinned memory of its own behind a
//! [`HostCqRegion`]: an entry is stored there directly while the thread's engine holds no write
//! that is not yet visible, and otherwise staged through the engine like GPU memory, so that it
//! lands after its command's data without the controller ever waiting for the GPU.
//!
//! The controller reaches GPU memory only through [`GpuRegion`]s registered in its device-address
//! map, and its doorbells for these queues are words in a pinned host page that GPU threads
//! write ([`PinnedDoorbell`]). One `cudaMemcpy` per command would cap the controller at about
//! 0.3 M commands/s (../shared/design/gpu.md), so writes are batched by a [`GpuDma`] engine:
//!
//! - every write the controller makes (read data, completion entries) is appended to a pinned
//!   staging area, mapped into the GPU, with a [`CopyDesc`] naming its destination, at the
//!   destination's alignment modulo 16 (so the kernel copies 16-byte vectors into a tensor
//!   that starts 8 bytes past a boundary, say);
//! - at the end of each controller batch (`MemoryRegion::flush`), ONE scatter kernel copies every
//!   staged piece to its place; completion-queue phase dwords are marked late and written by the
//!   kernel's last block after a fence, so a completion never becomes visible before its data
//!   or the rest of its entry;
//! - a Read of 64 KiB or more is copied from the image (out of a mapping of it, or by `pread`:
//!   `image_reads::ReadMode`) into the staging area like any other write but moved by a copy
//!   engine, one copy per run of Reads adjacent in GPU memory,
//!   queued before the scatter that carries their completions ([`StagedCopies`]; 7B-shaped
//!   load on the H200, 2026-11-26: 43.7 GB/s against 40.6 by the scatter kernel);
//! - reads (SQE fetches, PRP lists, data of write commands) copy and wait (bounded); ranges the
//!   controller announced with `MemoryRegion::prefetch` (a batch's PRP lists, then its write
//!   data) are fetched together by ONE gather kernel into a pinned area, and the reads that
//!   follow are served from it until the batch moves on (the next prefetch or flush);
//! - a read of memory the controller has written (a region it staged data or entries into)
//!   flushes first and copies on the scatter's stream, so it sees every earlier write; a read
//!   of memory it never wrote (the clients' SQ rings and PRP lists, a Write's data in a buffer
//!   only clients fill) copies on a second stream of the engine and does not wait for the
//!   batch's scatter: the next batch's commands are fetched, and its `pread`s run, while the
//!   last batch's data still moves (`GPUNVME_EMU_FETCH=ordered` orders every read, for
//!   comparisons).
//!
//! Each controller thread has an engine of its own (stream, staging and gather areas), picked
//! with `nvme_emu::controller_thread_index`: a queue pair is served by one thread, so its data
//! and completions go through one stream in issue order. The streams live in the controller's
//! own SM partition (a green context), so client kernels that occupy every other SM cannot
//! starve them. Two staging areas alternate: the controller fills one while the GPU drains the
//! other.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpu_queues::GpuError;
use gpu_queues::ffi::os::{DIRECT_ALIGN, HostArena, MappedImage};
use gpu_queues::ffi::{
    Arg, Cuda, DeviceMemory, Event, GreenPartition, Kernel, PinnedMemory, Placement, Stream,
};
use gpu_queues::kernels::Kernels;
use gpu_queues::queues::{
    DescCommon, DescParts, GpuBuffer, GpuQueueOptions, GpuQueuePair, GpuQueues, Plan,
    QueueSetParts, QueueTransport, ReadAhead, TransportKind, alloc_protocol_state, plan,
    prebuilt_prp_lists,
};
use gpu_queues::transport::{Candidate, QueueLayout, TransportChoice, select};
use nvme::{Controller, DmaRegion, QueueRegions};
use nvme_emu::{DeviceAddressMap, DoorbellWord, EmuDevice, MemoryRegion, RegionError};
use zerocopy::IntoBytes;

use crate::desc::{COPY_LATE, CopyDesc};
use crate::env_choice;
use crate::image_reads::{ColdReads, ImageViews, ImageWindows, ReadMode, Source, WindowStats};
use crate::kernels::EmuKernels;

/// Bytes between two queues' doorbell pairs in the pinned doorbell page (a cache line each,
/// so the controller's polling of one queue does not share a line with another's writes).
const DOORBELL_STRIDE: usize = 64;

/// Pieces one staging area holds before it is flushed.
const MAX_PIECES: usize = 8192;
/// Data bytes one staging area holds before it is flushed. Small enough that a controller of
/// many threads allocates its pinned memory quickly (every thread has three such areas: 32 MiB
/// each made 16 threads spend a second in `cuMemHostAlloc` before a load, 2026-11-25), large
/// enough for a batch of MDTS-sized reads to stage while the other area drains.
const STAGING_BYTES: usize = 4 << 20;
/// Ranges one gather moves.
const MAX_GATHER_PIECES: usize = 8192;
/// Data bytes one gather moves (PRP lists, write data; a read larger than this is copied in
/// pieces of this size).
const GATHER_BYTES: usize = 4 << 20;
/// Largest piece one scatter warp copies: a long run (a big Read's data) is cut into pieces of
/// this size so that many warps move it at once, not one warp the whole run.
const PIECE_BYTES: usize = 32 << 10;
/// Bound on any single wait for the GPU inside the controller.
const GPU_WAIT: Duration = Duration::from_secs(10);
/// Warps per block of the scatter and gather kernels (one warp per piece).
const WARPS_PER_BLOCK: u32 = 8;

/// Launches the scatter or gather kernel on `stream` with one warp per piece.
fn launch_per_piece(
    stream: &Stream,
    kernel: Kernel,
    pieces: usize,
    args: &[Arg],
) -> Result<(), GpuError> {
    let grid = (pieces as u32).div_ceil(WARPS_PER_BLOCK).clamp(1, 1024);
    stream.launch(kernel, grid, WARPS_PER_BLOCK * 32, args)
}

/// A Read's data copied straight from a registered image window ([`ImageWindows`]) by a copy
/// engine, issued at the flush of the staging area it was noted in, before that area's scatter
/// (which carries the command's completion).
struct Direct {
    dst: u64,
    window: Arc<MappedImage>,
    offset: usize,
    len: usize,
}

/// Direct copies one staging area notes before it is flushed.
const MAX_DIRECT: usize = 4096;

/// A Read's data staged from the image and moved by a copy engine (adjacent ones merged), issued
/// at the flush of its staging area before that area's scatter ([`StagedCopies::Engine`]): so
/// before the completions among the scatter's pieces, and before any piece of the same area
/// whatever the order they were staged in (only commands in flight together can write the same
/// bytes, and NVMe leaves the result of such overlaps undefined).
struct EngineCopy {
    /// Byte offset in the area's data part.
    src: usize,
    dst: u64,
    len: usize,
}

/// Reads of at least this many bytes go by copy engine when [`StagedCopies::Engine`]; smaller
/// ones (a call each would cost more than the copy) go by the scatter kernel.
pub const ENGINE_COPY_MIN: usize = 64 << 10;

/// How a Read's data staged from the image reaches GPU memory: `GPUNVME_EMU_STAGED`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagedCopies {
    /// By copy engines, one copy per run of adjacent Reads of [`ENGINE_COPY_MIN`] bytes or
    /// more (the default): the controller's SMs are left to the completions and small pieces.
    Engine,
    /// By the scatter kernel on the controller's SMs, like every other staged write.
    Kernel,
}

impl StagedCopies {
    /// `GPUNVME_EMU_STAGED=engine|kernel` (unset: engine, or kernel in [`CopyMode::Memcpy`],
    /// where pieces are copies already).
    fn from_env() -> Result<Self, GpuError> {
        Self::choose(env_choice::var(Self::VAR).as_deref())
    }

    const VAR: &str = "GPUNVME_EMU_STAGED";

    fn choose(var: Option<&str>) -> Result<Self, GpuError> {
        let c = [("engine", Self::Engine), ("kernel", Self::Kernel)];
        Ok(env_choice::choice(Self::VAR, var, &c)?.unwrap_or(Self::Engine))
    }
}

struct Staging {
    mem: PinnedMemory,
    /// Direct copies to issue, in order, before this area's scatter.
    direct: Vec<Direct>,
    /// Staged Reads to move by copy engine, in order, before this area's scatter.
    copies: Vec<EngineCopy>,
    /// Finished when the scatter that read this area is done.
    drained: Event,
    pieces: usize,
    bytes: usize,
}

/// A GPU range copied into the gather area, valid until the controller's batch moves on.
#[derive(Clone, Copy)]
struct Fetched {
    gpu: u64,
    len: usize,
    /// Byte offset of its copy in the gather area's data part.
    at: usize,
}

/// What one engine has done, for reports on where the controller's time goes.
#[derive(Clone, Copy, Debug, Default)]
pub struct DmaStats {
    /// Scatter kernels launched (one per controller batch that wrote GPU memory).
    pub scatters: u64,
    /// Pieces the scatters moved (data ranges and completion entries).
    pub pieces: u64,
    /// Gather kernels launched (prefetched SQEs, PRP lists, write data).
    pub gathers: u64,
    /// Ranges the gathers moved.
    pub gathered: u64,
    /// Reads served from gathered bytes.
    pub hits: u64,
    /// Reads that needed a copy and a wait of their own.
    pub sync_reads: u64,
    /// Nanoseconds the controller thread spent waiting for the GPU (reads, full staging).
    pub wait_ns: u64,
    /// Of `wait_ns`: waiting for reads of GPU memory (SQE fetches, gathers, sync reads).
    pub fetch_wait_ns: u64,
    /// Of `wait_ns`: waiting for a staging area the GPU still drained.
    pub drain_wait_ns: u64,
    /// Reads and gathers of memory the controller never wrote, on the fetch stream (not
    /// ordered after the engine's writes).
    pub unordered_reads: u64,
    /// Nanoseconds spent copying image data into staging (mapped copies or `pread`).
    pub file_ns: u64,
    /// Copies issued straight from registered image windows (adjacent ranges merged).
    pub direct_copies: u64,
    /// Bytes those copies moved.
    pub direct_bytes: u64,
    /// Bytes of Reads staged through pinned memory from the image file.
    pub staged_file_bytes: u64,
    /// Of `staged_file_bytes`: copied out of a mapping of the image ([`ReadMode::Mapped`],
    /// pages in memory); the rest by `pread` or direct I/O.
    pub mapped_bytes: u64,
    /// Of `staged_file_bytes`: read by direct I/O (Reads with no page in the page cache,
    /// [`ColdReads::Direct`]; pieces the file system or the alignment refused went by `pread`),
    /// or copied out of a prefetch's pool, which direct I/O filled ([`ColdReads::Prefetch`]).
    pub cold_direct_bytes: u64,
    /// Copy-engine copies of staged Read data (adjacent Reads merged).
    pub engine_copies: u64,
    /// When the first Read after a lull (no staged Read for [`LULL`]) was staged: the start
    /// of the latest burst of work, such as a load.
    pub burst_start: Option<Instant>,
    /// When the last staged Read's data was in staging.
    pub last_staged: Option<Instant>,
}

/// A pause between staged Reads that starts a new burst ([`DmaStats::burst_start`]).
const LULL: Duration = Duration::from_millis(5);

impl DmaStats {
    fn add(&mut self, o: &DmaStats) {
        self.scatters += o.scatters;
        self.pieces += o.pieces;
        self.gathers += o.gathers;
        self.gathered += o.gathered;
        self.hits += o.hits;
        self.sync_reads += o.sync_reads;
        self.wait_ns += o.wait_ns;
        self.fetch_wait_ns += o.fetch_wait_ns;
        self.drain_wait_ns += o.drain_wait_ns;
        self.unordered_reads += o.unordered_reads;
        self.file_ns += o.file_ns;
        self.direct_copies += o.direct_copies;
        self.direct_bytes += o.direct_bytes;
        self.staged_file_bytes += o.staged_file_bytes;
        self.mapped_bytes += o.mapped_bytes;
        self.cold_direct_bytes += o.cold_direct_bytes;
        self.engine_copies += o.engine_copies;
        self.burst_start = match (self.burst_start, o.burst_start) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_staged = self.last_staged.max(o.last_staged);
    }
}

struct EngineState {
    areas: [Staging; 2],
    cur: usize,
    /// Gather area: MAX_GATHER_PIECES descriptors, then GATHER_BYTES of data; also the bounce
    /// buffer of reads too large to gather.
    gather: PinnedMemory,
    /// Ranges announced by `prefetch`, fetched together at the next read, each with whether
    /// it must be read after the engine's earlier writes (see the module's documentation).
    pending: Vec<(u64, usize, bool)>,
    /// Ranges the last gather fetched.
    fetched: Vec<Fetched>,
    /// A flush launched work that was not yet seen finished (see [`GpuDma::pending`]).
    in_flight: bool,
    stats: DmaStats,
}

/// One controller thread's copy engine: its own stream, staging areas and gather area, so that
/// threads never wait on each other's copies and each thread's writes stay in issue order.
struct Engine {
    /// Scatters, and reads ordered after them.
    stream: Stream,
    /// Reads of memory the controller never wrote (not ordered after the scatters).
    fetch: Stream,
    /// Device counter the scatter kernel's blocks use to find the last one.
    done_blocks: DeviceMemory,
    state: Mutex<EngineState>,
}

/// How an engine moves a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMode {
    /// One scatter or gather kernel per batch (the default).
    Kernels,
    /// One `cuMemcpyAsync` per piece, no kernels: for `compute-sanitizer`, which runs one
    /// kernel at a time, so the controller's kernels would wait behind the client kernel that
    /// waits for them. About 0.3 M commands/s (../shared/design/gpu.md): for checking only.
    /// Chosen under compute-sanitizer, or with `GPUNVME_EMU_DMA=memcpy`.
    Memcpy,
}

impl CopyMode {
    /// The mode `GPUNVME_EMU_DMA` asks for (`kernels` or `memcpy`); unset, `memcpy` under
    /// compute-sanitizer ([`gpu_queues::queues::under_compute_sanitizer`], logged) and
    /// `kernels` otherwise.
    pub fn from_env() -> Result<Self, GpuError> {
        Self::choose(
            env_choice::var("GPUNVME_EMU_DMA").as_deref(),
            gpu_queues::queues::under_compute_sanitizer(),
        )
    }

    /// [`CopyMode::from_env`] from the variable's value and whether the sanitizer runs.
    fn choose(var: Option<&str>, sanitizer: bool) -> Result<Self, GpuError> {
        let c = [("kernels", Self::Kernels), ("memcpy", Self::Memcpy)];
        Ok(match env_choice::choice("GPUNVME_EMU_DMA", var, &c)? {
            Some(mode) => mode,
            None if sanitizer => {
                tracing::info!(
                    "compute-sanitizer detected: the software controller copies with \
                     cuMemcpyAsync (GPUNVME_EMU_DMA=kernels overrides)"
                );
                Self::Memcpy
            }
            None => Self::Kernels,
        })
    }
}

/// Where the software controller's GPU queues keep their rings, PRP-list pages and slot
/// buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingPlacement {
    /// In GPU memory, reached by the controller through its copy engines: every SQE fetch is
    /// a copy and a wait, every completion a piece of a scatter kernel.
    Gpu,
    /// In pinned host memory the controller reads and writes directly, mapped into the GPU
    /// (transport (c)'s layout on a real SSD; the CQ in pinned memory of its own, see
    /// [`HostCqRegion`]): GPU threads write SQEs and read CQEs and slot buffer data over PCIe;
    /// no copy or kernel per command. Buffers from [`GpuQueues::alloc_buffer`] stay in GPU
    /// memory (copies for data only).
    Host,
}

impl RingPlacement {
    /// The placement `GPUNVME_EMU_RINGS` asks for (`host` or `gpu`); unset, what the caller
    /// asked for ([`GpuQueueOptions::host_rings`]), and GPU memory if it did not.
    pub fn from_env(host_rings: Option<bool>) -> Result<Self, GpuError> {
        Self::choose(env_choice::var("GPUNVME_EMU_RINGS").as_deref(), host_rings)
    }

    fn choose(var: Option<&str>, host_rings: Option<bool>) -> Result<Self, GpuError> {
        let c = [("host", Self::Host), ("gpu", Self::Gpu)];
        let asked = if host_rings == Some(true) {
            Self::Host
        } else {
            Self::Gpu
        };
        Ok(env_choice::choice("GPUNVME_EMU_RINGS", var, &c)?.unwrap_or(asked))
    }

    /// `"gpu"` or `"host"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Host => "host",
        }
    }
}

/// The batched copy engines of the software controller, one per controller thread
/// (`nvme_emu::controller_thread_index` picks it).
pub struct GpuDma {
    cuda: Arc<Cuda>,
    kernels: Arc<EmuKernels>,
    engines: Vec<Engine>,
    mode: CopyMode,
    /// How Read data leaves the image.
    read_mode: ReadMode,
    /// Registered windows of the image(s) Reads copy from directly ([`ReadMode::Registered`]);
    /// dropped after the engines' streams are idle (see `Drop`).
    windows: ImageWindows,
    /// Read-only mappings of the image(s) staged Reads copy out of ([`ReadMode::Mapped`]).
    views: ImageViews,
    /// `GPUNVME_EMU_FETCH=ordered`: every read waits for the engine's earlier writes.
    always_ordered: bool,
    /// How staged Read data moves.
    staged: StagedCopies,
}

/// `GPUNVME_EMU_FETCH=ordered|unordered` (default `unordered`): whether reads of GPU memory the
/// controller never wrote still wait for its earlier writes (the behaviour before such reads
/// got a stream of their own; for comparisons).
fn fetch_always_ordered() -> Result<bool, GpuError> {
    fetch_ordered_from(env_choice::var("GPUNVME_EMU_FETCH").as_deref())
}

fn fetch_ordered_from(var: Option<&str>) -> Result<bool, GpuError> {
    let c = [("ordered", true), ("unordered", false)];
    Ok(env_choice::choice("GPUNVME_EMU_FETCH", var, &c)?.unwrap_or(false))
}

impl Drop for GpuDma {
    fn drop(&mut self) {
        // Direct copies read the windows' registered pages: let every queued copy finish
        // (bounded) before the windows are unregistered and unmapped.
        for e in &self.engines {
            for stream in [&e.stream, &e.fetch] {
                if let Err(err) = stream.wait_idle(GPU_WAIT) {
                    tracing::warn!("software controller's copy stream did not drain: {err}");
                }
            }
        }
    }
}

impl std::fmt::Debug for GpuDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDma")
            .field("engines", &self.engines.len())
            .finish_non_exhaustive()
    }
}

fn region_error(e: GpuError) -> RegionError {
    RegionError {
        reason: "GPU memory access failed".into(),
        source: Some(Box::new(e)),
    }
}

fn lock(e: &Engine) -> MutexGuard<'_, EngineState> {
    e.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Time a closure spends, added to `wait_ns`.
fn timed<T>(wait_ns: &mut u64, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    *wait_ns += t.elapsed().as_nanos() as u64;
    r
}

impl GpuDma {
    /// `threads` engines (one per controller thread), each with a stream in the controller's
    /// SM partition; every kernel they launch was loaded and warmed up by `kernels`' owner.
    pub fn new(
        cuda: &Arc<Cuda>,
        partition: &Arc<GreenPartition>,
        threads: usize,
        kernels: Arc<EmuKernels>,
    ) -> Result<Arc<Self>, GpuError> {
        let area = || -> Result<Staging, GpuError> {
            Ok(Staging {
                mem: PinnedMemory::alloc(cuda, MAX_PIECES * size_of::<CopyDesc>() + STAGING_BYTES)?,
                direct: Vec::new(),
                copies: Vec::new(),
                drained: Event::new(cuda)?,
                pieces: 0,
                bytes: 0,
            })
        };
        let read_mode = ReadMode::from_env()?;
        let mut engines = Vec::with_capacity(threads.max(1));
        for _ in 0..threads.max(1) {
            let stream = Stream::new(cuda, Placement::Controller, Some(partition))?;
            let fetch = Stream::new(cuda, Placement::Controller, Some(partition))?;
            let done_blocks = DeviceMemory::alloc(cuda, 256)?;
            // Every kernel this engine launches is loaded on its stream now, while nothing
            // spins: a first launch (lazy loading) during a client kernel's wait may need a
            // context synchronisation, which waits for that client, which waits for this copy.
            kernels.warm_up(&stream)?;
            kernels.warm_up_copies(&stream, done_blocks.ptr())?;
            kernels.warm_up_copies(&fetch, done_blocks.ptr())?;
            engines.push(Engine {
                stream,
                fetch,
                done_blocks,
                state: Mutex::new(EngineState {
                    areas: [area()?, area()?],
                    cur: 0,
                    gather: PinnedMemory::alloc(
                        cuda,
                        MAX_GATHER_PIECES * size_of::<CopyDesc>() + GATHER_BYTES,
                    )?,
                    pending: Vec::new(),
                    fetched: Vec::new(),
                    in_flight: false,
                    stats: DmaStats::default(),
                }),
            });
        }
        Ok(Arc::new(Self {
            cuda: cuda.clone(),
            kernels,
            engines,
            mode: CopyMode::from_env()?,
            read_mode,
            windows: ImageWindows::for_mode(cuda, read_mode),
            views: ImageViews::for_mode(read_mode, ColdReads::from_env()?),
            always_ordered: fetch_always_ordered()?,
            staged: StagedCopies::from_env()?,
        }))
    }

    /// How batches move.
    pub fn mode(&self) -> CopyMode {
        self.mode
    }

    /// Engines (controller threads served).
    pub fn engines(&self) -> usize {
        self.engines.len()
    }

    /// The calling controller thread's engine (the first for any other thread).
    fn engine(&self) -> &Engine {
        let i = nvme_emu::controller_thread_index().unwrap_or(0);
        &self.engines[i % self.engines.len()]
    }

    /// The registered image windows' counters.
    pub fn window_stats(&self) -> WindowStats {
        self.windows.stats()
    }

    /// How Read data leaves the image.
    pub fn read_mode(&self) -> ReadMode {
        self.read_mode
    }

    /// How Reads of image data not in the page cache are read.
    pub fn cold_reads(&self) -> ColdReads {
        self.views.cold_reads()
    }

    /// Totals over every engine.
    pub fn stats(&self) -> DmaStats {
        let mut total = DmaStats::default();
        for e in &self.engines {
            total.add(&lock(e).stats);
        }
        total
    }

    /// Each controller thread's engine's counters, by thread index.
    pub fn stats_per_thread(&self) -> Vec<DmaStats> {
        self.engines.iter().map(|e| lock(e).stats).collect()
    }

    /// Stages `data` for GPU address `dst`; `late` pieces are written after all others of the
    /// same flush.
    fn stage(
        &self,
        e: &Engine,
        st: &mut EngineState,
        dst: u64,
        data: &[u8],
        late: bool,
    ) -> Result<(), GpuError> {
        self.stage_with(
            e,
            st,
            dst,
            data.len(),
            late,
            false,
            false,
            |mem, at, done, n| {
                mem.write(at, &data[done..done + n]);
                Ok(())
            },
        )
        // The fill above never fails.
        .map(|_always_ok| ())
    }

    /// Stages `len` bytes for GPU address `dst`, flushing whenever the current area is full;
    /// `fill(mem, at, done, n)` puts bytes `done..done + n` of the range at `at` of `mem`. The
    /// first `fill` error ends the staging (what was described before it is still copied).
    /// `by_engine`: moved by copy engine ([`EngineCopy`]) rather than the scatter kernel.
    /// `aligned` (with `by_engine`): every piece starts at a [`DIRECT_ALIGN`] boundary of the
    /// host's addresses and spans whole multiples of it but for the range's last (direct I/O's
    /// rule: a copy engine takes any alignment).
    #[allow(clippy::too_many_arguments)]
    fn stage_with(
        &self,
        e: &Engine,
        st: &mut EngineState,
        dst: u64,
        len: usize,
        late: bool,
        by_engine: bool,
        aligned: bool,
        mut fill: impl FnMut(&PinnedMemory, usize, usize, usize) -> std::io::Result<()>,
    ) -> Result<std::io::Result<()>, GpuError> {
        let mut done = 0;
        while done < len {
            let area = &st.areas[st.cur];
            let data = MAX_PIECES * size_of::<CopyDesc>();
            // Staged at the destination's alignment modulo 16: the scatter then moves the bytes
            // as 16-byte vectors however the destination is aligned (`copy_piece`), and a Read
            // that follows another in GPU memory follows it in staging too (one copy).
            let src = if aligned {
                let base = area.mem.host_ptr().addr() + data;
                (base + area.bytes).next_multiple_of(DIRECT_ALIGN) - base
            } else {
                area.bytes + ((dst + done as u64).wrapping_sub(area.bytes as u64) & 15) as usize
            };
            let full = if by_engine {
                area.copies.len() == MAX_DIRECT
            } else {
                area.pieces == MAX_PIECES
            };
            if full || src >= STAGING_BYTES {
                self.flush_locked(e, st)?;
                continue;
            }
            let area = &mut st.areas[st.cur];
            // As much as the area has room for, in pieces and in bytes.
            let room = if by_engine {
                usize::MAX
            } else {
                (MAX_PIECES - area.pieces) * PIECE_BYTES
            };
            let mut n = (len - done).min(STAGING_BYTES - src).min(room);
            if aligned && n < len - done {
                n -= n % DIRECT_ALIGN;
                if n == 0 {
                    self.flush_locked(e, st)?;
                    continue;
                }
            }
            if let Err(err) = fill(&area.mem, data + src, done, n) {
                // Nothing of this piece was described: its staged bytes are never copied.
                return Ok(Err(err));
            }
            let to = dst + done as u64;
            if by_engine {
                match area.copies.last_mut() {
                    Some(last)
                        if last.src + last.len == src && last.dst + last.len as u64 == to =>
                    {
                        last.len += n;
                    }
                    _ => area.copies.push(EngineCopy {
                        src,
                        dst: to,
                        len: n,
                    }),
                }
                area.bytes = src + n;
            } else {
                Self::describe(area, to, src, n, late);
            }
            done += n;
        }
        Ok(Ok(()))
    }

    /// Stages `len` bytes for GPU address `dst` straight from `file` at `file_offset` (a
    /// positioned read into the staging area: the file's bytes are copied once on the host).
    /// `None` when gathered bytes overlap `dst` (they would have to be updated too: the caller
    /// takes the general path); else the file's result.
    fn stage_from_file(
        &self,
        dst: u64,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> Result<Option<std::io::Result<()>>, GpuError> {
        let e = self.engine();
        let mut guard = lock(e);
        let st = &mut *guard;
        let end = dst + len as u64;
        if st
            .fetched
            .iter()
            .any(|f| dst < f.gpu + f.len as u64 && f.gpu < end)
        {
            return Ok(None);
        }
        if let Some(w) = self.windows.lookup(file, file_offset, len) {
            let area = &st.areas[st.cur];
            if area.direct.len() == MAX_DIRECT {
                self.flush_locked(e, st)?;
            }
            let area = &mut st.areas[st.cur];
            match area.direct.last_mut() {
                Some(last)
                    if Arc::ptr_eq(&last.window, &w.window)
                        && last.offset + last.len == w.offset
                        && last.dst + last.len as u64 == dst =>
                {
                    last.len += len;
                }
                _ => area.direct.push(Direct {
                    dst,
                    window: w.window,
                    offset: w.offset,
                    len,
                }),
            }
            st.stats.direct_bytes += len as u64;
            return Ok(Some(Ok(())));
        }
        st.stats.staged_file_bytes += len as u64;
        let now = Instant::now();
        if st
            .stats
            .last_staged
            .is_none_or(|t| now.saturating_duration_since(t) > LULL)
        {
            st.stats.burst_start = Some(now);
        }
        let mut file_ns = 0;
        let by_engine = self.staged == StagedCopies::Engine
            && self.mode == CopyMode::Kernels
            && len >= ENGINE_COPY_MIN;
        // Out of a prefetch's pool where one reads the range (ColdReads::Prefetch), out of the
        // image's mapping where every page is cached (ReadMode::Mapped), by direct I/O where
        // none is (ColdReads::Direct; Reads the copy engine moves: they may sit anywhere in
        // staging), else `pread`.
        let base = usize::try_from(file_offset);
        let source = match self.views.lookup(file, file_offset, len) {
            Source::Pool(p) => Source::Pool(p),
            Source::Mapped(map) if base.is_ok() => {
                st.stats.mapped_bytes += len as u64;
                Source::Mapped(map)
            }
            Source::Direct(d) if by_engine => Source::Direct(d),
            Source::Mapped(_) | Source::Direct(_) | Source::Read => Source::Read,
        };
        let aligned = matches!(source, Source::Direct(_));
        let mut direct_bytes = 0;
        let r = self.stage_with(
            e,
            st,
            dst,
            len,
            false,
            by_engine,
            aligned,
            |mem, at, done, n| {
                let offset = file_offset + done as u64;
                timed(&mut file_ns, || match (&source, &base) {
                    (Source::Mapped(map), Ok(base)) => {
                        mem.copy_from_mapping(at, n, map, base + done)
                    }
                    (Source::Direct(d), _) => d.read_into(mem, at, n, offset, file).map(|direct| {
                        if direct {
                            direct_bytes += n as u64;
                        }
                    }),
                    (Source::Pool(p), _) => {
                        let got = p.serve(offset, n, |d, bytes| mem.write(at + d, bytes));
                        direct_bytes += got as u64;
                        mem.read_file_at(at + got, n - got, file, offset + got as u64)
                    }
                    _ => mem.read_file_at(at, n, file, offset),
                })
            },
        );
        st.stats.cold_direct_bytes += direct_bytes;
        st.stats.file_ns += file_ns;
        st.stats.last_staged = Some(Instant::now());
        r.map(Some)
    }

    /// Adds descriptors for `n` bytes at `src` of `area`'s data, bound for `dst`, in pieces
    /// of at most [`PIECE_BYTES`] (the caller checked there is room for them), and moves the
    /// area's fill mark past them.
    fn describe(area: &mut Staging, dst: u64, src: usize, n: usize, late: bool) {
        let mut at = 0;
        while at < n {
            let m = (n - at).min(PIECE_BYTES);
            let desc = CopyDesc {
                dst: dst + at as u64,
                src: (src + at) as u32,
                len: m as u32 | if late { COPY_LATE } else { 0 },
            };
            area.mem
                .write(area.pieces * size_of::<CopyDesc>(), desc.as_bytes());
            area.pieces += 1;
            at += m;
        }
        // The next piece is placed at its own destination's alignment (`stage_with`).
        area.bytes = src + n;
    }

    /// Launches the scatter of the current staging area (if it holds anything) and switches to
    /// the other one, waiting (bounded) until the GPU has drained that one.
    fn flush_locked(&self, e: &Engine, st: &mut EngineState) -> Result<(), GpuError> {
        let cur = st.cur;
        let pieces = st.areas[cur].pieces;
        if pieces == 0 && st.areas[cur].direct.is_empty() && st.areas[cur].copies.is_empty() {
            return Ok(());
        }
        self.cuda.make_current()?;
        // Direct copies first: a command's completion is among this area's pieces, and must
        // not become visible before its data.
        for d in st.areas[cur].direct.drain(..) {
            e.stream
                .copy_from_registered(d.window.registration(), d.offset, d.dst, d.len)?;
            st.stats.direct_copies += 1;
        }
        let data = MAX_PIECES * size_of::<CopyDesc>();
        let area = &mut st.areas[cur];
        let copies = area.copies.len() as u64;
        for c in area.copies.drain(..) {
            e.stream
                .copy_from_pinned(&area.mem, data + c.src, c.dst, c.len)?;
        }
        st.stats.engine_copies += copies;
        let area = &st.areas[cur];
        let base = area.mem.device_ptr();
        match self.mode {
            CopyMode::Kernels if pieces == 0 => {}
            CopyMode::Kernels => {
                launch_per_piece(
                    &e.stream,
                    self.kernels.scatter,
                    pieces,
                    &[
                        Arg::U64(base),
                        Arg::U32(pieces as u32),
                        Arg::U64(base + data as u64),
                        Arg::U64(e.done_blocks.ptr()),
                    ],
                )?;
            }
            CopyMode::Memcpy => {
                // In stream order: every piece, then the late ones (completion phase dwords).
                for late in [false, true] {
                    for i in 0..pieces {
                        let mut d = CopyDesc::default();
                        area.mem.read(i * size_of::<CopyDesc>(), d.as_mut_bytes());
                        if (d.len & COPY_LATE != 0) == late {
                            let len = (d.len & !COPY_LATE) as usize;
                            e.stream.copy_from_pinned(
                                &area.mem,
                                data + d.src as usize,
                                d.dst,
                                len,
                            )?;
                        }
                    }
                }
            }
        }
        area.drained.record(&e.stream)?;
        st.in_flight = true;
        st.stats.scatters += 1;
        st.stats.pieces += pieces as u64;
        let area = &mut st.areas[cur];
        area.pieces = 0;
        area.bytes = 0;
        st.cur ^= 1;
        let drained = &st.areas[st.cur].drained;
        let mut waited = 0;
        let r = timed(&mut waited, || drained.wait(GPU_WAIT));
        st.stats.wait_ns += waited;
        st.stats.drain_wait_ns += waited;
        r
    }

    /// Performs every staged write now (asynchronously; later work on the stream is ordered
    /// after it). Ends the batch: gathered bytes are no longer trusted.
    fn flush(&self) -> Result<(), GpuError> {
        let e = self.engine();
        let mut st = lock(e);
        st.fetched.clear();
        st.pending.clear();
        self.flush_locked(e, &mut st)
    }

    /// Waits (bounded) until every copy this thread's engine issued so far has run: the
    /// writes of its flushes are then visible to the GPU's threads.
    fn wait_flushed(&self) -> Result<(), GpuError> {
        let e = self.engine();
        let t = Instant::now();
        let r = e.stream.wait_idle(GPU_WAIT);
        lock(e).stats.wait_ns += t.elapsed().as_nanos() as u64;
        r
    }

    /// Whether the calling thread's engine holds writes not yet known to be visible: staged and
    /// not flushed, or flushed and not yet seen finished. A failure to ask counts as pending
    /// (the caller then orders through the engine, which is always correct).
    fn pending(&self) -> bool {
        let e = self.engine();
        let mut st = lock(e);
        let cur = st.cur;
        if st.areas[cur].pieces > 0
            || !st.areas[cur].direct.is_empty()
            || !st.areas[cur].copies.is_empty()
        {
            return true;
        }
        if st.in_flight {
            // The area flushed last is the other one; its event follows every earlier flush.
            match st.areas[cur ^ 1].drained.is_done() {
                Ok(true) => st.in_flight = false,
                _ => return true,
            }
        }
        false
    }

    /// Drops gathered bytes and pending ranges: a new batch begins.
    fn forget_gathered(&self) {
        let e = self.engine();
        let mut st = lock(e);
        st.fetched.clear();
        st.pending.clear();
    }

    /// Notes ranges the controller is about to read (`ordered`: after the engine's earlier
    /// writes); the next read fetches them all at once. Bytes gathered before are no longer
    /// trusted (a new step of the batch begins).
    fn prefetch(&self, ranges: impl Iterator<Item = (u64, usize)>, ordered: bool) {
        let e = self.engine();
        let mut st = lock(e);
        st.fetched.clear();
        st.pending.extend(
            ranges
                .filter(|&(_, len)| len > 0 && len <= GATHER_BYTES)
                .map(|(gpu, len)| (gpu, len, ordered)),
        );
    }

    /// The stream a read copies on, after flushing the staged writes if it is `ordered` (or
    /// every read is, `GPUNVME_EMU_FETCH=ordered`).
    fn read_stream<'a>(
        &self,
        e: &'a Engine,
        st: &mut EngineState,
        ordered: bool,
    ) -> Result<&'a Stream, GpuError> {
        if ordered || self.always_ordered {
            self.flush_locked(e, st)?;
            Ok(&e.stream)
        } else {
            st.stats.unordered_reads += 1;
            Ok(&e.fetch)
        }
    }

    /// Copies every pending range (as many as fit) into the gather area with one kernel, after
    /// every staged write if any of them is ordered, and waits for it (bounded).
    fn gather_locked(&self, e: &Engine, st: &mut EngineState) -> Result<(), GpuError> {
        st.fetched.clear();
        let mut at = 0usize;
        let mut n = 0usize;
        for &(gpu, len, _) in &st.pending {
            if n == MAX_GATHER_PIECES || at + len > GATHER_BYTES {
                break;
            }
            let desc = CopyDesc {
                dst: gpu,
                src: at as u32,
                len: len as u32,
            };
            st.gather.write(n * size_of::<CopyDesc>(), desc.as_bytes());
            st.fetched.push(Fetched { gpu, len, at });
            at = (at + len).next_multiple_of(16);
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        // The descriptors are in pinned memory no queued copy reads (every gather and sync
        // read is waited for): the flush of an ordered gather may come after them.
        let ordered = st.pending[..n].iter().any(|&(_, _, o)| o);
        st.pending.drain(..n);
        let stream = self.read_stream(e, st, ordered)?;
        let data = MAX_GATHER_PIECES * size_of::<CopyDesc>();
        match self.mode {
            CopyMode::Kernels => {
                let base = st.gather.device_ptr();
                launch_per_piece(
                    stream,
                    self.kernels.gather,
                    n,
                    &[
                        Arg::U64(base),
                        Arg::U32(n as u32),
                        Arg::U64(base + data as u64),
                    ],
                )?;
            }
            CopyMode::Memcpy => {
                for f in &st.fetched {
                    stream.copy_to_pinned(&st.gather, data + f.at, f.gpu, f.len)?;
                }
            }
        }
        st.stats.gathers += 1;
        st.stats.gathered += n as u64;
        Self::wait_read(st, stream)
    }

    /// Waits (bounded) for a read's copy on `stream`, counted as fetch waiting.
    fn wait_read(st: &mut EngineState, stream: &Stream) -> Result<(), GpuError> {
        let mut waited = 0;
        let r = timed(&mut waited, || stream.wait_idle(GPU_WAIT));
        st.stats.wait_ns += waited;
        st.stats.fetch_wait_ns += waited;
        r
    }

    /// Serves `buf` from gathered bytes if one gathered range covers it.
    fn hit(st: &mut EngineState, src: u64, buf: &mut [u8]) -> bool {
        let end = src + buf.len() as u64;
        let Some(f) = st
            .fetched
            .iter()
            .find(|f| f.gpu <= src && end <= f.gpu + f.len as u64)
            .copied()
        else {
            return false;
        };
        let off = MAX_GATHER_PIECES * size_of::<CopyDesc>() + f.at + (src - f.gpu) as usize;
        st.gather.read(off, buf);
        st.stats.hits += 1;
        true
    }

    /// Reads GPU memory at `src` into `buf` (bounded wait; `ordered`: after every staged
    /// write): from the bytes a gather fetched when a prefetch announced the range, else with a
    /// copy of its own.
    fn read(&self, src: u64, buf: &mut [u8], ordered: bool) -> Result<(), GpuError> {
        let e = self.engine();
        let mut st = lock(e);
        if Self::hit(&mut st, src, buf) {
            return Ok(());
        }
        if !st.pending.is_empty() {
            if buf.len() <= GATHER_BYTES {
                st.pending.insert(0, (src, buf.len(), ordered));
            }
            self.gather_locked(e, &mut st)?;
            if Self::hit(&mut st, src, buf) {
                return Ok(());
            }
        }
        let stream = self.read_stream(e, &mut st, ordered)?;
        st.stats.sync_reads += 1;
        let bounce = MAX_GATHER_PIECES * size_of::<CopyDesc>();
        // A copy of its own overwrites the gather area.
        st.fetched.clear();
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(GATHER_BYTES);
            stream.copy_to_pinned(&st.gather, bounce, src + done as u64, n)?;
            Self::wait_read(&mut st, stream)?;
            st.gather.read(bounce, &mut buf[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn write(&self, dst: u64, data: &[u8], late_last_dword: bool) -> Result<(), GpuError> {
        let e = self.engine();
        let mut st = lock(e);
        // Gathered copies of these bytes must read as written (reads see every earlier write).
        let end = dst + data.len() as u64;
        let base = MAX_GATHER_PIECES * size_of::<CopyDesc>();
        for i in 0..st.fetched.len() {
            let f = st.fetched[i];
            let (lo, hi) = (dst.max(f.gpu), end.min(f.gpu + f.len as u64));
            if lo < hi {
                let at = base + f.at + (lo - f.gpu) as usize;
                st.gather
                    .write(at, &data[(lo - dst) as usize..(hi - dst) as usize]);
            }
        }
        if late_last_dword && data.len() >= 4 {
            let split = data.len() - 4;
            self.stage(e, &mut st, dst, &data[..split], false)?;
            self.stage(e, &mut st, dst + split as u64, &data[split..], true)
        } else {
            self.stage(e, &mut st, dst, data, false)
        }
    }
}

/// A range of GPU memory as the software controller sees it: a [`MemoryRegion`] whose writes
/// are staged in a [`GpuDma`] engine until the controller's batch ends.
pub struct GpuRegion {
    engine: Arc<GpuDma>,
    ptr: u64,
    len: usize,
    /// A submission queue ring: the controller reads one at the start of every batch, which
    /// ends the trust in bytes gathered for the batch before (even one that wrote nothing and
    /// so was never flushed).
    starts_batches: bool,
    /// The controller has written into this memory: its reads are ordered after the engine's
    /// writes from then on. An SQ ring's reads never are: the controller writes it only to
    /// poison fetched entries (hostile mode), and a client rewrites such a slot only after a
    /// completion staged after the poison (late pieces land after all others), before the
    /// doorbell that makes the controller read it again.
    written: AtomicBool,
    _mem: Arc<DeviceMemory>,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuRegion({:#x}+{:#x})", self.ptr, self.len)
    }
}

impl GpuRegion {
    /// The whole of `mem`, reached through `engine`.
    pub fn new(engine: Arc<GpuDma>, mem: Arc<DeviceMemory>) -> Self {
        Self {
            engine,
            ptr: mem.ptr(),
            len: mem.len(),
            starts_batches: false,
            written: AtomicBool::new(false),
            _mem: mem,
        }
    }

    /// A submission queue ring in `mem` (see `starts_batches`).
    pub fn submission_queue(engine: Arc<GpuDma>, mem: Arc<DeviceMemory>) -> Self {
        Self {
            starts_batches: true,
            ..Self::new(engine, mem)
        }
    }
}

impl GpuRegion {
    /// Whether reads of this memory must see the engine's earlier writes.
    fn ordered(&self) -> bool {
        // Relaxed: set and read by the controller threads, and a thread's own writes are all
        // it orders against (another thread's engine is never waited for, either way).
        !self.starts_batches && self.written.load(Ordering::Relaxed)
    }

    fn note_written(&self) {
        self.written.store(true, Ordering::Relaxed);
    }
}

impl MemoryRegion for GpuRegion {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        if self.starts_batches {
            self.engine.forget_gathered();
        }
        self.engine
            .read(self.ptr + offset, buf, self.ordered())
            .map_err(region_error)
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.note_written();
        self.engine
            .write(self.ptr + offset, data, false)
            .map_err(region_error)
    }

    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.note_written();
        self.engine
            .write(self.ptr + offset, data, true)
            .map_err(region_error)
    }

    fn flush(&self) -> Result<(), RegionError> {
        self.engine.flush().map_err(region_error)
    }

    fn defers_writes(&self) -> bool {
        true
    }

    fn wait_flushed(&self) -> Result<(), RegionError> {
        self.engine.wait_flushed().map_err(region_error)
    }

    fn read_from_file(
        &self,
        offset: u64,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> Option<std::io::Result<()>> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.len as u64)
        {
            return Some(Err(std::io::ErrorKind::InvalidInput.into()));
        }
        self.note_written();
        // An engine failure (a GPU error) is None: the general path reports it as a DMA error.
        self.engine
            .stage_from_file(self.ptr + offset, len, file, file_offset)
            .unwrap_or_default()
    }

    fn prefetch(&self, ranges: &[(u64, usize)]) -> Result<(), RegionError> {
        let ptr = self.ptr;
        self.engine.prefetch(
            ranges.iter().map(|&(off, len)| (ptr + off, len)),
            self.ordered(),
        );
        Ok(())
    }
}

/// A completion queue ring in pinned host memory mapped into the GPU ([`RingPlacement::Host`]).
///
/// The controller writes an entry straight into it while its thread's copy engine holds no
/// write that is not yet visible; otherwise through that engine, like GPU memory, so that the
/// entry lands after the data of its command (in GPU memory, behind the engine) and after
/// every earlier entry staged there. Either way no controller thread waits for the GPU here.
struct HostCqRegion {
    engine: Arc<GpuDma>,
    mem: Arc<PinnedMemory>,
}

impl MemoryRegion for HostCqRegion {
    fn len(&self) -> usize {
        self.mem.len()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        if self.engine.pending() {
            self.engine.flush().map_err(region_error)?;
            self.engine.wait_flushed().map_err(region_error)?;
        }
        self.mem.read(offset as usize, buf);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        if self.engine.pending() {
            return self
                .engine
                .write(self.mem.device_ptr() + offset, data, false)
                .map_err(region_error);
        }
        self.mem.write(offset as usize, data);
        Ok(())
    }

    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        if self.engine.pending() || data.len() < 4 || offset % 4 != 0 {
            return self
                .engine
                .write(self.mem.device_ptr() + offset, data, true)
                .map_err(region_error);
        }
        let split = data.len() - 4;
        self.mem.write(offset as usize, &data[..split]);
        let last = u32::from_le_bytes(data[split..].try_into().expect("4 bytes"));
        // Release: the rest of the entry (and the command's data in host memory) first.
        self.mem.store_u32(offset as usize + split, last);
        Ok(())
    }

    fn flush(&self) -> Result<(), RegionError> {
        self.engine.flush().map_err(region_error)
    }

    fn defers_writes(&self) -> bool {
        // It may stage (behind the engine's writes), so the controller must not wait for
        // deferred writes before an entry here: the engine orders them itself.
        true
    }

    fn wait_flushed(&self) -> Result<(), RegionError> {
        self.engine.wait_flushed().map_err(region_error)
    }
}

/// A doorbell word in pinned host memory that GPU threads write and the software controller
/// polls.
pub struct PinnedDoorbell {
    page: Arc<PinnedMemory>,
    offset: usize,
}

impl PinnedDoorbell {
    /// The word at `offset` of `page`.
    pub fn new(page: Arc<PinnedMemory>, offset: usize) -> Self {
        Self { page, offset }
    }

    /// The GPU's address of the word.
    pub fn device_ptr(&self) -> u64 {
        self.page.device_ptr() + self.offset as u64
    }

    /// Zeroes the word (before the queue is created).
    pub fn reset(&self) {
        self.page.store_u32(self.offset, 0)
    }
}

impl DoorbellWord for PinnedDoorbell {
    fn load(&self) -> u32 {
        self.page.load_u32(self.offset)
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

/// Registers `mem` in the software controller's address map as a region reached through
/// `engine` (a submission queue ring when `sq`): its device address range, unregistered when
/// the returned region's last holder drops.
fn register_region(
    map: &Arc<DeviceAddressMap>,
    engine: &Arc<GpuDma>,
    mem: Arc<DeviceMemory>,
    sq: bool,
) -> Result<DmaRegion, GpuError> {
    let region = Arc::new(if sq {
        GpuRegion::submission_queue(engine.clone(), mem.clone())
    } else {
        GpuRegion::new(engine.clone(), mem.clone())
    });
    let len = mem.len().next_multiple_of(4096);
    map_region(map, region, len, Box::new(mem))
}

/// Registers `region` (`len` bytes) in the software controller's address map: its device
/// address range, unregistered when the returned region's last holder drops, which also keeps
/// `keep` (the memory behind it) alive until then.
fn map_region(
    map: &Arc<DeviceAddressMap>,
    region: Arc<dyn MemoryRegion>,
    len: usize,
    keep: Box<dyn Send + Sync>,
) -> Result<DmaRegion, GpuError> {
    let base = map.register_region(region).map_err(GpuError::controller)?;
    Ok(DmaRegion::contiguous(
        base,
        len,
        Box::new((
            Unregister {
                map: map.clone(),
                base,
            },
            keep,
        )),
    ))
}

/// One queue pair's memory as the controller (device addresses) and GPU threads (GPU
/// addresses) see it.
struct PairMemory {
    sq_region: Arc<DmaRegion>,
    cq_region: Arc<DmaRegion>,
    /// GPU addresses of the rings.
    sq: u64,
    cq: u64,
    /// (GPU, device) addresses of the PRP-list pages and of the slot buffers.
    prp_lists: (u64, u64),
    slot_buffers: (u64, u64),
    /// Keeps all of it allocated and mapped.
    keep: Box<dyn Send + Sync>,
}

/// [`RingPlacement::Gpu`]: rings, PRP-list pages (two per slot: the slot buffer's pre-built
/// list, and one for `build_prps`) and slot buffers in GPU memory, registered in the
/// controller's address map behind the copy engines.
fn gpu_pair_memory(
    cuda: &Arc<Cuda>,
    p: &Plan,
    register_as: impl Fn(Arc<DeviceMemory>, bool) -> Result<DmaRegion, GpuError>,
) -> Result<PairMemory, GpuError> {
    let depth = p.depth as usize;
    let sq = Arc::new(DeviceMemory::alloc(
        cuda,
        (depth * 64).next_multiple_of(4096),
    )?);
    let cq = Arc::new(DeviceMemory::alloc(
        cuda,
        (depth * 16).next_multiple_of(4096),
    )?);
    let prp = Arc::new(DeviceMemory::alloc(cuda, depth * 2 * 4096)?);
    let bufs = Arc::new(DeviceMemory::alloc(
        cuda,
        depth * p.slot_buffer_bytes as usize,
    )?);
    let sq_region = Arc::new(register_as(sq.clone(), true)?);
    let cq_region = Arc::new(register_as(cq.clone(), false)?);
    let prp_region = register_as(prp.clone(), false)?;
    let buf_region = register_as(bufs.clone(), false)?;
    let prp_bus = prp_region.device_address(0);
    let buf_bus = buf_region.device_address(0);
    // Pre-built PRP lists: slot s's list names pages 1.. of slot s's buffer.
    if let Some(lists) = prebuilt_prp_lists(p.depth, p.slot_buffer_bytes, buf_bus) {
        prp.write(0, lists.as_bytes())?;
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

/// [`RingPlacement::Host`]: the pair's rings, PRP-list pages and slot buffers in one arena of
/// the controller's own host DMA memory ([`QueueLayout`], as transport (c) lays them out on a
/// real SSD), registered with CUDA so that GPU threads reach it over PCIe.
fn host_pair_memory(
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

/// Transport (a) as the runtime sees it: the software controller and its copy engines.
pub struct SoftwareTransport {
    emu: Arc<EmuDevice>,
    engine: Arc<GpuDma>,
    rings: RingPlacement,
    /// Threads a [`QueueTransport::will_read`] hint walks the image with, having the kernel
    /// read it ahead (0: the hint does nothing; [`READAHEAD_ENV`]).
    readahead: usize,
    /// Reader threads of a prefetch ([`ColdReads::Prefetch`]; `crate::prefetch::READERS_ENV`).
    prefetch_readers: usize,
}

/// `GPUNVME_EMU_READAHEAD=on|off|N` (`on`: [`READAHEAD_WALKERS`] threads; `N` from 1 to 16
/// threads): whether a hint of Reads to come ([`QueueTransport::will_read`]) has the kernel
/// read the parts of the image not in the page cache ahead of the controller threads
/// ([`Readahead`]), or does nothing (`off`). Unset: `on`, but `off` where cold Reads go by
/// direct I/O (`GPUNVME_EMU_COLD_READS=direct`: pages read ahead into the page cache would turn
/// them into copies out of it, the disk read twice where the two race).
pub const READAHEAD_ENV: &str = "GPUNVME_EMU_READAHEAD";

/// Threads of a [`Readahead`] by default: each `posix_fadvise` waits while it submits its
/// block's reads, so several keep more of the disk's queue filled.
pub const READAHEAD_WALKERS: usize = 4;

fn readahead_from(var: Option<&str>, default: usize) -> Result<usize, GpuError> {
    let v = var.map(str::trim).filter(|v| !v.is_empty());
    if let Some(n) = v.and_then(|v| v.parse::<usize>().ok()) {
        if (1..=16).contains(&n) {
            return Ok(n);
        }
    }
    let c = [("on", READAHEAD_WALKERS), ("off", 0)];
    match env_choice::choice(READAHEAD_ENV, v, &c) {
        Ok(n) => Ok(n.unwrap_or(default)),
        Err(GpuError::InvalidArgument(m)) => Err(GpuError::InvalidArgument(format!(
            "{m} or a thread count from 1 to 16"
        ))),
        Err(e) => Err(e),
    }
}

/// Bytes of the image one `posix_fadvise(WILLNEED)` of [`Readahead`] asks for.
const READAHEAD_BLOCK: u64 = 8 << 20;

/// A [`QueueTransport::will_read`] hint at work: threads of its own walk the hinted byte
/// ranges of the image in order, a [`READAHEAD_BLOCK`] at a time (the next block to whichever
/// thread is free), and have the kernel read each block not wholly in the page cache
/// (`gpu_queues::ffi::os::advise_willneed`: the reads are started, not waited for). A cold
/// image is then read at the disk's pace by large requests in flight together, rather than by
/// each controller thread's 128 KiB `pread` in turn (on the lent H200, 2026-11-28, cold loads
/// ran at 1.7 to 1.8 GB/s where fastsafetensors read the same disk at 2.1 to 2.9; with one
/// such thread, 1.8 to 2.1). Resident blocks cost one `cachestat` each, made by one thread
/// until a block is found to read, when the others start. Dropping this stops
/// the walk without waiting for it: each thread ends after the block in hand (its
/// `posix_fadvise` may wait for room in the device queue) and owns its descriptor, so nothing
/// it touches goes away under it.
struct Readahead {
    stop: Arc<AtomicBool>,
    /// The walk's owner: returns the bytes it asked for and the threads it ran.
    thread: Option<std::thread::JoinHandle<(u64, usize)>>,
}

impl Readahead {
    /// Starts the walk over `ranges` (byte ranges of `file`) on `walkers` threads.
    fn start(
        file: std::fs::File,
        ranges: Vec<(u64, u64)>,
        walkers: usize,
    ) -> std::io::Result<Self> {
        use std::os::fd::AsFd;
        use std::sync::atomic::{AtomicU64, AtomicUsize};
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let blocks: Vec<(u64, u64)> = ranges
            .iter()
            .flat_map(|&(start, len)| {
                let end = start.saturating_add(len);
                (start..end)
                    .step_by(READAHEAD_BLOCK as usize)
                    .map(move |at| (at, (end - at).min(READAHEAD_BLOCK)))
            })
            .collect();
        // One thread of ours owns the walk; it runs the other walkers scoped and returns when
        // they all have.
        let thread = std::thread::Builder::new()
            .name("gpunvme-readahead".into())
            .spawn(move || {
                let (next, asked) = (AtomicUsize::new(0), AtomicU64::new(0));
                // `on_cold` runs before each block that is not all in the page cache.
                let walk = |on_cold: &dyn Fn()| {
                    while !halt.load(Ordering::Relaxed) {
                        let Some(&(at, n)) = blocks.get(next.fetch_add(1, Ordering::Relaxed))
                        else {
                            return;
                        };
                        let cached = gpu_queues::ffi::os::range_cached(file.as_fd(), at, n);
                        if !cached.unwrap_or(false) {
                            on_cold();
                            if gpu_queues::ffi::os::advise_willneed(file.as_fd(), at, n).is_ok() {
                                asked.fetch_add(n, Ordering::Relaxed);
                            }
                        }
                    }
                };
                // The other walkers start at the first block there is to read: a warm image
                // costs one thread's cachestats, not several threads beside the controller's.
                let threads = std::thread::scope(|s| {
                    let started = std::cell::Cell::new(false);
                    let ran = std::cell::Cell::new(1usize);
                    let more = || {
                        if !started.replace(true) {
                            for _ in 1..walkers.clamp(1, blocks.len().max(1)) {
                                // A thread the system refuses is one walker fewer.
                                let helper = std::thread::Builder::new()
                                    .name("gpunvme-readahead".into())
                                    .spawn_scoped(s, || walk(&|| {}));
                                if helper.is_ok() {
                                    ran.set(ran.get() + 1);
                                }
                            }
                        }
                    };
                    walk(&more);
                    ran.get()
                });
                let bytes = asked.into_inner();
                tracing::trace!(bytes, threads, "image read ahead of Reads");
                (bytes, threads)
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Waits for the whole walk; the bytes it asked the kernel to read and the threads it ran
    /// (tests).
    #[cfg(test)]
    fn finish(mut self) -> (u64, usize) {
        self.thread
            .take()
            .map_or((0, 0), |t| t.join().unwrap_or((0, 0)))
    }
}

impl Drop for Readahead {
    fn drop(&mut self) {
        // Detached, not joined: the hint's owner (a load) does not wait on the disk.
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take();
    }
}

impl std::fmt::Debug for SoftwareTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftwareTransport")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl SoftwareTransport {
    /// The transport of `queues`, when it is the software controller.
    pub fn of(queues: &GpuQueues) -> Option<&Self> {
        queues.backend().as_any().downcast_ref::<Self>()
    }

    /// What each controller thread's copy engine did, by thread index.
    pub fn dma_stats_per_thread(&self) -> Vec<DmaStats> {
        self.engine.stats_per_thread()
    }

    /// What the copy engines did (totals over the controller's threads).
    pub fn dma_stats(&self) -> DmaStats {
        self.engine.stats()
    }

    /// How the software controller moves batches.
    pub fn copy_mode(&self) -> CopyMode {
        self.engine.mode()
    }

    /// Where the queues' rings and slot buffers are.
    pub fn ring_placement(&self) -> RingPlacement {
        self.rings
    }

    /// Controller threads with a copy engine of their own.
    pub fn controller_threads(&self) -> usize {
        self.engine.engines()
    }

    /// How Read data leaves the image, and the registered windows' counters.
    pub fn window_stats(&self) -> (ReadMode, WindowStats) {
        (self.engine.read_mode(), self.engine.window_stats())
    }
}

impl SoftwareTransport {
    /// Starts a prefetch of `ranges` of namespace `nsid`'s image at `path` for the Reads to come
    /// ([`crate::prefetch`]) and has the Read path look in its pool until the result is
    /// dropped. `None`: every page of the ranges is in the page cache (nothing to read ahead).
    fn prefetch(
        &self,
        nsid: u32,
        path: &std::path::Path,
        ranges: &[(u64, u64)],
    ) -> std::io::Result<Option<ReadAhead>> {
        use std::os::fd::AsFd;
        let image = std::fs::File::open(path)?;
        let warm = ranges.iter().all(|&(at, n)| {
            gpu_queues::ffi::os::range_cached(image.as_fd(), at, n).unwrap_or(false)
        });
        if warm {
            return Ok(None);
        }
        let writes = self
            .emu
            .media_writes(nsid)
            .ok_or_else(|| std::io::Error::other("the namespace is not an image file"))?;
        let direct = gpu_queues::ffi::os::reopen_direct(&image)?;
        let running = crate::prefetch::Prefetch::start(
            &image,
            direct,
            writes,
            ranges,
            self.prefetch_readers,
            crate::prefetch::POOL_BYTES,
        )?;
        self.engine.views.add_prefetch(running.prefetch().clone());
        Ok(Some(ReadAhead::running(Box::new(PrefetchHint {
            running: Some(running),
            engine: self.engine.clone(),
        }))))
    }
}

/// A prefetch the Read path looks in, until dropped.
struct PrefetchHint {
    running: Option<crate::prefetch::Running>,
    engine: Arc<GpuDma>,
}

impl Drop for PrefetchHint {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.engine.views.remove_prefetch(r.prefetch());
            // Stops the readers; the pool (up to a GiB of mapped memory) goes with the last of
            // them, or here: unmapped on a thread of its own, not the caller's (a load's end).
            let unmapped = std::thread::Builder::new()
                .name("gpunvme-prefetch".into())
                .spawn(move || drop(r));
            // A thread the system refuses: the drop happens here (the closure was dropped).
            drop(unmapped);
        }
    }
}

impl QueueTransport for SoftwareTransport {
    fn alloc_buffer(&self, cuda: &Arc<Cuda>, len: usize) -> Result<GpuBuffer, GpuError> {
        let mem = Arc::new(DeviceMemory::alloc(cuda, len.next_multiple_of(4096))?);
        let region = register_region(self.emu.address_map(), &self.engine, mem.clone(), false)?;
        Ok(GpuBuffer::new(mem, 0, region))
    }

    fn map_memory(&self, _: &Arc<Cuda>, mem: Arc<DeviceMemory>) -> Result<GpuBuffer, GpuError> {
        // The device-address range is whole pages; the region behind it ends where `mem`
        // does, so the controller reaches no byte past the caller's allocation.
        let region = register_region(self.emu.address_map(), &self.engine, mem.clone(), false)?;
        Ok(GpuBuffer::new(mem, 0, region))
    }

    fn queue_deleted(&self, qid: u16) {
        self.emu.detach_external_doorbells(qid);
    }

    /// Has the kernel read the hinted LBAs of the namespace's image that are not in the page
    /// cache, ahead of the controller threads ([`Readahead`]; a namespace in memory, or of
    /// another LBA size than the hint's: nothing). The image is opened again by its path, for
    /// the thread to own: the page cache is the file's, so any descriptor serves, and a file
    /// put in its place since would only waste the hint.
    fn will_read(&self, nsid: u32, lba_shift: u32, runs: &[(u64, u64)]) -> ReadAhead {
        let prefetch = self.engine.cold_reads() == ColdReads::Prefetch;
        if (self.readahead == 0 && !prefetch) || lba_shift >= 32 {
            return ReadAhead::none();
        }
        let Some(ns) = (nsid as usize)
            .checked_sub(1)
            .and_then(|i| self.emu.namespace_configs().get(i))
        else {
            return ReadAhead::none();
        };
        let nvme_emu::Backend::File(path) = &ns.backend else {
            return ReadAhead::none();
        };
        if ns.lba_size != 1 << lba_shift {
            return ReadAhead::none();
        }
        let unit = 1u64 << lba_shift;
        let ranges: Vec<(u64, u64)> = runs
            .iter()
            .filter_map(|&(lba, n)| Some((lba.checked_mul(unit)?, n.checked_mul(unit)?)))
            .filter(|&(_, len)| len > 0)
            .collect();
        if ranges.is_empty() {
            return ReadAhead::none();
        }
        if prefetch {
            match self.prefetch(nsid, path, &ranges) {
                Ok(Some(running)) => return running,
                Ok(None) => return ReadAhead::none(),
                // Then as with buffered cold reads.
                Err(e) => tracing::debug!("no prefetch of {}: {e}", path.display()),
            }
        }
        if self.readahead == 0 {
            return ReadAhead::none();
        }
        match std::fs::File::open(path).and_then(|f| Readahead::start(f, ranges, self.readahead)) {
            Ok(r) => ReadAhead::running(Box::new(r)),
            Err(e) => {
                tracing::debug!("no readahead of {}: {e}", path.display());
                ReadAhead::none()
            }
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// [`queues`], with the choice reported as [`gpu_queues::transport::open`] reports its own:
/// for callers that print which transport ran.
pub fn open(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    emu: &Arc<EmuDevice>,
    opts: &GpuQueueOptions,
) -> Result<(GpuQueues, TransportChoice), GpuError> {
    select(vec![Candidate::Try(
        TransportKind::SoftwareController,
        Box::new(|| queues(cuda, controller, emu, opts)),
    )])
}

/// Builds queue pairs in GPU memory on `controller`, whose transport is the software
/// controller `emu` (transport (a)): GPU memory is registered in its device-address map and
/// each queue's doorbells are attached as pinned-host-page words before the queue exists.
pub fn queues(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    emu: &Arc<EmuDevice>,
    opts: &GpuQueueOptions,
) -> Result<GpuQueues, GpuError> {
    let p = plan(controller.info(), opts)?;
    let Plan {
        depth,
        slot_buffer_bytes,
        count,
        ..
    } = p;

    let started = Instant::now();
    let kernels = Kernels::load(cuda)?;
    let t_kernels = started.elapsed();
    let partition = GreenPartition::split(cuda, opts.controller_sms)?;
    let client_stream = Stream::new(cuda, Placement::Client, Some(&partition))?;
    // Every client kernel loaded before any of them spins (lazy loading: see
    // `Kernels::warm_up_clients`).
    kernels.warm_up_clients(cuda, &client_stream)?;
    // One copy engine per controller thread, each warmed up on its own stream.
    let emu_kernels = EmuKernels::load(cuda)?;
    let t_warm = started.elapsed();
    let engine = GpuDma::new(cuda, &partition, emu.controller_threads(), emu_kernels)?;
    let readahead = readahead_from(
        env_choice::var(READAHEAD_ENV).as_deref(),
        match engine.cold_reads() {
            ColdReads::Direct => 0,
            ColdReads::Buffered | ColdReads::Prefetch => READAHEAD_WALKERS,
        },
    )?;
    let prefetch_readers = crate::prefetch::readers_from_env()?;
    let t_engines = started.elapsed();
    let doorbells = Arc::new(PinnedMemory::alloc(cuda, count as usize * DOORBELL_STRIDE)?);
    let host_flags = PinnedMemory::alloc(cuda, 4096)?;
    let common = DescCommon::new(&p, &host_flags, opts.timeout, 0).with_protection(controller)?;
    let map = emu.address_map();
    let register_as = |mem: Arc<DeviceMemory>, sq: bool| register_region(map, &engine, mem, sq);
    let rings = RingPlacement::from_env(opts.host_rings)?;

    let mut pairs = Vec::with_capacity(count as usize);
    for q in 0..count as usize {
        let mem = match rings {
            RingPlacement::Gpu => gpu_pair_memory(cuda, &p, register_as)?,
            RingPlacement::Host => host_pair_memory(cuda, emu, &engine, &p)?,
        };
        let (state, slots) = alloc_protocol_state(cuda, depth)?;
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
                sq: mem.sq_region.clone(),
                sq_entries: depth,
                cq: mem.cq_region.clone(),
                cq_entries: depth,
            },
            |qid| {
                emu.attach_external_doorbells(qid, sq_word, cq_word)
                    .map_err(|e| nvme::Error::Unsupported(format!("external doorbells: {e}")))
            },
        );
        let created = created?;
        let desc = common.desc(DescParts {
            sq: mem.sq,
            cq: mem.cq,
            doorbells: (sq_db, cq_db),
            state: state.ptr(),
            slots: slots.ptr(),
            prp_lists: mem.prp_lists,
            slot_buffers: mem.slot_buffers,
            qid: created.qid(),
        });
        pairs.push(GpuQueuePair {
            created: Some(created),
            desc,
            state: state.clone(),
            keep: vec![Box::new(mem.keep), Box::new(vec![state, slots])],
        });
    }
    tracing::info!(
        queues = count,
        depth,
        slot_buffer_bytes,
        rings = rings.name(),
        controller_sms = partition.controller_sms(),
        kernels_ms = t_kernels.as_millis() as u64,
        warm_up_ms = (t_warm - t_kernels).as_millis() as u64,
        copy_engines_ms = (t_engines - t_warm).as_millis() as u64,
        queue_pairs_ms = (started.elapsed() - t_engines).as_millis() as u64,
        "GPU queues created on the software controller"
    );
    GpuQueues::assemble(
        cuda,
        QueueSetParts {
            kind: TransportKind::SoftwareController,
            pairs,
            host_flags,
            keep: Box::new(doorbells),
            client_stream,
            kernels,
            partition,
            plan: p,
            backend: Arc::new(SoftwareTransport {
                emu: emu.clone(),
                engine,
                rings,
                readahead,
                prefetch_readers,
            }),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::{CopyMode, RingPlacement, StagedCopies, fetch_ordered_from, readahead_from};

    /// The hint's walk on a file made cold: the hinted blocks (and only they) are asked for
    /// and enter the page cache; a second walk over them, now resident, asks for nothing.
    #[test]
    fn a_readahead_reads_the_hinted_blocks_that_are_not_cached() {
        use super::{READAHEAD_BLOCK, Readahead};
        use gpu_queues::ffi::os::{advise_dontneed, range_cached};
        use std::io::Write;
        use std::os::fd::AsFd;
        let path = std::env::temp_dir().join(format!("gpunvme-readahead-{}", std::process::id()));
        let b = READAHEAD_BLOCK;
        {
            let mut f = std::fs::File::create(&path).unwrap();
            let data: Vec<u8> = (0..4 * b).map(|i| (i * 7 % 251) as u8).collect();
            f.write_all(&data).unwrap();
            f.sync_all().unwrap();
        }
        let f = std::fs::File::open(&path).unwrap();
        advise_dontneed(f.as_fd(), 0, 4 * b).unwrap();
        let cold = |at, n| range_cached(f.as_fd(), at, n);
        match cold(0, 4 * b) {
            Err(e) => {
                eprintln!("skipped: no cachestat here ({e})");
                let _ = std::fs::remove_file(&path);
                return;
            }
            Ok(true) => {
                eprintln!("skipped: the file system kept the file's pages (tmpfs?)");
                let _ = std::fs::remove_file(&path);
                return;
            }
            Ok(false) => {}
        }
        // Blocks 0 and 2 of the four.
        let ranges = vec![(0, b), (2 * b, b)];
        let open = || std::fs::File::open(&path).unwrap();
        let (asked, threads) = Readahead::start(open(), ranges.clone(), 2)
            .unwrap()
            .finish();
        assert_eq!(asked, 2 * b, "both hinted blocks were cold");
        assert_eq!(threads, 2, "a block to read started the second walker");
        assert!(
            cold(0, b).unwrap() && cold(2 * b, b).unwrap(),
            "hinted blocks cached"
        );
        assert!(
            !cold(b, b).unwrap(),
            "a block between them was not asked for"
        );
        let again = Readahead::start(open(), ranges, 2).unwrap().finish();
        assert_eq!(
            again,
            (0, 1),
            "resident blocks: one thread's cachestats, no read"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn staged_copies_and_fetch_order_follow_their_variables() {
        use StagedCopies::{Engine, Kernel};
        assert_eq!(StagedCopies::choose(None).unwrap(), Engine);
        assert_eq!(StagedCopies::choose(Some(" engine ")).unwrap(), Engine);
        assert_eq!(StagedCopies::choose(Some("kernel")).unwrap(), Kernel);
        let e = StagedCopies::choose(Some("dma")).unwrap_err().to_string();
        assert!(e.contains("GPUNVME_EMU_STAGED=dma"), "{e}");
        assert!(!fetch_ordered_from(None).unwrap());
        assert!(!fetch_ordered_from(Some("unordered")).unwrap());
        assert!(fetch_ordered_from(Some("ordered")).unwrap());
        let e = fetch_ordered_from(Some("always")).unwrap_err().to_string();
        assert!(e.contains("GPUNVME_EMU_FETCH=always"), "{e}");
        use super::READAHEAD_WALKERS;
        assert_eq!(readahead_from(None, 0).unwrap(), 0, "the caller's default");
        assert_eq!(readahead_from(Some(""), 4).unwrap(), 4);
        assert_eq!(readahead_from(Some("on"), 0).unwrap(), READAHEAD_WALKERS);
        assert_eq!(readahead_from(Some(" off"), 4).unwrap(), 0);
        assert_eq!(readahead_from(Some("1"), 0).unwrap(), 1);
        assert_eq!(readahead_from(Some("16"), 0).unwrap(), 16);
        for bad in ["0", "17", "many"] {
            let e = readahead_from(Some(bad), 0).unwrap_err().to_string();
            assert!(e.contains(&format!("GPUNVME_EMU_READAHEAD={bad}")), "{e}");
            assert!(
                e.contains("from 1 to 16") && !e.contains("argument: invalid"),
                "{e}"
            );
        }
    }

    #[test]
    fn ring_placement_follows_the_variable_then_the_caller() {
        use RingPlacement::{Gpu, Host};
        assert_eq!(RingPlacement::choose(None, None).unwrap(), Gpu);
        assert_eq!(RingPlacement::choose(None, Some(true)).unwrap(), Host);
        assert_eq!(RingPlacement::choose(Some(""), Some(false)).unwrap(), Gpu);
        assert_eq!(RingPlacement::choose(Some("gpu"), Some(true)).unwrap(), Gpu);
        assert_eq!(RingPlacement::choose(Some("host"), None).unwrap(), Host);
        assert!(RingPlacement::choose(Some("hbm"), None).is_err());
    }

    #[test]
    fn copy_mode_follows_the_variable_then_the_sanitizer() {
        assert_eq!(CopyMode::choose(None, false).unwrap(), CopyMode::Kernels);
        assert_eq!(CopyMode::choose(None, true).unwrap(), CopyMode::Memcpy);
        assert_eq!(CopyMode::choose(Some(""), true).unwrap(), CopyMode::Memcpy);
        assert_eq!(
            CopyMode::choose(Some("kernels"), true).unwrap(),
            CopyMode::Kernels
        );
        assert_eq!(
            CopyMode::choose(Some("memcpy"), false).unwrap(),
            CopyMode::Memcpy
        );
        assert!(CopyMode::choose(Some("dma"), false).is_err());
    }
}
