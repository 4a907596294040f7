//! The vfio-user wire format: message header, command numbers and the fixed parts of the
//! messages this client sends and receives.
//!
//! Layouts follow the vfio-user protocol specification (QEMU's `docs/interop/vfio-user.rst`,
//! version 0.1): every message starts with a 16-byte header; integers are little-endian (the
//! host's order: this crate runs on x86-64 and arm64 only). Region and device info reuse the
//! kernel's `struct vfio_region_info` / `vfio_device_info` layouts, so region replies are
//! decoded by the same code as the kernel's (`crate::caps`).
#![forbid(unsafe_code)]

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Protocol version this client speaks (and requires of the server: major 0).
pub(crate) const VERSION_MAJOR: u16 = 0;
/// Minor version offered.
pub(crate) const VERSION_MINOR: u16 = 1;

/// Largest message accepted from a server: a region read of at most [`MAX_DATA_XFER`] bytes
/// plus headers, or a region-info reply with its capabilities.
pub(crate) const MAX_MESSAGE: usize = MAX_DATA_XFER + 4096;
/// Largest data transfer this client asks for in one region access (the spec's default).
pub(crate) const MAX_DATA_XFER: usize = 1 << 20;

/// vfio-user commands (the header's `command`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum Command {
    /// VFIO_USER_VERSION.
    Version = 1,
    /// VFIO_USER_DMA_MAP.
    DmaMap = 2,
    /// VFIO_USER_DMA_UNMAP.
    DmaUnmap = 3,
    /// VFIO_USER_DEVICE_GET_INFO.
    DeviceGetInfo = 4,
    /// VFIO_USER_DEVICE_GET_REGION_INFO.
    DeviceGetRegionInfo = 5,
    /// VFIO_USER_DEVICE_GET_IRQ_INFO.
    DeviceGetIrqInfo = 7,
    /// VFIO_USER_REGION_READ.
    RegionRead = 9,
    /// VFIO_USER_REGION_WRITE.
    RegionWrite = 10,
    /// VFIO_USER_DEVICE_RESET.
    DeviceReset = 13,
}

impl Command {
    /// The spec's name, for messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Command::Version => "VFIO_USER_VERSION",
            Command::DmaMap => "VFIO_USER_DMA_MAP",
            Command::DmaUnmap => "VFIO_USER_DMA_UNMAP",
            Command::DeviceGetInfo => "VFIO_USER_DEVICE_GET_INFO",
            Command::DeviceGetRegionInfo => "VFIO_USER_DEVICE_GET_REGION_INFO",
            Command::DeviceGetIrqInfo => "VFIO_USER_DEVICE_GET_IRQ_INFO",
            Command::RegionRead => "VFIO_USER_REGION_READ",
            Command::RegionWrite => "VFIO_USER_REGION_WRITE",
            Command::DeviceReset => "VFIO_USER_DEVICE_RESET",
        }
    }
}

/// Header flags: message type in the low 4 bits.
pub(crate) const FLAG_TYPE_MASK: u32 = 0xf;
/// Type: a command.
pub(crate) const FLAG_TYPE_COMMAND: u32 = 0;
/// Type: a reply.
pub(crate) const FLAG_TYPE_REPLY: u32 = 1;
/// The reply reports an error; `error` holds an errno.
pub(crate) const FLAG_ERROR: u32 = 1 << 5;

/// DMA_MAP flags: the server may read / write the region.
pub(crate) const DMA_READ: u32 = 1 << 0;
/// See [`DMA_READ`].
pub(crate) const DMA_WRITE: u32 = 1 << 1;

/// The header every message starts with.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct Header {
    /// Matches a reply to its command.
    pub message_id: u16,
    /// [`Command`].
    pub command: u16,
    /// Whole message, header included.
    pub message_size: u32,
    /// `FLAG_*`.
    pub flags: u32,
    /// errno, when `flags` has [`FLAG_ERROR`].
    pub error: u32,
}

/// Size of [`Header`] on the wire.
pub(crate) const HEADER_SIZE: usize = size_of::<Header>();

/// VFIO_USER_VERSION payload; a NUL-terminated JSON capabilities string follows.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct Version {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
}

