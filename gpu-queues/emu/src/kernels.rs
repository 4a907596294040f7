//! The emulated controllers' kernels (`ptx/emu/gpunvme_emu_kernels.cu`: the software
//! controller's scatter and gather copies, the GPU-resident controller model), loaded from the
//! embedded PTX. Every kernel is loaded (and its module warmed up) before any kernel that spins
//! is started: with lazy loading, the first launch of a kernel while a persistent kernel holds
//! the GPU was seen never to run (../shared/design/gpu.md, "Deadlocks seen").
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use gpu_queues::GpuError;
use gpu_queues::ffi::{Arg, Cuda, Kernel, Library, Stream};

use crate::desc::EMU_KERNELS_PTX;

/// The loaded kernels of `ptx/emu/gpunvme_emu_kernels.cu`.
pub struct EmuKernels {
    _lib: Library,
    /// `gpunvme_scatter` (the software controller's batched writes into GPU memory).
    pub scatter: Kernel,
    /// `gpunvme_gather` (its batched reads of GPU memory).
    pub gather: Kernel,
    /// `gpunvme_emu_warmup`.
    pub warmup: Kernel,
    /// `gpunvme_controller` (the GPU-resident controller model).
    pub controller: Kernel,
}

impl std::fmt::Debug for EmuKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuKernels").finish_non_exhaustive()
    }
}

impl EmuKernels {
    /// JIT-loads the embedded PTX and looks up every kernel.
    pub fn load(cuda: &Arc<Cuda>) -> Result<Arc<Self>, GpuError> {
        let lib = Library::load_ptx(cuda, EMU_KERNELS_PTX)?;
        Ok(Arc::new(Self {
            scatter: lib.kernel("gpunvme_scatter")?,
            gather: lib.kernel("gpunvme_gather")?,
            warmup: lib.kernel("gpunvme_emu_warmup")?,
            controller: lib.kernel("gpunvme_controller")?,
            _lib: lib,
        }))
    }

    /// Launches the module's empty kernel on `stream` and waits for it: after this, nothing of
    /// the module needs loading on that stream's context.
    pub fn warm_up(&self, stream: &Stream) -> Result<(), GpuError> {
        stream.launch(self.warmup, 1, 32, &[Arg::U64(0)])?;
        stream.wait_idle(Duration::from_secs(10))
    }

    /// Launches the scatter and gather kernels once on `stream` with no pieces (the scatter's
    /// block counter at `done_blocks`, which it leaves at 0) and waits: CUDA's lazy loading
    /// loads a kernel on its first launch, and that load may need a context synchronisation
    /// (the CUDA Programming Guide, "Lazy Loading", "Concurrent execution"): a first launch
    /// while a client kernel spins on the copy it would make could wait for that client, which
    /// waits for the copy, until the client's bound runs out.
    pub fn warm_up_copies(&self, stream: &Stream, done_blocks: u64) -> Result<(), GpuError> {
        stream.launch(
            self.scatter,
            1,
            32,
            &[Arg::U64(0), Arg::U32(0), Arg::U64(0), Arg::U64(done_blocks)],
        )?;
        stream.launch(self.gather, 1, 32, &[Arg::U64(0), Arg::U32(0), Arg::U64(0)])?;
        stream.wait_idle(Duration::from_secs(10))
    }
}
