//! Decoding of VFIO info structures and their capability chains from the bytes the kernel
//! returned (`VFIO_DEVICE_GET_REGION_INFO`, `VFIO_IOMMU_GET_INFO`).
//!
//! Layouts are those of `<linux/vfio.h>`; offsets are checked against vfio-bindings' structs.
//! Malformed chains (out-of-bounds or looping `next` offsets) are reported, never followed.
#![forbid(unsafe_code)]

use std::io;
use std::mem::offset_of;

use vfio_bindings::bindings::vfio as b;

/// A region of a VFIO device (a BAR, config space, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    /// Region index (`VFIO_PCI_*_REGION_INDEX`).
    pub index: u32,
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: u32,
    /// Size in bytes.
    pub size: u64,
    /// Offset of the region in the device file, for pread/pwrite/mmap.
    pub offset: u64,
    /// Areas that may be mmapped, as (offset within the region, size), when the kernel restricts
    /// mmap to parts of the region (`VFIO_REGION_INFO_CAP_SPARSE_MMAP`); `None` when the whole
    /// region is mmappable (if `flags` has `MMAP`).
    pub sparse_mmap: Option<Vec<(u64, u64)>>,
}

impl RegionInfo {
    /// Whether the region can be read.
    pub fn readable(&self) -> bool {
        self.flags & b::VFIO_REGION_INFO_FLAG_READ != 0
    }
    /// Whether the region can be written.
    pub fn writable(&self) -> bool {
        self.flags & b::VFIO_REGION_INFO_FLAG_WRITE != 0
    }
    /// Whether (some of) the region can be mmapped.
    pub fn mmappable(&self) -> bool {
        self.flags & b::VFIO_REGION_INFO_FLAG_MMAP != 0
    }
    /// The areas that can be mmapped, as (offset, size) within the region.
    pub fn mmap_areas(&self) -> Vec<(u64, u64)> {
        if !self.mmappable() {
            return Vec::new();
        }
        match &self.sparse_mmap {
            Some(areas) => areas
                .iter()
                .copied()
                .filter(|&(_, size)| size > 0)
                .collect(),
            None => vec![(0, self.size)],
        }
    }
}

/// What the type1 IOMMU says about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IommuInfo {
    /// Bitmap of supported IOMMU page sizes.
    pub iova_pgsizes: u64,
    /// Usable IOVA ranges, inclusive `(start, end)`; `None` if the kernel did not report them
    /// (before Linux 5.4).
    pub iova_ranges: Option<Vec<(u64, u64)>>,
    /// Remaining number of mappings the container may create (Linux 5.10+).
    pub dma_avail: Option<u32>,
}

fn bad(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("malformed VFIO capability chain: {what}"),
    )
}

fn u32_at(buf: &[u8], off: usize) -> io::Result<u32> {
    buf.get(off..off + 4)
        .map(|s| u32::from_ne_bytes(s.try_into().expect("4 bytes")))
        .ok_or_else(|| bad("field past the end"))
}

fn u64_at(buf: &[u8], off: usize) -> io::Result<u64> {
    buf.get(off..off + 8)
        .map(|s| u64::from_ne_bytes(s.try_into().expect("8 bytes")))
        .ok_or_else(|| bad("field past the end"))
}

fn u16_at(buf: &[u8], off: usize) -> io::Result<u16> {
    buf.get(off..off + 2)
        .map(|s| u16::from_ne_bytes(s.try_into().expect("2 bytes")))
        .ok_or_else(|| bad("field past the end"))
}

/// Walks a capability chain starting at `first` (0 = none), calling `f(id, offset)` for each.
fn walk_caps(
    buf: &[u8],
    first: u32,
    mut f: impl FnMut(u16, usize) -> io::Result<()>,
) -> io::Result<()> {
    let hdr_id = offset_of!(b::vfio_info_cap_header, id);
    let hdr_next = offset_of!(b::vfio_info_cap_header, next);
    let mut off = first as usize;
    let mut seen = 0;
    while off != 0 {
        seen += 1;
        if seen > 64 {
            return Err(bad("more than 64 capabilities (loop?)"));
        }
        if off % 4 != 0 || off + size_of::<b::vfio_info_cap_header>() > buf.len() {
            return Err(bad("capability header out of bounds"));
        }
        let id = u16_at(buf, off + hdr_id)?;
        let next = u32_at(buf, off + hdr_next)? as usize;
        f(id, off)?;
        if next != 0 && next <= off {
            return Err(bad("capability `next` points backwards"));
        }
        off = next;
    }
    Ok(())
}

