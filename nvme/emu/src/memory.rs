//! The controller's device-address space: memory regions and the map from device addresses to
//! them.
//!
//! A real controller reaches host memory only through bus addresses translated by an IOMMU. The
//! software controller does the same: every SQE fetch, PRP-list read, data transfer and CQE
//! write names a device address, which [`DeviceAddressMap`] translates to a [`MemoryRegion`]
//! and an offset in it. An address that no region covers is a DMA error, which the controller
//! reports the way hardware does (Data Transfer Error for command data, Controller Fatal Status
//! for queue memory), never a panic.
//!
//! Regions are an interface so that memory that is not plain host memory (GPU memory reached
//! through CUDA copies) can be served later: `gpu_queues` registers such regions with
//! [`DeviceAddressMap::register_region`].
//!
//! Device addresses come from a bump allocator that never reuses an address and leaves an
//! unmapped guard gap after each region, so a late DMA after a buffer was dropped, or a transfer
//! that runs off the end of a buffer, hits an unmapped address rather than someone else's memory.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::error::EmuError;

/// First device address handed out. Address 0 (and everything below 4 GiB) is never valid, so
/// a zeroed PRP or queue base is always a DMA error.
pub const DEVICE_ADDRESS_BASE: u64 = 0x1_0000_0000;

/// Unmapped gap left after every region, and the alignment of every region's base.
pub const GUARD_GAP: u64 = 2 << 20;

/// Why an access to a [`MemoryRegion`] failed.
#[derive(Debug, thiserror::Error)]
#[error("memory region access failed: {reason}")]
pub struct RegionError {
    /// What went wrong, in words.
    pub reason: String,
    /// The underlying error, if any (a CUDA error for GPU regions).
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl RegionError {
    /// An error with a reason and no underlying cause.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            source: None,
        }
    }
}

/// A range of memory the controller can reach by DMA.
///
/// Offsets are relative to the start of the region. Implementations must tolerate concurrent
/// access by the host (the driver writes SQEs and reads CQEs in the same memory while the
/// controller works on it), so they never hand out references into the memory.
///
/// # Threads
/// The controller may run several threads ([`crate::EmuConfig::controller_threads`]), and
/// any of them may call into the same region at the same time. Every call a controller thread
/// makes comes from a thread where [`crate::controller_thread_index`] returns `Some(i)`, the
/// same `i` for the thread's whole life, so a region can keep per-thread resources (a copy
/// engine with its own staging area and stream) indexed by it. The guarantees below about
/// order (deferred writes, flush, read-your-writes) are per thread: a thread's flush covers
/// the writes that thread issued. Each I/O completion queue, and every submission queue
/// posting to it, is served by one thread, so the data of a command and its completion entry
/// are always written, and flushed, by the same thread.
///
/// # Deferred writes
/// A region may defer writes (stage them, and perform a whole batch at once: GPU memory
/// behind batched copies, where each copy costs microseconds of CPU) until
/// [`MemoryRegion::flush`]. Each controller thread calls `flush` on every region it wrote
/// through before it goes idle: at the end of each batch of commands fetched from a submission queue,
/// after that batch's completion queue entries are written, and at the end of every pass that
/// wrote anything else (held, delayed and event completions). Such a region must still
///
/// - perform its writes in issue order when flushed, so that a completion queue entry's last
///   dword (the phase tag) becomes visible after the rest of the entry and after the data of
///   the commands it completes, which were written before it;
/// - let [`MemoryRegion::read`] observe the region's own earlier writes (flushing first if
///   needed), as the controller may read back what it wrote;
/// - say so ([`MemoryRegion::defers_writes`]) and implement [`MemoryRegion::wait_flushed`]:
///   a completion entry bound for a region that writes at once (rings in host memory, data in
///   GPU memory) is written only after the deferring regions' earlier writes are visible.
pub trait MemoryRegion: Send + Sync {
    /// Length of the region in bytes.
    fn len(&self) -> usize;

    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `buf.len()` bytes starting at `offset` into `buf`. The caller has checked that
    /// the range lies inside the region. A region that defers writes must return the bytes as
    /// they are after every write issued through it so far (flushing first if needed).
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError>;

    /// Copies `data` into the region at `offset`. The caller has checked that the range lies
    /// inside the region. The write may be deferred until [`MemoryRegion::flush`].
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError>;

