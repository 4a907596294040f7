//! blockfs files on the GPU, cuFile-like (layer: files, GPU side): a file's blockfs extent
//! table is copied into GPU memory and GPU threads translate file offsets to LBAs and issue the
//! NVMe commands themselves, on the runtime's [`gpu_queues::GpuQueues`]. The device code is
//! `ptx/include/gpunvme_file.cuh` (and the file kernel in `ptx/kernels/`), which embedders can
//! call from their own kernels.
//!
//! # Architecture
//! - [`files`]: the host API — [`GpuFiles`] opens files (or every file under a prefix) for the
//!   GPU, pinning their tables for as long as a [`GpuFile`] handle lives; reads and writes byte
//!   ranges synchronously or as batches on a stream ([`Pending`]); reserves space for device
//!   writes and commits them ([`GpuFile::commit_with_crc`]); computes CRC-32C of GPU memory on
//!   the GPU.
//! - Files in the GPU page cache are the crate `gpu_cache`'s (`bind_file`), above this one.
//! - [`plan`]: the device algorithm's Rust twins (chunks, pieces, CRC combining, batch plans),
//!   tested here without a GPU.
//! - [`desc`]: the `#[repr(C)]` mirrors of the file kernel's structs, checked against the CUDA
//!   sources and blockfs's table layout.
//!
//! # Not implemented
//! Growing a file from the GPU past its reservation; files of more than one namespace in one
//! batch.

pub mod desc;
pub mod error;
pub mod files;
pub mod plan;
#[cfg(test)]
mod testutil;
pub mod volume;

pub use error::FilesError;
pub use files::{
    BatchResult, CRC_SEGMENT_BYTES, ChunkOrder, FileRange, GpuFile, GpuFiles, GpuFilesOptions,
    GpuSpan, LaunchShape, Pending, crc32c_on,
};
pub use plan::{BatchPlan, RangeSpec, plan_batch};
pub use volume::{VolumeFile, VolumeFiles, VolumeIoResult, VolumeWrite};
