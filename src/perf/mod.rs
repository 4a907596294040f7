//! The perf engine, in one place for CPU and GPU queues (`gpunvme perf`, `perf --gpu`): fio's
//! patterns, depths and stop conditions, latency percentiles, byte-for-byte verification with
//! the LBA-stamped pattern ([`gpu_queues::pattern`], which the GPU kernels compute too).
//!
//! - `cpu` (re-exported here): the load generator over the driver's CPU I/O queue pairs.
//! - [`gpu`]: `perf --gpu` — GPU queues set up on the opened controller (optionally beside CPU
//!   queues running the CPU engine), verification by CPU and GPU together, the report.
//! - `several` (re-exported): the CPU engine on several controllers at once, with totals.
//! - [`kernel`]: the perf kernel's host side — launch on the clients' SM partition, bounded
//!   wait with a watchdog, counters and latency histogram read back.

mod cpu;
pub mod gpu;
pub mod kernel;
pub mod served;
mod several;

pub use cpu::*;
pub use several::{
    NamedGpuReport, NamedReport, PerfTotals, SeveralError, SeveralGpuReport, SeveralReport,
    run_gpus_on_controllers, run_on_gpus, run_several, run_several_gpu,
};
