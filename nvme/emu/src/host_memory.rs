//! Host memory the software controller hands to the driver as DMA memory.
//!
//! A [`HostRegion`] is a page-aligned, zeroed allocation (heap, or a mapping when large). The driver reaches it through
//! the [`DmaMemory`] returned by [`crate::EmuDevice::alloc_dma`]; the controller threads reach
//! it through the device-address map, as a [`MemoryRegion`]. Both sides use raw-pointer copies
//! and atomics only, never Rust references, because the other side may be writing the same bytes
//! at the same time (exactly as a device and its driver do).
//!
//! Lifetime: the `DmaMemory`'s owner ([`EmuDmaOwner`]) holds one `Arc<HostRegion>` and the map
//! holds another; the controller's translation cache may hold a third. Dropping the `DmaMemory`
//! first unregisters the region from the map, so no later DMA can reach it, and the allocation
//! is freed only when the last `Arc` goes, so a DMA that raced the unregistration still touches
//! live memory.
// UNSAFETY: this module allocates the memory behind DMA buffers and copies into and out of it
// through raw pointers, which is the only sound way to share memory with a concurrent writer.
#![expect(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use nvme::{DMA_PAGE_SIZE, DmaAllocError, DmaMemory};

use crate::memory::{DeviceAddressMap, MemoryRegion, RegionError};

/// A zeroed, page-aligned host allocation usable as DMA memory. From [`MAPPED_FROM`] bytes on
/// it is an anonymous mapping of its own, whose pages the kernel supplies zeroed at their first
/// touch, so that a large buffer costs no page faults or zeroing until it is used
/// (`alloc_zeroed` of a page-aligned layout zeroes every byte at once: a lane's 4 MiB bounce
/// buffer took about 2 ms); smaller ones come from the heap.
pub(crate) struct HostRegion {
    ptr: NonNull<u8>,
    len: usize,
    /// The heap layout, for a region from the heap; `None` for a mapping.
    heap: Option<Layout>,
}

/// Regions of at least this many bytes are mappings of their own (see [`HostRegion`]).
const MAPPED_FROM: usize = 256 << 10;

// SAFETY: the region is a plain allocation owned by this value; all access to its bytes
// goes through raw-pointer copies and atomics, which any thread may perform.
unsafe impl Send for HostRegion {}
// SAFETY: as above: no method hands out references into the allocation, so shared use from
// several threads is no different from a device and a driver sharing memory.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Allocates `len` bytes (a nonzero multiple of the page size), zeroed.
    pub(crate) fn new(len: usize) -> Option<Self> {
        if len == 0 || len % DMA_PAGE_SIZE != 0 {
            return None;
        }
        if len < MAPPED_FROM {
            let layout = Layout::from_size_align(len, DMA_PAGE_SIZE).ok()?;
            // SAFETY: the layout has a nonzero size (checked above).
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            return Some(Self {
                ptr: NonNull::new(ptr)?,
                len,
                heap: Some(layout),
            });
        }
        // SAFETY: a private anonymous mapping at an address of the kernel's choosing (page
        // aligned, zero-filled); it overlaps nothing.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        Some(Self {
            ptr: NonNull::new(ptr.cast())?,
            len,
            heap: None,
        })
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, RegionError> {
        let offset = usize::try_from(offset).map_err(|_| RegionError::new("offset too large"))?;
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(offset),
            _ => Err(RegionError::new(format!(
                "access {offset:#x}+{len:#x} outside host region of {:#x} bytes",
                self.len
            ))),
        }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        match self.heap {
            // SAFETY: `ptr` was returned by `alloc_zeroed` with exactly this layout and is
            // freed only here, once, when the last reference to the region goes away.
            Some(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: `ptr..ptr + len` is exactly the mapping `new` made, unmapped only here,
            // once, when the last reference to the region goes away.
            None => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            },
        }
    }
}

