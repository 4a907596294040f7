//! Raw VFIO ioctls over vfio-bindings' structs, plus the two libc queries the crate needs.
//!
//! Each wrapper issues exactly one ioctl and returns the OS error untouched; callers turn it into
//! an [`crate::Error`] that names the operation. Structures with capability chains
//! (`VFIO_DEVICE_GET_REGION_INFO`, `VFIO_IOMMU_GET_INFO`) are handled as byte buffers and decoded
//! by the safe parsers in [`crate::caps`].
// UNSAFETY: ioctl(2) on VFIO file descriptors with pointers to argument structures, and
// getrlimit/sysconf. Every call passes memory that lives across the call and is as large as the
// `argsz` it declares.
#![expect(unsafe_code)]

use std::ffi::CStr;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use libc::{c_int, c_ulong};
use vfio_bindings::bindings::vfio as b;

/// `_IO(VFIO_TYPE, VFIO_BASE + n)`: every VFIO ioctl is an `_IO` number whose argument size
/// travels in the structure's `argsz` field instead of the request number.
const fn vfio_io(n: u32) -> c_ulong {
    (((b::VFIO_TYPE as u32) << 8) | (b::VFIO_BASE + n)) as c_ulong
}

pub(crate) const VFIO_GET_API_VERSION: c_ulong = vfio_io(0);
pub(crate) const VFIO_CHECK_EXTENSION: c_ulong = vfio_io(1);
pub(crate) const VFIO_SET_IOMMU: c_ulong = vfio_io(2);
pub(crate) const VFIO_GROUP_GET_STATUS: c_ulong = vfio_io(3);
pub(crate) const VFIO_GROUP_SET_CONTAINER: c_ulong = vfio_io(4);
pub(crate) const VFIO_GROUP_GET_DEVICE_FD: c_ulong = vfio_io(6);
pub(crate) const VFIO_DEVICE_GET_INFO: c_ulong = vfio_io(7);
pub(crate) const VFIO_DEVICE_GET_REGION_INFO: c_ulong = vfio_io(8);
pub(crate) const VFIO_DEVICE_RESET: c_ulong = vfio_io(11);
pub(crate) const VFIO_IOMMU_GET_INFO: c_ulong = vfio_io(12);
pub(crate) const VFIO_IOMMU_MAP_DMA: c_ulong = vfio_io(13);
pub(crate) const VFIO_IOMMU_UNMAP_DMA: c_ulong = vfio_io(14);

fn check(ret: c_int) -> io::Result<c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `VFIO_GET_API_VERSION` on the container.
pub(crate) fn get_api_version(container: BorrowedFd<'_>) -> io::Result<i32> {
    // SAFETY: this ioctl takes no argument and writes no memory of ours.
    check(unsafe { libc::ioctl(container.as_raw_fd(), VFIO_GET_API_VERSION as _) })
}

/// `VFIO_CHECK_EXTENSION`: whether the container supports IOMMU type or extension `ext`.
pub(crate) fn check_extension(container: BorrowedFd<'_>, ext: u32) -> io::Result<bool> {
    // SAFETY: the argument is passed by value; the kernel writes no memory of ours.
    let r = check(unsafe {
        libc::ioctl(
            container.as_raw_fd(),
            VFIO_CHECK_EXTENSION as _,
            ext as c_ulong,
        )
    })?;
    Ok(r > 0)
}

/// `VFIO_SET_IOMMU`: selects the IOMMU model once a group is attached.
pub(crate) fn set_iommu(container: BorrowedFd<'_>, ty: u32) -> io::Result<()> {
    // SAFETY: the argument is passed by value; the kernel writes no memory of ours.
    check(unsafe { libc::ioctl(container.as_raw_fd(), VFIO_SET_IOMMU as _, ty as c_ulong) })?;
    Ok(())
}

/// `VFIO_GROUP_GET_STATUS`: the group's `VFIO_GROUP_FLAGS_*`.
pub(crate) fn group_get_status(group: BorrowedFd<'_>) -> io::Result<u32> {
    let mut status = b::vfio_group_status {
        argsz: size_of::<b::vfio_group_status>() as u32,
        flags: 0,
    };
    // SAFETY: `status` is a live, correctly sized vfio_group_status whose argsz says so; the
    // kernel writes at most that many bytes.
    check(unsafe { libc::ioctl(group.as_raw_fd(), VFIO_GROUP_GET_STATUS as _, &mut status) })?;
    Ok(status.flags)
}

