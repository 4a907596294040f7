//! The CUDA driver backend of [`super`] (the default build): the driver API through cudarc's
//! `driver::sys` (dynamically loaded libcuda), as little of it as gpu-queues needs, behind
//! small owning types. [`Cuda::open`] checks that libcuda can be loaded before the first CUDA
//! call (cudarc panics otherwise) and returns [`GpuError::NoCuda`].
// UNSAFETY: this module is the FFI boundary to libcuda: raw handles, raw pointers into pinned
// memory, and kernel launches with untyped argument arrays.
#![expect(unsafe_code)]

use std::ffi::{CStr, CString, c_void};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::sys;

use super::{Arg, Deferred, Placement, defer_free, persistent_kernel_count_ended, poll_until};
use crate::error::GpuError;

fn check(call: &'static str, r: sys::CUresult) -> Result<(), GpuError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string (or leaves it null).
    let named = unsafe { sys::cuGetErrorName(r, &mut name) } == sys::CUresult::CUDA_SUCCESS;
    let message = if named && !name.is_null() {
        // SAFETY: a non-null result is a NUL-terminated static string owned by the driver.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{r:?}")
    };
    Err(GpuError::Cuda {
        call,
        code: r as i32,
        message,
    })
}

/// Whether libcuda can be loaded at all (checked once).
pub fn cuda_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the library; it has no preconditions.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// An opened GPU: its device handle and retained primary context.
pub struct Cuda {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    ordinal: i32,
    name: String,
    sm_count: u32,
    compute_capability: (i32, i32),
    /// Shared memory of one SM, and the most one block may opt in to (bytes).
    shared_per_sm: u32,
    shared_per_block: u32,
}

// SAFETY: CUDA driver handles may be used from any thread; every thread that calls into the
// driver first makes the context current (`Cuda::make_current`).
unsafe impl Send for Cuda {}
// SAFETY: as above; the type has no interior mutability of its own.
unsafe impl Sync for Cuda {}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl Cuda {
    /// Opens GPU `ordinal`: loads libcuda (error if absent), initialises the driver with eager
    /// module loading (lazy loading deadlocks next to spinning kernels), and retains the
    /// primary context.
    pub fn open(ordinal: i32) -> Result<Arc<Cuda>, GpuError> {
        if !cuda_present() {
            return Err(GpuError::NoCuda {
                reason: "libcuda.so could not be loaded (no NVIDIA driver on this machine, or \
                         it is not on LD_LIBRARY_PATH)"
                    .into(),
            });
        }
        if std::env::var_os("CUDA_MODULE_LOADING").is_none() {
            // SAFETY: set before the driver is initialised, from the thread opening the GPU;
            // gpunvme sets no other environment variables concurrently. The driver reads it at
            // cuInit.
            unsafe { std::env::set_var("CUDA_MODULE_LOADING", "EAGER") };
        }
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            check("cuInit", sys::cuInit(0)).map_err(|e| GpuError::NoCuda {
                reason: format!("the CUDA driver did not initialise: {e}"),
            })?;
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
            if ordinal < 0 || ordinal >= count {
                return Err(GpuError::NoCuda {
                    reason: format!("no GPU {ordinal} (the driver sees {count})"),
                });
            }
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal))?;
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            )?;
            check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
            let mut name = [0 as std::ffi::c_char; 128];
            check(
                "cuDeviceGetName",
                sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
            )?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let attr = |a| {
                let mut v = 0;
                check(
                    "cuDeviceGetAttribute",
                    sys::cuDeviceGetAttribute(&mut v, a, dev),
                )
                .map(|()| v)
            };
            use sys::CUdevice_attribute::*;
            let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
            let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let shared_per_sm = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?;
            let shared_per_block = attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
            Ok(Arc::new(Cuda {
                dev,
                ctx,
                ordinal,
                name,
                sm_count,
                compute_capability: (major, minor),
                shared_per_sm: shared_per_sm.max(0) as u32,
                shared_per_block: shared_per_block.max(0) as u32,
            }))
        }
    }

    /// Makes the primary context current on the calling thread (cheap when it already is).
    pub fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: the context is retained for as long as `self` lives.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// The GPU's name ("NVIDIA H100 80GB HBM3").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }
}

