//! blockfs files on the GPU, cuFile-like: open a file (or every file under a prefix) for the
//! GPU, then read and write byte ranges of it into and out of GPU memory with commands that GPU
//! threads issue on the [`GpuQueues`] themselves (`ptx/include/gpunvme_file.cuh`).
//!
//! - [`GpuFiles::open`] / [`GpuFiles::open_prefix`]: the file's (or the batch's) blockfs extent
//!   table is copied into GPU memory; the [`blockfs::PinnedTable`] is held by the returned
//!   [`GpuFile`]s, so the blocks the GPU reads stay out of reuse until the last handle goes.
//! - [`GpuFiles::reserve`]: a device-write reservation ([`blockfs::File::reserve_device_write`],
//!   no zero fill): the writable table goes to GPU memory; [`GpuFile::commit`] (or
//!   [`GpuFile::commit_with_crc`]) sets the new length afterwards, and the caller's
//!   `FileSystem::sync` makes it durable.
//! - [`GpuFiles::read`] / [`GpuFiles::write`]: one range, synchronously; [`GpuFiles::run`]:
//!   a batch of ranges over many files in one kernel; [`GpuFiles::submit`] /
//!   [`GpuFiles::submit_on`]: the same on a stream, returning a [`Pending`] to wait on.
//! - [`GpuFiles::crc32c`]: CRC-32C (blockfs's data checksum) of GPU memory, computed on the GPU.
//!
//! How a range moves (the device code says it at length): it is cut into chunks at multiples of
//! the chunk size (the controller's maximum transfer) of the file offset; every chunk goes to one
//! lane of a warp (or one thread); the lane cuts its chunk into pieces ([`plan_piece`]): whole
//! LBAs straight between the device and the caller's memory (DIRECT), unaligned heads and tails
//! (and whole LBAs whose GPU address is not 4-byte aligned) through the slot buffer of the
//! command's ticket (BOUNCE), and a write's partial LBAs by read-modify-write through a scratch
//! LBA (RMW). The pure functions here ([`plan_piece`], [`plan_range`], [`chunk_count`],
//! [`chunk_of`], the `crc32c_*`) are the Rust twins of the device functions of the same names,
//! so the algorithm is tested where there is no GPU.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use blockfs::table::{ExtentTable, TABLE_FILE_WRITABLE};
use blockfs::{DeviceWrite, FileSystem, OpenMode, PinnedTable};
use gpu_queues::ffi::{Arg, DeviceMemory, Stream};
use gpu_queues::queues::compute_wait_bound;
use gpu_queues::{DeviceStatus, GpuError, GpuQueues, ReadAhead};
use zerocopy::{FromZeros, IntoBytes};

use crate::desc::{CRC32C_COMBINE_THREADS, FileIo, FileParams};
use crate::error::FilesError;
pub use crate::plan::GpuSpan;
use crate::plan::{BatchPlan, RangeSpec, plan_batch};

/// Bytes per CRC segment (one GPU thread each).
pub const CRC_SEGMENT_BYTES: u32 = 16 << 10;

/// What keeps a table's blocks out of reuse.
enum Hold {
    /// A read-only table (an open, or a batch open).
    Pinned(#[allow(dead_code)] PinnedTable),
    /// A device-write reservation, until committed.
    Reservation(DeviceWrite),
    /// Whatever keeps the blocks of a table derived from another (a striped volume's member
    /// table: the volume file's pin, shared by every member's table).
    Shared(#[allow(dead_code)] Arc<dyn Send + Sync>),
}

/// An extent table in GPU memory, with the pin on the blocks it names.
struct GpuTable {
    device: DeviceMemory,
    table: ExtentTable,
    names: Vec<String>,
    hold: Hold,
}

/// A blockfs file opened for the GPU (cuFile's handle): its extent table is in GPU memory and
/// its blocks are pinned until the last handle sharing the table is dropped.
pub struct GpuFile {
    table: Arc<GpuTable>,
    index: u32,
}

impl std::fmt::Debug for GpuFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuFile")
            .field("name", &self.name())
            .field("size", &self.size())
            .field("alloc", &self.alloc_bytes())
            .field("writable", &self.is_writable())
            .finish()
    }
}

