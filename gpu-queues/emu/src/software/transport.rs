//! [`SoftwareTransport`]: the software-controller transport as the runtime sees it
//! ([`QueueTransport`]): buffers registered in the controller's address map, its copy engines'
//! counters, and Read hints (readahead, or a prefetch the Read path looks in).

use std::sync::Arc;

use gpu_queues::GpuError;
use gpu_queues::ffi::{Cuda, DeviceMemory};
use gpu_queues::queues::{GpuBuffer, GpuQueues, QueueTransport, ReadAhead};
use nvme_emu::EmuDevice;

use crate::image_reads::{ColdReads, ReadMode, WindowStats};

use super::engine::{GROW_STAGING_FROM, GpuDma};
use super::modes::CopyMode;
use super::pair_memory::RingPlacement;
use super::readahead::Readahead;
use super::regions::register_region;
use super::stats::DmaStats;

/// The software-controller transport as the runtime sees it: the software controller and its
/// copy engines.
pub struct SoftwareTransport {
    pub(super) emu: Arc<EmuDevice>,
    pub(super) engine: Arc<GpuDma>,
    pub(super) rings: RingPlacement,
    /// Threads a [`QueueTransport::will_read`] hint walks the image with, having the kernel
    /// read it ahead (0: the hint does nothing; [`READAHEAD_ENV`]).
    ///
    /// [`READAHEAD_ENV`]: super::READAHEAD_ENV
    pub(super) readahead: usize,
    /// Reader threads of a prefetch ([`ColdReads::Prefetch`]; `crate::prefetch::READERS_ENV`).
    pub(super) prefetch_readers: usize,
}

impl std::fmt::Debug for SoftwareTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftwareTransport")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl SoftwareTransport {
    /// The transport of `queues`, when it is the software controller.
    pub fn of(queues: &GpuQueues) -> Option<&Self> {
        queues.backend().as_any().downcast_ref::<Self>()
    }

    /// What each controller thread's copy engine did, by thread index.
    pub fn dma_stats_per_thread(&self) -> Vec<DmaStats> {
        self.engine.stats_per_thread()
    }

    /// Has the copy engines' staging areas grow for a large job (what a `will_read` hint of
    /// at least 4 GiB does; see `GpuDma::grow_staging`).
    pub fn grow_staging(&self) {
        self.engine.grow_staging();
    }

    /// What the copy engines did (totals over the controller's threads).
    pub fn dma_stats(&self) -> DmaStats {
        self.engine.stats()
    }

    /// How the software controller moves batches.
    pub fn copy_mode(&self) -> CopyMode {
        self.engine.mode()
    }

    /// Where the queues' rings and slot buffers are.
    pub fn ring_placement(&self) -> RingPlacement {
        self.rings
    }

    /// Controller threads with a copy engine of their own.
    pub fn controller_threads(&self) -> usize {
        self.engine.engines()
    }

    /// How Read data leaves the image, and the registered windows' counters.
    pub fn window_stats(&self) -> (ReadMode, WindowStats) {
        (self.engine.read_mode(), self.engine.window_stats())
    }
}

impl SoftwareTransport {
    /// Starts a prefetch of `ranges` of namespace `nsid`'s image at `path` for the Reads to come
    /// ([`crate::prefetch`]) and has the Read path look in its pool until the result is
    /// dropped. `None`: every page of the ranges is in the page cache (nothing to read ahead).
    fn prefetch(
        &self,
        nsid: u32,
        path: &std::path::Path,
        ranges: &[(u64, u64)],
    ) -> std::io::Result<Option<ReadAhead>> {
        use std::os::fd::AsFd;
        let image = std::fs::File::open(path)?;
        let warm = ranges
            .iter()
            .all(|&(at, n)| crate::os::range_cached(image.as_fd(), at, n).unwrap_or(false));
        if warm {
            return Ok(None);
        }
        let writes = self
            .emu
            .media_writes(nsid)
            .ok_or_else(|| std::io::Error::other("the namespace is not an image file"))?;
        let direct = crate::os::reopen_direct(&image)?;
        let running = crate::prefetch::Prefetch::start(
            &image,
            direct,
            writes,
            ranges,
            self.prefetch_readers,
            crate::prefetch::POOL_BYTES,
        )?;
        self.engine.views.add_prefetch(running.prefetch().clone());
        Ok(Some(ReadAhead::running(Box::new(PrefetchHint {
            running: Some(running),
            engine: self.engine.clone(),
        }))))
    }
}

