//! [`FilesError`]: every way a file transfer on the GPU can fail.

use gpu_queues::{DeviceStatus, GpuError};

/// Errors of the blockfs_gpu crate.
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    /// The GPU queues or the GPU failed (set-up, a copy, a bounded wait that ran out).
    #[error("GPU queues")]
    Gpu(#[from] GpuError),
    /// A blockfs call failed (opening a file for the GPU, reserving it, committing).
    #[error("file system")]
    Fs(#[from] blockfs::Error),
    /// A caller's request that cannot be honoured.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A byte range outside what the file lets the device touch: past its length for a read,
    /// past its allocation (or through a read-only table) for a write.
    #[error("{name}: bytes {offset}..{end} are outside the file's {what} ({limit} bytes)")]
    OutOfFile {
        /// The file.
        name: String,
        /// First byte asked for.
        offset: u64,
        /// End of the range.
        end: u64,
        /// "length" (reads) or "allocation" (writes through a reservation) or "read-only table".
        what: &'static str,
        /// The limit in bytes.
        limit: u64,
    },
    /// A file transfer failed on the GPU.
    #[error("GPU {op} of {name} bytes {offset}..{end} failed: {status}{}", nvme_suffix(*.nvme_status))]
    FileIo {
        /// "read" or "write".
        op: &'static str,
        /// The file.
        name: String,
        /// First byte of the range.
        offset: u64,
        /// End of the range.
        end: u64,
        /// The device-side status.
        status: DeviceStatus,
        /// The CQE status field, for NVMe errors.
        nvme_status: u16,
    },
}

fn nvme_suffix(sf: u16) -> String {
    if sf == 0 {
        String::new()
    } else {
        format!(" (CQE status field {sf:#06x})")
    }
}