impl GpuFile {
    /// The file's name.
    pub fn name(&self) -> &str {
        &self.table.names[self.index as usize]
    }

    /// Its length when opened (reads stop here).
    pub fn size(&self) -> u64 {
        self.entry().size_bytes
    }

    /// Bytes its extents cover (writes through a reservation may go up to here).
    pub fn alloc_bytes(&self) -> u64 {
        self.entry().alloc_bytes
    }

    /// Whether the GPU may write it (a reservation from [`GpuFiles::reserve`]).
    pub fn is_writable(&self) -> bool {
        self.entry().flags & TABLE_FILE_WRITABLE != 0
    }

    /// The host copy of its extent table (file [`GpuFile::index`] of it).
    pub fn table(&self) -> &ExtentTable {
        &self.table.table
    }

    /// Its index in the table (the batch order of [`GpuFiles::open_prefix`]).
    pub fn index(&self) -> u32 {
        self.index
    }

    /// GPU pointer of the table (for kernels of one's own that include `gpunvme_file.cuh`).
    pub fn table_ptr(&self) -> u64 {
        self.table.device.ptr()
    }

    /// What keeps the file's table in GPU memory and its blocks pinned (or its reservation
    /// open): a share of the handle's table, for holders such as the page cache.
    pub fn keep_alive(&self) -> Box<dyn Send + Sync> {
        Box::new(self.table.clone())
    }

    fn entry(&self) -> &blockfs::table::TableFile {
        &self.table.table.files()[self.index as usize]
    }

    /// Commits a reservation's device writes: `len` becomes the file's length, no byte zero
    /// filled ([`DeviceWrite::commit`]); sync the file system to make it durable. Fails for a
    /// handle that is not a reservation.
    pub fn commit(self, len: u64) -> Result<(), FilesError> {
        self.into_reservation()?.commit(len)?;
        Ok(())
    }

    /// [`GpuFile::commit`] recording `crc` (CRC-32C of bytes `0..len`, e.g. from
    /// [`GpuFiles::crc32c`] of the data written) as the file's data checksum.
    pub fn commit_with_crc(self, len: u64, crc: u32) -> Result<(), FilesError> {
        self.into_reservation()?.commit_with_crc(len, crc)?;
        Ok(())
    }

    fn into_reservation(self) -> Result<DeviceWrite, FilesError> {
        let name = self.name().to_owned();
        let t = Arc::try_unwrap(self.table).map_err(|_| {
            FilesError::InvalidArgument(format!("{name}: the table is shared by other handles"))
        })?;
        match t.hold {
            Hold::Reservation(dw) => Ok(dw),
            Hold::Pinned(_) | Hold::Shared(_) => Err(FilesError::InvalidArgument(format!(
                "{name} was opened for reading: only a reservation (GpuFiles::reserve) commits"
            ))),
        }
    }
}

/// One range of a batch: `span.len` bytes of `file` at `offset`, read into or written from
/// `span`.
#[derive(Clone, Copy, Debug)]
pub struct FileRange<'a> {
    /// The file.
    pub file: &'a GpuFile,
    /// Write `span` into the file (else read the file into `span`).
    pub write: bool,
    /// First byte of the file.
    pub offset: u64,
    /// The GPU memory.
    pub span: GpuSpan,
}

impl<'a> FileRange<'a> {
    /// A read of `span.len` bytes at `offset` into `span`.
    pub fn read(file: &'a GpuFile, offset: u64, span: GpuSpan) -> Self {
        Self {
            file,
            write: false,
            offset,
            span,
        }
    }

    /// A write of `span` at `offset`.
    pub fn write(file: &'a GpuFile, offset: u64, span: GpuSpan) -> Self {
        Self {
            file,
            write: true,
            offset,
            span,
        }
    }
}

