//! A file's extent list in memory, with prefix sums for O(log n) offset lookup.

use crate::format::Extent;

/// Extents of one file in file order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ExtentList {
    ext: Vec<Extent>,
    /// `ends[i]`: file block just past extent `i`.
    ends: Vec<u64>,
}

impl ExtentList {
    pub fn from_vec(v: Vec<Extent>) -> Self {
        let mut l = Self::default();
        for e in v {
            l.push(e);
        }
        l
    }

    /// Blocks allocated.
    pub fn blocks(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    pub fn as_slice(&self) -> &[Extent] {
        &self.ext
    }

    /// Appends a run, merging it into the last extent when contiguous on disk.
    pub fn push(&mut self, e: Extent) {
        if e.len == 0 {
            return;
        }
        let end = self.blocks() + e.len;
        match self.ext.last_mut() {
            Some(last) if last.bno + last.len == e.bno => {
                last.len += e.len;
                *self.ends.last_mut().expect("ends tracks ext") = end;
            }
            _ => {
                self.ext.push(e);
                self.ends.push(end);
            }
        }
    }

    /// Keeps the first `keep` blocks and returns the runs cut off.
    pub fn truncate(&mut self, keep: u64) -> Vec<Extent> {
        let mut freed = Vec::new();
        while let Some(last) = self.ext.last_mut() {
            let end = *self.ends.last().expect("ends tracks ext");
            let start = end - last.len;
            if start >= keep {
                freed.push(*last);
                self.ext.pop();
                self.ends.pop();
            } else {
                if end > keep {
                    let cut = end - keep;
                    last.len -= cut;
                    freed.push(Extent {
                        bno: last.bno + last.len,
                        len: cut,
                    });
                    *self.ends.last_mut().expect("ends tracks ext") = keep;
                }
                break;
            }
        }
        freed
    }

    /// Block just past the last extent on disk: where growth would stay contiguous.
    pub fn next_goal(&self) -> Option<u64> {
        self.ext.last().map(|e| e.bno + e.len)
    }

    /// Device runs `(first block, blocks)` holding file blocks `fb..fb+count` (all allocated).
    pub fn runs(&self, fb: u64, count: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut i = self.ends.partition_point(|&end| end <= fb);
        let mut pos = fb;
        let end = fb + count;
        std::iter::from_fn(move || {
            if pos >= end {
                return None;
            }
            let e = self.ext.get(i)?;
            let e_start = self.ends[i] - e.len;
            let off = pos - e_start;
            let n = (e.len - off).min(end - pos);
            let run = (e.bno + off, n);
            pos += n;
            i += 1;
            Some(run)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_maps_and_truncates() {
        let mut l = ExtentList::default();
        l.push(Extent { bno: 100, len: 4 });
        l.push(Extent { bno: 104, len: 2 }); // merges
        l.push(Extent { bno: 50, len: 3 });
        assert_eq!(l.as_slice().len(), 2);
        assert_eq!(l.blocks(), 9);
        assert_eq!(l.runs(5, 3).collect::<Vec<_>>(), vec![(105, 1), (50, 2)]);
        assert_eq!(l.runs(0, 9).collect::<Vec<_>>(), vec![(100, 6), (50, 3)]);
        assert_eq!(l.next_goal(), Some(53));
        let freed = l.truncate(4);
        assert_eq!(
            freed,
            vec![Extent { bno: 50, len: 3 }, Extent { bno: 104, len: 2 }]
        );
        assert_eq!(l.blocks(), 4);
        assert_eq!(l.truncate(0), vec![Extent { bno: 100, len: 4 }]);
        assert_eq!(l.blocks(), 0);
    }
}
