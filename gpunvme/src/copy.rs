//! Copies between host files and blockfs files: what `gpunvme fs put` and `fs get` do, as a
//! library with typed errors and a report that is both [`Serialize`] and [`Display`](std::fmt::Display).
//!
//! - [`put`] hands the host file to [`blockfs::File::write_from`], whose device lanes read it
//!   command by command as they write (no staging copy), checksums exactly the bytes handed to
//!   the device ([`ChecksummedSource`]) and records the CRC-32C with the file. Replacing an
//!   existing file (`force`) writes the new version under a temporary name that never reaches
//!   the medium and swaps it in with [`FileSystem::rename_replace`] in the one commit that
//!   also removes the old version.
//! - [`get`] into a path writes a temporary file beside it through the device lanes
//!   ([`blockfs::File::read_to`]), checks the bytes against the recorded CRC-32C as they pass
//!   ([`ChecksummedSink`]), syncs, and renames it into place only then; a destination that is
//!   not a regular file (a device, a FIFO) is written in place. Into a stream (a pipe, standard
//!   output) chunks are read on [`GET_READERS`] threads and written in order by one.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File as HostFile;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::time::Instant;

use blockfs::device::SourceWriteReq;
use blockfs::{
    BlockDevice, ChecksummedSink, ChecksummedSource, Crc32cPieces, CreateOptions, FileSystem,
    OpenMode,
};
use serde::Serialize;

use crate::units::{escape_control, format_bytes};

/// Streaming `get`: threads reading from the file system at once.
pub const GET_READERS: usize = 2;
/// Streaming `get`: buffers in circulation.
const GET_BUFFERS: usize = 4;
/// Streaming `get`'s default bytes per call.
pub const GET_STREAM_CHUNK: u64 = 16 << 20;
/// Smallest `chunk`.
pub const MIN_CHUNK: u64 = 4096;
/// Largest `chunk` of a streaming `get`, whose buffers it sizes.
pub const MAX_STREAM_CHUNK: u64 = 1 << 30;

/// Why a copy failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The file system refused or failed (no such file, no space, a device error, ...).
    #[error(transparent)]
    Fs(#[from] blockfs::Error),
    /// Writing the file's bytes failed.
    #[error("writing {name}")]
    Write {
        /// The file.
        name: String,
        /// What the file system said.
        #[source]
        source: blockfs::Error,
    },
    /// Reading the file's bytes into the destination failed.
    #[error("reading {name} into {}", dst.display())]
    Read {
        /// The file.
        name: String,
        /// The destination.
        dst: PathBuf,
        /// What the file system said.
        #[source]
        source: blockfs::Error,
    },
    /// A host file operation failed.
    #[error("{op} {}", path.display())]
    Host {
        /// What was being done ("opening", "creating", "writing", ...).
        op: &'static str,
        /// The host path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The source is not a regular file (a copy reads it by position and needs its length).
    #[error("{} is not a regular file", .0.display())]
    NotRegular(PathBuf),
    /// The destination is a directory.
    #[error("{} is a directory", .0.display())]
    IsDirectory(PathBuf),
    /// The destination path names no file (`/`, `..`).
    #[error("{} names no file", .0.display())]
    NoFileName(PathBuf),
    /// The source changed size while being copied.
    #[error("{} changed size while being copied ({len} bytes, then {})", path.display(),
        now.map_or_else(|| format!("more than {len}"), |n| n.to_string()))]
    SourceChanged {
        /// The source.
        path: PathBuf,
        /// Its length when the copy started.
        len: u64,
        /// Its length after (`None`: it grew past `len`).
        now: Option<u64>,
    },
    /// The source was modified while being copied (same length, but its modification or
    /// status-change time moved, e.g. rewritten in place): the bytes read may mix two
    /// versions, so the copy was not committed (an old version keeps its name).
    #[error(
        "{} was modified while being copied, so the copy may mix two versions; nothing was \
         stored (copy it again when nothing is writing it)",
        path.display()
    )]
    SourceModified {
        /// The source.
        path: PathBuf,
    },
    /// `chunk` is out of range.
    #[error("--chunk must be {0}")]
    Chunk(String),
    /// The file ended early while being copied.
    #[error("{name} ended at byte {at} while being copied")]
    Ended {
        /// The file.
        name: String,
        /// Where it ended.
        at: u64,
    },
    /// The bytes read do not match the CRC-32C recorded when the file was written.
    #[error(
        "file {name}: its bytes do not match the CRC-32C recorded when it was written ({recorded:#010x}, read {}): the data on the device is damaged{}",
        found.map_or_else(|| "incompletely".to_string(), |c| format!("{c:#010x}")),
        if *streamed { "; what was already written to the output is wrong" } else { "" }
    )]
    DataMismatch {
        /// The file.
        name: String,
        /// The recorded CRC-32C.
        recorded: u32,
        /// The CRC-32C of the bytes read (`None`: not all were seen).
        found: Option<u32>,
        /// Whether bytes had already gone to a stream.
        streamed: bool,
    },
    /// Writing to the output stream failed.
    #[error("writing the destination")]
    Output(#[source] std::io::Error),
    /// A copy thread panicked.
    #[error("a copy thread panicked")]
    Panicked,
    /// The caller cancelled the copy ([`put_cancellable`], [`get_cancellable`]) before it
    /// committed: nothing was stored (a `put` leaves the old version, a `get` the old
    /// destination).
    #[error("cancelled before it was committed; nothing was stored")]
    Cancelled,
}

/// A copy's result.
pub type Result<T, E = CopyError> = std::result::Result<T, E>;

