//! DMA memory: memory the controller reads and writes, as device addresses per page
//! ([`DmaRegion`]) and, where the host can reach it too, a host mapping over them
//! ([`DmaMemory`]).
//!
//! Memory shared with a device is never reached through Rust references, because the device can
//! change it underneath them. Every access here goes through raw pointers: volatile loads and
//! stores for the words that carry protocol state (phase bits, command ids), and plain
//! non-overlapping copies for bulk data, which the caller only performs once a completion (read
//! with Acquire ordering) says the device is done with the bytes, or before a doorbell write
//! (ordered by a Release fence) hands them to it.
// UNSAFETY: this module owns the raw pointer behind every DMA buffer and must dereference it.
#![expect(unsafe_code)]

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Size of the pages device addresses are given for; also the NVMe memory page size the driver
/// selects (CC.MPS = 0).
pub const DMA_PAGE_SIZE: usize = 4096;

/// Something that keeps a DMA buffer's memory alive and mapped for the device, and undoes both
/// when dropped: first removes the device's access (IOMMU unmap, or unregistering the range from
/// the software controller), then frees the memory.
pub trait DmaOwner: Send + Sync {}

impl<T: Send + Sync> DmaOwner for T {}

/// Device memory addresses with no host mapping: what a queue or a transfer needs from the
/// driver's point of view, wherever the bytes live (host memory, GPU memory, a BAR, memory
/// another process owns).
///
/// Holds the device address of each 4 KiB page and an owner that keeps the memory alive and
/// reachable by the device; dropping the region drops the owner, which revokes the device's
/// access before the memory is freed (see [`DmaOwner`]). Holding the region, for instance in an
/// `Arc` next to a queue created on it, therefore keeps the memory valid for the device for as
/// long as that queue may use it.
///
/// Constructing one is safe: the driver never dereferences these addresses on the host. What the
/// device may do with them is the transport's business: the addresses must be ones the device
/// can reach and that hold nothing it must not touch, for as long as the owner lives.
pub struct DmaRegion {
    len: usize,
    pages: Pages,
    _owner: Box<dyn DmaOwner>,
}

/// Where a region's pages are for the device.
enum Pages {
    /// Device address of each 4 KiB page; each page-aligned.
    Listed(Vec<u64>),
    /// One range from `base`: the page table is built only if someone asks for it
    /// ([`DmaRegion::page_addresses`]), since a GPU arena of 13.5 GB would otherwise spend
    /// 15-20 ms and 26 MB writing 3.3 million addresses that nothing reads.
    Contiguous {
        base: u64,
        table: OnceLock<Vec<u64>>,
    },
}

impl fmt::Debug for DmaRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaRegion")
            .field("len", &self.len)
            .field("first_device_address", &self.first_address())
            .field("contiguous", &self.is_device_contiguous())
            .finish()
    }
}

impl DmaRegion {
    /// A region of `len` bytes whose 4 KiB page `i` the device reaches at `page_addrs[i]`, kept
    /// alive and mapped by `owner`.
    ///
    /// # Panics
    /// If `len` is not a whole number of [`DMA_PAGE_SIZE`] pages, `page_addrs` does not hold
    /// exactly one address per page, or an address is not page-aligned (caller bugs).
    pub fn new(len: usize, page_addrs: Vec<u64>, owner: Box<dyn DmaOwner>) -> Self {
        assert_eq!(len % DMA_PAGE_SIZE, 0, "DMA length must be whole pages");
        assert_eq!(
            page_addrs.len(),
            len / DMA_PAGE_SIZE,
            "one device address per page"
        );
        assert!(
            page_addrs.iter().all(|a| a % DMA_PAGE_SIZE as u64 == 0),
            "device addresses must be page-aligned"
        );
        Self {
            len,
            pages: Pages::Listed(page_addrs),
            _owner: owner,
        }
    }