/// Reads `count` (u64, u64) pairs starting at `off`.
fn pairs(buf: &[u8], off: usize, count: u32) -> io::Result<Vec<(u64, u64)>> {
    if count > 4096 {
        return Err(bad("implausible element count"));
    }
    (0..count as usize)
        .map(|i| Ok((u64_at(buf, off + 16 * i)?, u64_at(buf, off + 16 * i + 8)?)))
        .collect()
}

/// Decodes `vfio_region_info` plus its capabilities.
pub fn parse_region_info(buf: &[u8]) -> io::Result<RegionInfo> {
    type R = b::vfio_region_info;
    let flags = u32_at(buf, offset_of!(R, flags))?;
    let mut info = RegionInfo {
        index: u32_at(buf, offset_of!(R, index))?,
        flags,
        size: u64_at(buf, offset_of!(R, size))?,
        offset: u64_at(buf, offset_of!(R, offset))?,
        sparse_mmap: None,
    };
    if flags & b::VFIO_REGION_INFO_FLAG_CAPS != 0 {
        let first = u32_at(buf, offset_of!(R, cap_offset))?;
        walk_caps(buf, first, |id, off| {
            if u32::from(id) == b::VFIO_REGION_INFO_CAP_SPARSE_MMAP {
                type S = b::vfio_region_info_cap_sparse_mmap;
                let n = u32_at(buf, off + offset_of!(S, nr_areas))?;
                info.sparse_mmap = Some(pairs(buf, off + offset_of!(S, areas), n)?);
            }
            Ok(())
        })?;
    }
    Ok(info)
}

