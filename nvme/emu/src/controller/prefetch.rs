//! The prefetch pre-pass: before executing a batch of I/O commands, a thread tells the memory
//! regions what the batch will read ([`crate::MemoryRegion::prefetch`]), so that a region
//! behind costly transfers (GPU memory) fetches it in a few transfers instead of one per
//! access:
//!
//! 1. the PRP list pages of the batch's Read and Write commands, one call per region (and one
//!    more round per level of chained list pages, whose addresses are only known once the page
//!    before is read);
//! 2. the data of the batch's Write commands, found by walking their PRPs (which now reads the
//!    list pages fetched in step 1).
//!
//! Only a hint: errors are ignored (the commands report them with the proper status when they
//! run), and commands whose fields are invalid are skipped. The controller's own host memory
//! takes no hints: while no region that takes them is mapped, the pass is skipped altogether;
//! otherwise a list or a write buffer that starts in host memory is skipped after one
//! translation.

use super::worker::Worker;
use crate::prp::PAGE;

impl Worker {
    /// Announces the reads of the first `n` commands of the fetch buffer.
    pub(super) fn prefetch_batch(&mut self, n: usize) {
        if !self.cache.any_hints() {
            return;
        }
        // 1. PRP list pages: the first page of every list, then its chain, level by level.
        self.pf_ranges.clear();
        self.pf_lists.clear();
        self.pf_writes.clear();
        for i in 0..n {
            let cmd = self.sqe(i);
            let Some((len, write)) = self.read_write_len(&cmd) else {
                continue;
            };
            if write && self.cache.takes_hints(cmd.prp1) {
                self.pf_writes.push((i, len));
            }
            let first = len.min(PAGE - cmd.prp1 % PAGE);
            let remaining = len - first;
            if remaining <= PAGE || cmd.prp2 & 7 != 0 || cmd.prp1 & 3 != 0 {
                // No list (PRP2 is data, or nothing), or an invalid one.
                continue;
            }
            if self.cache.takes_hints(cmd.prp2) {
                list_page_range(cmd.prp2, remaining, &mut self.pf_ranges, &mut self.pf_lists);
            }
        }
        while !self.pf_ranges.is_empty() {
            let _ = self.cache.prefetch(&self.pf_ranges);
            self.pf_ranges.clear();
            // Follow each chain to its next list page (the pointer in the last slot).
            let mut lists = std::mem::take(&mut self.pf_lists);
            self.pf_next.clear();
            for &(addr, remaining) in &lists {
                let slots = (PAGE - addr % PAGE) / 8;
                let mut next = [0u8; 8];
                if self.cache.read(addr + (slots - 1) * 8, &mut next).is_err() {
                    continue;
                }
                let next = u64::from_le_bytes(next);
                if next % PAGE != 0 || !self.cache.takes_hints(next) {
                    continue;
                }
                let remaining = remaining - (slots - 1) * PAGE;
                list_page_range(next, remaining, &mut self.pf_ranges, &mut self.pf_next);
            }
            lists.clear();
            std::mem::swap(&mut lists, &mut self.pf_next);
            self.pf_lists = lists;
        }
        if self.pf_writes.is_empty() {
            return;
        }

        // 2. The data of Write commands whose buffer starts in memory that takes hints.
        for k in 0..self.pf_writes.len() {
            let (i, len) = self.pf_writes[k];
            let cmd = self.sqe(i);
            if crate::prp::walk(
                &mut self.cache,
                cmd.prp1,
                cmd.prp2,
                len,
                &mut self.pf_segments,
                &mut self.list_page,
            )
            .is_err()
            {
                continue;
            }
            self.pf_ranges
                .extend(self.pf_segments.iter().map(|&(a, l)| (a, l as usize)));
        }
        if !self.pf_ranges.is_empty() {
            let _ = self.cache.prefetch(&self.pf_ranges);
        }
    }
}

/// Adds the entries of the PRP list page at `addr` that a transfer with `remaining` bytes
/// after PRP1 reads to `ranges`, and the page to `chained` (with `remaining`) if it ends with
/// a pointer to another list page.
fn list_page_range(
    addr: u64,
    remaining: u64,
    ranges: &mut Vec<(u64, usize)>,
    chained: &mut Vec<(u64, u64)>,
) {
    let slots = (PAGE - addr % PAGE) / 8;
    let pages = remaining.div_ceil(PAGE);
    ranges.push((addr, (pages.min(slots) * 8) as usize));
    if pages > slots {
        chained.push((addr, remaining));
    }
}
