//! [`DmaStats`]: what one copy engine has done, for reports on where the controller's time
//! goes.

use std::time::{Duration, Instant};

/// What one engine has done, for reports on where the controller's time goes.
#[derive(Clone, Copy, Debug, Default)]
pub struct DmaStats {
    /// Scatter kernels launched (one per controller batch that wrote GPU memory).
    pub scatters: u64,
    /// Pieces the scatters moved (data ranges and completion entries).
    pub pieces: u64,
    /// Gather kernels launched (prefetched SQEs, PRP lists, write data).
    pub gathers: u64,
    /// Ranges the gathers moved.
    pub gathered: u64,
    /// Reads served from gathered bytes.
    pub hits: u64,
    /// Reads that needed a copy and a wait of their own.
    pub sync_reads: u64,
    /// Nanoseconds the controller thread spent waiting for the GPU (reads, full staging).
    pub wait_ns: u64,
    /// Of `wait_ns`: waiting for reads of GPU memory (SQE fetches, gathers, sync reads).
    pub fetch_wait_ns: u64,
    /// Of `wait_ns`: waiting for a staging area the GPU still drained.
    pub drain_wait_ns: u64,
    /// Reads and gathers of memory the controller never wrote, on the fetch stream (not
    /// ordered after the engine's writes).
    pub unordered_reads: u64,
    /// Nanoseconds spent copying image data into staging (mapped copies or `pread`).
    pub file_ns: u64,
    /// Copies issued straight from registered image windows (adjacent ranges merged).
    pub direct_copies: u64,
    /// Bytes those copies moved.
    pub direct_bytes: u64,
    /// Bytes of Reads staged through pinned memory from the image file.
    pub staged_file_bytes: u64,
    /// Of `staged_file_bytes`: copied out of a mapping of the image ([`ReadMode::Mapped`],
    /// pages in memory); the rest by `pread` or direct I/O.
    ///
    /// [`ReadMode::Mapped`]: crate::image_reads::ReadMode::Mapped
    pub mapped_bytes: u64,
    /// Of `staged_file_bytes`: read by direct I/O (Reads with no page in the page cache,
    /// [`ColdReads::Direct`]; pieces the file system or the alignment refused went by `pread`),
    /// or copied out of a prefetch's pool, which direct I/O filled ([`ColdReads::Prefetch`]).
    ///
    /// [`ColdReads::Direct`]: crate::image_reads::ColdReads::Direct
    /// [`ColdReads::Prefetch`]: crate::image_reads::ColdReads::Prefetch
    pub cold_direct_bytes: u64,
    /// Copy-engine copies of staged Read data (adjacent Reads merged).
    pub engine_copies: u64,
    /// Pinned bytes of staging and gather areas allocated so far (each at its first use).
    pub pinned_bytes: u64,
    /// Nanoseconds those allocations took (or waited for the engines' pool).
    pub pinned_alloc_ns: u64,
    /// Bytes of the engines' pool of first areas, once allocated (a total's only: allocated
    /// once for every engine, beside the set-up).
    pub pinned_pool_bytes: u64,
    /// Nanoseconds the pool's allocation took, on its own thread.
    pub pinned_pool_ns: u64,
    /// When the first Read after a lull (no staged Read for [`LULL`]) was staged: the start
    /// of the latest burst of work, such as a load.
    pub burst_start: Option<Instant>,
    /// When the last staged Read's data was in staging.
    pub last_staged: Option<Instant>,
}

/// A pause between staged Reads that starts a new burst ([`DmaStats::burst_start`]).
pub(super) const LULL: Duration = Duration::from_millis(5);

impl DmaStats {
    pub(super) fn add(&mut self, o: &DmaStats) {
        self.scatters += o.scatters;
        self.pieces += o.pieces;
        self.gathers += o.gathers;
        self.gathered += o.gathered;
        self.hits += o.hits;
        self.sync_reads += o.sync_reads;
        self.wait_ns += o.wait_ns;
        self.fetch_wait_ns += o.fetch_wait_ns;
        self.drain_wait_ns += o.drain_wait_ns;
        self.unordered_reads += o.unordered_reads;
        self.file_ns += o.file_ns;
        self.direct_copies += o.direct_copies;
        self.direct_bytes += o.direct_bytes;
        self.staged_file_bytes += o.staged_file_bytes;
        self.mapped_bytes += o.mapped_bytes;
        self.cold_direct_bytes += o.cold_direct_bytes;
        self.engine_copies += o.engine_copies;
        self.pinned_bytes += o.pinned_bytes;
        self.pinned_alloc_ns += o.pinned_alloc_ns;
        self.burst_start = match (self.burst_start, o.burst_start) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.last_staged = self.last_staged.max(o.last_staged);
    }
}
