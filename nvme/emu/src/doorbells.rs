//! External doorbells: per-queue SQ tail and CQ head words that live outside the register
//! window (a pinned host page a GPU writes), and the table of which queue ids have them.
//!
//! A host attaches a pair of words to a queue id with
//! [`crate::EmuDevice::attach_external_doorbells`] before it creates the I/O queues with that
//! id. The controller consults the table only when it creates a queue: a queue created while
//! its id has words attached takes its doorbell from the word for as long as it exists (until
//! it is deleted or the controller is reset), whatever happens to the attachment meanwhile.
//! Attachments survive controller resets; only [`crate::EmuDevice::detach_external_doorbells`]
//! removes them.

use std::sync::{Arc, Mutex};

use crate::error::{AttachRefusal, EmuError};

/// A 32-bit doorbell word that lives outside the register window (e.g. a pinned host page a
/// GPU writes).
///
/// The controller thread serving the queue polls it: a GPU write raises no wakeup, so while it
/// serves a queue with external doorbells that thread never parks. Every value read is validated
/// as a register-window doorbell write is (see the crate documentation).
pub trait DoorbellWord: Send + Sync {
    /// Current value, with Acquire ordering (entries written before the doorbell are visible).
    fn load(&self) -> u32;
}

/// The words attached to one queue id.
#[derive(Clone)]
pub(crate) struct AttachedWords {
    /// Tail doorbell of submission queue `qid`.
    pub(crate) sq_tail: Arc<dyn DoorbellWord>,
    /// Head doorbell of completion queue `qid`.
    pub(crate) cq_head: Arc<dyn DoorbellWord>,
}

/// One queue id's entry.
#[derive(Default)]
struct Slot {
    words: Option<AttachedWords>,
    /// Submission queue `qid` exists (maintained by controller thread 0).
    sq_live: bool,
    /// Completion queue `qid` exists.
    cq_live: bool,
}

/// Which I/O queue ids have external doorbells, and which of those queues exist. Shared by the
/// device handle (attach, detach) and controller thread 0 (queue creation and deletion), so
/// that "attach only while the queue does not exist" is decided under one lock.
pub(crate) struct ExternalDoorbells {
    /// Index `qid`; index 0 (the admin queue) is never used.
    slots: Mutex<Vec<Slot>>,
}

impl ExternalDoorbells {
    /// A table for I/O queue ids `1..=max_qid`, with nothing attached.
    pub(crate) fn new(max_qid: u16) -> Self {
        Self {
            slots: Mutex::new((0..=max_qid).map(|_| Slot::default()).collect()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches words to `qid`: refused for a queue id outside `1..=max_qid`, while submission
    /// or completion queue `qid` exists, or while words are already attached.
    pub(crate) fn attach(&self, qid: u16, words: AttachedWords) -> Result<(), EmuError> {
        let mut slots = self.lock();
        let max = (slots.len() - 1) as u16;
        let refuse = |reason| Err(EmuError::AttachDoorbells { qid, reason });
        let Some(slot) = slots.get_mut(qid as usize).filter(|_| qid != 0) else {
            return refuse(AttachRefusal::InvalidQueueId { max });
        };
        if slot.sq_live || slot.cq_live {
            return refuse(AttachRefusal::QueueExists);
        }
        if slot.words.is_some() {
            return refuse(AttachRefusal::AlreadyAttached);
        }
        slot.words = Some(words);
        Ok(())
    }

    /// Removes the words attached to `qid`, if any; returns whether there were some.
    pub(crate) fn detach(&self, qid: u16) -> bool {
        self.lock()
            .get_mut(qid as usize)
            .and_then(|s| s.words.take())
            .is_some()
    }

    /// Marks submission (`is_sq`) or completion queue `qid` as existing or not; on creation,
    /// returns the word the queue is to use (none: BAR0 doorbells).
    pub(crate) fn set_live(
        &self,
        qid: u16,
        is_sq: bool,
        live: bool,
    ) -> Option<Arc<dyn DoorbellWord>> {
        let mut slots = self.lock();
        let slot = slots.get_mut(qid as usize).filter(|_| qid != 0)?;
        if is_sq {
            slot.sq_live = live;
        } else {
            slot.cq_live = live;
        }
        let words = slot.words.as_ref().filter(|_| live)?;
        Some(if is_sq {
            words.sq_tail.clone()
        } else {
            words.cq_head.clone()
        })
    }

    /// Marks every queue nonexistent (controller reset); attachments stay.
    pub(crate) fn reset(&self) {
        for slot in self.lock().iter_mut() {
            slot.sq_live = false;
            slot.cq_live = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    struct Word(AtomicU32);

    impl DoorbellWord for Word {
        fn load(&self) -> u32 {
            self.0.load(Ordering::Acquire)
        }
    }

    fn words() -> AttachedWords {
        AttachedWords {
            sq_tail: Arc::new(Word(AtomicU32::new(0))),
            cq_head: Arc::new(Word(AtomicU32::new(0))),
        }
    }

    fn refusal(r: Result<(), EmuError>) -> AttachRefusal {
        match r {
            Err(EmuError::AttachDoorbells { reason, .. }) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn attach_rules() {
        let t = ExternalDoorbells::new(2);
        assert_eq!(
            refusal(t.attach(0, words())),
            AttachRefusal::InvalidQueueId { max: 2 }
        );
        assert_eq!(
            refusal(t.attach(3, words())),
            AttachRefusal::InvalidQueueId { max: 2 }
        );
        assert!(t.set_live(1, false, true).is_none(), "nothing attached");
        assert_eq!(refusal(t.attach(1, words())), AttachRefusal::QueueExists);
        t.set_live(1, false, false);
        t.attach(1, words()).unwrap();
        assert_eq!(
            refusal(t.attach(1, words())),
            AttachRefusal::AlreadyAttached
        );
        assert!(t.set_live(1, true, true).is_some());
        assert!(t.set_live(1, false, true).is_some());
        t.reset();
        assert!(t.detach(1));
        assert!(!t.detach(1));
        assert!(!t.detach(9));
        assert!(t.set_live(1, true, true).is_none(), "detached");
    }
}
