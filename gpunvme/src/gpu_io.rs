//! GPU memory that someone else allocated (a PyTorch, CuPy or JAX tensor; a C caller's
//! `cudaMalloc`) read from and written to blockfs files by GPU-issued commands: what the
//! Python package's `read_into`, `save` and `save_safetensors` and the C ABI run, and what
//! `fs put --gpu` writes with.
//!
//! Reads go straight into the caller's memory where the transport can map it
//! ([`gpu_queues::GpuQueues::map_memory`]: the software controller and the GPU-resident model),
//! else through a staging buffer the controller reaches and a copy on the GPU. Writes always
//! stage: a file is written as a stream of pieces (host bytes such as a header, and GPU ranges
//! such as tensors) assembled window by window in one staging buffer, so pieces of any length
//! and alignment become whole-block writes, no two commands of a batch touch the same block,
//! and the CRC-32C of the file is computed on the GPU as it goes.

use std::sync::Arc;
use std::time::Instant;

use crate::error::{Context, Result, ensure};
use blockfs::{CreateOptions, FileSystem, OpenMode};
use blockfs_gpu::plan::crc32c_combine;
use blockfs_gpu::{FileRange, FilesError, GpuFiles, GpuFilesOptions, GpuSpan};
use gpu_queues::ffi::{DeviceMemory, copy_to_gpu};
use gpu_queues::queues::compute_wait_bound;
use gpu_queues::{GpuBuffer, GpuError};
use serde::Serialize;

use crate::gpu::GpuSetup;

/// A checksum disagreement between the GPU's and the host's view of a file.
#[derive(Debug, thiserror::Error)]
#[error(
    "{name}: CRC-32C computed on the GPU {gpu:#010x} differs from {what} {host:#010x}: the bytes \
     in GPU memory are not the file's"
)]
pub struct GpuChecksumMismatch {
    /// The file.
    pub name: String,
    /// What the GPU computed.
    pub gpu: u32,
    /// What it was compared with.
    pub host: u32,
    /// "the host's" or "the recorded checksum".
    pub what: &'static str,
}

/// The data path GPU file reads (`write` false) or writes take on `setup`, in words.
pub fn data_path(setup: &GpuSetup, write: bool) -> String {
    let memory = setup.queues.transport().buffer_memory();
    format!(
        "GPU threads (a warp lane per chunk) issue NVMe {} on GPU queues, data {} {memory} by \
         PRPs; unaligned head/tail through slot buffers{}; extent table in GPU memory; {}",
        if write { "writes" } else { "reads" },
        if write {
            "straight from"
        } else {
            "straight into"
        },
        if write { " (read-modify-write)" } else { "" },
        setup.transport
    )
}

/// [`data_path`] of reads staged into GPU memory ([`crate::staged`]): where the controller
/// reaches only host memory.
pub fn staged_data_path(setup: &GpuSetup) -> String {
    let memory = setup.queues.transport().buffer_memory();
    format!(
        "GPU threads (a warp lane per chunk) issue NVMe reads on GPU queues, data into a bounce \
         buffer in {memory} by PRPs, then by copy engines into GPU memory (two windows, reads \
         of one beside the copy of the other); extent table in GPU memory; {}",
        setup.transport
    )
}

