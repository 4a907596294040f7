//! How the software controller reads image data for Reads on GPU queues (transport (a)).
//!
//! Three ways, chosen by `GPUNVME_EMU_READS` ([`ReadMode`]):
//! - `mapped` (the default on x86-64 Linux): the image mapped read-only, whole ([`ImageViews`]);
//!   a Read whose pages are all in the page cache (`cachestat(2)`) is copied out of the mapping
//!   into the controller thread's pinned staging memory (`PinnedMemory::copy_from_mapping`),
//!   then into GPU memory at the end of the batch (by copy engine or scatter kernel,
//!   `software::StagedCopies`), and any other Read goes by `pread` (whose readahead serves a
//!   cold image). One CPU copy per byte, as with `pread`, but without `pread`'s marking of
//!   every page as accessed: a page read a second time moves to the active LRU list under a
//!   lock every reader shares, which made a model's first load after a warming read up to
//!   1.35x slower than the next (7B-shaped, H200, 2026-11-28, docs/benchmarks.md); a copy from
//!   a mapping leaves that to the page tables' accessed bits. A page lost between the check
//!   and the copy (evicted, then a disk error) is the Read's error, not a SIGBUS
//!   (`gpu_queues::ffi::guarded_copy`);
//! - `pread`: a positioned read of the image straight into the staging memory, the same
//!   otherwise (the default where guarded copies are not available);
//! - `registered`: the image's page-cache pages are registered with CUDA a window at a time
//!   ([`ImageWindows`]) and a copy engine moves a Read's data straight into GPU memory, with no
//!   CPU copy. Registering pins and maps every page, and CUDA does that for one thread at a
//!   time: on the lent H100 (2026-11-25) a 4 GiB load that registered its windows ran at 14-16
//!   GB/s against 22-29 GB/s staged (docs/benchmarks.md). For a process that reads the same
//!   image data repeatedly, and for comparisons.
//!
//! Registered windows: a window is the run of allocated data (no holes) around a Read within a
//! [`WINDOW_BYTES`] cell of the file, registered the first time a Read falls in it, and only if
//! every page of it is in the page cache then (a cold window would be faulted in a page at a
//! time by the registration; its Reads are staged, which reads ahead). Windows stay until the
//! controller's GPU queues are torn down, within a budget of pinned bytes
//! (`GPUNVME_EMU_PIN_BUDGET`, default half the memory).
//!
//! Consistency: windows are shared mappings of the image, so they are the very page-cache pages
//! that the controller's Writes (`pwrite`) change; holes are never registered (a later Write
//! would replace such a page rather than change it). A Read's copy runs after its command was
//! processed and before its completion is posted (stream order), so it returns the data of
//! every Write completed before the Read was submitted, as NVMe promises; a Write racing an
//! overlapping Read may be seen in part, as with `pread`.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use gpu_queues::GpuError;
use gpu_queues::ffi::os::{MappedImage, Mapping};
use gpu_queues::ffi::{Cuda, guarded_copy};

/// How Read data leaves the image (see the module's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// Copied by the controller thread out of a mapping of the image into pinned staging
    /// memory, then scattered (staged by `pread` where the image cannot be mapped).
    Mapped,
    /// Read by the controller thread (`pread`) into pinned staging memory, then scattered.
    Pread,
    /// Copied by a copy engine from registered windows of the image (staged where it cannot).
    Registered,
}

impl ReadMode {
    /// The mode `GPUNVME_EMU_READS` names (unset: [`ReadMode::Mapped`] where guarded copies
    /// work, else [`ReadMode::Pread`]).
    pub fn from_env() -> Result<Self, GpuError> {
        Self::parse(crate::env_choice::var(READS_ENV).as_deref())
    }