    /// A region of `len` bytes the device reaches at `base..base + len` (one IOVA range, a BAR
    /// window, a physically contiguous allocation).
    ///
    /// # Panics
    /// If `base` or `len` is not a multiple of [`DMA_PAGE_SIZE`], or the range wraps around
    /// the 64-bit address space.
    pub fn contiguous(base: u64, len: usize, owner: Box<dyn DmaOwner>) -> Self {
        assert!(
            base.checked_add(len as u64).is_some(),
            "device range {base:#x}+{len:#x} wraps around"
        );
        assert_eq!(len % DMA_PAGE_SIZE, 0, "DMA length must be whole pages");
        assert_eq!(
            base % DMA_PAGE_SIZE as u64,
            0,
            "device addresses must be page-aligned"
        );
        Self {
            len,
            pages: Pages::Contiguous {
                base,
                table: OnceLock::new(),
            },
            _owner: owner,
        }
    }

    /// The device address of the first page, if there is one.
    fn first_address(&self) -> Option<u64> {
        match &self.pages {
            Pages::Listed(p) => p.first().copied(),
            Pages::Contiguous { base, .. } => (self.len > 0).then_some(*base),
        }
    }

    /// Length in bytes (whole pages).
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of the byte at `offset`.
    ///
    /// # Panics
    /// If `offset >= len` (a caller bug, not device input).
    pub fn device_address(&self, offset: usize) -> u64 {
        assert!(
            offset < self.len,
            "offset {offset} outside DMA region of {}",
            self.len
        );
        match &self.pages {
            Pages::Listed(p) => p[offset / DMA_PAGE_SIZE] + (offset % DMA_PAGE_SIZE) as u64,
            Pages::Contiguous { base, .. } => base + offset as u64,
        }
    }

    /// Device addresses of every page, in order.
    #[inline]
    pub fn page_addresses(&self) -> &[u64] {
        match &self.pages {
            Pages::Listed(p) => p,
            Pages::Contiguous { base, table } => table.get_or_init(|| {
                (0..self.len / DMA_PAGE_SIZE)
                    .map(|i| base + (i * DMA_PAGE_SIZE) as u64)
                    .collect()
            }),
        }
    }

    /// Whether the device addresses of all pages are contiguous (true for IOVA mappings and the
    /// software controller; usually false for no-IOMMU physical addresses).
    pub fn is_device_contiguous(&self) -> bool {
        match &self.pages {
            Pages::Listed(p) => p.windows(2).all(|w| w[1] == w[0] + DMA_PAGE_SIZE as u64),
            Pages::Contiguous { .. } => true,
        }
    }
}

/// A buffer of DMA memory: a host mapping plus a [`DmaRegion`] (the device address of each
/// 4 KiB page, and the owner that keeps both alive).
///
/// Dropping it revokes the device's access before freeing the memory, so a command that timed
/// out and completes late can never write into memory that was reused. The region is shared
/// ([`DmaMemory::region`]): whoever holds a clone of it keeps the memory alive and mapped for
/// the device after this host handle is gone.
pub struct DmaMemory {
    ptr: NonNull<u8>,
    region: Arc<DmaRegion>,
}

// SAFETY: DmaMemory hands out no references into the buffer; all access is through raw-pointer
// copies and atomics, which are safe to make from any thread. The region (and its owner) is
// Send + Sync.
unsafe impl Send for DmaMemory {}
// SAFETY: as above; concurrent accesses from several threads are no different from concurrent
// accesses by the device, which this type already tolerates.
unsafe impl Sync for DmaMemory {}

impl fmt::Debug for DmaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.region.len)
            .field("first_device_address", &self.region.first_address())
            .finish()
    }
}

