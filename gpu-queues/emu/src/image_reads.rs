//! How the software controller reads image data for Reads on GPU queues.
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
//!   (`crate::os::guarded_copy`);
//!   with `GPUNVME_EMU_COLD_READS=direct` ([`ColdReads::Direct`]), a Read none of whose pages
//!   is in the page cache (a cold image) is read from the disk straight into the staging
//!   memory by direct I/O (`O_DIRECT`), as fastsafetensors reads a checkpoint: no page-cache
//!   pages to allocate, fill and copy out of. Not the default: on the lent H200 (2026-11-29,
//!   cold 7B-shaped loads, docs/benchmarks.md) it ran at 0.78-0.99x of the buffered path in
//!   each of 5 rounds (the controller threads' Reads, one per thread at a time and spread over
//!   the file, are not fastsafetensors' 512 KiB reads in file order); with
//!   `GPUNVME_EMU_COLD_READS=prefetch` ([`ColdReads::Prefetch`]), a load's readahead hint starts
//!   a prefetch that reads the hinted ranges by direct I/O in file order into a host pool
//!   (`crate::prefetch`) and Reads in its blocks copy out of it ([`Source::Pool`]): level with
//!   the buffered path on the same disks (0.84-1.07x, 2026-11-29), so not the default either;
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
use std::sync::{Arc, Mutex, RwLock};

use gpu_queues::GpuError;
use gpu_queues::ffi::os::Mapping;
use gpu_queues::ffi::{Cuda, PinnedMemory};

use crate::os::{DIRECT_ALIGN, MappedImage, Residency, guarded_copy, reopen_direct, residency};
use crate::prefetch::Prefetch;

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
        Self::parse(gpunvme_settings::EMU_READS.value().as_deref())
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

/// How a staged Read none of whose image pages is in the page cache leaves the image
/// ([`ReadMode::Mapped`]; `GPUNVME_EMU_COLD_READS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColdReads {
    /// Read from the disk straight into staging memory (`O_DIRECT`), where the file system
    /// takes direct I/O and the Read keeps to its alignment; else as `Buffered`.
    Direct,
    /// Read through the page cache (`pread`), with the kernel's readahead (the default).
    Buffered,
    /// Read ahead of the Reads by direct I/O in file order into a bounded pool of host memory
    /// on a [`gpu_queues::QueueTransport::will_read`] hint (`crate::prefetch`), Reads copying
    /// out of it; Reads the pool does not serve go as `Buffered`.
    Prefetch,
}

impl ColdReads {
    /// The choice `GPUNVME_EMU_COLD_READS` names (unset: [`ColdReads::Buffered`]).
    pub fn from_env() -> Result<Self, GpuError> {
        Self::parse(gpunvme_settings::EMU_COLD_READS.value().as_deref())
    }

    fn parse(v: Option<&str>) -> Result<Self, GpuError> {
        let c = [
            ("direct", Self::Direct),
            ("buffered", Self::Buffered),
            ("prefetch", Self::Prefetch),
        ];
        Ok(crate::env_choice::choice(COLD_READS_ENV, v, &c)?.unwrap_or(Self::Buffered))
    }
}

/// `GPUNVME_EMU_COLD_READS=direct|buffered|prefetch`: how Reads of uncached image data are read.
const COLD_READS_ENV: &str = gpunvme_settings::EMU_COLD_READS.name;

/// Bytes per window (and the alignment of windows in the file).
pub const WINDOW_BYTES: u64 = 64 << 20;

