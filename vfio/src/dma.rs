//! DMA memory for a VFIO device, handed to the driver as [`nvme::DmaMemory`].
//!
//! **Chunks.** Host memory comes in chunks of 2 MiB hugepages (`MAP_HUGETLB`), or of 4 KiB pages
//! when no hugepage is free (with one warning per process). Each chunk is made reachable by the
//! device once: one `VFIO_IOMMU_MAP_DMA` at a 2 MiB-aligned IOVA (type1), or a pagemap lookup of
//! its locked pages (no-IOMMU). Requests up to 1 MiB are carved out of the current chunk, so the
//! container's mapping count (65535 by default) stays at about the number of megabytes in use;
//! larger requests get a chunk of their own.
//!
//! **Revocation.** A chunk hands out each of its bytes at most once. When its last buffer is
//! dropped the chunk is unmapped from the IOMMU, and only then is its memory freed or kept as a
//! spare for a later chunk, which gets a fresh IOVA (the IOVA allocator is next-fit). So a
//! command that completes after its buffer was dropped faults in the IOMMU instead of writing
//! into memory that was handed out again, as [`nvme::DmaMemory`] promises. If an unmap fails the
//! memory is leaked, never reused. In no-IOMMU mode nothing can be revoked: the device can reach
//! all of memory anyway.
//!
//! **Cost.** A long-lived buffer keeps the rest of its chunk from being reused until it is
//! dropped; at most 2 MiB per chunk that holds one.
// UNSAFETY: wrapping our own mappings in `DmaMemory` (an unsafe constructor), zeroing them
// through raw pointers, and mapping them for the device.
#![expect(unsafe_code)]

use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::{MmapOptions, MmapRaw};
use nvme::{DMA_PAGE_SIZE, DmaMemory, DmaRegion};

use crate::container::Container;
use crate::iova::IovaAllocator;
use crate::pagemap::Pagemap;
use crate::{Error, sys};

/// Size of a chunk: one 2 MiB hugepage, and the unit of IOMMU mapping.
pub const CHUNK_SIZE: usize = 2 << 20;
/// Requests larger than this get a chunk of their own instead of a slice of a shared one (half
/// the chunk size: mappers with larger chunks, vfio-user's, move it up with them).
pub const DEDICATED_ABOVE: usize = CHUNK_SIZE / 2;
/// `MAP_HUGE_2MB >> MAP_HUGE_SHIFT`.
const HUGEPAGE_SHIFT: u8 = 21;

/// Device addresses of a chunk.
#[derive(Debug)]
pub(crate) enum DeviceAddrs {
    /// One contiguous IOVA range starting here.
    Contiguous(u64),
    /// The device address of each 4 KiB page.
    Pages(Vec<u64>),
}

impl DeviceAddrs {
    fn page(&self, i: usize) -> u64 {
        match self {
            DeviceAddrs::Contiguous(base) => base + (i * DMA_PAGE_SIZE) as u64,
            DeviceAddrs::Pages(v) => v[i],
        }
    }
}