/// Decodes `vfio_iommu_type1_info` plus its capabilities.
pub fn parse_iommu_info(buf: &[u8]) -> io::Result<IommuInfo> {
    type I = b::vfio_iommu_type1_info;
    let flags = u32_at(buf, offset_of!(I, flags))?;
    let mut info = IommuInfo {
        iova_pgsizes: if flags & b::VFIO_IOMMU_INFO_PGSIZES != 0 {
            u64_at(buf, offset_of!(I, iova_pgsizes))?
        } else {
            0
        },
        iova_ranges: None,
        dma_avail: None,
    };
    if flags & b::VFIO_IOMMU_INFO_CAPS != 0 {
        let first = u32_at(buf, offset_of!(I, cap_offset))?;
        walk_caps(buf, first, |id, off| {
            match u32::from(id) {
                b::VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE => {
                    type C = b::vfio_iommu_type1_info_cap_iova_range;
                    let n = u32_at(buf, off + offset_of!(C, nr_iovas))?;
                    let ranges = pairs(buf, off + offset_of!(C, iova_ranges), n)?;
                    if ranges.iter().any(|&(s, e)| e < s) {
                        return Err(bad("IOVA range ends before it starts"));
                    }
                    info.iova_ranges = Some(ranges);
                }
                b::VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL => {
                    // struct vfio_iommu_type1_info_dma_avail { header; __u32 avail; }
                    info.dma_avail = Some(u32_at(buf, off + 8)?);
                }
                _ => {}
            }
            Ok(())
        })?;
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put32(buf: &mut Vec<u8>, off: usize, v: u32) {
        if buf.len() < off + 4 {
            buf.resize(off + 4, 0);
        }
        buf[off..off + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put64(buf: &mut Vec<u8>, off: usize, v: u64) {
        if buf.len() < off + 8 {
            buf.resize(off + 8, 0);
        }
        buf[off..off + 8].copy_from_slice(&v.to_ne_bytes());
    }

    /// What a QEMU VT-d guest's type1 container reports: 4K|2M|1G pages, the MSI window cut out,
    /// and a DMA-available count, chained in that order.
    fn qemu_iommu_info() -> Vec<u8> {
        let mut b = vec![0u8; 24];
        put32(&mut b, 0, 80);
        put32(
            &mut b,
            4,
            b::VFIO_IOMMU_INFO_PGSIZES | b::VFIO_IOMMU_INFO_CAPS,
        );
        put64(&mut b, 8, 0x4020_1000);
        put32(&mut b, 16, 24);
        // IOVA range cap at 24: header(id 1, ver 1, next 72), nr 2, ranges.
        put32(&mut b, 24, 1 | (1 << 16));
        put32(&mut b, 28, 72);
        put32(&mut b, 32, 2);
        put64(&mut b, 40, 0);
        put64(&mut b, 48, 0xfedf_ffff);
        put64(&mut b, 56, 0xfef0_0000);
        put64(&mut b, 64, 0x7f_ffff_ffff);
        // DMA avail cap at 72.
        put32(&mut b, 72, 3 | (1 << 16));
        put32(&mut b, 76, 0);
        put32(&mut b, 80, 65535);
        b.resize(88, 0);
        b
    }

    #[test]
    fn decodes_iommu_info_with_ranges_and_dma_avail() {
        let info = parse_iommu_info(&qemu_iommu_info()).unwrap();
        assert_eq!(info.iova_pgsizes, 0x4020_1000);
        assert_eq!(
            info.iova_ranges,
            Some(vec![(0, 0xfedf_ffff), (0xfef0_0000, 0x7f_ffff_ffff)])
        );
        assert_eq!(info.dma_avail, Some(65535));
    }

    #[test]
    fn iommu_info_without_caps() {
        let mut b = vec![0u8; 24];
        put32(&mut b, 4, b::VFIO_IOMMU_INFO_PGSIZES);
        put64(&mut b, 8, 0x1000);
        let info = parse_iommu_info(&b).unwrap();
        assert_eq!(
            info,
            IommuInfo {
                iova_pgsizes: 0x1000,
                iova_ranges: None,
                dma_avail: None
            }
        );
    }

    #[test]
    fn rejects_looping_or_truncated_chains() {
        let mut b = qemu_iommu_info();
        put32(&mut b, 28, 24); // next points at itself
        assert_eq!(
            parse_iommu_info(&b).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        let mut b = qemu_iommu_info();
        put32(&mut b, 32, 1000); // nr_iovas past the end
        assert!(parse_iommu_info(&b).is_err());
        let b = qemu_iommu_info();
        assert!(parse_iommu_info(&b[..60]).is_err());
    }

    #[test]
    fn decodes_region_info_with_sparse_mmap() {
        let mut b = vec![0u8; 32];
        put32(
            &mut b,
            4,
            b::VFIO_REGION_INFO_FLAG_READ
                | b::VFIO_REGION_INFO_FLAG_WRITE
                | b::VFIO_REGION_INFO_FLAG_MMAP
                | b::VFIO_REGION_INFO_FLAG_CAPS,
        );
        put32(&mut b, 8, 0);
        put32(&mut b, 12, 32);
        put64(&mut b, 16, 0x4000);
        put64(&mut b, 24, 0);
        // Sparse mmap: two areas around an MSI-X table page at 0x2000.
        put32(&mut b, 32, 1 | (1 << 16));
        put32(&mut b, 36, 0);
        put32(&mut b, 40, 2);
        put64(&mut b, 48, 0);
        put64(&mut b, 56, 0x2000);
        put64(&mut b, 64, 0x3000);
        put64(&mut b, 72, 0x1000);
        let r = parse_region_info(&b).unwrap();
        assert!(r.readable() && r.writable() && r.mmappable());
        assert_eq!(r.size, 0x4000);
        assert_eq!(r.mmap_areas(), vec![(0, 0x2000), (0x3000, 0x1000)]);
    }

    #[test]
    fn region_without_caps_is_wholly_mmappable() {
        let mut b = vec![0u8; 32];
        put32(
            &mut b,
            4,
            b::VFIO_REGION_INFO_FLAG_READ | b::VFIO_REGION_INFO_FLAG_MMAP,
        );
        put32(&mut b, 8, 7);
        put64(&mut b, 16, 0x100);
        put64(&mut b, 24, 7 << 40);
        let r = parse_region_info(&b).unwrap();
        assert_eq!((r.index, r.offset), (7, 7 << 40));
        assert_eq!(r.mmap_areas(), vec![(0, 0x100)]);
        let mut nommap = b.clone();
        put32(&mut nommap, 4, b::VFIO_REGION_INFO_FLAG_READ);
        assert!(parse_region_info(&nommap).unwrap().mmap_areas().is_empty());
    }
}
