//! The kind each typed error is: the crates underneath (blockfs, the driver, VFIO, the GPU
//! side, the software controller) and this crate's own (copies, safetensors, images), so an
//! [`Error`] made from one has its kind set once, here, and a binary's error chain
//! ([`ErrorKind::of_chain`]) is read the same way.

use crate::error::{Error, ErrorKind, InvalidArgument, Refused};

impl ErrorKind {
    /// The kind of an error chain (e.g. `anyhow::Error::chain()` in a binary): the first
    /// [`Error`] in it says its own; before one, the first typed error of the crates underneath
    /// that says one; [`ErrorKind::Other`] if none does.
    pub fn of_chain<'a>(
        chain: impl IntoIterator<Item = &'a (dyn std::error::Error + 'static)>,
    ) -> ErrorKind {
        chain
            .into_iter()
            .find_map(|c| match c.downcast_ref::<Error>() {
                Some(e) => Some(e.kind()),
                None => kind_of(c),
            })
            .unwrap_or(ErrorKind::Other)
    }
}

impl Error {
    /// An error from any typed error: its kind from the first error in its chain that says one
    /// ([`ErrorKind::Other`] if none does).
    pub fn from_std(cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        let kind = ErrorKind::of_chain(std::iter::successors(
            Some(&cause as &(dyn std::error::Error + 'static)),
            |e| e.source(),
        ));
        Self::with_cause(kind, cause)
    }
}

/// Typed errors of the crates underneath (and of this one) become an [`Error`] of the kind
/// they say.
macro_rules! from_typed {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::from_std(e)
            }
        }
    )*};
}

from_typed!(
    std::io::Error,
    nvme::Error,
    nvme_emu::EmuError,
    vfio::Error,
    nvmf::host::FabricsError,
    blockfs::Error,
    blockfs::VolumeError,
    gpu_queues::GpuError,
    blockfs_gpu::FilesError,
    crate::copy::CopyError,
    crate::safetensors::SafetensorsError,
    crate::gpu_io::GpuChecksumMismatch,
    crate::open::HostWriteFailed,
    crate::open::MissingImage,
    crate::open::ImageExists,
    Refused,
    InvalidArgument,
    blockfs::DeviceError,
    nvme::DmaAllocError,
    std::num::TryFromIntError,
    gpunvme_serve_client::ClientError,
);

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::with_cause(ErrorKind::Other, e)
    }
}

