//! One controller thread's copy engine ([`Engine`]: its streams, staging areas and gather
//! area, sized by the constants here) and [`GpuDma`], the set of them: construction, the
//! engine a controller thread uses, accessors and counters. The write side (staging, flushes)
//! is in `staging`, the read side (prefetches, gathers, copies that wait) in `gather`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpu_queues::GpuError;
use gpu_queues::ffi::{
    Arg, Cuda, DeviceMemory, Event, GreenPartition, Kernel, PinnedMemory, Placement, Stream,
};

use crate::desc::CopyDesc;
use crate::image_reads::{ColdReads, ImageViews, ImageWindows, ReadMode, WindowStats};
use crate::kernels::EmuKernels;

use super::gather::Fetched;
use super::modes::{CopyMode, StagedCopies, fetch_always_ordered};
use super::staging::Staging;
use super::stats::DmaStats;

/// Pieces one staging area holds before it is flushed.
pub(super) const MAX_PIECES: usize = 2048;
/// Data bytes one staging area holds before it is flushed. Pinned memory costs about 0.6 ms
/// per MiB to allocate (an H200: 48 areas of 4 MiB took 123 ms, of 1 MiB 28 ms, of 256 KiB
/// 7 ms, from one thread or sixteen alike; `scripts/setup-costs.py`), and each of a
/// controller's threads has two areas, allocated at their first use: a load's first
/// milliseconds pay for all of them. Large enough that filling one (a few hundred
/// microseconds from the page cache) outlasts a flush's launch and wait many times over.
pub(super) const STAGING_BYTES: usize = 512 << 10;
/// Ranges one gather moves.
pub(super) const MAX_GATHER_PIECES: usize = 2048;
/// Data bytes one gather moves at most (PRP lists, write data; a read larger than this is
/// copied in pieces of this size).
pub(super) const GATHER_BYTES: usize = 4 << 20;
/// Data bytes of a gather area when it is first allocated; it grows (by powers of two, up to
/// [`GATHER_BYTES`]) when a gather or a read needs more: PRP lists and SQEs never do, writes
/// of large blocks do, once.
pub(super) const GATHER_START_BYTES: usize = 256 << 10;
/// Largest piece one scatter warp copies: a long run (a big Read's data) is cut into pieces of
/// this size so that many warps move it at once, not one warp the whole run.
pub(super) const PIECE_BYTES: usize = 32 << 10;
/// Bound on any single wait for the GPU inside the controller.
pub(super) const GPU_WAIT: Duration = Duration::from_secs(10);
/// Warps per block of the scatter and gather kernels (one warp per piece).
const WARPS_PER_BLOCK: u32 = 8;

/// Launches the scatter or gather kernel on `stream` with one warp per piece.
pub(super) fn launch_per_piece(
    stream: &Stream,
    kernel: Kernel,
    pieces: usize,
    args: &[Arg],
) -> Result<(), GpuError> {
    let grid = (pieces as u32).div_ceil(WARPS_PER_BLOCK).clamp(1, 1024);
    stream.launch(kernel, grid, WARPS_PER_BLOCK * 32, args)
}

/// Pinned memory allocated at its first use: the queues' set-up never waits for it (pinning
/// was most of a copy engine's cost, see [`STAGING_BYTES`]), and a controller thread that never
/// stages (or never gathers) never pays for it.
pub(super) struct LazyPinned {
    cuda: Arc<Cuda>,
    len: usize,
    mem: Option<PinnedMemory>,
    /// Nanoseconds its allocation took (0 until it is allocated).
    alloc_ns: u64,
}

impl LazyPinned {
    pub(super) fn new(cuda: &Arc<Cuda>, len: usize) -> Self {
        Self {
            cuda: cuda.clone(),
            len,
            mem: None,
            alloc_ns: 0,
        }
    }

    /// The memory, allocated now if this is its first use.
    pub(super) fn get(&mut self) -> Result<&PinnedMemory, GpuError> {
        self.get_at_least(self.len)
    }