/// How [`GpuFiles`] runs its kernel.
#[derive(Clone, Debug)]
pub struct GpuFilesOptions {
    /// One chunk per lane of a warp (default; needs rings of 32 entries or more), else one
    /// chunk per thread.
    pub warp: bool,
    /// Chunk size (default: the controller's maximum transfer; a multiple of 4096).
    pub chunk_bytes: Option<u32>,
    /// Most warps (or threads / 32) the kernel launches (default: 32 per queue... as many as
    /// every queue can keep busy: depth / 32 warps per queue).
    pub max_warps: Option<u32>,
    /// How warps take chunks (warp mode). Default [`ChunkOrder::Claim`]; the setting
    /// `GPUNVME_FILE_CHUNKS=claim|spread` chooses ([`GpuFilesOptions::from_env`]).
    pub chunks: ChunkOrder,
    /// Warps per queue with [`ChunkOrder::Claim`] (default 2; the setting
    /// `GPUNVME_FILE_CLAIM_WARPS`, 1 to 8): enough commands in flight to keep each queue's server busy, few
    /// enough that when the chunks run out no queue holds much more than another.
    pub claim_warps: u32,
    /// The fewest chunks a claim takes with [`ChunkOrder::Claim`] (default 8; the setting
    /// `GPUNVME_FILE_CLAIM_LEAST`, 1 to 32): claims start at 32 chunks and
    /// shrink to this in the batch's last round ([`crate::plan::claim_size`]); 32 keeps them
    /// whole.
    pub claim_least: u32,
    /// Bound of a host-side wait for a batch (every device-side wait is bounded by the queues'
    /// own timeout as well).
    pub timeout: Duration,
}

impl Default for GpuFilesOptions {
    /// The defaults, whatever the environment holds ([`GpuFilesOptions::from_env`] applies
    /// the settings).
    fn default() -> Self {
        Self {
            warp: true,
            chunk_bytes: None,
            max_warps: None,
            chunks: ChunkOrder::Claim,
            claim_warps: 2,
            claim_least: 8,
            timeout: Duration::from_secs(600),
        }
    }
}

impl GpuFilesOptions {
    /// The defaults with the settings `GPUNVME_FILE_CHUNKS`, `GPUNVME_FILE_CLAIM_WARPS` and
    /// `GPUNVME_FILE_CLAIM_LEAST` applied (docs/settings.md); a value that cannot be used is
    /// [`FilesError::InvalidArgument`].
    pub fn from_env() -> Result<Self, FilesError> {
        use gpunvme_settings::{FILE_CHUNKS, FILE_CLAIM_LEAST, FILE_CLAIM_WARPS};
        let bad = |e: gpunvme_settings::SettingError| FilesError::InvalidArgument(e.to_string());
        let mut o = Self::default();
        match FILE_CHUNKS.value().as_deref() {
            None | Some("claim") => {}
            Some("spread") => o.chunks = ChunkOrder::Spread,
            Some(v) => return Err(bad(FILE_CHUNKS.invalid(v))),
        }
        if let Some(n) = FILE_CLAIM_WARPS.read_number_in(1, 8).map_err(bad)? {
            o.claim_warps = n as u32;
        }
        if let Some(n) = FILE_CLAIM_LEAST.read_number_in(1, 32).map_err(bad)? {
            o.claim_least = n as u32;
        }
        Ok(o)
    }
}

/// How the batch file kernel's warps take chunks (warp mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkOrder {
    /// A few warps per queue ([`GpuFilesOptions::claim_warps`]), each claiming its next chunks
    /// (32, fewer as the batch ends: [`crate::plan::claim_size`]) once its last ones are done,
    /// so queues served faster take more (a software controller's threads do not all run at
    /// one speed, and equal shares finish at different times); a batch of one round or less
    /// is spread as [`ChunkOrder::Spread`].
    Claim,
    /// A multiple of the queue count of warps where the cap allows, each round's chunks cut
    /// evenly over them ([`crate::plan::file_warps`], [`crate::plan::warp_span`]): every queue
    /// gets the same work.
    Spread,
}

