//! Files of a striped volume read into GPU memory by GPU-issued commands on every member's
//! controller (issue 23; docs/design/volumes-on-the-gpu.md). A file's extent table (volume
//! LBAs) is cut into one table per member ([`blockfs::StripedVolume::member_tables`]), each in
//! GPU memory for that member's [`GpuFiles`]; a byte range becomes runs on one member each
//! ([`blockfs::StripedVolume::member_runs`]), and each member's runs are one batch on its own
//! queues, the batches running side by side. The device header is unchanged: a member's table
//! and queues are an ordinary single-controller file on the GPU. The page cache is the
//! exception (a miss is known only on the GPU): `gpu_cache::bind_volume_file` binds a file's
//! table of volume LBAs ([`VolumeFiles::volume_table`]) to a cache over the whole volume, whose
//! fills cut every command at stripe units on the device.

use std::sync::Arc;
use std::time::{Duration, Instant};

use blockfs::table::ExtentTable;
use blockfs::{MemberRun, StripedVolume};
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
    /// The pin on the file's blocks, shared by every member's table.
    keep: Arc<dyn Send + Sync>,
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

/// A volume file reserved for GPU writes ([`VolumeFiles::reserve`]): the device-write
/// reservation's table cut per member, each in GPU memory for its member's queues. Write
/// through [`VolumeFiles::write`], then [`VolumeWrite::commit_with_crc`] and sync.
pub struct VolumeWrite {
    name: String,
    table: ExtentTable,
    /// Before `reservation`: the member tables go before the reservation is committed.
    members: Vec<GpuFile>,
    reservation: blockfs::DeviceWrite,
}

impl VolumeWrite {
    /// The file's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes the reservation may write (its allocation).
    pub fn alloc_bytes(&self) -> u64 {
        self.table.files().first().map_or(0, |f| f.alloc_bytes)
    }

    /// Commits the file's new length `len` with `crc`, the CRC-32C of its bytes `0..len`
    /// ([`blockfs::DeviceWrite::commit_with_crc`]); the member tables are dropped first.
    pub fn commit_with_crc(self, len: u64, crc: u32) -> Result<(), FilesError> {
        drop(self.members);
        self.reservation.commit_with_crc(len, crc)?;
        Ok(())
    }
}

