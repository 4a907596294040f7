//! Userspace NVMe driver core (layer: controller and queues, above a transport).
//!
//! Reaches the controller only through [`device::Device`]: a register window and DMA memory.
//! The same code runs over VFIO (`vfio` crate) and the software controller (`nvme_emu`); the
//! GPU runtime (`gpu_queues`) creates its queues in GPU memory through this driver's admin
//! queue ([`Controller::create_queue_pair_on`]).
//!
//! Spec revisions: [NVM Express Base Specification 2.0 and NVM Command Set Specification
//! 1.0](https://nvmexpress.org/specifications/); data types live in [`nvme_spec`].
//!
//! # Architecture
//! - [`device`], [`dma`]: the seam (register window, DMA memory with per-page device
//!   addresses: [`DmaRegion`] for addresses only, [`DmaMemory`] with a host mapping over one,
//!   [`DmaSlice`]).
//! - [`registers`]: typed CAP/CC/CSTS/AQA access and bounded CSTS waits.
//! - [`controller`]: bring-up (disable, admin queue, enable, identify, Number of Queues),
//!   namespaces, orderly shutdown. [`Controller`] is `Send + Sync`.
//! - `admin`: the admin queue; one command at a time under a mutex, polled, each bounded by
//!   [`ControllerOptions::admin_timeout`].
//! - [`queue_lifecycle`]: an I/O queue pair's life on the controller, whoever drives its rings:
//!   queue ids, Create/Delete I/O CQ and SQ on caller-supplied [`DmaRegion`]s
//!   ([`Controller::create_queue_pair_on`] → [`CreatedQueuePair`]), deletion at drop or shutdown.
//! - [`queue`]: ring arithmetic; `queue_pair`: the CID table, submit and reap engine;
//!   [`io`]: [`IoQueuePair`] (a [`CreatedQueuePair`] on host memory, driven by the CPU),
//!   lock-free (`&mut self`) I/O with typed validation, splitting at the maximum transfer size
//!   and deadlines on every command.
//!
//! Module dependencies point one way: `io` → `controller` → `queue_lifecycle` → `admin` →
//! `queue_pair` → `queue`/`prp`/`registers` → `device`/`dma`/`error`.
//! - [`prp`]: PRP1/PRP2/PRP list construction (one list page per command slot).
//! - [`error`]: [`Error`], one variant per failure, with the command named.
//! - Not here: the inline null device implementing [`Device`] that completes commands inside
//!   the doorbell write, for measuring the driver's own cost (`benches/hot_path.rs`,
//!   `examples/driver_cost.rs`), is the `nvme_null` crate (`nvme/null`), which only this
//!   crate's benches, examples and tests reach, as a dev-dependency; it uses nothing but the
//!   public [`Device`] seam and [`DmaMemory::from_raw_parts`], so it cannot become part of the
//!   driver's API by accident.
//!
//! No interrupts: completions are polled. Completions are matched by CID and may arrive in any
//! order. Device-supplied garbage (unknown CID, wrong SQ id, all-ones registers, CFS) becomes an
//! error, never a panic.
//!
//! # Key constants
//! - Memory page size 4 KiB (CC.MPS = 0); SQE 64 B, CQE 16 B (field offsets in
//!   [`nvme_spec::wire`]).
//! - Per-command transfer: MDTS capped at [`prp::MAX_PRP_TRANSFER`] (2 MiB), so one PRP list
//!   page always suffices.
//! - Queue depth ≤ CAP.MQES + 1; `depth - 1` commands in flight.
//!
//! # Not implemented
//! Interrupts, SGLs, metadata / protection information, namespaces with LBA sizes outside
//! 512..=4096, controller reset and recovery after a failure (a failed queue pair stays failed),
//! Abort, asynchronous events, physically discontiguous I/O queues (CAP.CQR = 0 with PC = 0).
//!
//! # Unsafe
//! Only [`dma`] uses `unsafe` (raw-pointer access to DMA memory); every other module is
//! `#![forbid(unsafe_code)]` or under the workspace's `deny(unsafe_code)`. (The null device's
//! side of the same memory, its admin queue's lock and its lock-free I/O queue states are
//! `unsafe` in `nvme_null`'s `region`, `spin` and `published`.)

mod admin;
pub mod controller;
pub mod device;
pub mod dma;
pub mod error;
pub mod io;
pub mod namespace;
pub mod prp;
pub mod queue;
pub mod queue_lifecycle;
pub mod queue_pair;
pub mod registers;
mod timeout;

pub use controller::{Controller, ControllerInfo, ControllerOptions};
pub use device::{Device, DmaAllocError, RegisterIo};
pub use dma::{DMA_PAGE_SIZE, DmaMemory, DmaOwner, DmaRegion, DmaSlice, DmaSliceError};
pub use error::{Error, Op};
pub use io::{IoCommand, IoCompletion, IoQueuePair};
pub use namespace::{Namespace, NamespaceUnusable, SkippedNamespace};
pub use nvme_spec;
pub use queue_lifecycle::{CreatedQueuePair, QueueRegions};

#[cfg(test)]
mod tests {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}

    #[test]
    fn thread_safety() {
        send_sync::<crate::Controller>();
        send::<crate::IoQueuePair>();
        send_sync::<crate::Error>();
        send_sync::<crate::DmaSlice>();
        send_sync::<crate::DmaRegion>();
        send_sync::<crate::QueueRegions>();
        send_sync::<crate::CreatedQueuePair>();
    }
}