impl Kernel {
    /// Makes one block of this kernel take an SM to itself: sets its dynamic shared memory to
    /// more than half of an SM's (with what it declares statically), so that no second block
    /// of any kernel that needs shared memory fits beside it. With `all`, asks for all the
    /// shared memory a block may have instead (the controller model's held completions use
    /// it). Returns the dynamic bytes to pass at launch.
    pub fn reserve_whole_sm(&self, cuda: &Cuda, all: bool) -> Result<u32, GpuError> {
        let mut static_bytes = 0;
        // SAFETY: valid kernel handle and out-pointer.
        check("cuKernelGetAttribute", unsafe {
            sys::cuKernelGetAttribute(
                &mut static_bytes,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                self.raw,
                cuda.dev,
            )
        })?;
        let static_bytes = static_bytes.max(0) as u32;
        let want = if all {
            cuda.shared_per_block.saturating_sub(static_bytes)
        } else {
            (cuda.shared_per_sm / 2 + 1024).saturating_sub(static_bytes)
        };
        if want + static_bytes > cuda.shared_per_block {
            return Err(GpuError::Unsupported(format!(
                "cannot reserve an SM by shared memory ({} B per SM, {} B per block)",
                cuda.shared_per_sm, cuda.shared_per_block
            )));
        }
        // SAFETY: valid kernel handle; the value is within the device's opt-in limit.
        check("cuKernelSetAttribute", unsafe {
            sys::cuKernelSetAttribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                want as i32,
                self.raw,
                cuda.dev,
            )
        })?;
        Ok(want)
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `open`.
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// GPU memory from `cuMemAlloc` (not a stream-ordered pool: this memory is registered with a
/// controller and must stay put). Zeroed on allocation.
pub struct DeviceMemory {
    cuda: Arc<Cuda>,
    pub(super) ptr: u64,
    pub(super) len: usize,
}

impl DeviceMemory {
    /// Allocates `len` bytes (rounded up to 64 KiB granularity by the driver), zeroed.
    pub fn alloc(cuda: &Arc<Cuda>, len: usize) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; a zero-length request is refused by the driver.
        unsafe {
            check("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, len.max(1)))?;
            let mem = Self {
                cuda: cuda.clone(),
                ptr,
                len,
            };
            check("cuMemsetD8", sys::cuMemsetD8_v2(ptr, 0, len.max(1)))?;
            Ok(mem)
        }
    }

    /// Copies `data` to `offset` (synchronous; set-up and test path, not the hot path).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), GpuError> {
        let dst = self.range(offset, data.len())?;
        self.cuda.make_current()?;
        // SAFETY: the destination range lies in this allocation; the source is a live slice.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len())
        })
    }

    /// Copies bytes at `offset` into `buf` (synchronous).
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), GpuError> {
        let src = self.range(offset, buf.len())?;
        self.cuda.make_current()?;
        // SAFETY: the source range lies in this allocation; the destination is a live slice.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(buf.as_mut_ptr().cast(), src, buf.len())
        })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if defer_free(Deferred::Device {
            ptr: self.ptr,
            len: self.len,
        }) {
            return;
        }
        if self.cuda.make_current().is_ok() {
            // SAFETY: frees the allocation made in `alloc`, once.
            unsafe {
                sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// Marks a persistent kernel as ended (its stream is idle); when none runs any more, performs
/// the frees held back meanwhile.
pub fn persistent_kernel_ended(cuda: &Cuda) {
    let held = persistent_kernel_count_ended();
    if held.is_empty() || cuda.make_current().is_err() {
        return;
    }
    for d in held {
        // SAFETY: each was an allocation of this crate whose owner was dropped (so nothing
        // refers to it); it is freed once, here.
        unsafe {
            match d {
                Deferred::Device { ptr, .. } => {
                    sys::cuMemFree_v2(ptr);
                }
                Deferred::Host { ptr, .. } => {
                    sys::cuMemFreeHost(ptr as *mut c_void);
                }
            }
        }
    }
}

/// Page-locked host memory mapped into the GPU's address space (`cuMemHostAlloc` with
/// DEVICEMAP | PORTABLE): doorbell pages, the host's abort word, staging areas.
pub struct PinnedMemory {
    cuda: Arc<Cuda>,
    pub(super) host: *mut u8,
    dev: u64,
    pub(super) len: usize,
}

// SAFETY: the allocation is owned by this value; all access is through raw-pointer copies and
// volatile word accesses, which any thread may perform (the GPU does too).
unsafe impl Send for PinnedMemory {}
// SAFETY: as above: no method hands out references into the memory.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// Allocates `len` bytes of zeroed pinned memory mapped into the GPU.
    pub fn alloc(cuda: &Arc<Cuda>, len: usize) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let len = len.max(1).next_multiple_of(4096);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the flags ask for a mapping usable from every context.
        unsafe {
            check(
                "cuMemHostAlloc",
                sys::cuMemHostAlloc(
                    &mut host,
                    len,
                    sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                ),
            )?;
            let mut mem = Self {
                cuda: cuda.clone(),
                host: host.cast(),
                dev: 0,
                len,
            };
            std::ptr::write_bytes(mem.host, 0, len);
            let mut dev = 0;
            check(
                "cuMemHostGetDevicePointer",
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0),
            )?;
            mem.dev = dev;
            Ok(mem)
        }
    }

    /// The GPU's address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if defer_free(Deferred::Host {
            ptr: self.host as usize,
            len: self.len,
        }) {
            return;
        }
        if self.cuda.make_current().is_ok() {
            // SAFETY: frees the allocation made in `alloc`, once.
            unsafe {
                sys::cuMemFreeHost(self.host.cast());
            }
        }
    }
}

