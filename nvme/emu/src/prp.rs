//! Physical Region Page walking (NVMe Base 2.0, section 4.1.1 "Physical Region Page Entry and
//! List"), and copying data between the controller and the host buffer a PRP set describes.
//!
//! With a 4 KiB memory page (CC.MPS = 0):
//! - PRP1 may start anywhere dword-aligned; it covers up to the end of its page.
//! - If the rest fits in one page, PRP2 points to that page (offset 0).
//! - Otherwise PRP2 is a PRP list pointer (qword aligned, any offset). The list's entries fill
//!   its page; when more entries remain than fit, the last entry of the page points to the
//!   next list page (offset 0) instead of to data.
//! - Every entry after PRP1 must have offset 0, else PRP Offset Invalid. An address no region
//!   maps is a Data Transfer Error.

use crate::memory::{DmaError, MapCache};

/// The memory page size (CC.MPS = 0).
pub(crate) const PAGE: u64 = 4096;

/// Why a PRP set is unusable.
#[derive(Debug)]
pub(crate) enum PrpError {
    /// An entry's offset is not allowed where it is; `field` is the byte offset in the command
    /// of the field that held it (24 for PRP1, 32 for PRP2 and list entries).
    OffsetInvalid { field: u16 },
    /// A PRP list could not be read.
    Dma(DmaError),
}

/// A contiguous piece of the host buffer: device address and length.
pub(crate) type Segment = (u64, u32);

/// Walks the PRPs of a command transferring `len` bytes and fills `segments` with the pieces
/// of the host buffer, merging adjacent ones. `list` is scratch space of one page.
pub(crate) fn walk(
    cache: &mut MapCache,
    prp1: u64,
    prp2: u64,
    len: u64,
    segments: &mut Vec<Segment>,
    list: &mut [u8; PAGE as usize],
) -> Result<(), PrpError> {
    segments.clear();
    if len == 0 {
        return Ok(());
    }
    if prp1 & 3 != 0 {
        return Err(PrpError::OffsetInvalid { field: 24 });
    }
    let first = len.min(PAGE - prp1 % PAGE);
    push(segments, prp1, first);
    let mut remaining = len - first;
    if remaining == 0 {
        return Ok(());
    }
    if remaining <= PAGE {
        if prp2 % PAGE != 0 {
            return Err(PrpError::OffsetInvalid { field: 32 });
        }
        push(segments, prp2, remaining);
        return Ok(());
    }
    if prp2 & 7 != 0 {
        return Err(PrpError::OffsetInvalid { field: 32 });
    }
    let mut list_addr = prp2;
    loop {
        let slots = (PAGE - list_addr % PAGE) / 8;
        let pages_left = remaining.div_ceil(PAGE);
        let (entries, chained) = if pages_left <= slots {
            (pages_left, false)
        } else {
            // The last slot of this list page points to the next list page.
            (slots, true)
        };
        let bytes = &mut list[..entries as usize * 8];
        cache.read(list_addr, bytes).map_err(PrpError::Dma)?;
        let data_entries = if chained { entries - 1 } else { entries };
        for chunk in bytes.chunks_exact(8).take(data_entries as usize) {
            let entry = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
            if entry % PAGE != 0 {
                return Err(PrpError::OffsetInvalid { field: 32 });
            }
            let n = remaining.min(PAGE);
            push(segments, entry, n);
            remaining -= n;
        }
        if !chained {
            debug_assert_eq!(remaining, 0);
            return Ok(());
        }
        let last = &bytes[(entries as usize - 1) * 8..];
        let next = u64::from_le_bytes(last.try_into().expect("8-byte entry"));
        if next % PAGE != 0 {
            return Err(PrpError::OffsetInvalid { field: 32 });
        }
        list_addr = next;
    }
}

fn push(segments: &mut Vec<Segment>, addr: u64, len: u64) {
    if let Some(last) = segments.last_mut()
        && last.0.checked_add(last.1 as u64) == Some(addr)
        && last.1 as u64 + len <= u32::MAX as u64
    {
        last.1 += len as u32;
        return;
    }
    segments.push((addr, len as u32));
}

/// Copies `data` into the host buffer described by `segments` (controller to host).
pub(crate) fn copy_to_host(
    cache: &mut MapCache,
    segments: &[Segment],
    data: &[u8],
) -> Result<(), DmaError> {
    let mut done = 0usize;
    for &(addr, len) in segments {
        let len = len as usize;
        cache.write(addr, &data[done..done + len])?;
        done += len;
    }
    Ok(())
}