/// A prefetch the Read path looks in, until dropped.
struct PrefetchHint {
    running: Option<crate::prefetch::Running>,
    engine: Arc<GpuDma>,
}

impl Drop for PrefetchHint {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.engine.views.remove_prefetch(r.prefetch());
            // Stops the readers; the pool (up to a GiB of mapped memory) goes with the last of
            // them, or here: unmapped on a thread of its own, not the caller's (a load's end).
            let unmapped = std::thread::Builder::new()
                .name("gpunvme-prefetch".into())
                .spawn(move || drop(r));
            // A thread the system refuses: the drop happens here (the closure was dropped).
            drop(unmapped);
        }
    }
}

impl QueueTransport for SoftwareTransport {
    fn alloc_buffer(&self, cuda: &Arc<Cuda>, len: usize) -> Result<GpuBuffer, GpuError> {
        let mem = Arc::new(DeviceMemory::alloc(cuda, len.next_multiple_of(4096))?);
        let region = register_region(self.emu.address_map(), &self.engine, mem.clone(), false)?;
        Ok(GpuBuffer::new(mem, 0, region))
    }

    fn map_memory(&self, _: &Arc<Cuda>, mem: Arc<DeviceMemory>) -> Result<GpuBuffer, GpuError> {
        // The device-address range is whole pages; the region behind it ends where `mem`
        // does, so the controller reaches no byte past the caller's allocation.
        let region = register_region(self.emu.address_map(), &self.engine, mem.clone(), false)?;
        Ok(GpuBuffer::new(mem, 0, region))
    }

    fn queue_deleted(&self, qid: u16) {
        self.emu.detach_external_doorbells(qid);
    }

    /// Has the kernel read the hinted LBAs of the namespace's image that are not in the page
    /// cache, ahead of the controller threads ([`Readahead`]; a namespace in memory, or of
    /// another LBA size than the hint's: nothing). The image is opened again by its path, for
    /// the thread to own: the page cache is the file's, so any descriptor serves, and a file
    /// put in its place since would only waste the hint.
    fn will_read(&self, nsid: u32, lba_shift: u32, runs: &[(u64, u64)]) -> ReadAhead {
        // A large job: bigger staging areas, registered beside it (`GpuDma::grow_staging`).
        let bytes = runs.iter().fold(0u64, |sum, &(_, n)| {
            sum.saturating_add(n.checked_shl(lba_shift).unwrap_or(u64::MAX))
        });
        if bytes >= GROW_STAGING_FROM {
            self.engine.grow_staging();
        }
        let prefetch = self.engine.cold_reads() == ColdReads::Prefetch;
        if (self.readahead == 0 && !prefetch) || lba_shift >= 32 {
            return ReadAhead::none();
        }
        let Some(ns) = (nsid as usize)
            .checked_sub(1)
            .and_then(|i| self.emu.namespace_configs().get(i))
        else {
            return ReadAhead::none();
        };
        let nvme_emu::Backend::File(path) = &ns.backend else {
            return ReadAhead::none();
        };
        if ns.lba_size != 1 << lba_shift {
            return ReadAhead::none();
        }
        let unit = 1u64 << lba_shift;
        let ranges: Vec<(u64, u64)> = runs
            .iter()
            .filter_map(|&(lba, n)| Some((lba.checked_mul(unit)?, n.checked_mul(unit)?)))
            .filter(|&(_, len)| len > 0)
            .collect();
        if ranges.is_empty() {
            return ReadAhead::none();
        }
        if prefetch {
            match self.prefetch(nsid, path, &ranges) {
                Ok(Some(running)) => return running,
                Ok(None) => return ReadAhead::none(),
                // Then as with buffered cold reads.
                Err(e) => tracing::debug!("no prefetch of {}: {e}", path.display()),
            }
        }
        if self.readahead == 0 {
            return ReadAhead::none();
        }
        match std::fs::File::open(path).and_then(|f| Readahead::start(f, ranges, self.readahead)) {
            Ok(r) => ReadAhead::running(Box::new(r)),
            Err(e) => {
                tracing::debug!("no readahead of {}: {e}", path.display());
                ReadAhead::none()
            }
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
