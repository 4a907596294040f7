//! Ring arithmetic of one queue pair, as the host sees it: the submission queue's tail (ours)
//! and head (the controller's, learned from completions), the completion queue's head and
//! expected phase. Pure: no memory is touched here.

/// The host's view of a submission queue of `depth` entries: entries `head..tail` (modulo
/// `depth`) are the controller's, at most `depth - 1` of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SubmissionRing {
    depth: u32,
    tail: u32,
    head: u32,
}

impl SubmissionRing {
    /// An empty ring of `depth` entries (at least 2).
    pub(crate) const fn new(depth: u32) -> Self {
        Self {
            depth,
            tail: 0,
            head: 0,
        }
    }

    /// The index the next entry goes to.
    pub(crate) const fn tail(&self) -> u32 {
        self.tail
    }

    /// The tail after one more entry: the value the doorbell is rung with.
    pub(crate) const fn next_tail(&self) -> u32 {
        (self.tail + 1) % self.depth
    }

    /// Entries the controller has not fetched yet, as far as the host knows.
    pub(crate) const fn occupied(&self) -> u32 {
        (self.tail + self.depth - self.head) % self.depth
    }

    /// Whether another entry would make the tail meet the head.
    pub(crate) const fn is_full(&self) -> bool {
        self.occupied() == self.depth - 1
    }

    /// Moves the tail past one entry (written, and its doorbell rung); returns the entry's
    /// index.
    pub(crate) fn push(&mut self) -> u32 {
        let index = self.tail;
        self.tail = self.next_tail();
        index
    }

    /// Moves the head forward to `position` if that is between the head known so far and the
    /// tail; anything else is a position the head has already passed (or one it cannot
    /// reach), and leaves the ring unchanged. Returns whether it moved.
    fn forward_to(&mut self, position: u32) -> bool {
        let moved = (position + self.depth - self.head) % self.depth;
        if moved == 0 || moved > self.occupied() {
            return false;
        }
        self.head = position;
        true
    }

    /// The entry at `index` was fetched (its command completed): a controller fetches in
    /// order, so the head is past it, whatever the completion's SQ head field says.
    pub(crate) fn fetched(&mut self, index: u32) {
        self.forward_to((index + 1) % self.depth);
    }

    /// Takes the SQ Head Pointer of a completion. A head outside the ring is an error (the
    /// ring unchanged); one that is not a move forward, from the head known so far up to the
    /// tail, is stale (a completion built before a later one was posted) and ignored.
    pub(crate) fn advance_head(&mut self, sqhd: u16) -> Result<(), String> {
        let sqhd = u32::from(sqhd);
        if sqhd >= self.depth {
            return Err(format!(
                "SQ head {sqhd} is outside a submission queue of {} entries",
                self.depth
            ));
        }
        self.forward_to(sqhd);
        Ok(())
    }
}

/// The host's view of a completion queue of `depth` entries: the next entry to look at and
/// the phase tag that marks it new (1 on the first pass, flipped at every wrap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CompletionRing {
    depth: u32,
    head: u32,
    phase: bool,
}

impl CompletionRing {
    /// A ring of `depth` entries the controller has not written yet (zeroed: phase 0).
    pub(crate) const fn new(depth: u32) -> Self {
        Self {
            depth,
            head: 0,
            phase: true,
        }
    }

    /// The entry looked at next: the value the CQ head doorbell is rung with.
    pub(crate) const fn head(&self) -> u32 {
        self.head
    }

    /// The phase tag of a new entry at [`CompletionRing::head`].
    pub(crate) const fn phase(&self) -> bool {
        self.phase
    }

    /// Moves past one consumed entry, flipping the expected phase at the wrap.
    pub(crate) fn advance(&mut self) {
        self.head += 1;
        if self.head == self.depth {
            self.head = 0;
            self.phase = !self.phase;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_submission_ring_holds_depth_minus_one_and_wraps() {
        let mut sq = SubmissionRing::new(4);
        for i in 0..3 {
            assert!(!sq.is_full());
            assert_eq!(sq.tail(), i);
            sq.push();
        }
        assert!(sq.is_full());
        assert_eq!(sq.next_tail(), 0);
        // The controller fetched two: room for two more, and the tail wraps to 1.
        sq.advance_head(2).unwrap();
        assert_eq!(sq.occupied(), 1);
        sq.push();
        sq.push();
        assert_eq!(sq.tail(), 1);
        assert!(sq.is_full());
        // The head wraps too.
        sq.advance_head(0).unwrap();
        assert_eq!(sq.occupied(), 1);
        sq.advance_head(1).unwrap();
        assert_eq!(sq.occupied(), 0);
        // Many times around.
        for n in 0..1000u32 {
            sq.push();
            sq.advance_head(sq.tail() as u16).unwrap();
            assert_eq!(sq.tail(), (2 + n) % 4);
        }
    }

    #[test]
    fn a_head_outside_the_ring_is_refused_and_a_stale_one_ignored() {
        let mut sq = SubmissionRing::new(8);
        sq.push();
        sq.push();
        let before = sq;
        assert!(sq.advance_head(8).unwrap_err().contains("outside"));
        assert!(sq.advance_head(u16::MAX).is_err());
        assert_eq!(sq, before);
        // Past the tail (or behind the head: the same positions, modulo the depth): ignored.
        sq.advance_head(3).unwrap();
        sq.advance_head(7).unwrap();
        assert_eq!(sq, before);
        // Standing still, then forward.
        sq.advance_head(0).unwrap();
        sq.advance_head(2).unwrap();
        assert_eq!(sq.occupied(), 0);
        // Backwards (a stale head after a newer one): ignored.
        sq.advance_head(1).unwrap();
        assert_eq!(sq.occupied(), 0);
        // The largest depth: every u16 head is inside it.
        let mut big = SubmissionRing::new(65536);
        big.push();
        big.advance_head(1).unwrap();
        big.advance_head(u16::MAX).unwrap();
        assert_eq!(big.occupied(), 0);
    }

    #[test]
    fn a_completed_entry_frees_everything_before_it() {
        let mut sq = SubmissionRing::new(4);
        let (a, b, c) = (sq.push(), sq.push(), sq.push());
        assert_eq!((a, b, c), (0, 1, 2));
        assert!(sq.is_full());
        // The controller completed the second one and said nothing useful in SQHD.
        sq.advance_head(0).unwrap();
        sq.fetched(b);
        assert_eq!(sq.occupied(), 1);
        // The first one completing later changes nothing: the head is past it.
        sq.fetched(a);
        assert_eq!(sq.occupied(), 1);
        sq.fetched(c);
        assert_eq!(sq.occupied(), 0);
        // Around the wrap.
        for _ in 0..10 {
            let i = sq.push();
            sq.fetched(i);
            assert_eq!(sq.occupied(), 0);
        }
    }

    #[test]
    fn the_completion_phase_flips_at_every_wrap() {
        let mut cq = CompletionRing::new(3);
        assert_eq!((cq.head(), cq.phase()), (0, true));
        let mut seen = Vec::new();
        for _ in 0..9 {
            seen.push((cq.head(), cq.phase()));
            cq.advance();
        }
        assert_eq!(
            seen,
            [
                (0, true),
                (1, true),
                (2, true),
                (0, false),
                (1, false),
                (2, false),
                (0, true),
                (1, true),
                (2, true)
            ]
        );
        let mut two = CompletionRing::new(2);
        two.advance();
        two.advance();
        assert_eq!((two.head(), two.phase()), (0, false));
    }
}