impl MemoryRegion for HostRegion {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        let offset = self.check(offset, buf.len())?;
        // SAFETY: the range is inside the allocation (checked above), which lives as long as
        // `self`; the source is never a Rust reference, and `buf` is a distinct Rust slice.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            )
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let offset = self.check(offset, data.len())?;
        // SAFETY: the range is inside the allocation (checked above); no Rust reference aliases
        // the destination, and `data` cannot overlap it (it is a Rust slice).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(offset), data.len())
        }
        Ok(())
    }

    fn read_from_file(
        &self,
        offset: u64,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> Option<std::io::Result<()>> {
        use std::io::{Error, ErrorKind};
        use std::os::fd::AsRawFd;
        let Ok(start) = self.check(offset, len) else {
            return Some(Err(Error::from(ErrorKind::InvalidInput)));
        };
        let mut done = 0usize;
        while done < len {
            let Ok(at) = libc::off_t::try_from(file_offset + done as u64) else {
                return Some(Err(Error::from(ErrorKind::InvalidInput)));
            };
            // SAFETY: `start + done .. start + len` is inside the allocation (checked above),
            // which lives as long as `self`. The kernel writes it as a device's DMA would: no
            // Rust reference to these bytes exists, and the host does not touch a buffer while
            // a command that fills it is in flight.
            let n = unsafe {
                libc::pread(
                    file.as_raw_fd(),
                    self.ptr.as_ptr().add(start + done).cast::<libc::c_void>(),
                    len - done,
                    at,
                )
            };
            match n {
                0 => return Some(Err(Error::from(ErrorKind::UnexpectedEof))),
                n if n > 0 => done += n as usize,
                _ => {
                    let e = Error::last_os_error();
                    if e.kind() != ErrorKind::Interrupted {
                        return Some(Err(e));
                    }
                }
            }
        }
        Some(Ok(()))
    }

    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let start = self.check(offset, data.len())?;
        if data.len() < 4 || data.len() % 4 != 0 || start % 4 != 0 {
            return Err(RegionError::new(
                "ordered write must be whole aligned dwords",
            ));
        }
        let split = data.len() - 4;
        if let Ok(entry) = <&[u8; 16]>::try_from(data) {
            // A completion queue entry: three plain dword stores, no call to `memcpy`.
            // SAFETY: `start..start + 16` is inside the allocation and 4-byte aligned (checked
            // above); see the Release store below for why atomics.
            let words = unsafe { &*self.ptr.as_ptr().add(start).cast::<[AtomicU32; 3]>() };
            for (i, word) in words.iter().enumerate() {
                let bytes = [
                    entry[4 * i],
                    entry[4 * i + 1],
                    entry[4 * i + 2],
                    entry[4 * i + 3],
                ];
                word.store(u32::from_ne_bytes(bytes), Ordering::Relaxed);
            }
        } else {
            self.write(offset, &data[..split])?;
        }
        let last = u32::from_ne_bytes([
            data[split],
            data[split + 1],
            data[split + 2],
            data[split + 3],
        ]);
        // SAFETY: `start + split` is inside the allocation (checked above) and 4-byte aligned
        // (the base is page-aligned, `start` and `split` are multiples of 4). AtomicU32 has the
        // layout of u32; the reference lives only for this store, and atomics are the sanctioned
        // way to publish a word that another thread polls.
        let word = unsafe { &*self.ptr.as_ptr().add(start + split).cast::<AtomicU32>() };
        // Release: the host, after an Acquire load of this dword (the phase tag), sees the
        // first dwords of the entry too.
        word.store(last, Ordering::Release);
        Ok(())
    }
}

/// Keeps an emulator DMA buffer mapped and alive; dropping it unmaps the buffer from the
/// controller, then releases this reference to the memory.
pub(crate) struct EmuDmaOwner {
    map: Arc<DeviceAddressMap>,
    base: u64,
    _region: Arc<HostRegion>,
}

impl Drop for EmuDmaOwner {
    fn drop(&mut self) {
        // Revoke the device's access first; the memory is freed when `_region` (dropped right
        // after this) was the last reference.
        self.map.unregister_region(self.base);
    }
}

