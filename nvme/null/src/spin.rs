//! [`SpinMutex`]: the lock around the null device's admin queue.
//!
//! Why not `std::sync::Mutex`: its uncontended lock and unlock are two atomic
//! read-modify-writes (the unlock swaps, to learn whether a waiter must be woken). This lock's
//! unlock is a plain release store. Admin commands are rare; the I/O queues take no lock at all
//! (see `published`). Under contention a waiter spins briefly, then yields its CPU.
// UNSAFETY: a lock hands out `&mut T` from `&self`, which needs an `UnsafeCell`; exclusive
// access is what the flag's acquire/release protocol guarantees.
#![expect(unsafe_code)]

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// A mutual-exclusion lock whose unlock is a plain store (no poisoning: a panic while held
/// releases it, and the state is whatever the panicking code left).
#[derive(Default)]
pub(super) struct SpinMutex<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and at most one guard exists at a time
// (the flag), so sharing the lock between threads shares `T` only by moving access, which
// needs `T: Send`.
unsafe impl<T: Send> Sync for SpinMutex<T> {}

impl<T> SpinMutex<T> {
    /// The wait when the first try failed: out of line, so that the uncontended lock is one
    /// compare-and-swap with nothing to spill around it.
    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Takes the lock, spinning (then yielding) while another thread holds it.
    #[inline]
    pub(super) fn lock(&self) -> SpinGuard<'_, T> {
        if self
            .locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        SpinGuard { lock: self }
    }
}

/// Exclusive access to a [`SpinMutex`]'s value until dropped.
pub(super) struct SpinGuard<'a, T> {
    lock: &'a SpinMutex<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard holds the lock (acquired in `lock`), so no other reference to the
        // value exists until it is dropped.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        // Release: every write made under the lock is visible to the next holder's acquire.
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::SpinMutex;
    use std::sync::Arc;

    #[test]
    fn threads_incrementing_under_the_lock_lose_no_update() {
        let m = Arc::new(SpinMutex::<u64>::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..50_000 {
                        *m.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*m.lock(), 200_000);
    }
}