/// [`read_into`] on a controller a daemon owns, by this process's CPU on lent queue pairs
/// ([`crate::cpu_staged::read_served`]): up to `dst.len()` bytes of `name` from `offset` on,
/// staged through a lent bounce into `dst`; no GPU queues are set up.
pub fn read_into_served(
    served: &crate::served::ServedController,
    nsid: u32,
    fs: &FileSystem,
    name: &str,
    offset: u64,
    dst: &Arc<DeviceMemory>,
) -> Result<GpuIoReport> {
    let file = fs.open(name, OpenMode::ReadOnly)?;
    let size = file.len()?;
    ensure!(
        offset <= size,
        InvalidArgument,
        "offset {offset} is past the end of {name} ({size} bytes)"
    );
    let n = (size - offset).min(dst.len() as u64);
    let table = file.extent_table()?;
    let read = crate::staged::StagedRead {
        file: 0,
        offset,
        len: n,
        dest: 0,
    };
    let (out, p) = crate::cpu_staged::read_served(
        served,
        nsid,
        dst.cuda(),
        &[table.table()],
        std::slice::from_ref(&read),
        || Ok(dst.clone()),
    )?;
    ensure!(
        out.bytes == n,
        Device,
        "the CPU read {} of {n} bytes",
        out.bytes
    );
    let secs = out.elapsed.as_secs_f64();
    Ok(GpuIoReport {
        name: name.to_owned(),
        bytes: n,
        seconds: secs,
        bytes_per_sec: if secs > 0.0 { n as f64 / secs } else { 0.0 },
        staged: true,
        data_path: crate::cpu_staged::DATA_PATH.to_owned(),
        transport: format!(
            "served ({}), {} CPU queue pairs",
            served.describe(),
            p.queues
        ),
        crc32c: None,
    })
}

/// The largest staging buffer (bytes): writes, and reads on transports that cannot map the
/// caller's memory, move at most this much per batch.
pub const STAGE_MAX: usize = 256 << 20;

/// Staging windows are whole multiples of this (bytes), so every window but the last ends on
/// a block boundary of any blockfs block size and no block is written twice.
const STAGE_ALIGN: usize = 1 << 20;

/// What a GPU read or write of a file did.
#[derive(Debug, Clone, Serialize)]
pub struct GpuIoReport {
    /// The file.
    pub name: String,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds on the GPU side (batches, and staging copies where there were any).
    pub seconds: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// Whether the data went through a staging buffer (else straight into the caller's memory).
    pub staged: bool,
    /// The data path that ran, in words.
    pub data_path: String,
    /// The transport (or model).
    pub transport: String,
    /// CRC-32C of the bytes written, computed on the GPU and recorded as the file's checksum
    /// (writes only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<String>,
}

impl GpuIoReport {
    fn new(name: &str, bytes: u64, secs: f64, staged: bool, setup: &GpuSetup, write: bool) -> Self {
        let mut path = data_path(setup, write);
        if staged {
            path.push_str(if write {
                "; staged: assembled window by window in a GPU buffer the controller reaches"
            } else {
                "; staged: the controller cannot reach memory allocated elsewhere on this \
                 transport, so the data went through a GPU buffer it reaches and a copy on the GPU"
            });
        } else if !write {
            path.push_str("; straight into the caller's memory (mapped for the controller)");
        }
        Self {
            name: name.to_owned(),
            bytes,
            seconds: secs,
            bytes_per_sec: if secs > 0.0 { bytes as f64 / secs } else { 0.0 },
            staged,
            data_path: path,
            transport: setup.transport.clone(),
            crc32c: None,
        }
    }
}

/// How [`read_into`] moves data into the caller's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadPath {
    /// Straight in where the transport maps the memory, else staged.
    Direct,
    /// Through a staging buffer and a copy on the GPU (what transports that cannot map the
    /// caller's memory take; asked for by tests of that path on the others).
    Staged,
}

