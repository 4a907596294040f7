//! Physical Region Page (PRP) construction (NVMe Base 2.0, section 4.1.1 "Physical Region Page
//! Entry and List").
//!
//! Pure: given the device addresses of the 4 KiB pages a transfer touches, it computes PRP1,
//! PRP2 and the entries of a single PRP list page. The driver caps each command at
//! [`MAX_PRP_TRANSFER`] or less so that one list page (512 entries) always suffices and lists are
//! never chained.

#![forbid(unsafe_code)]

/// Memory page size the driver selects (CC.MPS = 0): PRP entries address 4 KiB pages.
pub const PRP_PAGE_SIZE: usize = 4096;
/// Entries in one PRP list page.
pub const PRP_ENTRIES_PER_LIST: usize = PRP_PAGE_SIZE / 8;
/// The most bytes one command may move when its buffer is page-aligned and one PRP list page
/// is used: PRP1 plus 512 list entries is 513 pages, so any 2 MiB transfer fits at any offset.
pub const MAX_PRP_TRANSFER: usize = 2 * 1024 * 1024;

/// The data pointer of one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prp {
    /// PRP Entry 1: device address of the first byte (may carry a dword-aligned page offset).
    pub prp1: u64,
    /// PRP Entry 2: 0 (unused), the second page, or the device address of the PRP list.
    pub prp2: u64,
    /// Number of entries written to the PRP list (0 when no list is used).
    pub list_entries: usize,
}

/// Why a buffer cannot be described by PRPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrpError {
    /// The transfer is empty.
    #[error("empty transfer")]
    Empty,
    /// The first byte is not dword aligned (PRP1's offset must be a multiple of 4).
    #[error("buffer offset {offset:#x} within its page is not dword aligned")]
    Unaligned {
        /// Offset within the first page.
        offset: usize,
    },
    /// The number of page addresses supplied does not match the pages the transfer spans.
    #[error("transfer spans {needed} pages but {given} page addresses were given")]
    PageCount {
        /// Pages the transfer spans.
        needed: usize,
        /// Page addresses supplied.
        given: usize,
    },
    /// A page address is not 4 KiB aligned.
    #[error("page address {address:#x} (page {index}) is not 4 KiB aligned")]
    PageNotAligned {
        /// Index of the page in the transfer.
        index: usize,
        /// The address.
        address: u64,
    },
    /// The transfer needs more list entries than one PRP list page holds.
    #[error("transfer spans {pages} pages; at most {} fit one PRP list", PRP_ENTRIES_PER_LIST + 1)]
    TooLarge {
        /// Pages the transfer spans.
        pages: usize,
    },
}

/// Number of pages a transfer of `len` bytes starting `first_offset` bytes into a page touches.
pub const fn pages_spanned(first_offset: usize, len: usize) -> usize {
    if len == 0 {
        0
    } else {
        (first_offset % PRP_PAGE_SIZE + len).div_ceil(PRP_PAGE_SIZE)
    }
}

