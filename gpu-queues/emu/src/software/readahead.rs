//! [`Readahead`]: a [`QueueTransport::will_read`] hint at work, threads that have the kernel
//! read the hinted parts of the image not in the page cache ahead of the controller threads
//! (`GPUNVME_EMU_READAHEAD`).
//!
//! [`QueueTransport::will_read`]: gpu_queues::queues::QueueTransport::will_read

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpu_queues::GpuError;

use crate::env_choice;

/// `GPUNVME_EMU_READAHEAD=on|off|N` (`on`: [`READAHEAD_WALKERS`] threads; `N` from 1 to 16
/// threads): whether a hint of Reads to come ([`QueueTransport::will_read`]) has the kernel
/// read the parts of the image not in the page cache ahead of the controller threads
/// ([`Readahead`]), or does nothing (`off`). Unset: `on`, but `off` where cold Reads go by
/// direct I/O (`GPUNVME_EMU_COLD_READS=direct`: pages read ahead into the page cache would turn
/// them into copies out of it, the disk read twice where the two race).
///
/// [`QueueTransport::will_read`]: gpu_queues::queues::QueueTransport::will_read
pub const READAHEAD_ENV: &str = gpunvme_settings::EMU_READAHEAD.name;

/// Threads of a [`Readahead`] by default: each `posix_fadvise` waits while it submits its
/// block's reads, so several keep more of the disk's queue filled.
pub const READAHEAD_WALKERS: usize = 4;

pub(super) fn readahead_from(var: Option<&str>, default: usize) -> Result<usize, GpuError> {
    let v = var.map(str::trim).filter(|v| !v.is_empty());
    if let Some(n) = v.and_then(|v| v.parse::<usize>().ok()) {
        if (1..=16).contains(&n) {
            return Ok(n);
        }
    }
    let c = [("on", READAHEAD_WALKERS), ("off", 0)];
    match env_choice::choice(READAHEAD_ENV, v, &c) {
        Ok(n) => Ok(n.unwrap_or(default)),
        Err(GpuError::InvalidArgument(m)) => Err(GpuError::InvalidArgument(format!(
            "{m} or a thread count from 1 to 16"
        ))),
        Err(e) => Err(e),
    }
}

/// Bytes of the image one `posix_fadvise(WILLNEED)` of [`Readahead`] asks for.
pub(super) const READAHEAD_BLOCK: u64 = 8 << 20;

/// A [`QueueTransport::will_read`] hint at work: threads of its own walk the hinted byte
/// ranges of the image in order, a [`READAHEAD_BLOCK`] at a time (the next block to whichever
/// thread is free), and have the kernel read each block not wholly in the page cache
/// (`crate::os::advise_willneed`: the reads are started, not waited for). A cold
/// image is then read at the disk's pace by large requests in flight together, rather than by
/// each controller thread's 128 KiB `pread` in turn (on the lent H200, 2026-11-28, cold loads
/// ran at 1.7 to 1.8 GB/s where fastsafetensors read the same disk at 2.1 to 2.9; with one
/// such thread, 1.8 to 2.1). Resident blocks cost one `cachestat` each, made by one thread
/// until a block is found to read, when the others start. Dropping this stops
/// the walk without waiting for it: each thread ends after the block in hand (its
/// `posix_fadvise` may wait for room in the device queue) and owns its descriptor, so nothing
/// it touches goes away under it.
///
/// [`QueueTransport::will_read`]: gpu_queues::queues::QueueTransport::will_read
pub(super) struct Readahead {
    stop: Arc<AtomicBool>,
    /// The walk's owner: returns the bytes it asked for and the threads it ran.
    thread: Option<std::thread::JoinHandle<(u64, usize)>>,
}

impl Readahead {
    /// Starts the walk over `ranges` (byte ranges of `file`) on `walkers` threads.
    pub(super) fn start(
        file: std::fs::File,
        ranges: Vec<(u64, u64)>,
        walkers: usize,
    ) -> std::io::Result<Self> {
        use std::os::fd::AsFd;
        use std::sync::atomic::{AtomicU64, AtomicUsize};
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let blocks: Vec<(u64, u64)> = ranges
            .iter()
            .flat_map(|&(start, len)| {
                let end = start.saturating_add(len);
                (start..end)
                    .step_by(READAHEAD_BLOCK as usize)
                    .map(move |at| (at, (end - at).min(READAHEAD_BLOCK)))
            })
            .collect();
        // One thread of ours owns the walk; it runs the other walkers scoped and returns when
        // they all have.
        let thread = std::thread::Builder::new()
            .name("gpunvme-readahead".into())
            .spawn(move || {
                let (next, asked) = (AtomicUsize::new(0), AtomicU64::new(0));
                // `on_cold` runs before each block that is not all in the page cache.
                let walk = |on_cold: &dyn Fn()| {
                    while !halt.load(Ordering::Relaxed) {
                        let Some(&(at, n)) = blocks.get(next.fetch_add(1, Ordering::Relaxed))
                        else {
                            return;
                        };
                        let cached = crate::os::range_cached(file.as_fd(), at, n);
                        if !cached.unwrap_or(false) {
                            on_cold();
                            if crate::os::advise_willneed(file.as_fd(), at, n).is_ok() {
                                asked.fetch_add(n, Ordering::Relaxed);
                            }
                        }
                    }
                };
                // The other walkers start at the first block there is to read: a warm image
                // costs one thread's cachestats, not several threads beside the controller's.
                let threads = std::thread::scope(|s| {
                    let started = std::cell::Cell::new(false);
                    let ran = std::cell::Cell::new(1usize);
                    let more = || {
                        if !started.replace(true) {
                            for _ in 1..walkers.clamp(1, blocks.len().max(1)) {
                                // A thread the system refuses is one walker fewer.
                                let helper = std::thread::Builder::new()
                                    .name("gpunvme-readahead".into())
                                    .spawn_scoped(s, || walk(&|| {}));
                                if helper.is_ok() {
                                    ran.set(ran.get() + 1);
                                }
                            }
                        }
                    };
                    walk(&more);
                    ran.get()
                });
                let bytes = asked.into_inner();
                tracing::trace!(bytes, threads, "image read ahead of Reads");
                (bytes, threads)
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Waits for the whole walk; the bytes it asked the kernel to read and the threads it ran
    /// (tests).
    #[cfg(test)]
    pub(super) fn finish(mut self) -> (u64, usize) {
        self.thread
            .take()
            .map_or((0, 0), |t| t.join().unwrap_or((0, 0)))
    }
}

impl Drop for Readahead {
    fn drop(&mut self) {
        // Detached, not joined: the hint's owner (a load) does not wait on the disk.
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take();
    }
}
