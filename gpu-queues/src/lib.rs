//! NVMe I/O queue pairs in GPU memory (layer: controller/queues, GPU side).
//!
//! **Not implemented yet.** This crate will hold the GPU-memory `DmaBuffer`, the device-side
//! queue handles that the kernels in `ptx/` drive, and their creation through the CPU admin
//! queue of the `nvme` crate. Nothing here runs today; see the README's "What works where".
#![forbid(unsafe_code)]
