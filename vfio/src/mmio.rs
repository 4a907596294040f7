//! BAR0 as the driver's register window: the mmappable parts mapped and accessed with volatile
//! 32-bit loads and stores, the rest through a slower port.
//!
//! If only parts of the BAR may be mmapped (a sparse-mmap capability: around an MSI-X table for
//! vfio-pci; only the doorbell page for a vfio-user server such as SPDK's), accesses outside
//! those parts go through a [`RegionPort`]: pread/pwrite on the VFIO device file, which VFIO
//! turns into the same MMIO accesses, or region read/write messages to a vfio-user server. A
//! failed access reads as all-ones, which the driver already treats as "device gone".
// UNSAFETY: volatile loads and stores through the pointer of an mmapped BAR.
#![expect(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use crate::caps::RegionInfo;

/// Register accesses the mapping does not cover: offsets are within the region.
pub(crate) trait RegionPort: Send + Sync {
    /// Reads `buf.len()` bytes at `offset` in the region.
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `buf` at `offset` in the region.
    fn write(&self, offset: u64, buf: &[u8]) -> io::Result<()>;
}

/// The VFIO device file at the region's offset.
pub(crate) struct FilePort {
    /// The device file.
    pub file: Arc<File>,
    /// Offset of the region in the device file.
    pub region_offset: u64,
}

impl RegionPort for FilePort {
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, self.region_offset + offset)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.file.write_all_at(buf, self.region_offset + offset)
    }
}

/// Why a BAR cannot be mapped.
#[derive(Debug)]
pub(crate) enum BarError {
    /// The region's description does not make sense (reason in words).
    Layout(String),
    /// mmap failed.
    Map(io::Error),
}

struct MappedArea {
    /// Offset of the area in the BAR.
    start: usize,
    /// Exclusive end of the area in the BAR.
    end: usize,
    map: MmapRaw,
}

/// A device's BAR, mapped for MMIO where it may be.
pub struct Bar {
    /// Which device, for logs ("0000:01:00.0", "vfio-user /run/x/cntrl").
    label: String,
    len: usize,
    areas: Vec<MappedArea>,
    port: Box<dyn RegionPort>,
    /// Set once a port access has failed and been logged (later failures are not logged again:
    /// the driver may poll a register many times before it gives up).
    port_failed: AtomicBool,
}

