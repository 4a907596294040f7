//! Queue state on the controller side: ring arithmetic for submission and completion queues.
//!
//! The controller keeps its own copy of every pointer; doorbell values are only taken in after
//! validation, and queue memory is reached through the device-address map.

use std::collections::VecDeque;
use std::sync::Arc;

use nvme_spec::Completion;

use crate::doorbells::DoorbellWord;

/// A submission queue as the controller tracks it.
pub(crate) struct SubQueue {
    /// Device address of entry 0.
    pub(crate) base: u64,
    /// Number of entries (2..=65536).
    pub(crate) entries: u32,
    /// Next entry the controller will fetch.
    pub(crate) head: u32,
    /// Completion queue this queue posts to.
    pub(crate) cqid: u16,
    /// The external tail doorbell, if the queue was created with one (else the tail is read
    /// from the register window, which validates it as it is written).
    pub(crate) doorbell: Option<Arc<dyn DoorbellWord>>,
    /// The tail as last validly reported.
    pub(crate) tail: u32,
    /// The last raw tail doorbell value looked at (valid or not), so that an invalid value is
    /// reported once.
    pub(crate) seen_doorbell: u32,
    /// The controller thread's translation-cache entry for the ring (a hint, checked on use:
    /// see `MapCache::translate_at`).
    pub(crate) map_hint: usize,
}

impl SubQueue {
    /// A queue of `entries` entries at `base`, posting to `cqid`, with an optional external
    /// tail doorbell.
    pub(crate) fn new(
        base: u64,
        entries: u32,
        cqid: u16,
        doorbell: Option<Arc<dyn DoorbellWord>>,
    ) -> Self {
        Self {
            base,
            entries,
            head: 0,
            cqid,
            doorbell,
            tail: 0,
            seen_doorbell: 0,
            map_hint: 0,
        }
    }

    /// Entries the host has submitted (tail doorbell `tail`) that are not yet fetched.
    pub(crate) fn pending(&self, tail: u32) -> u32 {
        (tail + self.entries - self.head) % self.entries
    }

    /// Advances the head past `n` fetched entries.
    pub(crate) fn advance(&mut self, n: u32) {
        self.head = (self.head + n) % self.entries;
    }
}

/// A completion waiting to be posted: everything but the SQ head and the phase tag, which are
/// filled in when it is written.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PendingCompletion {
    pub(crate) sqid: u16,
    pub(crate) cid: u16,
    pub(crate) dw0: u32,
    /// The status field without the phase tag.
    pub(crate) status: u16,
}

/// A completion queue as the controller tracks it.
pub(crate) struct CompQueue {
    /// Device address of entry 0.
    pub(crate) base: u64,
    /// Number of entries (2..=65536).
    pub(crate) entries: u32,
    /// Next entry the controller will write.
    pub(crate) tail: u32,
    /// Head as last validly reported by the host's doorbell.
    pub(crate) head: u32,
    /// Last raw head doorbell value looked at (valid or not), so an invalid value is reported
    /// once.
    pub(crate) seen_doorbell: u32,
    /// Phase tag of the entries being written in the current pass through the ring.
    pub(crate) phase: bool,
    /// Completions waiting because the queue was full, oldest first.
    pub(crate) held: VecDeque<PendingCompletion>,
    /// Commands fetched for this queue whose completion is neither posted nor held (executing
    /// or delayed). The controller fetches no more than the queue can take.
    pub(crate) owed: u32,
    /// Submission queues posting here.
    pub(crate) sq_count: u32,
    /// The external head doorbell, if the queue was created with one (else the head is read
    /// from the register window).
    pub(crate) doorbell: Option<Arc<dyn DoorbellWord>>,
    /// The controller thread's translation-cache entry for the ring (a hint, checked on use:
    /// see `MapCache::translate_at`).
    pub(crate) map_hint: usize,
}

impl CompQueue {
    /// A queue of `entries` entries at `base` with register-window doorbells.
    pub(crate) fn new(base: u64, entries: u32) -> Self {
        Self {
            base,
            entries,
            tail: 0,
            head: 0,
            seen_doorbell: 0,
            phase: true,
            held: VecDeque::new(),
            owed: 0,
            sq_count: 0,
            doorbell: None,
            map_hint: 0,
        }
    }

    /// Entries posted and not yet consumed by the host.
    pub(crate) fn used(&self) -> u32 {
        (self.tail + self.entries - self.head) % self.entries
    }

    /// Free slots (a queue of N entries holds at most N - 1).
    pub(crate) fn free(&self) -> u32 {
        self.entries - 1 - self.used()
    }

    /// How many more commands may be fetched for this queue without risking an overflow.
    pub(crate) fn fetch_budget(&self) -> u32 {
        self.free()
            .saturating_sub(self.owed)
            .saturating_sub(self.held.len() as u32)
    }

    /// Whether `new_head` is a valid head doorbell value: it may only move forward over
    /// entries that have been posted.
    pub(crate) fn head_is_valid(&self, new_head: u32) -> bool {
        new_head < self.entries
            && (new_head + self.entries - self.head) % self.entries <= self.used()
    }

    /// Device address of the next entry to write, and the completion to write there; advances
    /// the tail (flipping the phase on wrap).
    pub(crate) fn next_slot(&mut self) -> (u64, bool) {
        let addr = self.base + self.tail as u64 * size_of::<Completion>() as u64;
        let phase = self.phase;
        self.tail += 1;
        if self.tail == self.entries {
            self.tail = 0;
            self.phase = !self.phase;
        }
        (addr, phase)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_arithmetic() {
        let mut cq = CompQueue::new(0x1000, 4);
        assert_eq!((cq.used(), cq.free(), cq.fetch_budget()), (0, 3, 3));
        cq.owed = 1;
        assert_eq!(cq.fetch_budget(), 2);
        for i in 0..3 {
            let (addr, phase) = cq.next_slot();
            assert_eq!(addr, 0x1000 + 16 * i);
            assert!(phase);
        }
        assert_eq!(cq.free(), 0);
        assert!(cq.head_is_valid(3));
        assert!(cq.head_is_valid(2));
        assert!(!cq.head_is_valid(4));
        cq.head = 3;
        assert!(!cq.head_is_valid(1), "head may not pass the tail");
        assert!(cq.head_is_valid(3));
        let (addr, phase) = cq.next_slot();
        assert_eq!((addr, phase), (0x1000 + 48, true));
        assert_eq!(cq.tail, 0);
        let (_, phase) = cq.next_slot();
        assert!(!phase, "phase flips after a wrap");
        assert!(cq.head_is_valid(1));
        assert!(cq.head_is_valid(0));

        let mut sq = SubQueue::new(0, 8, 1, None);
        sq.head = 6;
        assert_eq!(sq.pending(2), 4);
        sq.advance(4);
        assert_eq!(sq.head, 2);
        assert_eq!(sq.pending(2), 0);
    }
}
