//! GPU file reads into GPU memory where the controller reaches only host memory mapped into the
//! GPU ([`GpuQueues::buffers_in_host_memory`]: a controller a `gpunvme serve` daemon owns, whose
//! buffers are memory the daemon lends): the GPU's reads land in a
//! bounce buffer the controller reaches, and a copy engine moves each window of it into GPU
//! memory. Tensors then live in GPU memory, as on an owned device, not in host pages every
//! kernel would read over PCIe.
//!
//! The bounce buffer is two windows, each used by a client stream of its own. A window's copy
//! is queued on its stream behind that window's reads, and the next reads into the window
//! behind the copy, so stream order alone keeps a window from being overwritten before it is
//! copied out, while the other stream's reads keep the controller busy. Everything is queued
//! up front; the caller waits once, and no CPU work sits between two windows.

use std::sync::Arc;
use std::time::{Duration, Instant};

use blockfs_gpu::{FileRange, FilesError, GpuFile, GpuFiles, GpuSpan};
use gpu_queues::ffi::{DeviceMemory, Stream};
use gpu_queues::{GpuBuffer, GpuError};

/// Bytes of one bounce window unless the job is smaller: two of them are lent (and registered
/// with CUDA by this process, about 0.3 ms per MiB), and each window's reads are one kernel.
pub const WINDOW_BYTES: u64 = 32 << 20;

/// File offsets keep this alignment in the bounce buffer (a piece starts at a window offset
/// congruent to its file offset), so whole LBAs of 512 or 4096 bytes still move straight from
/// the device into the window.
const ALIGN: u64 = 4096;

/// One read of a staged job: `len` bytes of file `file` (an index into the caller's opened
/// files) at `offset`, for byte `dest` of the destination memory on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedRead {
    /// Which opened file.
    pub file: usize,
    /// First byte in the file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// First byte in the destination.
    pub dest: u64,
}

/// A piece of a window: a read (or the part of one) placed at byte `at` of its window; the
/// read is the one at `origin` of the planned reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) read: StagedRead,
    pub(crate) at: u64,
    pub(crate) origin: usize,
}

/// What a staged job moved.
#[derive(Clone, Copy, Debug)]
pub struct StagedOutcome {
    /// Bytes read (and copied).
    pub bytes: u64,
    /// From the first launch to the last copy's end.
    pub elapsed: Duration,
    /// Windows the job took.
    pub windows: usize,
}

/// The bounce bytes a job of `total` bytes uses: two windows of [`WINDOW_BYTES`], or less for a
/// small job (whole pages, room for one alignment gap).
pub fn bounce_bytes(total: u64) -> u64 {
    2 * window_for(total)
}

fn window_for(total: u64) -> u64 {
    WINDOW_BYTES
        .min((total + ALIGN).next_multiple_of(ALIGN))
        .max(2 * ALIGN)
}

/// Cuts `reads` into windows of `window` bytes (at least `2 * ALIGN`): each read keeps its order;
/// a piece starts at a window offset congruent to its file offset modulo `ALIGN`, and a read
/// that does not fit is cut where the rest starts `ALIGN`-aligned in the file.
pub(crate) fn plan_windows(reads: &[StagedRead], window: u64) -> Vec<Vec<Piece>> {
    let window = window.max(2 * ALIGN);
    let mut windows: Vec<Vec<Piece>> = Vec::new();
    let mut cur: Vec<Piece> = Vec::new();
    let mut used = 0u64;
    for (origin, r) in reads.iter().enumerate().filter(|(_, r)| r.len > 0) {
        let mut rest = *r;
        while rest.len > 0 {
            let skew = rest.offset % ALIGN;
            // The first offset from `used` on congruent to the file offset (a read that
            // follows the last one in the file follows it in the window).
            let at = used + (skew + ALIGN - used % ALIGN) % ALIGN;
            let room = window.saturating_sub(at);
            let take = if rest.len <= room {
                rest.len
            } else {
                // Up to an aligned file offset, so the rest starts aligned in its window.
                ((rest.offset + room) / ALIGN * ALIGN).saturating_sub(rest.offset)
            };
            if take == 0 {
                // Nothing fits beside what the window holds: the next window. A fresh one
                // always takes something (it starts at `skew`, and `window >= 2 * ALIGN`).
                windows.push(std::mem::take(&mut cur));
                used = 0;
                continue;
            }
            cur.push(Piece {
                read: StagedRead { len: take, ..rest },
                at,
                origin,
            });
            used = at + take;
            rest = advance(rest, take);
            if rest.len > 0 {
                windows.push(std::mem::take(&mut cur));
                used = 0;
            }
        }
    }
    if !cur.is_empty() {
        windows.push(cur);
    }
    windows
}

fn advance(r: StagedRead, by: u64) -> StagedRead {
    StagedRead {
        offset: r.offset + by,
        len: r.len - by,
        dest: r.dest + by,
        ..r
    }
}

