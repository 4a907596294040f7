//! The crate's FFI boundary, the only place with `unsafe`: the GPU, as little of it as
//! gpu-queues needs, behind small owning types; and the operating-system calls of the
//! real-SSD transports, vfio-p2p and host-memory ([`os`]).
//!
//! The GPU is one of two backends with the same public API, chosen at build time:
//! - by default, the CUDA driver API (`cuda.rs`) through cudarc's `driver::sys` (dynamically
//!   loaded libcuda), so the crate builds and its CPU tests run where there is no CUDA.
//!   [`Cuda::open`] checks that libcuda can be loaded before the first CUDA call (cudarc panics
//!   otherwise) and returns [`GpuError::NoCuda`];
//! - with the `host-gpu` feature, a CPU stand-in (`host_gpu.rs`): the project's CUDA sources
//!   (`ptx/kernels/`, and the emulated controllers' `ptx/emu/`) compiled for the host by g++
//!   against `ptx/host/gpunvme_host.h`
//!   and run on CPU threads, "GPU memory" being host memory whose device address is its host
//!   address. It is a correctness harness, so that the GPU tests' logic runs in CI without a
//!   GPU: it is not a GPU, and nothing measured through it says anything about GPU
//!   performance.
//!
//! The public types are defined once, for both backends: `gpu.rs` ([`Cuda`], [`Library`],
//! [`Kernel`], [`GreenPartition`], [`Stream`], [`Event`], [`copy_to_gpu`]) and `memory.rs`
//! ([`DeviceMemory`], [`PinnedMemory`], [`HostRegistration`], the frees held back while a
//! kernel may be waiting for a controller), with what the backends share: the API and its
//! documentation, argument and bounds checks, host-side access to pinned memory, waits. Each holds its
//! backend's raw part, and the backend module (`backend`: `cuda.rs` or `host_gpu.rs`, with the
//! same names in both) has only what differs: the driver's calls, or the host runtime's.
//!
//! Memory the GPU or a controller may change is never reached through Rust references here:
//! host-side access to pinned memory is by volatile loads and stores and raw copies, with the
//! fences named where ordering matters.
//!
//! [`GpuError::NoCuda`]: crate::error::GpuError::NoCuda

use std::ffi::c_void;
use std::time::{Duration, Instant};

use crate::error::GpuError;

mod gpu;
mod memory;
pub mod os;

#[cfg(not(feature = "host-gpu"))]
mod cuda;
#[cfg(not(feature = "host-gpu"))]
use cuda as backend;

#[cfg(feature = "host-gpu")]
mod host_gpu;
#[cfg(feature = "host-gpu")]
use host_gpu as backend;

pub use backend::cuda_present;
pub use gpu::{Cuda, Event, GreenPartition, Kernel, Library, Stream, copy_to_gpu};
pub use memory::{
    DeviceMemory, HostRegistration, ManagedMemory, PinnedMemory, held_frees, held_frees_on,
    persistent_kernel_ended, persistent_kernel_started,
};

/// What a GPU is, read without opening it ([`Cuda::identify`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuIdentity {
    /// CUDA's ordinal in this process.
    pub ordinal: i32,
    /// Its name ("NVIDIA H200").
    pub name: String,
    /// Its UUID as `nvidia-smi -L` prints it (`GPU-...`).
    pub uuid: String,
    /// Its PCI address as sysfs spells it (`0000:3b:00.0`); `None` for the `host-gpu`
    /// stand-ins, which are on no bus.
    pub pci_bus_id: Option<String>,
}

/// A UUID's 16 bytes as `nvidia-smi -L` prints them: `GPU-` and 8-4-4-4-12 hex digits.
pub(crate) fn format_uuid(bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

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

/// The kernel parameter array of a launch (cuLaunchKernel's `kernelParams`, which the host
/// runtime takes too): a pointer to each argument's 64-bit slot, in order. Little-endian: a
/// `u32` parameter is read from the low half of its slot.
fn param_pointers(slots: &mut [u64]) -> Vec<*mut c_void> {
    slots
        .iter_mut()
        .map(|v| (v as *mut u64).cast::<c_void>())
        .collect()
}