/// One finished `put` or `get`: printed as text ([`Display`](std::fmt::Display)) or JSON ([`Serialize`], keys as
/// `gpunvme fs put --json` prints them).
#[derive(Clone, Debug, Serialize)]
pub struct TransferReport {
    /// `put` or `get`.
    pub op: &'static str,
    /// The source (a host path or a file name).
    pub from: String,
    /// The destination.
    pub to: String,
    /// Bytes copied.
    pub bytes: u64,
    /// Wall time of the copy.
    pub seconds: f64,
    /// `bytes / seconds`.
    pub bytes_per_sec: f64,
    /// Extents of the file.
    pub extents: usize,
    /// The file's CRC-32C: recorded (`put`), or checked (`get`); `None` for a `get` of a file
    /// without one.
    pub crc32c: Option<u32>,
    /// Whether the bytes copied were checked against a recorded CRC-32C (`get`).
    pub verified: bool,
    /// Whether the file's bytes were written by a device through an extent table and
    /// committed without a checksum (`get`: why nothing was verified).
    pub device_written: bool,
    /// Which transport carried the data.
    pub data_path: String,
}

impl fmt::Display for TransferReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "data path: {}", self.data_path)?;
        writeln!(
            f,
            "{} {} -> {}: {} in {:.3} s ({}/s), {} extent(s)",
            self.op,
            escape_control(&self.from),
            escape_control(&self.to),
            format_bytes(self.bytes as f64),
            self.seconds,
            format_bytes(self.bytes_per_sec),
            self.extents
        )?;
        match (self.op, self.crc32c) {
            ("put", Some(c)) => write!(f, "CRC-32C {c:#010x} recorded"),
            ("get", Some(c)) => write!(f, "CRC-32C {c:#010x} verified"),
            ("get", None) if self.device_written => write!(
                f,
                "not verified: written by a device through an extent table, no checksum recorded"
            ),
            ("get", None) => write!(f, "not verified: no checksum recorded for this file"),
            _ => Ok(()),
        }
    }
}

/// Checks a `chunk` (bytes per file-system call): at least [`MIN_CHUNK`].
pub fn check_chunk(chunk: Option<u64>) -> Result<()> {
    match chunk {
        Some(c) if c < MIN_CHUNK => Err(CopyError::Chunk(format!("at least 4k, not {c}"))),
        _ => Ok(()),
    }
}

/// How to `put`.
#[derive(Clone, Debug, Default)]
pub struct PutOptions {
    /// Replace the file if it exists (atomically: see the module docs).
    pub force: bool,
    /// Bytes per file-system call (`None`: the whole file in one call). The device stays busy
    /// within a call and drains between calls.
    pub chunk: Option<u64>,
}

