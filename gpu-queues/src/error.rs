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
    /// The controller serving the queues refused, in its own terms (an emulated controller's
    /// registration of GPU memory or doorbells).
    #[error("the controller serving the GPU queues refused")]
    Controller(#[source] Box<dyn std::error::Error + Send + Sync>),
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
    /// VFIO refused (mapping memory for the SSD).
    #[error("VFIO: {op}")]
    Vfio {
        /// What was being done.
        op: &'static str,
        /// VFIO's error.
        #[source]
        source: vfio::Error,
    },
    /// An operating-system call failed (mmap, ioctl, sysfs).
    #[error("{op}")]
    Os {
        /// What was being done, with the path or device involved.
        op: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The GPU's IOMMU domain translates its DMA, so its doorbell writes to the SSD would fault
    /// or silently never arrive; the message says how to fix it.
    #[error(
        "GPU {gpu} is in IOMMU group {group} whose domain type is {domain:?} (translated): its \
         writes to the SSD's doorbells would fault or silently never arrive. Make the GPU's \
         group identity-mapped: boot with `iommu=pt` (Intel: `intel_iommu=on iommu=pt`; or \
         `iommu.passthrough=1`), or unbind the GPU's driver, `echo identity > \
         /sys/kernel/iommu_groups/{group}/type`, and bind it again"
    )]
    GpuIommuTranslated {
        /// The GPU's PCI address.
        gpu: String,
        /// Its IOMMU group.
        group: u32,
        /// What `iommu_group/type` says ("DMA", "DMA-FQ", ...).
        domain: String,
    },
    /// Whether the GPU's DMA is translated could not be told; the message says why.
    #[error("cannot tell whether GPU {gpu}'s IOMMU domain is identity-mapped: {reason}")]
    GpuIommuUnknown {
        /// The GPU's PCI address.
        gpu: String,
        /// What was missing or unreadable, and what to do.
        reason: String,
    },
    /// No transport could serve GPU queues on this controller; every one tried, with why.
    #[error("no GPU queue transport works here: {}", crate::transport_kind::list_skipped(.skipped))]
    NoTransport {
        /// Each transport in the order tried, with the reason it was skipped.
        skipped: Vec<crate::transport_kind::Skipped>,
    },
}

impl GpuError {
    /// [`GpuError::Controller`] from the serving controller's own error.
    pub fn controller(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Controller(Box::new(e))
    }
}