    fn parse(v: Option<&str>) -> Result<Self, GpuError> {
        let c = [
            ("mapped", Self::Mapped),
            ("pread", Self::Pread),
            ("registered", Self::Registered),
        ];
        let default = if guarded_copy::available() {
            Self::Mapped
        } else {
            Self::Pread
        };
        match crate::env_choice::choice(READS_ENV, v, &c)? {
            Some(Self::Mapped) if !guarded_copy::available() => Err(GpuError::Unsupported(
                format!("{READS_ENV}=mapped: guarded copies need x86-64 Linux"),
            )),
            m => Ok(m.unwrap_or(default)),
        }
    }

    /// The name `GPUNVME_EMU_READS` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mapped => "mapped",
            Self::Pread => "pread",
            Self::Registered => "registered",
        }
    }
}

/// Bytes per window (and the alignment of windows in the file).
pub const WINDOW_BYTES: u64 = 64 << 20;

/// `GPUNVME_EMU_READS=mapped|pread|registered`: how Read data leaves the image.
const READS_ENV: &str = "GPUNVME_EMU_READS";
/// `GPUNVME_EMU_PIN_BUDGET=BYTES`: the most image bytes registered at once (default: half the
/// machine's memory).
const BUDGET_ENV: &str = "GPUNVME_EMU_PIN_BUDGET";

/// Which file a window belongs to: the descriptor the controller reads through, and the file
/// behind it (so a reused descriptor number never finds another file's windows).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct FileKey {
    fd: i32,
    dev: u64,
    ino: u64,
}

