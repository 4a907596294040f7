//! A strict software NVMe controller: the test device and embedded default of gpunvme.
//!
//! Layer: a transport. [`EmuDevice`] implements [`nvme::Device`], so the driver runs over it
//! exactly as over VFIO: through a register window (BAR0) and DMA memory, nothing else. It
//! implements the parts of NVM Express Base Specification 2.0 / NVM Command Set 1.0 that a
//! driver for one PCIe controller uses, and reports version 1.4 (VS = 0x00010400).
//!
//! # Architecture
//! - `registers` (private): BAR0 as atomics. Doorbell writes are validated
//!   as they land; CC writes wake controller thread 0, doorbell writes the queue's thread.
//! - `doorbells` (private, exports [`DoorbellWord`]): external doorbells, 32-bit words outside
//!   the register window (a pinned host page GPU threads write) attached to an I/O queue id
//!   with [`EmuDevice::attach_external_doorbells`] before the queues are created; those queues
//!   take their SQ tail and CQ head from the words, which the controller polls.
//! - [`memory`]: the device-address map. Every SQE fetch, PRP-list read, data transfer and CQE
//!   write is a DMA through it, to a [`MemoryRegion`]; unmapped addresses are DMA errors, never
//!   shortcuts. [`DeviceAddressMap::register_region`] lets other memory (GPU regions) be
//!   served. A region may defer its writes until [`MemoryRegion::flush`], which each controller
//!   thread calls on every region it wrote through at the end of each batch of commands (after
//!   the batch's completions) and before it goes idle. [`MemoryRegion::prefetch`] announces,
//!   per batch, the PRP list pages and write data the batch will read, so such a region can
//!   fetch them in one transfer.
//! - `host_memory` (private, the only `unsafe` module): page-aligned host allocations behind
//!   [`nvme::Device::alloc_dma`]; dropping the `DmaMemory` unmaps before it frees.
//! - `controller` (private): [`EmuConfig::controller_threads`] threads. Thread 0 runs the CC
//!   state machine, the admin command set, asynchronous events and the logs; every thread
//!   (thread 0 included) serves a share of the I/O queues: completion queue `cqid`, with every
//!   submission queue posting to it, belongs to thread `(cqid - 1) % n`
//!   ([`EmuDevice::thread_for_cq`]). Queues are handed to and taken from their thread by the
//!   admin commands, which wait for the handoff. Each thread fetches round robin with a batch
//!   limit per queue (64, or [`EmuConfig::external_batch`] for queues with external
//!   doorbells) and posts completions with the phase tag written last.
//!   [`controller_thread_index`] tells a memory region which controller thread calls it.
//! - `storage` (private): namespace media, shared by the threads: files with positioned I/O,
//!   memory in 2 MiB stripes behind reader-writer locks.
//! - [`queue_server`]: a [`QueueServer`] installed with [`EmuDevice::set_queue_server`] takes
//!   every I/O queue created afterwards (after the controller's checks of the Create command):
//!   the GPU-resident controller model serves queues in GPU memory this way.
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
//! - External doorbells: a queue created while its id has words attached reads its SQ tail or
//!   CQ head only from its word, from creation until deletion or controller reset (which
//!   forget the queue; the attachment stays until detached). The host zeroes the words before
//!   creating the queues: a nonzero value found at creation is reported (below) and ignored
//!   until the word changes. Each new value is validated as a register-window write is: one
//!   not below the queue size, or a CQ head passing entries not yet posted, is ignored and
//!   reported with an Error Information log entry and an Invalid Doorbell Write Value event,
//!   once per distinct value. Writes to such a queue's register-window doorbells are refused
//!   as writes to an invalid doorbell register. While such a queue exists the controller
//!   thread serving it never parks (nothing could wake it): it polls, yielding its CPU now and
//!   then. Other threads park when idle.
//! - A region's flush error is controller fatal (CSTS.CFS), whatever the writes were: the
//!   completions of the commands may be among them, so a Data Transfer Error can no longer be
//!   posted instead.
//! - Commands are fetched from a queue only as far as its completion queue has room, so a full
//!   completion queue holds completions back until the host moves the CQ head; nothing is ever
//!   overwritten.
//! - Every failed command gets an Error Information log entry and More set in its status; Do
//!   Not Retry is set except for Data Transfer Error and aborts.
//! - An image file is locked with `flock(2)` while the controller runs (`lock`, private):
//!   exclusively for a writable namespace, shared for a [`NamespaceConfig::read_only`] one,
//!   which is opened read-only; a conflicting start fails with [`EmuError::ImageBusy`] naming
//!   the holder's pid when `/proc/locks` shows it. A read-only namespace reports NSATTR bit 0
//!   and fails Write, Write Zeroes and deallocating Dataset Management with Namespace Is Write
//!   Protected.
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
//! from one queue per pass (at most [`EmuConfig::external_batch`], default 256, up to
//! [`config::MAX_EXTERNAL_BATCH`], for queues with external doorbells). An idle thread parks
//! for at most 1 ms, and not at all while it serves a queue with external doorbells. At most
//! [`config::MAX_CONTROLLER_THREADS`] threads; the automatic count is a quarter of the CPUs,
//! 1 to 4.

pub mod config;
mod controller;
mod device;
mod doorbells;
pub mod error;
pub mod faults;
pub mod forward;
mod host_memory;
mod image_map;
mod lock;
pub mod memory;
mod prp;
pub mod queue_server;
mod queues;
mod registers;
pub mod stats;
mod storage;
mod stripes;

pub use config::{Backend, EmuConfig, Hostile, ImageReads, NamespaceConfig, NsFormat};
pub use controller::controller_thread_index;
pub use device::EmuDevice;
pub use doorbells::DoorbellWord;
pub use error::{AttachRefusal, EmuError};
pub use faults::{DROP_ALL, Faults};
pub use forward::{ForwardChannel, ForwardData, ForwardDone, ForwardError, Forwarded, Forwarder};
pub use memory::{DeviceAddressMap, DmaError, MemoryRegion, RegionError};
pub use queue_server::{QueueServer, QueueServerRefusal};
pub use stats::EmuStats;
pub use storage::{HostWriteError, HostWriteErrors, MediaWrites};
