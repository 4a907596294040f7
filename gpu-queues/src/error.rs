//! [`GpuError`]: every way setting up or running GPU queues can fail.

use std::time::Duration;

use crate::desc::DeviceStatus;

/// Errors of the gpu_queues crate.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No usable CUDA driver or GPU.
    #[error("no GPU: {reason}")]
    NoCuda {
        /// What was missing.
        reason: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA call {call} failed: {message} ({code})")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// Its CUresult.
        code: i32,
        /// The driver's name for it.
        message: String,
    },
    /// The NVMe driver failed (queue creation or deletion, admin commands).
    #[error("NVMe driver")]
    Nvme(#[from] nvme::Error),
    /// The software controller refused (registration of GPU memory or doorbells).
    #[error("software controller")]
    Emu(#[from] nvme_emu::EmuError),
    /// A transport or configuration this build or machine cannot do.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A caller's request that cannot be honoured.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A bounded wait on the GPU ran out.
    #[error("{what} did not finish within {waited:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: Duration,
    },
    /// A device-side call returned an error status.
    #[error("GPU queue operation failed: {status}")]
    Device {
        /// The header's status code.
        status: DeviceStatus,
        /// The CQE status field (SCT/SC/DNR), for NVMe errors.
        nvme_status: u16,
    },
}