/// Reads `name` from byte `offset` into `dst` (GPU memory allocated elsewhere): up to
/// `dst.len()` bytes, fewer only where the file ends (like `readinto`). An offset past the end
/// is an invalid argument ([`FilesError::InvalidArgument`]). `watch` aborts device-side waits ([`crate::gpu::watchdog`]).
pub fn read_into(
    setup: &GpuSetup,
    fs: &FileSystem,
    name: &str,
    offset: u64,
    dst: &Arc<DeviceMemory>,
    path: ReadPath,
    mut watch: impl FnMut() -> Option<String> + Send,
) -> Result<GpuIoReport> {
    let file = fs.open(name, OpenMode::ReadOnly)?;
    let size = file.len()?;
    if offset > size {
        return Err(FilesError::InvalidArgument(format!(
            "offset {offset} is past the end of {name} ({size} bytes)"
        ))
        .into());
    }
    let n = (size - offset).min(dst.len() as u64);
    if n == 0 {
        return Ok(GpuIoReport::new(name, 0, 0.0, false, setup, false));
    }
    let files = GpuFiles::new(&setup.queues, GpuFilesOptions::from_env()?);
    let gfile = files.open(&file).context("opening the file for the GPU")?;
    let t0 = Instant::now();
    let mapped = match path {
        ReadPath::Direct => setup.queues.map_memory(dst.clone()),
        ReadPath::Staged => Err(GpuError::Unsupported("staging asked for".into())),
    };
    match mapped {
        Ok(buf) => {
            let span = GpuSpan::of(&buf, 0, n)?;
            let r = files
                .submit(&[FileRange::read(&gfile, offset, span)])?
                .wait_watched(&mut watch)?
                .into_first_error()?;
            ensure!(
                r.bytes() == n,
                Device,
                "the GPU read {} of {n} bytes",
                r.bytes()
            );
            let secs = r.elapsed.as_secs_f64();
            Ok(GpuIoReport::new(name, n, secs, false, setup, false))
        }
        Err(GpuError::Unsupported(_)) => {
            // Through a bounce buffer the controller reaches, two windows overlapping reads
            // and copies ([`crate::staged`]).
            crate::staged::read_range(&files, &gfile, offset, n, dst, &mut watch)?;
            let secs = t0.elapsed().as_secs_f64();
            Ok(GpuIoReport::new(name, n, secs, true, setup, false))
        }
        Err(e) => Err(e).context("mapping the destination for the controller"),
    }
}

/// One piece of a file written by [`write_pieces`]: the file is the pieces in order.
pub enum Piece {
    /// Bytes from host memory (a header).
    Host(Vec<u8>),
    /// All of a range of GPU memory allocated elsewhere (a tensor).
    Gpu(Arc<DeviceMemory>),
}

impl Piece {
    /// Its bytes.
    pub fn len(&self) -> u64 {
        match self {
            Piece::Host(b) => b.len() as u64,
            Piece::Gpu(m) => m.len() as u64,
        }
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `pieces` end to end as a data source (file offset 0 is the first piece's first byte): host
/// pieces copied, GPU pieces read from GPU memory (synchronous copies). For writes whose bytes
/// cross host memory (a served device's write lease).
pub(crate) struct PiecesSource<'a> {
    pieces: &'a [Piece],
    starts: Vec<u64>,
}

impl<'a> PiecesSource<'a> {
    pub(crate) fn new(pieces: &'a [Piece]) -> Self {
        let mut at = 0;
        let starts = pieces
            .iter()
            .map(|p| {
                let s = at;
                at += p.len();
                s
            })
            .collect();
        Self { pieces, starts }
    }
}

impl blockfs::DataSource for PiecesSource<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let i = self.starts.partition_point(|&s| s <= at).wrapping_sub(1);
            let piece = self
                .pieces
                .get(i)
                .filter(|p| at - self.starts[i] < p.len())
                .ok_or(std::io::ErrorKind::UnexpectedEof)?;
            let within = at - self.starts[i];
            let n = ((piece.len() - within) as usize).min(buf.len() - done);
            let out = &mut buf[done..done + n];
            match piece {
                Piece::Host(b) => out.copy_from_slice(&b[within as usize..within as usize + n]),
                Piece::Gpu(m) => m
                    .read(within as usize, out)
                    .map_err(|e| std::io::Error::other(e.to_string()))?,
            }
            done += n;
        }
        Ok(())
    }
}

