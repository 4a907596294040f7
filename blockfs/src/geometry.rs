//! File system geometry: the sizes fixed at mkfs plus the device's LBA size, and the check that
//! a device can hold a blockfs of a given block size.

use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::format::{MAX_BLOCK_SIZE, MAX_LBA_SIZE, MIN_BLOCK_SIZE, reserved_blocks};

/// Sizes fixed at mkfs, plus the device's LBA size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// File system block size in bytes.
    pub block_size: u32,
    /// Device LBA size in bytes.
    pub lba_size: u32,
    /// LBA size the file system was made with.
    pub mkfs_lba_size: u32,
    /// Blocks in the file system.
    pub block_count: u64,
    /// File system UUID.
    pub uuid: [u8; 16],
}

impl Geometry {
    /// Device LBAs per file system block.
    pub fn lbas_per_block(&self) -> u64 {
        (self.block_size / self.lba_size) as u64
    }

    /// Blocks reserved for the superblock slots.
    pub fn reserved_blocks(&self) -> u64 {
        reserved_blocks(self.block_size)
    }

    /// Device LBA of block `bno`.
    pub fn lba(&self, bno: u64) -> u64 {
        bno * self.lbas_per_block()
    }
}

/// Checks the device's LBA size and computes the block count for a block size.
pub(crate) fn check_device(dev: &dyn BlockDevice, block_size: u32) -> Result<(u32, u64)> {
    let lba = dev.lba_size();
    if !lba.is_power_of_two() || !(512..=MAX_LBA_SIZE).contains(&lba) {
        return Err(Error::Geometry(format!(
            "LBA size {lba} (blockfs needs a power of two from 512 to {MAX_LBA_SIZE})"
        )));
    }
    if !block_size.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) {
        return Err(Error::Geometry(format!(
            "block size {block_size} (must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE})"
        )));
    }
    let bytes = dev.lba_count().saturating_mul(lba as u64);
    Ok((lba, bytes / block_size as u64))
}
