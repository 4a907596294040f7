//! The seam between the driver and whatever carries its bytes: a register window and DMA memory.
//!
//! The driver never touches hardware any other way. VFIO (`vfio` crate), the software controller
//! (`nvme_emu`) and, later, GPU-memory queues are implementations of these two interfaces, so the
//! same bring-up, admin and I/O code runs over each of them.

use crate::dma::DmaMemory;

/// A window of device registers (an NVMe controller's BAR0), accessed with MMIO semantics.
///
/// Implementations use volatile accesses of exactly the requested width; the driver asks only
/// for naturally aligned offsets inside [`RegisterIo::len`]. 64-bit registers are accessed as two
/// 32-bit halves, low dword first, which the NVMe specification permits for every register the
/// driver touches (CAP, ASQ, ACQ) and which every controller must accept.
pub trait RegisterIo: Send + Sync {
    /// Size of the window in bytes.
    fn len(&self) -> usize;

    /// Whether the window is empty (never true for a usable controller).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Reads the 32-bit register at `offset` (4-byte aligned, inside the window).
    fn read_u32(&self, offset: usize) -> u32;

    /// Writes the 32-bit register at `offset` (4-byte aligned, inside the window).
    fn write_u32(&self, offset: usize, value: u32);

    /// Reads a 64-bit register as two 32-bit reads, low half first.
    fn read_u64(&self, offset: usize) -> u64 {
        let lo = self.read_u32(offset) as u64;
        let hi = self.read_u32(offset + 4) as u64;
        lo | (hi << 32)
    }

    /// Writes a 64-bit register as two 32-bit writes, low half first.
    fn write_u64(&self, offset: usize, value: u64) {
        self.write_u32(offset, value as u32);
        self.write_u32(offset + 4, (value >> 32) as u32);
    }
}

/// Why a transport could not provide DMA memory.
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate {len} bytes of DMA memory: {reason}")]
pub struct DmaAllocError {
    /// Bytes asked for.
    pub len: usize,
    /// What the transport said, in words a user can act on.
    pub reason: String,
    /// The underlying error, if any.
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// A controller the driver can reach: its registers plus a source of DMA memory.
///
/// Implemented by `vfio::VfioNvme` (a real PCI function) and `nvme_emu::EmuDevice` (the
/// software controller).
pub trait Device: Send + Sync {
    /// The controller's register window (BAR0).
    fn registers(&self) -> &dyn RegisterIo;

    /// Writes a doorbell register (`offset` at or past 0x1000 in the window). The same as
    /// `self.registers().write_u32(offset, value)`, which is what it does unless a transport
    /// overrides it: the queue pairs ring doorbells through here, once per batch and per reap
    /// round, and an override saves the second dynamic call (and lets the register write be
    /// inlined into it).
    fn write_doorbell(&self, offset: usize, value: u32) {
        self.registers().write_u32(offset, value);
    }

    /// Allocates `len` bytes (rounded up to whole 4 KiB pages) of zeroed memory that the
    /// controller can read and write, with a device address for every page.
    fn alloc_dma(&self, len: usize) -> Result<DmaMemory, DmaAllocError>;

    /// One line for humans: which transport and which device ("software controller over
    /// ./gpunvme.img", "vfio 0000:01:00.0 (type1 IOMMU)").
    fn describe(&self) -> String;
}
