//! Pinned memory for the copy engines, allocated off the controller threads' path: the
//! engines' first areas as one allocation ([`PinPool`]), each area taken at its first use
//! ([`LazyPinned`]), and the bigger areas of a large job registered a few at a time
//! ([`AreaPool`]).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use gpu_queues::GpuError;
use gpu_queues::ffi::{Cuda, PinnedMemory};

use super::engine::GPU_WAIT;
use super::stats::DmaStats;

/// Every engine's first areas (two staging areas and a gather area each) as one pinned
/// allocation ([`PinnedMemory::alloc_large`]: registered huge pages, one driver call instead of
/// three per engine, at about half the cost per MiB), made on a thread of its own from
/// [`GpuDma::start_pinning`] on. The rest of the queues' set-up (and a kept handle's wait for
/// its first load) overlaps it, so that neither the set-up nor, usually, a load's first
/// milliseconds wait for pinning; an area used before it is ready waits for it (bounded), and
/// one whose pool failed allocates its own.
pub(super) struct PinPool {
    state: Mutex<PoolState>,
    ready: Condvar,
}

enum PoolState {
    /// Not asked for yet ([`GpuDma::start_pinning`]): an area used now allocates its own.
    NotStarted,
    Pending,
    /// The allocation and the nanoseconds it took.
    Ready(Arc<PinnedMemory>, u64),
    Failed,
}

impl PinPool {
    /// A pool to be allocated ([`PinPool::spawn`]).
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(PoolState::NotStarted),
            ready: Condvar::new(),
        })
    }

    /// Starts allocating `len` bytes on a thread of its own.
    pub(super) fn spawn(
        self: &Arc<Self>,
        cuda: &Arc<Cuda>,
        len: usize,
    ) -> Result<JoinHandle<()>, GpuError> {
        *self.lock() = PoolState::Pending;
        let (p, cuda) = (self.clone(), cuda.clone());
        std::thread::Builder::new()
            .name("gpunvme-pin".into())
            .spawn(move || {
                let t = Instant::now();
                let state = match PinnedMemory::alloc_large(&cuda, len) {
                    Ok(mem) => PoolState::Ready(Arc::new(mem), t.elapsed().as_nanos() as u64),
                    Err(e) => {
                        tracing::warn!("copy engines' pinned areas ({len} bytes): {e}");
                        PoolState::Failed
                    }
                };
                *p.lock() = state;
                p.ready.notify_all();
            })
            .map_err(|e| {
                *self.lock() = PoolState::Failed;
                GpuError::Os {
                    op: "starting the copy engines' pinning thread".into(),
                    source: e,
                }
            })
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The allocation, waiting for it (at most [`GPU_WAIT`]); `None` if it was not started,
    /// failed or is late.
    fn region(&self) -> Option<Arc<PinnedMemory>> {
        let st = self.lock();
        let (st, _) = self
            .ready
            .wait_timeout_while(st, GPU_WAIT, |s| matches!(s, PoolState::Pending))
            .unwrap_or_else(|e| e.into_inner());
        match &*st {
            PoolState::Ready(mem, _) => Some(mem.clone()),
            _ => None,
        }
    }

    /// Whether it was asked for ([`PinPool::spawn`]).
    pub(super) fn started(&self) -> bool {
        !matches!(&*self.lock(), PoolState::NotStarted)
    }

    /// Its bytes and the nanoseconds their allocation took, once allocated.
    pub(super) fn allocated(&self) -> Option<(u64, u64)> {
        match &*self.lock() {
            PoolState::Ready(mem, ns) => Some((mem.len() as u64, *ns)),
            _ => None,
        }
    }
}

/// Pinned memory allocated at its first use, as a part of the engines' [`PinPool`] where it
/// has one: the queues' set-up never waits for it (pinning was most of a copy engine's cost,
/// see [`STAGING_BYTES`]).
pub(super) struct LazyPinned {
    cuda: Arc<Cuda>,
    len: usize,
    mem: Option<PinnedMemory>,
    /// Its place in the pool (until its first allocation).
    pool: Option<(Arc<PinPool>, usize)>,
    /// Nanoseconds its allocation took, or waited for the pool (0 until it is allocated).
    alloc_ns: u64,
}

impl LazyPinned {
    /// `len` bytes, first at `at` of `pool` (`len` and `at` whole 4 KiB pages).
    pub(super) fn new(cuda: &Arc<Cuda>, len: usize, pool: &Arc<PinPool>, at: usize) -> Self {
        Self {
            cuda: cuda.clone(),
            len,
            mem: None,
            pool: Some((pool.clone(), at)),
            alloc_ns: 0,
        }
    }

