//! The one unsafe step of serving a VFIO function: making an arena's shared memory reachable by
//! the device through the IOMMU (`VFIO_IOMMU_MAP_DMA` of this process's mapping).
// UNSAFETY: VfioNvme::map_external is unsafe (the memory must stay mapped until the mapping is
// dropped); this module holds the one call and the reason it is sound.
#![expect(unsafe_code)]

use std::sync::Arc;

use gpunvme_serve_shm::SharedMemory;

/// `mem` mapped for the device behind `dev`, to be dropped before `mem` (see [`Mapped`]).
pub(crate) struct Mapped {
    /// Dropped first: the device's access is revoked while `_mem` still holds the pages.
    mapping: Option<vfio::ExternalMapping>,
    _mem: Arc<SharedMemory>,
}

impl Mapped {
    /// Maps the whole of `mem` (page-aligned, whole pages: a `SharedMemory` always is).
    pub(crate) fn new(dev: &vfio::VfioNvme, mem: Arc<SharedMemory>) -> Result<Self, vfio::Error> {
        // SAFETY: `mem`'s mapping covers `as_mut_ptr()..+len()` for as long as `mem` lives, and
        // this value keeps an `Arc` of it until after `mapping` is dropped (its Drop below):
        // the device's access ends before the pages can be unmapped. The memory is an arena
        // lent for DMA, so it holds nothing the device must not touch.
        let mapping = unsafe { dev.map_external(mem.as_mut_ptr(), mem.len()) }?;
        Ok(Self {
            mapping: Some(mapping),
            _mem: mem,
        })
    }

    /// Where the device reaches the first byte.
    pub(crate) fn device_address(&self) -> u64 {
        self.mapping.as_ref().map_or(0, |m| m.device_address(0))
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        drop(self.mapping.take());
    }
}