impl DmaMemory {
    /// Wraps memory that a transport has mapped for its device.
    ///
    /// # Safety
    /// - `ptr` is 4 KiB-aligned and valid for reads and writes of `len` bytes for as long as
    ///   `owner` lives, and nothing else creates Rust references into it.
    /// - `len` is a multiple of [`DMA_PAGE_SIZE`] and `page_addrs.len() == len / DMA_PAGE_SIZE`.
    /// - `page_addrs[i]` is the page-aligned address at which the device reaches the page at
    ///   `ptr + i * DMA_PAGE_SIZE`, and stays so until `owner` is dropped; dropping `owner`
    ///   removes the device's access before the memory is freed (the same contract as
    ///   `VFIO_IOMMU_MAP_DMA`/`VFIO_IOMMU_UNMAP_DMA` around a user mapping).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        page_addrs: Vec<u64>,
        owner: Box<dyn DmaOwner>,
    ) -> Self {
        assert_eq!(
            ptr.as_ptr() as usize % DMA_PAGE_SIZE,
            0,
            "DMA memory must be page-aligned"
        );
        Self {
            ptr,
            region: Arc::new(DmaRegion::new(len, page_addrs, owner)),
        }
    }

    /// The device side of this buffer: its addresses and the owner keeping it alive. Clone the
    /// `Arc` to hand the memory to something that needs only device addresses (a queue created
    /// with [`crate::Controller::create_queue_pair_on`], say); the memory then stays valid and
    /// mapped until both this buffer and every clone are dropped.
    pub fn region(&self) -> &Arc<DmaRegion> {
        &self.region
    }

    /// Length in bytes (whole pages).
    #[inline]
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// Device address of the byte at `offset`.
    ///
    /// # Panics
    /// If `offset >= len` (a caller bug, not device input).
    pub fn device_address(&self, offset: usize) -> u64 {
        self.region.device_address(offset)
    }

    /// Device addresses of every page, in order.
    #[inline]
    pub fn page_addresses(&self) -> &[u64] {
        self.region.page_addresses()
    }

    /// Whether the device addresses of all pages are contiguous (true for IOVA mappings and the
    /// software controller; usually false for no-IOMMU physical addresses).
    pub fn is_device_contiguous(&self) -> bool {
        self.region.is_device_contiguous()
    }

    #[inline]
    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len()),
            "access {offset}+{len} outside DMA buffer of {}",
            self.len()
        );
    }

    /// Copies `buf.len()` bytes out of the buffer, starting at `offset`.
    ///
    /// Call only once the device is known to be done writing these bytes (after an Acquire load
    /// of the completion that covers them).
    pub fn read(&self, offset: usize, buf: &mut [u8]) {
        self.check(offset, buf.len());
        // SAFETY: in bounds (checked above); the source is valid for reads per the constructor's
        // contract and is not a Rust reference; the destination is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            )
        }
    }

    /// Copies `data` into the buffer at `offset`.
    ///
    /// The bytes become visible to the device at the next Release fence (the driver issues one
    /// before every doorbell write).
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: in bounds (checked above); the destination is valid for writes per the
        // constructor's contract and no Rust reference aliases it.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
    }

    /// Copies `words` into the buffer at `offset` (8-byte aligned), in native (little-endian)
    /// byte order: an SQE built as quadwords, or a run of PRP list entries.
    ///
    /// Like [`DmaMemory::write`], the words become visible to the device at the next Release
    /// fence (the driver issues one before every doorbell write).
    #[inline]
    pub fn write_u64s(&self, offset: usize, words: &[u64]) {
        let len = size_of_val(words);
        self.check(offset, len);
        assert_eq!(offset % 8, 0, "unaligned 64-bit DMA access at {offset}");
        // SAFETY: in bounds and aligned (checked above; the base is page-aligned); the
        // destination is valid for writes per the constructor's contract and no Rust reference
        // aliases it; the source is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                words.as_ptr().cast::<u8>(),
                self.ptr.as_ptr().add(offset),
                len,
            )
        }
    }

    /// Fills `len` bytes at `offset` with `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) {
        self.check(offset, len);
        // SAFETY: in bounds (checked above); valid for writes per the constructor's contract.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), byte, len) }
    }

    fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        self.check(offset, 4);
        assert_eq!(offset % 4, 0, "unaligned 32-bit DMA access at {offset}");
        // SAFETY: in bounds and 4-byte aligned (checked above; the base is page-aligned). An
        // AtomicU32 has the layout of a u32, and atomics are the sanctioned way to share a word
        // with another agent that may write it concurrently.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        self.check(offset, 8);
        assert_eq!(offset % 8, 0, "unaligned 64-bit DMA access at {offset}");
        // SAFETY: in bounds and 8-byte aligned (checked above); see `atomic_u32`.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    /// Loads the 32-bit word at `offset` (4-byte aligned) with the given ordering. Use
    /// `Ordering::Acquire` for the completion dword that carries the phase tag.
    pub fn load_u32(&self, offset: usize, order: Ordering) -> u32 {
        self.atomic_u32(offset).load(order)
    }

    /// Loads the 16-byte completion queue entry at `offset` (16-byte aligned) as four dwords:
    /// dword 3, which carries the phase tag, first and with Acquire, then dwords 0 to 2, so
    /// that when the phase tag says the entry is new, the other dwords are the controller's.
    #[inline]
    pub fn load_cqe(&self, offset: usize) -> [u32; 4] {
        self.check(offset, 16);
        assert_eq!(offset % 16, 0, "unaligned 16-byte DMA access at {offset}");
        // SAFETY: in bounds and 16-byte aligned (checked above; the base is page-aligned); four
        // AtomicU32 have the layout of [u32; 4]; see `atomic_u32`.
        let words = unsafe { &*self.ptr.as_ptr().add(offset).cast::<[AtomicU32; 4]>() };
        let dw3 = words[3].load(Ordering::Acquire);
        [
            words[0].load(Ordering::Relaxed),
            words[1].load(Ordering::Relaxed),
            words[2].load(Ordering::Relaxed),
            dw3,
        ]
    }

    /// Stores the 32-bit word at `offset` (4-byte aligned) with the given ordering.
    pub fn store_u32(&self, offset: usize, value: u32, order: Ordering) {
        self.atomic_u32(offset).store(value, order)
    }

    /// Loads the 64-bit word at `offset` (8-byte aligned).
    pub fn load_u64(&self, offset: usize, order: Ordering) -> u64 {
        self.atomic_u64(offset).load(order)
    }

    /// Stores the 64-bit word at `offset` (8-byte aligned).
    pub fn store_u64(&self, offset: usize, value: u64, order: Ordering) {
        self.atomic_u64(offset).store(value, order)
    }

    /// Raw base pointer, for transports that must hand the mapping to another API (CUDA host
    /// registration, IOMMU mapping). Never turn it into a Rust reference.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