/// How chunks are made reachable by the device, and how that is undone.
pub(crate) trait Mapper: Send + Sync {
    /// Makes `len` bytes at `vaddr` reachable by the device (at an IOVA aligned to `align`,
    /// where IOVAs are chosen).
    ///
    /// # Safety
    /// `vaddr..vaddr + len` stays allocated, and holds nothing the device must not touch, until
    /// [`Mapper::unmap`] of the returned addresses has succeeded.
    /// `fd` is the memory's file descriptor, for mappers that share memory by descriptor
    /// (vfio-user); the memory is the whole of the file, from offset 0.
    unsafe fn map(
        &self,
        vaddr: usize,
        len: usize,
        align: usize,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<DeviceAddrs, Error>;

    /// Host memory for a chunk of `len` bytes: anonymous memory (hugepages if preferred and
    /// free) unless the mapper needs something else.
    fn host_memory(&self, len: usize, prefer_hugepages: bool) -> Result<HostMemory, Error> {
        alloc_host(len, prefer_hugepages, self.needs_mlock())
    }

    /// Size of the chunks small buffers are carved from ([`CHUNK_SIZE`] unless the mapper
    /// needs fewer, larger mappings).
    fn chunk_size(&self) -> usize {
        CHUNK_SIZE
    }

    /// Whether memory this crate did not allocate can be mapped (needs an IOMMU).
    fn can_map_external(&self) -> bool;

    /// Revokes the device's access. After an error the memory must never be reused.
    fn unmap(&self, addrs: &DeviceAddrs, len: usize) -> Result<(), Error>;

    /// Whether host memory must be locked by us (nothing else pins it).
    fn needs_mlock(&self) -> bool;
}

/// Type1 IOMMU: each chunk gets its own IOVA range, mapped once.
pub(crate) struct Type1Mapper {
    container: Arc<Container>,
    iova: Mutex<IovaAllocator>,
}

impl Type1Mapper {
    pub(crate) fn new(container: Arc<Container>, iova: IovaAllocator) -> Self {
        Self {
            container,
            iova: Mutex::new(iova),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves consistent data (every update is a single
    // insert/remove), so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Mapper for Type1Mapper {
    unsafe fn map(
        &self,
        vaddr: usize,
        len: usize,
        align: usize,
        _fd: Option<BorrowedFd<'_>>,
    ) -> Result<DeviceAddrs, Error> {
        let iova = lock(&self.iova)
            .alloc(len as u64, align as u64)
            .ok_or(Error::IovaExhausted { len })?;
        // SAFETY: the caller keeps the memory allocated, and free of anything the device must
        // not touch, until `unmap` of this range succeeds.
        let r = unsafe { sys::iommu_map_dma(self.container.fd(), vaddr as u64, iova, len as u64) };
        if let Err(source) = r {
            lock(&self.iova).free(iova, len as u64);
            return Err(Container::map_dma_error(iova, len, source));
        }
        Ok(DeviceAddrs::Contiguous(iova))
    }

    fn unmap(&self, addrs: &DeviceAddrs, len: usize) -> Result<(), Error> {
        let DeviceAddrs::Contiguous(iova) = *addrs else {
            unreachable!("type1 chunks are always contiguous")
        };
        self.container.unmap_dma(iova, len)?;
        lock(&self.iova).free(iova, len as u64);
        Ok(())
    }

    fn can_map_external(&self) -> bool {
        true
    }

    fn needs_mlock(&self) -> bool {
        // VFIO pins mapped pages itself (and charges them to RLIMIT_MEMLOCK); an mlock on top
        // would charge them twice.
        false
    }
}

/// No-IOMMU: the device is given physical addresses, read from `/proc/self/pagemap`.
pub(crate) struct NoIommuMapper {
    _container: Arc<Container>,
    pagemap: Pagemap,
}

impl NoIommuMapper {
    pub(crate) fn new(container: Arc<Container>, pagemap: Pagemap) -> Self {
        Self {
            _container: container,
            pagemap,
        }
    }
}

impl Mapper for NoIommuMapper {
    unsafe fn map(
        &self,
        vaddr: usize,
        len: usize,
        _align: usize,
        _fd: Option<BorrowedFd<'_>>,
    ) -> Result<DeviceAddrs, Error> {
        Ok(DeviceAddrs::Pages(self.pagemap.translate(
            vaddr,
            len,
            DMA_PAGE_SIZE,
        )?))
    }

    fn unmap(&self, _addrs: &DeviceAddrs, _len: usize) -> Result<(), Error> {
        // Nothing to revoke: without an IOMMU the device can reach all memory.
        Ok(())
    }

    fn can_map_external(&self) -> bool {
        // Foreign memory (a GPU BAR, say) is not pinned by us and may not even have page frames
        // that pagemap can report.
        false
    }

    fn needs_mlock(&self) -> bool {
        true
    }
}

/// Host memory backing one chunk: anonymous, or a shared mapping of a file (memfd) whose
/// descriptor is handed to the device's server.
pub(crate) struct HostMemory {
    pub(crate) map: MmapRaw,
    pub(crate) hugepages: bool,
    /// The file the mapping is of, for mappers that share memory by descriptor.
    pub(crate) file: Option<std::fs::File>,
}

impl HostMemory {
    fn len(&self) -> usize {
        self.map.len()
    }

    fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

static HUGEPAGE_FALLBACK_WARNED: AtomicBool = AtomicBool::new(false);
static NOIOMMU_SMALL_PAGES_WARNED: AtomicBool = AtomicBool::new(false);

/// Keeps DMA memory out of child processes. After a fork, the parent's next write to a shared
/// copy-on-write page would move it to a new page frame while the device (given the old frame's
/// physical address in no-IOMMU mode) keeps using the old one.
fn dont_fork(m: &memmap2::MmapMut, len: usize) -> Result<(), Error> {
    m.advise(memmap2::Advice::DontFork)
        .map_err(|source| Error::HostMemory { len, source })
}

fn alloc_host(len: usize, prefer_hugepages: bool, mlock: bool) -> Result<HostMemory, Error> {
    if prefer_hugepages {
        match MmapOptions::new()
            .len(len)
            .huge(Some(HUGEPAGE_SHIFT))
            .populate()
            .map_anon()
        {
            // Hugetlb pages are never swapped, so they need no mlock; the kernel moves them only
            // in rare cases (memory offlining, huge contiguous allocations).
            Ok(m) => {
                dont_fork(&m, len)?;
                return Ok(HostMemory {
                    map: m.into(),
                    hugepages: true,
                    file: None,
                });
            }
            Err(e) => {
                if !HUGEPAGE_FALLBACK_WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %e,
                        "no free 2 MiB hugepages; DMA memory falls back to 4 KiB pages \
                         (reserve some with: scripts/setup.sh hugepages 256)"
                    );
                }
            }
        }
    }
    let m = MmapOptions::new()
        .len(len)
        .populate()
        .map_anon()
        .map_err(|source| Error::HostMemory { len, source })?;
    dont_fork(&m, len)?;
    if mlock {
        if !NOIOMMU_SMALL_PAGES_WARNED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "no-IOMMU mode on 4 KiB pages: mlock keeps them resident but the kernel may still \
                 migrate them (compaction), leaving the device with stale physical addresses; \
                 reserve hugepages, or set vm.compact_unevictable_allowed=0"
            );
        }
        m.lock().map_err(|source| match source.raw_os_error() {
            Some(libc::ENOMEM | libc::EPERM | libc::EAGAIN) => Error::MemlockTooLow {
                len,
                limit: sys::memlock_limit(),
            },
            _ => Error::HostMemory { len, source },
        })?;
    }
    Ok(HostMemory {
        map: m.into(),
        hugepages: false,
        file: None,
    })
}

struct Chunk {
    mem: HostMemory,
    addrs: DeviceAddrs,
    /// Buffers handed out and not yet dropped.
    live: usize,
    /// Bytes handed out so far; never moves back.
    bump: usize,
}

#[derive(Default)]
struct State {
    chunks: HashMap<u64, Chunk>,
    /// The chunk small requests are carved from.
    current: Option<u64>,
    next_id: u64,
    /// One unmapped standard-size chunk kept for reuse.
    spare: Option<HostMemory>,
    leaked_bytes: usize,
}

struct Shared {
    mapper: Box<dyn Mapper>,
    prefer_hugepages: bool,
    state: Mutex<State>,
}

/// Counters describing a pool, for diagnostics and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaStats {
    /// Chunks currently mapped for the device (each one IOMMU mapping in type1 mode).
    pub chunks: usize,
    /// Bytes in those chunks.
    pub mapped_bytes: usize,
    /// Of those, bytes backed by 2 MiB hugepages.
    pub hugepage_bytes: usize,
    /// Buffers handed out and not yet dropped.
    pub live_buffers: usize,
    /// Bytes whose IOMMU unmap failed and that were therefore never freed.
    pub leaked_bytes: usize,
}