/// Builds the PRPs for a transfer of `len` bytes that starts `first_offset` bytes into
/// `pages[0]` and continues through `pages[1..]` (each a 4 KiB-aligned device address).
///
/// When a list is needed, `write_entry(i, address)` is called for each list entry `i` and
/// `list_address` (the device address of the list page, 4 KiB aligned) becomes PRP2.
pub fn build_prp(
    pages: &[u64],
    first_offset: usize,
    len: usize,
    list_address: u64,
    mut write_entry: impl FnMut(usize, u64),
) -> Result<Prp, PrpError> {
    if len == 0 {
        return Err(PrpError::Empty);
    }
    if first_offset % 4 != 0 || first_offset >= PRP_PAGE_SIZE {
        return Err(PrpError::Unaligned {
            offset: first_offset,
        });
    }
    let needed = pages_spanned(first_offset, len);
    if pages.len() != needed {
        return Err(PrpError::PageCount {
            needed,
            given: pages.len(),
        });
    }
    if needed > PRP_ENTRIES_PER_LIST + 1 {
        return Err(PrpError::TooLarge { pages: needed });
    }
    if let Some((index, &address)) = pages
        .iter()
        .enumerate()
        .find(|(_, a)| **a % PRP_PAGE_SIZE as u64 != 0)
    {
        return Err(PrpError::PageNotAligned { index, address });
    }
    let prp1 = pages[0] + first_offset as u64;
    Ok(match needed {
        1 => Prp {
            prp1,
            prp2: 0,
            list_entries: 0,
        },
        2 => Prp {
            prp1,
            prp2: pages[1],
            list_entries: 0,
        },
        _ => {
            assert_eq!(
                list_address % PRP_PAGE_SIZE as u64,
                0,
                "PRP list page must be aligned"
            );
            for (i, &page) in pages[1..].iter().enumerate() {
                write_entry(i, page);
            }
            Prp {
                prp1,
                prp2: list_address,
                list_entries: needed - 1,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIST: u64 = 0x7777_0000;

    fn pages(first: u64, n: usize) -> Vec<u64> {
        // Deliberately discontiguous: each page 3 pages after the previous one.
        (0..n as u64)
            .map(|i| first + i * 3 * PRP_PAGE_SIZE as u64)
            .collect()
    }

    fn run(pages: &[u64], off: usize, len: usize) -> Result<(Prp, Vec<u64>), PrpError> {
        let mut list = vec![0u64; PRP_ENTRIES_PER_LIST];
        let mut written = 0;
        let prp = build_prp(pages, off, len, LIST, |i, a| {
            list[i] = a;
            written = written.max(i + 1);
        })?;
        list.truncate(written);
        Ok((prp, list))
    }

    #[test]
    fn spans() {
        assert_eq!(pages_spanned(0, 0), 0);
        assert_eq!(pages_spanned(0, 1), 1);
        assert_eq!(pages_spanned(0, 4096), 1);
        assert_eq!(pages_spanned(0, 4097), 2);
        assert_eq!(pages_spanned(4092, 4), 1);
        assert_eq!(pages_spanned(4092, 8), 2);
        assert_eq!(pages_spanned(512, 2 * 1024 * 1024), 513);
    }

    #[test]
    fn prp1_only() {
        let p = pages(0x10_0000, 1);
        let (prp, list) = run(&p, 0, 512).unwrap();
        assert_eq!(
            prp,
            Prp {
                prp1: 0x10_0000,
                prp2: 0,
                list_entries: 0
            }
        );
        assert!(list.is_empty());
        // Exactly one page.
        let (prp, _) = run(&p, 0, 4096).unwrap();
        assert_eq!(prp.prp2, 0);
        // Offset, still inside the page.
        let (prp, _) = run(&p, 0x200, 0xe00).unwrap();
        assert_eq!(
            prp,
            Prp {
                prp1: 0x10_0200,
                prp2: 0,
                list_entries: 0
            }
        );
    }

    #[test]
    fn prp2_second_page() {
        let p = pages(0x10_0000, 2);
        let (prp, list) = run(&p, 0, 8192).unwrap();
        assert_eq!(
            prp,
            Prp {
                prp1: 0x10_0000,
                prp2: p[1],
                list_entries: 0
            }
        );
        assert!(list.is_empty());
        // An offset pushes a 4 KiB transfer into a second page.
        let (prp, _) = run(&p, 4, 4096).unwrap();
        assert_eq!(
            prp,
            Prp {
                prp1: 0x10_0004,
                prp2: p[1],
                list_entries: 0
            }
        );
    }

    #[test]
    fn list() {
        let p = pages(0x20_0000, 3);
        let (prp, list) = run(&p, 0, 3 * 4096).unwrap();
        assert_eq!(
            prp,
            Prp {
                prp1: p[0],
                prp2: LIST,
                list_entries: 2
            }
        );
        assert_eq!(list, &p[1..]);
        // Offset + 8 KiB spans three pages.
        let (prp, list) = run(&p, 0x800, 8192).unwrap();
        assert_eq!(
            prp,
            Prp {
                prp1: p[0] + 0x800,
                prp2: LIST,
                list_entries: 2
            }
        );
        assert_eq!(list, &p[1..]);
    }

    #[test]
    fn two_mib() {
        let p = pages(0x4000_0000, 512);
        let (prp, list) = run(&p, 0, MAX_PRP_TRANSFER).unwrap();
        assert_eq!(prp.list_entries, 511);
        assert_eq!(list, &p[1..]);
        // At an offset, 2 MiB spans 513 pages: exactly a full list.
        let p = pages(0x4000_0000, 513);
        let (prp, list) = run(&p, 12, MAX_PRP_TRANSFER).unwrap();
        assert_eq!(prp.prp1, p[0] + 12);
        assert_eq!(prp.list_entries, 512);
        assert_eq!(list, &p[1..]);
        // One page more does not fit.
        let p = pages(0x4000_0000, 514);
        assert_eq!(
            run(&p, 0, 514 * 4096).unwrap_err(),
            PrpError::TooLarge { pages: 514 }
        );
    }

    #[test]
    fn errors() {
        let p = pages(0x10_0000, 2);
        assert_eq!(
            run(&p, 2, 4096).unwrap_err(),
            PrpError::Unaligned { offset: 2 }
        );
        assert_eq!(run(&p[..1], 0, 0).unwrap_err(), PrpError::Empty);
        assert_eq!(
            run(&p, 0, 4096).unwrap_err(),
            PrpError::PageCount {
                needed: 1,
                given: 2
            }
        );
        assert_eq!(
            run(&[0x1000, 0x2200], 0, 8192).unwrap_err(),
            PrpError::PageNotAligned {
                index: 1,
                address: 0x2200
            }
        );
    }
}