/// Writes `pieces`, in order, as the whole content of `file` (a new file: opened read-write,
/// empty), by GPU-issued writes through a device-write reservation, then commits the length
/// with the CRC-32C computed on the GPU as the file's checksum. `expect_crc`: the checksum the
/// caller knows the bytes have (the host's, for `fs put --gpu`); a mismatch fails before the
/// commit. Sync the file system afterwards to make the file durable.
pub fn write_pieces(
    setup: &GpuSetup,
    file: &blockfs::File,
    pieces: &[Piece],
    expect_crc: Option<u32>,
    mut watch: impl FnMut() -> Option<String> + Send,
) -> Result<GpuIoReport> {
    let name = file.name().to_owned();
    let total: u64 = pieces.iter().map(Piece::len).sum();
    let files = GpuFiles::new(&setup.queues, GpuFilesOptions::from_env()?);
    let gfile = files.reserve(file, total).context("reserving the file")?;
    let t0 = Instant::now();
    let mut crc = 0u32;
    if total > 0 {
        let stage = setup
            .queues
            .alloc_buffer(stage_len(total))
            .context("allocating a GPU staging buffer")?;
        let stream = setup.queues.client_stream();
        crc = stage_pieces(
            stream,
            stage.memory(),
            in_mem(&stage),
            stage.len() as u64,
            pieces,
            |at, len| {
                let crc = files.crc32c(stage.ptr(), len)?;
                let span = GpuSpan::of(&stage, 0, len)?;
                files
                    .submit(&[FileRange::write(&gfile, at, span)])?
                    .wait_watched(&mut watch)?
                    .into_first_error()?;
                Ok(crc)
            },
        )?;
    }
    let secs = t0.elapsed().as_secs_f64();
    check_expected(&name, crc, expect_crc)?;
    gfile.commit_with_crc(total, crc)?;
    let mut report = GpuIoReport::new(&name, total, secs, true, setup, true);
    report.crc32c = Some(format!("{crc:08x}"));
    Ok(report)
}

/// [`write_pieces`] on a striped volume: `setups` are the members' GPU queues in member order,
/// the reservation's table is cut per member and every window's runs are written on their
/// members' queues ([`blockfs_gpu::VolumeFiles::write`], every member's batch at once). The
/// report's path is the first member's.
pub fn write_pieces_volume(
    setups: &[&GpuSetup],
    volume: &blockfs::StripedVolume,
    file: &blockfs::File,
    pieces: &[Piece],
    expect_crc: Option<u32>,
    mut watch: impl FnMut() -> Option<String> + Send,
) -> Result<GpuIoReport> {
    let first = setups.first().context("a volume without members")?;
    let name = file.name().to_owned();
    let total: u64 = pieces.iter().map(Piece::len).sum();
    let queues: Vec<&gpu_queues::GpuQueues> = setups.iter().map(|s| &s.queues).collect();
    let vf = blockfs_gpu::VolumeFiles::new(&queues, GpuFilesOptions::from_env()?);
    let reservation = vf
        .reserve(volume, file, total)
        .context("reserving the file")?;
    let t0 = Instant::now();
    let mut crc = 0u32;
    if total > 0 {
        let stage = Arc::new(
            DeviceMemory::alloc(first.queues.cuda(), stage_len(total))
                .context("allocating a GPU staging buffer")?,
        );
        let stream = first.queues.client_stream();
        crc = stage_pieces(stream, &stage, 0, stage.len() as u64, pieces, |at, len| {
            let crc = blockfs_gpu::crc32c_on(&first.queues, stream, stage.ptr(), len)?;
            let r = vf.write(volume, &reservation, at, &stage, len, &mut watch)?;
            ensure!(
                r.bytes == len,
                Device,
                "the GPU wrote {} of {len} bytes",
                r.bytes
            );
            Ok(crc)
        })?;
    }
    let secs = t0.elapsed().as_secs_f64();
    check_expected(&name, crc, expect_crc)?;
    reservation.commit_with_crc(total, crc)?;
    let mut report = GpuIoReport::new(&name, total, secs, true, first, true);
    report.crc32c = Some(format!("{crc:08x}"));
    Ok(report)
}

