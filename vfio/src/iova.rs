//! IOVA space allocation inside the ranges the IOMMU accepts.
//!
//! A free list of disjoint ranges, coalesced on free. Allocation is next-fit: it continues after
//! the previous allocation and wraps around, so a freed IOVA range is handed out again as late as
//! possible. A device that writes through a stale IOVA after its buffer was unmapped then hits an
//! IOMMU fault instead of someone else's new buffer.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

/// Allocator of aligned IOVA ranges.
#[derive(Clone, Debug)]
pub struct IovaAllocator {
    /// Free ranges: start -> end (exclusive). Disjoint and never adjacent (coalesced).
    free: BTreeMap<u64, u64>,
    /// Where the next search starts.
    cursor: u64,
}

impl IovaAllocator {
    /// Creates an allocator over the inclusive `ranges`, leaving out everything below `floor`
    /// (so IOVA 0, which reads like "no address" in a PRP entry, is never handed out).
    pub fn new(ranges: &[(u64, u64)], floor: u64) -> Self {
        let mut a = Self {
            free: BTreeMap::new(),
            cursor: 0,
        };
        for &(start, end_incl) in ranges {
            let start = start.max(floor);
            // Exclusive end; the very last byte of the 64-bit space is given up to avoid overflow.
            let end = end_incl.saturating_add(1);
            if start < end {
                a.insert(start, end);
            }
        }
        a
    }