/// How a batch ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// Chunks of all ranges.
    pub chunks: u64,
    /// Blocks × threads per block.
    pub grid: (u32, u32),
    /// Warps that take chunks (warp mode; the grid's last block may hold more).
    pub warps: u32,
    /// Whether they claimed chunks ([`ChunkOrder::Claim`] with more than one round of work).
    pub claim: bool,
    /// Lanes of a warp together (else threads alone).
    pub warp: bool,
    /// Chunk size in bytes.
    pub chunk_bytes: u32,
}

/// What a batch did: per range, the bytes moved or why it failed.
#[derive(Debug)]
pub struct BatchResult {
    /// In the order of the ranges given.
    pub ranges: Vec<Result<u64, FilesError>>,
    /// Launch to the kernel's end.
    pub elapsed: Duration,
    /// The launch.
    pub shape: LaunchShape,
}

impl BatchResult {
    /// Total bytes of the ranges that succeeded.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().filter_map(|r| r.as_ref().ok()).sum()
    }

    /// The first failure, if any (and the result otherwise).
    pub fn into_first_error(mut self) -> Result<Self, FilesError> {
        if let Some(i) = self.ranges.iter().position(Result::is_err) {
            return Err(self.ranges.swap_remove(i).expect_err("an error"));
        }
        Ok(self)
    }
}

/// A batch launched on a stream: wait for it with [`Pending::wait`]. Dropping it without
/// waiting aborts the queues' device-side waits and waits for the kernel (its memory must
/// outlive it).
pub struct Pending<'q> {
    files: &'q GpuFiles<'q>,
    stream: &'q Stream,
    ios: Vec<FileIo>,
    names: Vec<String>,
    /// Bytes each range moves if it succeeds (reads clamped at the length).
    lens: Vec<u64>,
    _params: DeviceMemory,
    ios_mem: Option<DeviceMemory>,
    _scratch: Option<DeviceMemory>,
    start: Instant,
    shape: LaunchShape,
    waited: bool,
}

impl std::fmt::Debug for Pending<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("ranges", &self.ios.len())
            .field("shape", &self.shape)
            .finish()
    }
}

impl Pending<'_> {
    /// Whether the kernel has finished.
    pub fn is_done(&self) -> Result<bool, FilesError> {
        Ok(self.stream.is_idle()?)
    }

    /// Waits (bounded by [`GpuFilesOptions::timeout`]) for the batch and returns each range's
    /// outcome.
    pub fn wait(self) -> Result<BatchResult, FilesError> {
        self.wait_watched(|| None)
    }

    /// [`Pending::wait`], calling `watchdog` about every millisecond: when it returns a reason
    /// (controller fatal, device gone), every device-side wait is aborted and the ranges still
    /// running fail with `GPUNVME_ABORTED`.
    pub fn wait_watched(
        mut self,
        mut watchdog: impl FnMut() -> Option<String>,
    ) -> Result<BatchResult, FilesError> {
        self.waited = true;
        let limit = self.files.opts.timeout;
        let mut aborted = false;
        while !self.stream.is_idle()? {
            if !aborted && let Some(why) = watchdog() {
                tracing::warn!(reason = %why, "aborting GPU file I/O");
                self.files.queues.abort();
                aborted = true;
            }
            if self.start.elapsed() > limit {
                self.files.queues.abort();
                self.stream.wait_idle(compute_wait_bound())?;
                return Err(FilesError::Gpu(GpuError::Timeout {
                    what: "GPU file I/O kernel",
                    waited: limit,
                }));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        let elapsed = self.start.elapsed();
        let mut out = vec![FileIo::new_zeroed(); self.ios.len()];
        if let Some(m) = &self.ios_mem {
            m.read(0, out.as_mut_bytes())?;
        }
        let ranges = out
            .iter()
            .zip(&self.ios)
            .zip(self.names.iter().zip(&self.lens))
            .map(|((got, asked), (name, &len))| {
                if asked.len == 0 || got.status == 0 {
                    Ok(len)
                } else {
                    Err(FilesError::FileIo {
                        op: if asked.write != 0 { "write" } else { "read" },
                        name: name.clone(),
                        offset: asked.offset,
                        end: asked.offset + asked.len,
                        status: DeviceStatus::from_code(got.status),
                        nvme_status: got.nvme_status as u16,
                    })
                }
            })
            .collect();
        Ok(BatchResult {
            ranges,
            elapsed,
            shape: self.shape,
        })
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.waited && !self.stream.is_idle().unwrap_or(true) {
            self.files.queues.abort();
            if let Err(e) = self.stream.wait_idle(compute_wait_bound()) {
                tracing::error!(error = %e, "a GPU file I/O kernel outlived its batch");
            }
        }
    }
}

/// GPU file I/O on a set of GPU queues (cuFile's driver handle).
pub struct GpuFiles<'q> {
    queues: &'q GpuQueues,
    opts: GpuFilesOptions,
}