    /// Writes `data` (a multiple of 4 bytes, at a 4-byte aligned offset) so that its last
    /// dword becomes visible to other agents no earlier than the rest, and no earlier than
    /// anything written through this region before: used for completion queue entries, whose
    /// last dword carries the phase tag. The write may be deferred until
    /// [`MemoryRegion::flush`]; the ordering must then hold once it is flushed.
    ///
    /// The default writes everything but the last dword, then the last dword, with two
    /// [`MemoryRegion::write`] calls; regions whose writes complete in issue order (a single
    /// CUDA stream, or a staged batch scattered in order) are correct with it. Host memory
    /// overrides it with a Release store.
    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let split = data.len().saturating_sub(4);
        self.write(offset, &data[..split])?;
        self.write(offset + split as u64, &data[split..])
    }

    /// Makes every write issued so far through this region take effect, in issue order;
    /// regions that stage writes (GPU memory behind batched copies) perform them now.
    ///
    /// The controller treats an error as fatal (Controller Fatal Status): the completions of
    /// the batch may already be among the writes, so no command can be failed instead.
    /// The default does nothing (host memory writes take effect at once).
    fn flush(&self) -> Result<(), RegionError> {
        Ok(())
    }

    /// Fills `len` bytes of the region at `offset` straight from `file` at `file_offset`: a
    /// positioned read into the region's memory, so that a Read from an image file moves its
    /// data once (by the kernel) instead of through the controller's own buffer. `None` when
    /// the region cannot take one (the default): the controller then reads into a buffer of
    /// its own and [`MemoryRegion::write`]s it. `Some(Err)` is the file's error (a short file
    /// is [`std::io::ErrorKind::UnexpectedEof`]), or [`std::io::ErrorKind::InvalidInput`] for a
    /// range outside the region (the caller checks it first).
    ///
    /// Like [`MemoryRegion::write`], the bytes may reach other agents only at the next
    /// [`MemoryRegion::flush`] for regions that defer writes.
    fn read_from_file(
        &self,
        offset: u64,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> Option<std::io::Result<()>> {
        let _ = (offset, len, file, file_offset);
        None
    }

    /// A hint: the calling controller thread is about to [`MemoryRegion::read`] these
    /// `(offset, len)` ranges of the region (each inside it), so a region behind costly
    /// transfers (GPU memory) can fetch them all in one transfer and serve the following reads
    /// from what it fetched.
    ///
    /// Purely a hint: the controller never depends on it. Reads after it must still return the
    /// bytes as they are when read (a region that keeps fetched bytes must make sure nothing
    /// changed them since, or fetch again), and an error is ignored (the reads that follow
    /// report their own). The controller calls it per batch of commands fetched from a
    /// submission queue: once with the PRP list pages the batch's Read and Write commands will
    /// walk, then once with the data of its Write commands (the ranges in command order). The
    /// default does nothing.
    fn prefetch(&self, ranges: &[(u64, usize)]) -> Result<(), RegionError> {
        let _ = ranges;
        Ok(())
    }

    /// Whether the region defers its writes to [`MemoryRegion::flush`] and performs them
    /// asynchronously (GPU memory behind batched copies). The default is false: host memory,
    /// whose writes are visible once stored.
    ///
    /// The controller orders writes across regions with it: before it writes a completion
    /// entry into a region that does not defer, it flushes every deferring region written
    /// since the last such entry and waits ([`MemoryRegion::wait_flushed`]), so that a
    /// command's data in GPU memory is visible before its completion in host memory.
    fn defers_writes(&self) -> bool {
        false
    }

    /// Waits, bounded, until every write flushed so far through this region by the calling
    /// thread is visible to other agents; an error if the bound passes or the transfer
    /// failed (the controller then treats it as a DMA error). The default does nothing (writes
    /// that do not defer are visible at once).
    fn wait_flushed(&self) -> Result<(), RegionError> {
        Ok(())
    }
}

/// Why a DMA through the device-address map failed.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// No region covers the whole range.
    #[error("DMA to unmapped device address range {addr:#x}+{len:#x}")]
    Unmapped {
        /// First device address of the access.
        addr: u64,
        /// Length of the access in bytes.
        len: usize,
    },
    /// The region covering the range failed the access.
    #[error("DMA at device address {addr:#x} failed")]
    Region {
        /// First device address of the access.
        addr: u64,
        /// The region's error.
        #[source]
        source: RegionError,
    },
}

#[derive(Clone)]
struct Mapping {
    len: u64,
    region: Arc<dyn MemoryRegion>,
    /// Whether the region is told about coming reads ([`MemoryRegion::prefetch`]); not for
    /// the controller's own host memory, whose prefetch does nothing, so that the controller
    /// can skip the work of finding what to announce.
    hint: bool,
}

/// Translates device addresses to memory regions.
///
/// Shared between the controller threads (which translate) and whoever maps memory for the
/// device (`EmuDevice`'s `alloc_dma`, and later GPU queue code).
pub struct DeviceAddressMap {
    regions: RwLock<BTreeMap<u64, Mapping>>,
    next: AtomicU64,
    /// Bumped on every unregistration, so translation caches know to forget.
    generation: AtomicU64,
    /// Regions mapped that take prefetch hints: while there are none, the controller skips
    /// the prefetch pre-pass altogether.
    hinted: AtomicUsize,
}

