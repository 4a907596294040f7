//! The read side of a [`GpuDma`] engine: ranges announced by `prefetch` are fetched together by
//! one gather kernel into the pinned gather area and served from it until the batch moves on;
//! any other read is a copy and a wait of its own, ordered after the engine's writes or not.

use gpu_queues::GpuError;
use gpu_queues::ffi::{Arg, PinnedMemory, Stream};
use zerocopy::IntoBytes;

use crate::desc::CopyDesc;

use super::engine::{
    Engine, EngineState, GATHER_BYTES, GATHER_START_BYTES, GPU_WAIT, GpuDma, MAX_GATHER_PIECES,
    launch_per_piece, lock, timed,
};
use super::modes::CopyMode;
use super::pinning::LazyPinned;

/// A GPU range copied into the gather area, valid until the controller's batch moves on.
#[derive(Clone, Copy)]
pub(super) struct Fetched {
    pub(super) gpu: u64,
    pub(super) len: usize,
    /// Byte offset of its copy in the gather area's data part.
    pub(super) at: usize,
}

impl GpuDma {
    /// Drops gathered bytes and pending ranges: a new batch begins.
    pub(super) fn forget_gathered(&self) {
        let e = self.engine();
        let mut st = lock(e);
        st.fetched.clear();
        st.pending.clear();
    }

    /// Notes ranges the controller is about to read (`ordered`: after the engine's earlier
    /// writes); the next read fetches them all at once. Bytes gathered before are no longer
    /// trusted (a new step of the batch begins).
    pub(super) fn prefetch(&self, ranges: impl Iterator<Item = (u64, usize)>, ordered: bool) {
        let e = self.engine();
        let mut st = lock(e);
        st.fetched.clear();
        st.pending.extend(
            ranges
                .filter(|&(_, len)| len > 0 && len <= GATHER_BYTES)
                .map(|(gpu, len)| (gpu, len, ordered)),
        );
    }

    /// The stream a read copies on, after flushing the staged writes if it is `ordered` (or
    /// every read is, `GPUNVME_EMU_FETCH=ordered`).
    fn read_stream<'a>(
        &self,
        e: &'a Engine,
        st: &mut EngineState,
        ordered: bool,
    ) -> Result<&'a Stream, GpuError> {
        if ordered || self.always_ordered {
            self.flush_locked(e, st)?;
            Ok(&e.stream)
        } else {
            st.stats.unordered_reads += 1;
            Ok(&e.fetch)
        }
    }

    /// The gather area with room for `data` bytes of data (grown by powers of two from
    /// [`GATHER_START_BYTES`], at most [`GATHER_BYTES`]). Growing drops what the old area held:
    /// the caller has forgotten what was gathered (`fetched` is empty).
    pub(super) fn gather_area(
        gather: &mut LazyPinned,
        data: usize,
    ) -> Result<&PinnedMemory, GpuError> {
        let bytes = data
            .next_power_of_two()
            .clamp(GATHER_START_BYTES, GATHER_BYTES.max(data));
        gather.get_at_least(MAX_GATHER_PIECES * size_of::<CopyDesc>() + bytes)
    }

    /// Copies every pending range (as many as fit) into the gather area with one kernel, after
    /// every staged write if any of them is ordered, and waits for it (bounded).
    fn gather_locked(&self, e: &Engine, st: &mut EngineState) -> Result<(), GpuError> {
        st.fetched.clear();
        // The ranges that fit, and the data bytes they take.
        let (mut at, mut n) = (0usize, 0usize);
        for &(_, len, _) in &st.pending {
            if n == MAX_GATHER_PIECES || at + len > GATHER_BYTES {
                break;
            }
            at = (at + len).next_multiple_of(16);
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        let gather = Self::gather_area(&mut st.gather, at)?;
        let mut at = 0usize;
        for &(gpu, len, _) in &st.pending[..n] {
            let desc = CopyDesc {
                dst: gpu,
                src: at as u32,
                len: len as u32,
            };
            gather.write(st.fetched.len() * size_of::<CopyDesc>(), desc.as_bytes());
            st.fetched.push(Fetched { gpu, len, at });
            at = (at + len).next_multiple_of(16);
        }
        // The descriptors are in pinned memory no queued copy reads (every gather and sync
        // read is waited for): the flush of an ordered gather may come after them.
        let ordered = st.pending[..n].iter().any(|&(_, _, o)| o);
        st.pending.drain(..n);
        let stream = self.read_stream(e, st, ordered)?;
        let data = MAX_GATHER_PIECES * size_of::<CopyDesc>();
        match self.mode {
            CopyMode::Kernels => {
                let base = st.gather.get()?.device_ptr();
                launch_per_piece(
                    stream,
                    self.kernels.gather,
                    n,
                    &[
                        Arg::U64(base),
                        Arg::U32(n as u32),
                        Arg::U64(base + data as u64),
                    ],
                )?;
            }
            CopyMode::Memcpy => {
                for f in &st.fetched {
                    stream.copy_to_pinned(st.gather.get()?, data + f.at, f.gpu, f.len)?;
                }
            }
        }
        st.stats.gathers += 1;
        st.stats.gathered += n as u64;
        Self::wait_read(st, stream)
    }

    /// Waits (bounded) for a read's copy on `stream`, counted as fetch waiting.
    fn wait_read(st: &mut EngineState, stream: &Stream) -> Result<(), GpuError> {
        let mut waited = 0;
        let r = timed(&mut waited, || stream.wait_idle(GPU_WAIT));
        st.stats.wait_ns += waited;
        st.stats.fetch_wait_ns += waited;
        r
    }

    /// Serves `buf` from gathered bytes if one gathered range covers it.
    fn hit(st: &mut EngineState, src: u64, buf: &mut [u8]) -> Result<bool, GpuError> {
        let end = src + buf.len() as u64;
        let Some(f) = st
            .fetched
            .iter()
            .find(|f| f.gpu <= src && end <= f.gpu + f.len as u64)
            .copied()
        else {
            return Ok(false);
        };
        let off = MAX_GATHER_PIECES * size_of::<CopyDesc>() + f.at + (src - f.gpu) as usize;
        st.gather.get()?.read(off, buf);
        st.stats.hits += 1;
        Ok(true)
    }

    /// Reads GPU memory at `src` into `buf` (bounded wait; `ordered`: after every staged
    /// write): from the bytes a gather fetched when a prefetch announced the range, else with a
    /// copy of its own.
    pub(super) fn read(&self, src: u64, buf: &mut [u8], ordered: bool) -> Result<(), GpuError> {
        let e = self.engine();
        let mut st = lock(e);
        if Self::hit(&mut st, src, buf)? {
            return Ok(());
        }
        if !st.pending.is_empty() {
            if buf.len() <= GATHER_BYTES {
                st.pending.insert(0, (src, buf.len(), ordered));
            }
            self.gather_locked(e, &mut st)?;
            if Self::hit(&mut st, src, buf)? {
                return Ok(());
            }
        }
        let stream = self.read_stream(e, &mut st, ordered)?;
        st.stats.sync_reads += 1;
        let bounce = MAX_GATHER_PIECES * size_of::<CopyDesc>();
        // A copy of its own overwrites the gather area.
        st.fetched.clear();
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(GATHER_BYTES);
            let area = Self::gather_area(&mut st.gather, n)?;
            stream.copy_to_pinned(area, bounce, src + done as u64, n)?;
            Self::wait_read(&mut st, stream)?;
            st.gather.get()?.read(bounce, &mut buf[done..done + n]);
            done += n;
        }
        Ok(())
    }
}