/// A source of DMA memory for one device.
pub(crate) struct DmaPool {
    shared: Arc<Shared>,
}

/// Keeps a buffer's chunk alive; returning the last one unmaps and frees the chunk.
struct Lease {
    shared: Arc<Shared>,
    chunk: u64,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.shared.release(self.chunk);
    }
}

impl Shared {
    fn new_chunk(&self, st: &mut State, len: usize) -> Result<u64, Error> {
        let mem = match st.spare.take() {
            Some(m) if m.len() == len => m,
            other => {
                st.spare = other;
                self.mapper.host_memory(len, self.prefer_hugepages)?
            }
        };
        let fd = mem.file.as_ref().map(|f| f.as_fd());
        // SAFETY: `mem` lives in `st.chunks` until `release` has unmapped it successfully; on an
        // unmap failure it is leaked, never freed. Nothing else uses it.
        let addrs = unsafe { self.mapper.map(mem.ptr() as usize, len, CHUNK_SIZE, fd) }?;
        let id = st.next_id;
        st.next_id += 1;
        st.chunks.insert(
            id,
            Chunk {
                mem,
                addrs,
                live: 0,
                bump: 0,
            },
        );
        Ok(id)
    }

    fn release(&self, id: u64) {
        let mut st = lock(&self.state);
        let Some(chunk) = st.chunks.get_mut(&id) else {
            tracing::error!(chunk = id, "DMA lease for an unknown chunk");
            return;
        };
        chunk.live -= 1;
        if chunk.live > 0 {
            return;
        }
        let chunk = st.chunks.remove(&id).expect("present above");
        if st.current == Some(id) {
            st.current = None;
        }
        match self.mapper.unmap(&chunk.addrs, chunk.mem.len()) {
            Ok(()) => {
                if chunk.mem.len() == self.mapper.chunk_size() && st.spare.is_none() {
                    st.spare = Some(chunk.mem);
                }
                // Otherwise the memory is unmapped from the process here.
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot revoke device access to a DMA chunk; leaking it");
                st.leaked_bytes += chunk.mem.len();
                std::mem::forget(chunk.mem);
            }
        }
    }
}