/// A ring of `entries` entries of `STRIDE` bytes at the start of a [`DmaMemory`] (a
/// submission queue of 64-byte SQEs, a completion queue of 16-byte CQEs), checked once to fit
/// the memory, so that each entry access checks only its index: one compare where
/// [`DmaMemory`]'s byte-range accessors compute and check an end offset. A producer (the SQ)
/// also keeps its tail here: always below the entry count, so writing at it needs no check.
pub(crate) struct DmaRing<const STRIDE: usize> {
    mem: DmaMemory,
    entries: u32,
    /// The next entry [`DmaRing::push_u64s`] writes; below `entries`.
    tail: u32,
}

impl<const STRIDE: usize> DmaRing<STRIDE> {
    /// The ring of `entries` entries at the start of `mem`.
    ///
    /// # Panics
    /// If `entries` is 0, the entries do not fit `mem`, or `STRIDE` is not a power of two of
    /// at least 16 (caller bugs).
    pub(crate) fn new(mem: DmaMemory, entries: u32) -> Self {
        const { assert!(STRIDE.is_power_of_two() && STRIDE >= 16) };
        assert!(entries > 0, "empty ring");
        assert!(
            (entries as usize)
                .checked_mul(STRIDE)
                .is_some_and(|len| len <= mem.len()),
            "{entries} entries of {STRIDE} bytes do not fit {} bytes",
            mem.len()
        );
        Self {
            mem,
            entries,
            tail: 0,
        }
    }

