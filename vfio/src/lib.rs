//! VFIO transport for the NVMe driver (layer: transport, below `nvme`).
//!
//! Opens a PCI NVMe controller bound to `vfio-pci` and implements [`nvme::Device`] for it:
//! BAR0 as the register window, and DMA memory the controller reaches through the IOMMU.
//! Speaks the Linux VFIO user API (`<linux/vfio.h>`, API version 0) through vfio-bindings'
//! structures and its own thin ioctl wrappers; see
//! <https://docs.kernel.org/driver-api/vfio.html>.
//!
//! # Architecture
//! - [`sysfs`]: read-only checks before anything is opened (address exists, class NVMe, bound to
//!   vfio-pci, IOMMU group viable, group file present), each failure a one-line error that says
//!   what to do.
//! - `container`: the legacy container/group API with the type1 IOMMU (TYPE1v2 preferred), or
//!   the no-IOMMU model when only `/dev/vfio/noiommu-N` exists.
//! - `device`: device and region info, configuration space (Memory Space and Bus Master are set
//!   by us; VFIO leaves them off), function reset.
//! - `mmio`: BAR0 mmapped, volatile 32-bit accesses, pread/pwrite for areas that cannot be
//!   mmapped.
//! - `dma`: 2 MiB chunks (hugepages when available) mapped once each, small buffers carved out
//!   of them; IOVAs from the ranges `VFIO_IOMMU_GET_INFO` reports (`iova`), physical addresses
//!   from `/proc/self/pagemap` in no-IOMMU mode (`pagemap`).
//! - `sys` and `caps`: the raw ioctls and the decoding of their capability chains.
//! - [`VfioNvme::map_external`]: memory allocated elsewhere (a GPU BAR mapping, say) mapped
//!   into the same container (type1 only); [`ExternalMapping::into_region`] turns the mapping
//!   into an [`nvme::DmaRegion`] (device addresses plus the mapping as owner), on which
//!   `nvme::Controller::create_queue_pair_on` can create queues.
//!
//! - [`user`]: the same driver seam over vfio-user, a VFIO-like protocol on a Unix socket, for
//!   controllers served by another process (SPDK's NVMe-oF target): [`VfioUserNvme`].
//!
//! `examples/vfio_probe.rs` exercises all of it on a real device: BAR0 registers, DMA buffers,
//! and an Identify Controller through a hand-built admin queue.
//!
//! Unsafe code lives only in `sys` (ioctls), `mmio` (volatile MMIO) and `dma` (wrapping mapped
//! memory as [`nvme::DmaMemory`]); `user` has
//! none (it implements the mapper's unsafe `map`, performing no unsafe operation).
//!
//! # Why not vfio-ioctls
//! vfio-ioctls (0.10, default features off) was weighed for the container, group and device
//! calls and left out: it drives only TYPE1v2 containers, so the no-IOMMU mode would need a
//! second implementation beside it; its `region_read`/`region_write` swallow errors, which
//! would hide a failed config-space access; and its `Drop` panics on errors, where a device
//! that misbehaves while we let go of it must not bring the process down. One thin wrapper over
//! vfio-bindings' structures serves both modes with typed errors (notes from reading its source:
//! `shared/design/crates.md`).
//!
//! # Not implemented
//! - iommufd and VFIO cdev (`/dev/iommu`, `/dev/vfio/devices/*`): the legacy API is what every
//!   kernel with VFIO offers, including iommufd's compatibility container.
//! - Interrupts (the driver polls), hot reset of multi-function slots, several devices sharing
//!   one group or container (each [`VfioNvme`] opens its own group; a second open of the same
//!   group reports it busy).
//! - Mapping foreign memory in no-IOMMU mode ([`VfioNvme::map_external`] needs type1).
//!
//! # Key constants
//! - [`dma::CHUNK_SIZE`] = 2 MiB: hugepage size and unit of IOMMU mapping.
//! - [`dma::DEDICATED_ABOVE`] = 1 MiB: larger buffers get a chunk of their own.
//! - [`sysfs::NVME_CLASS`] = 0x010802.

mod caps;
mod container;
mod device;
pub mod dma;
mod error;
mod iova;
mod mmio;
mod pagemap;
mod pci;
mod sys;
pub mod sysfs;
pub mod user;
mod vfio_nvme;

pub use caps::{IommuInfo, RegionInfo};
pub use dma::{DmaStats, ExternalMapping};
pub use error::{Error, GroupMember};
pub use iova::IovaAllocator;
pub use mmio::Bar;
pub use pci::{PciAddress, looks_like_pci_address};
pub use sysfs::{Preflight, SysRoots, preflight};
pub use user::{VfioUserNvme, VfioUserOptions};
pub use vfio_nvme::{VfioNvme, VfioOptions};

use std::fmt;

/// How the device's DMA addresses are produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IommuMode {
    /// Through the type1 IOMMU: IOVAs this crate allocates and maps.
    Type1,
    /// Without an IOMMU (`enable_unsafe_noiommu_mode`): physical addresses of locked memory.
    NoIommu,
}

impl fmt::Display for IommuMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IommuMode::Type1 => "type1 IOMMU",
            IommuMode::NoIommu => "no-IOMMU",
        })
    }
}
