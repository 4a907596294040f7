//! [`VfioNvme`]: an NVMe controller reached through VFIO, as an [`nvme::Device`].
#![forbid(unsafe_code)]

use std::sync::Arc;

use vfio_bindings::bindings::vfio as b;

use crate::container::Container;
use crate::device::VfioDevice;
use crate::dma::{DmaPool, DmaStats, NoIommuMapper, Type1Mapper};
use crate::iova::IovaAllocator;
use crate::mmio::{Bar, BarError, FilePort};
use crate::pagemap::Pagemap;
use crate::sysfs::{self, SysRoots};
use crate::{Error, IommuMode, PciAddress, sys};

/// Smallest BAR0 that holds the NVMe registers (0x0..0x1000) and one pair of doorbells.
const MIN_BAR0: u64 = 0x1000 + 8;

/// IOVAs below this are never used: 0 reads as "no address" in PRP entries and in dumps.
const IOVA_FLOOR: u64 = 2 << 20;

/// IOVA space assumed when the kernel does not report usable ranges (before Linux 5.4): the
/// 39-bit space every VT-d and AMD-Vi implementation supports, minus the x86 MSI window.
const DEFAULT_IOVA_RANGES: &[(u64, u64)] = &[(0, 0xfedf_ffff), (0xfef0_0000, (1 << 39) - 1)];

/// How to open a controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VfioOptions {
    /// Back DMA memory with 2 MiB hugepages when any are free (default true); otherwise, or when
    /// none are free, 4 KiB pages.
    pub prefer_hugepages: bool,
    /// Issue a function-level reset on open if the device supports one (default true).
    pub reset: bool,
}

impl Default for VfioOptions {
    fn default() -> Self {
        Self {
            prefer_hugepages: true,
            reset: true,
        }
    }
}

/// An NVMe controller bound to vfio-pci, with BAR0 mapped and DMA memory available.
///
/// Dropping it closes the device file, which makes vfio-pci reset the function and clear Bus
/// Master; DMA buffers still alive keep their IOMMU mappings (and the container) until dropped.
pub struct VfioNvme {
    addr: PciAddress,
    group: u32,
    mode: IommuMode,
    bar: Bar,
    dma: DmaPool,
    _device: VfioDevice,
}

impl std::fmt::Debug for VfioNvme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioNvme")
            .field("addr", &self.addr)
            .field("group", &self.group)
            .field("mode", &self.mode)
            .field("bar", &self.bar)
            .finish()
    }
}

impl VfioNvme {
    /// Opens the NVMe controller at `addr`.
    ///
    /// First checks, reading only sysfs and `/dev`, that the function exists, is an NVMe
    /// controller, is bound to vfio-pci and sits in a viable IOMMU group ([`crate::preflight`]);
    /// nothing is opened before these pass. Then attaches the group to a container (type1, or
    /// no-IOMMU if only `/dev/vfio/noiommu-N` exists), opens the device, resets it (if
    /// `opts.reset` and supported), sets Memory Space and Bus Master Enable, and maps BAR0.
    pub fn open(addr: &PciAddress, opts: &VfioOptions) -> Result<Arc<Self>, Error> {
        Self::open_at(addr, opts, &SysRoots::default())
    }

