//! Free-space allocator: free runs by address, plus runs freed by recent commits that wait two
//! commits before they may be reused (FORMAT.md, "Commit protocol").
//!
//! Policy, chosen to keep files in few large extents: data goes first to the run right after the
//! file's last extent (so growth stays contiguous), then to the smallest free run that holds the
//! whole request (best fit), and only when no single run is large enough to the largest runs
//! first. Metadata runs are contiguous and go to the lowest-addressed run that fits (first fit),
//! which keeps them packed near the start and away from the large runs files want.

use std::collections::BTreeMap;

use crate::format::{Extent, FreeExtent, PendingExtent};

/// Free and pending runs of one file system.
#[derive(Clone, Debug, Default)]
pub(crate) struct Allocator {
    free: BTreeMap<u64, u64>,
    free_blocks: u64,
    pending: Vec<PendingExtent>,
    pending_blocks: u64,
}

impl Allocator {
    /// Blocks free now.
    pub fn free_blocks(&self) -> u64 {
        self.free_blocks
    }

    /// Blocks waiting to become free.
    pub fn pending_blocks(&self) -> u64 {
        self.pending_blocks
    }

    /// Free runs in address order.
    pub fn free_runs(&self) -> Vec<FreeExtent> {
        self.free
            .iter()
            .map(|(&bno, &len)| FreeExtent { bno, len })
            .collect()
    }

    /// Number of free runs.
    pub fn free_run_count(&self) -> usize {
        self.free.len()
    }

    /// Pending runs.
    pub fn pending_runs(&self) -> &[PendingExtent] {
        &self.pending
    }

    /// Adds `bno..bno+len` to the free runs, merging with neighbours. The caller guarantees it
    /// overlaps nothing free.
    pub fn insert_free(&mut self, bno: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (mut start, mut total) = (bno, len);
        if let Some((&ps, &pl)) = self.free.range(..bno).next_back() {
            debug_assert!(ps + pl <= bno, "free run {ps}+{pl} overlaps {bno}+{len}");
            if ps + pl == bno {
                self.free.remove(&ps);
                start = ps;
                total += pl;
            }
        }
        if let Some(nl) = self.free.remove(&(bno + len)) {
            total += nl;
        }
        debug_assert!(
            self.free.range(bno..bno + len).next().is_none(),
            "free run inside {bno}+{len}"
        );
        self.free.insert(start, total);
        self.free_blocks += len;
    }

    /// Removes `bno..bno+len`, which lies inside one free run.
    fn take(&mut self, bno: u64, len: u64) {
        let (&s, &l) = self
            .free
            .range(..=bno)
            .next_back()
            .expect("allocated from a free run");
        debug_assert!(bno + len <= s + l);
        self.free.remove(&s);
        if s < bno {
            self.free.insert(s, bno - s);
        }
        if bno + len < s + l {
            self.free.insert(bno + len, s + l - (bno + len));
        }
        self.free_blocks -= len;
    }

    /// A contiguous run of `n` blocks at the lowest address that has one (metadata).
    pub fn alloc_contiguous(&mut self, n: u64) -> Option<u64> {
        let bno = self.free.iter().find(|(_, l)| **l >= n).map(|(&s, _)| s)?;
        self.take(bno, n);
        Some(bno)
    }

    /// `n` blocks for file data, as few runs as the free space allows, starting at `goal` if a
    /// free run starts there. `None` (and nothing taken) if fewer than `n` blocks are free.
    pub fn alloc_data(&mut self, n: u64, goal: Option<u64>) -> Option<Vec<Extent>> {
        if n > self.free_blocks {
            return None;
        }
        let mut out: Vec<Extent> = Vec::new();
        let mut need = n;
        if let Some(g) = goal
            && let Some(&len) = self.free.get(&g)
        {
            let k = len.min(need);
            self.take(g, k);
            out.push(Extent { bno: g, len: k });
            need -= k;
        }
        while need > 0 {
            let best = self
                .free
                .iter()
                .filter(|(_, l)| **l >= need)
                .min_by_key(|(s, l)| (**l, **s))
                .map(|(&s, _)| (s, need));
            let (s, k) = best.unwrap_or_else(|| {
                let (&s, &l) = self
                    .free
                    .iter()
                    .max_by_key(|(s, l)| (**l, std::cmp::Reverse(**s)))
                    .expect("free_blocks >= need implies a free run");
                (s, l)
            });
            self.take(s, k);
            match out.last_mut() {
                Some(last) if last.bno + last.len == s => last.len += k,
                _ => out.push(Extent { bno: s, len: k }),
            }
            need -= k;
        }
        Some(out)
    }

    /// Records `bno..bno+len` as freed by the commit of generation `freed_gen`.
    pub fn free_later(&mut self, bno: u64, len: u64, freed_gen: u64) {
        if len == 0 {
            return;
        }
        self.pending_blocks += len;
        if let Some(last) = self.pending.last_mut()
            && last.freed_gen == freed_gen
            && last.bno + last.len == bno
        {
            last.len += len;
            return;
        }
        self.pending.push(PendingExtent {
            bno,
            len,
            freed_gen,
        });
    }