/// A context-independent library of kernels (`cuLibraryLoadData`), loaded from PTX text.
pub struct Library {
    lib: sys::CUlibrary,
    _cuda: Arc<Cuda>,
}

// SAFETY: library and kernel handles are context-independent driver objects, usable from any
// thread.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

/// A kernel of a [`Library`].
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    raw: sys::CUkernel,
}

// SAFETY: a CUkernel is a context-independent handle, valid while its library is loaded (the
// holder keeps the library).
unsafe impl Send for Kernel {}
// SAFETY: as above.
unsafe impl Sync for Kernel {}

impl Library {
    /// JIT-loads PTX text.
    pub fn load_ptx(cuda: &Arc<Cuda>, ptx: &str) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let text = CString::new(ptx)
            .map_err(|_| GpuError::InvalidArgument("PTX contains a NUL byte".into()))?;
        let mut lib = std::ptr::null_mut();
        // SAFETY: NUL-terminated image, no JIT or library options.
        check("cuLibraryLoadData", unsafe {
            sys::cuLibraryLoadData(
                &mut lib,
                text.as_ptr().cast(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        })?;
        Ok(Self {
            lib,
            _cuda: cuda.clone(),
        })
    }

    /// The kernel named `name` (an `extern "C"` entry point).
    pub fn kernel(&self, name: &str) -> Result<Kernel, GpuError> {
        let c = CString::new(name).map_err(|_| GpuError::InvalidArgument(name.into()))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid library handle and NUL-terminated name.
        check("cuLibraryGetKernel", unsafe {
            sys::cuLibraryGetKernel(&mut raw, self.lib, c.as_ptr())
        })?;
        Ok(Kernel { raw })
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: unloads the library loaded in `load_ptx`, once.
        unsafe {
            sys::cuLibraryUnload(self.lib);
        }
    }
}

/// SM partitions (green contexts): one for the controller's own kernels, the rest for clients,
/// so that a client kernel that fills its partition can never keep the controller's kernels
/// from running (../shared/design/gpu.md, "Deadlocks seen").
pub struct GreenPartition {
    controller: sys::CUgreenCtx,
    client: sys::CUgreenCtx,
    controller_sms: u32,
    client_sms: u32,
    _cuda: Arc<Cuda>,
}

// SAFETY: green context handles are driver objects usable from any thread.
unsafe impl Send for GreenPartition {}
// SAFETY: as above.
unsafe impl Sync for GreenPartition {}

impl GreenPartition {
    /// Splits the GPU's SMs: at least `controller_sms` (rounded up by the driver to its
    /// partition granularity) for the controller, the rest for clients.
    pub fn split(cuda: &Arc<Cuda>, controller_sms: u32) -> Result<Arc<Self>, GpuError> {
        cuda.make_current()?;
        // SAFETY: plain driver calls on zeroed POD out-structures.
        unsafe {
            let mut all: sys::CUdevResource = std::mem::zeroed();
            check(
                "cuDeviceGetDevResource",
                sys::cuDeviceGetDevResource(
                    cuda.dev,
                    &mut all,
                    sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
                ),
            )?;
            let mut group: sys::CUdevResource = std::mem::zeroed();
            let mut rest: sys::CUdevResource = std::mem::zeroed();
            let mut groups = 1u32;
            check(
                "cuDevSmResourceSplitByCount",
                sys::cuDevSmResourceSplitByCount(
                    &mut group,
                    &mut groups,
                    &all,
                    &mut rest,
                    0,
                    controller_sms.max(1),
                ),
            )?;
            let controller_sms = group.__bindgen_anon_1.sm.smCount;
            let client_sms = rest.__bindgen_anon_1.sm.smCount;
            if groups != 1 || client_sms == 0 {
                return Err(GpuError::Unsupported(format!(
                    "cannot reserve {controller_sms} SMs for the controller: {} SMs in all",
                    all.__bindgen_anon_1.sm.smCount
                )));
            }
            let make = |res: &mut sys::CUdevResource| -> Result<sys::CUgreenCtx, GpuError> {
                let mut desc = std::ptr::null_mut();
                check(
                    "cuDevResourceGenerateDesc",
                    sys::cuDevResourceGenerateDesc(&mut desc, res, 1),
                )?;
                let mut g = std::ptr::null_mut();
                check(
                    "cuGreenCtxCreate",
                    sys::cuGreenCtxCreate(
                        &mut g,
                        desc,
                        cuda.dev,
                        sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32,
                    ),
                )?;
                Ok(g)
            };
            let controller = make(&mut group)?;
            let client = match make(&mut rest) {
                Ok(c) => c,
                Err(e) => {
                    sys::cuGreenCtxDestroy(controller);
                    return Err(e);
                }
            };
            Ok(Arc::new(Self {
                controller,
                client,
                controller_sms,
                client_sms,
                _cuda: cuda.clone(),
            }))
        }
    }

