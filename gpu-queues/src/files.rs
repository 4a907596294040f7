//! blockfs files on the GPU, cuFile-like: open a file (or every file under a prefix) for the
//! GPU, then read and write byte ranges of it into and out of GPU memory with commands that GPU
//! threads issue on the [`GpuQueues`] themselves (`ptx/gpunvme_file.cuh`).
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
use zerocopy::{FromZeros, IntoBytes};

use crate::desc::{
    CRC32C_COMBINE_THREADS, CRC32C_POLY, DeviceStatus, FileIo, FileParams, PIECE_BOUNCE,
    PIECE_DIRECT, PIECE_RMW,
};
use crate::error::GpuError;
use crate::ffi::{Arg, DeviceMemory, Stream};
use crate::queues::{GpuBuffer, GpuQueues};

/// Bytes per CRC segment (one GPU thread each).
pub const CRC_SEGMENT_BYTES: u32 = 16 << 10;

// ---------------------------------------------------------------------------------------------
// The device algorithm's Rust twins.

/// How a piece moves (`GPUNVME_PIECE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceKind {
    /// Whole LBAs straight between the device and the caller's GPU memory.
    Direct,
    /// Through the slot buffer of the command's ticket.
    Bounce,
    /// A write's partial LBA: read, overlay, write (two commands).
    Rmw,
}

impl PieceKind {
    /// The device code.
    pub fn code(self) -> u32 {
        match self {
            Self::Direct => PIECE_DIRECT,
            Self::Bounce => PIECE_BOUNCE,
            Self::Rmw => PIECE_RMW,
        }
    }
}

/// One command's worth of a file range (`gpunvme::fs::piece`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// File offset of its first byte.
    pub pos: u64,
    /// First device LBA.
    pub lba: u64,
    /// LBAs the command moves.
    pub blocks: u32,
    /// Bytes of the range it covers.
    pub bytes: u32,
    /// Where those bytes start in its first LBA.
    pub skip: u32,
    /// How it moves.
    pub kind: PieceKind,
}

/// The piece of `[pos, end)` of file `file` of `table` that starts at `pos`
/// (`gpunvme::fs::plan_piece`): `aligned` says whether the GPU address of byte `pos` is 4-byte
/// aligned, `max_blocks` is LBAs per command, `bounce_blocks` LBAs per slot buffer. Reads use
/// blockfs's [`ExtentTable::translate`] (stops at the length), writes
/// [`ExtentTable::translate_write`] (writable tables, up to the allocation); both are the
/// device's `lookup`. Past either: [`DeviceStatus::OutOfExtent`].
#[allow(clippy::too_many_arguments)]
pub fn plan_piece(
    table: &ExtentTable,
    file: usize,
    write: bool,
    pos: u64,
    end: u64,
    aligned: bool,
    max_blocks: u32,
    bounce_blocks: u32,
) -> Result<Piece, DeviceStatus> {
    if pos >= end {
        return Err(DeviceStatus::InvalidArgument);
    }
    let tr = if write {
        table.translate_write(file, pos)
    } else {
        table.translate(file, pos)
    }
    .ok_or(DeviceStatus::OutOfExtent)?;
    let shift = table.header().lba_shift;
    let lsize = 1u64 << shift;
    let skip = (pos & (lsize - 1)) as u32;
    let left = end - pos;
    if skip != 0 || left < lsize {
        return Ok(Piece {
            pos,
            lba: tr.lba,
            blocks: 1,
            bytes: (lsize - skip as u64).min(left) as u32,
            skip,
            kind: if write {
                PieceKind::Rmw
            } else {
                PieceKind::Bounce
            },
        });
    }
    let cap = if aligned { max_blocks } else { bounce_blocks };
    let n = (left >> shift).min(tr.contiguous_lbas).min(cap as u64);
    if n == 0 {
        return Err(DeviceStatus::InvalidArgument);
    }
    Ok(Piece {
        pos,
        lba: tr.lba,
        blocks: n as u32,
        bytes: (n << shift) as u32,
        skip: 0,
        kind: if aligned {
            PieceKind::Direct
        } else {
            PieceKind::Bounce
        },
    })
}