    /// Adds a pending run read from disk.
    pub fn insert_pending(&mut self, p: PendingExtent) {
        self.free_later(p.bno, p.len, p.freed_gen);
    }

    /// Makes every run freed by generation `up_to_gen` or earlier free, except the blocks in
    /// `held` (sorted, non-overlapping `(bno, len)` runs: pinned by extent tables), which stay
    /// pending with their old `freed_gen` until a later release finds them no longer held.
    pub fn release(&mut self, up_to_gen: u64, held: &[(u64, u64)]) {
        let pending = std::mem::take(&mut self.pending);
        for p in pending {
            if p.freed_gen > up_to_gen {
                self.pending.push(p);
                continue;
            }
            let end = p.bno + p.len;
            let mut pos = p.bno;
            let first = held.partition_point(|&(b, l)| b + l <= p.bno);
            for &(hb, hl) in held[first..].iter().take_while(|&&(b, _)| b < end) {
                let (hs, he) = (hb.max(pos), (hb + hl).min(end));
                if hs > pos {
                    self.pending_blocks -= hs - pos;
                    self.insert_free(pos, hs - pos);
                }
                self.pending.push(PendingExtent {
                    bno: hs,
                    len: he - hs,
                    freed_gen: p.freed_gen,
                });
                pos = he;
            }
            if pos < end {
                self.pending_blocks -= end - pos;
                self.insert_free(pos, end - pos);
            }
        }
    }

    /// Pending blocks inside `held` (sorted, non-overlapping runs).
    pub fn pending_within(&self, held: &[(u64, u64)]) -> u64 {
        self.pending
            .iter()
            .map(|p| {
                held.iter()
                    .map(|&(b, l)| (b + l).min(p.bno + p.len).saturating_sub(b.max(p.bno)))
                    .sum::<u64>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesces_and_prefers_goal_then_best_fit() {
        let mut a = Allocator::default();
        a.insert_free(10, 5);
        a.insert_free(20, 100);
        a.insert_free(15, 5); // joins 10..15 and 20..120
        assert_eq!(a.free_runs(), vec![FreeExtent { bno: 10, len: 110 }]);
        assert_eq!(a.alloc_contiguous(3), Some(10));
        let got = a.alloc_data(10, Some(13)).unwrap();
        assert_eq!(got, vec![Extent { bno: 13, len: 10 }]);
        // Make a small hole and check best fit picks it over the big run.
        a.free_later(13, 4, 5);
        a.release(5, &[]);
        assert_eq!(
            a.alloc_data(4, None).unwrap(),
            vec![Extent { bno: 13, len: 4 }]
        );
        assert_eq!(a.free_blocks(), 120 - 10 - 3 - 10 - 4 + 4);
    }

    #[test]
    fn splits_only_when_no_run_is_large_enough() {
        let mut a = Allocator::default();
        a.insert_free(0, 4);
        a.insert_free(10, 8);
        a.insert_free(30, 2);
        assert_eq!(a.alloc_data(15, None), None);
        assert_eq!(a.free_blocks(), 14);
        let got = a.alloc_data(11, None).unwrap();
        assert_eq!(
            got,
            vec![Extent { bno: 10, len: 8 }, Extent { bno: 0, len: 3 }]
        );
        assert_eq!(a.free_blocks(), 3);
        assert_eq!(a.alloc_contiguous(3), None);
    }

    #[test]
    fn pending_waits_for_release() {
        let mut a = Allocator::default();
        a.free_later(100, 10, 7);
        a.free_later(110, 5, 7);
        a.free_later(200, 1, 8);
        assert_eq!(a.pending_runs().len(), 2);
        assert_eq!(a.free_blocks(), 0);
        a.release(6, &[]);
        assert_eq!(a.free_blocks(), 0);
        a.release(7, &[]);
        assert_eq!(a.free_runs(), vec![FreeExtent { bno: 100, len: 15 }]);
        assert_eq!(a.pending_blocks(), 1);
    }
}

#[cfg(test)]
mod held_tests {
    use super::*;

    #[test]
    fn held_blocks_stay_pending_until_no_longer_held() {
        let mut a = Allocator::default();
        a.free_later(100, 20, 3);
        a.free_later(200, 5, 3);
        // Blocks 105..110 and 118..125 (past the first run's end) and all of the second run.
        let held = [(105, 5), (118, 7), (200, 5)];
        assert_eq!(a.pending_within(&held), 2 + 5 + 5);
        a.release(3, &held);
        assert_eq!(
            a.free_runs(),
            vec![
                FreeExtent { bno: 100, len: 5 },
                FreeExtent { bno: 110, len: 8 }
            ]
        );
        assert_eq!(a.pending_blocks(), 5 + 2 + 5);
        assert_eq!(a.pending_within(&held), 12);
        // Still held: nothing changes.
        a.release(9, &held);
        assert_eq!(a.pending_blocks(), 12);
        // Released: everything becomes free.
        a.release(9, &[]);
        assert_eq!(a.pending_blocks(), 0);
        assert_eq!(
            a.free_runs(),
            vec![
                FreeExtent { bno: 100, len: 20 },
                FreeExtent { bno: 200, len: 5 }
            ]
        );
    }
}
