//! gpunvme's CLI library: what the `gpunvme` command, the examples and the top-level benches
//! and tests share, above the layers (layer: CLI). The CLI (`main.rs`, `cli/`) parses and
//! prints; the logic it runs lives here, where it is tested.
//!
//! - [`image`]: image files of a given size for the software controller (`gpunvme image
//!   create`, Python's `create=`, C's `gpunvme_image_create`);
//! - [`open`]: device specs (`--device`: an image for the software controller, or a PCI
//!   address bound to vfio-pci) and the one-owner rule;
//! - [`perf`]: the perf engine for CPU and GPU queues (`perf`, `perf --gpu`);
//! - [`gpu`]: GPU queues on an opened controller (the runtime's transports, or an emulated
//!   controller in the software controller's place) and the watchdog, shared by `perf --gpu`
//!   and `fs get/put --gpu`; [`gpu_fs`]: `fs get/put --gpu`;
//! - [`copy`]: copies between host files and blockfs; [`fs_report`] and [`report`]: what each
//!   command reports (`Serialize` for `--json`, `Display` for text); [`units`]: sizes and
//!   durations; [`workloads`]: the page cache's BFS and embedding workloads (data, CPU
//!   references, GPU runs) for its examples and benchmark.
//!
//! The layers are re-exported: [`nvme_spec`] (spec types), [`nvme`] (driver), [`vfio`] (real
//! PCI devices), [`gpu_queues`] (the GPU runtime), [`blockfs`] and [`blockfs_gpu`] (files, and
//! files on the GPU), and the emulated controllers [`nvme_emu`] (software NVMe controller) and
//! [`gpu_emu`] (its GPU transport and the GPU-resident model).
#![forbid(unsafe_code)]

pub mod copy;
pub mod error_kind;
pub mod fs_report;
pub mod gpu;
pub mod gpu_fs;
pub mod gpu_io;
pub mod handle;
pub mod image;
pub mod logs;
pub mod open;
pub mod perf;
pub mod report;
pub mod safetensors;
pub mod units;
pub mod volume;
pub mod workloads;

/// The verification patterns (shared with the GPU kernels; they live in `gpu_queues`).
pub use gpu_queues::pattern;

pub use blockfs;
pub use blockfs_gpu;
pub use gpu_emu;
pub use gpu_queues;
pub use nvme;
pub use nvme_emu;
pub use nvme_spec;
pub use vfio;