/// Copies host file `src` into the file system as `name`, syncs, and reports. `progress` is
/// called with byte counts as they reach the device.
pub fn put(
    fs: &FileSystem,
    src: &Path,
    name: &str,
    opts: &PutOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<TransferReport> {
    put_cancellable(fs, src, name, opts, progress, &AtomicBool::new(false))
}

/// [`put`], which `cancel` (set from any thread) stops before it commits: the device lanes
/// stop reading the source at their next command, and a copy that has written everything
/// checks it once more right before the commit. A cancelled put fails with
/// [`CopyError::Cancelled`] and stores nothing (an existing `name` keeps its old version).
pub fn put_cancellable(
    fs: &FileSystem,
    src: &Path,
    name: &str,
    opts: &PutOptions,
    progress: &(dyn Fn(u64) + Sync),
    cancel: &AtomicBool,
) -> Result<TransferReport> {
    check_chunk(opts.chunk)?;
    let host = |op, source| CopyError::Host {
        op,
        path: src.to_owned(),
        source,
    };
    let (input, len, stamp) = open_source(src)?;
    let temp = replacement_temp(fs, name, opts.force)?;
    let file = fs.create(
        temp.as_deref().unwrap_or(name),
        &CreateOptions { size_hint: len },
    )?;
    let start = Instant::now();
    // The checksum of exactly the bytes handed to the device, taken as the lanes read them.
    let pieces = Crc32cPieces::new();
    let source = Cancellable(ChecksummedSource::new(&input, &pieces), cancel);
    let chunk = opts.chunk.unwrap_or(len).max(1);
    let mut off = 0u64;
    while off < len {
        let n = chunk.min(len - off);
        file.write_from(off, &source, off..off + n, progress)
            .map_err(|e| {
                if cancel.load(Ordering::SeqCst) {
                    // Nothing of it was committed: drop the new file from memory too.
                    let _ = fs.remove(temp.as_deref().unwrap_or(name));
                    return CopyError::Cancelled;
                }
                changed_size(&input, src, len).unwrap_or(CopyError::Write {
                    name: name.to_owned(),
                    source: e,
                })
            })?;
        off += n;
    }
    // A source that changed while being copied is not committed: its new file is dropped
    // before anything syncs it (the old version, if any, keeps the name).
    let discard = |e: CopyError| {
        let _ = fs.remove(temp.as_deref().unwrap_or(name));
        e
    };
    // A source that grew while being copied has a byte past the length read at the start.
    if let Some(e) = changed_size(&input, src, len) {
        return Err(discard(e));
    }
    // One rewritten in place keeps its length but moves its times.
    let now = input.metadata().map_err(|e| discard(host("reading", e)))?;
    if SourceStamp::of(&now) != stamp {
        return Err(discard(CopyError::SourceModified {
            path: src.to_owned(),
        }));
    }
    let crc = pieces.finish(0, len);
    if let Some(crc) = crc {
        file.set_data_crc(crc)?;
    }
    // The last moment a cancel stops the put: nothing of it is committed yet.
    if cancel.load(Ordering::SeqCst) {
        let _ = fs.remove(temp.as_deref().unwrap_or(name));
        return Err(CopyError::Cancelled);
    }
    finish_put(
        fs,
        &file,
        temp.as_deref(),
        name,
        src.display().to_string(),
        len,
        start,
        crc,
    )
}

/// The end of a put of `bytes` bytes from `from`, begun at `start`, written to `file` (under
/// `temp` when it replaces `name`): renames it over the old version, commits, and reports.
#[allow(clippy::too_many_arguments)]
fn finish_put(
    fs: &FileSystem,
    file: &blockfs::File,
    temp: Option<&str>,
    name: &str,
    from: String,
    bytes: u64,
    start: Instant,
    crc: Option<u32>,
) -> Result<TransferReport> {
    if let Some(temp) = temp {
        fs.rename_replace(temp, name)?;
    }
    fs.sync()?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(TransferReport {
        op: "put",
        from,
        to: name.to_owned(),
        bytes,
        seconds,
        bytes_per_sec: bytes as f64 / seconds.max(1e-9),
        extents: file.stat()?.extents,
        crc32c: crc,
        verified: false,
        device_written: false,
        data_path: fs.device().describe(),
    })
}

/// [`put_cancellable`] onto a device a `gpunvme serve` daemon owns: the daemon reserves the
/// file's blocks (`reserve(len)`: a write lease, [`crate::served::ServedWrite`]), this process
/// writes the bytes through the lease ([`write_lease`]) and the daemon commits the length and
/// the CRC-32C of exactly the bytes read. A source that changed, a write that failed or
/// `cancel` drops the lease before the commit: nothing is stored (with `force`, the old version
/// keeps its name).
pub(crate) fn put_served(
    dev: &dyn BlockDevice,
    src: &Path,
    name: &str,
    reserve: impl FnOnce(u64) -> crate::Result<crate::served::ServedWrite>,
    progress: &(dyn Fn(u64) + Sync),
    cancel: &AtomicBool,
) -> crate::Result<TransferReport> {
    let host = |op, source| CopyError::Host {
        op,
        path: src.to_owned(),
        source,
    };
    let (input, len, stamp) = open_source(src)?;
    let lease = reserve(len)?;
    let start = Instant::now();
    let written = write_lease(dev, &lease, &input, len, name, progress, cancel);
    let (crc, extents) = written.map_err(|e| match e {
        CopyError::Write { .. } => changed_size(&input, src, len).unwrap_or(e),
        e => e,
    })?;
    if let Some(e) = changed_size(&input, src, len) {
        return Err(e.into());
    }
    let now = input.metadata().map_err(|e| host("reading", e))?;
    if SourceStamp::of(&now) != stamp {
        return Err(CopyError::SourceModified {
            path: src.to_owned(),
        }
        .into());
    }
    if cancel.load(Ordering::SeqCst) {
        return Err(CopyError::Cancelled.into());
    }
    lease.commit(len, crc)?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(TransferReport {
        op: "put",
        from: src.display().to_string(),
        to: name.to_owned(),
        bytes: len,
        seconds,
        bytes_per_sec: len as f64 / seconds.max(1e-9),
        extents,
        crc32c: crc,
        verified: false,
        device_written: false,
        data_path: dev.describe(),
    })
}

/// Writes `len` bytes of `source` (file offsets `0..len`) through `lease`'s table onto `dev`,
/// the last LBA padded with zeros: the CRC-32C of exactly those bytes (`None` if the device
/// read some of them more than once, and the pieces do not tile) and the file's extent count.
/// Nothing is committed; the caller commits (or drops) the lease.
pub(crate) fn write_lease(
    dev: &dyn BlockDevice,
    lease: &crate::served::ServedWrite,
    source: &dyn blockfs::DataSource,
    len: u64,
    name: &str,
    progress: &(dyn Fn(u64) + Sync),
    cancel: &AtomicBool,
) -> Result<(Option<u32>, usize)> {
    let lba = u64::from(dev.lba_size());
    let table = lease.table();
    let reqs = lease_requests(table, lba, 0, len.next_multiple_of(lba));
    let pieces = Crc32cPieces::new();
    let checked = ChecksummedSource::new(source, &pieces);
    let padded = Cancellable(Padded(&checked, len), cancel);
    dev.write_from(&reqs, &padded, progress)
        .map_err(|e| lease_write_error(e, name, cancel))?;
    Ok((
        pieces.finish(0, len),
        table.files()[0].extent_count as usize,
    ))
}

/// A failed write through a lease's table: a cancel if `cancel` was set, else the device's
/// error naming the file.
fn lease_write_error(e: blockfs::DeviceError, name: &str, cancel: &AtomicBool) -> CopyError {
    if cancel.load(Ordering::SeqCst) {
        return CopyError::Cancelled;
    }
    CopyError::Write {
        name: name.to_owned(),
        source: blockfs::Error::Device {
            op: "writing file data",
            source: e,
        },
    }
}

/// The device writes of file bytes `from..to` (whole LBAs of `lba` bytes) through a lease's
/// table, each at most a staging buffer; source offsets are file offsets.
fn lease_requests(
    table: &blockfs::ExtentTable,
    lba: u64,
    from: u64,
    to: u64,
) -> Vec<SourceWriteReq> {
    let f = table.files()[0];
    let first = f.first_extent as usize;
    let mut reqs = Vec::new();
    for e in &table.extents()[first..first + f.extent_count as usize] {
        let start = (e.file_lba * lba).clamp(from, to);
        let end = ((e.file_lba + e.nlb) * lba).clamp(from, to);
        let mut at = start;
        while at < end {
            let n = (end - at).min(blockfs::device::SOURCE_STAGE_BYTES as u64);
            reqs.push(SourceWriteReq {
                lba: e.lba + (at - e.file_lba * lba) / lba,
                src_offset: at,
                len: n as usize,
            });
            at += n;
        }
    }
    reqs
}

/// [`put_stream`] onto a device a `gpunvme serve` daemon owns: a write lease of one chunk
/// (`reserve`), grown by a chunk ahead whenever the stream reaches its end
/// ([`crate::served::ServedWrite::grow`]), each chunk written through the lease's table as it
/// fills (the last LBA zero-padded), committed at the end of the stream with the CRC-32C of
/// exactly the bytes read. A read error, a write error or `cancel` drops the lease: nothing
/// is stored (with `force`, the old version keeps its name).
#[allow(clippy::too_many_arguments)]
pub(crate) fn put_stream_served(
    dev: &dyn BlockDevice,
    input: &mut dyn std::io::Read,
    from: &str,
    name: &str,
    chunk: Option<u64>,
    reserve: impl FnOnce(u64) -> crate::Result<crate::served::ServedWrite>,
    progress: &(dyn Fn(u64) + Sync),
    cancel: &AtomicBool,
) -> crate::Result<TransferReport> {
    check_chunk(chunk)?;
    let lba = u64::from(dev.lba_size());
    // Whole LBAs, so that every chunk but the last starts and ends on one.
    let chunk = chunk.unwrap_or(PUT_STREAM_CHUNK).next_multiple_of(lba);
    let mut buf = stream_buffer(chunk)?;
    let mut lease = reserve(chunk)?;
    let start = Instant::now();
    let (mut crc, mut off) = (0u32, 0u64);
    loop {
        if cancel.load(Ordering::SeqCst) {
            return Err(CopyError::Cancelled.into());
        }
        let n = fill_from(input, &mut buf).map_err(|source| CopyError::Host {
            op: "reading",
            path: PathBuf::from(from),
            source,
        })?;
        if n == 0 {
            break;
        }
        let end = off + n as u64;
        if end > lease.table().files()[0].alloc_bytes {
            lease.grow(end + chunk)?;
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        let reqs = lease_requests(lease.table(), lba, off, end.next_multiple_of(lba));
        let piece = Padded(&Slice(&buf[..n], off), end);
        dev.write_from(&reqs, &Cancellable(piece, cancel), progress)
            .map_err(|e| lease_write_error(e, name, cancel))?;
        off = end;
    }
    if cancel.load(Ordering::SeqCst) {
        return Err(CopyError::Cancelled.into());
    }
    let extents = lease.table().files()[0].extent_count as usize;
    lease.commit(off, Some(crc))?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(TransferReport {
        op: "put",
        from: from.to_owned(),
        to: name.to_owned(),
        bytes: off,
        seconds,
        bytes_per_sec: off as f64 / seconds.max(1e-9),
        extents,
        crc32c: Some(crc),
        verified: false,
        device_written: false,
        data_path: dev.describe(),
    })
}

/// Bytes `.0` at source offset `.1` (one chunk of a stream).
struct Slice<'a>(&'a [u8], u64);

impl blockfs::DataSource for Slice<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let at = offset
            .checked_sub(self.1)
            .and_then(|a| usize::try_from(a).ok())
            .filter(|&a| a.checked_add(buf.len()).is_some_and(|e| e <= self.0.len()));
        match at {
            Some(a) => {
                buf.copy_from_slice(&self.0[a..a + buf.len()]);
                Ok(())
            }
            None => Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("bytes {offset}+{} outside the chunk", buf.len()),
            )),
        }
    }
}

