//! The legacy VFIO container/group API: open a group, check it is viable, attach it to a
//! container, pick the IOMMU model (type1, or no-IOMMU), map and unmap DMA.
#![forbid(unsafe_code)]

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use vfio_bindings::bindings::vfio as b;

use crate::caps::{self, IommuInfo};
use crate::sysfs::{self, Preflight, SysRoots};
use crate::{Error, IommuMode, PciAddress, sys};

/// A VFIO container with one group attached and its IOMMU model set.
///
/// Keeps the group file open: closing it would detach the group and tear the IOMMU context
/// down, so it lives exactly as long as the container (and so as long as any DMA mapping).
#[derive(Debug)]
pub(crate) struct Container {
    file: File,
    group: File,
    group_number: u32,
    mode: IommuMode,
}

fn open_rw(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).write(true).open(path)
}

impl Container {
    /// Opens the group of a function that passed [`sysfs::preflight`], checks that VFIO finds it
    /// viable, and attaches it to a new container with the right IOMMU model.
    pub(crate) fn open(pre: &Preflight, roots: &SysRoots) -> Result<Self, Error> {
        let group = open_rw(&pre.group_file).map_err(|source| {
            let path = pre.group_file.clone();
            match source.raw_os_error() {
                Some(libc::ENOENT) => Error::GroupFileMissing {
                    addr: pre.addr,
                    group: pre.group,
                    path,
                },
                Some(libc::EBUSY) => Error::GroupBusy {
                    path,
                    group: pre.group,
                },
                Some(libc::EPERM) if pre.mode == IommuMode::NoIommu => {
                    Error::NoIommuNeedsRoot { path }
                }
                Some(libc::EACCES | libc::EPERM) => Error::Permission { path, source },
                _ => Error::Open { path, source },
            }
        })?;

        let flags = sys::group_get_status(group.as_fd()).map_err(|source| Error::Ioctl {
            op: "VFIO_GROUP_GET_STATUS",
            source,
        })?;
        if flags & b::VFIO_GROUP_FLAGS_VIABLE == 0 {
            // Name the culprits if sysfs can tell; VFIO's verdict stands either way.
            let blockers = sysfs::group_blockers(roots, pre.group).unwrap_or_default();
            return Err(Error::GroupNotViable {
                addr: pre.addr,
                group: pre.group,
                blockers,
            });
        }

        let path = roots.container_file();
        let file = open_rw(&path).map_err(|source| match source.raw_os_error() {
            Some(libc::ENOENT) => Error::VfioNotLoaded { path: path.clone() },
            Some(libc::EACCES | libc::EPERM) => Error::Permission {
                path: path.clone(),
                source,
            },
            _ => Error::Open {
                path: path.clone(),
                source,
            },
        })?;
        let version = sys::get_api_version(file.as_fd()).map_err(|source| Error::Ioctl {
            op: "VFIO_GET_API_VERSION",
            source,
        })?;
        if version != b::VFIO_API_VERSION as i32 {
            return Err(Error::ApiVersion {
                found: version,
                expected: b::VFIO_API_VERSION,
            });
        }

        let has = |ext: u32| {
            sys::check_extension(file.as_fd(), ext).map_err(|source| Error::Ioctl {
                op: "VFIO_CHECK_EXTENSION",
                source,
            })
        };
        let iommu_type = match pre.mode {
            IommuMode::Type1 if has(b::VFIO_TYPE1v2_IOMMU)? => b::VFIO_TYPE1v2_IOMMU,
            IommuMode::Type1 if has(b::VFIO_TYPE1_IOMMU)? => b::VFIO_TYPE1_IOMMU,
            IommuMode::Type1 => return Err(Error::NoType1),
            IommuMode::NoIommu if has(b::VFIO_NOIOMMU_IOMMU)? => b::VFIO_NOIOMMU_IOMMU,
            IommuMode::NoIommu => return Err(Error::NoIommuUnsupported),
        };

        sys::group_set_container(group.as_fd(), file.as_fd()).map_err(|source| Error::Ioctl {
            op: "VFIO_GROUP_SET_CONTAINER",
            source,
        })?;
        sys::set_iommu(file.as_fd(), iommu_type).map_err(|source| Error::Ioctl {
            op: "VFIO_SET_IOMMU",
            source,
        })?;
        tracing::debug!(group = pre.group, iommu_type, "VFIO container ready");
        Ok(Self {
            file,
            group,
            group_number: pre.group,
            mode: pre.mode,
        })
    }

    /// Opens the device file of `addr`, which must belong to this container's group.
    pub(crate) fn open_device(&self, addr: &PciAddress) -> Result<File, Error> {
        let name = CString::new(addr.to_string()).expect("a PCI address has no NUL byte");
        let fd = sys::group_get_device_fd(self.group.as_fd(), &name).map_err(|source| {
            match (source.raw_os_error(), self.mode) {
                (Some(libc::EPERM), IommuMode::NoIommu) => Error::NoIommuNeedsRoot {
                    path: format!("/dev/vfio/noiommu-{}", self.group_number).into(),
                },
                _ => Error::Ioctl {
                    op: "VFIO_GROUP_GET_DEVICE_FD",
                    source,
                },
            }
        })?;
        Ok(File::from(fd))
    }

    /// What the type1 IOMMU reports: page sizes, usable IOVA ranges, mappings left.
    pub(crate) fn iommu_info(&self) -> Result<IommuInfo, Error> {
        let bytes = sys::iommu_get_info(self.file.as_fd()).map_err(|source| Error::Ioctl {
            op: "VFIO_IOMMU_GET_INFO",
            source,
        })?;
        caps::parse_iommu_info(&bytes).map_err(|source| Error::Ioctl {
            op: "VFIO_IOMMU_GET_INFO",
            source,
        })
    }

    /// The container file, for `VFIO_IOMMU_MAP_DMA` (issued by `dma`, which owns the memory).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Turns a failed `VFIO_IOMMU_MAP_DMA` into the error a user can act on.
    pub(crate) fn map_dma_error(iova: u64, len: usize, source: io::Error) -> Error {
        match source.raw_os_error() {
            // vfio_iommu_type1 charges pinned pages to RLIMIT_MEMLOCK and says ENOMEM past it.
            Some(libc::ENOMEM) => Error::MemlockTooLow {
                len,
                limit: sys::memlock_limit(),
            },
            // dma_entry_limit reached.
            Some(libc::ENOSPC) => Error::TooManyMappings,
            _ => Error::MapDma { iova, len, source },
        }
    }

    /// Removes the device's access to `iova..iova + len`, a range earlier mapped whole.
    pub(crate) fn unmap_dma(&self, iova: u64, len: usize) -> Result<(), Error> {
        let unmapped = sys::iommu_unmap_dma(self.file.as_fd(), iova, len as u64)
            .map_err(|source| Error::UnmapDma { iova, len, source })?;
        if unmapped != len as u64 {
            return Err(Error::UnmapDma {
                iova,
                len,
                source: io::Error::other(format!("kernel unmapped {unmapped} bytes")),
            });
        }
        Ok(())
    }
}
