//! Injected faults, adjustable at run time from any thread while the controller runs.
//!
//! The controller threads sample these per command (the media-error set only when it is
//! non-empty), so a change applies to commands fetched after it.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvme_spec::Csts;

use crate::registers::RegisterWindow;

/// Fault knobs of one software controller ([`crate::EmuDevice::faults`]).
///
/// Completion delays and dropped completions apply to I/O queues only (not the admin queue), so
/// that a driver can still reach the controller to abort or reset; the admin delay
/// ([`Faults::set_admin_delay`]) is the admin queue's own.
#[derive(Debug)]
pub struct Faults {
    regs: Arc<RegisterWindow>,
    media_errors: Mutex<BTreeSet<(u32, u64)>>,
    media_error_count: AtomicUsize,
    completion_delay_ns: AtomicU64,
    admin_delay_ns: AtomicU64,
    drop_remaining: AtomicU64,
    fatal_requested: AtomicBool,
}

/// [`Faults::drop_completions`] count meaning "every completion, until cleared".
pub const DROP_ALL: u64 = u64::MAX;

impl Faults {
    pub(crate) fn new(regs: Arc<RegisterWindow>) -> Self {
        Self {
            regs,
            media_errors: Mutex::default(),
            media_error_count: AtomicUsize::new(0),
            completion_delay_ns: AtomicU64::new(0),
            admin_delay_ns: AtomicU64::new(0),
            drop_remaining: AtomicU64::new(0),
            fatal_requested: AtomicBool::new(false),
        }
    }

    /// Makes every read covering `lba` of namespace `nsid` fail with Unrecovered Read Error
    /// and every write covering it fail with Write Fault (Media and Data Integrity Errors).
    pub fn add_media_error(&self, nsid: u32, lba: u64) {
        let mut set = self.media_errors.lock().unwrap_or_else(|e| e.into_inner());
        set.insert((nsid, lba));
        self.media_error_count.store(set.len(), Ordering::Release);
    }

    /// Removes one injected media error; returns whether it was set.
    pub fn remove_media_error(&self, nsid: u32, lba: u64) -> bool {
        let mut set = self.media_errors.lock().unwrap_or_else(|e| e.into_inner());
        let removed = set.remove(&(nsid, lba));
        self.media_error_count.store(set.len(), Ordering::Release);
        removed
    }

    /// Removes every injected media error.
    pub fn clear_media_errors(&self) {
        let mut set = self.media_errors.lock().unwrap_or_else(|e| e.into_inner());
        set.clear();
        self.media_error_count.store(0, Ordering::Release);
    }

    /// The first injected media error in `slba..slba + nlb` of `nsid`, if any.
    #[inline]
    pub(crate) fn media_error_in(&self, nsid: u32, slba: u64, nlb: u64) -> Option<u64> {
        if self.media_error_count.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.media_error_in_set(nsid, slba, nlb)
    }

    #[cold]
    fn media_error_in_set(&self, nsid: u32, slba: u64, nlb: u64) -> Option<u64> {
        let set = self.media_errors.lock().unwrap_or_else(|e| e.into_inner());
        set.range((nsid, slba)..(nsid, slba.saturating_add(nlb)))
            .next()
            .map(|&(_, lba)| lba)
    }

    /// Delays every I/O completion by `delay` after the command has been executed (zero turns
    /// delays off). Delayed completions do not block the controller: other commands proceed.
    pub fn set_completion_delay(&self, delay: Duration) {
        let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.completion_delay_ns.store(ns, Ordering::Release);
    }

    /// Makes every admin command take `delay` before it executes, holding the admin queue's
    /// thread meanwhile (zero turns it off): a stand-in for a controller whose admin commands
    /// wait on something slow (a GPU-resident controller model taking a queue change).
    pub fn set_admin_delay(&self, delay: Duration) {
        let ns = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.admin_delay_ns.store(ns, Ordering::Release);
    }

    /// The current admin command delay.
    pub fn admin_delay(&self) -> Duration {
        Duration::from_nanos(self.admin_delay_ns.load(Ordering::Acquire))
    }

    /// The current completion delay.
    pub fn completion_delay(&self) -> Duration {
        Duration::from_nanos(self.completion_delay_ns.load(Ordering::Acquire))
    }

    /// Whether completions are being delayed (the check on every completion, without
    /// building a [`Duration`]).
    #[inline]
    pub(crate) fn delays_completions(&self) -> bool {
        self.completion_delay_ns.load(Ordering::Acquire) != 0
    }

    /// Executes the next `count` I/O commands but never posts their completions
    /// ([`DROP_ALL`]: every one, until set to 0). A later Abort of such a command completes it
    /// with Command Abort Requested.
    pub fn drop_completions(&self, count: u64) {
        self.drop_remaining.store(count, Ordering::Release);
    }

    /// How many more completions will be dropped ([`DROP_ALL`] for all).
    pub fn drops_remaining(&self) -> u64 {
        self.drop_remaining.load(Ordering::Acquire)
    }

    /// Consumes one drop, returning whether this completion is to be dropped.
    #[inline]
    pub(crate) fn take_drop(&self) -> bool {
        // The common case (no drops armed) without a read-modify-write.
        if self.drop_remaining.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.drop_remaining
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| match n {
                0 => None,
                DROP_ALL => Some(DROP_ALL),
                n => Some(n - 1),
            })
            .is_ok()
    }

    /// Puts the controller in Controller Fatal Status: CSTS.CFS reads 1 as soon as this
    /// returns, and the controller stops fetching and completing commands until the host resets
    /// it (CC.EN 1 to 0). Has no lasting effect on a disabled controller.
    pub fn fatal(&self) {
        self.fatal_requested.store(true, Ordering::Release);
        self.regs.csts_set(u32::from(Csts::new().with_cfs(true)));
        self.regs.wake_all();
    }

    /// Whether a fatal request is pending (not yet taken by controller thread 0). Every
    /// controller thread looks before fetching; only thread 0 takes the request, after it has
    /// entered Controller Fatal Status, so a thread that finds none pending also sees the
    /// fatal state the request led to.
    pub(crate) fn fatal_pending(&self) -> bool {
        self.fatal_requested.load(Ordering::Acquire)
    }

    /// Takes a pending fatal request.
    pub(crate) fn take_fatal(&self) -> bool {
        self.fatal_requested.load(Ordering::Acquire)
            && self.fatal_requested.swap(false, Ordering::AcqRel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_error_ranges_and_drops() {
        let f = Faults::new(Arc::new(RegisterWindow::new(1, 0, 0)));
        assert_eq!(f.media_error_in(1, 0, 100), None);
        f.add_media_error(1, 10);
        f.add_media_error(2, 5);
        assert_eq!(f.media_error_in(1, 0, 10), None);
        assert_eq!(f.media_error_in(1, 10, 1), Some(10));
        assert_eq!(f.media_error_in(1, 3, 8), Some(10));
        assert_eq!(f.media_error_in(2, 0, 8), Some(5));
        assert_eq!(f.media_error_in(1, u64::MAX - 1, 5), None);
        assert!(f.remove_media_error(1, 10));
        assert_eq!(f.media_error_in(1, 10, 1), None);

        f.drop_completions(2);
        assert!(f.take_drop());
        assert!(f.take_drop());
        assert!(!f.take_drop());
        f.drop_completions(DROP_ALL);
        assert!(f.take_drop() && f.take_drop());
        assert_eq!(f.drops_remaining(), DROP_ALL);
    }
}