    /// Index of the entry the next push writes (the SQ tail doorbell value after the entries
    /// before it).
    #[inline]
    pub(crate) fn tail(&self) -> u32 {
        self.tail
    }

    /// Claims the entry at the tail and advances the tail, wrapping at the entry count;
    /// returns the claimed index.
    #[inline(always)]
    pub(crate) fn advance(&mut self) -> u32 {
        let index = self.tail;
        self.tail = if index + 1 == self.entries {
            0
        } else {
            index + 1
        };
        index
    }

    /// Writes `words` (at most `STRIDE / 8` quadwords, native byte order) as the entry at the
    /// tail, advances the tail and returns the index written: an SQE built in place. No index
    /// check: the tail is always below the entry count. Like [`DmaMemory::write_u64s`], the
    /// words become visible to the device at the next Release fence (the driver issues one
    /// before every doorbell write).
    #[inline(always)]
    pub(crate) fn push_u64s(&mut self, words: &[u64]) -> u32 {
        assert!(size_of_val(words) <= STRIDE, "entry of {STRIDE} bytes");
        let index = self.advance();
        // SAFETY: `index < entries` (the tail's invariant: 0 at first, and `advance` wraps it
        // to 0 at `entries`), so `index * STRIDE + STRIDE <= entries * STRIDE <= len` (checked
        // in `new`); the entry is 8-byte aligned (the base is page-aligned, STRIDE a multiple
        // of 16); at most STRIDE bytes are written. The destination is valid for writes per
        // `DmaMemory`'s contract and no Rust reference aliases it; the source is a distinct
        // Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                words.as_ptr().cast::<u8>(),
                self.mem.ptr.as_ptr().add(index as usize * STRIDE),
                size_of_val(words),
            )
        }
        index
    }

    /// The memory the ring lies in.
    pub(crate) fn memory(&self) -> &DmaMemory {
        &self.mem
    }

    /// A pointer to entry `index`.
    ///
    /// # Panics
    /// If `index` is not below the entry count (a driver bug: ring indices come from the
    /// driver's own ring arithmetic, never from the device).
    #[inline(always)]
    fn entry(&self, index: u32) -> *mut u8 {
        if index >= self.entries {
            ring_index_panic(index, self.entries);
        }
        // SAFETY: `index * STRIDE + STRIDE <= entries * STRIDE <= len` (checked in `new`), so
        // the offset stays inside the allocation.
        unsafe { self.mem.ptr.as_ptr().add(index as usize * STRIDE) }
    }

    /// Loads entry `index` as a completion queue entry: dword 3 (the phase tag) first with
    /// Acquire, then dwords 0 and 2 Relaxed (dword 1 is reserved and not read); returns
    /// `[dw0, dw2, dw3]`. When the phase tag says the entry is new, the other dwords are the
    /// controller's.
    #[inline(always)]
    pub(crate) fn load_cqe(&self, index: u32) -> [u32; 3] {
        const { assert!(STRIDE >= 16) };
        let at = self.entry(index);
        // SAFETY: the entry's first 16 bytes are inside the memory (see `entry`) and 16-byte
        // aligned; four AtomicU32 have the layout of [u32; 4], and atomics are the sanctioned
        // way to share words with a device that may write them concurrently.
        let words = unsafe { &*at.cast::<[AtomicU32; 4]>() };
        let dw3 = words[3].load(Ordering::Acquire);
        [
            words[0].load(Ordering::Relaxed),
            words[2].load(Ordering::Relaxed),
            dw3,
        ]
    }
}

