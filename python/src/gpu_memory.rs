//! The caller's GPU memory for one call (the Python boundary's other unsafe code, beside
//! `dlpack.rs`): a tensor's bytes borrowed as [`DeviceMemory`] after the driver confirmed they
//! are device memory of the GPU the caller named (the tensor's device), and the caller's
//! stream waited for (bounded) so work queued there before the call (the kernel that computed
//! a tensor being saved) has finished.

use std::sync::Arc;
use std::time::Duration;

use gpunvme::gpu_queues::ffi::{DeviceMemory, Event};
use gpunvme::gpu_queues::{Cuda, GpuError};

/// How long a call waits for work the caller queued on its stream before the call.
const STREAM_WAIT: Duration = Duration::from_secs(60);

/// `len` bytes of GPU memory at `ptr` (a tensor's `data_ptr`), checked by the driver to lie in
/// one allocation of device memory on `cuda`'s GPU.
///
/// The memory is the caller's: the Python layer holds the object that owns it for the whole
/// call, and the call drops what it made of it before returning.
pub fn borrow(cuda: &Arc<Cuda>, ptr: u64, len: usize) -> Result<Arc<DeviceMemory>, GpuError> {
    // SAFETY: `borrowed` has the driver check that the range is device memory of this GPU
    // inside one allocation (else an error). It stays allocated for the call: the Python
    // layer holds a reference to the tensor owning it until the native call returns, nothing
    // frees it on our side (the value frees nothing when dropped), and no command or copy
    // made during the call outlives it (every batch and copy is waited for before the call
    // returns). A controller thread may keep its mapping cached a little longer but does not
    // touch it without a command.
    let mem = unsafe { DeviceMemory::borrowed(cuda, ptr, len, Box::new(()))? };
    Ok(Arc::new(mem))
}

/// Waits, at most a minute, for the work queued so far on the caller's stream `stream` (a
/// `CUstream` as an integer, from `__cuda_array_interface__` or `torch.cuda.current_stream()`;
/// 0 is the NULL stream, 1 and 2 the legacy and per-thread default streams).
pub fn wait_stream(cuda: &Arc<Cuda>, stream: u64) -> Result<(), GpuError> {
    // SAFETY: the handle comes from the framework that owns the caller's tensor (its current
    // stream, or the stream its array interface names), in the primary context gpunvme
    // shares with it; 0, 1 and 2 name the default streams.
    unsafe { Event::wait_foreign(cuda, stream, STREAM_WAIT) }
}
