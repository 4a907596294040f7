//! A strict software NVMe controller: the test device and embedded default of gpunvme.
//!
//! Layer: a transport. [`EmuDevice`] implements [`nvme::Device`], so the driver runs over it
//! exactly as over VFIO: through a register window (BAR0) and DMA memory, nothing else. It
//! implements the parts of NVM Express Base Specification 2.0 / NVM Command Set 1.0 that a
//! driver for one PCIe controller uses, and reports version 1.4 (VS = 0x00010400).
//!
//! # Architecture
//! - `registers` (private): BAR0 as atomics. Doorbell writes are validated
//!   as they land; CC and doorbell writes wake the controller thread.
//! - [`memory`]: the device-address map. Every SQE fetch, PRP-list read, data transfer and CQE
//!   write is a DMA through it, to a [`MemoryRegion`]; unmapped addresses are DMA errors, never
//!   shortcuts. [`DeviceAddressMap::register_region`] lets other memory (GPU regions) be
//!   served later.
//! - `host_memory` (private, the only `unsafe` module): page-aligned host allocations behind
//!   [`nvme::Device::alloc_dma`]; dropping the `DmaMemory` unmaps before it frees.
//! - `controller` (private): one thread; the CC state machine, round-robin fetch with a batch
//!   limit per queue, the admin and NVM command sets, completions with the phase tag written
//!   last, asynchronous events, the Error Information and SMART logs.
//! - [`Faults`]: media errors on chosen LBAs, slow and dropped completions, controller fatal.
//!
//! # Behaviour worth knowing
//! - CAP: MQES from the config, CQR = 1, TO = 2 (1 s), DSTRD = 0, CSS = NVM, MPSMIN = MPSMAX
//!   = 0 (4 KiB pages), no subsystem reset. The register window is 16 KiB or larger, enough for
//!   the doorbells of every queue.
//! - Enabling with CC.CSS, CC.MPS or CC.AMS other than 0, CC.IOSQES/IOCQES other than 6/4 (or 0,
//!   meaning "set later"), an admin queue of fewer than 2 entries or an unaligned ASQ/ACQ sets
//!   CSTS.CFS. So does any DMA error on queue memory (SQ fetch, CQE write). Creating an I/O
//!   queue requires IOSQES = 6 / IOCQES = 4 at that point (else Invalid Field in Command).
//! - A doorbell write to a queue that does not exist, or with a value not below the queue size,
//!   or a CQ head that passes entries not yet posted, is ignored and recorded: an Error
//!   Information log entry (SQID/CID 0xffff) and an Error status asynchronous event (Write to
//!   Invalid Doorbell Register, or Invalid Doorbell Write Value). Events of that type are then
//!   masked until the host reads the Error Information log without RAE.
//! - Commands are fetched from a queue only as far as its completion queue has room, so a full
//!   completion queue holds completions back until the host moves the CQ head; nothing is ever
//!   overwritten.
//! - Every failed command gets an Error Information log entry and More set in its status; Do
//!   Not Retry is set except for Data Transfer Error and aborts.
//! - Deallocated blocks (Dataset Management, Write Zeroes) read as zeroes (DLFEAT = 001b).
//!   Flush, FUA writes, and every write while the volatile write cache is disabled reach the
//!   file with `fdatasync` on a file backend.
//! - MDTS 0 ("no limit") applies to I/O commands; admin data transfers (Get Log Page) are
//!   limited to 2 MiB regardless.
//! - Interrupts are never raised (there are no interrupt vectors to raise; IEN is accepted,
//!   vectors other than 0 are Invalid Interrupt Vector). Hosts poll.
//!
//! # Not implemented
//! SGLs (PSDT must be 0), fused operations, metadata and protection information, multiple LBA
//! formats, Format NVM, firmware download/commit, namespace management, directives, reservations,
//! Keep Alive, the controller memory buffer, NVM subsystem reset, weighted round robin
//! arbitration, and per-namespace SMART data.
//!
//! # Key constants
//! Device addresses start at [`memory::DEVICE_ADDRESS_BASE`] (4 GiB; 0 is never valid) and each
//! region is followed by an unmapped [`memory::GUARD_GAP`]. At most 64 commands are fetched
//! from one queue per pass. The idle thread parks for at most 1 ms.

pub mod config;
mod controller;
mod device;
pub mod error;
pub mod faults;
mod host_memory;
pub mod memory;
mod prp;
mod queues;
mod registers;
pub mod stats;
mod storage;

pub use config::{Backend, EmuConfig, NamespaceConfig};
pub use device::EmuDevice;
pub use error::EmuError;
pub use faults::{DROP_ALL, Faults};
pub use memory::{DeviceAddressMap, DmaError, MemoryRegion, RegionError};
pub use stats::EmuStats;
