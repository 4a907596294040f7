//! gpunvme: the library embedders link (Rust; Python's package and C's `libgpunvme` are built on
//! it). It opens a device — an SSD bound to vfio-pci, a controller another process serves over
//! vfio-user, or an image file served by the software controller — and gives files, volumes,
//! safetensors checkpoints and files on the GPU on top of it, every failure one [`Error`] whose
//! [`ErrorKind`] is a field.
//!
//! - [`handle`]: [`handle::DeviceHandle`], an opened device and its file system, the one
//!   object the Python and C surfaces wrap;
//! - [`open`]: device specs ([`open::DeviceSpec`]) and the one-owner rule; [`image`]: image
//!   files of a given size;
//! - [`copy`]: copies between host files and blockfs; [`volume`]: striped volumes over several
//!   devices; [`safetensors`]: checkpoints as files of tensors;
//! - [`gpu`]: GPU queues on an opened controller (the runtime's transports, or an emulated
//!   controller in the software controller's place) and the watchdog; [`gpu_fs`] and
//!   [`gpu_io`]: files read and written by GPU-issued commands;
//! - [`fs_report`]: what the file operations report (`Serialize` for JSON, `Display` for
//!   text); [`logs`]: the controller's error and SMART logs; [`units`]: sizes and durations;
//! - [`error`]: [`Error`], [`ErrorKind`], [`Result`]; [`kinds`]: the kind of each typed error.
//!
//! The layers are re-exported: [`nvme_spec`] (spec types), [`nvme`] (driver), [`vfio`] (real
//! PCI devices), [`gpu_queues`] (the GPU runtime), [`blockfs`] and [`blockfs_gpu`] (files, and
//! files on the GPU), [`gpu_cache`] (the GPU page cache's host side), and the emulated controllers [`nvme_emu`] (the software NVMe controller,
//! the embedded default) and [`gpu_emu`] (its GPU transport and the GPU-resident model).
#![forbid(unsafe_code)]

pub mod copy;
pub mod cpu_staged;
pub mod error;
pub mod fabric;
pub mod fs_report;
pub mod gpu;
pub mod gpu_fs;
pub mod gpu_io;
pub mod handle;
pub mod image;
pub mod kinds;
pub mod logs;
pub mod open;
pub mod safetensors;
pub mod served;
pub mod staged;
pub mod units;
pub mod volume;

pub use error::{Error, ErrorKind, Result};

/// The verification patterns (shared with the GPU kernels; they live in `gpu_queues`).
pub use gpu_queues::pattern;

pub use blockfs;
pub use blockfs_gpu;
pub use gpu_cache;
pub use gpu_emu;
pub use gpu_queues;
pub use nvme;
pub use nvme_emu;
pub use nvme_spec;
pub use vfio;
