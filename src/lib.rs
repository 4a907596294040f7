//! The `gpunvme` command's own library: what its binary (`main.rs`, `cli/`), the top-level
//! tests and the benches share, above the library embedders link (`gpunvme`).
//!
//! - [`perf`]: the perf engine for CPU and GPU queues (`perf`, `perf --gpu`), fio-style;
//! - [`report`]: what the raw-LBA and identify commands report (`Serialize` for `--json`,
//!   `Display` for text).
#![forbid(unsafe_code)]

pub mod perf;
pub mod report;