/// Memory this crate did not allocate (e.g. a GPU BAR mapped into the process) made reachable
/// by the device at one contiguous IOVA range. Dropping it removes the device's access.
pub struct ExternalMapping {
    shared: Arc<Shared>,
    iova: u64,
    len: usize,
}

impl std::fmt::Debug for ExternalMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalMapping")
            .field("iova", &format_args!("0x{:x}", self.iova))
            .field("len", &self.len)
            .finish()
    }
}

impl ExternalMapping {
    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: empty mappings are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of the byte at `offset`.
    ///
    /// # Panics
    /// If `offset >= len` (a caller bug).
    pub fn device_address(&self, offset: usize) -> u64 {
        assert!(
            offset < self.len,
            "offset {offset} outside mapping of {}",
            self.len
        );
        self.iova + offset as u64
    }

    /// The mapping as a driver-side [`DmaRegion`]: its IOVA range, owned by the mapping, so
    /// dropping the region (after whatever used it, such as a queue pair created on it with
    /// `nvme::Controller::create_queue_pair_on`) removes the device's access.
    ///
    /// The region gives the driver device addresses only, which is all queue creation and PRP
    /// lists need; the memory itself stays the caller's to reach (a GPU, another process).
    pub fn into_region(self) -> DmaRegion {
        DmaRegion::contiguous(self.iova, self.len, Box::new(self))
    }
}

impl Drop for ExternalMapping {
    fn drop(&mut self) {
        let addrs = DeviceAddrs::Contiguous(self.iova);
        if let Err(e) = self.shared.mapper.unmap(&addrs, self.len) {
            tracing::error!(error = %e, "cannot revoke device access to external memory");
        }
    }
}

