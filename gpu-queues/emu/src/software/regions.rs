//! How the software controller reaches the queues' memory: [`GpuRegion`] (GPU memory behind a
//! copy engine), [`HostCqRegion`] (a completion queue in pinned host memory),
//! [`PinnedDoorbell`] (a doorbell word GPU threads write), and their registration in the
//! controller's device-address map.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gpu_queues::GpuError;
use gpu_queues::ffi::{DeviceMemory, PinnedMemory};
use nvme::DmaRegion;
use nvme_emu::{DeviceAddressMap, DoorbellWord, MemoryRegion, RegionError};

use super::engine::GpuDma;

fn region_error(e: GpuError) -> RegionError {
    RegionError {
        reason: "GPU memory access failed".into(),
        source: Some(Box::new(e)),
    }
}

/// A range of GPU memory as the software controller sees it: a [`MemoryRegion`] whose writes
/// are staged in a [`GpuDma`] engine until the controller's batch ends.
pub struct GpuRegion {
    engine: Arc<GpuDma>,
    ptr: u64,
    len: usize,
    /// A submission queue ring: the controller reads one at the start of every batch, which
    /// ends the trust in bytes gathered for the batch before (even one that wrote nothing and
    /// so was never flushed).
    starts_batches: bool,
    /// The controller has written into this memory: its reads are ordered after the engine's
    /// writes from then on. An SQ ring's reads never are: the controller writes it only to
    /// poison fetched entries (hostile mode), and a client rewrites such a slot only after a
    /// completion staged after the poison (late pieces land after all others), before the
    /// doorbell that makes the controller read it again.
    written: AtomicBool,
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
            starts_batches: false,
            written: AtomicBool::new(false),
            _mem: mem,
        }
    }

    /// A submission queue ring in `mem` (see `starts_batches`).
    pub fn submission_queue(engine: Arc<GpuDma>, mem: Arc<DeviceMemory>) -> Self {
        Self {
            starts_batches: true,
            ..Self::new(engine, mem)
        }
    }
}

impl GpuRegion {
    /// Whether reads of this memory must see the engine's earlier writes.
    fn ordered(&self) -> bool {
        // Relaxed: set and read by the controller threads, and a thread's own writes are all
        // it orders against (another thread's engine is never waited for, either way).
        !self.starts_batches && self.written.load(Ordering::Relaxed)
    }

    fn note_written(&self) {
        self.written.store(true, Ordering::Relaxed);
    }
}

impl MemoryRegion for GpuRegion {
    fn len(&self) -> usize {
        self.len
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        if self.starts_batches {
            self.engine.forget_gathered();
        }
        self.engine
            .read(self.ptr + offset, buf, self.ordered())
            .map_err(region_error)
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.note_written();
        self.engine
            .write(self.ptr + offset, data, false)
            .map_err(region_error)
    }

    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.note_written();
        self.engine
            .write(self.ptr + offset, data, true)
            .map_err(region_error)
    }

    fn flush(&self) -> Result<(), RegionError> {
        self.engine.flush().map_err(region_error)
    }

    fn defers_writes(&self) -> bool {
        true
    }

    fn wait_flushed(&self) -> Result<(), RegionError> {
        self.engine.wait_flushed().map_err(region_error)
    }

    fn read_from_file(
        &self,
        offset: u64,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> Option<std::io::Result<()>> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.len as u64)
        {
            return Some(Err(std::io::ErrorKind::InvalidInput.into()));
        }
        self.note_written();
        // An engine failure (a GPU error) is None: the general path reports it as a DMA error.
        self.engine
            .stage_from_file(self.ptr + offset, len, file, file_offset)
            .unwrap_or_default()
    }

    fn prefetch(&self, ranges: &[(u64, usize)]) -> Result<(), RegionError> {
        let ptr = self.ptr;
        self.engine.prefetch(
            ranges.iter().map(|&(off, len)| (ptr + off, len)),
            self.ordered(),
        );
        Ok(())
    }
}

/// A completion queue ring in pinned host memory mapped into the GPU ([`RingPlacement::Host`]).
///
/// The controller writes an entry straight into it while its thread's copy engine holds no
/// write that is not yet visible; otherwise through that engine, like GPU memory, so that the
/// entry lands after the data of its command (in GPU memory, behind the engine) and after
/// every earlier entry staged there. Either way no controller thread waits for the GPU here.
///
/// [`RingPlacement::Host`]: super::RingPlacement::Host
pub(super) struct HostCqRegion {
    pub(super) engine: Arc<GpuDma>,
    pub(super) mem: Arc<PinnedMemory>,
}

impl MemoryRegion for HostCqRegion {
    fn len(&self) -> usize {
        self.mem.len()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        if self.engine.pending() {
            self.engine.flush().map_err(region_error)?;
            self.engine.wait_flushed().map_err(region_error)?;
        }
        self.mem.read(offset as usize, buf);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        if self.engine.pending() {
            return self
                .engine
                .write(self.mem.device_ptr() + offset, data, false)
                .map_err(region_error);
        }
        self.mem.write(offset as usize, data);
        Ok(())
    }

    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        if self.engine.pending() || data.len() < 4 || offset % 4 != 0 {
            return self
                .engine
                .write(self.mem.device_ptr() + offset, data, true)
                .map_err(region_error);
        }
        let split = data.len() - 4;
        self.mem.write(offset as usize, &data[..split]);
        let last = u32::from_le_bytes(data[split..].try_into().expect("4 bytes"));
        // Release: the rest of the entry (and the command's data in host memory) first.
        self.mem.store_u32(offset as usize + split, last);
        Ok(())
    }

    fn flush(&self) -> Result<(), RegionError> {
        self.engine.flush().map_err(region_error)
    }

    fn defers_writes(&self) -> bool {
        // It may stage (behind the engine's writes), so the controller must not wait for
        // deferred writes before an entry here: the engine orders them itself.
        true
    }

    fn wait_flushed(&self) -> Result<(), RegionError> {
        self.engine.wait_flushed().map_err(region_error)
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

/// Removes a region from the software controller's address map when the last user goes.
struct Unregister {
    map: Arc<DeviceAddressMap>,
    base: u64,
}

impl Drop for Unregister {
    fn drop(&mut self) {
        self.map.unregister_region(self.base);
    }
}

/// Registers `mem` in the software controller's address map as a region reached through
/// `engine` (a submission queue ring when `sq`): its device address range, unregistered when
/// the returned region's last holder drops.
pub(super) fn register_region(
    map: &Arc<DeviceAddressMap>,
    engine: &Arc<GpuDma>,
    mem: Arc<DeviceMemory>,
    sq: bool,
) -> Result<DmaRegion, GpuError> {
    let region = Arc::new(if sq {
        GpuRegion::submission_queue(engine.clone(), mem.clone())
    } else {
        GpuRegion::new(engine.clone(), mem.clone())
    });
    let len = mem.len().next_multiple_of(4096);
    map_region(map, region, len, Box::new(mem))
}

/// Registers `region` (`len` bytes) in the software controller's address map: its device
/// address range, unregistered when the returned region's last holder drops, which also keeps
/// `keep` (the memory behind it) alive until then.
pub(super) fn map_region(
    map: &Arc<DeviceAddressMap>,
    region: Arc<dyn MemoryRegion>,
    len: usize,
    keep: Box<dyn Send + Sync>,
) -> Result<DmaRegion, GpuError> {
    let base = map.register_region(region).map_err(GpuError::controller)?;
    Ok(DmaRegion::contiguous(
        base,
        len,
        Box::new((
            Unregister {
                map: map.clone(),
                base,
            },
            keep,
        )),
    ))
}
