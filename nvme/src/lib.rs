//! Userspace NVMe driver core (layer: controller/queues).
//!
//! Reaches the controller only through [`device::Device`]: a register window and DMA memory.
pub mod device;
pub mod dma;

pub use device::{Device, DmaAllocError, RegisterIo};
pub use dma::{DMA_PAGE_SIZE, DmaMemory, DmaOwner};