    /// SMs reserved for the controller.
    pub fn controller_sms(&self) -> u32 {
        self.controller_sms
    }

    /// SMs left for client kernels.
    pub fn client_sms(&self) -> u32 {
        self.client_sms
    }
}

impl Drop for GreenPartition {
    fn drop(&mut self) {
        // SAFETY: destroys the contexts created in `split`, once; their streams are owned by
        // `Stream`s that hold an Arc to this partition, so they are gone already.
        unsafe {
            sys::cuGreenCtxDestroy(self.controller);
            sys::cuGreenCtxDestroy(self.client);
        }
    }
}

/// A non-blocking stream (never synchronises with the legacy default stream).
pub struct Stream {
    raw: sys::CUstream,
    cuda: Arc<Cuda>,
    _partition: Option<Arc<GreenPartition>>,
}

// SAFETY: stream handles may be used from any thread (the driver serialises internally); one
// owner at a time issues work in this crate.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream whose kernels run where `placement` says (`partition` is
    /// required for the green-context placements).
    pub fn new(
        cuda: &Arc<Cuda>,
        placement: Placement,
        partition: Option<&Arc<GreenPartition>>,
    ) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        let mut raw = std::ptr::null_mut();
        let green = match placement {
            Placement::Anywhere => None,
            Placement::Controller | Placement::Client => {
                let p = partition.ok_or_else(|| {
                    GpuError::InvalidArgument("a green-context stream needs a partition".into())
                })?;
                Some(if placement == Placement::Controller {
                    p.controller
                } else {
                    p.client
                })
            }
        };
        // SAFETY: valid out-pointer; the green context (if any) lives as long as `partition`,
        // which the stream keeps.
        unsafe {
            match green {
                None => check("cuStreamCreate", sys::cuStreamCreate(&mut raw, flags))?,
                Some(g) => check(
                    "cuGreenCtxStreamCreate",
                    sys::cuGreenCtxStreamCreate(&mut raw, g, flags, 0),
                )?,
            }
        }
        Ok(Self {
            raw,
            cuda: cuda.clone(),
            _partition: partition.cloned(),
        })
    }

    /// Launches `kernel` with `args` (each passed by value).
    pub fn launch(
        &self,
        kernel: Kernel,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        self.launch_with_shared(kernel, grid, block, 0, args)
    }

    /// Launches `kernel` with `shared` bytes of dynamic shared memory per block.
    pub fn launch_with_shared(
        &self,
        kernel: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        let mut storage: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        // Little-endian: a u32 argument is read from the low half of its u64 slot.
        let mut ptrs: Vec<*mut c_void> = storage
            .iter_mut()
            .map(|v| (v as *mut u64).cast::<c_void>())
            .collect();
        self.cuda.make_current()?;
        // SAFETY: `ptrs` points at one live value per kernel parameter, in order, each at
        // least as large as the parameter (u64 or u32 on a little-endian target); the caller
        // passes the kernel's signature (checked by the tests of each launch site). A CUkernel
        // may be passed where a CUfunction is expected (context-independent loading).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                kernel.raw.cast(),
                grid,
                1,
                1,
                block,
                1,
                1,
                shared,
                self.raw,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Queues a copy of `len` bytes from GPU address `src` into pinned memory at `offset`.
    pub fn copy_to_pinned(
        &self,
        dst: &PinnedMemory,
        offset: usize,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        let p = dst.at(offset, len);
        // SAFETY: destination range checked in `at`; the source is a GPU address the caller
        // vouches for (an allocation or a registered region); the copy is stream ordered.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(p.cast(), src, len, self.raw)
        })
    }

    /// Queues a copy of `len` bytes from pinned memory at `offset` to GPU address `dst`. The
    /// caller keeps those pinned bytes unchanged until the copy has run (an event after it).
    pub fn copy_from_pinned(
        &self,
        src: &PinnedMemory,
        offset: usize,
        dst: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        let p = src.at(offset, len);
        // SAFETY: source range checked in `at` and kept alive and unchanged by the caller until
        // the stream passes the copy; the destination is a GPU address the caller vouches for.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, p.cast_const().cast(), len, self.raw)
        })
    }

    /// Whether all work queued so far has finished (an error if any of it failed).
    pub fn is_idle(&self) -> Result<bool, GpuError> {
        // SAFETY: valid stream handle.
        let r = unsafe { sys::cuStreamQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuStreamQuery", r).map(|()| true)
    }

    /// Waits for the stream, at most `timeout`, polling (never an unbounded driver wait).
    pub fn wait_idle(&self, timeout: Duration) -> Result<(), GpuError> {
        poll_until("GPU stream", timeout, || self.is_idle())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.cuda.make_current().is_ok() {
            // SAFETY: destroys the stream created in `new`, once (pending work still runs).
            unsafe {
                sys::cuStreamDestroy_v2(self.raw);
            }
        }
    }
}

