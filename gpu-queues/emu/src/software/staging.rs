//! The write side of a [`GpuDma`] engine: every write the controller makes is staged in a
//! pinned area with a [`CopyDesc`] naming its destination (or noted as a [`Direct`] or
//! [`EngineCopy`] copy), and one scatter kernel per flush moves them all; Reads straight from
//! the image (`stage_from_file`); whether writes are still pending.

use std::sync::Arc;
use std::time::Instant;

use crate::os::{DIRECT_ALIGN, MappedImage};
use gpu_queues::GpuError;
use gpu_queues::ffi::{Arg, Event, PinnedMemory};
use zerocopy::IntoBytes;

use crate::desc::{COPY_LATE, CopyDesc};
use crate::image_reads::Source;

use super::engine::{
    BIG_STAGING_BYTES, Engine, EngineState, GPU_WAIT, GpuDma, MAX_GATHER_PIECES, MAX_PIECES,
    PIECE_BYTES, launch_per_piece, lock, timed,
};
use super::modes::{CopyMode, ENGINE_COPY_MIN, StagedCopies};
use super::pinning::LazyPinned;
use super::stats::LULL;

/// A Read's data copied straight from a registered image window ([`ImageWindows`]) by a copy
/// engine, issued at the flush of the staging area it was noted in, before that area's scatter
/// (which carries the command's completion).
///
/// [`ImageWindows`]: crate::image_reads::ImageWindows
pub(super) struct Direct {
    dst: u64,
    window: Arc<MappedImage>,
    offset: usize,
    len: usize,
}

/// Direct copies one staging area notes before it is flushed.
const MAX_DIRECT: usize = 4096;

/// A Read's data staged from the image and moved by a copy engine (adjacent ones merged), issued
/// at the flush of its staging area before that area's scatter ([`StagedCopies::Engine`]): so
/// before the completions among the scatter's pieces, and before any piece of the same area
/// whatever the order they were staged in (only commands in flight together can write the same
/// bytes, and NVMe leaves the result of such overlaps undefined).
pub(super) struct EngineCopy {
    /// Byte offset in the area's data part.
    src: usize,
    dst: u64,
    len: usize,
}

pub(super) struct Staging {
    /// MAX_PIECES descriptors, then `capacity` bytes of data (allocated at the area's first
    /// use).
    pub(super) mem: LazyPinned,
    /// Data bytes the area holds: [`STAGING_BYTES`], or [`BIG_STAGING_BYTES`] once it grew
    /// ([`GpuDma::grow_staging`]).
    pub(super) capacity: usize,
    /// Direct copies to issue, in order, before this area's scatter.
    pub(super) direct: Vec<Direct>,
    /// Staged Reads to move by copy engine, in order, before this area's scatter.
    pub(super) copies: Vec<EngineCopy>,
    /// Finished when the scatter that read this area is done.
    pub(super) drained: Event,
    pub(super) pieces: usize,
    pub(super) bytes: usize,
}

impl GpuDma {
    /// Stages `data` for GPU address `dst`; `late` pieces are written after all others of the
    /// same flush.
    fn stage(
        &self,
        e: &Engine,
        st: &mut EngineState,
        dst: u64,
        data: &[u8],
        late: bool,
    ) -> Result<(), GpuError> {
        self.stage_with(
            e,
            st,
            dst,
            data.len(),
            late,
            false,
            false,
            |mem, at, done, n| {
                mem.write(at, &data[done..done + n]);
                Ok(())
            },
        )
        // The fill above never fails.
        .map(|_always_ok| ())
    }