    /// Memory already allocated (an area of the big pool, [`GpuDma::grow_staging`]).
    pub(super) fn with(cuda: &Arc<Cuda>, mem: PinnedMemory) -> Self {
        Self {
            cuda: cuda.clone(),
            len: mem.len(),
            mem: Some(mem),
            pool: None,
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
                let t = Instant::now();
                // Its part of the pool serves only its first allocation, at its first size.
                let pooled = match self.pool.take() {
                    Some((pool, at)) if len <= self.len => pool
                        .region()
                        .and_then(|r| PinnedMemory::view(&r, at, self.len).ok()),
                    _ => None,
                };
                self.len = self.len.max(len);
                let mem = match pooled {
                    Some(mem) => mem,
                    None => PinnedMemory::alloc(&self.cuda, self.len)?,
                };
                self.alloc_ns += t.elapsed().as_nanos() as u64;
                mem
            }
        };
        Ok(self.mem.insert(mem))
    }

    /// Adds its bytes and allocation time, if it was allocated, to `stats`.
    pub(super) fn count(&self, stats: &mut DmaStats) {
        if let Some(mem) = &self.mem {
            stats.pinned_bytes += mem.len() as u64;
            stats.pinned_alloc_ns += self.alloc_ns;
        }
    }
}

/// Areas of one size registered on a thread of its own, [`AreaPool::AREAS_PER_CHUNK`] per
/// driver call, each chunk handed out as soon as it is registered ([`AreaPool::take`] never
/// waits). One registration of every big area at once (129 MiB for 16 engines, 25-34 ms on an
/// H200) stalled every controller thread's copies for as long, all of them at the same
/// moment, 20-30 ms into a 13.5 GB load (the driver serialises the calls); in chunks of
/// 16 MiB each stall is a few milliseconds at most and the engines move to the bigger areas
/// one by one as they come.
pub(super) struct AreaPool {
    state: Mutex<AreaPoolState>,
}

#[derive(Default)]
struct AreaPoolState {
    started: bool,
    /// Registered chunks, in order.
    chunks: Vec<Arc<PinnedMemory>>,
    /// Areas handed out so far (the next one is `taken`).
    taken: usize,
    /// Bytes and nanoseconds of the chunks registered so far.
    bytes: u64,
    ns: u64,
}

impl AreaPool {
    /// Areas per registration: four areas of 4 MiB are 16 MiB, a whole number of 2 MiB huge
    /// pages, registered in 3-4 ms.
    pub(super) const AREAS_PER_CHUNK: usize = 4;

    /// A pool to be registered ([`AreaPool::spawn`]).
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(AreaPoolState::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, AreaPoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether it was asked for.
    pub(super) fn started(&self) -> bool {
        self.lock().started
    }

    /// Starts registering `areas` areas of `area_len` bytes (whole 4 KiB pages) on a thread of
    /// its own, [`Self::AREAS_PER_CHUNK`] at a time; a chunk that cannot be registered ends it
    /// (the engines keep the areas they have).
    pub(super) fn spawn(
        self: &Arc<Self>,
        cuda: &Arc<Cuda>,
        area_len: usize,
        areas: usize,
    ) -> Result<JoinHandle<()>, GpuError> {
        self.lock().started = true;
        let (p, cuda) = (self.clone(), cuda.clone());
        std::thread::Builder::new()
            .name("gpunvme-pin-big".into())
            .spawn(move || {
                let mut left = areas;
                while left > 0 {
                    let n = left.min(Self::AREAS_PER_CHUNK);
                    let t = Instant::now();
                    match PinnedMemory::alloc_large(&cuda, n * area_len) {
                        Ok(mem) => {
                            let ns = t.elapsed().as_nanos() as u64;
                            let mut st = p.lock();
                            st.bytes += mem.len() as u64;
                            st.ns += ns;
                            st.chunks.push(Arc::new(mem));
                        }
                        Err(e) => {
                            tracing::debug!("no more bigger staging areas ({left} left): {e}");
                            return;
                        }
                    }
                    left -= n;
                }
            })
            .map_err(|e| GpuError::Os {
                op: "starting the copy engines' second pinning thread".into(),
                source: e,
            })
    }

    /// The next area of `area_len` bytes if its chunk is registered; `None` (at once) if not
    /// yet, or none is left.
    pub(super) fn take(&self, area_len: usize) -> Option<PinnedMemory> {
        let mut st = self.lock();
        let (chunk, i) = (
            st.taken / Self::AREAS_PER_CHUNK,
            st.taken % Self::AREAS_PER_CHUNK,
        );
        let region = st.chunks.get(chunk)?.clone();
        let area = PinnedMemory::view(&region, i * area_len, area_len).ok()?;
        st.taken += 1;
        Some(area)
    }

    /// Its bytes and the nanoseconds their registration took, once a chunk is registered.
    pub(super) fn allocated(&self) -> Option<(u64, u64)> {
        let st = self.lock();
        (!st.chunks.is_empty()).then_some((st.bytes, st.ns))
    }
}