    /// The memory, at least `len` bytes of it: allocated now on its first use, or replaced
    /// by a larger allocation (its contents are not kept: the caller holds nothing of the old
    /// one, and no copy still reads or writes it).
    pub(super) fn get_at_least(&mut self, len: usize) -> Result<&PinnedMemory, GpuError> {
        let mem = match self.mem.take() {
            Some(mem) if mem.len() >= len => mem,
            old => {
                drop(old);
                self.len = self.len.max(len);
                let t = Instant::now();
                let mem = PinnedMemory::alloc(&self.cuda, self.len)?;
                self.alloc_ns += t.elapsed().as_nanos() as u64;
                mem
            }
        };
        Ok(self.mem.insert(mem))
    }

    /// Adds its bytes and allocation time, if it was allocated, to `stats`.
    fn count(&self, stats: &mut DmaStats) {
        if let Some(mem) = &self.mem {
            stats.pinned_bytes += mem.len() as u64;
            stats.pinned_alloc_ns += self.alloc_ns;
        }
    }
}

pub(super) struct EngineState {
    pub(super) areas: [Staging; 2],
    pub(super) cur: usize,
    /// Gather area: MAX_GATHER_PIECES descriptors, then GATHER_START_BYTES of data and more
    /// as needed, up to GATHER_BYTES ([`gather_area`](GpuDma::gather_area)); also the bounce
    /// buffer of reads too large to gather.
    pub(super) gather: LazyPinned,
    /// Ranges announced by `prefetch`, fetched together at the next read, each with whether
    /// it must be read after the engine's earlier writes (see the module's documentation).
    pub(super) pending: Vec<(u64, usize, bool)>,
    /// Ranges the last gather fetched.
    pub(super) fetched: Vec<Fetched>,
    /// A flush launched work that was not yet seen finished (see [`GpuDma::pending`]).
    pub(super) in_flight: bool,
    pub(super) stats: DmaStats,
}

/// One controller thread's copy engine: its own stream, staging areas and gather area, so that
/// threads never wait on each other's copies and each thread's writes stay in issue order.
pub(super) struct Engine {
    /// Scatters, and reads ordered after them.
    pub(super) stream: Stream,
    /// Reads of memory the controller never wrote (not ordered after the scatters).
    pub(super) fetch: Stream,
    /// Device counter the scatter kernel's blocks use to find the last one.
    pub(super) done_blocks: DeviceMemory,
    state: Mutex<EngineState>,
}

/// The batched copy engines of the software controller, one per controller thread
/// (`nvme_emu::controller_thread_index` picks it).
pub struct GpuDma {
    pub(super) cuda: Arc<Cuda>,
    pub(super) kernels: Arc<EmuKernels>,
    engines: Vec<Engine>,
    pub(super) mode: CopyMode,
    /// How Read data leaves the image.
    read_mode: ReadMode,
    /// Registered windows of the image(s) Reads copy from directly ([`ReadMode::Registered`]);
    /// dropped after the engines' streams are idle (see `Drop`).
    pub(super) windows: ImageWindows,
    /// Read-only mappings of the image(s) staged Reads copy out of ([`ReadMode::Mapped`]).
    pub(super) views: ImageViews,
    /// `GPUNVME_EMU_FETCH=ordered`: every read waits for the engine's earlier writes.
    pub(super) always_ordered: bool,
    /// How staged Read data moves.
    pub(super) staged: StagedCopies,
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

pub(super) fn lock(e: &Engine) -> MutexGuard<'_, EngineState> {
    e.state.lock().unwrap_or_else(|e| e.into_inner())
}

/// Time a closure spends, added to `wait_ns`.
pub(super) fn timed<T>(wait_ns: &mut u64, f: impl FnOnce() -> T) -> T {
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
                mem: LazyPinned::new(cuda, MAX_PIECES * size_of::<CopyDesc>() + STAGING_BYTES),
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
                    gather: LazyPinned::new(
                        cuda,
                        MAX_GATHER_PIECES * size_of::<CopyDesc>() + GATHER_START_BYTES,
                    ),
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
            windows: ImageWindows::for_mode(cuda, read_mode)?,
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
    pub(super) fn engine(&self) -> &Engine {
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
        for s in self.stats_per_thread() {
            total.add(&s);
        }
        total
    }

    /// Each controller thread's engine's counters, by thread index.
    pub fn stats_per_thread(&self) -> Vec<DmaStats> {
        self.engines
            .iter()
            .map(|e| {
                let st = lock(e);
                let mut s = st.stats;
                for area in st.areas.iter().map(|a| &a.mem).chain([&st.gather]) {
                    area.count(&mut s);
                }
                s
            })
            .collect()
    }
}
