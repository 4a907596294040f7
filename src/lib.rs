//! gpunvme: a userspace NVMe driver with a software controller for machines without an SSD.
//!
//! This facade crate holds what the `gpunvme` CLI, the examples and the top-level benches share:
//! choosing and opening a device ([`open`]), the fio-style load generator ([`perf`]), copies
//! between host files and blockfs ([`copy`]), what each `fs` command reports ([`fs_report`]:
//! `Serialize` for `--json`, `Display` for text; [`report`] for `identify`, `read`, `write`) and
//! the size/duration parsers ([`units`]). The layers themselves live in their own crates, re-exported
//! here: [`nvme_spec`] (spec types), [`nvme`] (driver), [`nvme_emu`] (software controller),
//! [`vfio`] (real PCI devices) and [`blockfs`] (file layer).
#![forbid(unsafe_code)]

pub mod copy;
pub mod fs_report;
pub mod gpu;
pub mod gpu_fs;
pub mod gpu_perf;
pub mod open;
pub mod perf;
pub mod report;
pub mod units;

/// The verification patterns (shared with the GPU kernels; they live in `gpu_queues`).
pub use gpu_queues::pattern;

pub use blockfs;
pub use gpu_queues;
pub use nvme;
pub use nvme_emu;
pub use nvme_spec;
pub use vfio;