/// The kind one error of a chain says, if it is one of the typed errors underneath.
fn kind_of(cause: &(dyn std::error::Error + 'static)) -> Option<ErrorKind> {
    if cause.is::<Refused>() {
        return Some(ErrorKind::Refused);
    }
    if cause.is::<InvalidArgument>() {
        return Some(ErrorKind::InvalidArgument);
    }
    if let Some(e) = cause.downcast_ref::<crate::open::HostWriteFailed>() {
        return Some(if e.no_space {
            ErrorKind::NoSpace
        } else {
            ErrorKind::Io
        });
    }
    if cause.is::<crate::open::MissingImage>() {
        return Some(ErrorKind::NotFound);
    }
    if cause.is::<crate::open::ImageExists>() {
        return Some(ErrorKind::Exists);
    }
    if let Some(e) = cause.downcast_ref::<nvme_emu::EmuError>() {
        return Some(match e {
            nvme_emu::EmuError::ImageBusy { .. } => ErrorKind::Busy,
            nvme_emu::EmuError::OpenImage { .. }
            | nvme_emu::EmuError::CreateImage { .. }
            | nvme_emu::EmuError::InvalidImage { .. } => ErrorKind::Image,
            _ => ErrorKind::Device,
        });
    }
    if let Some(e) = cause.downcast_ref::<nvmf::host::FabricsError>() {
        return Some(match e {
            nvmf::host::FabricsError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            _ => ErrorKind::Device,
        });
    }
    if let Some(e) = cause.downcast_ref::<gpunvme_serve_client::ClientError>() {
        return Some(crate::served::client_kind(e));
    }
    if let Some(e) = cause.downcast_ref::<vfio::Error>() {
        return Some(match e {
            vfio::Error::GroupBusy { .. } => ErrorKind::Busy,
            _ => ErrorKind::Device,
        });
    }
    if let Some(e) = cause.downcast_ref::<crate::copy::CopyError>() {
        use crate::copy::CopyError as C;
        match e {
            C::DataMismatch { .. } => return Some(ErrorKind::Corrupt),
            C::NotRegular(_) | C::IsDirectory(_) | C::NoFileName(_) | C::Chunk(_) => {
                return Some(ErrorKind::InvalidArgument);
            }
            C::SourceChanged { .. } | C::SourceModified { .. } | C::Host { .. } => {
                return Some(ErrorKind::Io);
            }
            // Transparent: the chain goes on past it.
            C::Fs(e) => return Some(blockfs_kind(e)),
            _ => {}
        }
    }
    if let Some(e) = cause.downcast_ref::<crate::safetensors::SafetensorsError>() {
        use crate::safetensors::SafetensorsError as S;
        return Some(match e {
            S::Format { .. } => ErrorKind::Corrupt,
            S::Duplicate { .. } | S::InvalidArgument(_) => ErrorKind::InvalidArgument,
            S::Fs(e) => blockfs_kind(e),
            S::Gpu(_) => ErrorKind::Device,
        });
    }
    if cause.is::<crate::gpu_io::GpuChecksumMismatch>() {
        return Some(ErrorKind::Corrupt);
    }
    if let Some(e) = cause.downcast_ref::<blockfs::VolumeError>() {
        use blockfs::VolumeError as V;
        return Some(match e {
            V::BadLabel { .. } => ErrorKind::Corrupt,
            V::Device { .. } => ErrorKind::Device,
            // The wrong devices for the volume, or a geometry that cannot make one.
            _ => ErrorKind::InvalidArgument,
        });
    }
    if let Some(e) = cause.downcast_ref::<blockfs::Error>() {
        return Some(blockfs_kind(e));
    }
    if let Some(e) = cause.downcast_ref::<gpu_queues::GpuError>() {
        return Some(gpu_kind(e));
    }
    if let Some(e) = cause.downcast_ref::<blockfs_gpu::FilesError>() {
        use blockfs_gpu::FilesError as F;
        return Some(match e {
            F::InvalidArgument(_) => ErrorKind::InvalidArgument,
            F::Fs(e) => blockfs_kind(e),
            F::Gpu(e) => gpu_kind(e),
            _ => ErrorKind::Device,
        });
    }
    if cause.is::<nvme::Error>() {
        return Some(ErrorKind::Device);
    }
    if cause.is::<blockfs::DeviceError>() || cause.is::<nvme::DmaAllocError>() {
        return Some(ErrorKind::Device);
    }
    if cause.is::<std::num::TryFromIntError>() {
        return Some(ErrorKind::InvalidArgument);
    }
    if cause.is::<std::io::Error>() {
        return Some(ErrorKind::Io);
    }
    None
}

/// A GPU-side error's kind: an argument the GPU side refused (host memory given as GPU
/// memory, a range past its allocation) or the device.
fn gpu_kind(e: &gpu_queues::GpuError) -> ErrorKind {
    match e {
        gpu_queues::GpuError::InvalidArgument(_) => ErrorKind::InvalidArgument,
        _ => ErrorKind::Device,
    }
}

fn blockfs_kind(e: &blockfs::Error) -> ErrorKind {
    use blockfs::Error as E;
    match e {
        E::NotFound(_) => ErrorKind::NotFound,
        E::AlreadyExists(_) => ErrorKind::Exists,
        E::NoSpace { .. } => ErrorKind::NoSpace,
        E::ReadOnly(_) => ErrorKind::ReadOnly,
        E::NotBlockfs(_) => ErrorKind::NoFileSystem,
        E::Corrupt { .. } | E::Unsupported(_) => ErrorKind::Corrupt,
        E::InvalidName { .. } | E::TooLarge(_) | E::FutureGeneration { .. } => {
            ErrorKind::InvalidArgument
        }
        E::Device { .. } => ErrorKind::Device,
        _ => ErrorKind::FileSystem,
    }
}