impl std::fmt::Debug for GpuFiles<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuFiles")
            .field("queues", &self.queues)
            .field("opts", &self.opts)
            .finish()
    }
}

impl<'q> GpuFiles<'q> {
    /// File I/O on `queues` (their controller must serve the namespace the file system is on).
    pub fn new(queues: &'q GpuQueues, opts: GpuFilesOptions) -> Self {
        Self { queues, opts }
    }

    /// The queues.
    pub fn queues(&self) -> &'q GpuQueues {
        self.queues
    }

    fn upload(
        &self,
        table: ExtentTable,
        names: Vec<String>,
        hold: Hold,
    ) -> Result<Arc<GpuTable>, FilesError> {
        let h = table.header();
        if h.nsid == 0 {
            return Err(FilesError::Gpu(GpuError::Unsupported(
                "the file system is not on an NVMe namespace (its extent table names none)".into(),
            )));
        }
        let device = DeviceMemory::alloc(self.queues.cuda(), table.as_bytes().len())?;
        device.write(0, table.as_bytes())?;
        Ok(Arc::new(GpuTable {
            device,
            table,
            names,
            hold,
        }))
    }

    /// Hints the controller that `files` are about to be read whole
    /// ([`GpuQueues::will_read`] with each file's LBA runs, [`crate::plan::read_runs`]): the
    /// software controller has the kernel read what of them is not in the page cache, ahead
    /// of its threads, from while the caller gets ready (allocating the memory to read into,
    /// say) to the end of the reads. The hint lasts until the result is dropped; keep it across
    /// the reads.
    pub fn will_read(&self, files: &[&GpuFile]) -> ReadAhead {
        // Runs per (namespace, LBA shift), each in the files' order.
        let mut by_ns = std::collections::BTreeMap::<(u32, u32), Vec<(u64, u64)>>::new();
        for f in files {
            let h = f.table().header();
            by_ns
                .entry((h.nsid, h.lba_shift))
                .or_default()
                .extend(crate::plan::read_runs(f.table(), f.index as usize));
        }
        let running: Vec<ReadAhead> = by_ns
            .iter()
            .map(|(&(ns, shift), runs)| self.queues.will_read(ns, shift, runs))
            .filter(ReadAhead::is_running)
            .collect();
        if running.is_empty() {
            ReadAhead::none()
        } else {
            ReadAhead::running(Box::new(running))
        }
    }

    /// Opens `file` for GPU reads: its extent table (a snapshot: its length now, its whole
    /// allocation) goes to GPU memory, pinned while the handle lives.
    pub fn open(&self, file: &blockfs::File) -> Result<GpuFile, FilesError> {
        let pinned = file.extent_table()?;
        let table = pinned.table().clone();
        let t = self.upload(table, vec![file.name().to_owned()], Hold::Pinned(pinned))?;
        Ok(GpuFile { table: t, index: 0 })
    }

    /// Puts `table` (one file, named `name`: a table derived from another, such as a striped
    /// volume's member table) in GPU memory for reads; `keep` keeps its blocks pinned for as
    /// long as the handle lives.
    pub fn open_table(
        &self,
        table: ExtentTable,
        name: &str,
        keep: Arc<dyn Send + Sync>,
    ) -> Result<GpuFile, FilesError> {
        let t = self.upload(table, vec![name.to_owned()], Hold::Shared(keep))?;
        Ok(GpuFile { table: t, index: 0 })
    }

    /// Opens every file whose name starts with `prefix`, in name order, with ONE table in GPU
    /// memory for all of them (blockfs's batch open): one handle per file, sharing it.
    pub fn open_prefix(&self, fs: &FileSystem, prefix: &str) -> Result<Vec<GpuFile>, FilesError> {
        let batch = fs.open_prefix(prefix, OpenMode::ReadOnly)?;
        let table = batch.table.table().clone();
        let n = batch.names.len() as u32;
        let t = self.upload(table, batch.names, Hold::Pinned(batch.table))?;
        Ok((0..n)
            .map(|index| GpuFile {
                table: t.clone(),
                index,
            })
            .collect())
    }

    /// Reserves `file` for GPU writes up to `len` bytes ([`blockfs::File::reserve_device_write`]:
    /// allocates what is missing, no zero fill) and puts the writable table in GPU memory.
    /// Write through the handle, then [`GpuFile::commit`] and sync.
    pub fn reserve(&self, file: &blockfs::File, len: u64) -> Result<GpuFile, FilesError> {
        let dw = file.reserve_device_write(len)?;
        let table = dw.table().clone();
        let t = self.upload(table, vec![file.name().to_owned()], Hold::Reservation(dw))?;
        Ok(GpuFile { table: t, index: 0 })
    }

    /// Reads `span.len` bytes of `file` at `offset` into `span`, stopping at the file's length
    /// (like `pread`): returns the bytes read (0 at or past the end).
    pub fn read(&self, file: &GpuFile, span: GpuSpan, offset: u64) -> Result<u64, FilesError> {
        let r = self.run(&[FileRange::read(file, offset, span)])?;
        r.ranges.into_iter().next().unwrap_or(Ok(0))
    }

    /// Writes `span` into `file` at `offset` (a reservation; the range must lie inside its
    /// allocation).
    pub fn write(&self, file: &GpuFile, span: GpuSpan, offset: u64) -> Result<(), FilesError> {
        let r = self.run(&[FileRange::write(file, offset, span)])?;
        r.ranges.into_iter().next().unwrap_or(Ok(0)).map(|_| ())
    }

    /// Runs a batch synchronously (one kernel for all ranges).
    pub fn run(&self, ranges: &[FileRange<'_>]) -> Result<BatchResult, FilesError> {
        self.submit(ranges)?.wait()
    }

    /// Launches a batch on the queues' client stream.
    pub fn submit<'a>(&'a self, ranges: &[FileRange<'_>]) -> Result<Pending<'a>, FilesError> {
        self.submit_on(self.queues.client_stream(), ranges)
    }

    /// Launches a batch on `stream` (one of the clients' partition:
    /// [`GpuQueues::new_client_stream`]), after the work queued there before; returns at
    /// once. Reads are clamped at each file's length; a range past what the file allows fails
    /// here, before anything runs.
    pub fn submit_on<'a>(
        &'a self,
        stream: &'a Stream,
        ranges: &[FileRange<'_>],
    ) -> Result<Pending<'a>, FilesError> {
        let q = self.queues;
        let chunk_bytes = match self.opts.chunk_bytes {
            Some(c) if c == 0 || c % 4096 != 0 => {
                return Err(FilesError::InvalidArgument(format!(
                    "chunk of {c} bytes (a nonzero multiple of 4096)"
                )));
            }
            Some(c) => c,
            None => (q.max_transfer() / 4096 * 4096).max(4096),
        };
        let specs: Vec<RangeSpec> = ranges
            .iter()
            .map(|r| RangeSpec {
                name: r.file.name().to_owned(),
                table_ptr: r.file.table_ptr(),
                index: r.file.index,
                entry: *r.file.entry(),
                lba_shift: r.file.table().header().lba_shift,
                write: r.write,
                offset: r.offset,
                span: r.span,
            })
            .collect();
        let BatchPlan {
            mut ios,
            names,
            lens,
            scratch_lbas,
            chunks,
        } = plan_batch(&specs, chunk_bytes)?;
        // Empty ranges take no chunk and share first_chunk with the next range: the kernel's
        // search for a chunk's range (the last whose first_chunk is at most the chunk) never
        // lands on them, and their status stays 0.
        let scratch_mem = if scratch_lbas > 0 {
            Some(DeviceMemory::alloc(
                q.cuda(),
                (scratch_lbas * 4096) as usize,
            )?)
        } else {
            None
        };
        if let Some(m) = &scratch_mem {
            for io in &mut ios {
                if io.scratch != 0 {
                    io.scratch = m.ptr() + (io.scratch - 1) * 4096;
                }
            }
        }
        let warp = self.opts.warp && q.depth() >= 32;
        let per_queue_warps = (q.depth() / 32).max(1);
        let max_warps = self
            .opts
            .max_warps
            .unwrap_or((q.len() as u32).saturating_mul(per_queue_warps).min(4096))
            .max(1);
        let block = 128u32;
        let order = self.opts.chunks;
        let nq = q.len() as u32;
        let claim_warps = nq
            .saturating_mul(self.opts.claim_warps.max(1))
            .min(max_warps);
        // Claims pay off only past one round of every warp.
        let claim = warp && order == ChunkOrder::Claim && chunks > 32 * claim_warps as u64;
        let warps = if claim {
            claim_warps
        } else {
            crate::plan::file_warps(chunks, nq, max_warps)
        };
        let threads = if warp {
            warps as u64 * 32
        } else {
            chunks.min(max_warps as u64 * 32).max(1)
        };
        let grid = threads.div_ceil(block as u64) as u32;
        let shape = LaunchShape {
            chunks,
            grid: (grid, block),
            warps: if warp { warps } else { 0 },
            claim,
            warp,
            chunk_bytes,
        };
        let ios_mem = if ios.is_empty() {
            None
        } else {
            let m = DeviceMemory::alloc(q.cuda(), ios.as_bytes().len())?;
            m.write(0, ios.as_bytes())?;
            Some(m)
        };
        // The parameter block, then the claims' counter (zeroed by the allocation).
        let pmem = DeviceMemory::alloc(q.cuda(), size_of::<FileParams>() + 8)?;
        let params = FileParams {
            queues: q.descriptors(),
            ios: ios_mem.as_ref().map_or(0, |m| m.ptr()),
            total_chunks: chunks,
            nqueues: q.len() as u32,
            nios: ios.len() as u32,
            chunk_bytes,
            warp_mode: warp as u32,
            warps: shape.warps,
            claim_least: self.opts.claim_least.clamp(1, 32),
            claims: if claim {
                pmem.ptr() + size_of::<FileParams>() as u64
            } else {
                0
            },
            reserved: 0,
        };
        pmem.write(0, params.as_bytes())?;
        let start = Instant::now();
        if chunks > 0 {
            stream.launch(q.kernels().file_rw, grid, block, &[Arg::U64(pmem.ptr())])?;
        }
        Ok(Pending {
            files: self,
            stream,
            ios,
            names,
            lens,
            _params: pmem,
            ios_mem,
            _scratch: scratch_mem,
            start,
            shape,
            waited: false,
        })
    }

    /// CRC-32C (blockfs's data checksum, FORMAT.md) of `len` bytes of GPU memory at `ptr`,
    /// computed on the GPU: one thread per 16 KiB segment, then one block combining them.
    pub fn crc32c(&self, ptr: u64, len: u64) -> Result<u32, FilesError> {
        crc32c_on(self.queues, self.queues.client_stream(), ptr, len)
    }

    /// Fills `blocks` blocks of `1 << block_shift` bytes of GPU memory at `ptr` (8-byte
    /// aligned) with the verification pattern of [`crate::pattern`] — block `b` holds
    /// `pattern::fill(.., seed, nsid, first + b, 1 << block_shift)` — on the GPU
    /// (`gpunvme_pattern`), and waits. For data whose every block is a known function of its
    /// index (examples, tests), generated where it is used.
    pub fn pattern_fill(
        &self,
        ptr: u64,
        seed: u64,
        nsid: u32,
        first: u64,
        blocks: u64,
        block_shift: u32,
    ) -> Result<(), FilesError> {
        self.pattern(ptr, seed, nsid, first, blocks, block_shift, false)
            .map(|_| ())
    }

    /// Checks, on the GPU, `blocks` blocks at `ptr` against the pattern
    /// [`GpuFiles::pattern_fill`] writes; returns how many blocks differ (0: all match).
    pub fn pattern_check(
        &self,
        ptr: u64,
        seed: u64,
        nsid: u32,
        first: u64,
        blocks: u64,
        block_shift: u32,
    ) -> Result<u64, FilesError> {
        self.pattern(ptr, seed, nsid, first, blocks, block_shift, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn pattern(
        &self,
        ptr: u64,
        seed: u64,
        nsid: u32,
        first: u64,
        blocks: u64,
        block_shift: u32,
        check: bool,
    ) -> Result<u64, FilesError> {
        if ptr % 8 != 0 || !(3..=20).contains(&block_shift) {
            return Err(FilesError::InvalidArgument(format!(
                "pattern of {}-byte blocks at {ptr:#x} (8-byte aligned memory, blocks of 8 B to \
                 1 MiB)",
                1u64 << block_shift.min(63)
            )));
        }
        if blocks == 0 {
            return Ok(0);
        }
        let q = self.queues;
        let bad = DeviceMemory::alloc(q.cuda(), 8)?;
        bad.write(0, &[0u8; 8])?;
        let grid = blocks.min(1 << 16) as u32;
        let stream = q.client_stream();
        stream.launch(
            q.kernels().pattern,
            grid,
            128,
            &[
                Arg::U64(ptr),
                Arg::U64(seed),
                Arg::U32(nsid),
                Arg::U64(first),
                Arg::U64(blocks),
                Arg::U32(block_shift),
                Arg::U32(check as u32),
                Arg::U64(bad.ptr()),
            ],
        )?;
        stream.wait_idle(self.opts.timeout)?;
        let mut b = [0u8; 8];
        bad.read(0, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

/// CRC-32C of GPU memory on `stream` (see [`GpuFiles::crc32c`]).
pub fn crc32c_on(
    queues: &GpuQueues,
    stream: &Stream,
    ptr: u64,
    len: u64,
) -> Result<u32, FilesError> {
    if len == 0 {
        return Ok(0);
    }
    let seg = CRC_SEGMENT_BYTES;
    let nseg = len.div_ceil(seg as u64);
    let cuda = queues.cuda();
    let crcs = DeviceMemory::alloc(cuda, (nseg * 4) as usize)?;
    let out = DeviceMemory::alloc(cuda, 4)?;
    let block = 256u32;
    let grid = u32::try_from(nseg.div_ceil(block as u64))
        .map_err(|_| FilesError::InvalidArgument(format!("{len} bytes to checksum")))?;
    let k = queues.kernels();
    stream.launch(
        k.crc32c,
        grid,
        block,
        &[
            Arg::U64(ptr),
            Arg::U64(len),
            Arg::U32(seg),
            Arg::U64(crcs.ptr()),
        ],
    )?;
    stream.launch(
        k.crc32c_combine,
        1,
        CRC32C_COMBINE_THREADS,
        &[
            Arg::U64(crcs.ptr()),
            Arg::U64(nseg),
            Arg::U32(seg),
            Arg::U64(len),
            Arg::U64(out.ptr()),
        ],
    )?;
    stream.wait_idle(compute_wait_bound())?;
    let mut b = [0u8; 4];
    out.read(0, &mut b)?;
    Ok(u32::from_le_bytes(b))
}
