//! Transport (a): the software controller (`nvme_emu`) serving queues whose rings and data live
//! in GPU memory.
//!
//! The controller reaches GPU memory only through [`GpuRegion`]s registered in its device-address
//! map, and its doorbells for these queues are words in a pinned host page that GPU threads
//! write ([`PinnedDoorbell`]). One `cudaMemcpy` per command would cap the controller at about
//! 0.3 M commands/s (../shared/design/gpu.md), so writes are batched by a [`GpuDma`] engine:
//!
//! - every write the controller makes (read data, completion entries) is appended to a pinned
//!   staging area, mapped into the GPU, with a [`CopyDesc`] naming its destination;
//! - at the end of each controller batch (`MemoryRegion::flush`), ONE scatter kernel copies every
//!   staged piece to its place; completion-queue phase dwords are marked late and written by the
//!   kernel's last block after a fence, so a completion never becomes visible before its data
//!   or the rest of its entry;
//! - reads (SQE fetches, PRP lists, data of write commands) flush first, then copy on the same
//!   stream and wait (bounded).
//!
//! The engine's kernels run on a stream in the controller's own SM partition (a green
//! context), so client kernels that occupy every other SM cannot starve them. Two staging areas
//! alternate: the controller fills one while the GPU drains the other.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nvme_emu::{DoorbellWord, MemoryRegion, RegionError};
use zerocopy::IntoBytes;

use crate::desc::{COPY_LATE, CopyDesc};
use crate::error::GpuError;
use crate::ffi::{Arg, Cuda, DeviceMemory, Event, PinnedMemory, Stream};
use crate::kernels::Kernels;

/// Pieces one staging area holds before it is flushed.
const MAX_PIECES: usize = 8192;
/// Data bytes one staging area holds before it is flushed.
const STAGING_BYTES: usize = 32 << 20;
/// Bytes of the pinned bounce buffer for reads.
const READ_BOUNCE: usize = 4 << 20;
/// Bound on any single wait for the GPU inside the controller.
const GPU_WAIT: Duration = Duration::from_secs(10);

struct Staging {
    mem: PinnedMemory,
    /// Finished when the scatter that read this area is done.
    drained: Event,
    pieces: usize,
    bytes: usize,
}

struct EngineState {
    areas: [Staging; 2],
    cur: usize,
    read_bounce: PinnedMemory,
    /// Statistics: flushes that launched a kernel, pieces moved.
    flushes: u64,
    pieces: u64,
}

/// The batched copy engine of one software-controller thread.
pub struct GpuDma {
    cuda: Arc<Cuda>,
    stream: Stream,
    kernels: Arc<Kernels>,
    /// Device counter the scatter kernel's blocks use to find the last one.
    done_blocks: DeviceMemory,
    state: Mutex<EngineState>,
}

impl std::fmt::Debug for GpuDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDma").finish_non_exhaustive()
    }
}

fn region_error(e: GpuError) -> RegionError {
    RegionError {
        reason: "GPU memory access failed".into(),
        source: Some(Box::new(e)),
    }
}

