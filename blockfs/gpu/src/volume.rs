//! Files of a striped volume read into GPU memory by GPU-issued commands on every member's
//! controller (issue 23; docs/design/volumes-on-the-gpu.md). A file's extent table (volume
//! LBAs) is cut into one table per member ([`blockfs::StripedVolume::member_tables`]), each in
//! GPU memory for that member's [`GpuFiles`]; a byte range becomes runs on one member each
//! ([`blockfs::StripedVolume::member_runs`]), and each member's runs are one batch on its own
//! queues, the batches running side by side. The device header is unchanged: a member's table
//! and queues are an ordinary single-controller file on the GPU.

use std::sync::Arc;
use std::time::{Duration, Instant};

use blockfs::StripedVolume;
use blockfs::table::ExtentTable;
use gpu_queues::ffi::DeviceMemory;
use gpu_queues::{GpuBuffer, GpuQueues};

use crate::error::FilesError;
use crate::files::{FileRange, GpuFile, GpuFiles, GpuFilesOptions, GpuSpan};

/// GPU file I/O on a striped volume: one [`GpuFiles`] per member, each on the GPU queues of
/// that member's controller, in member order.
pub struct VolumeFiles<'q> {
    members: Vec<GpuFiles<'q>>,
    concurrent: bool,
}

/// A volume file opened for GPU reads: its table per member in GPU memory (every member's
/// pinning the file's blocks through one shared pin) and the volume table its runs come from.
pub struct VolumeFile {
    name: String,
    size: u64,
    table: ExtentTable,
    members: Vec<GpuFile>,
}

impl VolumeFile {
    /// The file's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its length in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Its table on member `m` (for kernels of one's own on that member's queues).
    pub fn member(&self, m: usize) -> Option<&GpuFile> {
        self.members.get(m)
    }
}

/// What a volume read did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeReadResult {
    /// Bytes read.
    pub bytes: u64,
    /// Runs (ranges on one member each) in the batches.
    pub runs: usize,
    /// Members that had runs.
    pub members: usize,
    /// From the first launch to the last batch's end.
    pub elapsed: Duration,
}

impl<'q> VolumeFiles<'q> {
    /// GPU file I/O over `queues`, member `m`'s controller's queues at index `m`.
    pub fn new(queues: &[&'q GpuQueues], opts: GpuFilesOptions) -> Self {
        Self {
            members: queues
                .iter()
                .map(|q| GpuFiles::new(q, opts.clone()))
                .collect(),
            concurrent: true,
        }
    }

    /// Whether a read launches every member's batch before waiting for any (`true`, the
    /// default), or runs them one after the other (`false`). Side by side is faster: a 2 GiB
    /// file over four software controllers read at 37-44 GB/s against 12-18 one after the other
    /// on the H100 (2026-11-26). (It used to stall: a member's batch freed its memory while the
    /// others' kernels waited for their controllers, and with CUDA a free holds up every
    /// thread's launches until the device is idle; frees now wait for client streams, see
    /// `gpu_queues::ffi::held_frees`.)
    pub fn concurrent(mut self, yes: bool) -> Self {
        self.concurrent = yes;
        self
    }

    /// Opens `file` of a file system on `volume` for GPU reads: its table cut per member, each
    /// in GPU memory for its member's queues, the file's blocks pinned while the handle lives.
    pub fn open(
        &self,
        volume: &StripedVolume,
        file: &blockfs::File,
    ) -> Result<VolumeFile, FilesError> {
        if volume.members() != self.members.len() {
            return Err(FilesError::InvalidArgument(format!(
                "a volume of {} members, GPU queues on {} controllers",
                volume.members(),
                self.members.len()
            )));
        }
        let pinned = file.extent_table()?;
        let table = pinned.table().clone();
        let size = table.files().first().map_or(0, |f| f.size_bytes);
        let keep: Arc<dyn Send + Sync> = Arc::new(pinned);
        let members = volume
            .member_tables(&table)
            .into_iter()
            .zip(&self.members)
            .map(|(t, f)| f.open_table(t, file.name(), keep.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VolumeFile {
            name: file.name().to_owned(),
            size,
            table,
            members,
        })
    }

    /// Reads `file` from byte `offset` into `dst` (GPU memory, mapped for every member's
    /// controller for the call): `dst.len()` bytes, fewer only where the file ends. Each
    /// member's runs are one batch on its queues (side by side or one after the other:
    /// [`VolumeFiles::concurrent`]);
    /// `watch` aborts device-side waits ([`crate::Pending::wait_watched`]). The first failed
    /// run is the error.
    pub fn read(
        &self,
        volume: &StripedVolume,
        file: &VolumeFile,
        offset: u64,
        dst: &Arc<DeviceMemory>,
        mut watch: impl FnMut() -> Option<String>,
    ) -> Result<VolumeReadResult, FilesError> {
        let runs = volume.member_runs(&file.table, 0, offset, dst.len() as u64);
        let bufs: Vec<GpuBuffer> = self
            .members
            .iter()
            .map(|f| f.queues().map_memory(dst.clone()))
            .collect::<Result<_, _>>()?;
        let start = Instant::now();
        // One result per member with runs: waited for at once (one after the other), or after
        // every batch was launched (side by side).
        let mut results = Vec::new();
        let mut pending = Vec::new();
        for (m, files) in self.members.iter().enumerate() {
            let ranges = runs
                .iter()
                .filter(|r| r.member == m)
                .map(|r| {
                    let span = GpuSpan::of(&bufs[m], r.offset - offset, r.len)?;
                    Ok(FileRange::read(&file.members[m], r.offset, span))
                })
                .collect::<Result<Vec<_>, FilesError>>()?;
            if ranges.is_empty() {
                continue;
            }
            let p = files.submit(&ranges)?;
            if self.concurrent {
                pending.push(p);
            } else {
                results.push(p.wait_watched(&mut watch));
            }
        }
        for p in pending {
            results.push(p.wait_watched(&mut watch));
        }
        let members = results.len();
        let mut bytes = 0;
        let mut first_error = None;
        for r in results {
            match r.and_then(|r| r.into_first_error()) {
                Ok(r) => bytes += r.bytes(),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(VolumeReadResult {
            bytes,
            runs: runs.len(),
            members,
            elapsed: start.elapsed(),
        })
    }
}