impl std::fmt::Debug for DeviceAddressMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let regions = self.regions.read().map(|r| r.len()).unwrap_or(0);
        f.debug_struct("DeviceAddressMap")
            .field("regions", &regions)
            .field("next", &self.next.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for DeviceAddressMap {
    fn default() -> Self {
        Self::new()
    }
}

impl DeviceAddressMap {
    /// An empty map whose first region will be placed at [`DEVICE_ADDRESS_BASE`].
    pub fn new() -> Self {
        Self {
            regions: RwLock::new(BTreeMap::new()),
            next: AtomicU64::new(DEVICE_ADDRESS_BASE),
            generation: AtomicU64::new(0),
            hinted: AtomicUsize::new(0),
        }
    }

    /// Maps `region` at a fresh device address and returns that address (aligned to
    /// [`GUARD_GAP`]). Addresses are never reused, even after the region is unregistered.
    pub fn register_region(&self, region: Arc<dyn MemoryRegion>) -> Result<u64, EmuError> {
        self.register(region, true)
    }

    /// [`DeviceAddressMap::register_region`] for host memory, whose prefetch does nothing.
    pub(crate) fn register_host_region(
        &self,
        region: Arc<dyn MemoryRegion>,
    ) -> Result<u64, EmuError> {
        self.register(region, false)
    }

    fn register(&self, region: Arc<dyn MemoryRegion>, hint: bool) -> Result<u64, EmuError> {
        let len = region.len() as u64;
        let span = len
            .checked_add(GUARD_GAP)
            .and_then(|s| s.checked_next_multiple_of(GUARD_GAP))
            .ok_or(EmuError::AddressSpaceExhausted { len })?;
        let mut base = 0;
        self.next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
                base = next;
                next.checked_add(span)
            })
            .map_err(|_| EmuError::AddressSpaceExhausted { len })?;
        let mut regions = self.regions.write().unwrap_or_else(|e| e.into_inner());
        if hint {
            self.hinted.fetch_add(1, Ordering::Release);
        }
        regions.insert(base, Mapping { len, region, hint });
        Ok(base)
    }

    /// Removes the region mapped at `base`, returning it. After this returns, no new
    /// translation reaches the region; an access already in progress on a controller thread
    /// may finish (as a DMA racing an IOMMU unmap would), which is safe because that access
    /// holds its own reference to the region.
    pub fn unregister_region(&self, base: u64) -> Option<Arc<dyn MemoryRegion>> {
        let removed = self
            .regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&base);
        if removed.as_ref().is_some_and(|m| m.hint) {
            self.hinted.fetch_sub(1, Ordering::Release);
        }
        self.generation.fetch_add(1, Ordering::Release);
        removed.map(|m| m.region)
    }

    /// Number of regions currently mapped.
    pub fn region_count(&self) -> usize {
        self.regions.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Finds the region covering `addr..addr + len`: its base, length and the region.
    fn lookup(&self, addr: u64, len: usize) -> Option<(u64, Mapping)> {
        let regions = self.regions.read().unwrap_or_else(|e| e.into_inner());
        let (&base, mapping) = regions.range(..=addr).next_back()?;
        let end = addr.checked_add(len as u64)?;
        (end <= base + mapping.len).then(|| (base, mapping.clone()))
    }

    /// Reads `buf.len()` bytes at device address `addr` (uncached; for tests and tools).
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let (base, m) = self.lookup(addr, buf.len()).ok_or(DmaError::Unmapped {
            addr,
            len: buf.len(),
        })?;
        m.region
            .read(addr - base, buf)
            .map_err(|source| DmaError::Region { addr, source })
    }

    /// Writes `data` at device address `addr` (uncached; for tests and tools).
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), DmaError> {
        let (base, m) = self.lookup(addr, data.len()).ok_or(DmaError::Unmapped {
            addr,
            len: data.len(),
        })?;
        m.region
            .write(addr - base, data)
            .map_err(|source| DmaError::Region { addr, source })
    }

    /// Announces reads of the device-address ranges `(addr, len)`: groups them by the region
    /// covering each and calls every such region's [`MemoryRegion::prefetch`] once, with its
    /// ranges (as offsets in the region, in the order given). Ranges no region covers are
    /// skipped, and so is the controller's own host memory (`alloc_dma`), whose prefetch does
    /// nothing; the first error (unmapped or the region's) is returned after every region
    /// was called.
    pub fn prefetch(&self, ranges: &[(u64, usize)]) -> Result<(), DmaError> {
        let mut groups = PrefetchGroups::default();
        let mut result = Ok(());
        for &(addr, len) in ranges {
            match self.lookup(addr, len) {
                Some((base, m)) if m.hint => groups.add(&m.region, addr, addr - base, len),
                Some(_) => {}
                None => {
                    if result.is_ok() {
                        result = Err(DmaError::Unmapped { addr, len });
                    }
                }
            }
        }
        groups.call(&mut result);
        result
    }
}

/// Prefetch ranges grouped by region (kept by [`MapCache`] so that the controller's per-batch
/// prefetch does not allocate).
#[derive(Default)]
struct PrefetchGroups {
    /// Distinct regions of the current call, in order of first appearance, with the device
    /// address of their first range (to name in an error).
    regions: Vec<(Arc<dyn MemoryRegion>, u64)>,
    /// (index in `regions`, position, offset, length) per range.
    tagged: Vec<(usize, usize, u64, usize)>,
    /// One region's ranges, handed to its `prefetch`.
    ranges: Vec<(u64, usize)>,
}

impl PrefetchGroups {
    /// Adds the range at device address `addr`, `offset` in `region`.
    fn add(&mut self, region: &Arc<dyn MemoryRegion>, addr: u64, offset: u64, len: usize) {
        let group = match self.regions.iter().position(|r| Arc::ptr_eq(&r.0, region)) {
            Some(i) => i,
            None => {
                self.regions.push((region.clone(), addr));
                self.regions.len() - 1
            }
        };
        self.tagged.push((group, self.tagged.len(), offset, len));
    }

    /// Calls each region's prefetch once with its ranges (in the order they were added), then
    /// forgets them; records the first region error in `result` unless it holds one already.
    fn call(&mut self, result: &mut Result<(), DmaError>) {
        // Sorting by position too keeps each region's ranges in the order given.
        if self.regions.len() > 1 {
            self.tagged.sort_unstable_by_key(|t| (t.0, t.1));
        }
        let mut start = 0;
        while start < self.tagged.len() {
            let group = self.tagged[start].0;
            let end = start
                + self.tagged[start..]
                    .iter()
                    .take_while(|t| t.0 == group)
                    .count();
            self.ranges.clear();
            self.ranges
                .extend(self.tagged[start..end].iter().map(|&(_, _, o, l)| (o, l)));
            let (region, addr) = &self.regions[group];
            if let Err(source) = region.prefetch(&self.ranges)
                && result.is_ok()
            {
                *result = Err(DmaError::Region {
                    addr: *addr,
                    source,
                });
            }
            start = end;
        }
        self.tagged.clear();
        self.regions.clear();
    }
}