    /// Stages `len` bytes for GPU address `dst`, flushing whenever the current area is full;
    /// `fill(mem, at, done, n)` puts bytes `done..done + n` of the range at `at` of `mem`. The
    /// first `fill` error ends the staging (what was described before it is still copied).
    /// `by_engine`: moved by copy engine ([`EngineCopy`]) rather than the scatter kernel.
    /// `aligned` (with `by_engine`): every piece starts at a [`DIRECT_ALIGN`] boundary of the
    /// host's addresses and spans whole multiples of it but for the range's last (direct I/O's
    /// rule: a copy engine takes any alignment).
    #[allow(clippy::too_many_arguments)]
    fn stage_with(
        &self,
        e: &Engine,
        st: &mut EngineState,
        dst: u64,
        len: usize,
        late: bool,
        by_engine: bool,
        aligned: bool,
        mut fill: impl FnMut(&PinnedMemory, usize, usize, usize) -> std::io::Result<()>,
    ) -> Result<std::io::Result<()>, GpuError> {
        let mut done = 0;
        while done < len {
            let area = &mut st.areas[st.cur];
            let host = area.mem.get()?.host_ptr().addr();
            let data = MAX_PIECES * size_of::<CopyDesc>();
            // Staged at the destination's alignment modulo 16: the scatter then moves the bytes
            // as 16-byte vectors however the destination is aligned (`copy_piece`), and a Read
            // that follows another in GPU memory follows it in staging too (one copy).
            let src = if aligned {
                let base = host + data;
                (base + area.bytes).next_multiple_of(DIRECT_ALIGN) - base
            } else {
                area.bytes + ((dst + done as u64).wrapping_sub(area.bytes as u64) & 15) as usize
            };
            let full = if by_engine {
                area.copies.len() == MAX_DIRECT
            } else {
                area.pieces == MAX_PIECES
            };
            if full || src >= area.capacity {
                self.flush_locked(e, st)?;
                continue;
            }
            let area = &mut st.areas[st.cur];
            // As much as the area has room for, in pieces and in bytes.
            let room = if by_engine {
                usize::MAX
            } else {
                (MAX_PIECES - area.pieces) * PIECE_BYTES
            };
            let mut n = (len - done).min(area.capacity - src).min(room);
            if aligned && n < len - done {
                n -= n % DIRECT_ALIGN;
                if n == 0 {
                    self.flush_locked(e, st)?;
                    continue;
                }
            }
            if let Err(err) = fill(area.mem.get()?, data + src, done, n) {
                // Nothing of this piece was described: its staged bytes are never copied.
                return Ok(Err(err));
            }
            let to = dst + done as u64;
            if by_engine {
                match area.copies.last_mut() {
                    Some(last)
                        if last.src + last.len == src && last.dst + last.len as u64 == to =>
                    {
                        last.len += n;
                    }
                    _ => area.copies.push(EngineCopy {
                        src,
                        dst: to,
                        len: n,
                    }),
                }
                area.bytes = src + n;
            } else {
                Self::describe(area, to, src, n, late)?;
            }
            done += n;
        }
        Ok(Ok(()))
    }