/// `GPUNVME_EMU_READS=mapped|pread|registered`: how Read data leaves the image.
const READS_ENV: &str = gpunvme_settings::EMU_READS.name;

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
    /// A bad `GPUNVME_EMU_PIN_BUDGET` is an error.
    pub fn for_mode(cuda: &Arc<Cuda>, mode: ReadMode) -> Result<Self, GpuError> {
        let budget = gpunvme_settings::EMU_PIN_BUDGET
            .read_number_in(1, u64::MAX)
            .map_err(|e| GpuError::InvalidArgument(e.to_string()))?
            .unwrap_or_else(default_budget);
        Ok(Self::new(cuda, mode == ReadMode::Registered, budget))
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
        let (start, stop) = match crate::os::data_run(file, file_offset, lo, hi) {
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

/// Where a staged Read's bytes come from ([`ImageViews::lookup`]).
pub enum Source {
    /// Every page is in the page cache: copied out of this mapping of the image.
    Mapped(Arc<Mapping>),
    /// No page is: read by direct I/O through this descriptor.
    Direct(Arc<DirectFile>),
    /// In blocks a prefetch reads: copied out of its pool (`Prefetch::serve`), what it does
    /// not hand over by `pread`.
    Pool(Arc<Prefetch>),
    /// By `pread` on the controller's own descriptor.
    Read,
}

/// A descriptor of an image for direct reads ([`crate::os::reopen_direct`]), given up
/// for the rest of the controller's life the first time the file system refuses a read on it.
#[derive(Debug)]
pub struct DirectFile {
    file: File,
    refused: AtomicBool,
}

impl DirectFile {
    /// Fills `at..at + n` of `mem` from the image at `offset`: by direct I/O where the range
    /// keeps to [`DIRECT_ALIGN`] (the memory's address too) and direct reads were not refused,
    /// else, or when the file system refuses this one (`EINVAL`), by `pread` on `buffered`.
    /// `Ok(true)` when the bytes came by direct I/O.
    pub fn read_into(
        &self,
        mem: &PinnedMemory,
        at: usize,
        n: usize,
        offset: u64,
        buffered: &File,
    ) -> std::io::Result<bool> {
        let aligned = (mem.host_ptr().addr() + at) % DIRECT_ALIGN == 0
            && offset % DIRECT_ALIGN as u64 == 0
            && n % DIRECT_ALIGN == 0;
        if aligned && !self.refused.load(Ordering::Relaxed) {
            match mem.read_file_at(at, n, &self.file, offset) {
                Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                    if !self.refused.swap(true, Ordering::Relaxed) {
                        tracing::debug!("direct reads of the image refused ({e}): pread instead");
                    }
                }
                r => return r.map(|()| true),
            }
        }
        mem.read_file_at(at, n, buffered, offset).map(|()| false)
    }
}

/// What [`ImageViews`] keeps per image file: its mapping and its direct descriptor (`None`
/// where making one failed; not tried again).
struct FileView {
    map: Option<Arc<Mapping>>,
    direct: Option<Arc<DirectFile>>,
}

/// Whole-image read-only mappings, one per image file the controller reads, made the first
/// time a Read of that file is staged ([`ReadMode::Mapped`]); kept until the controller's GPU
/// queues are torn down. A mapping costs address space and page tables, not memory: its
/// pages are the page cache's. Beside each, a descriptor for direct reads of cold ranges
/// ([`ColdReads::Direct`]).
///
/// Consistency: the mapping is shared, so it shows the very page-cache pages the controller's
/// Writes (`pwrite`) change, as `pread` would: a Read returns the data of every Write completed
/// before it was submitted; a Write racing an overlapping Read may be seen in part (NVMe leaves
/// that undefined). The copies are raw copies in assembly, never Rust reads of shared memory.
/// A direct read is only made of a range with no page in the page cache, so no Write's data
/// waits there (and the kernel writes back a range's dirty pages before reading it direct).
pub struct ImageViews {
    enabled: bool,
    cold: ColdReads,
    /// Per file, what was made for it.
    files: Mutex<HashMap<FileKey, Arc<FileView>>>,
    /// cachestat(2) failed once (logged once).
    no_cachestat: AtomicBool,
    /// Prefetches running ([`ColdReads::Prefetch`]).
    prefetches: RwLock<Vec<Arc<Prefetch>>>,
}

impl std::fmt::Debug for ImageViews {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageViews")
            .field("enabled", &self.enabled)
            .field("cold", &self.cold)
            .finish_non_exhaustive()
    }
}

impl ImageViews {
    /// Mappings made as needed when `mode` is [`ReadMode::Mapped`] (else every lookup is
    /// [`Source::Read`]), cold ranges read as `cold` says.
    pub fn for_mode(mode: ReadMode, cold: ColdReads) -> Self {
        Self {
            enabled: mode == ReadMode::Mapped,
            cold,
            files: Mutex::new(HashMap::new()),
            no_cachestat: AtomicBool::new(false),
            prefetches: RwLock::new(Vec::new()),
        }
    }

    /// Has Reads of the image `prefetch` reads look in its pool first, until
    /// [`Self::remove_prefetch`].
    pub fn add_prefetch(&self, prefetch: Arc<Prefetch>) {
        self.prefetches
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(prefetch);
    }