/// VFIO_USER_DMA_MAP payload (the region's fd travels as SCM_RIGHTS).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct DmaMap {
    /// Size of this structure.
    pub argsz: u32,
    /// [`DMA_READ`] | [`DMA_WRITE`].
    pub flags: u32,
    /// Offset of the region in the fd.
    pub offset: u64,
    /// Device (DMA) address of the region.
    pub address: u64,
    /// Length in bytes.
    pub size: u64,
}

/// VFIO_USER_DMA_UNMAP payload (and reply).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct DmaUnmap {
    /// Size of this structure.
    pub argsz: u32,
    /// 0: no dirty bitmap, not "unmap all".
    pub flags: u32,
    /// Device address of the region, as mapped.
    pub address: u64,
    /// Length, as mapped.
    pub size: u64,
}

/// VFIO_USER_DEVICE_GET_INFO payload (and reply): the first four fields of the kernel's
/// `vfio_device_info`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct DeviceInfo {
    /// Size of this structure.
    pub argsz: u32,
    /// `VFIO_DEVICE_FLAGS_*`.
    pub flags: u32,
    /// Number of regions.
    pub num_regions: u32,
    /// Number of interrupt types.
    pub num_irqs: u32,
}

/// VFIO_USER_DEVICE_GET_REGION_INFO payload: the kernel's `vfio_region_info` (the reply adds
/// capabilities after it, `cap_offset` counting from this structure's start).
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct RegionInfoRequest {
    /// Room the client offers for the reply (structure plus capabilities).
    pub argsz: u32,
    /// Filled by the server.
    pub flags: u32,
    /// Region index.
    pub index: u32,
    /// Filled by the server.
    pub cap_offset: u32,
    /// Filled by the server.
    pub size: u64,
    /// Filled by the server: offset for mmap in the fd passed with the reply.
    pub offset: u64,
}

/// VFIO_USER_DEVICE_GET_IRQ_INFO payload (and reply): the kernel's `vfio_irq_info`.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct IrqInfo {
    /// Size of this structure.
    pub argsz: u32,
    /// Filled by the server: `VFIO_IRQ_INFO_*`.
    pub flags: u32,
    /// Interrupt type: `VFIO_PCI_INTX_IRQ_INDEX`, `..._MSI_...`, `..._MSIX_...`, ...
    pub index: u32,
    /// Filled by the server: vectors of that type.
    pub count: u32,
}

/// VFIO_USER_REGION_READ / _WRITE payload; written data follows a write, read data a read's
/// reply.
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub(crate) struct RegionAccess {
    /// Offset in the region.
    pub offset: u64,
    /// Region index.
    pub region: u32,
    /// Bytes.
    pub count: u32,
}

/// The capabilities this client announces in VFIO_USER_VERSION.
pub(crate) fn client_capabilities() -> String {
    format!("{{\"capabilities\":{{\"max_msg_fds\":8,\"max_data_xfer_size\":{MAX_DATA_XFER}}}}}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;
    use vfio_bindings::bindings::vfio as b;

    #[test]
    fn sizes_match_the_specification() {
        assert_eq!(HEADER_SIZE, 16);
        assert_eq!(size_of::<Version>(), 4);
        assert_eq!(size_of::<DmaMap>(), 32);
        assert_eq!(size_of::<DmaUnmap>(), 24);
        // The kernel's vfio_device_info has grown a cap_offset since; vfio-user's has not.
        assert_eq!(size_of::<DeviceInfo>(), 16);
        assert_eq!(size_of::<RegionAccess>(), 16);
        assert_eq!(size_of::<IrqInfo>(), size_of::<b::vfio_irq_info>());
        assert_eq!(
            size_of::<RegionInfoRequest>(),
            size_of::<b::vfio_region_info>()
        );
        assert_eq!(
            offset_of!(RegionInfoRequest, cap_offset),
            offset_of!(b::vfio_region_info, cap_offset)
        );
        assert_eq!(
            offset_of!(RegionInfoRequest, offset),
            offset_of!(b::vfio_region_info, offset)
        );
    }

    #[test]
    fn capabilities_are_json() {
        let s = client_capabilities();
        assert!(s.starts_with("{\"capabilities\":{"));
        assert!(s.contains("\"max_data_xfer_size\":1048576"));
        assert_eq!(s.matches('{').count(), s.matches('}').count());
    }
}
