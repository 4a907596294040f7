//! Virtual-to-physical translation through `/proc/self/pagemap`, for no-IOMMU mode, where the
//! device is handed physical addresses.
//!
//! Each host page has a 64-bit entry: bit 63 "present", bits 0-54 the page frame number. Since
//! Linux 4.2 the frame number reads as zero without CAP_SYS_ADMIN.
#![forbid(unsafe_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::Error;

const PRESENT: u64 = 1 << 63;
const PFN_MASK: u64 = (1 << 55) - 1;

/// Decodes one pagemap entry into a page frame number.
pub(crate) fn decode_entry(entry: u64, vaddr: usize) -> Result<u64, Error> {
    if entry & PRESENT == 0 {
        return Err(Error::PageNotPresent { vaddr });
    }
    match entry & PFN_MASK {
        0 => Err(Error::PagemapNeedsRoot),
        pfn => Ok(pfn),
    }
}

/// Opened `/proc/self/pagemap`.
#[derive(Debug)]
pub(crate) struct Pagemap {
    file: File,
    host_page: usize,
}

impl Pagemap {
    /// Opens the calling process's pagemap.
    pub(crate) fn open(host_page: usize) -> Result<Self, Error> {
        let file = File::open("/proc/self/pagemap").map_err(|source| Error::Pagemap { source })?;
        Ok(Self { file, host_page })
    }

    /// Physical address of each `page`-sized page of `vaddr..vaddr + len` (all resident and
    /// locked by the caller).
    pub(crate) fn translate(
        &self,
        vaddr: usize,
        len: usize,
        page: usize,
    ) -> Result<Vec<u64>, Error> {
        let hp = self.host_page;
        let first = vaddr / hp;
        let last = (vaddr + len - 1) / hp;
        let mut raw = vec![0u8; (last - first + 1) * 8];
        self.file
            .read_exact_at(&mut raw, (first * 8) as u64)
            .map_err(|source| Error::Pagemap { source })?;
        (0..len / page)
            .map(|i| {
                let va = vaddr + i * page;
                let idx = va / hp - first;
                let entry =
                    u64::from_ne_bytes(raw[idx * 8..idx * 8 + 8].try_into().expect("8 bytes"));
                let pfn = decode_entry(entry, va)?;
                Ok(pfn * hp as u64 + (va % hp) as u64)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_entries() {
        assert_eq!(decode_entry(PRESENT | 0x1234, 0).unwrap(), 0x1234);
        // Soft-dirty and exclusive bits (55, 56) are not part of the frame number.
        assert_eq!(
            decode_entry(PRESENT | (1 << 55) | (1 << 56) | 0x42, 0).unwrap(),
            0x42
        );
        assert!(matches!(
            decode_entry(0x1234, 0x7000),
            Err(Error::PageNotPresent { vaddr: 0x7000 })
        ));
        let e = decode_entry(PRESENT, 0).unwrap_err();
        assert!(matches!(e, Error::PagemapNeedsRoot));
        assert!(e.to_string().contains("needs root"));
    }

    #[test]
    fn translates_own_memory_or_reports_missing_privilege() {
        // Touch two pages so they are present, then translate them. As root the frames are real
        // and page-aligned; otherwise the kernel hides them and we must say that root is needed.
        let mut v = vec![1u8; 3 * 4096];
        let base = v.as_mut_ptr() as usize;
        let aligned = base.next_multiple_of(4096);
        let pm = Pagemap::open(4096).unwrap();
        match pm.translate(aligned, 2 * 4096, 4096) {
            Ok(addrs) => {
                assert_eq!(addrs.len(), 2);
                assert!(addrs.iter().all(|a| a % 4096 == 0 && *a != 0));
            }
            Err(e) => assert!(matches!(e, Error::PagemapNeedsRoot), "{e}"),
        }
        drop(v);
    }
}