#[cold]
#[inline(never)]
fn ring_index_panic(index: u32, entries: u32) -> ! {
    panic!("ring entry {index} of {entries}")
}

/// A byte range of a shared DMA buffer: what I/O commands transfer into or out of.
///
/// Holding the `Arc` keeps the memory (and the device's access to it) alive while a command
/// that uses it is in flight.
#[derive(Clone, Debug)]
pub struct DmaSlice {
    /// The buffer.
    pub mem: Arc<DmaMemory>,
    /// Start of the range, in bytes from the buffer's start.
    pub offset: usize,
    /// Length of the range in bytes.
    pub len: usize,
}

/// A [`DmaSlice`] range that does not fit its buffer.
#[derive(Debug, thiserror::Error)]
#[error("DMA slice {offset}+{len} does not fit a buffer of {buffer_len} bytes")]
pub struct DmaSliceError {
    /// Requested offset.
    pub offset: usize,
    /// Requested length.
    pub len: usize,
    /// Length of the buffer.
    pub buffer_len: usize,
}

impl DmaSlice {
    /// The range `offset..offset + len` of `mem`.
    ///
    /// # Panics
    /// If the range does not fit the buffer (a caller bug, like slice indexing); use
    /// [`DmaSlice::try_new`] for ranges that come from input.
    pub fn new(mem: Arc<DmaMemory>, offset: usize, len: usize) -> Self {
        match Self::try_new(mem, offset, len) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    /// The range `offset..offset + len` of `mem`, or an error if it does not fit the buffer.
    pub fn try_new(mem: Arc<DmaMemory>, offset: usize, len: usize) -> Result<Self, DmaSliceError> {
        if offset.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Err(DmaSliceError {
                offset,
                len,
                buffer_len: mem.len(),
            });
        }
        Ok(Self { mem, offset, len })
    }

    /// The whole buffer.
    pub fn whole(mem: Arc<DmaMemory>) -> Self {
        let len = mem.len();
        Self {
            mem,
            offset: 0,
            len,
        }
    }

    /// A sub-range of this slice (`offset` relative to the slice's start).
    ///
    /// # Panics
    /// If the sub-range does not fit this slice; see [`DmaSlice::try_slice`].
    pub fn slice(&self, offset: usize, len: usize) -> Self {
        match self.try_slice(offset, len) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    /// A sub-range of this slice, or an error if it does not fit.
    pub fn try_slice(&self, offset: usize, len: usize) -> Result<Self, DmaSliceError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(DmaSliceError {
                offset,
                len,
                buffer_len: self.len,
            });
        }
        Ok(Self {
            mem: self.mem.clone(),
            offset: self.offset + offset,
            len,
        })
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device address of the first byte (the range must not be empty).
    pub fn device_address(&self) -> u64 {
        self.mem.device_address(self.offset)
    }

    /// Device addresses of the 4 KiB pages the range touches, in order.
    #[inline]
    pub fn pages(&self) -> &[u64] {
        if self.len == 0 {
            return &[];
        }
        let first = self.offset / DMA_PAGE_SIZE;
        let last = (self.offset + self.len - 1) / DMA_PAGE_SIZE;
        &self.mem.page_addresses()[first..=last]
    }

    /// Copies the range out into `buf` (`buf.len()` must equal the range's length).
    pub fn read(&self, buf: &mut [u8]) {
        assert_eq!(buf.len(), self.len, "DmaSlice::read length mismatch");
        self.mem.read(self.offset, buf)
    }