/// Copies `data` into GPU memory at `dst` on `stream` (pageable source: the call returns once
/// the bytes are staged).
pub fn copy_to_gpu(stream: &Stream, dst: u64, data: &[u8]) -> Result<(), GpuError> {
    stream.cuda.make_current()?;
    // SAFETY: `dst` is a GPU address the caller vouches for; the source is a live slice that
    // the driver stages before returning (pageable memory).
    check("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), stream.raw)
    })
}

/// A completion marker on a stream (`cuEventCreate` without timing).
pub struct Event {
    raw: sys::CUevent,
    cuda: Arc<Cuda>,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event (not yet recorded: it counts as complete).
    pub fn new(cuda: &Arc<Cuda>) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Self {
            raw,
            cuda: cuda.clone(),
        })
    }

    /// Marks the point in `stream` reached by the work queued so far.
    pub fn record(&self, stream: &Stream) -> Result<(), GpuError> {
        // SAFETY: both handles are live.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw)
        })
    }

    /// Whether the work before the last `record` has finished.
    pub fn is_done(&self) -> Result<bool, GpuError> {
        // SAFETY: live handle.
        let r = unsafe { sys::cuEventQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|()| true)
    }

    /// Waits for it, at most `timeout`, polling.
    pub fn wait(&self, timeout: Duration) -> Result<(), GpuError> {
        poll_until("GPU event", timeout, || self.is_done())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.cuda.make_current().is_ok() {
            // SAFETY: destroys the event created in `new`, once.
            unsafe {
                sys::cuEventDestroy_v2(self.raw);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Transports (b) and (c): host ranges registered with CUDA, the GPU's PCI address, dma-buf
// export of GPU memory.

impl Cuda {
    /// The GPU's PCI address as sysfs spells it (`0000:3b:00.0`: lower case), from
    /// `cuDeviceGetPCIBusId`.
    pub fn pci_bus_id(&self) -> Result<String, GpuError> {
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: valid buffer of the length passed; the driver NUL-terminates what it writes.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.dev)
        })?;
        // SAFETY: NUL-terminated by the driver within the buffer (zeroed beforehand as well).
        let id = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(id.to_string_lossy().to_ascii_lowercase())
    }
}