impl GpuDma {
    /// An engine issuing its copies and kernels on `stream`.
    pub fn new(
        cuda: &Arc<Cuda>,
        stream: Stream,
        kernels: Arc<Kernels>,
    ) -> Result<Arc<Self>, GpuError> {
        let area = |cuda: &Arc<Cuda>| -> Result<Staging, GpuError> {
            Ok(Staging {
                mem: PinnedMemory::alloc(cuda, MAX_PIECES * size_of::<CopyDesc>() + STAGING_BYTES)?,
                drained: Event::new(cuda)?,
                pieces: 0,
                bytes: 0,
            })
        };
        Ok(Arc::new(Self {
            cuda: cuda.clone(),
            stream,
            kernels,
            done_blocks: DeviceMemory::alloc(cuda, 256)?,
            state: Mutex::new(EngineState {
                areas: [area(cuda)?, area(cuda)?],
                cur: 0,
                read_bounce: PinnedMemory::alloc(cuda, READ_BOUNCE)?,
                flushes: 0,
                pieces: 0,
            }),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, EngineState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// (kernel launches, pieces moved) so far.
    pub fn stats(&self) -> (u64, u64) {
        let s = self.lock();
        (s.flushes, s.pieces)
    }

    /// Stages `data` for GPU address `dst`; `late` pieces are written after all others of the
    /// same flush.
    fn stage(
        &self,
        st: &mut EngineState,
        dst: u64,
        data: &[u8],
        late: bool,
    ) -> Result<(), GpuError> {
        let mut done = 0;
        while done < data.len() {
            let area = &st.areas[st.cur];
            if area.pieces == MAX_PIECES || area.bytes == STAGING_BYTES {
                self.flush_locked(st)?;
                continue;
            }
            let area = &mut st.areas[st.cur];
            let n = (data.len() - done).min(STAGING_BYTES - area.bytes);
            // Keep 16-byte alignment of pieces in the staging area (vector copies).
            let src = area.bytes;
            area.mem.write(
                MAX_PIECES * size_of::<CopyDesc>() + src,
                &data[done..done + n],
            );
            let desc = CopyDesc {
                dst: dst + done as u64,
                src: src as u32,
                len: n as u32 | if late { COPY_LATE } else { 0 },
            };
            area.mem
                .write(area.pieces * size_of::<CopyDesc>(), desc.as_bytes());
            area.pieces += 1;
            area.bytes = (src + n).next_multiple_of(16).min(STAGING_BYTES);
            done += n;
        }
        Ok(())
    }

    /// Launches the scatter of the current staging area (if it holds anything) and switches to
    /// the other one, waiting (bounded) until the GPU has drained that one.
    fn flush_locked(&self, st: &mut EngineState) -> Result<(), GpuError> {
        let cur = st.cur;
        let pieces = st.areas[cur].pieces;
        if pieces == 0 {
            return Ok(());
        }
        self.cuda.make_current()?;
        let area = &st.areas[cur];
        let base = area.mem.device_ptr();
        let warps_per_block = 8u32;
        let grid = (pieces as u32).div_ceil(warps_per_block).clamp(1, 1024);
        self.stream.launch(
            self.kernels.scatter,
            grid,
            warps_per_block * 32,
            &[
                Arg::U64(base),
                Arg::U32(pieces as u32),
                Arg::U64(base + (MAX_PIECES * size_of::<CopyDesc>()) as u64),
                Arg::U64(self.done_blocks.ptr()),
            ],
        )?;
        area.drained.record(&self.stream)?;
        st.flushes += 1;
        st.pieces += pieces as u64;
        let area = &mut st.areas[cur];
        area.pieces = 0;
        area.bytes = 0;
        st.cur ^= 1;
        st.areas[st.cur].drained.wait(GPU_WAIT)
    }

    /// Performs every staged write now (asynchronously; later work on the stream is ordered
    /// after it).
    pub fn flush(&self) -> Result<(), GpuError> {
        let mut st = self.lock();
        self.flush_locked(&mut st)
    }

    /// Reads GPU memory at `src` into `buf`, after every staged write (bounded wait).
    fn read(&self, src: u64, buf: &mut [u8]) -> Result<(), GpuError> {
        let mut st = self.lock();
        self.flush_locked(&mut st)?;
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(READ_BOUNCE);
            self.stream
                .copy_to_pinned(&st.read_bounce, 0, src + done as u64, n)?;
            self.stream.wait_idle(GPU_WAIT)?;
            st.read_bounce.read(0, &mut buf[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn write(&self, dst: u64, data: &[u8], late_last_dword: bool) -> Result<(), GpuError> {
        let mut st = self.lock();
        if late_last_dword && data.len() >= 4 {
            let split = data.len() - 4;
            self.stage(&mut st, dst, &data[..split], false)?;
            self.stage(&mut st, dst + split as u64, &data[split..], true)
        } else {
            self.stage(&mut st, dst, data, false)
        }
    }
}

/// A range of GPU memory as the software controller sees it: a [`MemoryRegion`] whose writes
/// are staged in a [`GpuDma`] engine until the controller's batch ends.
pub struct GpuRegion {
    engine: Arc<GpuDma>,
    ptr: u64,
    len: usize,
    _mem: Arc<DeviceMemory>,
}

impl std::fmt::Debug for GpuRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GpuRegion({:#x}+{:#x})", self.ptr, self.len)
    }
}

impl GpuRegion {
    /// The whole of `mem`, reached through `engine`.
    pub fn new(engine: Arc<GpuDma>, mem: Arc<DeviceMemory>) -> Self {
        Self {
            engine,
            ptr: mem.ptr(),
            len: mem.len(),
            _mem: mem,
        }
    }
}

impl MemoryRegion for GpuRegion {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        self.engine
            .read(self.ptr + offset, buf)
            .map_err(region_error)
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.engine
            .write(self.ptr + offset, data, false)
            .map_err(region_error)
    }

    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.engine
            .write(self.ptr + offset, data, true)
            .map_err(region_error)
    }

    fn flush(&self) -> Result<(), RegionError> {
        self.engine.flush().map_err(region_error)
    }
}

/// A doorbell word in pinned host memory that GPU threads write and the software controller
/// polls.
pub struct PinnedDoorbell {
    page: Arc<PinnedMemory>,
    offset: usize,
}

impl PinnedDoorbell {
    /// The word at `offset` of `page`.
    pub fn new(page: Arc<PinnedMemory>, offset: usize) -> Self {
        Self { page, offset }
    }

    /// The GPU's address of the word.
    pub fn device_ptr(&self) -> u64 {
        self.page.device_ptr() + self.offset as u64
    }

    /// Zeroes the word (before the queue is created).
    pub fn reset(&self) {
        self.page.store_u32(self.offset, 0)
    }
}

impl DoorbellWord for PinnedDoorbell {
    fn load(&self) -> u32 {
        self.page.load_u32(self.offset)
    }
}
