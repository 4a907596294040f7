//! The gpunvme runtime (layer: queues, GPU side): NVMe I/O queue pairs in GPU memory, where GPU
//! threads build commands, ring doorbells and poll completions themselves; the CPU only creates
//! the queues through the admin queue of the same [`nvme::Controller`] that serves CPU queues
//! and watches for controller failure. This is the crate an embedder links; it never imports an
//! emulator (the emulated controllers of `gpu_emu` plug in through [`QueueTransport`]).
//!
//! # Architecture
//! - `ptx/include/gpunvme.cuh` (embedded as [`desc::HEADER`]): the device side — slot
//!   reservation by ticket, doorbell coalescing, completion by command id with the phase tag,
//!   bounded waits, thread and warp variants, PRPs from pre-built per-slot lists, MDTS
//!   splitting. Its protocol and fence discipline are written at its top.
//! - [`desc`]: the `#[repr(C)]` mirrors of the header's and the kernels' structs
//!   ([`QueueDesc`], ...), checked against the header's `GPUNVME_*` numbers and
//!   `nvme_spec::wire` by tests.
//! - [`ffi`] (the only module with `unsafe`): the CUDA driver API through cudarc's dynamically
//!   loaded `sys` bindings, so this crate builds and its CPU tests run without CUDA, and in
//!   [`ffi::os`] the mmaps, ioctls and VFIO mappings of the real-SSD transports. With the
//!   `host-gpu` feature the same API is a CPU backend instead: the project's CUDA sources
//!   compiled for the host by g++ (`ptx/host/`) and run on CPU threads, GPU memory being host
//!   memory — a correctness harness for CI without a GPU, not a GPU and no performance claim.
//! - [`kernels`]: the project's kernels (`ptx/kernels/`: batches, byte ranges, files, CRC-32C,
//!   the page cache's write-back), loaded eagerly and warmed up before anything spins; the
//!   tool kernels (perf, tests, the cache examples) in a module of their own, loaded on first
//!   use. The page cache's host side is the crate `gpu_cache`, above the file layer.
//! - [`queues`]: [`GpuQueues`] — rings, protocol state, PRP-list pages and slot buffers in GPU
//!   memory, created with `nvme::Controller::create_queue_pair_on` by a [`QueueTransport`]
//!   and assembled here ([`GpuQueues::assemble`]).
//! - [`transport`]: the run-time choice of transport, always saying why; the real-SSD
//!   transports (vfio-p2p, host-memory).
//! - [`cpu_client`]: the header's protocol in Rust on CPU threads (its twin), for
//!   `gpunvme protocol-check` and tests; [`pattern`]: the verification pattern the kernels
//!   compute on the device.
//!
//! # Transports
//! - `software-controller`: the software controller — an emulator, in `gpu_emu::software`;
//!   run on the GPU machine;
//! - `vfio-p2p`: VFIO with a real SSD: BAR0 doorbells registered with CUDA, rings and data in
//!   GPU memory mapped for the SSD through a CPU mapping of BAR1 (gdrdrv, sysfs `resource1` at
//!   a known offset, or an mmapped CUDA dma-buf) — written, **never run** (no machine here has
//!   an SSD under VFIO and a GPU together);
//! - `host-memory`: VFIO with a real SSD, rings and data in hugepage host memory registered
//!   with CUDA, only the doorbell write peer to peer — written, **never run**, for the same
//!   reason;
//! - `gpu-controller`: the GPU-resident controller model — an emulator, in `gpu_emu::resident`.
//!
//! `vfio-p2p` and `host-memory` refuse unless the GPU's IOMMU group is identity-mapped or absent
//! ([`transport::iommu`]).
//!
//! # Not implemented
//! SGLs; queues deeper than 65536; more than one namespace per kernel call (each call names
//! its namespace).

pub mod cpu_client;
pub mod desc;
pub mod error;
pub mod ffi;
pub mod gpus;
pub mod kernels;
pub mod pattern;
pub mod queues;
pub mod transport;
pub mod transport_kind;

pub use desc::{DeviceStatus, IoReq, QueueDesc};
pub use error::GpuError;
pub use ffi::{Cuda, GpuIdentity, cuda_present};
pub use gpus::{GpuId, GpuSelection};
pub use queues::{
    GpuBuffer, GpuQueueOptions, GpuQueuePair, GpuQueues, QueueSetParts, QueueTransport, ReadAhead,
    TransportKind,
};
