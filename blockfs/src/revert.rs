//! Putting a mount's in-memory state back to what the medium holds after a change failed at
//! the device, so a failed put or rm leaves no trace in memory (no file listed that the medium
//! lacks, none hidden that it has). Beside `state.rs` rather than in it: it reads the medium
//! through `load`, which builds on `state`.

use crate::error::{Error, Result};
use crate::state::{Inner, State};

impl Inner {
    /// `r`, after putting the state back to what the medium holds if `r` is a device error: a
    /// change that failed at the device leaves no trace in memory (no file listed that the
    /// medium lacks, none hidden that it has). Every change not yet committed is dropped with
    /// it, as a remount would drop it.
    pub fn undo_on_device_error<T>(&self, st: &mut State, r: Result<T>) -> Result<T> {
        if matches!(r, Err(Error::Device { .. })) {
            self.revert_to_medium(st);
        }
        r
    }

    /// Replaces the state by the one the medium's last commit holds (read back from the
    /// device). Where that cannot be done safely (the superblock write of a commit was issued,
    /// so the medium may hold either generation; the medium does not read back as the
    /// generation this mount last committed; an extent table handed out names blocks the
    /// medium has free, which must not be reused while it lives), the file system is
    /// poisoned instead: it refuses changes until a remount.
    pub fn revert_to_medium(&self, st: &mut State) {
        if st.poisoned {
            return;
        }
        match self.committed_state(st.generation) {
            Ok(fresh) if !self.pins_in_free_space(&fresh) => *st = fresh,
            _ => st.poisoned = true,
        }
    }

    /// The state of generation `generation` as the medium holds it.
    fn committed_state(&self, generation: u64) -> Result<State> {
        let dev = self.dev.as_ref();
        let slots = crate::superblock::read_slots(dev)?;
        let sb = crate::superblock::pick_superblock(&slots)?;
        if sb.generation != generation || sb.uuid != self.geo.uuid {
            return Err(Error::Poisoned);
        }
        let raw = crate::load::read_raw(dev, &self.geo, &sb)?;
        crate::load::strict_state(&self.geo, &raw)
    }

    /// Whether a pinned extent table names a block that is free in `st`.
    fn pins_in_free_space(&self, st: &State) -> bool {
        let held = crate::pin::lock(&self.pins).runs();
        if held.is_empty() {
            return false;
        }
        let free = st.alloc.free_runs();
        held.iter().any(|&(bno, len)| {
            free.iter()
                .any(|f| bno < f.bno + f.len && f.bno < bno + len)
        })
    }
}