/// Every piece of `[start, end)` in order, as `rw_file_thread` / `rw_file_warp` issue them for
/// a range whose memory starts at device address `bus` (an RMW piece is one entry here and two
/// commands there). The same checks as the device: the range must be readable (below the
/// length) or writable (a writable table, below the allocation), and a bounce must fit a slot
/// buffer.
#[allow(clippy::too_many_arguments)]
pub fn plan_range(
    table: &ExtentTable,
    file: usize,
    write: bool,
    start: u64,
    end: u64,
    bus: u64,
    max_blocks: u32,
    bounce_blocks: u32,
) -> Result<Vec<Piece>, DeviceStatus> {
    let f = table
        .files()
        .get(file)
        .ok_or(DeviceStatus::InvalidArgument)?;
    let limit = if write { f.alloc_bytes } else { f.size_bytes };
    if (write && f.flags & TABLE_FILE_WRITABLE == 0) || end > limit {
        return Err(DeviceStatus::OutOfExtent);
    }
    if max_blocks == 0 {
        return Err(DeviceStatus::InvalidArgument);
    }
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        let aligned = (bus + (pos - start)) & 3 == 0;
        let p = plan_piece(
            table,
            file,
            write,
            pos,
            end,
            aligned,
            max_blocks,
            bounce_blocks,
        )?;
        if p.kind != PieceKind::Direct && p.blocks > bounce_blocks {
            return Err(DeviceStatus::InvalidArgument);
        }
        pos += p.bytes as u64;
        out.push(p);
    }
    Ok(out)
}

/// Chunks of `[offset, offset + len)` cut at multiples of `chunk_bytes` of the file offset
/// (0 for an empty range).
pub fn chunk_count(offset: u64, len: u64, chunk_bytes: u32) -> u64 {
    if len == 0 {
        return 0;
    }
    let c = chunk_bytes as u64;
    (offset + len - 1) / c - offset / c + 1
}

/// Chunk `k` of `[offset, offset + len)`: its byte range (`gpunvme::fs::chunk_of`).
pub fn chunk_of(offset: u64, len: u64, chunk_bytes: u32, k: u64) -> (u64, u64) {
    let c = chunk_bytes as u64;
    let s = (offset / c + k) * c;
    (s.max(offset), (s + c).min(offset + len))
}

/// `a * b` modulo the CRC-32C polynomial, reflected (`crc32c_multmodp`).
pub fn crc32c_multmodp(a: u32, mut b: u32) -> u32 {
    if a == 0 {
        return 0;
    }
    let mut m = 1u32 << 31;
    let mut p = 0;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 {
            (b >> 1) ^ CRC32C_POLY
        } else {
            b >> 1
        };
    }
    p
}

/// `x^(8n)` modulo the polynomial (`crc32c_x8n`).
pub fn crc32c_x8n(mut n: u64) -> u32 {
    let mut p = 1u32 << 31;
    let mut sq = 1u32 << 23;
    while n != 0 {
        if n & 1 != 0 {
            p = crc32c_multmodp(sq, p);
        }
        sq = crc32c_multmodp(sq, sq);
        n >>= 1;
    }
    p
}

/// The CRC-32C of `A || B` from `crc(A)`, `crc(B)` and `|B|` (`crc32c_combine`).
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    crc32c_multmodp(crc32c_x8n(len_b), crc_a) ^ crc_b
}

/// CRC-32C of `data` the way the GPU computes it: segments of `seg` bytes, each checksummed
/// alone, folded into runs the way the combining kernel's threads fold them, then a tree.
pub fn crc32c_segmented(data: &[u8], seg: u32) -> u32 {
    let crcs: Vec<u32> = data.chunks(seg as usize).map(crc32c_of).collect();
    combine_segments(&crcs, seg, data.len() as u64, CRC32C_COMBINE_THREADS)
}

/// The combining kernel's arithmetic (`gpunvme_crc32c_combine` with `threads` threads).
fn combine_segments(crcs: &[u32], seg: u32, len: u64, threads: u32) -> u32 {
    let nseg = crcs.len() as u64;
    let per = nseg.div_ceil(threads as u64);
    let mut run: Vec<(u32, u64)> = (0..threads as u64)
        .map(|t| {
            let (first, last) = ((t * per).min(nseg), ((t + 1) * per).min(nseg));
            let mut c = 0u32;
            let mut b = 0u64;
            for i in first..last {
                let n = (len - i * seg as u64).min(seg as u64);
                c = crc32c_multmodp(crc32c_x8n(n), c) ^ crcs[i as usize];
                b += n;
            }
            (c, b)
        })
        .collect();
    let mut stride = 1usize;
    while stride < run.len() {
        for t in (0..run.len()).step_by(2 * stride) {
            if t + stride < run.len() {
                let (r, rb) = run[t + stride];
                run[t] = (crc32c_combine(run[t].0, r, rb), run[t].1 + rb);
            }
        }
        stride *= 2;
    }
    run.first().map_or(0, |r| r.0)
}

/// Plain bytewise CRC-32C (the device's `crc32c_bytes`).
fn crc32c_of(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ CRC32C_POLY
            } else {
                c >> 1
            };
        }
    }
    !c
}