/// Allocates `len` bytes (rounded up to whole pages; at least one page) of zeroed host memory,
/// maps it in `map`, and wraps it as [`DmaMemory`].
pub(crate) fn alloc_dma(
    map: &Arc<DeviceAddressMap>,
    len: usize,
) -> Result<DmaMemory, DmaAllocError> {
    let fail = |reason: String| DmaAllocError {
        len,
        reason,
        source: None,
    };
    let rounded = len
        .max(1)
        .checked_next_multiple_of(DMA_PAGE_SIZE)
        .ok_or_else(|| fail("length overflows".into()))?;
    let region = Arc::new(
        HostRegion::new(rounded).ok_or_else(|| fail("host memory allocation failed".into()))?,
    );
    let ptr = region.ptr;
    let base = map
        .register_host_region(region.clone())
        .map_err(|e| DmaAllocError {
            len,
            reason: e.to_string(),
            source: Some(Box::new(e)),
        })?;
    let page_addrs = (0..rounded / DMA_PAGE_SIZE)
        .map(|i| base + (i * DMA_PAGE_SIZE) as u64)
        .collect();
    let owner = EmuDmaOwner {
        map: map.clone(),
        base,
        _region: region,
    };
    // SAFETY: `ptr` is page-aligned and valid for `rounded` bytes for as long as the owner
    // holds its `Arc<HostRegion>`; no Rust references into it exist (HostRegion hands none
    // out). `rounded` is a multiple of the page size with one device address per page, and the
    // device reaches page i at `base + i * 4096` (the map translates that range to this
    // region) until the owner's drop unregisters it, which happens before the owner's reference
    // to the memory is released.
    Ok(unsafe { DmaMemory::from_raw_parts(ptr, rounded, page_addrs, Box::new(owner)) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::DmaError;

    #[test]
    fn dma_memory_is_shared_with_the_map_and_unmapped_on_drop() {
        let map = Arc::new(DeviceAddressMap::new());
        let dma = alloc_dma(&map, 5000).unwrap();
        assert_eq!(dma.len(), 8192);
        assert!(dma.is_device_contiguous());
        let addr = dma.device_address(4096);
        dma.write(4096, b"hello");
        let mut buf = [0u8; 5];
        map.read(addr, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        map.write(addr + 8, b"dev").unwrap();
        let mut back = [0u8; 3];
        dma.read(4104, &mut back);
        assert_eq!(&back, b"dev");
        // Zeroed on allocation.
        let mut zero = [1u8; 16];
        dma.read(0, &mut zero);
        assert_eq!(zero, [0; 16]);
        assert_eq!(map.region_count(), 1);
        drop(dma);
        assert_eq!(map.region_count(), 0);
        assert!(matches!(
            map.read(addr, &mut buf),
            Err(DmaError::Unmapped { .. })
        ));
    }

    #[test]
    fn ordered_write_lands_whole() {
        let region = HostRegion::new(4096).unwrap();
        let entry: Vec<u8> = (0u8..16).collect();
        region.write_last_dword_release(32, &entry).unwrap();
        let mut back = [0u8; 16];
        region.read(32, &mut back).unwrap();
        assert_eq!(&back[..], &entry[..]);
        assert!(region.write_last_dword_release(2, &entry).is_err());
        assert!(region.write_last_dword_release(4090, &entry).is_err());
    }

    #[test]
    fn ordered_write_of_other_lengths_lands_whole() {
        let region = HostRegion::new(4096).unwrap();
        let data: Vec<u8> = (0u8..32).collect();
        region.write_last_dword_release(64, &data).unwrap();
        let mut back = [0u8; 32];
        region.read(64, &mut back).unwrap();
        assert_eq!(&back[..], &data[..]);
        assert!(region.write_last_dword_release(0, &[1, 2]).is_err());
    }

    #[test]
    fn positioned_reads_land_in_place_and_report_short_files() {
        use std::io::{ErrorKind, Write};
        let mut file = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        file.write_all(&bytes).unwrap();
        let region = HostRegion::new(8192).unwrap();
        region
            .read_from_file(100, 5000, &file, 1234)
            .unwrap()
            .unwrap();
        let mut back = vec![0u8; 5000];
        region.read(100, &mut back).unwrap();
        assert_eq!(back, bytes[1234..6234]);
        // Untouched around it.
        let mut edge = [1u8; 100];
        region.read(0, &mut edge).unwrap();
        assert_eq!(edge, [0; 100]);
        // Past the end of the file: a short read is an error, not zeroes.
        let e = region
            .read_from_file(0, 4096, &file, 8000)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::UnexpectedEof);
        // Outside the region: refused before any read.
        let e = region
            .read_from_file(8000, 4096, &file, 0)
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
}
