//! The null device's DMA memory: zeroed, page-aligned heap allocations with a synthetic device
//! address, and the device-side accessors the null controller uses on them (with `spin` and
//! `published`, the only `unsafe` in [`super`]).
//!
//! The driver reaches the same bytes through [`DmaMemory`]; this side plays the device's DMA.
//! Neither side ever forms a Rust reference to the bytes: words shared with the driver are
//! accessed as atomics (what a device's DMA engine does, seen from the memory model), bulk
//! copies through raw pointers.
// UNSAFETY: allocating, freeing and reaching into memory shared with the driver needs raw
// pointers; every access is bounds-checked here, so callers stay safe.
#![expect(unsafe_code)]

use nvme::dma::{DMA_PAGE_SIZE, DmaMemory, DmaOwner};
use nvme_spec::Command;
use nvme_spec::wire::SQE_SIZE;
use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use zerocopy::{FromZeros, IntoBytes};

/// A zeroed, page-aligned heap allocation with a synthetic device address.
pub(super) struct Region {
    ptr: NonNull<u8>,
    len: usize,
    iova: u64,
}

// SAFETY: a plain heap allocation owned by this value; its bytes are reached only through raw
// pointers and atomics, from any thread, as a device and a driver share memory.
unsafe impl Send for Region {}
// SAFETY: as above; no method hands out references into the allocation other than atomics.
unsafe impl Sync for Region {}

impl Region {
    /// `len` bytes (a nonzero multiple of the page size) of zeroed memory, reached by the
    /// device at `iova`; `None` when the allocation fails.
    pub(super) fn new(len: usize, iova: u64) -> Option<Self> {
        assert!(len > 0 && len % DMA_PAGE_SIZE == 0, "whole pages");
        let layout = Layout::from_size_align(len, DMA_PAGE_SIZE).ok()?;
        // SAFETY: `len` is at least one page, so the layout has a nonzero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        Some(Self {
            ptr: NonNull::new(ptr)?,
            len,
            iova,
        })
    }

    /// Length in bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Device address of the first byte.
    pub(super) fn iova(&self) -> u64 {
        self.iova
    }

    /// Writes a 16-byte completion queue entry at `offset` (16-byte aligned, inside the
    /// region): dwords 0..=2 first, then dword 3 (the one with the phase tag) with Release, so
    /// that a driver that sees the new phase (Acquire) sees the whole entry.
    pub(super) fn store_cqe(&self, offset: usize, dw: [u32; 4]) {
        assert!(
            offset % 16 == 0 && offset.checked_add(16).is_some_and(|end| end <= self.len),
            "CQE {offset} outside a region of {}",
            self.len
        );
        // SAFETY: the 16 bytes are in bounds and aligned (checked; the base is page-aligned);
        // atomics are how memory shared with the driver is touched.
        let words = unsafe { &*self.ptr.as_ptr().add(offset).cast::<[AtomicU32; 4]>() };
        words[0].store(dw[0], Ordering::Relaxed);
        words[1].store(dw[1], Ordering::Relaxed);
        words[2].store(dw[2], Ordering::Relaxed);
        words[3].store(dw[3], Ordering::Release);
    }

    /// Copies `data` to `offset` (the device writing host memory by DMA).
    pub(super) fn write(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|end| end <= self.len)
        );
        // SAFETY: in bounds (checked); no Rust reference aliases the destination.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
    }

    /// Copies the 64-byte command at `offset` out (the device fetching an SQE).
    pub(super) fn read_command(&self, offset: usize) -> Command {
        assert!(
            offset
                .checked_add(SQE_SIZE)
                .is_some_and(|end| end <= self.len)
        );
        let mut cmd = Command::new_zeroed();
        // SAFETY: in bounds (checked); the destination is a local value of exactly SQE_SIZE
        // bytes, and any bytes are a valid `Command`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                cmd.as_mut_bytes().as_mut_ptr(),
                SQE_SIZE,
            )
        }
        cmd
    }

    /// The driver's handle on this region: a [`DmaMemory`] whose page `i` the device reaches
    /// at `iova + i * 4096`, kept alive by `owner`, which must hold a clone of `region`.
    pub(super) fn dma_memory(region: &Arc<Region>, owner: Box<dyn DmaOwner>) -> DmaMemory {
        let pages = (0..region.len / DMA_PAGE_SIZE)
            .map(|i| region.iova + (i * DMA_PAGE_SIZE) as u64)
            .collect();
        // SAFETY: `ptr` is page-aligned and valid for `len` bytes while `owner` holds the
        // region (the caller's contract); the device reaches page `i` at `iova + i * 4096`
        // (translated through the null device's registry), and dropping `owner` removes the
        // registry entry before the allocation can be freed (queues still holding the region
        // keep it alive until they are deleted). Nothing creates Rust references into it.
        unsafe { DmaMemory::from_raw_parts(region.ptr, region.len, pages, owner) }
    }
}