impl std::fmt::Debug for Bar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bar")
            .field("device", &self.label)
            .field("len", &self.len)
            .field(
                "mmapped",
                &self
                    .areas
                    .iter()
                    .map(|a| (a.start, a.end))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Bar {
    /// Maps every mmappable area of `region` from `file` (at the region's offset in it), and
    /// reaches the rest through `port`.
    pub(crate) fn map(
        label: String,
        file: Option<&File>,
        region: &RegionInfo,
        port: Box<dyn RegionPort>,
    ) -> Result<Self, BarError> {
        let len = usize::try_from(region.size)
            .map_err(|_| BarError::Layout(format!("size 0x{:x} is too large", region.size)))?;
        let mut areas = Vec::new();
        let mappable = if file.is_some() {
            region.mmap_areas()
        } else {
            Vec::new()
        };
        for (off, size) in mappable {
            let end = off.checked_add(size).filter(|&e| e <= region.size);
            let (Ok(start), Some(end)) = (usize::try_from(off), end) else {
                return Err(BarError::Layout(format!(
                    "mmap area 0x{off:x}+0x{size:x} lies outside the BAR"
                )));
            };
            let file = file.expect("areas only when a file is given");
            let map = MmapOptions::new()
                .offset(region.offset + off)
                .len(size as usize)
                .map_raw(file)
                .map_err(BarError::Map)?;
            areas.push(MappedArea {
                start,
                end: end as usize,
                map,
            });
        }
        if areas.is_empty() {
            tracing::warn!(device = %label, "BAR0 cannot be mmapped; every register access is a slow one");
        }
        Ok(Self {
            label,
            len,
            areas,
            port,
            port_failed: AtomicBool::new(false),
        })
    }

    /// The host mapping of the whole BAR, when one mmap covers it (for handing the doorbells to
    /// another agent, e.g. CUDA host registration). Never turn it into a Rust reference.
    pub fn whole_mapping(&self) -> Option<(NonNull<u8>, usize)> {
        let a = self.areas.first()?;
        (a.start == 0 && a.end == self.len)
            .then(|| NonNull::new(a.map.as_mut_ptr()).map(|p| (p, self.len)))
            .flatten()
    }

    /// The mapped areas, as (offset in the BAR, host pointer, length). Never turn a pointer
    /// into a Rust reference.
    pub fn mapped_areas(&self) -> Vec<(usize, NonNull<u8>, usize)> {
        self.areas
            .iter()
            .filter_map(|a| NonNull::new(a.map.as_mut_ptr()).map(|p| (a.start, p, a.end - a.start)))
            .collect()
    }

    fn check(&self, offset: usize) {
        assert!(
            offset % 4 == 0,
            "unaligned 32-bit register access at 0x{offset:x}"
        );
        assert!(
            offset.checked_add(4).is_some_and(|e| e <= self.len),
            "register access at 0x{offset:x} outside BAR of 0x{:x} bytes",
            self.len
        );
    }

    /// The mapped word for `offset`, if an mmapped area covers it.
    fn word(&self, offset: usize) -> Option<*mut u32> {
        let a = self
            .areas
            .iter()
            .find(|a| a.start <= offset && offset + 4 <= a.end)?;
        // SAFETY: `offset - a.start + 4 <= a.map.len()`, so the result stays inside the mapping.
        Some(unsafe { a.map.as_mut_ptr().add(offset - a.start) }.cast::<u32>())
    }

    fn port_error(&self, op: &str, offset: usize, e: &io::Error) {
        if !self.port_failed.swap(true, Ordering::Relaxed) {
            tracing::error!(device = %self.label, offset, error = %e, "BAR0 {op} failed (later failures are not logged)");
        }
    }
}

impl nvme::RegisterIo for Bar {
    fn len(&self) -> usize {
        self.len
    }

    fn read_u32(&self, offset: usize) -> u32 {
        self.check(offset);
        if let Some(p) = self.word(offset) {
            // SAFETY: `p` is inside a live MAP_SHARED mapping of the BAR and 4-byte aligned (the
            // mapping is page-aligned and `offset` is a multiple of 4). A volatile load of exactly
            // 32 bits is the MMIO access the device expects; no Rust reference is created.
            return unsafe { p.read_volatile() };
        }
        let mut buf = [0u8; 4];
        match self.port.read(offset as u64, &mut buf) {
            Ok(()) => u32::from_le_bytes(buf),
            Err(e) => {
                self.port_error("read", offset, &e);
                u32::MAX
            }
        }
    }

    fn write_u32(&self, offset: usize, value: u32) {
        self.check(offset);
        if let Some(p) = self.word(offset) {
            // SAFETY: as in `read_u32`: in bounds, aligned, a 32-bit volatile store to MMIO.
            unsafe { p.write_volatile(value) };
            return;
        }
        if let Err(e) = self.port.write(offset as u64, &value.to_le_bytes()) {
            self.port_error("write", offset, &e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme::RegisterIo;
    use std::io::Write;

    /// A regular file stands in for the device file: both mmap and pread work on it, so the
    /// mmapped path and the pread fallback can be checked against the same bytes.
    fn fake_bar(sparse: Option<Vec<(u64, u64)>>) -> (tempfile::NamedTempFile, Bar) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let mut bytes = vec![0u8; 0x3000];
        for (i, w) in bytes.chunks_mut(4).enumerate() {
            w.copy_from_slice(&(i as u32 * 4).to_le_bytes());
        }
        f.write_all(&bytes).unwrap();
        let file = Arc::new(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(f.path())
                .unwrap(),
        );
        let region = RegionInfo {
            index: 0,
            flags: vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_READ
                | vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_WRITE
                | vfio_bindings::bindings::vfio::VFIO_REGION_INFO_FLAG_MMAP,
            size: 0x3000,
            offset: 0,
            sparse_mmap: sparse,
        };
        let port = Box::new(FilePort {
            file: Arc::clone(&file),
            region_offset: 0,
        });
        let bar = Bar::map("0000:00:03.0".into(), Some(&file), &region, port).unwrap();
        (f, bar)
    }

    #[test]
    fn reads_and_writes_through_mapping() {
        let (_f, bar) = fake_bar(None);
        assert_eq!(bar.len(), 0x3000);
        assert_eq!(bar.read_u32(0x14), 0x14);
        bar.write_u32(0x1000, 0xdead_beef);
        assert_eq!(bar.read_u32(0x1000), 0xdead_beef);
        assert_eq!(bar.read_u64(0x8), 0x0000_000c_0000_0008);
        assert!(bar.whole_mapping().is_some());
    }

    #[test]
    fn sparse_bar_falls_back_to_pread_for_holes() {
        let (f, bar) = fake_bar(Some(vec![(0, 0x1000), (0x2000, 0x1000)]));
        assert!(bar.whole_mapping().is_none());
        assert_eq!(bar.read_u32(0x1ffc), 0x1ffc, "hole read through pread");
        bar.write_u32(0x1800, 7);
        assert_eq!(bar.read_u32(0x1800), 7);
        let on_disk = std::fs::read(f.path()).unwrap();
        assert_eq!(&on_disk[0x1800..0x1804], &7u32.to_le_bytes());
        assert_eq!(bar.read_u32(0x2000), 0x2000, "second area mmapped");
    }

    #[test]
    #[should_panic(expected = "unaligned")]
    fn unaligned_access_is_a_caller_bug() {
        let (_f, bar) = fake_bar(None);
        bar.read_u32(2);
    }

    #[test]
    #[should_panic(expected = "outside BAR")]
    fn out_of_bounds_access_is_a_caller_bug() {
        let (_f, bar) = fake_bar(None);
        bar.write_u32(0x3000, 0);
    }
}