    /// [`VfioNvme::open`] with sysfs and `/dev` at other places (for tests and containers).
    pub fn open_at(
        addr: &PciAddress,
        opts: &VfioOptions,
        roots: &SysRoots,
    ) -> Result<Arc<Self>, Error> {
        let pre = sysfs::preflight(roots, addr)?;
        tracing::debug!(%addr, group = pre.group, mode = %pre.mode, "opening VFIO group");
        let container = Arc::new(Container::open(&pre, roots)?);
        let device = VfioDevice::new(*addr, container.open_device(addr)?)?;

        if opts.reset {
            if device.can_reset() {
                device.reset()?;
            } else {
                tracing::info!(%addr, "function reset not supported; continuing without it");
            }
        }
        device.enable_memory_and_bus_master()?;

        let region = device.region(b::VFIO_PCI_BAR0_REGION_INDEX)?;
        if region.size < MIN_BAR0 || !region.readable() || !region.writable() {
            return Err(Error::Bar0 {
                addr: *addr,
                reason: format!(
                    "size 0x{:x}, flags 0x{:x} (need a readable and writable BAR of at least 0x{MIN_BAR0:x} bytes)",
                    region.size, region.flags
                ),
            });
        }
        let port = Box::new(FilePort {
            file: Arc::clone(device.file()),
            region_offset: region.offset,
        });
        let bar =
            Bar::map(addr.to_string(), Some(device.file()), &region, port).map_err(
                |e| match e {
                    BarError::Layout(reason) => Error::Bar0 {
                        addr: *addr,
                        reason,
                    },
                    BarError::Map(source) => Error::MapBar {
                        addr: *addr,
                        source,
                    },
                },
            )?;

        let dma = match pre.mode {
            IommuMode::Type1 => {
                let info = container.iommu_info()?;
                let ranges = info
                    .iova_ranges
                    .clone()
                    .unwrap_or_else(|| DEFAULT_IOVA_RANGES.to_vec());
                tracing::debug!(
                    pgsizes = format_args!("0x{:x}", info.iova_pgsizes),
                    ?ranges,
                    dma_avail = ?info.dma_avail,
                    "type1 IOMMU"
                );
                let iova = IovaAllocator::new(&ranges, IOVA_FLOOR);
                DmaPool::new(
                    Box::new(Type1Mapper::new(Arc::clone(&container), iova)),
                    opts.prefer_hugepages,
                )
            }
            IommuMode::NoIommu => {
                tracing::warn!(%addr, "no-IOMMU mode: the device can DMA anywhere in memory");
                let pagemap = Pagemap::open(sys::host_page_size())?;
                DmaPool::new(
                    Box::new(NoIommuMapper::new(Arc::clone(&container), pagemap)),
                    opts.prefer_hugepages,
                )
            }
        };
        tracing::info!(%addr, mode = %pre.mode, bar0_bytes = region.size, "VFIO device open");
        Ok(Arc::new(Self {
            addr: *addr,
            group: pre.group,
            mode: pre.mode,
            bar,
            dma,
            _device: device,
        }))
    }

    /// The controller's PCI address.
    pub fn address(&self) -> PciAddress {
        self.addr
    }

    /// Its IOMMU group number.
    pub fn iommu_group(&self) -> u32 {
        self.group
    }

    /// How DMA addresses are produced.
    pub fn iommu_mode(&self) -> IommuMode {
        self.mode
    }

    /// The mapped BAR0, for register access outside the driver (e.g. registering the doorbells
    /// with a GPU). `None` when the kernel does not let one mmap cover the whole BAR.
    pub fn bar0_mapping(&self) -> Option<(std::ptr::NonNull<u8>, usize)> {
        self.bar.whole_mapping()
    }

    /// The DMA pool (for `dma`'s external mappings).
    pub(crate) fn dma_pool(&self) -> &DmaPool {
        &self.dma
    }

    /// DMA memory counters: mappings, bytes, hugepage bytes, live buffers.
    pub fn dma_stats(&self) -> DmaStats {
        self.dma.stats()
    }
}

impl nvme::Device for VfioNvme {
    fn registers(&self) -> &dyn nvme::RegisterIo {
        &self.bar
    }

    fn write_doorbell(&self, offset: usize, value: u32) {
        nvme::RegisterIo::write_u32(&self.bar, offset, value);
    }

    fn alloc_dma(&self, len: usize) -> Result<nvme::DmaMemory, nvme::DmaAllocError> {
        self.dma.alloc(len).map_err(|e| e.into_dma_alloc_error(len))
    }

    fn describe(&self) -> String {
        format!("vfio {} ({})", self.addr, self.mode)
    }
}
