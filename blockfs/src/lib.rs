//! blockfs: a small, crash-consistent file layer over a block device (an NVMe namespace), whose
//! per-file extent tables are flat arrays GPU threads can translate offsets with.
//!
//! Layer: above the `nvme` driver (through [`NvmeBlockDevice`]) or any other [`BlockDevice`];
//! below the `gpunvme fs` CLI and `blockfs_gpu` (files on the GPU), whose kernels read
//! [`ExtentTable`]s. The on-disk
//! format, the commit protocol and the extent table layout are specified in `FORMAT.md` next to
//! this crate (format version [`format::FORMAT_VERSION`]).
//!
//! # Architecture
//!
//! - [`device`]: the [`BlockDevice`] seam (batched whole-LBA reads and writes, writes fed from a
//!   [`DataSource`], reads delivered to a [`DataSink`], flush, write zeroes); [`MemDevice`], [`CrashDevice`] and
//!   [`NvmeBlockDevice`] implement it.
//! - [`format`](mod@format): byte layouts of the superblock, root run, file-table chunks and file records;
//!   decoders that take untrusted bytes and never panic.
//! - `alloc`: free-space runs plus runs freed by recent commits (reusable two commits later).
//! - `checksum`: [`Crc32cPieces`], [`ChecksummedSource`], [`ChecksummedSink`]: a whole-file
//!   CRC-32C from pieces the device lanes move out of order (the data checksums of FORMAT.md).
//! - `geometry`: [`Geometry`], the sizes fixed at mkfs, and the device check.
//! - `superblock`: the two superblock slots: reading both, picking one, encoding the next.
//! - `state`: the in-memory state of a mounted file system (inodes, names, chunks, allocator,
//!   uncommitted changes) behind one lock.
//! - `commit`: the copy-on-write commit (new chunks and root, flush, superblock into the other
//!   slot, flush) and `sync`.
//! - `fs`: the [`FileSystem`] API: mkfs, mount, probe and namespace operations.
//! - `file`: [`File`] handles: reads and writes mapped through extents, one device batch per call.
//! - `load`: reading and cross-checking a generation; salvage for repair.
//! - [`fsck`](fn@fsck): report and repair.
//! - [`table`]: the GPU extent table (the whole allocation, the length, a writable flag).
//! - `pin`: [`PinnedTable`], the guard that keeps a handed-out table's blocks from reuse.
//! - `device_write`: [`DeviceWrite`], a reservation a device writes through, committed as the
//!   new length without zero fill.
//! - `nvme_dev` (feature `nvme`, on by default): [`NvmeBlockDevice`], several queue pairs with
//!   reused DMA bounce buffers, batches split at the maximum transfer size.
//! - `fuzzing` (hidden): what the cargo-fuzz targets in `fuzz/` and the corpus test run.
//!
//! # Host API
//!
//! [`FileSystem::mkfs`], [`FileSystem::mount`], [`FileSystem::probe`] (is there a blockfs?), [`FileSystem::create`] (with a size hint),
//! [`FileSystem::open`] ([`OpenMode::ReadOnly`] or [`OpenMode::ReadWrite`]),
//! [`File::read_at`] / [`File::write_at`] / [`File::read_vectored_at`], [`File::write_from`] (a
//! copy from a [`DataSource`] such as a host file, read while the device writes),
//! [`File::read_to`] (a copy to a [`DataSink`], written as the device reads),
//! [`File::set_len`], [`File::allocate`], [`FileSystem::remove`], [`FileSystem::rename`],
//! [`FileSystem::list`] (by prefix), [`FileSystem::stat`], [`FileSystem::sync`],
//! [`FileSystem::reclaim`], [`FileSystem::df`], [`File::set_data_crc`] and
//! [`FileSystem::verify_data`] (file data checksums), [`FileSystem::rename_replace`], [`fsck()`](fn@fsck) (report, or repair), and the
//! GPU tables [`File::extent_table`] and [`FileSystem::open_prefix`] (each a [`PinnedTable`]),
//! and device writes: [`File::reserve_device_write`], then [`DeviceWrite::commit`] or
//! [`DeviceWrite::commit_with_crc`]. Reads past end of file are short (0 bytes at or past it).
//!
//! Names are flat, path-like UTF-8 strings up to [`format::MAX_NAME_LEN`] bytes with `/` as a
//! separator (no directories to create); [`FileSystem::list`] lists by prefix.
//!
//! # Guarantees
//!
//! After [`FileSystem::sync`] returns, a power cut at any later point mounts in the synced
//! state or a later synced one, never a mix; file data written before a sync is durable with
//! it. Data written after the last sync into blocks the file already had when it was synced
//! (an in-place overwrite) may be found old or new per LBA after a crash, as with ext4's
//! ordered mode; everything else written after the last sync is simply absent. A
//! device-write commit is durable with the next sync like any change: a crash before it
//! mounts the old length, after it the new length with the device's bytes. Blocks named by a
//! table still held are never reused, whatever happens to their file.
//!
//! # Not implemented
//!
//! - Directories as objects, permissions, timestamps, hard links, sparse files (holes are
//!   written as zeroes).
//! - Online defragmentation, shrinking or growing the file system.
//! - Concurrent mounts of one device: the library does not prevent two, and two writers
//!   corrupt each other. The `gpunvme` CLI prevents it: the software controller locks its image
//!   file (`flock`, exclusive for commands that change it, shared for read-only ones) and a
//!   VFIO group is exclusive to one process.
//! - Devices with LBAs larger than 4 KiB.
//! - Checksums of device-written data computed by the library (the device may supply one;
//!   FORMAT.md, "Data checksums").
//!
//! # Key constants
//!
//! Block size 4 KiB by default ([`MkfsOptions`]); superblock slots at bytes 0 and 4096
//! ([`format::SUPERBLOCK_SLOTS`]); file-table chunks of one block; CRC-32C on every metadata
//! structure.
#![forbid(unsafe_code)]

mod alloc;
mod checksum;
mod commit;
mod crash;
pub mod device;
mod device_write;
mod error;
mod extents;
mod file;
pub mod format;
mod fs;
mod fsck;
#[doc(hidden)]
pub mod fuzzing;
mod geometry;
mod load;
mod mem;
mod name;
#[cfg(feature = "nvme")]
mod nvme_dev;
mod pin;
mod revert;
mod state;
mod superblock;
pub mod table;
pub mod volume;

pub use checksum::{ChecksummedSink, ChecksummedSource, Crc32cPieces};
pub use crash::{CrashDevice, LoggedOp};
pub use device::{
    BlockDevice, DataSink, DataSource, DeviceError, ReadReq, SinkReadReq, SourceWriteReq, WriteReq,
};
pub use device_write::DeviceWrite;
pub use error::{Error, Result};
pub use file::{File, OpenMode};
pub use fs::{Batch, CreateOptions, DataCheck, Existing, FileSystem, FsStats, MkfsOptions};
pub use fsck::{FsckOptions, FsckReport, SlotReport, fsck};
pub use geometry::Geometry;
pub use load::Problem;
pub use mem::MemDevice;
pub use name::check_name;
#[cfg(feature = "nvme")]
pub use nvme_dev::{NvmeBlockDevice, NvmeDeviceOptions};
pub use pin::{GenerationHold, PinnedTable};
pub use state::FileStat;
pub use table::ExtentTable;
pub use volume::{MemberRun, StripedVolume, VolumeError, VolumeLabel};
