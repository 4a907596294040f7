//! Counters the controller keeps, readable from any thread.

use std::sync::atomic::{AtomicU64, Ordering};

/// A snapshot of a controller's counters ([`crate::EmuDevice::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EmuStats {
    /// Admin commands fetched.
    pub admin_commands: u64,
    /// I/O commands fetched.
    pub io_commands: u64,
    /// Read commands that succeeded.
    pub reads: u64,
    /// Write commands that succeeded.
    pub writes: u64,
    /// Bytes read by successful Read commands.
    pub bytes_read: u64,
    /// Bytes written by successful Write commands.
    pub bytes_written: u64,
    /// Flush commands that succeeded.
    pub flushes: u64,
    /// Commands completed with a status other than success.
    pub errors: u64,
    /// Completion queue entries posted.
    pub completions_posted: u64,
    /// Completions dropped by the drop-completions fault.
    pub completions_dropped: u64,
    /// Times a completion had to wait because its completion queue was full.
    pub cq_full_waits: u64,
    /// Doorbell values refused: register-window writes to a nonexistent queue or with an
    /// out-of-range value, CQ heads that pass entries not yet posted, and invalid values read
    /// from external doorbell words.
    pub invalid_doorbell_writes: u64,
    /// Times the controller entered Controller Fatal Status.
    pub fatal_errors: u64,
    /// Controller resets (CC.EN 1 to 0).
    pub resets: u64,
    /// Times an idle controller thread parked, summed over the threads (a thread never parks
    /// while it serves a queue with external doorbells).
    pub idle_parks: u64,
}

/// The live counters behind [`EmuStats`], one set per controller thread, written by that thread
/// only (a snapshot sums them). Aligned so that no two threads' sets share a cache line.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Counters {
    pub(crate) admin_commands: AtomicU64,
    pub(crate) io_commands: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) completions_posted: AtomicU64,
    pub(crate) completions_dropped: AtomicU64,
    pub(crate) cq_full_waits: AtomicU64,
    pub(crate) fatal_errors: AtomicU64,
    pub(crate) resets: AtomicU64,
    pub(crate) idle_parks: AtomicU64,
    /// Commands failed with a Media and Data Integrity Error (SMART Media Errors).
    pub(crate) media_errors: AtomicU64,
    /// Invalid doorbell values found by this thread (the register window counts the
    /// writes it refuses itself).
    pub(crate) invalid_doorbell_values: AtomicU64,
}

impl Counters {
    /// Adds `n` to a counter. Only the thread owning the set writes it, so a load and a store
    /// suffice (no locked read-modify-write on the hot path).
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.store(
            counter.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    /// Sums the sets of every thread; `invalid_doorbell_writes` counts the writes the register
    /// window refused itself.
    pub(crate) fn snapshot(sets: &[Counters], invalid_doorbell_writes: u64) -> EmuStats {
        let r = |f: fn(&Counters) -> &AtomicU64| Self::sum(sets, f);
        EmuStats {
            admin_commands: r(|c| &c.admin_commands),
            io_commands: r(|c| &c.io_commands),
            reads: r(|c| &c.reads),
            writes: r(|c| &c.writes),
            bytes_read: r(|c| &c.bytes_read),
            bytes_written: r(|c| &c.bytes_written),
            flushes: r(|c| &c.flushes),
            errors: r(|c| &c.errors),
            completions_posted: r(|c| &c.completions_posted),
            completions_dropped: r(|c| &c.completions_dropped),
            cq_full_waits: r(|c| &c.cq_full_waits),
            invalid_doorbell_writes: invalid_doorbell_writes
                .wrapping_add(r(|c| &c.invalid_doorbell_values)),
            fatal_errors: r(|c| &c.fatal_errors),
            resets: r(|c| &c.resets),
            idle_parks: r(|c| &c.idle_parks),
        }
    }

    /// One counter summed over every thread's set.
    pub(crate) fn sum(sets: &[Counters], f: fn(&Counters) -> &AtomicU64) -> u64 {
        sets.iter().fold(0u64, |acc, c| {
            acc.wrapping_add(f(c).load(Ordering::Relaxed))
        })
    }
}