/// `VFIO_GROUP_SET_CONTAINER`: attaches the group to the container.
pub(crate) fn group_set_container(
    group: BorrowedFd<'_>,
    container: BorrowedFd<'_>,
) -> io::Result<()> {
    let fd: c_int = container.as_raw_fd();
    // SAFETY: the kernel reads one int through the pointer, which points at `fd` for the call.
    check(unsafe { libc::ioctl(group.as_raw_fd(), VFIO_GROUP_SET_CONTAINER as _, &fd) })?;
    Ok(())
}

/// `VFIO_GROUP_GET_DEVICE_FD`: opens the device named `name` (a PCI address) in the group.
pub(crate) fn group_get_device_fd(group: BorrowedFd<'_>, name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a NUL-terminated string that outlives the call; the kernel only reads it.
    let fd = check(unsafe {
        libc::ioctl(
            group.as_raw_fd(),
            VFIO_GROUP_GET_DEVICE_FD as _,
            name.as_ptr(),
        )
    })?;
    // SAFETY: on success the ioctl returns a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `VFIO_DEVICE_GET_INFO`.
pub(crate) fn device_get_info(device: BorrowedFd<'_>) -> io::Result<b::vfio_device_info> {
    let mut info = b::vfio_device_info {
        argsz: size_of::<b::vfio_device_info>() as u32,
        ..Default::default()
    };
    // SAFETY: `info` is a live vfio_device_info and argsz is its size; the kernel writes at
    // most argsz bytes (capabilities beyond it are not requested).
    check(unsafe { libc::ioctl(device.as_raw_fd(), VFIO_DEVICE_GET_INFO as _, &mut info) })?;
    Ok(info)
}

/// `VFIO_DEVICE_RESET`: function-level reset.
pub(crate) fn device_reset(device: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: this ioctl takes no argument.
    check(unsafe { libc::ioctl(device.as_raw_fd(), VFIO_DEVICE_RESET as _) })?;
    Ok(())
}

/// Issues an ioctl whose argument begins with `argsz` and may be followed by a capability
/// chain. `head` is the fixed part (argsz is overwritten). If the kernel answers with a larger
/// argsz, the call is repeated with a buffer of that size. Returns the bytes the kernel filled.
fn ioctl_with_caps(fd: BorrowedFd<'_>, request: c_ulong, head: &[u8]) -> io::Result<Vec<u8>> {
    let mut size = head.len();
    // Two rounds suffice: the second uses the size the kernel asked for. A third is allowed in
    // case the chain grew in between (hotplug), then we give up.
    for _ in 0..3 {
        // u64 elements: the structures need 8-byte alignment.
        let mut buf = vec![0u64; size.div_ceil(8)];
        {
            let bytes = as_bytes_mut(&mut buf);
            bytes[..head.len()].copy_from_slice(head);
            bytes[..4].copy_from_slice(&(size as u32).to_ne_bytes());
        }
        // SAFETY: `buf` is live for the call, 8-byte aligned and at least `size` bytes long, and
        // its argsz field says `size`; the kernel writes at most argsz bytes.
        check(unsafe { libc::ioctl(fd.as_raw_fd(), request as _, buf.as_mut_ptr()) })?;
        let bytes = as_bytes_mut(&mut buf);
        let wanted = u32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
        if wanted <= size {
            let mut out = bytes.to_vec();
            out.truncate(size);
            return Ok(out);
        }
        size = wanted;
    }
    Err(io::Error::other("capability chain kept growing"))
}

fn as_bytes_mut(buf: &mut [u64]) -> &mut [u8] {
    let len = std::mem::size_of_val(buf);
    // SAFETY: any initialized u64 slice is a valid u8 slice of 8x the length, with compatible
    // (smaller) alignment; the borrow keeps `buf` exclusively borrowed for the result's lifetime.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u8>(), len) }
}

/// `VFIO_DEVICE_GET_REGION_INFO` for region `index`, with its capability chain.
pub(crate) fn device_get_region_info(device: BorrowedFd<'_>, index: u32) -> io::Result<Vec<u8>> {
    let mut head = [0u8; size_of::<b::vfio_region_info>()];
    head[8..12].copy_from_slice(&index.to_ne_bytes());
    ioctl_with_caps(device, VFIO_DEVICE_GET_REGION_INFO, &head)
}

/// `VFIO_IOMMU_GET_INFO` (type1), with its capability chain.
pub(crate) fn iommu_get_info(container: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
    let head = [0u8; size_of::<b::vfio_iommu_type1_info>()];
    ioctl_with_caps(container, VFIO_IOMMU_GET_INFO, &head)
}

/// `VFIO_IOMMU_MAP_DMA`: lets the device read and write `size` bytes at `vaddr` through `iova`.
///
/// # Safety
/// `vaddr..vaddr + size` is a mapping of this process that stays allocated, and is not reused
/// for anything the device must not touch, until [`iommu_unmap_dma`] of the same IOVA range has
/// returned successfully (the kernel pins the pages, but the device can write them at any time
/// while the mapping exists).
pub(crate) unsafe fn iommu_map_dma(
    container: BorrowedFd<'_>,
    vaddr: u64,
    iova: u64,
    size: u64,
) -> io::Result<()> {
    let map = b::vfio_iommu_type1_dma_map {
        argsz: size_of::<b::vfio_iommu_type1_dma_map>() as u32,
        flags: b::VFIO_DMA_MAP_FLAG_READ | b::VFIO_DMA_MAP_FLAG_WRITE,
        vaddr,
        iova,
        size,
    };
    // SAFETY: `map` is live and argsz-sized; the kernel only reads it. Keeping the user memory
    // valid while mapped is this function's own contract, passed to the caller.
    check(unsafe { libc::ioctl(container.as_raw_fd(), VFIO_IOMMU_MAP_DMA as _, &map) })?;
    Ok(())
}

/// `VFIO_IOMMU_UNMAP_DMA`: removes the device's access to `iova..iova + size`. Returns how many
/// bytes the kernel reports unmapped.
pub(crate) fn iommu_unmap_dma(container: BorrowedFd<'_>, iova: u64, size: u64) -> io::Result<u64> {
    let mut unmap = b::vfio_iommu_type1_dma_unmap {
        argsz: size_of::<b::vfio_iommu_type1_dma_unmap>() as u32,
        flags: 0,
        iova,
        size,
        data: Default::default(),
    };
    // SAFETY: `unmap` is live and argsz-sized (no dirty bitmap requested); the kernel writes
    // back only its `size` field.
    check(unsafe { libc::ioctl(container.as_raw_fd(), VFIO_IOMMU_UNMAP_DMA as _, &mut unmap) })?;
    Ok(unmap.size)
}

/// The soft RLIMIT_MEMLOCK in bytes (`u64::MAX` for unlimited), if it can be read.
pub(crate) fn memlock_limit() -> Option<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `rl` is a live rlimit the call fills in.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    (r == 0).then_some(if rl.rlim_cur == libc::RLIM_INFINITY {
        u64::MAX
    } else {
        rl.rlim_cur
    })
}