/// Host file `src` opened for a put: the file, its length and its stamp; anything but a
/// regular file refused.
fn open_source(src: &Path) -> Result<(HostFile, u64, SourceStamp)> {
    let host = |op, source| CopyError::Host {
        op,
        path: src.to_owned(),
        source,
    };
    let input = HostFile::open(src).map_err(|e| host("opening", e))?;
    let meta = input.metadata().map_err(|e| host("reading", e))?;
    if !meta.is_file() {
        return Err(CopyError::NotRegular(src.to_owned()));
    }
    Ok((input, meta.len(), SourceStamp::of(&meta)))
}

/// A source read to `.1` bytes, zeros past them (a last LBA's padding).
struct Padded<'a>(&'a dyn blockfs::DataSource, u64);

impl blockfs::DataSource for Padded<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let real = usize::try_from(self.1.saturating_sub(offset))
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let (head, tail) = buf.split_at_mut(real);
        if !head.is_empty() {
            self.0.read_exact_at(head, offset)?;
        }
        tail.fill(0);
        Ok(())
    }
}

/// Streaming `put`'s default bytes per file-system call: the one buffer it holds.
pub const PUT_STREAM_CHUNK: u64 = 16 << 20;

/// Copies a stream (a pipe, standard input: no length known up front) into the file system as
/// `name`, syncs, and reports; `from` names the stream in the report and errors. The stream is
/// read into one bounded buffer (`opts.chunk`, by default [`PUT_STREAM_CHUNK`], at most
/// [`MAX_STREAM_CHUNK`]) and written piece by piece as it fills, the CRC-32C taken over exactly
/// the bytes written; the file is committed (and the checksum recorded) only at the end of
/// the stream. A read error, a write error or `cancel` before then stores nothing: the new
/// file is dropped before anything commits it (with `force`, the old version keeps its name).
pub fn put_stream(
    fs: &FileSystem,
    input: &mut dyn std::io::Read,
    from: &str,
    name: &str,
    opts: &PutOptions,
    progress: &(dyn Fn(u64) + Sync),
    cancel: &AtomicBool,
) -> Result<TransferReport> {
    check_chunk(opts.chunk)?;
    let mut buf = stream_buffer(opts.chunk.unwrap_or(PUT_STREAM_CHUNK))?;
    let temp = replacement_temp(fs, name, opts.force)?;
    let target = temp.as_deref().unwrap_or(name);
    let file = fs.create(target, &CreateOptions { size_hint: 0 })?;
    // Nothing is committed before the end: dropping the new file undoes the copy.
    let discard = |e: CopyError| {
        let _ = fs.remove(target);
        e
    };
    let start = Instant::now();
    let mut crc = 0u32;
    let mut off = 0u64;
    loop {
        if cancel.load(Ordering::SeqCst) {
            return Err(discard(CopyError::Cancelled));
        }
        let n = fill_from(input, &mut buf).map_err(|source| {
            discard(CopyError::Host {
                op: "reading",
                path: PathBuf::from(from),
                source,
            })
        })?;
        if n == 0 {
            break;
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        file.write_at(off, &buf[..n]).map_err(|source| {
            discard(CopyError::Write {
                name: name.to_owned(),
                source,
            })
        })?;
        off += n as u64;
        progress(n as u64);
    }
    file.set_data_crc(crc).map_err(|e| discard(e.into()))?;
    if cancel.load(Ordering::SeqCst) {
        return Err(discard(CopyError::Cancelled));
    }
    finish_put(
        fs,
        &file,
        temp.as_deref(),
        name,
        from.to_owned(),
        off,
        start,
        Some(crc),
    )
}

/// A stream put's one buffer of `chunk` bytes (at most [`MAX_STREAM_CHUNK`]), refused by name
/// where there is no memory for it.
fn stream_buffer(chunk: u64) -> Result<Vec<u8>> {
    if chunk > MAX_STREAM_CHUNK {
        return Err(CopyError::Chunk(format!(
            "at most {} for a stream, not {chunk}",
            format_bytes(MAX_STREAM_CHUNK as f64)
        )));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(chunk as usize)
        .map_err(|_| CopyError::Chunk(format!("{chunk} bytes: no memory for them")))?;
    buf.resize(chunk as usize, 0);
    Ok(buf)
}

/// Reads from `r` until `buf` is full or the stream ends: the count read (0 at the end).
/// Interrupted reads are retried.
pub fn fill_from(r: &mut dyn std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A [`DataSource`](blockfs::DataSource) or [`DataSink`](blockfs::DataSink) that fails every
/// read or write once the flag is set: how a cancel stops the device lanes of a copy.
struct Cancellable<'a, T>(T, &'a AtomicBool);

impl<T> Cancellable<'_, T> {
    fn check(&self) -> std::io::Result<()> {
        if self.1.load(Ordering::SeqCst) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                "the copy was cancelled",
            ));
        }
        Ok(())
    }
}