/// The copies out of one window: runs of pieces adjacent in both the window and the
/// destination are one copy. Each is (window offset, destination offset, bytes).
fn window_copies(pieces: &[Piece]) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for p in pieces {
        match out.last_mut() {
            Some((at, dest, len)) if *at + *len == p.at && *dest + *len == p.read.dest => {
                *len += p.read.len
            }
            _ => out.push((p.at, p.read.dest, p.read.len)),
        }
    }
    out
}

/// Reads `reads` of `opened` into `dest` (GPU memory) through `bounce`, a buffer of at least
/// [`bounce_bytes`] of the job that the controller of `files`' queues reaches; `watch` ends
/// the waits early (the queues' watchdog). Every read's bytes are in `dest` when this returns
/// `Ok`; a range that failed is the error (the others were waited for).
pub fn read_staged(
    files: &GpuFiles<'_>,
    opened: &[GpuFile],
    reads: &[StagedRead],
    dest: &DeviceMemory,
    bounce: &GpuBuffer,
    mut watch: impl FnMut() -> Option<String>,
) -> Result<StagedOutcome, FilesError> {
    let total: u64 = reads.iter().map(|r| r.len).sum();
    for r in reads {
        if r.file >= opened.len()
            || r.dest
                .checked_add(r.len)
                .is_none_or(|e| e > dest.len() as u64)
        {
            return Err(FilesError::InvalidArgument(format!(
                "a staged read of {} bytes for destination byte {} (file {} of {}) outside the \
                 destination's {} bytes",
                r.len,
                r.dest,
                r.file,
                opened.len(),
                dest.len()
            )));
        }
    }
    let window = window_for(total).min(bounce.len() as u64 / 2);
    if window < 2 * ALIGN {
        return Err(FilesError::InvalidArgument(format!(
            "a bounce buffer of {} bytes: at least {} are needed",
            bounce.len(),
            4 * ALIGN
        )));
    }
    let windows = plan_windows(reads, window);
    let queues = files.queues();
    let streams = [queues.new_client_stream()?, queues.new_client_stream()?];
    let src = bounce.shared_memory();
    let base = (bounce.ptr() - src.ptr()) as usize;
    let started = Instant::now();
    let mut pending = Vec::with_capacity(windows.len());
    for (w, pieces) in windows.iter().enumerate() {
        let half = (w % 2) as u64 * window;
        let stream: &Stream = &streams[w % 2];
        let ranges = pieces
            .iter()
            .map(|p| {
                let span = GpuSpan::of(bounce, half + p.at, p.read.len)?;
                Ok(FileRange::read(&opened[p.read.file], p.read.offset, span))
            })
            .collect::<Result<Vec<_>, FilesError>>()?;
        pending.push(files.submit_on(stream, &ranges)?);
        // Behind the reads on the same stream: the copy starts once they are done, and the
        // next reads into this window (two windows on) start once it is.
        for (at, to, len) in window_copies(pieces) {
            stream.copy_device(
                dest,
                to as usize,
                src,
                base + (half + at) as usize,
                len as usize,
            )?;
        }
    }
    let mut bytes = 0u64;
    let mut first_error = None;
    for p in pending {
        match p
            .wait_watched(&mut watch)
            .and_then(|r| r.into_first_error())
        {
            Ok(r) => bytes += r.bytes(),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    for s in &streams {
        s.wait_idle(Duration::from_secs(10))?;
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(StagedOutcome {
        bytes,
        elapsed: started.elapsed(),
        windows: windows.len(),
    })
}

/// Reads `len` bytes of `file` from `offset` into `dest` (from its first byte) through a new
/// bounce buffer of `files`' controller ([`read_staged`] of one range); fewer bytes than asked
/// is an error.
pub fn read_range(
    files: &GpuFiles<'_>,
    file: &GpuFile,
    offset: u64,
    len: u64,
    dest: &DeviceMemory,
    watch: impl FnMut() -> Option<String>,
) -> Result<StagedOutcome, FilesError> {
    let bounce = files
        .queues()
        .alloc_buffer(bounce_bytes(len) as usize)
        .map_err(FilesError::from)?;
    let read = StagedRead {
        file: 0,
        offset,
        len,
        dest: 0,
    };
    let out = read_staged(
        files,
        std::slice::from_ref(file),
        &[read],
        dest,
        &bounce,
        watch,
    )?;
    if out.bytes != len {
        return Err(FilesError::Gpu(GpuError::InvalidArgument(format!(
            "the GPU read {} of {len} bytes",
            out.bytes
        ))));
    }
    Ok(out)
}

/// Where a load's or a read's bytes are: GPU memory, reachable by the controller where the
/// transport maps it (`mapped`), or not (staged through a bounce buffer).
pub struct GpuTarget {
    mem: Arc<DeviceMemory>,
    ptr: u64,
    len: usize,
    mapped: Option<GpuBuffer>,
}

impl std::fmt::Debug for GpuTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuTarget({:#x}+{:#x})", self.ptr, self.len)
    }
}

impl GpuTarget {
    /// A buffer the controller reaches.
    pub fn mapped(buf: GpuBuffer) -> Self {
        Self {
            mem: buf.shared_memory().clone(),
            ptr: buf.ptr(),
            len: buf.len(),
            mapped: Some(buf),
        }
    }

    /// GPU memory the controller does not reach (filled by staged reads).
    pub fn unmapped(mem: Arc<DeviceMemory>) -> Self {
        Self {
            ptr: mem.ptr(),
            len: mem.len(),
            mem,
            mapped: None,
        }
    }

    /// GPU pointer of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The GPU memory the bytes are in (they start at [`GpuTarget::ptr`] - its `ptr()`).
    pub fn memory(&self) -> &Arc<DeviceMemory> {
        &self.mem
    }

    /// The buffer the controller reaches, where it does (else the bytes were staged).
    pub fn buffer(&self) -> Option<&GpuBuffer> {
        self.mapped.as_ref()
    }

    /// Copies `buf.len()` bytes from byte `offset` to the host (tests and tools).
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), GpuError> {
        let at = (self.ptr - self.mem.ptr()) as usize + offset;
        if offset.checked_add(buf.len()).is_none_or(|e| e > self.len) {
            return Err(GpuError::InvalidArgument(format!(
                "bytes {offset}..{} outside {} bytes",
                offset.saturating_add(buf.len()),
                self.len
            )));
        }
        self.mem.read(at, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(file: usize, offset: u64, len: u64, dest: u64) -> StagedRead {
        StagedRead {
            file,
            offset,
            len,
            dest,
        }
    }

    /// Every byte of every read lands once, in order, inside a window, keeping its file
    /// offset's alignment; pieces of a window do not overlap.
    fn check(reads: &[StagedRead], window: u64) -> Vec<Vec<Piece>> {
        let w = plan_windows(reads, window);
        let flat: Vec<Piece> = w.iter().flatten().copied().collect();
        let mut it = flat.iter().peekable();
        for read in reads.iter().filter(|r| r.len > 0) {
            let mut at = *read;
            while at.len > 0 {
                let p = it.next().expect("a piece for every byte");
                assert_eq!(
                    (p.read.file, p.read.offset, p.read.dest),
                    (at.file, at.offset, at.dest)
                );
                assert!(p.read.len > 0 && p.read.len <= at.len);
                at = advance(at, p.read.len);
            }
        }
        assert!(it.next().is_none());
        for pieces in &w {
            assert!(!pieces.is_empty());
            let mut end = 0;
            for p in pieces {
                assert!(p.at >= end, "{pieces:?} overlap");
                assert!(p.at + p.read.len <= window, "{p:?} past the window");
                assert_eq!(p.at % ALIGN, p.read.offset % ALIGN, "{p:?} alignment");
                end = p.at + p.read.len;
            }
        }
        w
    }

    #[test]
    fn a_read_larger_than_a_window_is_cut_at_aligned_offsets() {
        let w = check(&[r(0, 100, 10 * 8192 + 5, 0)], 8192);
        assert!(w.len() >= 10);
        assert!(w[1..].iter().all(|p| p[0].read.offset % ALIGN == 0));
    }

    #[test]
    fn small_reads_share_a_window_and_adjacent_ones_are_one_copy() {
        let reads = [r(0, 0, 1000, 0), r(0, 1000, 3000, 1000), r(1, 8, 16, 5000)];
        let w = check(&reads, 1 << 20);
        assert_eq!(w.len(), 1);
        // The first two are adjacent in the file, the window and the destination.
        assert_eq!(window_copies(&w[0])[0], (0, 0, 4000));
        assert_eq!(window_copies(&w[0]).len(), 2);
    }

    #[test]
    fn odd_shapes_cover_every_byte() {
        let mut seed = 7u64;
        for _ in 0..200 {
            let mut reads = Vec::new();
            let mut dest = 0;
            for f in 0..(seed % 5 + 1) {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let len = (seed >> 20) % 70_000;
                let off = (seed >> 40) % 50_000;
                reads.push(r(f as usize, off, len, dest));
                dest += len;
            }
            let window = [8192u64, 12288, 65536][(seed % 3) as usize];
            check(&reads, window);
        }
        assert!(plan_windows(&[r(0, 5, 0, 0)], 8192).is_empty());
    }

    #[test]
    fn the_bounce_is_two_windows_at_most_and_small_for_small_jobs() {
        assert_eq!(bounce_bytes(10 << 30), 2 * WINDOW_BYTES);
        assert_eq!(bounce_bytes(1), 4 * ALIGN);
        assert_eq!(bounce_bytes(1 << 20), 2 * ((1 << 20) + ALIGN));
    }
}
