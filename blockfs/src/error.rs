//! The crate's error type.

use crate::device::DeviceError;

/// Everything a blockfs operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The block device failed while blockfs was doing `op`.
    #[error("device error while {op}")]
    Device {
        /// What blockfs was doing ("reading the superblocks", "writing file data", ...).
        op: &'static str,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
    /// Reading the source of a [`crate::File::write_from`] failed (or it ended early).
    #[error("reading the data source at byte {offset} failed")]
    ReadSource {
        /// Source offset of the failed read.
        offset: u64,
        /// What the source said.
        #[source]
        source: std::io::Error,
    },
    /// Writing the destination of a [`crate::File::read_to`] failed.
    #[error("writing the destination at byte {offset} failed")]
    WriteSink {
        /// Destination offset of the failed write.
        offset: u64,
        /// What the destination said.
        #[source]
        source: std::io::Error,
    },
    /// Neither superblock slot holds a blockfs superblock (wrong magic in both).
    #[error("not a blockfs file system: {0}")]
    NotBlockfs(String),
    /// A metadata structure failed its checksum or its consistency checks.
    #[error("corrupt {what}: {detail}")]
    Corrupt {
        /// Which structure, and where ("superblock slot 1 (byte 4096)", "file table chunk at
        /// block 17 (generation 9)").
        what: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The on-disk format is newer than this build or uses features it does not know.
    #[error("unsupported file system: {0}")]
    Unsupported(String),
    /// The device cannot hold this file system, or its geometry does not fit blockfs.
    #[error("device geometry: {0}")]
    Geometry(String),
    /// A file name breaks the naming rules (FORMAT.md, "Names").
    #[error("invalid file name {name:?}: {reason}")]
    InvalidName {
        /// The name as given.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// No file has this name.
    #[error("no such file: {0}")]
    NotFound(String),
    /// A file with this name already exists.
    #[error("file exists: {0}")]
    AlreadyExists(String),
    /// Not enough free blocks (or, for metadata, no contiguous run long enough).
    #[error("no space left on the file system: {needed} blocks needed, {free} free")]
    NoSpace {
        /// Blocks the operation needed.
        needed: u64,
        /// Blocks free (not counting blocks waiting two commits before reuse).
        free: u64,
    },
    /// A write, resize or allocation through a handle opened read-only.
    #[error("file {0:?} is open read-only")]
    ReadOnly(String),
    /// The file behind a handle was removed.
    #[error("file {0:?} was removed while open")]
    Removed(String),
    /// An offset or length past the largest supported file size.
    #[error("file offset {0} is past the largest supported file size")]
    TooLarge(u64),
    /// The file system refuses changes because a commit failed after its superblock write was
    /// issued: the medium may hold either generation, so only a fresh mount knows which.
    #[error("an earlier sync failed after writing the superblock; remount the file system")]
    Poisoned,
    /// Every file id has been handed out (only an image that says so, made elsewhere, gets
    /// here: ids are 64-bit).
    #[error("no file ids left (the file table's next id is {0})")]
    OutOfFileIds(u64),
    /// A device-write commit asked for a length past the allocation its reservation covers.
    #[error(
        "file {name:?}: length {len} is past the {allocated} bytes the device-write reservation covers"
    )]
    BeyondReservation {
        /// The file.
        name: String,
        /// The length asked for.
        len: u64,
        /// Bytes the reservation's table lets the device write.
        allocated: u64,
    },
    /// A device-write commit found that the file's blocks are no longer the ones its
    /// reservation handed out (the file was truncated or reallocated meanwhile): what the
    /// device wrote is not in the file, and the length stays as it was.
    #[error("file {0:?} changed its blocks since the device-write reservation")]
    ReservationStale(String),
    /// A generation asked for is past the file system's last commit.
    #[error("generation {asked} is not there yet (the file system is at {current})")]
    FutureGeneration {
        /// The generation asked for.
        asked: u64,
        /// The last commit's.
        current: u64,
    },
    /// fsck could not produce a consistent file system.
    #[error("cannot repair: {0}")]
    Unrepairable(String),
}

/// Result alias for blockfs operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) trait DeviceResultExt<T> {
    /// Wraps a device error with the operation blockfs was doing.
    fn during(self, op: &'static str) -> Result<T>;
}

impl<T> DeviceResultExt<T> for std::result::Result<T, DeviceError> {
    fn during(self, op: &'static str) -> Result<T> {
        self.map_err(|e| match e {
            // The device did nothing wrong: the caller's data source or sink failed.
            DeviceError::ReadSource { offset, source } => Error::ReadSource { offset, source },
            DeviceError::WriteSink { offset, source } => Error::WriteSink { offset, source },
            source => Error::Device { op, source },
        })
    }
}

pub(crate) fn corrupt(what: impl Into<String>, detail: impl Into<String>) -> Error {
    Error::Corrupt {
        what: what.into(),
        detail: detail.into(),
    }
}