    /// Total free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.free.iter().map(|(s, e)| e - s).sum()
    }

    /// Number of disjoint free ranges (for tests of coalescing).
    pub fn free_ranges(&self) -> usize {
        self.free.len()
    }

    /// Allocates `len` bytes aligned to `align` (a power of two). `None` if no free range fits.
    pub fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        assert!(len > 0, "empty IOVA allocation");
        assert!(
            align.is_power_of_two(),
            "alignment {align} is not a power of two"
        );
        let fits = |start: u64, end: u64, from: u64| -> Option<u64> {
            let base = start.max(from).checked_next_multiple_of(align)?;
            (base.checked_add(len)? <= end).then_some(base)
        };
        // First the ranges at or after the cursor (including one that straddles it), then from
        // the bottom: next-fit with wrap-around.
        let straddling = self
            .free
            .range(..=self.cursor)
            .next_back()
            .map(|(&s, &e)| (s, e));
        let candidates = straddling
            .into_iter()
            .chain(
                self.free
                    .range(self.cursor.saturating_add(1)..)
                    .map(|(&s, &e)| (s, e)),
            )
            .map(|(s, e)| (s, e, self.cursor))
            .chain(self.free.iter().map(|(&s, &e)| (s, e, 0)));
        let mut found = None;
        for (s, e, from) in candidates {
            if let Some(base) = fits(s, e, from) {
                found = Some((s, e, base));
                break;
            }
        }
        let (s, e, base) = found?;
        self.free.remove(&s);
        if s < base {
            self.free.insert(s, base);
        }
        if base + len < e {
            self.free.insert(base + len, e);
        }
        self.cursor = base + len;
        Some(base)
    }

    /// Returns `[iova, iova + len)` to the free list.
    ///
    /// # Panics
    /// If the range overlaps free space (a double free: a bug in this crate's bookkeeping).
    pub fn free(&mut self, iova: u64, len: u64) {
        assert!(len > 0, "empty IOVA free");
        self.insert(iova, iova.checked_add(len).expect("IOVA range overflows"));
    }

    fn insert(&mut self, mut start: u64, mut end: u64) {
        if let Some((&ps, &pe)) = self.free.range(..=start).next_back() {
            assert!(pe <= start, "IOVA range 0x{start:x} freed twice");
            if pe == start {
                self.free.remove(&ps);
                start = ps;
            }
        }
        if let Some((&ns, &ne)) = self.free.range(start..).next() {
            assert!(
                ns >= end,
                "IOVA range 0x{start:x}..0x{end:x} overlaps free space"
            );
            if ns == end {
                self.free.remove(&ns);
                end = ne;
            }
        }
        self.free.insert(start, end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M2: u64 = 2 << 20;

    #[test]
    fn allocations_stay_inside_ranges_and_are_aligned() {
        // The QEMU VT-d ranges, with the MSI window 0xfee00000..0xfeefffff cut out.
        let ranges = [(0, 0xfedf_ffff), (0xfef0_0000, 0x7f_ffff_ffff)];
        let mut a = IovaAllocator::new(&ranges, M2);
        let mut got = Vec::new();
        for _ in 0..4 {
            let iova = a.alloc(M2, M2).unwrap();
            assert_eq!(iova % M2, 0);
            assert!(iova >= M2);
            got.push(iova);
        }
        assert_eq!(got, vec![M2, 2 * M2, 3 * M2, 4 * M2]);
        // Nothing ever lands in the hole.
        let mut b = IovaAllocator::new(&ranges, 0xfec0_0000);
        let first = b.alloc(M2, M2).unwrap();
        let second = b.alloc(M2, M2).unwrap();
        assert_eq!(first, 0xfec0_0000);
        assert!(second >= 0xfef0_0000, "0x{second:x} is in the MSI window");
        assert_eq!(second % M2, 0);
    }

    #[test]
    fn next_fit_delays_reuse_then_wraps() {
        let mut a = IovaAllocator::new(&[(0, 4 * M2 - 1)], 0);
        let x = a.alloc(M2, M2).unwrap();
        a.free(x, M2);
        let y = a.alloc(M2, M2).unwrap();
        assert_ne!(x, y, "freed range reused immediately");
        let z = a.alloc(2 * M2, M2).unwrap();
        assert_eq!(z, 2 * M2);
        // The top is used up: the search wraps to the bottom, where `x` was freed.
        let w = a.alloc(M2, M2).unwrap();
        assert_eq!(w, x);
        assert_eq!(a.alloc(4096, 4096), None, "space exhausted");
    }

    #[test]
    fn frees_coalesce() {
        let mut a = IovaAllocator::new(&[(0, 16 * M2 - 1)], 0);
        let blocks: Vec<u64> = (0..16).map(|_| a.alloc(M2, M2).unwrap()).collect();
        assert_eq!(a.free_bytes(), 0);
        // Free in an interleaved order; the result must be one range again.
        for i in (0..16).step_by(2).chain((1..16).step_by(2)) {
            a.free(blocks[i], M2);
        }
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.free_bytes(), 16 * M2);
        assert_eq!(
            a.alloc(16 * M2, M2),
            Some(0),
            "coalesced range serves a whole-space request"
        );
    }

    #[test]
    fn unaligned_range_starts_are_rounded_up() {
        let mut a = IovaAllocator::new(&[(0x1234, 0x80_0000)], 0);
        assert_eq!(a.alloc(M2, M2), Some(M2));
        assert_eq!(a.alloc(4096, 4096), Some(2 * M2));
        // The head 0x1234..M2 was kept free.
        assert_eq!(a.free_bytes(), 0x80_0001 - 0x1234 - M2 - 4096);
    }

    #[test]
    fn range_ending_at_top_of_address_space() {
        let mut a = IovaAllocator::new(&[(u64::MAX - 4 * M2 + 1, u64::MAX)], 0);
        let x = a.alloc(M2, M2).unwrap();
        assert_eq!(x, u64::MAX - 4 * M2 + 1);
        assert!(a.alloc(4 * M2, M2).is_none());
    }

    #[test]
    #[should_panic(expected = "freed twice")]
    fn double_free_is_caught() {
        let mut a = IovaAllocator::new(&[(0, 4 * M2 - 1)], 0);
        let x = a.alloc(M2, M2).unwrap();
        a.free(x, M2);
        a.free(x, M2);
    }
}
