//! What kind of failure an error is, for callers that answer per kind: the CLI's `--json`
//! error objects, the Python package's exception classes. Found by walking the error's chain
//! for the typed errors of the crates underneath.

/// A call refused before anything changed, because it would destroy data.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// A caller's argument that cannot work (a combination of options, a value out of range):
/// [`ErrorKind::InvalidArgument`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidArgument(pub String);

/// The kinds of failure a caller may want to tell apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Another process (or handle) owns the device or image.
    Busy,
    /// No such file.
    NotFound,
    /// The file exists.
    Exists,
    /// The file system is full, or the host file system holding an image is.
    NoSpace,
    /// The file is open read-only, or the handle or file system is (a change refused up
    /// front on a handle opened read-only).
    ReadOnly,
    /// The namespace holds no blockfs.
    NoFileSystem,
    /// On-disk data failed its checks (metadata checksum, data checksum, format).
    Corrupt,
    /// A caller's argument is not acceptable (a name, a size, an offset, a host path's kind).
    InvalidArgument,
    /// A host file or stream failed.
    Io,
    /// The image file cannot be opened, created or used.
    Image,
    /// The device (controller, VFIO, a command) failed.
    Device,
    /// Refused before anything changed: the call would destroy data.
    Refused,
    /// Another file-system error.
    FileSystem,
    /// Anything else.
    Other,
}

impl ErrorKind {
    /// The kind's name in JSON error objects: `busy`, `not_found`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Busy => "busy",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Exists => "exists",
            ErrorKind::NoSpace => "no_space",
            ErrorKind::ReadOnly => "read_only",
            ErrorKind::NoFileSystem => "no_file_system",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Io => "io",
            ErrorKind::Image => "image",
            ErrorKind::Device => "device",
            ErrorKind::Refused => "refused",
            ErrorKind::FileSystem => "file_system",
            ErrorKind::Other => "error",
        }
    }

    /// The kind of `e`: the first typed error in its chain that says one.
    pub fn of(e: &anyhow::Error) -> ErrorKind {
        e.chain().find_map(kind_of).unwrap_or(ErrorKind::Other)
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
            S::Duplicate { .. } => ErrorKind::InvalidArgument,
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
        E::InvalidName { .. } | E::TooLarge(_) => ErrorKind::InvalidArgument,
        E::Device { .. } => ErrorKind::Device,
        _ => ErrorKind::FileSystem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_typed_error_in_the_chain_decides() {
        let e = anyhow::Error::new(blockfs::Error::NotFound("a".into())).context("getting a");
        assert_eq!(ErrorKind::of(&e), ErrorKind::NotFound);
        let e = anyhow::Error::new(std::io::Error::other("x")).context("reading");
        assert_eq!(ErrorKind::of(&e), ErrorKind::Io);
        assert_eq!(ErrorKind::of(&anyhow::anyhow!("plain")), ErrorKind::Other);
        assert_eq!(ErrorKind::NoSpace.as_str(), "no_space");
    }

    #[test]
    fn a_refused_host_write_is_named_for_its_cause() {
        let failed = |no_space| {
            anyhow::Error::new(crate::open::HostWriteFailed {
                path: "disk.img".into(),
                no_space,
                host: "No space left on device (os error 28)".into(),
                device: "Write Fault".into(),
            })
        };
        let e = failed(true);
        assert_eq!(ErrorKind::of(&e), ErrorKind::NoSpace);
        assert!(
            e.to_string()
                .starts_with("no space left on the host file system holding disk.img (ENOSPC"),
            "{e}"
        );
        assert_eq!(ErrorKind::of(&failed(false)), ErrorKind::Io);
        let missing = anyhow::Error::new(crate::open::MissingImage {
            path: "x.img".into(),
            default: false,
            hint: None,
        })
        .context("opening x.img");
        assert_eq!(ErrorKind::of(&missing), ErrorKind::NotFound);
        let worded = crate::open::MissingImage::explain(missing, |_| "make it so".into());
        assert_eq!(
            format!("{worded:#}"),
            "opening x.img: image x.img does not exist (make it so)"
        );
    }
}
