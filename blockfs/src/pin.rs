//! Extent pinning: blocks named by an extent table that was handed out (to a GPU kernel, say)
//! are not reused while the table is held.
//!
//! Removing or truncating a file makes its blocks pending; two commits later they would
//! normally be free (FORMAT.md, "Allocation"). A kernel may still be reading them through a
//! table built before, so every table the library hands out carries a pin on the blocks it
//! names: at a commit, pending runs overlapping a pin stay pending (with their old
//! `freed_gen`) instead of becoming free, and become free at the first commit after the last
//! pin on them is released. Pins live in memory only: a remount starts with none, and the
//! pending runs they held become free at its first commit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::table::ExtentTable;

/// Block runs `(bno, len)` pinned by the tables handed out, by pin id; and the generations
/// held by readers elsewhere ([`GenerationHold`]).
#[derive(Debug, Default)]
pub(crate) struct Pins {
    next_id: u64,
    held: HashMap<u64, Vec<(u64, u64)>>,
    /// Generation held, by hold id.
    generations: HashMap<u64, u64>,
}

impl Pins {
    /// Pins `runs`; returns the pin's id.
    fn pin(&mut self, runs: Vec<(u64, u64)>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, runs);
        id
    }

    /// Releases pin `id`.
    fn unpin(&mut self, id: u64) {
        self.held.remove(&id);
    }

    /// Every pinned run, sorted by block and merged where runs overlap or touch.
    pub fn runs(&self) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = self.held.values().flatten().copied().collect();
        all.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(all.len());
        for (bno, len) in all {
            match out.last_mut() {
                Some((b, l)) if *b + *l >= bno => *l = (*l).max(bno + len - *b),
                _ => out.push((bno, len)),
            }
        }
        out
    }

    /// Number of pins held.
    pub fn count(&self) -> usize {
        self.held.len()
    }

    /// The oldest generation a [`GenerationHold`] holds, if any.
    pub fn oldest_generation(&self) -> Option<u64> {
        self.generations.values().copied().min()
    }
}

/// The pins of one mounted file system, shared with the guards that release them.
pub(crate) type SharedPins = Arc<Mutex<Pins>>;

/// Locks `pins` (a poisoned lock still holds valid pins: every change is one map operation).
pub(crate) fn lock(pins: &SharedPins) -> std::sync::MutexGuard<'_, Pins> {
    pins.lock().unwrap_or_else(|e| e.into_inner())
}

/// A pin on some blocks; released when dropped.
struct Pin {
    pins: SharedPins,
    id: u64,
}

impl Drop for Pin {
    fn drop(&mut self) {
        lock(&self.pins).unpin(self.id);
    }
}

/// A hold on a generation of the file system for a reader that does not share this mount (a
/// read-only mount of the same device in another process, say, fed by the holder): until it
/// is dropped, no block that generation's metadata or files use is given to anything else,
/// however many commits remove them here, so such a reader may go on reading what it mounted.
/// Blocks removed since stay pending (counted in [`crate::FsStats`]'s pending blocks) and
/// become free at the first commit after the last hold on an older generation went.
pub struct GenerationHold {
    pins: SharedPins,
    id: u64,
    generation: u64,
}

impl GenerationHold {
    pub(crate) fn new(pins: &SharedPins, generation: u64) -> Self {
        let mut p = lock(pins);
        let id = p.next_id;
        p.next_id += 1;
        p.generations.insert(id, generation);
        Self {
            pins: pins.clone(),
            id,
            generation,
        }
    }

    /// The generation held.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl Drop for GenerationHold {
    fn drop(&mut self) {
        lock(&self.pins).generations.remove(&self.id);
    }
}

impl std::fmt::Debug for GenerationHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerationHold")
            .field("generation", &self.generation)
            .finish()
    }
}

/// An [`ExtentTable`] that was handed out, with a pin on the blocks it names: until it is
/// dropped (or [`PinnedTable::release`]d), none of those blocks is given to another file or to
/// metadata, even if its file is removed or truncated and the removal committed. Release it
/// once every kernel reading or writing through the table has finished.
///
/// It dereferences to the table. A copy of the table (`ExtentTable::clone`, `as_bytes().to_vec()`)
/// carries no pin of its own: its blocks are protected only while this guard lives.
pub struct PinnedTable {
    table: ExtentTable,
    _pin: Pin,
}

impl PinnedTable {
    /// Pins `runs` (the blocks `table` names) in `pins`. The caller holds the state lock, so
    /// no commit frees the runs between building the table and pinning them.
    pub(crate) fn new(pins: &SharedPins, table: ExtentTable, runs: Vec<(u64, u64)>) -> Self {
        let id = lock(pins).pin(runs);
        Self {
            table,
            _pin: Pin {
                pins: pins.clone(),
                id,
            },
        }
    }

    /// The table.
    pub fn table(&self) -> &ExtentTable {
        &self.table
    }

    /// Releases the pin (the same as dropping the guard): the blocks may be reused from the
    /// next commit on if their file no longer owns them.
    pub fn release(self) {}
}

impl std::ops::Deref for PinnedTable {
    type Target = ExtentTable;

    fn deref(&self) -> &ExtentTable {
        &self.table
    }
}

impl std::fmt::Debug for PinnedTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedTable")
            .field("pin", &self._pin.id)
            .field("table", &self.table)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_pins_release_on_drop() {
        let shared: SharedPins = Arc::default();
        let empty = ExtentTable::build(512, 0, 8, &[]);
        let a = PinnedTable::new(&shared, empty.clone(), vec![(10, 5), (30, 2)]);
        let b = PinnedTable::new(&shared, empty.clone(), vec![(12, 10), (40, 1)]);
        assert_eq!(lock(&shared).runs(), vec![(10, 12), (30, 2), (40, 1)]);
        assert_eq!(lock(&shared).count(), 2);
        drop(a);
        assert_eq!(lock(&shared).runs(), vec![(12, 10), (40, 1)]);
        b.release();
        assert!(lock(&shared).runs().is_empty());
    }
}
