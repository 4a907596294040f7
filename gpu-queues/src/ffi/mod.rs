//! The crate's FFI boundary, the only place with `unsafe`: the GPU, as little of it as
//! gpu-queues needs, behind small owning types; and the operating-system calls of transports
//! (b) and (c) ([`os`]).
//!
//! The GPU is one of two backends with the same public API, chosen at build time:
//! - by default, the CUDA driver API (`cuda.rs`) through cudarc's `driver::sys` (dynamically
//!   loaded libcuda), so the crate builds and its CPU tests run where there is no CUDA.
//!   [`Cuda::open`] checks that libcuda can be loaded before the first CUDA call (cudarc panics
//!   otherwise) and returns [`GpuError::NoCuda`];
//! - with the `host-gpu` feature, a CPU stand-in (`host_gpu.rs`): the project's CUDA sources
//!   (`ptx/kernels/gpunvme_kernels.cu`) compiled for the host by g++ against `ptx/host/gpunvme_host.h`
//!   and run on CPU threads, "GPU memory" being host memory whose device address is its host
//!   address. It is a correctness harness, so that the GPU tests' logic runs in CI without a
//!   GPU: it is not a GPU, and nothing measured through it says anything about GPU
//!   performance.
//!
//! Memory the GPU or a controller may change is never reached through Rust references here:
//! host-side access to pinned memory is by volatile loads and stores and raw copies, with the
//! fences named where ordering matters.
//!
//! [`GpuError::NoCuda`]: crate::error::GpuError::NoCuda

use std::time::{Duration, Instant};

use crate::error::GpuError;

mod host_memory;
pub mod os;

#[cfg(not(feature = "host-gpu"))]
mod cuda;
#[cfg(not(feature = "host-gpu"))]
pub use cuda::*;

#[cfg(feature = "host-gpu")]
mod host_gpu;
#[cfg(feature = "host-gpu")]
pub use host_gpu::*;

/// One kernel argument, passed by value.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    /// A 64-bit value (pointers, counts).
    U64(u64),
    /// A 32-bit value.
    U32(u32),
}

impl Arg {
    /// The argument in a 64-bit slot: a `u32` is widened, so that on a little-endian target a
    /// 32-bit parameter read from the slot's address finds its value in the low half.
    fn slot(self) -> u64 {
        match self {
            Arg::U64(v) => v,
            Arg::U32(v) => u64::from(v),
        }
    }
}

/// Which SMs a stream's kernels may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The whole GPU (primary context).
    Anywhere,
    /// The controller's green-context partition.
    Controller,
    /// The clients' green-context partition.
    Client,
}

/// Polls `done` until it is true, at most `timeout`. The software controller's threads wait
/// here for copies of a few microseconds: they spin, then yield, and only sleep once a wait has
/// gone on for a millisecond (a sleep costs tens of microseconds of timer slack).
fn poll_until(
    what: &'static str,
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool, GpuError>,
) -> Result<(), GpuError> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        if done()? {
            return Ok(());
        }
        let waited = start.elapsed();
        if waited > timeout {
            return Err(GpuError::Timeout {
                what,
                waited: timeout,
            });
        }
        spins += 1;
        if spins <= 64 {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// Memory whose free waits until no persistent kernel runs.
#[derive(Clone, Copy, Debug)]
enum Deferred {
    /// GPU memory: its device address and the length asked for.
    Device {
        /// Device address of the first byte.
        ptr: u64,
        /// Length the owner was allocated with (the host backend's layout; CUDA needs none).
        #[cfg_attr(not(feature = "host-gpu"), allow(dead_code))]
        len: usize,
    },
    /// Pinned host memory: its host address and length.
    Host {
        /// Host address of the first byte.
        ptr: usize,
        /// Length the owner was allocated with (the host backend's layout; CUDA needs none).
        #[cfg_attr(not(feature = "host-gpu"), allow(dead_code))]
        len: usize,
    },
}

/// Persistent kernels running (the GPU-resident controller), and the frees held back
/// meanwhile: with CUDA, `cuMemFree` and `cuMemFreeHost` synchronise with the whole device, so
/// a free while a persistent kernel runs would wait for it to end (a hang); with `host-gpu`,
/// the CPU threads of a persistent kernel may still read the memory.
static PERSISTENT: std::sync::Mutex<(usize, Vec<Deferred>)> =
    std::sync::Mutex::new((0, Vec::new()));

/// Holds `what` back if a persistent kernel runs; returns whether it did.
fn defer_free(what: Deferred) -> bool {
    let mut p = PERSISTENT.lock().unwrap_or_else(|e| e.into_inner());
    if p.0 == 0 {
        return false;
    }
    p.1.push(what);
    true
}

/// Marks a persistent kernel as running: until [`persistent_kernel_ended`], frees of GPU and
/// pinned memory are held back instead of synchronising with the device.
pub fn persistent_kernel_started() {
    PERSISTENT.lock().unwrap_or_else(|e| e.into_inner()).0 += 1;
}

/// Counts a persistent kernel as ended; returns the frees held back meanwhile once none runs
/// any more (for the backend's `persistent_kernel_ended` to perform), else nothing.
fn persistent_kernel_count_ended() -> Vec<Deferred> {
    let mut p = PERSISTENT.lock().unwrap_or_else(|e| e.into_inner());
    p.0 = p.0.saturating_sub(1);
    if p.0 > 0 {
        return Vec::new();
    }
    std::mem::take(&mut p.1)
}