impl crate::VfioNvme {
    /// Makes `len` bytes at `ptr`, memory this crate did not allocate, reachable by the device
    /// (one `VFIO_IOMMU_MAP_DMA`). Type1 IOMMU only: the kernel pins the pages, or for a PFNMAP
    /// of device memory (a GPU BAR) follows the page tables.
    ///
    /// # Safety
    /// `ptr..ptr + len` stays mapped in this process, and holds nothing the device must not
    /// touch, until the returned [`ExternalMapping`] is dropped (the `VFIO_IOMMU_MAP_DMA`
    /// contract: the device can write the range at any time while it is mapped).
    ///
    /// # Panics
    /// If `ptr` or `len` is not a multiple of 4 KiB, or `len` is 0.
    pub unsafe fn map_external(&self, ptr: *mut u8, len: usize) -> Result<ExternalMapping, Error> {
        // SAFETY: the caller's contract is the pool's.
        unsafe { self.dma_pool().map_external(ptr as usize, len) }
    }
}

impl DmaPool {
    /// See [`crate::VfioNvme::map_external`].
    ///
    /// # Safety
    /// As there.
    pub(crate) unsafe fn map_external(
        &self,
        vaddr: usize,
        len: usize,
    ) -> Result<ExternalMapping, Error> {
        assert!(len > 0, "empty external mapping");
        assert!(
            vaddr % DMA_PAGE_SIZE == 0 && len % DMA_PAGE_SIZE == 0,
            "external mapping 0x{vaddr:x}+0x{len:x} is not 4 KiB-aligned"
        );
        let sh = &self.shared;
        if !sh.mapper.can_map_external() {
            return Err(Error::ExternalNeedsIommu);
        }
        // 2 MiB-aligned IOVAs for 2 MiB-aligned memory let the IOMMU use large pages.
        let align = if vaddr % CHUNK_SIZE == 0 && len >= CHUNK_SIZE {
            CHUNK_SIZE
        } else {
            DMA_PAGE_SIZE
        };
        // SAFETY: the caller keeps the memory valid until the mapping is dropped, which unmaps.
        let addrs = unsafe { sh.mapper.map(vaddr, len, align, None) }?;
        let DeviceAddrs::Contiguous(iova) = addrs else {
            unreachable!("mappers that can map external memory give contiguous IOVAs")
        };
        Ok(ExternalMapping {
            shared: Arc::clone(sh),
            iova,
            len,
        })
    }

    pub(crate) fn new(mapper: Box<dyn Mapper>, prefer_hugepages: bool) -> Self {
        Self {
            shared: Arc::new(Shared {
                mapper,
                prefer_hugepages,
                state: Mutex::default(),
            }),
        }
    }

    /// Allocates `len` bytes (rounded up to whole 4 KiB pages, at least one) of zeroed memory
    /// the device can reach.
    pub(crate) fn alloc(&self, len: usize) -> Result<DmaMemory, Error> {
        let len = len
            .max(1)
            .checked_next_multiple_of(DMA_PAGE_SIZE)
            .ok_or(Error::IovaExhausted { len })?;
        let sh = &self.shared;
        let mut st = lock(&sh.state);
        let chunk_size = sh.mapper.chunk_size();
        let id = if len > chunk_size / 2 {
            let size = len
                .checked_next_multiple_of(CHUNK_SIZE)
                .ok_or(Error::IovaExhausted { len })?;
            sh.new_chunk(&mut st, size)?
        } else {
            match st.current {
                Some(id) if st.chunks[&id].bump + len <= st.chunks[&id].mem.len() => id,
                _ => {
                    let id = sh.new_chunk(&mut st, chunk_size)?;
                    st.current = Some(id);
                    id
                }
            }
        };
        let chunk = st.chunks.get_mut(&id).expect("chunk just found or made");
        let offset = chunk.bump;
        chunk.bump += len;
        chunk.live += 1;
        // SAFETY: `offset + len <= chunk length` (checked when picking the chunk), so the result
        // stays inside the mapping.
        let ptr = unsafe { chunk.mem.ptr().add(offset) };
        // SAFETY: in bounds as above; these bytes were never handed out in this mapping, so no
        // buffer and no command refers to them; raw-pointer writes create no reference.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        let first = offset / DMA_PAGE_SIZE;
        let page_addrs: Vec<u64> = (0..len / DMA_PAGE_SIZE)
            .map(|i| chunk.addrs.page(first + i))
            .collect();
        drop(st);
        let owner = Box::new(Lease {
            shared: Arc::clone(sh),
            chunk: id,
        });
        let ptr = NonNull::new(ptr).expect("mmap never returns null");
        // SAFETY: `ptr` is 4 KiB-aligned (chunks are page-aligned mmaps, offsets whole pages) and
        // valid for `len` bytes while the lease keeps the chunk in the pool; `page_addrs` holds
        // the device address of each page, valid until the chunk is unmapped, which happens only
        // after the lease is dropped; unmapping precedes freeing (or the memory is leaked).
        Ok(unsafe { DmaMemory::from_raw_parts(ptr, len, page_addrs, owner) })
    }