    /// Ends what [`Self::add_prefetch`] began.
    pub fn remove_prefetch(&self, prefetch: &Arc<Prefetch>) {
        self.prefetches
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p| !Arc::ptr_eq(p, prefetch));
    }

    /// The prefetch that reads the block of `key`'s file holding `file_offset`, if one does.
    fn prefetch_of(&self, key: FileKey, file_offset: u64) -> Option<Arc<Prefetch>> {
        let running = self.prefetches.read().unwrap_or_else(|e| e.into_inner());
        running
            .iter()
            .find(|p| p.file_id() == (key.dev, key.ino) && p.covers(file_offset))
            .cloned()
    }

    /// Whether cold ranges are read by direct I/O (where the file system takes it).
    pub fn cold_reads(&self) -> ColdReads {
        if self.enabled {
            self.cold
        } else {
            ColdReads::Buffered
        }
    }

    /// Where `len` bytes of `file` at `file_offset` are read from: a prefetch's pool where one
    /// reads the range's first block ([`ColdReads::Prefetch`]); its mapping (made for the
    /// whole file, at its current length, on the first lookup) when every page of the range is
    /// in the page cache; its direct descriptor when none is ([`ColdReads::Direct`]); else, or
    /// when disabled, for an empty range or one past the mapped length, where the file cannot
    /// be mapped, or where the kernel cannot say (no `cachestat(2)`), `pread`.
    pub fn lookup(&self, file: &File, file_offset: u64, len: usize) -> Source {
        if !self.enabled || len == 0 {
            return Source::Read;
        }
        let Some(key) = FileKey::of(file) else {
            return Source::Read;
        };
        if let Some(p) = self.prefetch_of(key, file_offset) {
            return Source::Pool(p);
        }
        // The table's lock covers the lookup only, not the cachestat below: every controller
        // thread comes here once per Read.
        let view = self
            .files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key)
            .or_insert_with(|| Arc::new(self.view_of(file)))
            .clone();
        if view.map.is_none() && view.direct.is_none() {
            return Source::Read;
        }
        // Only pages already in memory are copied out of the mapping: a Read of pages that are
        // not goes by direct I/O or `pread` (whose readahead brings in what comes next), whose
        // errors are plain error codes.
        let resident = match residency(file.as_fd(), file_offset, len as u64) {
            Ok(r) => r,
            Err(e) => {
                if !self.no_cachestat.swap(true, Ordering::Relaxed) {
                    tracing::debug!("cachestat: {e}: image Reads by pread");
                }
                return Source::Read;
            }
        };
        match (resident, &view.map, &view.direct) {
            (Residency::All, Some(map), _)
                if file_offset
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= map.len() as u64) =>
            {
                Source::Mapped(map.clone())
            }
            (Residency::None, _, Some(d)) => Source::Direct(d.clone()),
            _ => Source::Read,
        }
    }

    fn view_of(&self, file: &File) -> FileView {
        let map = file
            .metadata()
            .ok()
            .and_then(|m| usize::try_from(m.len()).ok())
            .and_then(|len| match Mapping::read_only(file.as_fd(), len) {
                Ok(m) => Some(Arc::new(m)),
                Err(e) => {
                    tracing::debug!("image not mapped for reads ({len} bytes): {e}");
                    None
                }
            });
        let direct = (self.cold == ColdReads::Direct)
            .then(|| match reopen_direct(file) {
                Ok(f) => Some(Arc::new(DirectFile {
                    file: f,
                    refused: AtomicBool::new(false),
                })),
                Err(e) => {
                    tracing::debug!("no direct reads of the image: {e}");
                    None
                }
            })
            .flatten();
        FileView { map, direct }
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

    #[test]
    fn cold_reads_default_to_buffered_and_bad_names_are_refused() {
        assert_eq!(ColdReads::parse(None).unwrap(), ColdReads::Buffered);
        assert_eq!(
            ColdReads::parse(Some(" buffered")).unwrap(),
            ColdReads::Buffered
        );
        assert_eq!(ColdReads::parse(Some("direct")).unwrap(), ColdReads::Direct);
        let e = ColdReads::parse(Some("odirect")).unwrap_err().to_string();
        assert!(e.contains("GPUNVME_EMU_COLD_READS=odirect"), "{e}");
    }
}