/// Copies the host buffer described by `segments` into `out` (host to controller).
pub(crate) fn copy_from_host(
    cache: &mut MapCache,
    segments: &[Segment],
    out: &mut [u8],
) -> Result<(), DmaError> {
    let mut done = 0usize;
    for &(addr, len) in segments {
        let len = len as usize;
        cache.read(addr, &mut out[done..done + len])?;
        done += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_memory::alloc_dma;
    use crate::memory::DeviceAddressMap;
    use std::sync::Arc;

    fn setup() -> (Arc<DeviceAddressMap>, MapCache) {
        let map = Arc::new(DeviceAddressMap::new());
        let cache = MapCache::new(map.clone());
        (map, cache)
    }

    #[test]
    fn single_and_two_pages() {
        let (map, mut cache) = setup();
        let buf = alloc_dma(&map, 3 * 4096).unwrap();
        let a = buf.device_address(0);
        let mut segs = Vec::new();
        let mut list = [0u8; 4096];
        walk(&mut cache, a + 512, 0, 512, &mut segs, &mut list).unwrap();
        assert_eq!(segs, vec![(a + 512, 512)]);
        // Crossing one page boundary: PRP2 is the second page (here not adjacent).
        walk(&mut cache, a + 3584, a + 8192, 1024, &mut segs, &mut list).unwrap();
        assert_eq!(segs, vec![(a + 3584, 512), (a + 8192, 512)]);
        // Adjacent pages merge.
        walk(&mut cache, a, a + 4096, 8192, &mut segs, &mut list).unwrap();
        assert_eq!(segs, vec![(a, 8192)]);
        assert!(matches!(
            walk(&mut cache, a + 2, 0, 4, &mut segs, &mut list),
            Err(PrpError::OffsetInvalid { field: 24 })
        ));
        assert!(matches!(
            walk(&mut cache, a, a + 4, 8192, &mut segs, &mut list),
            Err(PrpError::OffsetInvalid { field: 32 })
        ));
    }

    #[test]
    fn chained_lists() {
        let (map, mut cache) = setup();
        // Two list pages: the first list starts 16 bytes before its page end, so it holds two
        // slots: one data entry and the chain pointer.
        let lists = alloc_dma(&map, 2 * 4096).unwrap();
        let l0 = lists.device_address(4096 - 16);
        let l1 = lists.device_address(4096);
        let data_pages: Vec<u64> = (0..4).map(|i| 0x5000_0000_0000 + i * 0x10_000).collect();
        lists.write(4096 - 16, &data_pages[1].to_le_bytes());
        lists.write(4096 - 8, &l1.to_le_bytes());
        lists.write(4096, &data_pages[2].to_le_bytes());
        lists.write(4096 + 8, &data_pages[3].to_le_bytes());
        let mut segs = Vec::new();
        let mut list = [0u8; 4096];
        walk(
            &mut cache,
            data_pages[0],
            l0,
            4 * 4096,
            &mut segs,
            &mut list,
        )
        .unwrap();
        let expect: Vec<Segment> = data_pages.iter().map(|&p| (p, 4096)).collect();
        assert_eq!(segs, expect);
        // A misaligned chain pointer.
        lists.write(4096 - 8, &(l1 + 8).to_le_bytes());
        assert!(matches!(
            walk(
                &mut cache,
                data_pages[0],
                l0,
                4 * 4096,
                &mut segs,
                &mut list
            ),
            Err(PrpError::OffsetInvalid { .. })
        ));
        // A list in unmapped memory.
        assert!(matches!(
            walk(
                &mut cache,
                data_pages[0],
                0x8000,
                4 * 4096,
                &mut segs,
                &mut list
            ),
            Err(PrpError::Dma(DmaError::Unmapped { .. }))
        ));
        // A data entry with an offset.
        lists.write(4096 - 8, &l1.to_le_bytes());
        lists.write(4096 + 8, &(data_pages[3] + 512).to_le_bytes());
        assert!(matches!(
            walk(
                &mut cache,
                data_pages[0],
                l0,
                4 * 4096,
                &mut segs,
                &mut list
            ),
            Err(PrpError::OffsetInvalid { field: 32 })
        ));
    }
}