    /// Current counters.
    pub(crate) fn stats(&self) -> DmaStats {
        let st = lock(&self.shared.state);
        let mut s = DmaStats {
            leaked_bytes: st.leaked_bytes,
            ..Default::default()
        };
        for c in st.chunks.values() {
            s.chunks += 1;
            s.mapped_bytes += c.mem.len();
            if c.mem.hugepages {
                s.hugepage_bytes += c.mem.len();
            }
            s.live_buffers += c.live;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Event {
        Map { vaddr: usize, len: usize, iova: u64 },
        Unmap { iova: u64, len: usize },
    }

    /// Records map/unmap calls; IOVAs are handed out bump-style so reuse would show.
    #[derive(Default)]
    struct FakeMapper {
        log: Arc<Mutex<Vec<Event>>>,
        next: AtomicU64,
        fail_unmap: bool,
    }

    impl Mapper for FakeMapper {
        unsafe fn map(
            &self,
            vaddr: usize,
            len: usize,
            _align: usize,
            _fd: Option<BorrowedFd<'_>>,
        ) -> Result<DeviceAddrs, Error> {
            let iova = 0x1_0000_0000 + self.next.fetch_add(len as u64, Ordering::Relaxed);
            lock(&self.log).push(Event::Map { vaddr, len, iova });
            Ok(DeviceAddrs::Contiguous(iova))
        }
        fn unmap(&self, addrs: &DeviceAddrs, len: usize) -> Result<(), Error> {
            let DeviceAddrs::Contiguous(iova) = *addrs else {
                unreachable!()
            };
            lock(&self.log).push(Event::Unmap { iova, len });
            if self.fail_unmap {
                return Err(Error::UnmapDma {
                    iova,
                    len,
                    source: std::io::Error::other("test"),
                });
            }
            Ok(())
        }
        fn can_map_external(&self) -> bool {
            true
        }
        fn needs_mlock(&self) -> bool {
            false
        }
    }

    fn pool(fail_unmap: bool) -> (DmaPool, Arc<Mutex<Vec<Event>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let m = FakeMapper {
            log: Arc::clone(&log),
            fail_unmap,
            ..Default::default()
        };
        (DmaPool::new(Box::new(m), true), log)
    }

    fn maps(log: &Mutex<Vec<Event>>) -> usize {
        lock(log)
            .iter()
            .filter(|e| matches!(e, Event::Map { .. }))
            .count()
    }
    fn unmaps(log: &Mutex<Vec<Event>>) -> usize {
        lock(log)
            .iter()
            .filter(|e| matches!(e, Event::Unmap { .. }))
            .count()
    }

    #[test]
    fn small_buffers_share_one_mapping_per_chunk() {
        let (p, log) = pool(false);
        let bufs: Vec<DmaMemory> = (0..600).map(|_| p.alloc(100).unwrap()).collect();
        // 512 one-page buffers fit a 2 MiB chunk: 600 need two chunks, so two mappings.
        assert_eq!(maps(&log), 2);
        assert_eq!(p.stats().chunks, 2);
        assert_eq!(p.stats().live_buffers, 600);
        let mut seen = std::collections::HashSet::new();
        for b in &bufs {
            assert_eq!(b.len(), DMA_PAGE_SIZE);
            assert!(
                seen.insert(b.device_address(0)),
                "device address handed out twice"
            );
            assert_eq!(b.device_address(0) % DMA_PAGE_SIZE as u64, 0);
        }
        drop(bufs);
        assert_eq!(unmaps(&log), 2);
        assert_eq!(p.stats(), DmaStats::default());
    }

    #[test]
    fn buffers_are_zeroed_and_disjoint() {
        let (p, _log) = pool(false);
        let a = p.alloc(3 * DMA_PAGE_SIZE).unwrap();
        let b = p.alloc(DMA_PAGE_SIZE).unwrap();
        a.fill(0, a.len(), 0xaa);
        let mut page = vec![1u8; DMA_PAGE_SIZE];
        b.read(0, &mut page);
        assert!(page.iter().all(|&x| x == 0), "b not zeroed or overlaps a");
        assert!(a.is_device_contiguous());
        assert_eq!(
            b.device_address(0),
            a.device_address(0) + 3 * DMA_PAGE_SIZE as u64
        );
    }

    #[test]
    fn chunk_is_unmapped_only_when_its_last_buffer_goes() {
        let (p, log) = pool(false);
        let a = p.alloc(DMA_PAGE_SIZE).unwrap();
        let b = p.alloc(DMA_PAGE_SIZE).unwrap();
        drop(a);
        assert_eq!(unmaps(&log), 0, "chunk unmapped while b still uses it");
        drop(b);
        assert_eq!(unmaps(&log), 1);
    }

    #[test]
    fn memory_is_reused_only_after_unmap_and_at_a_new_address() {
        let (p, log) = pool(false);
        let a = p.alloc(DMA_PAGE_SIZE).unwrap();
        let (a_ptr, a_dev) = (a.as_ptr(), a.device_address(0));
        a.fill(0, DMA_PAGE_SIZE, 0x5a);
        drop(a);
        let b = p.alloc(DMA_PAGE_SIZE).unwrap();
        // The spare chunk's memory comes back (same host address) but re-zeroed, remapped at a
        // different device address, and the unmap came before the new map.
        assert_eq!(b.as_ptr(), a_ptr);
        assert_ne!(b.device_address(0), a_dev);
        let mut page = vec![1u8; DMA_PAGE_SIZE];
        b.read(0, &mut page);
        assert!(page.iter().all(|&x| x == 0));
        let events = lock(&log).clone();
        assert!(
            matches!(
                events.as_slice(),
                [Event::Map { .. }, Event::Unmap { .. }, Event::Map { .. }]
            ),
            "{events:?}"
        );
    }

    #[test]
    fn a_freed_range_is_not_handed_out_while_its_chunk_is_mapped() {
        let (p, _log) = pool(false);
        let keep = p.alloc(DMA_PAGE_SIZE).unwrap();
        let tmp = p.alloc(DMA_PAGE_SIZE).unwrap();
        let tmp_dev = tmp.device_address(0);
        drop(tmp);
        for _ in 0..10 {
            let again = p.alloc(DMA_PAGE_SIZE).unwrap();
            assert_ne!(again.device_address(0), tmp_dev);
        }
        drop(keep);
    }

    #[test]
    fn large_buffers_get_their_own_contiguous_chunk() {
        let (p, log) = pool(false);
        let small = p.alloc(DMA_PAGE_SIZE).unwrap();
        let big = p.alloc(3 << 20).unwrap();
        assert_eq!(big.len(), 3 << 20);
        assert!(big.is_device_contiguous());
        assert_eq!(maps(&log), 2);
        assert!(matches!(lock(&log)[1], Event::Map { len, .. } if len == 4 << 20));
        drop(big);
        assert_eq!(unmaps(&log), 1, "dedicated chunk unmapped at once");
        drop(small);
    }

    #[test]
    fn failed_unmap_leaks_instead_of_reusing() {
        let (p, log) = pool(true);
        let a = p.alloc(DMA_PAGE_SIZE).unwrap();
        let a_ptr = a.as_ptr();
        drop(a);
        assert_eq!(p.stats().leaked_bytes, CHUNK_SIZE);
        let b = p.alloc(DMA_PAGE_SIZE).unwrap();
        assert_ne!(
            b.as_ptr(),
            a_ptr,
            "memory still reachable by the device was reused"
        );
        assert_eq!(maps(&log), 2);
    }

    #[test]
    fn external_memory_is_mapped_once_and_unmapped_on_drop() {
        let (p, log) = pool(false);
        let mem = memmap2::MmapMut::map_anon(3 * DMA_PAGE_SIZE).unwrap();
        let vaddr = mem.as_ptr() as usize;
        // SAFETY: `mem` outlives the mapping (dropped below, before `mem`).
        let m = unsafe { p.map_external(vaddr, 3 * DMA_PAGE_SIZE) }.unwrap();
        assert_eq!(m.len(), 3 * DMA_PAGE_SIZE);
        assert_eq!(m.device_address(4097), m.device_address(0) + 4097);
        assert!(
            matches!(lock(&log)[0], Event::Map { vaddr: v, len, .. } if v == vaddr && len == 3 * DMA_PAGE_SIZE)
        );
        drop(m);
        assert!(matches!(lock(&log)[1], Event::Unmap { len, .. } if len == 3 * DMA_PAGE_SIZE));
        drop(mem);
    }

    #[test]
    fn external_mapping_becomes_a_region_that_unmaps_on_drop() {
        let (p, log) = pool(false);
        let mem = memmap2::MmapMut::map_anon(2 * DMA_PAGE_SIZE).unwrap();
        let vaddr = mem.as_ptr() as usize;
        // SAFETY: `mem` outlives the mapping and the region that owns it (both dropped first).
        let m = unsafe { p.map_external(vaddr, 2 * DMA_PAGE_SIZE) }.unwrap();
        let iova = m.device_address(0);
        let region = Arc::new(m.into_region());
        assert_eq!(region.len(), 2 * DMA_PAGE_SIZE);
        assert!(region.is_device_contiguous());
        assert_eq!(
            region.page_addresses(),
            &[iova, iova + DMA_PAGE_SIZE as u64]
        );
        assert_eq!(region.device_address(DMA_PAGE_SIZE + 12), iova + 4108);
        let user = Arc::clone(&region);
        drop(region);
        assert_eq!(unmaps(&log), 0, "unmapped while a user holds the region");
        drop(user);
        assert!(
            matches!(lock(&log)[1], Event::Unmap { iova: i, len } if i == iova && len == 2 * DMA_PAGE_SIZE)
        );
        drop(mem);
    }

    #[test]
    #[should_panic(expected = "not 4 KiB-aligned")]
    fn external_memory_must_be_page_aligned() {
        let (p, _log) = pool(false);
        // SAFETY: the assertion fires before anything is mapped.
        let _ = unsafe { p.map_external(0x1000 + 8, DMA_PAGE_SIZE) };
    }

    #[test]
    fn concurrent_alloc_and_free() {
        let (p, log) = pool(false);
        let p = Arc::new(p);
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let p = Arc::clone(&p);
                std::thread::spawn(move || {
                    for i in 0..200 {
                        let len = DMA_PAGE_SIZE * (1 + (i + t) % 5);
                        let b = p.alloc(len).unwrap();
                        b.fill(0, len, t as u8 + 1);
                        let mut out = vec![0u8; len];
                        b.read(0, &mut out);
                        assert!(
                            out.iter().all(|&x| x == t as u8 + 1),
                            "buffer shared between threads"
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(p.stats(), DmaStats::default());
        assert_eq!(maps(&log), unmaps(&log));
    }
}
