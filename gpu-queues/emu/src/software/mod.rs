//! The software-controller transport: the software controller (`nvme_emu`) serving queues that
//! GPU threads drive — an emulated controller standing in for an SSD, built on the runtime's
//! [`QueueTransport`] seam ([`queues`] builds the queue pairs, [`SoftwareTransport`] serves
//! them).
//!
//! Where a pair's rings, PRP-list pages and slot buffers live is a [`RingPlacement`]:
//!
//! - **host** (`perf --gpu`'s choice, [`GpuQueueOptions::host_rings`]): one arena of the
//!   controller's own host DMA memory per pair, laid out as the host-memory transport lays
//!   them out on a real SSD and registered with CUDA. The controller
//!   reads SQEs and writes CQEs and slot-buffer data directly, as for CPU queues; GPU threads
//!   reach the arena over PCIe. No copy, kernel or wait per command: the latency of a command is
//!   the PCIe round trips and the controller's polling.
//! - **gpu** (the default): all of it in GPU memory, behind the copy engines below. Measured
//!   faster for bulk transfers into GPU buffers (`fs get --gpu` of 1 GiB, H100, 2026-11-26:
//!   19.4 GB/s against 13.4 with host rings; not profiled, the likely cause is that the
//!   pollers' PCIe reads of a host CQ wait behind the data moving to the GPU).
//!
//! Either way, buffers from [`GpuQueues::alloc_buffer`] (files, the page cache's frames) are GPU
//! memory behind the copy engines. With host rings the CQ is pinned memory of its own behind a
//! [`HostCqRegion`]: an entry is stored there directly while the thread's engine holds no write
//! that is not yet visible, and otherwise staged through the engine like GPU memory, so that it
//! lands after its command's data without the controller ever waiting for the GPU.
//!
//! The controller reaches GPU memory only through [`GpuRegion`]s registered in its device-address
//! map, and its doorbells for these queues are words in a pinned host page that GPU threads
//! write ([`PinnedDoorbell`]). One `cudaMemcpy` per command would cap the controller at about
//! 0.3 M commands/s (../shared/design/gpu.md), so writes are batched by a [`GpuDma`] engine:
//!
//! - every write the controller makes (read data, completion entries) is appended to a pinned
//!   staging area, mapped into the GPU, with a [`CopyDesc`] naming its destination, at the
//!   destination's alignment modulo 16 (so the kernel copies 16-byte vectors into a tensor
//!   that starts 8 bytes past a boundary, say);
//! - at the end of each controller batch (`MemoryRegion::flush`), ONE scatter kernel copies every
//!   staged piece to its place; completion-queue phase dwords are marked late and written by the
//!   kernel's last block after a fence, so a completion never becomes visible before its data
//!   or the rest of its entry;
//! - a Read of 64 KiB or more is copied from the image (out of a mapping of it, or by `pread`:
//!   `image_reads::ReadMode`) into the staging area like any other write but moved by a copy
//!   engine, one copy per run of Reads adjacent in GPU memory,
//!   queued before the scatter that carries their completions ([`StagedCopies`]; 7B-shaped
//!   load on the H200, 2026-11-26: 43.7 GB/s against 40.6 by the scatter kernel);
//! - reads (SQE fetches, PRP lists, data of write commands) copy and wait (bounded); ranges the
//!   controller announced with `MemoryRegion::prefetch` (a batch's PRP lists, then its write
//!   data) are fetched together by ONE gather kernel into a pinned area, and the reads that
//!   follow are served from it until the batch moves on (the next prefetch or flush);
//! - a read of memory the controller has written (a region it staged data or entries into)
//!   flushes first and copies on the scatter's stream, so it sees every earlier write; a read
//!   of memory it never wrote (the clients' SQ rings and PRP lists, a Write's data in a buffer
//!   only clients fill) copies on a second stream of the engine and does not wait for the
//!   batch's scatter: the next batch's commands are fetched, and its `pread`s run, while the
//!   last batch's data still moves (`GPUNVME_EMU_FETCH=ordered` orders every read, for
//!   comparisons).
//!
//! Each controller thread has an engine of its own (stream, staging and gather areas), picked
//! with `nvme_emu::controller_thread_index`: a queue pair is served by one thread, so its data
//! and completions go through one stream in issue order. The streams live in the controller's
//! own SM partition (a green context), so client kernels that occupy every other SM cannot
//! starve them. Two staging areas alternate: the controller fills one while the GPU drains the
//! other.
//!
//! The code, by concept: `engine` (one controller thread's copy engine and [`GpuDma`], the set
//! of them), `staging` (its write side: staging areas and the scatter), `gather` (its read
//! side: prefetched gathers and copies that wait), `modes` (how the engines move data, as the
//! environment chooses), `stats` ([`DmaStats`]), `regions` (the memory regions and doorbell
//! words the controller reaches the queues through), `pair_memory` (where a pair's rings and
//! buffers live), `readahead` (read hints at work), `transport` ([`SoftwareTransport`]) and
//! `create` ([`queues`], [`open`]).
//!
//! [`QueueTransport`]: gpu_queues::queues::QueueTransport
//! [`GpuQueueOptions::host_rings`]: gpu_queues::queues::GpuQueueOptions::host_rings
//! [`GpuQueues::alloc_buffer`]: gpu_queues::queues::GpuQueues::alloc_buffer
//! [`HostCqRegion`]: regions::HostCqRegion
//! [`CopyDesc`]: crate::desc::CopyDesc
#![forbid(unsafe_code)]

mod create;
mod engine;
mod gather;
mod modes;
mod pair_memory;
mod pinning;
mod readahead;
mod regions;
mod staging;
mod stats;
mod transport;

pub use create::{open, queues};
pub use engine::GpuDma;
pub use modes::{CopyMode, ENGINE_COPY_MIN, StagedCopies};
pub use pair_memory::RingPlacement;
pub use readahead::{READAHEAD_ENV, READAHEAD_WALKERS};
pub use regions::{GpuRegion, PinnedDoorbell};
pub use stats::DmaStats;
pub use transport::SoftwareTransport;

#[cfg(test)]
mod tests;