/// A host range registered with CUDA (`cuMemHostRegister`, DEVICEMAP | PORTABLE, plus
/// IOMEMORY for device registers) so GPU threads can reach it; unregistered on drop.
///
/// It does not own the range: whoever creates it keeps the range mapped for as long as it lives
/// (see [`HostRegistration::register`]).
pub struct HostRegistration {
    cuda: Arc<Cuda>,
    pub(super) host: *mut u8,
    pub(super) len: usize,
    dev: u64,
}

// SAFETY: the registration is a driver-side object; this type holds only its host address as
// a key and never dereferences it.
unsafe impl Send for HostRegistration {}
// SAFETY: as above: no method reads or writes the range.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// [`HostRegistration::register`], optionally `CU_MEMHOSTREGISTER_READ_ONLY` (the GPU
    /// only reads the range: what a read-only file mapping allows).
    ///
    /// # Safety
    /// As for [`HostRegistration::register`].
    pub unsafe fn register_with(
        cuda: &Arc<Cuda>,
        host: *mut u8,
        len: usize,
        io_memory: bool,
        read_only: bool,
    ) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let mut flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        if io_memory {
            flags |= sys::CU_MEMHOSTREGISTER_IOMEMORY;
        }
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        // SAFETY: the caller keeps the range mapped until drop, which unregisters it.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(host.cast(), len, flags)
        })?;
        let mut reg = Self {
            cuda: cuda.clone(),
            host,
            len,
            dev: 0,
        };
        reg.dev = reg.lookup(0)?;
        Ok(reg)
    }

    fn lookup(&self, offset: usize) -> Result<u64, GpuError> {
        let mut dev = 0;
        // SAFETY: `host + offset` lies in the registered range (callers check `offset < len`);
        // valid out-pointer.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dev, self.host.add(offset).cast(), 0)
        })?;
        Ok(dev)
    }

    /// GPU address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Asks the driver again for the GPU address of the byte at `offset` (a doorbell page,
    /// say) and checks that it is `device_ptr() + offset`: the registration covers that page.
    pub fn verify(&self, offset: usize) -> Result<u64, GpuError> {
        if offset >= self.len {
            return Err(GpuError::InvalidArgument(format!(
                "offset {offset:#x} outside a registration of {:#x} bytes",
                self.len
            )));
        }
        let got = self.lookup(offset)?;
        let want = self.dev + offset as u64;
        if got != want {
            return Err(GpuError::Unsupported(format!(
                "CUDA maps byte {offset:#x} of the registered range at {got:#x}, not {want:#x}: \
                 the registration does not cover that page as one range"
            )));
        }
        Ok(got)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.cuda.make_current().is_ok() {
            // SAFETY: unregisters the registration made in `register`, once; the range is
            // still mapped (the caller's contract).
            unsafe {
                sys::cuMemHostUnregister(self.host.cast());
            }
        }
    }
}

impl DeviceMemory {
    /// Exports `len` bytes at `offset` as a dma-buf file descriptor
    /// (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`). The range must
    /// be aligned to the GPU's page (64 KiB on current GPUs) or the driver refuses it.
    pub fn export_dma_buf(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<std::os::fd::OwnedFd, GpuError> {
        use std::os::fd::FromRawFd;
        let ptr = self.range(offset, len)?;
        self.cuda.make_current()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: the range lies in this allocation; `fd` is a valid out-pointer for an int.
        check("cuMemGetHandleForAddressRange", unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                ptr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        })?;
        if fd < 0 {
            return Err(GpuError::Unsupported(format!(
                "cuMemGetHandleForAddressRange returned fd {fd}"
            )));
        }
        // SAFETY: the driver just created this descriptor for us; nothing else owns it.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation, as GDRCopy asks of memory a
    /// third party reaches through BAR1: CUDA copies to it then complete before they return.
    pub fn set_sync_memops(&self) -> Result<(), GpuError> {
        self.cuda.make_current()?;
        let one: std::ffi::c_uint = 1;
        // SAFETY: valid pointer to a live value of the attribute's type, live allocation.
        check("cuPointerSetAttribute", unsafe {
            sys::cuPointerSetAttribute(
                (&one as *const std::ffi::c_uint).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
                self.ptr,
            )
        })
    }
}
