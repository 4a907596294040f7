//! [`Published`]: a value that lock-free readers reach with one load, and that stays alive
//! until its owner is dropped.
//!
//! Why: the null device's I/O queue state (rings, heads, tails) is read on every doorbell. With
//! a lock around it, each SQ doorbell paid an atomic read-modify-write, which on the GPU
//! machine's host measured 11 ns, a third of a QD 1 round trip the benchmarks exist to measure
//! for the driver. Here a doorbell loads a pointer instead. Queues are created and deleted
//! rarely (admin commands), so every state ever published is simply kept until the device is
//! dropped: a doorbell that raced with a deletion still holds valid memory, and no reclamation
//! scheme (epochs, hazard pointers) is needed.
// UNSAFETY: readers dereference a raw pointer to a value owned elsewhere; what keeps it valid
// is that values are freed only in `Drop`, which needs `&mut self`, so no reader is left.
#![expect(unsafe_code)]

use std::ptr::{self, NonNull};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The current value (or none), replaced and cleared by a serialized writer, read lock-free.
/// Every value ever set is kept until this is dropped.
pub(super) struct Published<T> {
    current: AtomicPtr<T>,
    /// Every value set so far, from `Box::into_raw`: freed in `Drop` only.
    kept: Mutex<Vec<NonNull<T>>>,
}

// SAFETY: readers on any thread get `&T` (needs `T: Sync`); the values are dropped on whatever
// thread drops this (needs `T: Send`).
unsafe impl<T: Send + Sync> Sync for Published<T> {}
// SAFETY: as above: moving this moves ownership of the kept values.
unsafe impl<T: Send + Sync> Send for Published<T> {}

impl<T> Default for Published<T> {
    fn default() -> Self {
        Self {
            current: AtomicPtr::new(ptr::null_mut()),
            kept: Mutex::new(Vec::new()),
        }
    }
}

impl<T> Published<T> {
    /// The current value, if one is set.
    #[inline]
    pub(super) fn get(&self) -> Option<&T> {
        // Acquire: the value's fields, written before `set` published it, are seen.
        let p = self.current.load(Ordering::Acquire);
        // SAFETY: `p` is null or came from `Box::into_raw` in `set` and sits in `kept`, which
        // frees nothing before `Drop`; the returned borrow lives no longer than `&self`, so the
        // value outlives it. Only shared references are ever made to it.
        unsafe { p.as_ref() }
    }

    /// Publishes `value` as the current one (the previous one stays alive).
    pub(super) fn set(&self, value: T) {
        let p = Box::into_raw(Box::new(value));
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).push(
            // SAFETY: `Box::into_raw` never returns null.
            unsafe { NonNull::new_unchecked(p) },
        );
        self.current.store(p, Ordering::Release);
    }

    /// No current value from now on (the previous one stays alive).
    pub(super) fn clear(&self) {
        self.current.store(ptr::null_mut(), Ordering::Release);
    }
}

impl<T> Drop for Published<T> {
    fn drop(&mut self) {
        let kept = self.kept.get_mut().unwrap_or_else(|e| e.into_inner());
        for p in kept.drain(..) {
            // SAFETY: each pointer came from `Box::into_raw` once and is freed once, here;
            // `&mut self` means no borrow from `get` is alive.
            drop(unsafe { Box::from_raw(p.as_ptr()) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Published;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Counted(Arc<AtomicUsize>, u32);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn replaced_and_cleared_values_live_until_the_owner_drops() {
        let dropped = Arc::new(AtomicUsize::new(0));
        let p = Published::default();
        assert!(p.get().is_none());
        p.set(Counted(dropped.clone(), 1));
        let first = p.get().map(|c| c.1);
        p.set(Counted(dropped.clone(), 2));
        assert_eq!((first, p.get().map(|c| c.1)), (Some(1), Some(2)));
        p.clear();
        assert!(p.get().is_none());
        assert_eq!(dropped.load(Ordering::Relaxed), 0);
        drop(p);
        assert_eq!(dropped.load(Ordering::Relaxed), 2);
    }
}