impl<T: blockfs::DataSource> blockfs::DataSource for Cancellable<'_, T> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.check()?;
        self.0.read_exact_at(buf, offset)
    }
}

impl<T: blockfs::DataSink> blockfs::DataSink for Cancellable<'_, T> {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.check()?;
        self.0.write_all_at(buf, offset)
    }
}

/// Checks `name`, and when it names a file that `force` replaces, returns the temporary name
/// to write the new version under (which never reaches the medium: nothing commits before the
/// end) before it is renamed over the old one in the same commit that removes the old one, so
/// any failure before that leaves the old version. An immutable old file is refused.
fn replacement_temp(fs: &FileSystem, name: &str, force: bool) -> Result<Option<String>> {
    blockfs::check_name(name).map_err(|reason| blockfs::Error::InvalidName {
        name: name.to_owned(),
        reason,
    })?;
    Ok(match fs.stat(name) {
        Ok(old) if force => {
            if old.immutable {
                return Err(blockfs::Error::ReadOnly(name.to_owned()).into());
            }
            Some(temp_name(fs))
        }
        _ => None,
    })
}

/// A name no file has, for a replacement being written.
fn temp_name(fs: &FileSystem) -> String {
    let base = format!(".gpunvme-put-{}", std::process::id());
    let mut i = 0u64;
    loop {
        let n = format!("{base}-{i}");
        if fs.stat(&n).is_err() {
            return n;
        }
        i += 1;
    }
}

