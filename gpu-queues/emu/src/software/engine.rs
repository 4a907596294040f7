//! One controller thread's copy engine ([`Engine`]: its streams, staging areas and gather
//! area, sized by the constants here) and [`GpuDma`], the set of them: construction, the
//! engine a controller thread uses, accessors and counters. The write side (staging, flushes)
//! is in `staging`, the read side (prefetches, gathers, copies that wait) in `gather`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
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
use super::pinning::{AreaPool, LazyPinned, PinPool};
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
/// Data bytes of a staging area once a large job made the areas grow
/// ([`GpuDma::grow_staging`]): copies of 512 KiB pay their launch and wait every 10-20 µs, and
/// a 13.5 GB model load ran at 29 GB/s with them against 44 GB/s with areas of this size
/// (H200, 2026-11-29 and 2026-12-02).
pub(super) const BIG_STAGING_BYTES: usize = BIG_AREA_BYTES - MAX_PIECES * size_of::<CopyDesc>();
/// Bytes of one bigger staging area, its descriptors included: a whole number of them fills
/// whole 2 MiB huge pages ([`AreaPool::AREAS_PER_CHUNK`]).
pub(super) const BIG_AREA_BYTES: usize = 4 << 20;
/// Bytes a job announces ([`GpuDma::grow_staging`]'s caller, the `will_read` hint) from which
/// the staging areas grow: registering the bigger areas (129 MiB for 16 threads) takes tens of
/// milliseconds beside the job, which a 1.2 GB load (40 ms) does not win back.
pub(super) const GROW_STAGING_FROM: u64 = 4 << 30;
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
    /// The engines' first areas, allocated by `pin_thread`, and the pool's length.
    pool: Arc<PinPool>,
    pool_len: usize,
    /// Bigger staging areas for large jobs ([`GpuDma::grow_staging`]): the pool, and how many
    /// of its areas were taken.
    big: Arc<AreaPool>,
    /// Joined on drop (no thread of ours calls the driver after its owner is gone).
    pin_thread: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for GpuDma {
    fn drop(&mut self) {
        let pins = std::mem::take(&mut *self.pin_thread.lock().unwrap_or_else(|e| e.into_inner()));
        for t in pins {
            let _ = t.join();
        }
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
        let threads = threads.max(1);
        let (area_len, gather_len) = (
            (MAX_PIECES * size_of::<CopyDesc>() + STAGING_BYTES).next_multiple_of(4096),
            (MAX_GATHER_PIECES * size_of::<CopyDesc>() + GATHER_START_BYTES).next_multiple_of(4096),
        );
        let per_engine = 2 * area_len + gather_len;
        let pool = PinPool::new();
        let area = |at: usize| -> Result<Staging, GpuError> {
            Ok(Staging {
                mem: LazyPinned::new(cuda, area_len, &pool, at),
                capacity: STAGING_BYTES,
                direct: Vec::new(),
                copies: Vec::new(),
                drained: Event::new(cuda)?,
                pieces: 0,
                bytes: 0,
            })
        };
        let read_mode = ReadMode::from_env()?;
        let mut engines = Vec::with_capacity(threads);
        for i in 0..threads {
            let at = i * per_engine;
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
                    areas: [area(at)?, area(at + area_len)?],
                    cur: 0,
                    gather: LazyPinned::new(cuda, gather_len, &pool, at + 2 * area_len),
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
            pool,
            pool_len: threads * per_engine,
            big: AreaPool::new(),
            pin_thread: Mutex::new(Vec::new()),
        }))
    }

    /// Has the staging areas grow to [`BIG_STAGING_BYTES`] for a large job: the bigger areas
    /// (two per engine) are registered on a thread of their own, a few at a time
    /// ([`AreaPool`]), and each engine moves to them one area at a time as it switches areas,
    /// never waiting for them. Once only; nothing depends on it.
    pub fn grow_staging(&self) {
        let mut t = self.pin_thread.lock().unwrap_or_else(|e| e.into_inner());
        if self.big.started() {
            return;
        }
        match self
            .big
            .spawn(&self.cuda, BIG_AREA_BYTES, self.engines.len() * 2)
        {
            Ok(h) => t.push(h),
            Err(e) => tracing::debug!("no bigger staging areas: {e}"),
        }
    }

    /// An area of the big pool if one is registered and left.
    pub(super) fn big_area(&self) -> Option<PinnedMemory> {
        self.big.take(BIG_AREA_BYTES)
    }

    /// Starts allocating the engines' first areas ([`PinPool`]) on a thread of its own; until
    /// it is called, an area used allocates its own. Called once the queue pairs exist: during
    /// the set-up, the registration (5 ms for 22 MiB on an H200) slowed what ran beside it
    /// (the engines' streams and warm-ups went from 1.3 ms to 6-10 ms, the pairs' memory from
    /// 2 to 6-9 ms, their creation from 6-7 to 12-13 ms). Once only.
    pub fn start_pinning(&self) -> Result<(), GpuError> {
        let mut t = self.pin_thread.lock().unwrap_or_else(|e| e.into_inner());
        if !self.pool.started() {
            t.push(self.pool.spawn(&self.cuda, self.pool_len)?);
        }
        Ok(())
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
        for (bytes, ns) in [self.pool.allocated(), self.big.allocated()]
            .into_iter()
            .flatten()
        {
            total.pinned_pool_bytes += bytes;
            total.pinned_pool_ns += ns;
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