impl FileKey {
    fn of(file: &File) -> Option<Self> {
        let meta = file.metadata().ok()?;
        Some(Self {
            fd: file.as_raw_fd(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// A run of a cell: `start..start + len` of the file.
enum Run {
    /// Registered.
    Ready {
        start: u64,
        window: Arc<MappedImage>,
    },
    /// Not resident when tried, or refused: not tried again until [`RETRY`] more misses.
    Skipped { start: u64, len: u64, misses: u32 },
}

impl Run {
    fn covers(&self, from: u64, to: u64) -> bool {
        let (start, len) = match self {
            Run::Ready { start, window } => (*start, window.registration().len() as u64),
            Run::Skipped { start, len, .. } => (*start, *len),
        };
        start <= from && to <= start + len
    }
}

/// The runs of one [`WINDOW_BYTES`] cell of a file that were tried.
#[derive(Default)]
struct Cell {
    runs: Vec<Run>,
    /// A thread is registering a run of this cell: others take the general path meanwhile.
    busy: bool,
}

/// Misses of a skipped run before it is tried again (it may have become resident).
const RETRY: u32 = 64;

/// A registered window and where a range starts in it.
pub struct WindowRange {
    /// The window.
    pub window: Arc<MappedImage>,
    /// Byte offset of the range in the window.
    pub offset: usize,
}

/// Counters of the fast path, for reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct WindowStats {
    /// Windows registered.
    pub registered: u64,
    /// Bytes registered.
    pub registered_bytes: u64,
    /// Registrations skipped because a window was not all in the page cache.
    pub not_resident: u64,
    /// Registrations refused by CUDA, or left out for the budget.
    pub refused: u64,
}

struct State {
    cells: HashMap<(FileKey, u64), Cell>,
    /// The inode each descriptor last had.
    files: HashMap<i32, FileKey>,
    pinned: u64,
    stats: WindowStats,
}

/// The registered windows of the images one software controller serves.
pub struct ImageWindows {
    cuda: Arc<Cuda>,
    enabled: bool,
    budget: u64,
    state: Mutex<State>,
}

impl std::fmt::Debug for ImageWindows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageWindows")
            .field("enabled", &self.enabled)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// Half of the machine's memory (1 GiB if it cannot be read).
fn default_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(1 << 30, |kib| kib * 1024 / 2)
}

impl ImageWindows {
    /// The windows of a controller using `cuda`: enabled when `mode` is
    /// [`ReadMode::Registered`], budgeted as `GPUNVME_EMU_PIN_BUDGET` says.
    pub fn for_mode(cuda: &Arc<Cuda>, mode: ReadMode) -> Self {
        let budget = std::env::var(BUDGET_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(default_budget);
        Self::new(cuda, mode == ReadMode::Registered, budget)
    }

    /// Windows as configured: `enabled` (else every lookup misses), at most `budget` bytes.
    pub fn new(cuda: &Arc<Cuda>, enabled: bool, budget: u64) -> Self {
        Self {
            cuda: cuda.clone(),
            enabled,
            budget,
            state: Mutex::new(State {
                cells: HashMap::new(),
                files: HashMap::new(),
                pinned: 0,
                stats: WindowStats::default(),
            }),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> WindowStats {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).stats
    }

    /// The registered window holding all of `file_offset..file_offset + len` of `file`,
    /// registering it now if it is resident and within budget; `None` when the range must take
    /// the general path (disabled, spans two cells or a hole, not resident, over budget,
    /// refused, or another thread is registering in its cell right now).
    ///
    /// A window is the run of allocated data (no holes) around the range within its
    /// [`WINDOW_BYTES`] cell: holes are never mapped, so no page is ever pinned that a later
    /// Write would replace rather than change.
    pub fn lookup(&self, file: &File, file_offset: u64, len: usize) -> Option<WindowRange> {
        if !self.enabled || len == 0 {
            return None;
        }
        let index = file_offset / WINDOW_BYTES;
        let lo = index * WINDOW_BYTES;
        let end = file_offset.checked_add(len as u64)?;
        if end > lo + WINDOW_BYTES {
            return None;
        }
        let fd = file.as_raw_fd();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let key = match st.files.get(&fd) {
            Some(&k) => k,
            None => {
                let k = FileKey::of(file)?;
                st.files.insert(fd, k);
                k
            }
        };
        let cell = st.cells.entry((key, index)).or_default();
        if let Some(i) = cell.runs.iter().position(|r| r.covers(file_offset, end)) {
            match &mut cell.runs[i] {
                Run::Ready { start, window } => {
                    return Some(WindowRange {
                        window: window.clone(),
                        offset: (file_offset - *start) as usize,
                    });
                }
                Run::Skipped { misses, .. } => {
                    *misses += 1;
                    if *misses < RETRY || cell.busy {
                        return None;
                    }
                    cell.runs.swap_remove(i);
                }
            }
        }
        if cell.busy {
            return None;
        }
        // The run of data around the range, within the cell and the file.
        let file_len = file.metadata().ok()?.len();
        let hi = file_len.min(lo + WINDOW_BYTES);
        let (start, stop) = match gpu_queues::ffi::os::data_run(file, file_offset, lo, hi) {
            Ok(Some(run)) => run,
            _ => return None,
        };
        if end > stop {
            return None;
        }
        let wlen = stop - start;
        if st.pinned + wlen > self.budget {
            st.stats.refused += 1;
            let cell = st.cells.entry((key, index)).or_default();
            cell.runs.push(Run::Skipped {
                start,
                len: wlen,
                misses: 0,
            });
            return None;
        }
        st.pinned += wlen;
        st.cells.entry((key, index)).or_default().busy = true;
        drop(st);
        let made = MappedImage::resident_window(&self.cuda, file, start, wlen as usize);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (run, found) = match made {
            Ok(Some(w)) => {
                let w = Arc::new(w);
                st.stats.registered += 1;
                st.stats.registered_bytes += wlen;
                (
                    Run::Ready {
                        start,
                        window: w.clone(),
                    },
                    Some(WindowRange {
                        window: w,
                        offset: (file_offset - start) as usize,
                    }),
                )
            }
            made => {
                match made {
                    Ok(_) => st.stats.not_resident += 1,
                    Err(e) => {
                        tracing::debug!("image window at {start:#x} not registered: {e}");
                        st.stats.refused += 1;
                    }
                }
                st.pinned -= wlen;
                (
                    Run::Skipped {
                        start,
                        len: wlen,
                        misses: 0,
                    },
                    None,
                )
            }
        };
        let cell = st.cells.entry((key, index)).or_default();
        cell.busy = false;
        cell.runs.push(run);
        found
    }
}

/// Whole-image read-only mappings, one per image file the controller reads, made the first
/// time a Read of that file is staged ([`ReadMode::Mapped`]); kept until the controller's GPU
/// queues are torn down. A mapping costs address space and page tables, not memory: its
/// pages are the page cache's.
///
/// Consistency: the mapping is shared, so it shows the very page-cache pages the controller's
/// Writes (`pwrite`) change, as `pread` would: a Read returns the data of every Write completed
/// before it was submitted; a Write racing an overlapping Read may be seen in part (NVMe leaves
/// that undefined). The copies are raw copies in assembly, never Rust reads of shared memory.
#[derive(Debug)]
pub struct ImageViews {
    enabled: bool,
    /// Per file, its mapping, or `None` where mapping it failed (not tried again).
    maps: Mutex<HashMap<FileKey, Option<Arc<Mapping>>>>,
    /// cachestat(2) failed once (logged once).
    no_cachestat: AtomicBool,
}

impl ImageViews {
    /// Mappings made as needed when `mode` is [`ReadMode::Mapped`]; else every lookup misses.
    pub fn for_mode(mode: ReadMode) -> Self {
        Self {
            enabled: mode == ReadMode::Mapped,
            maps: Mutex::new(HashMap::new()),
            no_cachestat: AtomicBool::new(false),
        }
    }

    /// The mapping of `file` if it covers `file_offset..file_offset + len` and every page of
    /// that range is in the page cache (mapping the whole file now, at its current length, on
    /// the first lookup); `None` when the range must be read with `pread` (disabled, an empty
    /// file, past the mapped length, not all resident (a cold read), or the file cannot be
    /// mapped).
    pub fn lookup(&self, file: &File, file_offset: u64, len: usize) -> Option<Arc<Mapping>> {
        if !self.enabled || len == 0 {
            return None;
        }
        let key = FileKey::of(file)?;
        // The table's lock covers the lookup only, not the cachestat below: every controller
        // thread comes here once per Read.
        let map = self
            .maps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_insert_with(|| {
                let len = usize::try_from(file.metadata().ok()?.len()).ok()?;
                match Mapping::read_only(file.as_fd(), len) {
                    Ok(m) => Some(Arc::new(m)),
                    Err(e) => {
                        tracing::debug!("image not mapped for reads ({len} bytes): {e}");
                        None
                    }
                }
            })
            .clone()?;
        let end = file_offset.checked_add(len as u64)?;
        if end > map.len() as u64 {
            return None;
        }
        // Only pages already in memory: a Read of pages that are not goes by `pread`, whose
        // readahead brings in what comes next (a page fault reads around the one page), and
        // whose errors are plain error codes. Where the kernel cannot say (no cachestat(2)),
        // every Read goes by `pread`.
        match gpu_queues::ffi::os::range_cached(file.as_fd(), file_offset, len as u64) {
            Ok(true) => Some(map),
            Ok(false) => None,
            Err(e) => {
                if !self.no_cachestat.swap(true, Ordering::Relaxed) {
                    tracing::debug!("cachestat: {e}: image Reads by pread");
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_mode_names_round_trip_and_bad_names_are_refused() {
        let default = if guarded_copy::available() {
            ReadMode::Mapped
        } else {
            ReadMode::Pread
        };
        assert_eq!(ReadMode::parse(None).unwrap(), default);
        assert_eq!(ReadMode::parse(Some("")).unwrap(), default);
        for m in [ReadMode::Mapped, ReadMode::Pread, ReadMode::Registered] {
            assert_eq!(ReadMode::parse(Some(m.name())).unwrap(), m);
        }
        let e = ReadMode::parse(Some("mmap")).unwrap_err().to_string();
        assert!(e.contains("GPUNVME_EMU_READS=mmap"), "{e}");
    }
}