/// A ring of `entries` entries of `stride` bytes at `offset` of a [`Region`], checked once to
/// lie inside it, so that each entry access checks only its index.
pub(super) struct RingRef<'a> {
    /// The ring's first byte (`offset` bytes into the region).
    base: NonNull<u8>,
    entries: u32,
    stride: usize,
    _region: std::marker::PhantomData<&'a Region>,
}

/// A ring checked once, when its queue is created, to lie inside its region, which it keeps
/// alive: [`CheckedRing::view`] then costs no check (a doorbell on the hot path needs both
/// rings' views every time).
pub(super) struct CheckedRing {
    region: Arc<Region>,
    base: NonNull<u8>,
    entries: u32,
    stride: usize,
}

// SAFETY: `base` points into `region`, which this value keeps alive and which is Send and Sync
// itself; the pointer is only used to build views (atomics and raw copies behind them).
unsafe impl Send for CheckedRing {}
// SAFETY: as above; no method hands out anything but views bound to `&self`.
unsafe impl Sync for CheckedRing {}

impl CheckedRing {
    /// The ring at `offset` of `region` (as [`Region::ring`] checks it), or `None` if it does
    /// not fit.
    pub(super) fn new(
        region: Arc<Region>,
        offset: usize,
        entries: u32,
        stride: usize,
    ) -> Option<Self> {
        let (base, entries, stride) = {
            let r = region.ring(offset, entries, stride)?;
            (r.base, r.entries, r.stride)
        };
        Some(Self {
            region,
            base,
            entries,
            stride,
        })
    }

    /// The region the ring lies in.
    pub(super) fn region(&self) -> &Region {
        &self.region
    }

    /// The ring's entries, for as long as this value is borrowed (which keeps the region).
    #[inline(always)]
    pub(super) fn view(&self) -> RingRef<'_> {
        RingRef {
            base: self.base,
            entries: self.entries,
            stride: self.stride,
            _region: std::marker::PhantomData,
        }
    }
}

impl Region {
    /// The ring at `offset` (aligned to `stride`, a power of two of at least 16), or `None` if
    /// it does not fit the region.
    pub(super) fn ring(&self, offset: usize, entries: u32, stride: usize) -> Option<RingRef<'_>> {
        let end = (entries as usize)
            .checked_mul(stride)
            .and_then(|len| offset.checked_add(len))?;
        let fits = stride.is_power_of_two() && stride >= 16 && offset % stride == 0;
        (fits && end <= self.len).then(|| RingRef {
            // SAFETY: `offset <= end <= len`: inside the allocation or one past its end.
            base: unsafe { self.ptr.add(offset) },
            entries,
            stride,
            _region: std::marker::PhantomData,
        })
    }
}

/// An entry index at or beyond a ring's entry count (a bug in the null device).
#[cold]
#[inline(never)]
fn bad_entry(index: u32, entries: u32) -> ! {
    panic!("entry {index} of a ring of {entries}")
}

