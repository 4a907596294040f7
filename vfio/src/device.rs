//! A PCI function opened through VFIO: device info, region info, configuration space and
//! function reset.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use vfio_bindings::bindings::vfio as b;

use crate::caps::{self, RegionInfo};
use crate::{Error, PciAddress, sys};

/// Offset of the PCI command register in configuration space.
pub const PCI_COMMAND: u64 = 0x04;
/// Command register: respond to memory-space accesses (BARs).
pub const PCI_COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: the function may master the bus (issue DMA).
pub const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// Offset of the vendor ID in configuration space.
pub const PCI_VENDOR_ID: u64 = 0x00;

/// A VFIO device file for one PCI function.
#[derive(Debug)]
pub(crate) struct VfioDevice {
    addr: PciAddress,
    file: Arc<File>,
    flags: u32,
    num_regions: u32,
    config: RegionInfo,
}

impl VfioDevice {
    /// Wraps the device file returned by `VFIO_GROUP_GET_DEVICE_FD` and checks that VFIO sees a
    /// PCI device with a configuration region.
    pub(crate) fn new(addr: PciAddress, file: File) -> Result<Self, Error> {
        let info = sys::device_get_info(file.as_fd()).map_err(|source| Error::Ioctl {
            op: "VFIO_DEVICE_GET_INFO",
            source,
        })?;
        if info.flags & b::VFIO_DEVICE_FLAGS_PCI == 0
            || info.num_regions <= b::VFIO_PCI_CONFIG_REGION_INDEX
        {
            return Err(Error::NotPciDevice {
                addr,
                flags: info.flags,
            });
        }
        let file = Arc::new(file);
        let config = region_info(&file, b::VFIO_PCI_CONFIG_REGION_INDEX)?;
        Ok(Self {
            addr,
            file,
            flags: info.flags,
            num_regions: info.num_regions,
            config,
        })
    }

    /// The device file (shared with BAR mappings, which use it for pread fallbacks).
    pub(crate) fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// Information about region `index` (`VFIO_PCI_BAR0_REGION_INDEX`, ...).
    pub(crate) fn region(&self, index: u32) -> Result<RegionInfo, Error> {
        if index >= self.num_regions {
            return Err(Error::Ioctl {
                op: "VFIO_DEVICE_GET_REGION_INFO",
                source: io::Error::other(format!(
                    "region {index} of {} does not exist",
                    self.num_regions
                )),
            });
        }
        region_info(&self.file, index)
    }

    /// Reads a 16-bit configuration-space register.
    pub(crate) fn config_read_u16(&self, offset: u64) -> Result<u16, Error> {
        let mut buf = [0u8; 2];
        self.file
            .read_exact_at(&mut buf, self.config.offset + offset)
            .map_err(|source| Error::ConfigSpace {
                op: "read",
                offset,
                source,
            })?;
        Ok(u16::from_le_bytes(buf))
    }

    /// Writes a 16-bit configuration-space register.
    pub(crate) fn config_write_u16(&self, offset: u64, value: u16) -> Result<(), Error> {
        self.file
            .write_all_at(&value.to_le_bytes(), self.config.offset + offset)
            .map_err(|source| Error::ConfigSpace {
                op: "write",
                offset,
                source,
            })
    }

    /// Sets Memory Space Enable and Bus Master Enable in the command register, as the function
    /// needs to decode its BAR and to DMA; VFIO leaves both to userspace.
    pub(crate) fn enable_memory_and_bus_master(&self) -> Result<(), Error> {
        let vendor = self.config_read_u16(PCI_VENDOR_ID)?;
        if vendor == 0xffff {
            return Err(Error::ConfigSpace {
                op: "read",
                offset: PCI_VENDOR_ID,
                source: io::Error::other(format!("{} reads as all-ones: device gone", self.addr)),
            });
        }
        let cmd = self.config_read_u16(PCI_COMMAND)?;
        let want = cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
        if cmd != want {
            self.config_write_u16(PCI_COMMAND, want)?;
        }
        let now = self.config_read_u16(PCI_COMMAND)?;
        if now & (PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)
            != PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER
        {
            return Err(Error::ConfigSpace {
                op: "write",
                offset: PCI_COMMAND,
                source: io::Error::other(format!(
                    "command register reads 0x{now:04x} after setting Memory Space and Bus Master"
                )),
            });
        }
        tracing::debug!(addr = %self.addr, before = cmd, after = now, "PCI command register");
        Ok(())
    }

    /// Whether VFIO can reset this function.
    pub(crate) fn can_reset(&self) -> bool {
        self.flags & b::VFIO_DEVICE_FLAGS_RESET != 0
    }

    /// Function-level reset (`VFIO_DEVICE_RESET`).
    pub(crate) fn reset(&self) -> Result<(), Error> {
        sys::device_reset(self.file.as_fd()).map_err(|source| Error::Reset {
            addr: self.addr,
            source,
        })
    }
}

fn region_info(file: &File, index: u32) -> Result<RegionInfo, Error> {
    let op = "VFIO_DEVICE_GET_REGION_INFO";
    let bytes = sys::device_get_region_info(file.as_fd(), index)
        .map_err(|source| Error::Ioctl { op, source })?;
    caps::parse_region_info(&bytes).map_err(|source| Error::Ioctl { op, source })
}