/// Entries in [`MapCache`]: queue memory plus a few data buffers.
const CACHE_ENTRIES: usize = 8;

struct CacheEntry {
    base: u64,
    len: u64,
    region: Arc<dyn MemoryRegion>,
    /// Written through since the last [`MapCache::flush`] (the region is in `dirty`).
    dirty: bool,
    /// The region takes prefetch hints (see `Mapping::hint`).
    hint: bool,
    /// The region defers its writes ([`MemoryRegion::defers_writes`]).
    defers: bool,
    /// Written through since the last fence (the region is in `unfenced`).
    unfenced: bool,
}

/// A controller thread's translation cache in front of a [`DeviceAddressMap`]: a few recently
/// used regions, dropped whenever any region is unregistered, so that the common case costs one
/// atomic load and a short scan instead of a lock.
///
/// It also remembers which regions were written through since the last
/// [`MapCache::flush`], so that regions deferring their writes can be told when a batch ends.
pub(crate) struct MapCache {
    map: Arc<DeviceAddressMap>,
    generation: u64,
    entries: Vec<CacheEntry>,
    /// Index of the entry to replace next (round robin).
    victim: usize,
    /// Index of the entry used last by an access without a hint of its own.
    mru: usize,
    /// Regions written through since the last flush, each once (held even after their cache
    /// entry is evicted or the region unregistered: their writes must still be flushed).
    dirty: Vec<Arc<dyn MemoryRegion>>,
    /// Regions that defer their writes, written through since the last completion entry went
    /// to a region that does not ([`MapCache::write_last_dword_release_at`] fences them first).
    unfenced: Vec<Arc<dyn MemoryRegion>>,
    prefetch: PrefetchGroups,
}

impl MapCache {
    pub(crate) fn new(map: Arc<DeviceAddressMap>) -> Self {
        let generation = map.generation.load(Ordering::Acquire);
        Self {
            map,
            generation,
            entries: Vec::with_capacity(CACHE_ENTRIES),
            victim: 0,
            mru: 0,
            dirty: Vec::with_capacity(CACHE_ENTRIES),
            unfenced: Vec::new(),
            prefetch: PrefetchGroups::default(),
        }
    }

