//! Where one queue pair sits in an arena ([`PairLayout`]): the daemon lays pairs out with it
//! and clients check their grants against it. The order is the GPU queue protocol's (the
//! real-SSD transports' `QueueLayout` at 4 KiB alignment): the SQ, the CQ, two PRP list pages
//! per slot, then the slot buffers, each page-aligned, so a GPU client can build its queue
//! descriptors on served rings as they are.

use crate::msg::PAGE;

/// PRP list pages per slot (the GPU protocol keeps two; a CPU client uses the first).
pub const PRP_PAGES_PER_SLOT: u64 = 2;

/// Offsets of one pair's pieces from the pair's start, and its size (all whole pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairLayout {
    /// The SQ ring (`depth` × 64 bytes).
    pub sq: u64,
    /// The CQ ring (`depth` × 16 bytes).
    pub cq: u64,
    /// The PRP list pages, [`PRP_PAGES_PER_SLOT`] per slot.
    pub prp_lists: u64,
    /// The slot buffers, `slot_bytes` each.
    pub slots: u64,
    /// Bytes of the SQ ring, whole pages.
    pub sq_len: u64,
    /// Bytes of the CQ ring, whole pages.
    pub cq_len: u64,
    /// Bytes of the pair.
    pub len: u64,
}

impl PairLayout {
    /// The layout of a pair of `depth` entries with slot buffers of `slot_bytes` (whole
    /// pages; the messages' limits keep every product far from overflow).
    pub fn new(depth: u32, slot_bytes: u32) -> Self {
        let d = u64::from(depth);
        let sq_len = (d * 64).next_multiple_of(PAGE);
        let cq_len = (d * 16).next_multiple_of(PAGE);
        let sq = 0;
        let cq = sq + sq_len;
        let prp_lists = cq + cq_len;
        let slots = prp_lists + d * PRP_PAGES_PER_SLOT * PAGE;
        let len = (slots + d * u64::from(slot_bytes)).next_multiple_of(PAGE);
        Self {
            sq,
            cq,
            prp_lists,
            slots,
            sq_len,
            cq_len,
            len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pieces_follow_each_other_page_aligned() {
        // Depth 16, 8 KiB slots: SQ 1 KiB and CQ 256 B take a page each, 32 list pages.
        let l = PairLayout::new(16, 8192);
        assert_eq!(
            (l.sq, l.cq, l.prp_lists, l.slots),
            (0, 4096, 8192, 8192 + 32 * 4096)
        );
        assert_eq!(l.len, l.slots + 16 * 8192);
        // Depth 1024: SQ 64 KiB, CQ 16 KiB.
        let l = PairLayout::new(1024, 4096);
        assert_eq!(
            (l.sq_len, l.cq_len, l.cq, l.prp_lists),
            (65536, 16384, 65536, 81920)
        );
        assert!(
            [l.sq, l.cq, l.prp_lists, l.slots, l.len]
                .iter()
                .all(|o| o % PAGE == 0)
        );
    }
}