// ---------------------------------------------------------------------------------------------
// The host API.

/// Where a transfer's bytes are in GPU memory: a GPU pointer and the device address the
/// controller reaches it at (from a [`GpuBuffer`], whose memory is registered for the
/// controller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuSpan {
    /// GPU pointer of the first byte.
    pub ptr: u64,
    /// Its device (bus) address.
    pub bus: u64,
    /// Bytes.
    pub len: u64,
}

impl GpuSpan {
    /// Bytes `offset..offset + len` of `buf`.
    pub fn of(buf: &GpuBuffer, offset: u64, len: u64) -> Result<Self, GpuError> {
        match offset.checked_add(len) {
            Some(end) if end <= buf.len() as u64 => Ok(Self {
                ptr: buf.ptr() + offset,
                bus: buf.bus() + offset,
                len,
            }),
            _ => Err(GpuError::InvalidArgument(format!(
                "GPU buffer bytes {offset}..{} outside its {} bytes",
                offset.saturating_add(len),
                buf.len()
            ))),
        }
    }

    /// The whole of `buf`.
    pub fn all(buf: &GpuBuffer) -> Self {
        Self {
            ptr: buf.ptr(),
            bus: buf.bus(),
            len: buf.len() as u64,
        }
    }
}

/// What keeps a table's blocks out of reuse.
enum Hold {
    /// A read-only table (an open, or a batch open).
    Pinned(#[allow(dead_code)] PinnedTable),
    /// A device-write reservation, until committed.
    Reservation(DeviceWrite),
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

    fn entry(&self) -> &blockfs::table::TableFile {
        &self.table.table.files()[self.index as usize]
    }

    /// Commits a reservation's device writes: `len` becomes the file's length, no byte zero
    /// filled ([`DeviceWrite::commit`]); sync the file system to make it durable. Fails for a
    /// handle that is not a reservation.
    pub fn commit(self, len: u64) -> Result<(), GpuError> {
        self.into_reservation()?.commit(len)?;
        Ok(())
    }

    /// [`GpuFile::commit`] recording `crc` (CRC-32C of bytes `0..len`, e.g. from
    /// [`GpuFiles::crc32c`] of the data written) as the file's data checksum.
    pub fn commit_with_crc(self, len: u64, crc: u32) -> Result<(), GpuError> {
        self.into_reservation()?.commit_with_crc(len, crc)?;
        Ok(())
    }

    fn into_reservation(self) -> Result<DeviceWrite, GpuError> {
        let name = self.name().to_owned();
        let t = Arc::try_unwrap(self.table).map_err(|_| {
            GpuError::InvalidArgument(format!("{name}: the table is shared by other handles"))
        })?;
        match t.hold {
            Hold::Reservation(dw) => Ok(dw),
            Hold::Pinned(_) => Err(GpuError::InvalidArgument(format!(
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
    /// Bound of a host-side wait for a batch (every device-side wait is bounded by the queues'
    /// own timeout as well).
    pub timeout: Duration,
}

impl Default for GpuFilesOptions {
    fn default() -> Self {
        Self {
            warp: true,
            chunk_bytes: None,
            max_warps: None,
            timeout: Duration::from_secs(600),
        }
    }
}

/// How a batch ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchShape {
    /// Chunks of all ranges.
    pub chunks: u64,
    /// Blocks × threads per block.
    pub grid: (u32, u32),
    /// Lanes of a warp together (else threads alone).
    pub warp: bool,
    /// Chunk size in bytes.
    pub chunk_bytes: u32,
}

/// What a batch did: per range, the bytes moved or why it failed.
#[derive(Debug)]
pub struct BatchResult {
    /// In the order of the ranges given.
    pub ranges: Vec<Result<u64, GpuError>>,
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
    pub fn into_first_error(mut self) -> Result<Self, GpuError> {
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
    pub fn is_done(&self) -> Result<bool, GpuError> {
        self.stream.is_idle()
    }

    /// Waits (bounded by [`GpuFilesOptions::timeout`]) for the batch and returns each range's
    /// outcome.
    pub fn wait(self) -> Result<BatchResult, GpuError> {
        self.wait_watched(|| None)
    }

    /// [`Pending::wait`], calling `watchdog` about every millisecond: when it returns a reason
    /// (controller fatal, device gone), every device-side wait is aborted and the ranges still
    /// running fail with `GPUNVME_ABORTED`.
    pub fn wait_watched(
        mut self,
        mut watchdog: impl FnMut() -> Option<String>,
    ) -> Result<BatchResult, GpuError> {
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
                self.stream.wait_idle(Duration::from_secs(60))?;
                return Err(GpuError::Timeout {
                    what: "GPU file I/O kernel",
                    waited: limit,
                });
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
                    Err(GpuError::FileIo {
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
            if let Err(e) = self.stream.wait_idle(Duration::from_secs(60)) {
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
    ) -> Result<Arc<GpuTable>, GpuError> {
        let h = table.header();
        if h.nsid == 0 {
            return Err(GpuError::Unsupported(
                "the file system is not on an NVMe namespace (its extent table names none)".into(),
            ));
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

    /// Opens `file` for GPU reads: its extent table (a snapshot: its length now, its whole
    /// allocation) goes to GPU memory, pinned while the handle lives.
    pub fn open(&self, file: &blockfs::File) -> Result<GpuFile, GpuError> {
        let pinned = file.extent_table()?;
        let table = pinned.table().clone();
        let t = self.upload(table, vec![file.name().to_owned()], Hold::Pinned(pinned))?;
        Ok(GpuFile { table: t, index: 0 })
    }

    /// Opens every file whose name starts with `prefix`, in name order, with ONE table in GPU
    /// memory for all of them (blockfs's batch open): one handle per file, sharing it.
    pub fn open_prefix(&self, fs: &FileSystem, prefix: &str) -> Result<Vec<GpuFile>, GpuError> {
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
    pub fn reserve(&self, file: &blockfs::File, len: u64) -> Result<GpuFile, GpuError> {
        let dw = file.reserve_device_write(len)?;
        let table = dw.table().clone();
        let t = self.upload(table, vec![file.name().to_owned()], Hold::Reservation(dw))?;
        Ok(GpuFile { table: t, index: 0 })
    }

    /// Reads `span.len` bytes of `file` at `offset` into `span`, stopping at the file's length
    /// (like `pread`): returns the bytes read (0 at or past the end).
    pub fn read(&self, file: &GpuFile, span: GpuSpan, offset: u64) -> Result<u64, GpuError> {
        let r = self.run(&[FileRange::read(file, offset, span)])?;
        r.ranges.into_iter().next().unwrap_or(Ok(0))
    }

    /// Writes `span` into `file` at `offset` (a reservation; the range must lie inside its
    /// allocation).
    pub fn write(&self, file: &GpuFile, span: GpuSpan, offset: u64) -> Result<(), GpuError> {
        let r = self.run(&[FileRange::write(file, offset, span)])?;
        r.ranges.into_iter().next().unwrap_or(Ok(0)).map(|_| ())
    }

    /// Runs a batch synchronously (one kernel for all ranges).
    pub fn run(&self, ranges: &[FileRange<'_>]) -> Result<BatchResult, GpuError> {
        self.submit(ranges)?.wait()
    }

    /// Launches a batch on the queues' client stream.
    pub fn submit<'a>(&'a self, ranges: &[FileRange<'_>]) -> Result<Pending<'a>, GpuError> {
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
    ) -> Result<Pending<'a>, GpuError> {
        let q = self.queues;
        let chunk_bytes = match self.opts.chunk_bytes {
            Some(c) if c == 0 || c % 4096 != 0 => {
                return Err(GpuError::InvalidArgument(format!(
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
        let threads = if warp {
            (chunks.div_ceil(32).min(max_warps as u64) * 32).max(32)
        } else {
            chunks.min(max_warps as u64 * 32).max(1)
        };
        let grid = threads.div_ceil(block as u64) as u32;
        let shape = LaunchShape {
            chunks,
            grid: (grid, block),
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
        let params = FileParams {
            queues: q.descriptors(),
            ios: ios_mem.as_ref().map_or(0, |m| m.ptr()),
            total_chunks: chunks,
            nqueues: q.len() as u32,
            nios: ios.len() as u32,
            chunk_bytes,
            warp_mode: warp as u32,
            reserved: [0; 3],
        };
        let pmem = DeviceMemory::alloc(q.cuda(), size_of::<FileParams>())?;
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
    pub fn crc32c(&self, ptr: u64, len: u64) -> Result<u32, GpuError> {
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
    ) -> Result<(), GpuError> {
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
    ) -> Result<u64, GpuError> {
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
    ) -> Result<u64, GpuError> {
        if ptr % 8 != 0 || !(3..=20).contains(&block_shift) {
            return Err(GpuError::InvalidArgument(format!(
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
pub fn crc32c_on(queues: &GpuQueues, stream: &Stream, ptr: u64, len: u64) -> Result<u32, GpuError> {
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
        .map_err(|_| GpuError::InvalidArgument(format!("{len} bytes to checksum")))?;
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
    stream.wait_idle(Duration::from_secs(60))?;
    let mut b = [0u8; 4];
    out.read(0, &mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// One range of a batch as the planner sees it (what a [`FileRange`] says, with its file's
/// table entry).
#[derive(Clone, Debug)]
pub struct RangeSpec {
    /// The file's name (for errors).
    pub name: String,
    /// GPU pointer of its table.
    pub table_ptr: u64,
    /// Its index in the table.
    pub index: u32,
    /// Its table entry.
    pub entry: blockfs::table::TableFile,
    /// The table's log2 LBA size.
    pub lba_shift: u32,
    /// Write (else read).
    pub write: bool,
    /// First byte of the file.
    pub offset: u64,
    /// The GPU memory.
    pub span: GpuSpan,
}

/// A batch as the kernel gets it.
#[derive(Clone, Debug)]
pub struct BatchPlan {
    /// The kernel's ranges, in the caller's order; `scratch` is 1 + the index of the range's
    /// first scratch LBA (4 KiB apart) or 0, made a pointer once the scratch exists.
    pub ios: Vec<FileIo>,
    /// Each range's file name.
    pub names: Vec<String>,
    /// Bytes each range moves (reads clamped at the length).
    pub lens: Vec<u64>,
    /// Scratch LBAs the writes need (two per write with a partial LBA).
    pub scratch_lbas: u64,
    /// Chunks in all.
    pub chunks: u64,
}

/// Plans a batch: clamps reads at each file's length (like `pread`), refuses ranges past what
/// a file allows (writes: a writable table, below the allocation), counts each range's chunks
/// (prefix sums in `first_chunk`: the kernel finds a chunk's range by binary search, see
/// [`range_of_chunk`]) and gives scratch to writes with a partial LBA.
pub fn plan_batch(ranges: &[RangeSpec], chunk_bytes: u32) -> Result<BatchPlan, GpuError> {
    let mut plan = BatchPlan {
        ios: Vec::with_capacity(ranges.len()),
        names: Vec::with_capacity(ranges.len()),
        lens: Vec::with_capacity(ranges.len()),
        scratch_lbas: 0,
        chunks: 0,
    };
    for r in ranges {
        let f = &r.entry;
        let lsize = 1u64 << r.lba_shift;
        let out_of_file = |limit, what| GpuError::OutOfFile {
            name: r.name.clone(),
            offset: r.offset,
            end: r.offset.saturating_add(r.span.len),
            what,
            limit,
        };
        let (len, limit, what) = if r.write {
            if f.flags & TABLE_FILE_WRITABLE == 0 {
                return Err(out_of_file(0, "read-only table"));
            }
            (r.span.len, f.alloc_bytes, "allocation")
        } else {
            let len = r.span.len.min(f.size_bytes.saturating_sub(r.offset));
            (len, f.size_bytes, "length")
        };
        // A read at or past the end reads nothing (pread); anything else must fit.
        if (r.write || len > 0) && r.offset.checked_add(len).is_none_or(|e| e > limit) {
            return Err(out_of_file(limit, what));
        }
        let needs_scratch = r.write && len > 0 && (r.offset % lsize != 0 || len % lsize != 0);
        let scratch = if needs_scratch {
            plan.scratch_lbas += 2;
            plan.scratch_lbas - 1
        } else {
            0
        };
        plan.ios.push(FileIo {
            table: r.table_ptr,
            offset: r.offset,
            len,
            ptr: r.span.ptr,
            bus: r.span.bus,
            scratch,
            first_chunk: plan.chunks,
            file: r.index,
            write: r.write as u32,
            status: 0,
            nvme_status: 0,
        });
        plan.names.push(r.name.clone());
        plan.lens.push(len);
        plan.chunks += chunk_count(r.offset, len, chunk_bytes);
    }
    Ok(plan)
}

/// The range holding chunk `c` (the kernel's `file_chunk_setup`): the last whose
/// `first_chunk` is at most `c`.
pub fn range_of_chunk(ios: &[FileIo], c: u64) -> usize {
    let (mut lo, mut hi) = (0usize, ios.len());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if ios[mid].first_chunk <= c {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockfs::{CreateOptions, FileSystem, MemDevice, MkfsOptions};

    /// A small deterministic generator (no dependency for the tests).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 17
        }
        fn below(&mut self, n: u64) -> u64 {
            if n == 0 { 0 } else { self.next() % n }
        }
    }

    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut g = Lcg(seed);
        (0..n).map(|_| g.next() as u8).collect()
    }

    /// A file system on memory with `name` of `len` bytes spread over many extents (its
    /// appends interleave with another file's), and the device to look at its blocks.
    fn fragmented(lba: u32, len: usize) -> (Arc<MemDevice>, FileSystem, Vec<u8>) {
        let dev = Arc::new(MemDevice::new(lba, (64 << 20) / lba as u64));
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
        let data = bytes(len as u64 ^ lba as u64, len);
        let a = fs
            .create("dir/a", &CreateOptions::default())
            .expect("create");
        let b = fs
            .create("dir/b", &CreateOptions::default())
            .expect("create");
        let step = 4096 * 3 + 512;
        let mut at = 0;
        while at < len {
            let n = step.min(len - at);
            a.write_at(at as u64, &data[at..at + n]).expect("write a");
            b.write_at(at as u64, &data[at..at + n]).expect("write b");
            at += n;
        }
        fs.sync().expect("sync");
        (dev, fs, data)
    }

    /// The device model: runs `pieces` of a range whose memory is `mem` (byte `start` of the
    /// file at mem[0]) against the blocks of `dev`, as the kernels do (bounce and RMW through a
    /// buffer of whole LBAs).
    fn execute(
        dev: &MemDevice,
        lsize: u64,
        write: bool,
        start: u64,
        pieces: &[Piece],
        mem: &mut [u8],
    ) {
        for p in pieces {
            let at = (p.pos - start) as usize;
            let n = p.bytes as usize;
            let dev_at = p.lba * lsize;
            match (p.kind, write) {
                (PieceKind::Direct, false) => dev.load(dev_at, &mut mem[at..at + n]),
                (PieceKind::Direct, true) => dev.store(dev_at, &mem[at..at + n]),
                (PieceKind::Bounce, false) => {
                    let mut buf = vec![0u8; p.blocks as usize * lsize as usize];
                    dev.load(dev_at, &mut buf);
                    let s = p.skip as usize;
                    mem[at..at + n].copy_from_slice(&buf[s..s + n]);
                }
                (PieceKind::Bounce, true) => {
                    assert_eq!(n as u64, p.blocks as u64 * lsize, "whole LBAs");
                    dev.store(dev_at, &mem[at..at + n]);
                }
                (PieceKind::Rmw, true) => {
                    let mut buf = vec![0u8; lsize as usize];
                    dev.load(dev_at, &mut buf);
                    let s = p.skip as usize;
                    buf[s..s + n].copy_from_slice(&mem[at..at + n]);
                    dev.store(dev_at, &buf);
                }
                (PieceKind::Rmw, false) => panic!("a read planned a read-modify-write"),
            }
        }
    }

    /// Plans `[offset, offset + len)` chunk by chunk as the batch kernel does, checks the
    /// pieces' invariants, and runs them.
    #[allow(clippy::too_many_arguments)]
    fn run_range(
        dev: &MemDevice,
        table: &ExtentTable,
        write: bool,
        offset: u64,
        mem: &mut [u8],
        bus: u64,
        chunk: u32,
        max_blocks: u32,
        bounce_blocks: u32,
    ) -> Result<(), DeviceStatus> {
        let len = mem.len() as u64;
        let shift = table.header().lba_shift;
        let lsize = 1u64 << shift;
        let end = offset + len;
        let mut covered = offset;
        for k in 0..chunk_count(offset, len, chunk) {
            let (cs, ce) = chunk_of(offset, len, chunk, k);
            assert_eq!(cs, covered, "chunks tile the range");
            assert!(ce > cs && (cs == offset || cs % chunk as u64 == 0));
            let pieces = plan_range(
                table,
                0,
                write,
                cs,
                ce,
                bus + (cs - offset),
                max_blocks,
                bounce_blocks,
            )?;
            let mut pos = cs;
            for p in &pieces {
                assert_eq!(p.pos, pos);
                assert!(p.bytes > 0 && p.blocks > 0);
                match p.kind {
                    PieceKind::Direct => {
                        assert!(p.blocks <= max_blocks && p.skip == 0);
                        assert_eq!((bus + (p.pos - offset)) & 3, 0, "PRPs need dword alignment");
                    }
                    PieceKind::Bounce => assert!(p.blocks <= bounce_blocks),
                    PieceKind::Rmw => {
                        assert!(write && p.blocks == 1);
                        // The scratch rule of the kernel: a partial head is in the first
                        // chunk (scratch LBA 0), a partial tail in the last (scratch LBA 1).
                        assert!(cs == offset || ce == end, "RMW in a middle chunk");
                    }
                }
                // One extent: the last LBA of the piece is where the table says.
                let last = p.pos + p.bytes as u64 - 1;
                let tr = if write {
                    table.translate_write(0, last)
                } else {
                    table.translate(0, last)
                }
                .expect("inside the file");
                assert_eq!(tr.lba, p.lba + ((last >> shift) - (p.pos >> shift)));
                pos += p.bytes as u64;
            }
            assert_eq!(pos, ce, "pieces tile the chunk");
            let at = (cs - offset) as usize;
            execute(
                dev,
                lsize,
                write,
                cs,
                &pieces,
                &mut mem[at..(ce - offset) as usize],
            );
            covered = ce;
        }
        assert_eq!(covered, end);
        Ok(())
    }

    #[test]
    fn reads_of_any_range_match_the_host() {
        for lba in [512u32, 4096] {
            let len = 300_000 + 123;
            let (dev, fs, data) = fragmented(lba, len);
            let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            let table = file.extent_table().expect("table");
            assert!(
                table.extents().len() > 3,
                "fragmented: {:?}",
                table.extents().len()
            );
            let mut g = Lcg(lba as u64);
            let mut cases: Vec<(u64, u64)> = vec![
                (0, len as u64),
                (1, len as u64 - 1),
                (0, 1),
                (len as u64 - 1, 1),
                (4095, 2),
                (511, 4097 * 3),
                (len as u64 - 700, 700),
            ];
            for _ in 0..60 {
                let off = g.below(len as u64);
                cases.push((off, 1 + g.below(len as u64 - off)));
            }
            for (i, &(off, n)) in cases.iter().enumerate() {
                let bus = 0x10_0000 + (i as u64 % 5); // misaligned addresses bounce
                let chunk = [4096u32, 8192, 65536, 1 << 20][i % 4];
                let (max_blocks, bounce) = [(3, 2), (256, 8), (64, 1)][i % 3];
                let mut got = vec![0u8; n as usize];
                run_range(
                    &dev, &table, false, off, &mut got, bus, chunk, max_blocks, bounce,
                )
                .unwrap_or_else(|e| panic!("{off}+{n}: {e}"));
                assert_eq!(
                    got,
                    &data[off as usize..(off + n) as usize],
                    "{off}+{n} lba {lba}"
                );
            }
            // Past the length: refused, whole or in part.
            let mut buf = vec![0u8; 2];
            assert_eq!(
                run_range(&dev, &table, false, len as u64 - 1, &mut buf, 0, 4096, 8, 8),
                Err(DeviceStatus::OutOfExtent)
            );
            // Through a read-only table, no writes.
            assert_eq!(
                plan_range(&table, 0, true, 0, 1, 0, 8, 8),
                Err(DeviceStatus::OutOfExtent)
            );
        }
    }

    #[test]
    fn writes_through_a_reservation_read_back_after_remount() {
        for lba in [512u32, 4096] {
            let (dev, fs, mut data) = fragmented(lba, 50_000 + 77);
            let file = fs.open("dir/a", OpenMode::ReadWrite).expect("open");
            let new_len = 200_000u64 + 5;
            let dw = file.reserve_device_write(new_len).expect("reserve");
            let table = dw.table().clone();
            let alloc = dw.allocated();
            assert!(alloc >= new_len);
            data.resize(new_len as usize, 0);
            let mut g = Lcg(7 + lba as u64);
            // The new tail in one go (unaligned end), then overwrites at odd places.
            let mut ranges: Vec<(u64, u64)> =
                vec![(50_000 + 77, new_len - 50_077), (0, 1), (4095, 3)];
            for _ in 0..40 {
                let off = g.below(new_len);
                ranges.push((off, 1 + g.below((new_len - off).min(40_000))));
            }
            for (i, &(off, n)) in ranges.iter().enumerate() {
                let mut src = bytes(i as u64 * 31 + 5, n as usize);
                let bus = 0x20_0000 + (i as u64 % 3);
                let chunk = [4096u32, 16384, 1 << 20][i % 3];
                run_range(&dev, &table, true, off, &mut src, bus, chunk, 5, 2)
                    .unwrap_or_else(|e| panic!("{off}+{n}: {e}"));
                data[off as usize..(off + n) as usize].copy_from_slice(&src);
            }
            // Past the allocation: refused.
            let mut one = [0u8; 1];
            assert_eq!(
                run_range(&dev, &table, true, alloc, &mut one, 0, 4096, 8, 8),
                Err(DeviceStatus::OutOfExtent)
            );
            dw.commit(new_len).expect("commit");
            fs.sync().expect("sync");
            drop(file);
            fs.unmount().expect("unmount");
            let fs = FileSystem::mount(dev.clone()).expect("remount");
            let f = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            assert_eq!(f.len().expect("len"), new_len);
            let mut back = vec![0u8; new_len as usize];
            assert_eq!(f.read_at(0, &mut back).expect("read"), new_len as usize);
            assert!(
                back == data,
                "lba {lba}: the CPU reads what the device model wrote"
            );
        }
    }

    #[test]
    fn batch_plan_counts_chunks_clamps_reads_and_gives_writes_scratch() {
        let entry = |size, alloc, flags| blockfs::table::TableFile {
            size_bytes: size,
            first_extent: 0,
            extent_count: 1,
            file_id: 1,
            alloc_bytes: alloc,
            flags,
            reserved: 0,
        };
        let spec = |name: &str, e, write, offset, len| RangeSpec {
            name: name.into(),
            table_ptr: 0x1000,
            index: 0,
            entry: e,
            lba_shift: 9,
            write,
            offset,
            span: GpuSpan {
                ptr: 0x9000,
                bus: 0x9000,
                len,
            },
        };
        let ro = entry(10_000, 12_288, 0);
        let rw = entry(0, 1 << 20, TABLE_FILE_WRITABLE);
        let plan = plan_batch(
            &[
                spec("a", ro, false, 0, 10_000),    // chunks 0..3 of 4096
                spec("a", ro, false, 9_000, 5_000), // clamped to 1000 bytes: 1 chunk
                spec("a", ro, false, 20_000, 10),   // past the end: 0 bytes
                spec("w", rw, true, 4096, 8192),    // aligned: no scratch, 2 chunks
                spec("w", rw, true, 100, 5000),     // partial head and tail: scratch
                spec("w", rw, true, 8192, 4096),    // 1 chunk
            ],
            4096,
        )
        .expect("plan");
        assert_eq!(plan.lens, vec![10_000, 1000, 0, 8192, 5000, 4096]);
        let firsts: Vec<u64> = plan.ios.iter().map(|i| i.first_chunk).collect();
        assert_eq!(firsts, vec![0, 3, 4, 4, 6, 8]);
        assert_eq!(plan.chunks, 9);
        let scratch: Vec<u64> = plan.ios.iter().map(|i| i.scratch).collect();
        assert_eq!(scratch, vec![0, 0, 0, 0, 1, 0]);
        assert_eq!(plan.scratch_lbas, 2);
        // The kernel's search never lands on the empty range.
        let owners: Vec<usize> = (0..plan.chunks)
            .map(|c| range_of_chunk(&plan.ios, c))
            .collect();
        assert_eq!(owners, vec![0, 0, 0, 1, 3, 3, 4, 4, 5]);
        // Refusals.
        assert!(matches!(
            plan_batch(&[spec("a", ro, true, 0, 1)], 4096),
            Err(GpuError::OutOfFile {
                what: "read-only table",
                ..
            })
        ));
        assert!(matches!(
            plan_batch(&[spec("w", rw, true, (1 << 20) - 1, 2)], 4096),
            Err(GpuError::OutOfFile {
                what: "allocation",
                ..
            })
        ));
    }

    #[test]
    fn chunks_tile_ranges() {
        assert_eq!(chunk_count(0, 0, 4096), 0);
        assert_eq!(chunk_count(0, 4096, 4096), 1);
        assert_eq!(chunk_count(1, 4096, 4096), 2);
        assert_eq!(chunk_of(1, 4096, 4096, 0), (1, 4096));
        assert_eq!(chunk_of(1, 4096, 4096, 1), (4096, 4097));
        assert_eq!(chunk_count(8191, 2, 4096), 2);
    }

    #[test]
    fn crc_combine_and_segments_match_crc32c() {
        let data = bytes(3, 200_003);
        for split in [0usize, 1, 7, 4096, 100_000, 200_003] {
            let (a, b) = data.split_at(split);
            assert_eq!(
                crc32c_combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64),
                crc32c::crc32c(&data),
                "split {split}"
            );
        }
        assert_eq!(crc32c_x8n(0), 1 << 31, "x^0 is the identity");
        for (len, seg) in [
            (0usize, 16u32),
            (1, 16),
            (15, 16),
            (200_003, 16),
            (200_003, 4096),
            (4096 * 1500 + 9, 4096),
        ] {
            let d = &data.repeat(len.div_ceil(data.len()).max(1))[..len];
            assert_eq!(
                crc32c_segmented(d, seg),
                crc32c::crc32c(d),
                "{len} bytes, {seg}-byte segments"
            );
        }
        // Fewer combining threads than segments (each thread folds a run).
        let crcs: Vec<u32> = data.chunks(64).map(crc32c_of).collect();
        assert_eq!(
            combine_segments(&crcs, 64, data.len() as u64, 7),
            crc32c::crc32c(&data)
        );
    }
}
