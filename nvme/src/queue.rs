//! Ring arithmetic for submission and completion queues (NVMe Base 2.0, section 3.3.1
//! "Memory-Based Transport Queue Model"): indices, wraparound and the completion phase tag.
//!
//! A queue of `depth` entries is full when `tail + 1 == head` (mod depth), so at most
//! `depth - 1` entries are outstanding.

#![forbid(unsafe_code)]

/// Producer side of a submission queue: where the next command goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SqRing {
    depth: u32,
    tail: u32,
}

impl SqRing {
    /// An empty ring of `depth` entries (at least 2).
    pub fn new(depth: u32) -> Self {
        assert!(depth >= 2, "queue depth must be at least 2");
        Self { depth, tail: 0 }
    }

    /// Number of entries.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Index the next entry is written to.
    pub fn tail(&self) -> u32 {
        self.tail
    }

    /// Claims the entry at the tail and advances it; returns the claimed index.
    pub fn push(&mut self) -> u32 {
        let slot = self.tail;
        self.tail = next(self.tail, self.depth);
        slot
    }

    /// Entries between `head` and the tail: those the controller has not fetched yet.
    pub fn occupied(&self, head: u32) -> u32 {
        (self.tail + self.depth - head % self.depth) % self.depth
    }
}

/// Consumer side of a completion queue: where the next completion appears and which phase tag
/// marks it as new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CqRing {
    depth: u32,
    head: u32,
    phase: bool,
}

impl CqRing {
    /// A ring of `depth` entries, freshly created: the controller's first pass writes phase 1
    /// (the host zeroes the memory, so phase 0 means "not yet written").
    pub fn new(depth: u32) -> Self {
        assert!(depth >= 2, "queue depth must be at least 2");
        Self {
            depth,
            head: 0,
            phase: true,
        }
    }

    /// Number of entries.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Index of the next completion to look at.
    pub fn head(&self) -> u32 {
        self.head
    }

    /// Phase tag a new entry at [`CqRing::head`] carries.
    pub fn phase(&self) -> bool {
        self.phase
    }

    /// Moves the head to `head` with phase tag `phase`: where a consumer that followed the
    /// ring itself (its head and phase in registers for a round of [`CqRing::pop`]'s
    /// arithmetic) leaves it.
    ///
    /// # Panics
    /// If `head` is not below the depth.
    #[inline]
    pub fn set_position(&mut self, head: u32, phase: bool) {
        if head >= self.depth {
            Self::bad_head(head, self.depth);
        }
        self.head = head;
        self.phase = phase;
    }

    #[cold]
    #[inline(never)]
    fn bad_head(head: u32, depth: u32) -> ! {
        panic!("head {head} of {depth}")
    }

    /// Consumes the entry at the head; the phase flips when the head wraps.
    pub fn pop(&mut self) {
        self.head = next(self.head, self.depth);
        if self.head == 0 {
            self.phase = !self.phase;
        }
    }
}

fn next(index: u32, depth: u32) -> u32 {
    if index + 1 == depth { 0 } else { index + 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sq_wraps() {
        let mut sq = SqRing::new(4);
        assert_eq!([sq.push(), sq.push(), sq.push()], [0, 1, 2]);
        assert_eq!(sq.occupied(0), 3);
        assert_eq!(sq.push(), 3);
        assert_eq!(sq.tail(), 0);
        assert_eq!(sq.occupied(1), 3);
        assert_eq!(sq.push(), 0);
        assert_eq!(sq.occupied(1), 0);
        assert_eq!(sq.occupied(2), 3);
    }

    #[test]
    fn cq_phase_flips_on_wrap() {
        let mut cq = CqRing::new(3);
        assert_eq!((cq.head(), cq.phase()), (0, true));
        cq.pop();
        cq.pop();
        assert_eq!((cq.head(), cq.phase()), (2, true));
        cq.pop();
        assert_eq!((cq.head(), cq.phase()), (0, false));
        for _ in 0..3 {
            cq.pop();
        }
        assert_eq!((cq.head(), cq.phase()), (0, true));
    }

    #[test]
    #[should_panic(expected = "at least 2")]
    fn depth_one_rejected() {
        SqRing::new(1);
    }
}