    /// Copies `data` into the range (`data.len()` must equal the range's length).
    pub fn write(&self, data: &[u8]) {
        assert_eq!(data.len(), self.len, "DmaSlice::write length mismatch");
        self.mem.write(self.offset, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Records when it is dropped.
    struct Owner(Arc<AtomicBool>);
    impl Drop for Owner {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn region_addresses() {
        let r = DmaRegion::new(
            3 * DMA_PAGE_SIZE,
            vec![0x10_0000, 0x20_0000, 0x20_1000],
            Box::new(()),
        );
        assert_eq!(r.len(), 3 * DMA_PAGE_SIZE);
        assert!(!r.is_empty());
        assert_eq!(r.device_address(5), 0x10_0005);
        assert_eq!(r.device_address(2 * DMA_PAGE_SIZE + 8), 0x20_1008);
        assert_eq!(r.page_addresses(), &[0x10_0000, 0x20_0000, 0x20_1000]);
        assert!(!r.is_device_contiguous());
        let c = DmaRegion::contiguous(0x8000_0000, 4 * DMA_PAGE_SIZE, Box::new(()));
        assert!(c.is_device_contiguous());
        assert_eq!(c.device_address(3 * DMA_PAGE_SIZE + 1), 0x8000_3001);
        assert!(DmaRegion::contiguous(0x1000, 0, Box::new(())).is_empty());
        assert_eq!(
            c.page_addresses(),
            &[0x8000_0000, 0x8000_1000, 0x8000_2000, 0x8000_3000]
        );
        // A contiguous region keeps no page table until asked: 1 PiB (a table of 2 TiB)
        // answers its addresses at once.
        let huge = DmaRegion::contiguous(1 << 52, 1 << 50, Box::new(()));
        assert!(huge.is_device_contiguous());
        assert_eq!(
            huge.device_address((1 << 50) - 1),
            (1 << 52) + (1 << 50) - 1
        );
        assert!(format!("{huge:?}").contains("contiguous: true"));
    }

    #[test]
    #[should_panic(expected = "page-aligned")]
    fn region_refuses_unaligned_addresses() {
        DmaRegion::new(DMA_PAGE_SIZE, vec![0x1008], Box::new(()));
    }

    #[test]
    #[should_panic(expected = "one device address per page")]
    fn region_refuses_missing_addresses() {
        DmaRegion::new(2 * DMA_PAGE_SIZE, vec![0x1000], Box::new(()));
    }

    #[test]
    #[should_panic(expected = "whole pages")]
    fn region_refuses_partial_pages() {
        DmaRegion::contiguous(0x1000, 100, Box::new(()));
    }

    #[test]
    fn region_outlives_the_host_handle() {
        let dropped = Arc::new(AtomicBool::new(false));
        let layout = std::alloc::Layout::from_size_align(DMA_PAGE_SIZE, DMA_PAGE_SIZE).unwrap();
        /// Frees the test allocation after recording the drop.
        struct Alloc {
            ptr: *mut u8,
            layout: std::alloc::Layout,
            _flag: Owner,
        }
        // SAFETY: the pointer is only freed, once, in `drop`.
        unsafe impl Send for Alloc {}
        // SAFETY: as above; `&Alloc` gives no access to the memory.
        unsafe impl Sync for Alloc {}
        impl Drop for Alloc {
            fn drop(&mut self) {
                // SAFETY: allocated below with this layout, freed only here.
                unsafe { std::alloc::dealloc(self.ptr, self.layout) }
            }
        }
        // SAFETY: the layout has a nonzero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let owner = Alloc {
            ptr,
            layout,
            _flag: Owner(dropped.clone()),
        };
        // SAFETY: `ptr` is page-aligned and valid for one page until `owner` is dropped; the
        // "device address" is never used to reach it.
        let mem = unsafe {
            DmaMemory::from_raw_parts(
                NonNull::new(ptr).unwrap(),
                DMA_PAGE_SIZE,
                vec![0x4000],
                Box::new(owner),
            )
        };
        mem.store_u32(8, 7, Ordering::Relaxed);
        let region = Arc::clone(mem.region());
        assert_eq!(region.device_address(8), 0x4008);
        drop(mem);
        assert!(
            !dropped.load(Ordering::SeqCst),
            "owner dropped under a live region"
        );
        drop(region);
        assert!(dropped.load(Ordering::SeqCst));
    }
}
