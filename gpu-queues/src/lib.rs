//! NVMe I/O queue pairs in GPU memory (layer: controller/queues, GPU side): GPU threads build
//! commands, ring doorbells and poll completions themselves; the CPU only creates the queues
//! through its admin queue and watches for controller failure.
//!
//! # Architecture
//! - `ptx/gpunvme.cuh` (embedded as [`desc::HEADER`]): the device side — slot reservation by
//!   ticket, doorbell coalescing, completion by command id with the phase tag, bounded waits,
//!   thread and warp variants, PRPs from pre-built per-slot lists, MDTS splitting. Its protocol
//!   and fence discipline are written at its top.
//! - [`desc`]: the `#[repr(C)]` mirrors of the header's structs ([`QueueDesc`], ...), checked
//!   against the header's `GPUNVME_*` numbers and `nvme_spec::wire` by tests.
//! - [`ffi`] (the only module with `unsafe`): the CUDA driver API through cudarc's dynamically
//!   loaded `sys` bindings, so this crate builds and its CPU tests run without CUDA, and in
//!   [`ffi::os`] the mmaps, ioctls and VFIO mappings of transports (b) and (c). With the
//!   `host-gpu` feature the same API is a CPU backend instead: the kernels' CUDA sources
//!   compiled for the host by g++ (`ptx/host/`) and run on CPU threads, GPU memory being host
//!   memory — a correctness harness for CI without a GPU, not a GPU and no performance claim.
//! - [`kernels`]: the embedded PTX, loaded eagerly and warmed up before anything spins.
//! - [`queues`]: [`GpuQueues`] — rings, protocol state, PRP-list pages and slot buffers in GPU
//!   memory, created with `nvme::Controller::create_queue_pair_on_with` on the same controller
//!   that serves CPU queues.
//! - [`emu_dma`]: transport (a), the software controller serving those queues with batched
//!   copies (one scatter kernel per controller batch) in an SM partition of its own.
//! - [`gpu_controller`]: the GPU-resident controller model — a persistent kernel on reserved
//!   SMs serving queues in GPU memory at GPU speed, behind the software controller's admin
//!   queue ([`nvme_emu::QueueServer`]); `null`, `hbm` and `host` media, an optional SSD timing
//!   model per namespace ([`ssd_model`]) and fault injection ([`GpuFaults`]).
//! - [`perf`]: the GPU side of `gpunvme perf --gpu`.
//! - [`files`]: blockfs files on the GPU, cuFile-like ([`files::GpuFiles`]): extent tables
//!   uploaded to GPU memory (pinned while in use), byte ranges of files read and written by
//!   GPU-issued commands (`ptx/gpunvme_file.cuh`), batched over many files, synchronously or on
//!   a stream, device writes committed through blockfs's device-write reservations; CRC-32C of
//!   GPU memory computed on the GPU.
//!
//! # Transports
//! Chosen at run time by [`transport::open`], the choice logged and returned
//! ([`transport::TransportChoice`]: the transport and why each one before it was skipped):
//! - (a) the software controller — implemented and run on the GPU machine;
//! - (b) VFIO with a real SSD: BAR0 doorbells registered with CUDA, rings and data in GPU
//!   memory mapped for the SSD through a CPU mapping of BAR1 (gdrdrv, sysfs `resource1` at a
//!   known offset, or an mmapped CUDA dma-buf) — written, **never run** (no machine here has an
//!   SSD under VFIO and a GPU together);
//! - (c) VFIO with a real SSD, rings and data in hugepage host memory registered with CUDA,
//!   only the doorbell write peer to peer — written, **never run**, for the same reason.
//!
//! (b) and (c) refuse unless the GPU's IOMMU group is identity-mapped or absent
//! ([`transport::iommu`]).
//!
//! # Not implemented
//! SGLs; queues deeper than 65536; more than one namespace per kernel
//! call (each call names its namespace).

pub mod cpu_client;
pub mod desc;
pub mod emu_dma;
pub mod error;
pub mod ffi;
pub mod files;
pub mod gpu_controller;
pub mod kernels;
pub mod pattern;
pub mod perf;
pub mod queues;
pub mod ssd_model;
pub mod transport;

pub use desc::{DeviceStatus, IoReq, QueueDesc};
pub use error::GpuError;
pub use ffi::{Cuda, cuda_present};
pub use files::{GpuFile, GpuFiles, GpuSpan};
pub use gpu_controller::{GpuController, GpuControllerOptions, GpuFaults, MediaKind};
pub use queues::{GpuBuffer, GpuQueueOptions, GpuQueues, TransportKind};
pub use ssd_model::SsdModel;