/// The host's base page size.
pub(crate) fn host_page_size() -> usize {
    // SAFETY: sysconf reads a constant and touches no memory of ours.
    let r = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if r > 0 { r as usize } else { 4096 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbers from the kernel's uapi header (`_IO(';', 100 + n)`), as strace prints them.
    #[test]
    fn ioctl_numbers_match_the_kernel() {
        assert_eq!(VFIO_GET_API_VERSION, 0x3b64);
        assert_eq!(VFIO_CHECK_EXTENSION, 0x3b65);
        assert_eq!(VFIO_SET_IOMMU, 0x3b66);
        assert_eq!(VFIO_GROUP_GET_STATUS, 0x3b67);
        assert_eq!(VFIO_GROUP_SET_CONTAINER, 0x3b68);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD, 0x3b6a);
        assert_eq!(VFIO_DEVICE_GET_INFO, 0x3b6b);
        assert_eq!(VFIO_DEVICE_GET_REGION_INFO, 0x3b6c);
        assert_eq!(VFIO_DEVICE_RESET, 0x3b6f);
        assert_eq!(VFIO_IOMMU_GET_INFO, 0x3b70);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3b71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3b72);
    }

    #[test]
    fn struct_sizes_match_the_kernel() {
        assert_eq!(size_of::<b::vfio_region_info>(), 32);
        assert_eq!(size_of::<b::vfio_iommu_type1_info>(), 24);
        assert_eq!(size_of::<b::vfio_iommu_type1_dma_map>(), 32);
        assert_eq!(size_of::<b::vfio_iommu_type1_dma_unmap>(), 24);
    }

    #[test]
    fn ioctl_on_a_non_vfio_fd_reports_the_os_error() {
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        let e = get_api_version(f.as_fd()).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTTY));
    }
}