/// What a volume read or write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeIoResult {
    /// Bytes read or written.
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
        self.check_members(volume)?;
        let pinned = file.extent_table()?;
        let table = pinned.table().clone();
        let size = table.files().first().map_or(0, |f| f.size_bytes);
        let keep: Arc<dyn Send + Sync> = Arc::new(pinned);
        let members = self.member_files(volume, &table, file.name(), keep.clone())?;
        Ok(VolumeFile {
            name: file.name().to_owned(),
            size,
            table,
            members,
            keep,
        })
    }

    /// Reserves `file` of a file system on `volume` for GPU writes up to `len` bytes
    /// ([`blockfs::File::reserve_device_write`]), the writable table cut per member and put in
    /// GPU memory for each member's queues.
    pub fn reserve(
        &self,
        volume: &StripedVolume,
        file: &blockfs::File,
        len: u64,
    ) -> Result<VolumeWrite, FilesError> {
        self.check_members(volume)?;
        let reservation = file.reserve_device_write(len)?;
        let table = reservation.table().clone();
        // The reservation holds the blocks; the member tables need nothing else kept.
        let members = self.member_files(volume, &table, file.name(), Arc::new(()))?;
        Ok(VolumeWrite {
            name: file.name().to_owned(),
            table,
            members,
            reservation,
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
        watch: impl FnMut() -> Option<String>,
    ) -> Result<VolumeIoResult, FilesError> {
        let runs = volume.member_runs(&file.table, 0, offset, dst.len() as u64);
        self.transfer(&runs, &file.members, offset, dst, false, watch)
    }

    /// Writes the first `len` bytes of `src` (GPU memory, mapped for every member's controller
    /// for the call) into the reservation at byte `offset`, each member's runs one batch on its
    /// queues; the range must lie inside the reservation's allocation. Unaligned ends are
    /// read, modified and written back by the device header, within one member's stripe unit.
    pub fn write(
        &self,
        volume: &StripedVolume,
        file: &VolumeWrite,
        offset: u64,
        src: &Arc<DeviceMemory>,
        len: u64,
        watch: impl FnMut() -> Option<String>,
    ) -> Result<VolumeIoResult, FilesError> {
        let end = offset.checked_add(len);
        if len > src.len() as u64 || end.is_none_or(|e| e > file.alloc_bytes()) {
            return Err(FilesError::InvalidArgument(format!(
                "{}: a write of {len} bytes at {offset} from {} bytes of GPU memory, into a \
                 reservation of {} bytes",
                file.name,
                src.len(),
                file.alloc_bytes()
            )));
        }
        let runs = volume.member_write_runs(&file.table, 0, offset, len);
        self.transfer(&runs, &file.members, offset, src, true, watch)
    }

    /// `table` cut per member, each part in GPU memory for its member's queues, `keep` held
    /// by all of them.
    fn member_files(
        &self,
        volume: &StripedVolume,
        table: &ExtentTable,
        name: &str,
        keep: Arc<dyn Send + Sync>,
    ) -> Result<Vec<GpuFile>, FilesError> {
        volume
            .member_tables(table)
            .into_iter()
            .zip(&self.members)
            .map(|(t, f)| f.open_table(t, name, keep.clone()))
            .collect()
    }

    /// `file`'s table of volume LBAs in GPU memory (through the first member's queues), pinned
    /// with the file, naming the first member's namespace: for a page cache over the whole
    /// volume only (`gpu_cache::bind_volume_file`), whose fills find each piece's member
    /// through the volume's layout. A plain reader of it would read the wrong LBAs.
    pub fn volume_table(
        &self,
        volume: &StripedVolume,
        file: &VolumeFile,
    ) -> Result<GpuFile, FilesError> {
        self.check_members(volume)?;
        let nsid = volume
            .member_nsids()
            .first()
            .copied()
            .flatten()
            .ok_or_else(|| {
                FilesError::InvalidArgument(
                    "volume member 0 is not an NVMe namespace: a GPU cache cannot reach it".into(),
                )
            })?;
        let first = self
            .members
            .first()
            .ok_or_else(|| FilesError::InvalidArgument("a volume without members".into()))?;
        first.open_table(
            volume.table_naming(&file.table, nsid),
            &file.name,
            file.keep.clone(),
        )
    }

    fn check_members(&self, volume: &StripedVolume) -> Result<(), FilesError> {
        if volume.members() != self.members.len() {
            return Err(FilesError::InvalidArgument(format!(
                "a volume of {} members, GPU queues on {} controllers",
                volume.members(),
                self.members.len()
            )));
        }
        Ok(())
    }

    /// Moves `runs` (file bytes from `offset` on) between the files' member tables `tables`
    /// and `mem` (byte `r.offset - offset` of it for run `r`): one batch per member with runs,
    /// side by side or one after the other.
    fn transfer(
        &self,
        runs: &[MemberRun],
        tables: &[GpuFile],
        offset: u64,
        mem: &Arc<DeviceMemory>,
        write: bool,
        mut watch: impl FnMut() -> Option<String>,
    ) -> Result<VolumeIoResult, FilesError> {
        let bufs: Vec<GpuBuffer> = self
            .members
            .iter()
            .map(|f| f.queues().map_memory(mem.clone()))
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
                    Ok(if write {
                        FileRange::write(&tables[m], r.offset, span)
                    } else {
                        FileRange::read(&tables[m], r.offset, span)
                    })
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
        Ok(VolumeIoResult {
            bytes,
            runs: runs.len(),
            members,
            elapsed: start.elapsed(),
        })
    }
}