/// What tells a source file's version apart: a write moves its modification time, a
/// `utimes` or `chmod` its status-change time (both to the nanosecond where the file system
/// keeps them; Linux 6.13 and later make a change after a `stat` visible even within one
/// clock tick).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SourceStamp {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl SourceStamp {
    fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt as _;
        Self {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// The error to report if `input` is no longer `len` bytes long (or cannot be read at `len`).
fn changed_size(input: &HostFile, src: &Path, len: u64) -> Option<CopyError> {
    let mut probe = [0u8; 1];
    let host = |source| CopyError::Host {
        op: "reading",
        path: src.to_owned(),
        source,
    };
    match std::os::unix::fs::FileExt::read_at(input, &mut probe, len) {
        Ok(0) => match input.metadata() {
            Ok(m) if m.len() == len => None,
            Ok(m) => Some(CopyError::SourceChanged {
                path: src.to_owned(),
                len,
                now: Some(m.len()),
            }),
            Err(e) => Some(host(e)),
        },
        Ok(_) => Some(CopyError::SourceChanged {
            path: src.to_owned(),
            len,
            now: None,
        }),
        Err(e) => Some(host(e)),
    }
}

/// Where [`get`] writes.
pub enum Destination<'a> {
    /// A host path: a regular file (new or existing) is written under a temporary name and
    /// renamed into place when complete; anything else is written in place.
    Path(&'a Path),
    /// A stream written in order (a pipe, standard output). Its write errors come back as
    /// [`CopyError::Output`] with the stream's own error as the source.
    Stream(Box<dyn Write + Send + 'a>),
}

/// How to `get`.
#[derive(Clone, Debug, Default)]
pub struct GetOptions {
    /// Bytes per file-system call (`None`: the whole file in one call, or
    /// [`GET_STREAM_CHUNK`] into a stream or a destination without positioned writes).
    pub chunk: Option<u64>,
}

/// Copies file `name` out to `dst`, checking its bytes against the recorded CRC-32C before the
/// copy takes the destination's name, and reports. `progress` is called with byte counts as
/// they reach the destination.
pub fn get(
    fs: &FileSystem,
    name: &str,
    dst: Destination<'_>,
    opts: &GetOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<TransferReport> {
    get_cancellable(fs, name, dst, opts, progress, &AtomicBool::new(false))
}

/// [`get`], which `cancel` (set from any thread) stops before the copy takes the
/// destination's name: [`CopyError::Cancelled`], the destination as it was (a stream keeps
/// what it was sent).
pub fn get_cancellable(
    fs: &FileSystem,
    name: &str,
    dst: Destination<'_>,
    opts: &GetOptions,
    progress: &(dyn Fn(u64) + Sync),
    cancel: &AtomicBool,
) -> Result<TransferReport> {
    check_chunk(opts.chunk)?;
    let file = fs.open(name, OpenMode::ReadOnly)?;
    let len = file.len()?;
    let stat = file.stat()?;
    let recorded = stat.data_crc;
    let (target, stream, to) = match dst {
        Destination::Path(p) => (
            Some(StagedFile::create(p, "get")?),
            None,
            p.display().to_string(),
        ),
        Destination::Stream(w) => (None, Some(w), "-".to_string()),
    };
    let out = target.as_ref().map(|t| &t.file);
    // Positioned writes (a regular file, /dev/null) let the device lanes write the destination
    // themselves; a pipe takes the bytes in order from one writer.
    let positioned = out.filter(|o| std::os::unix::fs::FileExt::write_at(*o, &[], 0).is_ok());
    let start = Instant::now();
    let pieces = Crc32cPieces::new();
    let streamed = positioned.is_none();
    let copied_crc = match positioned {
        Some(out) => {
            let dst_path = target.as_ref().map_or_else(PathBuf::new, |t| t.dst.clone());
            if out.metadata().is_ok_and(|m| m.is_file()) {
                out.set_len(len).map_err(|source| CopyError::Host {
                    op: "sizing",
                    path: dst_path.clone(),
                    source,
                })?;
            }
            let sink = Cancellable(ChecksummedSink::new(out, &pieces), cancel);
            let chunk = opts.chunk.unwrap_or(len).max(1);
            let mut off = 0u64;
            while off < len {
                let n = chunk.min(len - off);
                let got = file
                    .read_to(off, n, &sink, off, progress)
                    .map_err(|source| {
                        if cancel.load(Ordering::SeqCst) {
                            return CopyError::Cancelled;
                        }
                        CopyError::Read {
                            name: name.to_owned(),
                            dst: dst_path.clone(),
                            source,
                        }
                    })?;
                if got != n {
                    return Err(CopyError::Ended {
                        name: name.to_owned(),
                        at: off + got,
                    });
                }
                off += n;
            }
            pieces.finish(0, len)
        }
        None => {
            let out: Box<dyn Write + Send + '_> = match (out, stream) {
                (Some(f), _) => Box::new(f),
                (None, Some(w)) => w,
                (None, None) => unreachable!("a destination is a path or a stream"),
            };
            let chunk = opts.chunk.unwrap_or(GET_STREAM_CHUNK);
            if !(MIN_CHUNK..=MAX_STREAM_CHUNK).contains(&chunk) {
                return Err(CopyError::Chunk(format!("between 4k and 1g, not {chunk}")));
            }
            Some(stream_out(&file, len, out, chunk as usize, progress)?)
        }
    };
    if let Some(recorded) = recorded
        && copied_crc != Some(recorded)
    {
        return Err(CopyError::DataMismatch {
            name: name.to_owned(),
            recorded,
            found: copied_crc,
            streamed,
        });
    }
    if cancel.load(Ordering::SeqCst) {
        return Err(CopyError::Cancelled);
    }
    if let Some(t) = target {
        t.commit(true)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(TransferReport {
        op: "get",
        from: name.to_owned(),
        to,
        bytes: len,
        seconds,
        bytes_per_sec: len as f64 / seconds.max(1e-9),
        extents: stat.extents,
        crc32c: recorded,
        verified: recorded.is_some(),
        device_written: stat.device_written,
        data_path: fs.device().describe(),
    })
}

/// Where `get` (and `gpunvme read`) writes a path: a regular file (new or existing) is written
/// under a temporary name in the same directory and renamed over the destination only when
/// complete and synced, so the destination never holds a partial copy; anything else (a device
/// such as /dev/null, a FIFO) is written in place. Dropped without [`StagedFile::commit`], the
/// temporary file is removed.
pub struct StagedFile {
    /// The file to write.
    pub file: HostFile,
    /// The temporary name, for a regular-file destination.
    temp: Option<PathBuf>,
    dst: PathBuf,
}

impl StagedFile {
    /// Opens `dst` for writing: a regular file (or none yet) through a new temporary file
    /// `.NAME.gpunvme-TAG-PID.tmp` beside it with the old file's permissions, anything else in
    /// place.
    pub fn create(dst: &Path, tag: &str) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let host = |op, path: &Path, source| CopyError::Host {
            op,
            path: path.to_owned(),
            source,
        };
        let existing = std::fs::metadata(dst).ok();
        if let Some(m) = existing.as_ref().filter(|m| !m.is_file()) {
            if m.is_dir() {
                return Err(CopyError::IsDirectory(dst.to_owned()));
            }
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(dst)
                .map_err(|e| host("opening", dst, e))?;
            return Ok(Self {
                file,
                temp: None,
                dst: dst.to_owned(),
            });
        }
        let file_name = dst
            .file_name()
            .ok_or_else(|| CopyError::NoFileName(dst.to_owned()))?;
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(file_name);
        temp_name.push(format!(".gpunvme-{tag}-{}.tmp", std::process::id()));
        let temp = dst.with_file_name(temp_name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| host("creating", &temp, e))?;
        let target = Self {
            file,
            temp: Some(temp),
            dst: dst.to_owned(),
        };
        if let Some(m) = existing {
            // Replace a file with one of the same permissions.
            let mode = std::fs::Permissions::from_mode(m.permissions().mode() & 0o7777);
            target
                .file
                .set_permissions(mode)
                .map_err(|e| host("creating", dst, e))?;
        }
        Ok(target)
    }

    /// The destination.
    pub fn path(&self) -> &Path {
        &self.dst
    }

    /// Syncs the copy and moves it into place; with `sync_dir`, then makes the rename itself
    /// durable (best effort: some file systems refuse to sync a directory).
    pub fn commit(mut self, sync_dir: bool) -> Result<()> {
        let Some(temp) = self.temp.take() else {
            return Ok(());
        };
        let done = self
            .file
            .sync_all()
            .and_then(|()| std::fs::rename(&temp, &self.dst));
        if let Err(source) = done {
            let _ = std::fs::remove_file(&temp);
            return Err(CopyError::Host {
                op: "writing",
                path: self.dst.clone(),
                source,
            });
        }
        if !sync_dir {
            return Ok(());
        }
        let dir = match self.dst.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if let Ok(d) = HostFile::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        if let Some(temp) = &self.temp {
            let _ = std::fs::remove_file(temp);
        }
    }
}

/// Buffers circulate between the file-system threads and the writer thread: `full` carries
/// (offset, buffer, length), `empty` returns buffers for reuse.
type Full = (u64, Vec<u8>, usize);

/// Copies `file` to `out` in order, `chunk` bytes per file-system call: [`GET_READERS`]
/// threads read consecutive chunks concurrently, so the device always has the next batch
/// queued while one completes, and one writer puts them back in order. Returns the CRC-32C of
/// the bytes written.
fn stream_out(
    file: &blockfs::File,
    len: u64,
    mut out: Box<dyn Write + Send + '_>,
    chunk: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u32> {
    let chunks = len.div_ceil(chunk as u64);
    let next = AtomicU64::new(0);
    let (full_tx, full_rx) = sync_channel::<Full>(GET_BUFFERS);
    let (empty_tx, empty_rx) = sync_channel::<Vec<u8>>(GET_BUFFERS);
    for _ in 0..GET_BUFFERS {
        // The channel holds GET_BUFFERS: these sends cannot block or fail.
        let _ = empty_tx.send(vec![0u8; chunk]);
    }
    let empty_rx = Mutex::new(empty_rx);
    std::thread::scope(|s| -> Result<u32> {
        let writer = s.spawn(move || -> Result<u32> {
            let mut waiting: BTreeMap<u64, (Vec<u8>, usize)> = BTreeMap::new();
            let mut expect = 0u64;
            let mut crc = 0u32;
            for (off, buf, n) in full_rx.iter() {
                waiting.insert(off, (buf, n));
                while let Some((buf, n)) = waiting.remove(&expect) {
                    crc = crc32c::crc32c_append(crc, &buf[..n]);
                    out.write_all(&buf[..n]).map_err(CopyError::Output)?;
                    expect += n as u64;
                    progress(n as u64);
                    let _ = empty_tx.send(buf);
                }
            }
            out.flush().map_err(CopyError::Output)?;
            if expect != len {
                return Err(CopyError::Ended {
                    name: file.name().to_owned(),
                    at: expect,
                });
            }
            Ok(crc)
        });
        let readers: Vec<_> = (0..GET_READERS)
            .map(|_| {
                let (full_tx, empty_rx, next, file) = (full_tx.clone(), &empty_rx, &next, &file);
                s.spawn(move || -> blockfs::Result<()> {
                    loop {
                        // Take a buffer before a chunk number, so the lowest chunk not yet
                        // written is always being read by someone holding a buffer.
                        let Ok(mut buf) = empty_rx
                            .lock()
                            .map_err(|_| ())
                            .and_then(|r| r.recv().map_err(drop))
                        else {
                            return Ok(());
                        };
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= chunks {
                            return Ok(());
                        }
                        let off = i * chunk as u64;
                        let n = file.read_at(off, &mut buf)?;
                        if full_tx.send((off, buf, n)).is_err() {
                            return Ok(());
                        }
                    }
                })
            })
            .collect();
        drop(full_tx);
        let mut result = Ok(());
        for r in readers {
            let r = r.join().map_err(|_| CopyError::Panicked)?;
            if result.is_ok() {
                result = r;
            }
        }
        let written = writer.join().map_err(|_| CopyError::Panicked)?;
        result.map_err(|source| CopyError::Read {
            name: file.name().to_owned(),
            dst: PathBuf::from("-"),
            source,
        })?;
        written
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use blockfs::{BlockDevice, MemDevice, MkfsOptions, ReadReq, WriteReq};

    fn mem_fs() -> (Arc<MemDevice>, FileSystem) {
        let dev = Arc::new(MemDevice::new(512, (32 << 20) / 512));
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        (dev, fs)
    }

    fn data(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 24) as u8)
            .collect()
    }

    /// A stream that keeps what it is given, in order.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn put_and_get_round_trip_through_paths_and_streams() {
        let (_dev, fs) = mem_fs();
        let dir = tempfile::tempdir().unwrap();
        let bytes = data(3_000_001, 1);
        let src = dir.path().join("src.bin");
        std::fs::write(&src, &bytes).unwrap();
        let done = AtomicU64::new(0);
        let count = |n| {
            done.fetch_add(n, Ordering::Relaxed);
        };
        let opts = PutOptions {
            force: false,
            chunk: Some(1 << 20),
        };
        let r = put(&fs, &src, "a/b", &opts, &count).unwrap();
        assert_eq!(r.bytes, bytes.len() as u64);
        assert_eq!(r.crc32c, Some(crc32c::crc32c(&bytes)));
        assert_eq!(done.load(Ordering::Relaxed), bytes.len() as u64);
        assert!(r.to_string().contains("put "), "{r}");
        // Into a path, in small calls.
        let dst = dir.path().join("dst.bin");
        let r = get(
            &fs,
            "a/b",
            Destination::Path(&dst),
            &GetOptions {
                chunk: Some(64 << 10),
            },
            &|_| {},
        )
        .unwrap();
        assert!(r.verified);
        assert!(std::fs::read(&dst).unwrap() == bytes);
        // Into a stream, with chunks small enough that the readers overtake each other.
        let sink = Sink::default();
        let r = get(
            &fs,
            "a/b",
            Destination::Stream(Box::new(sink.clone())),
            &GetOptions { chunk: Some(8192) },
            &|_| {},
        )
        .unwrap();
        assert_eq!(r.to, "-");
        assert!(*sink.0.lock().unwrap() == bytes);
        // Refusals.
        assert!(matches!(
            put(&fs, &src, "a/b", &PutOptions::default(), &|_| {}),
            Err(CopyError::Fs(blockfs::Error::AlreadyExists(_)))
        ));
        assert!(matches!(
            put(&fs, dir.path(), "x", &PutOptions::default(), &|_| {}),
            Err(CopyError::NotRegular(_))
        ));
        assert!(matches!(
            get(
                &fs,
                "a/b",
                Destination::Path(dir.path()),
                &GetOptions::default(),
                &|_| {}
            ),
            Err(CopyError::IsDirectory(_))
        ));
        assert!(matches!(
            check_chunk(Some(100)),
            Err(CopyError::Chunk(m)) if m.contains("at least 4k")
        ));
    }

    #[test]
    fn forced_put_replaces_and_damaged_data_never_takes_the_name() {
        let (dev, fs) = mem_fs();
        let dir = tempfile::tempdir().unwrap();
        let (old, new) = (data(10_000, 2), data(20_000, 3));
        let src = dir.path().join("src.bin");
        std::fs::write(&src, &old).unwrap();
        put(&fs, &src, "f", &PutOptions::default(), &|_| {}).unwrap();
        std::fs::write(&src, &new).unwrap();
        let force = PutOptions {
            force: true,
            chunk: None,
        };
        put(&fs, &src, "f", &force, &|_| {}).unwrap();
        assert_eq!(fs.list("").len(), 1, "no temporary name left");
        let dst = dir.path().join("out.bin");
        get(
            &fs,
            "f",
            Destination::Path(&dst),
            &GetOptions::default(),
            &|_| {},
        )
        .unwrap();
        assert_eq!(std::fs::read(&dst).unwrap(), new);
        // Flip a byte of the file on the device: get fails and leaves the destination alone.
        std::fs::write(&dst, b"keep me").unwrap();
        let table = fs
            .open("f", OpenMode::ReadOnly)
            .unwrap()
            .extent_table()
            .unwrap();
        let lba = table.extents()[0].lba + 3;
        let mut sector = vec![0u8; 512];
        dev.read(&mut [ReadReq {
            lba,
            buf: &mut sector,
        }])
        .unwrap();
        sector[9] ^= 0x40;
        dev.write(&[WriteReq { lba, buf: &sector }]).unwrap();
        let err = get(
            &fs,
            "f",
            Destination::Path(&dst),
            &GetOptions::default(),
            &|_| {},
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                CopyError::DataMismatch {
                    streamed: false,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(std::fs::read(&dst).unwrap(), b"keep me");
        let leftovers = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains("gpunvme-get")
            })
            .count();
        assert_eq!(leftovers, 0, "the temporary file was removed");
        let err = get(
            &fs,
            "f",
            Destination::Stream(Box::new(Sink::default())),
            &GetOptions::default(),
            &|_| {},
        )
        .unwrap_err();
        assert!(
            matches!(err, CopyError::DataMismatch { streamed: true, .. }),
            "{err}"
        );
    }
}
