//! Emulated NVMe controllers that serve gpunvme's GPU queues in place of an SSD (layer: test
//! devices, GPU side). They stand beside the runtime (`gpu_queues`), never under it: each plugs
//! in through the runtime's [`gpu_queues::QueueTransport`] seam, and an embedder with a real
//! SSD never links this crate.
//!
//! # Architecture
//! - [`software`]: the software controller (`nvme_emu`, CPU threads) and its transport,
//!   `software-controller`, serving queues whose rings and data live in GPU memory: batched
//!   copies (one scatter kernel per controller batch, one gather kernel for a batch's PRP lists
//!   and write data) on streams in an SM partition of its own (a green context); doorbells are
//!   words in a pinned host page.
//! - [`resident`]: the GPU-resident controller ([`GpuController`]) — a persistent kernel on
//!   reserved SMs serving queues in GPU memory at GPU speed, behind the software controller's
//!   admin queue ([`nvme_emu::QueueServer`]); `null`, `hbm` and `host` media, fault injection
//!   ([`GpuFaults`]) and an optional SSD timing model per namespace ([`ssd_model`]).
//! - [`kernels`] and [`desc`]: this crate's own kernel module (`ptx/emu/`) and the
//!   `#[repr(C)]` mirrors of its structs, checked against the CUDA sources by tests.
//!
//! [`GpuQueuesExt`] keeps the constructors users know, `GpuQueues::on_software_controller` and
//! `GpuQueues::on_gpu_controller`.
//!
//! # Not implemented
//! Real SSD timing beyond the model's latency, IOPS and bandwidth caps (no garbage collection,
//! no write cliff); namespaces of more than one kind per model (every namespace shares the
//! model's media kind).

pub mod desc;
mod env_choice;
pub mod image_reads;
pub mod kernels;
pub mod os;
pub mod prefetch;
pub mod resident;
pub mod software;
pub mod ssd_model;

use std::sync::Arc;

use gpu_queues::ffi::Cuda;
use gpu_queues::{GpuError, GpuQueueOptions, GpuQueues};
use nvme::Controller;
use nvme_emu::EmuDevice;

pub use resident::{
    GpuController, GpuControllerOptions, GpuFaults, GroupMember, MediaKind, ModelGroup,
    ModelTransport,
};
pub use software::{CopyMode, DmaStats, RingPlacement, SoftwareTransport};
pub use ssd_model::SsdModel;

/// The emulated controllers' constructors and statistics on [`GpuQueues`] (import the trait).
pub trait GpuQueuesExt: Sized {
    /// Queue pairs in GPU memory on `controller`, served by the software controller `emu`
    /// (the software-controller transport); see [`software::queues`].
    fn on_software_controller(
        cuda: &Arc<Cuda>,
        controller: &Controller,
        emu: &Arc<EmuDevice>,
        opts: &GpuQueueOptions,
    ) -> Result<Self, GpuError>;

    /// Queue pairs in GPU memory on `controller`, served by the GPU-resident controller model
    /// `gpu` (started on the same software controller before this call); see [`resident::queues`].
    fn on_gpu_controller(
        cuda: &Arc<Cuda>,
        controller: &Controller,
        gpu: &Arc<GpuController>,
        opts: &GpuQueueOptions,
    ) -> Result<Self, GpuError>;

    /// What the software controller's copy engines did, when it serves these queues.
    fn dma_stats(&self) -> Option<DmaStats>;

    /// The same per controller thread (by thread index), when the software controller serves
    /// these queues.
    fn dma_stats_per_thread(&self) -> Option<Vec<DmaStats>>;

    /// How the software controller moves batches, when it serves these queues.
    fn copy_mode(&self) -> Option<CopyMode>;

    /// The software controller's threads with a copy engine, when it serves these queues.
    fn controller_threads(&self) -> Option<usize>;

    /// Where the software controller's queues keep their rings and slot buffers, when it
    /// serves these queues.
    fn ring_placement(&self) -> Option<RingPlacement>;

    /// How the software controller reads image data for Reads, and its registered windows'
    /// counters, when it serves these queues.
    fn window_stats(&self) -> Option<(image_reads::ReadMode, image_reads::WindowStats)>;
}

impl GpuQueuesExt for GpuQueues {
    fn on_software_controller(
        cuda: &Arc<Cuda>,
        controller: &Controller,
        emu: &Arc<EmuDevice>,
        opts: &GpuQueueOptions,
    ) -> Result<Self, GpuError> {
        software::queues(cuda, controller, emu, opts)
    }

    fn on_gpu_controller(
        cuda: &Arc<Cuda>,
        controller: &Controller,
        gpu: &Arc<GpuController>,
        opts: &GpuQueueOptions,
    ) -> Result<Self, GpuError> {
        resident::queues(cuda, controller, gpu, opts)
    }

    fn dma_stats(&self) -> Option<DmaStats> {
        SoftwareTransport::of(self).map(SoftwareTransport::dma_stats)
    }

    fn dma_stats_per_thread(&self) -> Option<Vec<DmaStats>> {
        SoftwareTransport::of(self).map(SoftwareTransport::dma_stats_per_thread)
    }

    fn copy_mode(&self) -> Option<CopyMode> {
        SoftwareTransport::of(self).map(SoftwareTransport::copy_mode)
    }

    fn controller_threads(&self) -> Option<usize> {
        SoftwareTransport::of(self).map(SoftwareTransport::controller_threads)
    }

    fn ring_placement(&self) -> Option<RingPlacement> {
        SoftwareTransport::of(self).map(SoftwareTransport::ring_placement)
    }

    fn window_stats(&self) -> Option<(image_reads::ReadMode, image_reads::WindowStats)> {
        SoftwareTransport::of(self).map(SoftwareTransport::window_stats)
    }
}