    /// Forgets every cached region (releasing the references the cache holds). Regions
    /// written since the last flush stay remembered for [`MapCache::flush`].
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.victim = 0;
    }

    /// Forgets the cached regions if any region was unregistered since they were looked up
    /// (one of them may be a buffer the host freed, which the cache must not keep alive);
    /// keeps them otherwise: every cached region is then still mapped, so holding it keeps
    /// nothing alive that the map does not. Deferring regions still owed a fence are fenced
    /// then (their writes were flushed at the end of their batch; this waits for them), so that
    /// the list of them lets go too.
    pub(crate) fn release_stale(&mut self) {
        let generation = self.map.generation.load(Ordering::Acquire);
        if generation != self.generation {
            if !self.unfenced.is_empty()
                && let Err(e) = self.fence_deferred(0)
            {
                tracing::warn!(error = %e, "waiting for deferred writes while idle failed");
            }
            self.entries.clear();
            self.victim = 0;
            self.generation = generation;
        }
    }

    /// Translates `addr..addr + len` to the index of its cache entry and the offset in the
    /// region. The entry used last is tried first.
    #[inline]
    fn translate(&mut self, addr: u64, len: usize) -> Result<(usize, u64), DmaError> {
        let mut hint = self.mru;
        let found = self.translate_at(addr, len, &mut hint);
        self.mru = hint;
        found
    }

    /// [`MapCache::translate`], trying the entry `*hint` first and leaving in it the entry that
    /// matched: a caller that keeps its own hint (a queue for its ring, say) translates with
    /// one comparison while the map is unchanged. Every access is still checked against the
    /// region's bounds and the map's generation; a stale hint only costs the scan.
    #[inline(always)]
    fn translate_at(
        &mut self,
        addr: u64,
        len: usize,
        hint: &mut usize,
    ) -> Result<(usize, u64), DmaError> {
        let generation = self.map.generation.load(Ordering::Acquire);
        if generation == self.generation
            && let Some(end) = addr.checked_add(len as u64)
            && let Some(e) = self.entries.get(*hint)
            && addr >= e.base
            && end <= e.base + e.len
        {
            return Ok((*hint, addr - e.base));
        }
        let found = self.translate_slow(addr, len)?;
        *hint = found.0;
        Ok(found)
    }

    #[cold]
    fn translate_slow(&mut self, addr: u64, len: usize) -> Result<(usize, u64), DmaError> {
        let generation = self.map.generation.load(Ordering::Acquire);
        if generation != self.generation {
            self.entries.clear();
            self.generation = generation;
        }
        let unmapped = DmaError::Unmapped { addr, len };
        let end = addr
            .checked_add(len as u64)
            .ok_or(DmaError::Unmapped { addr, len })?;
        let hit = self
            .entries
            .iter()
            .position(|e| addr >= e.base && end <= e.base + e.len);
        let index = match hit {
            Some(i) => i,
            None => {
                let (base, mapping) = self.map.lookup(addr, len).ok_or(unmapped)?;
                let entry = CacheEntry {
                    base,
                    len: mapping.len,
                    dirty: self.dirty.iter().any(|d| Arc::ptr_eq(d, &mapping.region)),
                    hint: mapping.hint,
                    defers: mapping.region.defers_writes(),
                    unfenced: self
                        .unfenced
                        .iter()
                        .any(|d| Arc::ptr_eq(d, &mapping.region)),
                    region: mapping.region,
                };
                if self.entries.len() < CACHE_ENTRIES {
                    self.entries.push(entry);
                    self.entries.len() - 1
                } else {
                    let i = self.victim;
                    self.victim = (self.victim + 1) % CACHE_ENTRIES;
                    self.entries[i] = entry;
                    i
                }
            }
        };
        Ok((index, addr - self.entries[index].base))
    }

    /// Translates a range about to be written, remembering its region for the next flush.
    #[inline(always)]
    fn translate_write(
        &mut self,
        addr: u64,
        len: usize,
        hint: &mut usize,
    ) -> Result<(&dyn MemoryRegion, u64), DmaError> {
        let (index, offset) = self.translate_at(addr, len, hint)?;
        self.note_write(index);
        Ok((&*self.entries[index].region, offset))
    }

    /// Remembers that entry `index`'s region is being written (for the next flush, and for
    /// the next fence if it defers its writes).
    #[inline(always)]
    fn note_write(&mut self, index: usize) {
        let e = &self.entries[index];
        if !e.dirty || (e.defers && !e.unfenced) {
            self.mark_dirty(index);
        }
    }

    #[cold]
    fn mark_dirty(&mut self, index: usize) {
        let entry = &mut self.entries[index];
        entry.dirty = true;
        if !self.dirty.iter().any(|d| Arc::ptr_eq(d, &entry.region)) {
            self.dirty.push(entry.region.clone());
        }
        if entry.defers && !entry.unfenced {
            entry.unfenced = true;
            if !self.unfenced.iter().any(|d| Arc::ptr_eq(d, &entry.region)) {
                self.unfenced.push(entry.region.clone());
            }
        }
    }

    /// Flushes every deferring region written since the last fence and waits until its writes
    /// are visible ([`MemoryRegion::defers_writes`]); all of them even if one fails, the first
    /// error returned (as a DMA error at `addr`, the access that needed the fence).
    #[cold]
    fn fence_deferred(&mut self, addr: u64) -> Result<(), DmaError> {
        let mut result = Ok(());
        for entry in &mut self.entries {
            entry.unfenced = false;
        }
        for region in self.unfenced.drain(..) {
            if let Err(source) = region.flush().and_then(|()| region.wait_flushed())
                && result.is_ok()
            {
                result = Err(DmaError::Region { addr, source });
            }
        }
        result
    }

    #[inline]
    pub(crate) fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let mut hint = self.mru;
        self.read_at(addr, buf, &mut hint)?;
        self.mru = hint;
        Ok(())
    }

    /// [`MapCache::read`] with the caller's translation hint (see [`MapCache::translate_at`]).
    #[inline]
    pub(crate) fn read_at(
        &mut self,
        addr: u64,
        buf: &mut [u8],
        hint: &mut usize,
    ) -> Result<(), DmaError> {
        let (index, offset) = self.translate_at(addr, buf.len(), hint)?;
        self.entries[index]
            .region
            .read(offset, buf)
            .map_err(|source| DmaError::Region { addr, source })
    }

    #[inline]
    pub(crate) fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), DmaError> {
        let mut hint = self.mru;
        let (region, offset) = self.translate_write(addr, data.len(), &mut hint)?;
        let result = region
            .write(offset, data)
            .map_err(|source| DmaError::Region { addr, source });
        self.mru = hint;
        result
    }

    /// Fills device addresses `addr..addr + len` from `file` at `file_offset` with one
    /// positioned read into the region behind them ([`MemoryRegion::read_from_file`]), if that
    /// region can take one: `Ok(None)` if it cannot, `Ok(Some(Err))` for the file's error.
    pub(crate) fn write_from_file(
        &mut self,
        addr: u64,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> Result<Option<std::io::Result<()>>, DmaError> {
        let mut hint = self.mru;
        let (region, offset) = self.translate_write(addr, len, &mut hint)?;
        let done = region.read_from_file(offset, len, file, file_offset);
        self.mru = hint;
        Ok(done)
    }

    /// Writes `data` with its last dword stored Release (a completion queue entry).
    #[cfg(test)]
    pub(crate) fn write_last_dword_release(
        &mut self,
        addr: u64,
        data: &[u8],
    ) -> Result<(), DmaError> {
        let mut hint = self.mru;
        self.write_last_dword_release_at(addr, data, &mut hint)
    }

    /// Writes `data` with its last dword stored Release (a completion queue entry), with the
    /// caller's translation hint (see [`MapCache::translate_at`]).
    #[inline]
    pub(crate) fn write_last_dword_release_at(
        &mut self,
        addr: u64,
        data: &[u8],
        hint: &mut usize,
    ) -> Result<(), DmaError> {
        let (index, offset) = self.translate_at(addr, data.len(), hint)?;
        if !self.entries[index].defers && !self.unfenced.is_empty() {
            // A completion in memory written at once (host memory) must not be seen before
            // the data of its command in memory written later (GPU memory behind batched
            // copies): perform and wait for those writes first. (The fence changes no entry
            // but their fence flags: `index` stays valid.)
            self.fence_deferred(addr)?;
        }
        self.note_write(index);
        self.entries[index]
            .region
            .write_last_dword_release(offset, data)
            .map_err(|source| DmaError::Region { addr, source })
    }

    /// [`DeviceAddressMap::prefetch`] through the cache: each region covering some of the
    /// ranges gets one [`MemoryRegion::prefetch`] call with its ranges (host memory none).
    pub(crate) fn prefetch(&mut self, ranges: &[(u64, usize)]) -> Result<(), DmaError> {
        let mut result = Ok(());
        for &(addr, len) in ranges {
            match self.translate(addr, len) {
                Ok((index, offset)) => {
                    let entry = &self.entries[index];
                    if entry.hint {
                        self.prefetch.add(&entry.region, addr, offset, len);
                    }
                }
                Err(e) => {
                    if result.is_ok() {
                        result = Err(e);
                    }
                }
            }
        }
        self.prefetch.call(&mut result);
        result
    }

    /// Whether any region mapped now takes prefetch hints (none: nothing to announce).
    #[inline]
    pub(crate) fn any_hints(&self) -> bool {
        self.map.hinted.load(Ordering::Acquire) != 0
    }

    /// Whether the region at `addr` takes prefetch hints (false for host memory, and for an
    /// unmapped address).
    pub(crate) fn takes_hints(&mut self, addr: u64) -> bool {
        self.translate(addr, 1)
            .is_ok_and(|(index, _)| self.entries[index].hint)
    }

    /// Whether any region was written through since the last flush.
    pub(crate) fn has_unflushed(&self) -> bool {
        !self.dirty.is_empty()
    }

    /// Flushes every region written through since the last flush ([`MemoryRegion::flush`]),
    /// all of them even if one fails; returns the first error.
    pub(crate) fn flush(&mut self) -> Result<(), RegionError> {
        let mut result = Ok(());
        for region in self.dirty.drain(..) {
            if let Err(e) = region.flush()
                && result.is_ok()
            {
                result = Err(e);
            }
        }
        for entry in &mut self.entries {
            entry.dirty = false;
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct VecRegion(Mutex<Vec<u8>>);

    impl MemoryRegion for VecRegion {
        fn len(&self) -> usize {
            self.0.lock().unwrap().len()
        }
        fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
            let v = self.0.lock().unwrap();
            buf.copy_from_slice(&v[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
            let mut v = self.0.lock().unwrap();
            v[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    /// 8 KiB whose reads and writes do nothing; records its flush and prefetch calls.
    #[derive(Default)]
    struct RecordingRegion {
        flushes: std::sync::atomic::AtomicU32,
        prefetches: Mutex<Vec<Vec<(u64, usize)>>>,
    }

    impl MemoryRegion for RecordingRegion {
        fn len(&self) -> usize {
            8192
        }
        fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<(), RegionError> {
            Ok(())
        }
        fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), RegionError> {
            Ok(())
        }
        fn flush(&self) -> Result<(), RegionError> {
            self.flushes.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn prefetch(&self, ranges: &[(u64, usize)]) -> Result<(), RegionError> {
            self.prefetches.lock().unwrap().push(ranges.to_vec());
            Ok(())
        }
    }

    #[test]
    fn flush_reaches_each_written_region_once() {
        let map = Arc::new(DeviceAddressMap::new());
        let regions: Vec<Arc<RecordingRegion>> = (0..3)
            .map(|_| Arc::new(RecordingRegion::default()))
            .collect();
        let bases: Vec<u64> = regions
            .iter()
            .map(|r| map.register_region(r.clone()).unwrap())
            .collect();
        let flushes = |i: usize| regions[i].flushes.load(Ordering::Relaxed);
        let mut cache = MapCache::new(map.clone());
        assert!(!cache.has_unflushed());
        // Reads do not make a region dirty.
        cache.read(bases[2], &mut [0; 4]).unwrap();
        assert!(!cache.has_unflushed());
        for _ in 0..3 {
            cache.write(bases[0], &[1; 4]).unwrap();
            cache
                .write_last_dword_release(bases[1] + 16, &[1; 16])
                .unwrap();
        }
        assert!(cache.has_unflushed());
        // Evicted from the cache, or unregistered: still flushed.
        cache.clear();
        cache.write(bases[0] + 8, &[1; 4]).unwrap();
        assert!(map.unregister_region(bases[1]).is_some());
        cache.flush().unwrap();
        assert_eq!((flushes(0), flushes(1), flushes(2)), (1, 1, 0));
        assert!(!cache.has_unflushed());
        cache.flush().unwrap();
        assert_eq!(flushes(0), 1, "nothing written since");
        cache.write(bases[0], &[1; 4]).unwrap();
        cache.flush().unwrap();
        assert_eq!(flushes(0), 2);
    }

    /// 4 KiB that logs every call into a shared journal; `defers` says whether it defers its
    /// writes, `fail_wait` makes `wait_flushed` fail.
    struct JournalRegion {
        name: &'static str,
        defers: bool,
        fail_wait: bool,
        journal: Arc<Mutex<Vec<String>>>,
    }

    impl JournalRegion {
        fn log(&self, what: &str) {
            self.journal
                .lock()
                .unwrap()
                .push(format!("{} {what}", self.name));
        }
    }

    impl MemoryRegion for JournalRegion {
        fn len(&self) -> usize {
            4096
        }
        fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<(), RegionError> {
            Ok(())
        }
        fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), RegionError> {
            self.log("write");
            Ok(())
        }
        fn write_last_dword_release(&self, _offset: u64, _data: &[u8]) -> Result<(), RegionError> {
            self.log("cqe");
            Ok(())
        }
        fn flush(&self) -> Result<(), RegionError> {
            self.log("flush");
            Ok(())
        }
        fn defers_writes(&self) -> bool {
            self.defers
        }
        fn wait_flushed(&self) -> Result<(), RegionError> {
            self.log("wait");
            if self.fail_wait {
                return Err(RegionError {
                    reason: "transfer failed".into(),
                    source: None,
                });
            }
            Ok(())
        }
    }

    #[test]
    fn completion_in_host_memory_waits_for_deferred_data() {
        let journal = Arc::new(Mutex::new(Vec::new()));
        let map = Arc::new(DeviceAddressMap::new());
        let region = |name, defers, fail_wait| {
            map.register_region(Arc::new(JournalRegion {
                name,
                defers,
                fail_wait,
                journal: journal.clone(),
            }))
            .unwrap()
        };
        let gpu_data = region("gpu", true, false);
        let gpu_cq = region("gpucq", true, false);
        let host_cq = region("hostcq", false, false);
        let host_data = region("host", false, false);
        let take = || std::mem::take(&mut *journal.lock().unwrap());
        let mut cache = MapCache::new(map.clone());

        // Data in deferring memory, completion in host memory: flushed and waited for first.
        cache.write(gpu_data, &[1; 8]).unwrap();
        cache.write_last_dword_release(host_cq, &[2; 16]).unwrap();
        assert_eq!(take(), ["gpu write", "gpu flush", "gpu wait", "hostcq cqe"]);
        // Nothing deferred since: no second wait.
        cache.write(host_data, &[1; 8]).unwrap();
        cache.write_last_dword_release(host_cq, &[2; 16]).unwrap();
        assert_eq!(take(), ["host write", "hostcq cqe"]);
        // A completion in deferring memory keeps the region's own ordering: no wait.
        cache.write(gpu_data, &[1; 8]).unwrap();
        cache.write_last_dword_release(gpu_cq, &[2; 16]).unwrap();
        assert_eq!(take(), ["gpu write", "gpucq cqe"]);
        // ... but both are still owed to the next host completion.
        cache.write_last_dword_release(host_cq, &[2; 16]).unwrap();
        let fenced = take();
        assert_eq!(fenced.len(), 5, "{fenced:?}");
        assert_eq!(fenced[4], "hostcq cqe");
        for r in ["gpu", "gpucq"] {
            let flush = fenced.iter().position(|e| *e == format!("{r} flush"));
            let wait = fenced.iter().position(|e| *e == format!("{r} wait"));
            assert!(flush.is_some() && flush < wait, "{fenced:?}");
        }

        // A failed wait is the completion's DMA error, and the entry is not written.
        let broken = region("broken", true, true);
        cache.write(broken, &[1; 8]).unwrap();
        let err = cache
            .write_last_dword_release(host_cq, &[2; 16])
            .unwrap_err();
        assert!(
            matches!(err, DmaError::Region { addr, .. } if addr == host_cq),
            "{err:?}"
        );
        assert_eq!(take(), ["broken write", "broken flush", "broken wait"]);

        // A deferring region unmapped while owed a fence: waited for, then let go, when idle.
        let freed = Arc::new(JournalRegion {
            name: "freed",
            defers: true,
            fail_wait: false,
            journal: journal.clone(),
        });
        let base = map.register_region(freed.clone()).unwrap();
        cache.write(base, &[1; 8]).unwrap();
        cache.flush().unwrap();
        assert!(map.unregister_region(base).is_some());
        take();
        cache.release_stale();
        assert_eq!(take(), ["freed flush", "freed wait"]);
        assert_eq!(Arc::strong_count(&freed), 1, "the cache let go of it");
    }

    #[test]
    fn prefetch_groups_ranges_by_region() {
        let map = Arc::new(DeviceAddressMap::new());
        let a = Arc::new(RecordingRegion::default());
        let b = Arc::new(RecordingRegion::default());
        let host = map
            .register_region(Arc::new(VecRegion(Mutex::new(vec![0; 4096]))))
            .unwrap();
        let ba = map.register_region(a.clone()).unwrap();
        let bb = map.register_region(b.clone()).unwrap();
        let ranges = [
            (bb + 100, 8),
            (ba + 4096, 512),
            (host, 64),
            (bb, 4096),
            (ba, 16),
            (ba + 8000, 500), // runs off the end: unmapped
            (ba + 8, 8),
        ];
        let mut cache = MapCache::new(map.clone());
        for round in 0..2 {
            let result = if round == 0 {
                cache.prefetch(&ranges)
            } else {
                map.prefetch(&ranges)
            };
            assert!(matches!(result, Err(DmaError::Unmapped { .. })));
            let a_calls = std::mem::take(&mut *a.prefetches.lock().unwrap());
            let b_calls = std::mem::take(&mut *b.prefetches.lock().unwrap());
            assert_eq!(a_calls, vec![vec![(4096, 512), (0, 16), (8, 8)]]);
            assert_eq!(b_calls, vec![vec![(100, 8), (0, 4096)]]);
        }
        // Nothing to announce: no call.
        cache.prefetch(&[]).unwrap();
        assert!(a.prefetches.lock().unwrap().is_empty());
    }

    #[test]
    fn translate_bounds_and_unregister() {
        let map = Arc::new(DeviceAddressMap::new());
        let a = map
            .register_region(Arc::new(VecRegion(Mutex::new(vec![0; 8192]))))
            .unwrap();
        let b = map
            .register_region(Arc::new(VecRegion(Mutex::new(vec![0; 4096]))))
            .unwrap();
        assert_eq!(a, DEVICE_ADDRESS_BASE);
        assert!(b >= a + 8192 + GUARD_GAP, "guard gap between regions");
        assert_eq!(b % GUARD_GAP, 0);

        let mut cache = MapCache::new(map.clone());
        cache.write(a + 8190, &[1, 2]).unwrap();
        let mut two = [0u8; 2];
        map.read(a + 8190, &mut two).unwrap();
        assert_eq!(two, [1, 2]);
        // One byte past the end, the address 0 and an address below the base are unmapped.
        assert!(matches!(
            cache.write(a + 8191, &[1, 2]),
            Err(DmaError::Unmapped { .. })
        ));
        assert!(matches!(
            cache.read(0, &mut two),
            Err(DmaError::Unmapped { .. })
        ));
        assert!(matches!(
            cache.read(a - 1, &mut two),
            Err(DmaError::Unmapped { .. })
        ));
        assert!(matches!(
            cache.read(u64::MAX, &mut two),
            Err(DmaError::Unmapped { .. })
        ));

        // After unregistering, the cached translation is gone too.
        cache.read(b, &mut two).unwrap();
        assert!(map.unregister_region(b).is_some());
        assert!(matches!(
            cache.read(b, &mut two),
            Err(DmaError::Unmapped { .. })
        ));
        // Addresses are not reused.
        let c = map
            .register_region(Arc::new(VecRegion(Mutex::new(vec![0; 4096]))))
            .unwrap();
        assert!(c > b);
        assert_eq!(map.region_count(), 2);
    }

    #[test]
    fn idle_release_keeps_mapped_regions_and_drops_unmapped_ones() {
        let map = Arc::new(DeviceAddressMap::new());
        let a: Arc<dyn MemoryRegion> = Arc::new(VecRegion(Mutex::new(vec![0; 4096])));
        let b: Arc<dyn MemoryRegion> = Arc::new(VecRegion(Mutex::new(vec![0; 4096])));
        let ba = map.register_region(a.clone()).unwrap();
        let bb = map.register_region(b.clone()).unwrap();
        let mut cache = MapCache::new(map.clone());
        cache.read(ba, &mut [0; 4]).unwrap();
        cache.read(bb, &mut [0; 4]).unwrap();
        let (ca, cb) = (Arc::strong_count(&a), Arc::strong_count(&b));
        // Nothing unmapped: the cache keeps its entries (and references).
        cache.release_stale();
        assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (ca, cb));
        // `b` unmapped: the idle release lets go of everything cached, `b` included.
        assert!(map.unregister_region(bb).is_some());
        cache.release_stale();
        assert_eq!(Arc::strong_count(&b), 1);
        assert_eq!(Arc::strong_count(&a), ca - 1);
        assert!(matches!(
            cache.read(bb, &mut [0; 4]),
            Err(DmaError::Unmapped { .. })
        ));
        cache.read(ba, &mut [0; 4]).unwrap();
    }

    #[test]
    fn a_stale_hint_costs_a_lookup_never_a_wrong_translation() {
        let map = Arc::new(DeviceAddressMap::new());
        let regions: Vec<Arc<VecRegion>> = (0..3)
            .map(|i| Arc::new(VecRegion(Mutex::new(vec![i as u8; 4096]))))
            .collect();
        let bases: Vec<u64> = regions
            .iter()
            .map(|r| map.register_region(r.clone()).unwrap())
            .collect();
        let mut cache = MapCache::new(map.clone());
        for (i, &base) in bases.iter().enumerate() {
            let mut byte = [0u8];
            // Whatever the hint says (another entry, or none at all), the bytes come from the
            // region the address belongs to.
            for mut hint in [0, 1, 2, 7, usize::MAX] {
                cache.read_at(base + 5, &mut byte, &mut hint).unwrap();
                assert_eq!(byte[0], i as u8);
                let mut again = hint;
                cache.read_at(base + 6, &mut byte, &mut again).unwrap();
                assert_eq!(again, hint, "a good hint is kept");
            }
            let mut hint = 0;
            assert!(matches!(
                cache.read_at(base + 4095, &mut [0; 2], &mut hint),
                Err(DmaError::Unmapped { .. })
            ));
        }
    }

    #[test]
    fn hinted_regions_are_counted() {
        let map = Arc::new(DeviceAddressMap::new());
        let cache = MapCache::new(map.clone());
        let host = map
            .register_host_region(Arc::new(VecRegion(Mutex::new(vec![0; 4096]))))
            .unwrap();
        assert!(!cache.any_hints(), "host memory takes no hints");
        let gpu = map
            .register_region(Arc::new(VecRegion(Mutex::new(vec![0; 4096]))))
            .unwrap();
        assert!(cache.any_hints());
        assert!(map.unregister_region(host).is_some());
        assert!(cache.any_hints());
        assert!(map.unregister_region(gpu).is_some());
        assert!(!cache.any_hints());
    }
}