    /// Stages `len` bytes for GPU address `dst` straight from `file` at `file_offset` (a
    /// positioned read into the staging area: the file's bytes are copied once on the host).
    /// `None` when gathered bytes overlap `dst` (they would have to be updated too: the caller
    /// takes the general path); else the file's result.
    pub(super) fn stage_from_file(
        &self,
        dst: u64,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> Result<Option<std::io::Result<()>>, GpuError> {
        let e = self.engine();
        let mut guard = lock(e);
        let st = &mut *guard;
        let end = dst + len as u64;
        if st
            .fetched
            .iter()
            .any(|f| dst < f.gpu + f.len as u64 && f.gpu < end)
        {
            return Ok(None);
        }
        if let Some(w) = self.windows.lookup(file, file_offset, len) {
            let area = &st.areas[st.cur];
            if area.direct.len() == MAX_DIRECT {
                self.flush_locked(e, st)?;
            }
            let area = &mut st.areas[st.cur];
            match area.direct.last_mut() {
                Some(last)
                    if Arc::ptr_eq(&last.window, &w.window)
                        && last.offset + last.len == w.offset
                        && last.dst + last.len as u64 == dst =>
                {
                    last.len += len;
                }
                _ => area.direct.push(Direct {
                    dst,
                    window: w.window,
                    offset: w.offset,
                    len,
                }),
            }
            st.stats.direct_bytes += len as u64;
            return Ok(Some(Ok(())));
        }
        st.stats.staged_file_bytes += len as u64;
        let now = Instant::now();
        if st
            .stats
            .last_staged
            .is_none_or(|t| now.saturating_duration_since(t) > LULL)
        {
            st.stats.burst_start = Some(now);
        }
        let mut file_ns = 0;
        let by_engine = self.staged == StagedCopies::Engine
            && self.mode == CopyMode::Kernels
            && len >= ENGINE_COPY_MIN;
        // Out of a prefetch's pool where one reads the range (ColdReads::Prefetch), out of the
        // image's mapping where every page is cached (ReadMode::Mapped), by direct I/O where
        // none is (ColdReads::Direct; Reads the copy engine moves: they may sit anywhere in
        // staging), else `pread`.
        let base = usize::try_from(file_offset);
        let source = match self.views.lookup(file, file_offset, len) {
            Source::Pool(p) => Source::Pool(p),
            Source::Mapped(map) if base.is_ok() => {
                st.stats.mapped_bytes += len as u64;
                Source::Mapped(map)
            }
            Source::Direct(d) if by_engine => Source::Direct(d),
            Source::Mapped(_) | Source::Direct(_) | Source::Read => Source::Read,
        };
        let aligned = matches!(source, Source::Direct(_));
        let mut direct_bytes = 0;
        let r = self.stage_with(
            e,
            st,
            dst,
            len,
            false,
            by_engine,
            aligned,
            |mem, at, done, n| {
                let offset = file_offset + done as u64;
                timed(&mut file_ns, || match (&source, &base) {
                    (Source::Mapped(map), Ok(base)) => {
                        crate::os::copy_from_mapping(mem, at, n, map, base + done)
                    }
                    (Source::Direct(d), _) => d.read_into(mem, at, n, offset, file).map(|direct| {
                        if direct {
                            direct_bytes += n as u64;
                        }
                    }),
                    (Source::Pool(p), _) => {
                        let got = p.serve(offset, n, |d, bytes| mem.write(at + d, bytes));
                        direct_bytes += got as u64;
                        mem.read_file_at(at + got, n - got, file, offset + got as u64)
                    }
                    _ => mem.read_file_at(at, n, file, offset),
                })
            },
        );
        st.stats.cold_direct_bytes += direct_bytes;
        st.stats.file_ns += file_ns;
        st.stats.last_staged = Some(Instant::now());
        r.map(Some)
    }

    /// Adds descriptors for `n` bytes at `src` of `area`'s data, bound for `dst`, in pieces
    /// of at most [`PIECE_BYTES`] (the caller checked there is room for them), and moves the
    /// area's fill mark past them.
    fn describe(
        area: &mut Staging,
        dst: u64,
        src: usize,
        n: usize,
        late: bool,
    ) -> Result<(), GpuError> {
        let mem = area.mem.get()?;
        let mut at = 0;
        while at < n {
            let m = (n - at).min(PIECE_BYTES);
            let desc = CopyDesc {
                dst: dst + at as u64,
                src: (src + at) as u32,
                len: m as u32 | if late { COPY_LATE } else { 0 },
            };
            mem.write(area.pieces * size_of::<CopyDesc>(), desc.as_bytes());
            area.pieces += 1;
            at += m;
        }
        // The next piece is placed at its own destination's alignment (`stage_with`).
        area.bytes = src + n;
        Ok(())
    }

    /// Launches the scatter of the current staging area (if it holds anything) and switches to
    /// the other one, waiting (bounded) until the GPU has drained that one.
    pub(super) fn flush_locked(&self, e: &Engine, st: &mut EngineState) -> Result<(), GpuError> {
        let cur = st.cur;
        let pieces = st.areas[cur].pieces;
        if pieces == 0 && st.areas[cur].direct.is_empty() && st.areas[cur].copies.is_empty() {
            return Ok(());
        }
        self.cuda.make_current()?;
        // Direct copies first: a command's completion is among this area's pieces, and must
        // not become visible before its data.
        for d in st.areas[cur].direct.drain(..) {
            e.stream
                .copy_from_registered(d.window.registration(), d.offset, d.dst, d.len)?;
            st.stats.direct_copies += 1;
        }
        let data = MAX_PIECES * size_of::<CopyDesc>();
        let area = &mut st.areas[cur];
        let copies = area.copies.len() as u64;
        if copies > 0 || pieces > 0 {
            let mem = area.mem.get()?;
            for c in area.copies.drain(..) {
                e.stream.copy_from_pinned(mem, data + c.src, c.dst, c.len)?;
            }
        }
        st.stats.engine_copies += copies;
        let area = &mut st.areas[cur];
        // Allocated (pieces were staged in it) unless only direct copies were noted.
        let mem = if pieces > 0 {
            Some(area.mem.get()?)
        } else {
            None
        };
        match (self.mode, mem) {
            (_, None) => {}
            (CopyMode::Kernels, Some(mem)) => {
                let base = mem.device_ptr();
                launch_per_piece(
                    &e.stream,
                    self.kernels.scatter,
                    pieces,
                    &[
                        Arg::U64(base),
                        Arg::U32(pieces as u32),
                        Arg::U64(base + data as u64),
                        Arg::U64(e.done_blocks.ptr()),
                    ],
                )?;
            }
            (CopyMode::Memcpy, Some(mem)) => {
                // In stream order: every piece, then the late ones (completion phase dwords).
                for late in [false, true] {
                    for i in 0..pieces {
                        let mut d = CopyDesc::default();
                        mem.read(i * size_of::<CopyDesc>(), d.as_mut_bytes());
                        if (d.len & COPY_LATE != 0) == late {
                            let len = (d.len & !COPY_LATE) as usize;
                            e.stream
                                .copy_from_pinned(mem, data + d.src as usize, d.dst, len)?;
                        }
                    }
                }
            }
        }
        area.drained.record(&e.stream)?;
        st.in_flight = true;
        st.stats.scatters += 1;
        st.stats.pieces += pieces as u64;
        let area = &mut st.areas[cur];
        area.pieces = 0;
        area.bytes = 0;
        st.cur ^= 1;
        let drained = &st.areas[st.cur].drained;
        let mut waited = 0;
        let r = timed(&mut waited, || drained.wait(GPU_WAIT));
        st.stats.wait_ns += waited;
        st.stats.drain_wait_ns += waited;
        r?;
        // The area now current is drained and empty: where a large job asked for bigger areas
        // and they are ready, it takes one.
        let area = &mut st.areas[st.cur];
        if area.capacity < BIG_STAGING_BYTES {
            if let Some(mem) = self.big_area() {
                area.mem = LazyPinned::with(&self.cuda, mem);
                area.capacity = BIG_STAGING_BYTES;
            }
        }
        Ok(())
    }

    /// Performs every staged write now (asynchronously; later work on the stream is ordered
    /// after it). Ends the batch: gathered bytes are no longer trusted.
    pub(super) fn flush(&self) -> Result<(), GpuError> {
        let e = self.engine();
        let mut st = lock(e);
        st.fetched.clear();
        st.pending.clear();
        self.flush_locked(e, &mut st)
    }

    /// Waits (bounded) until every copy this thread's engine issued so far has run: the
    /// writes of its flushes are then visible to the GPU's threads.
    pub(super) fn wait_flushed(&self) -> Result<(), GpuError> {
        let e = self.engine();
        let t = Instant::now();
        let r = e.stream.wait_idle(GPU_WAIT);
        lock(e).stats.wait_ns += t.elapsed().as_nanos() as u64;
        r
    }

    /// Whether the calling thread's engine holds writes not yet known to be visible: staged and
    /// not flushed, or flushed and not yet seen finished. A failure to ask counts as pending
    /// (the caller then orders through the engine, which is always correct).
    pub(super) fn pending(&self) -> bool {
        let e = self.engine();
        let mut st = lock(e);
        let cur = st.cur;
        if st.areas[cur].pieces > 0
            || !st.areas[cur].direct.is_empty()
            || !st.areas[cur].copies.is_empty()
        {
            return true;
        }
        if st.in_flight {
            // The area flushed last is the other one; its event follows every earlier flush.
            match st.areas[cur ^ 1].drained.is_done() {
                Ok(true) => st.in_flight = false,
                _ => return true,
            }
        }
        false
    }

    pub(super) fn write(
        &self,
        dst: u64,
        data: &[u8],
        late_last_dword: bool,
    ) -> Result<(), GpuError> {
        let e = self.engine();
        let mut st = lock(e);
        // Gathered copies of these bytes must read as written (reads see every earlier write).
        let end = dst + data.len() as u64;
        let base = MAX_GATHER_PIECES * size_of::<CopyDesc>();
        for i in 0..st.fetched.len() {
            let f = st.fetched[i];
            let (lo, hi) = (dst.max(f.gpu), end.min(f.gpu + f.len as u64));
            if lo < hi {
                let at = base + f.at + (lo - f.gpu) as usize;
                st.gather
                    .get()?
                    .write(at, &data[(lo - dst) as usize..(hi - dst) as usize]);
            }
        }
        if late_last_dword && data.len() >= 4 {
            let split = data.len() - 4;
            self.stage(e, &mut st, dst, &data[..split], false)?;
            self.stage(e, &mut st, dst + split as u64, &data[split..], true)
        } else {
            self.stage(e, &mut st, dst, data, false)
        }
    }
}