/// Assembles `pieces` window by window in `stage` (bytes `base..base + cap` of it, on
/// `stream`), calling `window(at, len)` once a window holds file bytes `at..at + len` (it
/// writes them and returns their CRC-32C); returns the CRC-32C of all the bytes.
fn stage_pieces(
    stream: &gpu_queues::ffi::Stream,
    stage: &DeviceMemory,
    base: usize,
    cap: u64,
    pieces: &[Piece],
    mut window: impl FnMut(u64, u64) -> Result<u32>,
) -> Result<u32> {
    let total: u64 = pieces.iter().map(Piece::len).sum();
    let mut crc = 0u32;
    // The next byte to stage: piece `p`, byte `within` of it.
    let (mut p, mut within) = (0usize, 0u64);
    let mut at = 0u64;
    while at < total {
        let len = (total - at).min(cap);
        let mut filled = 0u64;
        while filled < len {
            let piece = &pieces[p];
            let take = (piece.len() - within).min(len - filled);
            match piece {
                Piece::Host(bytes) => copy_to_gpu(
                    stream,
                    stage.ptr() + (base as u64 + filled),
                    &bytes[within as usize..(within + take) as usize],
                )?,
                Piece::Gpu(mem) => stream.copy_device(
                    stage,
                    base + filled as usize,
                    mem,
                    within as usize,
                    take as usize,
                )?,
            }
            filled += take;
            within += take;
            if within == piece.len() {
                p += 1;
                within = 0;
            }
        }
        stream.wait_idle(compute_wait_bound())?;
        crc = crc32c_combine(crc, window(at, len)?, len);
        at += len;
    }
    Ok(crc)
}

/// Fails with [`GpuChecksumMismatch`] where the caller expected another checksum.
fn check_expected(name: &str, crc: u32, expect: Option<u32>) -> Result<()> {
    if let Some(want) = expect
        && want != crc
    {
        return Err(GpuChecksumMismatch {
            name: name.to_owned(),
            gpu: crc,
            host: want,
            what: "the host's",
        }
        .into());
    }
    Ok(())
}

/// The file a GPU write goes to: `name` itself when new, else (with `force`) a temporary file
/// swapped in by [`finish_target`] once it is complete.
pub struct Target {
    /// The name asked for.
    pub name: String,
    /// The name written (the same, or a temporary one).
    pub written: String,
    /// The file, empty, open read-write.
    pub file: blockfs::File,
}

/// Creates the file a GPU write of `len` bytes to `name` goes to ([`blockfs::Error::AlreadyExists`]
/// where `name` exists and `force` is not set).
pub fn prepare_target(fs: &FileSystem, name: &str, len: u64, force: bool) -> Result<Target> {
    let exists = fs.stat(name).is_ok();
    if exists && !force {
        return Err(blockfs::Error::AlreadyExists(name.to_owned()).into());
    }
    let written = if exists {
        format!("{name}.gpu-put-{}", std::process::id())
    } else {
        name.to_owned()
    };
    let file = fs.create(&written, &CreateOptions { size_hint: len })?;
    Ok(Target {
        name: name.to_owned(),
        written,
        file,
    })
}

/// Makes the write of `target` durable, or undoes it: on success the temporary file (if any)
/// replaces `name` by one commit and the file system is synced; on failure the file written is
/// removed (the old `name`, if any, stays as it was) and `result`'s error returned.
pub fn finish_target<T>(fs: &FileSystem, target: Target, result: Result<T>) -> Result<T> {
    let Target {
        name,
        written,
        file,
    } = target;
    drop(file);
    match result {
        Ok(v) => {
            if written != name {
                fs.rename_replace(&written, &name)?;
            }
            fs.sync().context("committing the file")?;
            Ok(v)
        }
        Err(e) => {
            let _ = fs.remove(&written);
            let _ = fs.sync();
            Err(e)
        }
    }
}

/// A staging buffer's length for `n` bytes: at most [`STAGE_MAX`], whole [`STAGE_ALIGN`]s.
fn stage_len(n: u64) -> usize {
    (n.min(STAGE_MAX as u64) as usize).next_multiple_of(STAGE_ALIGN)
}

/// Where `buf` starts in its memory.
fn in_mem(buf: &GpuBuffer) -> usize {
    (buf.ptr() - buf.memory().ptr()) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_windows_are_whole_megabytes_up_to_the_cap() {
        assert_eq!(stage_len(1), STAGE_ALIGN);
        assert_eq!(stage_len(STAGE_ALIGN as u64 + 1), 2 * STAGE_ALIGN);
        assert_eq!(stage_len(10 << 30), STAGE_MAX);
        assert_eq!(STAGE_MAX % STAGE_ALIGN, 0);
    }
}