impl RingRef<'_> {
    /// Number of entries.
    #[inline]
    pub(super) fn entries(&self) -> u32 {
        self.entries
    }

    /// The first quadword of entry `index` (CDW0 and the NSID of an SQE), loaded Relaxed.
    ///
    /// # Panics
    /// If `index` is not below the ring's entry count (a bug in the null device).
    #[inline]
    pub(super) fn load_u64(&self, index: u32) -> u64 {
        if index >= self.entries {
            bad_entry(index, self.entries);
        }
        // SAFETY: `index * stride..+ 8` is inside the ring (`index` is below its entry count),
        // which was checked to fit the region when this view was made (the borrow keeps the
        // region alive), and 8-byte aligned (the region is page-aligned, the ring's offset and
        // stride multiples of 16). An AtomicU64 has the layout of a u64, and atomics are how
        // memory shared with the driver is touched.
        let word = unsafe {
            &*self
                .base
                .as_ptr()
                .add(index as usize * self.stride)
                .cast::<AtomicU64>()
        };
        word.load(Ordering::Relaxed)
    }

    /// Writes entry `index` as a completion queue entry, dword 3 last with Release (see
    /// [`Region::store_cqe`]).
    ///
    /// # Panics
    /// If `index` is not below the ring's entry count (a bug in the null device).
    #[inline]
    pub(super) fn store_cqe(&self, index: u32, dw: [u32; 4]) {
        if index >= self.entries {
            bad_entry(index, self.entries);
        }
        // SAFETY: the 16 bytes of entry `index` are inside the ring and 16-byte aligned (as in
        // `load_u64`); atomics are how memory shared with the driver is touched.
        let words = unsafe {
            &*self
                .base
                .as_ptr()
                .add(index as usize * self.stride)
                .cast::<[AtomicU32; 4]>()
        };
        words[0].store(dw[0], Ordering::Relaxed);
        words[1].store(dw[1], Ordering::Relaxed);
        words[2].store(dw[2], Ordering::Relaxed);
        words[3].store(dw[3], Ordering::Release);
    }
}

/// Posts the completions of a run of `len` commands: SQ entries `sq_at..sq_at + len` of `sq`
/// and CQ entries `cq_at..cq_at + len` of `cq`, both checked once here to lie inside their
/// rings, so that each command costs no index check. `f(k, qw0)` gives the four dwords of the
/// `k`th command's CQE from the first quadword of its SQE (CDW0 and the NSID, loaded Relaxed);
/// each CQE is written as [`RingRef::store_cqe`] writes it, dword 3 last with Release.
///
/// # Panics
/// If a range does not fit its ring (a bug in the null device).
#[inline(always)]
pub(super) fn complete_run(
    sq: &RingRef<'_>,
    cq: &RingRef<'_>,
    sq_at: u32,
    cq_at: u32,
    len: u32,
    mut f: impl FnMut(u32, u64) -> [u32; 4],
) {
    let fits = |ring: &RingRef<'_>, at: u32| at as u64 + len as u64 <= ring.entries as u64;
    if !fits(sq, sq_at) || !fits(cq, cq_at) {
        bad_entry(
            sq_at.max(cq_at).saturating_add(len),
            sq.entries.min(cq.entries),
        );
    }
    // SAFETY: both ranges lie inside their rings (checked above), which were checked to fit
    // their regions when the views were made (the borrows keep the regions alive): every
    // pointer below, `k < len` strides past the range's start, points at an entry of its
    // ring. Strides are at least 16, so the first 8 bytes of an SQE and the 16 of a CQE are
    // inside the entry, and aligned (regions are page-aligned, offsets and strides multiples
    // of 16). Atomics are how memory shared with the driver is touched.
    unsafe {
        let sqe = sq.base.as_ptr().add(sq_at as usize * sq.stride);
        let cqe = cq.base.as_ptr().add(cq_at as usize * cq.stride);
        for k in 0..len as usize {
            let qw0 = (*sqe.add(k * sq.stride).cast::<AtomicU64>()).load(Ordering::Relaxed);
            let dw = f(k as u32, qw0);
            let words = &*cqe.add(k * cq.stride).cast::<[AtomicU32; 4]>();
            words[0].store(dw[0], Ordering::Relaxed);
            words[1].store(dw[1], Ordering::Relaxed);
            words[2].store(dw[2], Ordering::Relaxed);
            words[3].store(dw[3], Ordering::Release);
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, DMA_PAGE_SIZE)
            .unwrap_or_else(|_| unreachable!("checked at allocation"));
        // SAFETY: allocated in `Region::new` with this layout, freed only here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}
