//! BAR0 as the driver's register window: mmapped from the VFIO device file, accessed with
//! volatile 32-bit loads and stores.
//!
//! If the kernel lets only parts of the BAR be mmapped (a sparse-mmap capability, e.g. around an
//! MSI-X table), accesses outside those parts go through pread/pwrite on the device file, which
//! VFIO turns into the same MMIO accesses. A failed pread reads as all-ones, which the driver
//! already treats as "device gone".
// UNSAFETY: volatile loads and stores through the pointer of an mmapped BAR.
#![expect(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

use crate::caps::RegionInfo;
use crate::{Error, PciAddress};

struct MappedArea {
    /// Offset of the area in the BAR.
    start: usize,
    /// Exclusive end of the area in the BAR.
    end: usize,
    map: MmapRaw,
}

/// A device's BAR, mapped for MMIO.
pub struct Bar {
    addr: PciAddress,
    len: usize,
    areas: Vec<MappedArea>,
    file: Arc<File>,
    /// Offset of the region in the device file.
    region_offset: u64,
}

impl std::fmt::Debug for Bar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bar")
            .field("addr", &self.addr)
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
    /// Maps every mmappable area of `region` from the device file.
    pub(crate) fn map(
        addr: PciAddress,
        file: Arc<File>,
        region: &RegionInfo,
    ) -> Result<Self, Error> {
        let len = usize::try_from(region.size).map_err(|_| Error::Bar0 {
            addr,
            reason: format!("size 0x{:x} is too large", region.size),
        })?;
        let mut areas = Vec::new();
        for (off, size) in region.mmap_areas() {
            let end = off.checked_add(size).filter(|&e| e <= region.size);
            let (Ok(start), Some(end)) = (usize::try_from(off), end) else {
                return Err(Error::Bar0 {
                    addr,
                    reason: format!("mmap area 0x{off:x}+0x{size:x} lies outside the BAR"),
                });
            };
            let map = MmapOptions::new()
                .offset(region.offset + off)
                .len(size as usize)
                .map_raw(&*file)
                .map_err(|source| Error::MapBar { addr, source })?;
            areas.push(MappedArea {
                start,
                end: end as usize,
                map,
            });
        }
        if areas.is_empty() {
            tracing::warn!(%addr, "BAR0 cannot be mmapped; register accesses go through pread/pwrite");
        }
        Ok(Self {
            addr,
            len,
            areas,
            file,
            region_offset: region.offset,
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
        match self
            .file
            .read_exact_at(&mut buf, self.region_offset + offset as u64)
        {
            Ok(()) => u32::from_le_bytes(buf),
            Err(e) => {
                tracing::error!(addr = %self.addr, offset, error = %e, "BAR0 read failed");
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
        if let Err(e) = self
            .file
            .write_all_at(&value.to_le_bytes(), self.region_offset + offset as u64)
        {
            tracing::error!(addr = %self.addr, offset, error = %e, "BAR0 write failed");
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
        let bar = Bar::map("0000:00:03.0".parse().unwrap(), file, &region).unwrap();
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
