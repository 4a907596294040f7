//! The `host-gpu` backend of [`super`]: **not a GPU**. The project's CUDA sources
//! (`ptx/kernels/gpunvme_kernels.cu`, `ptx/emu/gpunvme_emu_kernels.cu` and the headers they
//! include) are compiled for the host by g++
//! against `ptx/host/gpunvme_host.h` (see `build.rs`), and a kernel launch runs them on CPU
//! threads (`ptx/host/gpunvme_host.cpp`: one OS thread per GPU thread). It is a correctness
//! harness, so that the GPU test suite's logic runs in CI on machines without a GPU; nothing
//! measured through it means anything about GPU performance, and the host's memory model is
//! stronger than the GPU's (a fence the GPU needs may be missing without anything showing
//! here).
//!
//! The API is the one both backends share (`gpu.rs`, `memory.rs`); this module holds the raw
//! parts behind it, with the names of the CUDA backend's (`cuda.rs`):
//! - "GPU memory" ([`DeviceMemory`]) is anonymous host memory mapped in 64 KiB units (the CUDA
//!   driver's granularity), lazily zeroed; its "device address" is its host address, so the
//!   software controller, the kernels' CPU threads and the CPU side all reach it directly.
//!   [`PinnedMemory`] and [`HostRegistration`] likewise: device address == host address.
//! - [`RawLibrary::load_ptx`] ignores the PTX (the kernels are compiled in) and
//!   [`RawLibrary::kernel`] asks the C++ runtime whether it has a kernel of that name.
//! - A stream ([`RawStream`]) is a worker thread running its queue of jobs (launches, copies,
//!   event records) in order; a launch blocks that thread until the grid has ended. A failed
//!   launch makes the stream's error sticky, as a CUDA context's is.
//! - [`Cuda`] is one of `GPUNVME_HOST_GPU_COUNT` stand-ins (default 1; each with its own frees
//!   held back and launch gate, the state CUDA keeps per device, while the harness's threads
//!   and its own held frees below are shared), made-up UUIDs and no PCI bus id; each reports
//!   `sm_count` 16 (environment `GPUNVME_HOST_GPU_SMS` overrides it), compute capability 9.0
//!   and an H100's shared-memory sizes; [`RawPartition::split`] only does the
//!   arithmetic of a split (every launch gets threads of its own; nothing is partitioned).
//! - Frees wait, as with CUDA, while a persistent kernel runs ([`super::persistent_kernel_started`]);
//!   here they also wait while any stream has work queued or running, since CPU threads of a
//!   kernel may still read the memory (with CUDA a free synchronises with the device instead).
// UNSAFETY: this module is the FFI boundary to the C++ runtime that runs the kernels on CPU
// threads (launches with untyped argument arrays) and owns the "GPU" memory those threads and
// the software controller share: raw mmap/munmap, copies through raw addresses that callers
// pass as device addresses, and volatile word accesses to memory other threads write.
#![expect(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::memory::{Deferred, PinnedOwner, map_zeroed};
use super::{Cuda, DeviceMemory, HostRegistration, PinnedMemory, Placement, param_pointers};
use crate::error::GpuError;

// SAFETY: these are the declarations of `ptx/host/gpunvme_host.cpp`'s two `extern "C"`
// functions (same parameter types: `uint32_t` = u32, `size_t` = usize, `void* const*` =
// `*const *mut c_void`); build.rs compiles and links that file whenever this module is built.
unsafe extern "C" {
    /// 1 if the host build has a kernel of that name, else 0.
    fn gpunvme_host_kernel_exists(name: *const c_char) -> c_int;
    /// Runs kernel `name` to completion on CPU threads (blocks concurrently, `block` threads
    /// each, `shared_bytes` of dynamic shared memory per block). `args[i]` points at parameter
    /// i's value (as cuLaunchKernel's kernelParams), `nargs` of them. Returns 0, or nonzero
    /// with a NUL-terminated message written into `err[..err_len]`.
    fn gpunvme_host_launch(
        name: *const c_char,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        args: *const *mut c_void,
        nargs: u32,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
}

/// The granularity and alignment of [`DeviceMemory`] (the CUDA driver's).
const DEVICE_UNIT: usize = 64 << 10;
/// The granularity and alignment of [`PinnedMemory`].
const PINNED_UNIT: usize = 4096;
/// SMs reported when `GPUNVME_HOST_GPU_SMS` is not set.
const DEFAULT_SMS: u32 = 16;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Always true: the host backend needs no driver.
pub fn cuda_present() -> bool {
    true
}

/// [`Cuda`]'s backend part: nothing (there is no driver, no context).
pub(super) struct RawCuda;

/// Stand-in GPUs when `GPUNVME_HOST_GPU_COUNT` is not set.
const DEFAULT_COUNT: i32 = 1;
/// Most stand-in GPUs.
const MAX_COUNT: u64 = 16;

/// [`Cuda::count`]: `GPUNVME_HOST_GPU_COUNT` (1 to 16), else 1.
pub(super) fn device_count() -> Result<i32, GpuError> {
    Ok(gpunvme_settings::HOST_GPU_COUNT
        .read_number_in(1, MAX_COUNT)
        .map_err(|e| GpuError::InvalidArgument(e.to_string()))?
        .map_or(DEFAULT_COUNT, |n| n as i32))
}

/// Stand-in `ordinal`'s name and made-up UUID, refused by name past the count.
fn stand_in(ordinal: i32) -> Result<(String, String), GpuError> {
    let count = device_count()?;
    if ordinal < 0 || ordinal >= count {
        return Err(GpuError::NoCuda {
            reason: format!(
                "no GPU {ordinal} (the host-gpu build has {count}, ordinals 0 to {}; \
                 GPUNVME_HOST_GPU_COUNT sets how many)",
                count - 1
            ),
        });
    }
    // The ordinal first, so that stand-ins differ from their first digits, as real GPUs'
    // random UUIDs do.
    let mut uuid = *b"\0gpunvme-hostgpu";
    uuid[0] = ordinal as u8;
    Ok((
        format!("host-gpu {ordinal} (CPU threads running the CUDA sources; not a GPU)"),
        super::format_uuid(uuid),
    ))
}

/// [`Cuda::identify`]: the stand-in's name and UUID; no PCI bus id.
pub(super) fn identify(ordinal: i32) -> Result<super::GpuIdentity, GpuError> {
    let (name, uuid) = stand_in(ordinal)?;
    Ok(super::GpuIdentity {
        ordinal,
        name,
        uuid,
        pci_bus_id: None,
    })
}

/// [`Cuda::open`]: stand-in GPU `ordinal` (of `GPUNVME_HOST_GPU_COUNT`, default 1), with fixed
/// numbers (see the module doc); its SM count is 16 unless `GPUNVME_HOST_GPU_SMS` gives
/// another (a positive integer).
pub(super) fn open(ordinal: i32) -> Result<Cuda, GpuError> {
    let (name, uuid) = stand_in(ordinal)?;
    // The harness (C++) reads these itself and would fall back on a bad value: refused here
    // first, so a typo is an error rather than a silent default.
    for s in [
        gpunvme_settings::HOST_GPU_THREADS,
        gpunvme_settings::HOST_GPU_WAIT_S,
        gpunvme_settings::HOST_GPU_SLEEP_NS,
    ] {
        s.read_number_in(1, u32::MAX as u64 - 1)
            .map_err(|e| GpuError::InvalidArgument(e.to_string()))?;
    }
    let sm_count = gpunvme_settings::HOST_GPU_SMS
        .read_number_in(1, u32::MAX as u64)
        .map_err(|e| GpuError::InvalidArgument(e.to_string()))?
        .map_or(DEFAULT_SMS, |n| n as u32);
    Ok(Cuda {
        raw: RawCuda,
        ordinal,
        name,
        sm_count,
        compute_capability: (9, 0),
        shared_per_sm: 233_472,
        shared_per_block: 232_448,
        uuid,
        holds: super::memory::holds_of(ordinal),
    })
}

impl RawCuda {
    /// Nothing to do: there is no context.
    pub(super) fn make_current(&self) -> Result<(), GpuError> {
        Ok(())
    }

    /// Refused: the stand-in has no peer-to-peer path.
    pub(super) fn p2p_write_ordering(&self) -> Result<i32, GpuError> {
        Err(GpuError::Unsupported(
            "the host-gpu build has no peer-to-peer writes".into(),
        ))
    }

    /// Refused: the stand-in is on no PCI bus.
    pub(super) fn pci_bus_id(&self) -> Result<String, GpuError> {
        Err(GpuError::Unsupported(
            "the host-gpu build has no GPU on a PCI bus (no PCI bus id)".into(),
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Memory: anonymous mappings, freed when nothing may still read them.

/// The mapped length of a [`DeviceMemory`] of `len` bytes.
fn device_map_len(len: usize) -> usize {
    len.max(1).next_multiple_of(DEVICE_UNIT)
}

/// Unmaps memory of a dropped [`DeviceMemory`] or [`PinnedMemory`] now.
fn free_now(what: Deferred) {
    let (addr, len) = match what {
        Deferred::Device { ptr, len } => (ptr as usize, device_map_len(len)),
        Deferred::Host { ptr, len } => (ptr, len),
        // Never made here (`alloc_pinned_large` is `alloc_pinned`).
        Deferred::Registered { .. } => return,
        // Never made here (RawLibrary::unload_later): the kernels are compiled in.
        Deferred::Library { .. } => return,
    };
    let p = std::ptr::with_exposed_provenance_mut::<c_void>(addr);
    // SAFETY: `addr..addr + len` is exactly one mapping made by `map_zeroed` for an owner that
    // has been dropped, and no job that might still use it is queued or running (`release`);
    // it is unmapped once, here.
    unsafe {
        libc::munmap(p, len);
    }
}

/// Jobs queued or running on all streams, and the frees held back until there are none.
struct Busy {
    jobs: usize,
    held: Vec<Deferred>,
}

static BUSY: Mutex<Busy> = Mutex::new(Busy {
    jobs: 0,
    held: Vec::new(),
});

/// Frees `what` now if no stream has work queued or running (a kernel's CPU threads or a
/// queued copy may still use it), else once none has.
fn release(what: Deferred) {
    {
        let mut b = lock(&BUSY);
        if b.jobs > 0 {
            b.held.push(what);
            return;
        }
    }
    free_now(what);
}

/// Counts a job as finished; performs the held frees when it was the last one in flight.
fn job_finished() {
    let held = {
        let mut b = lock(&BUSY);
        b.jobs -= 1;
        if b.jobs > 0 {
            return;
        }
        std::mem::take(&mut b.held)
    };
    for d in held {
        free_now(d);
    }
}

/// [`DeviceMemory::alloc`]: anonymous memory mapped in 64 KiB units (as the CUDA driver
/// rounds), zeroed (also when not asked to be: fresh anonymous pages are); its device address
/// is its host address (provenance exposed).
pub(super) fn alloc_device(
    cuda: &Arc<Cuda>,
    len: usize,
    _zeroed: bool,
) -> Result<DeviceMemory, GpuError> {
    let p = map_zeroed(device_map_len(len), DEVICE_UNIT, "host-gpu device memory")?;
    Ok(DeviceMemory {
        cuda: cuda.clone(),
        ptr: p.expose_provenance() as u64,
        len,
        owner: None,
    })
}

/// [`ManagedMemory::alloc`](super::ManagedMemory::alloc): host memory, as device memory is here.
pub(super) fn alloc_managed(cuda: &Arc<Cuda>, len: usize) -> Result<DeviceMemory, GpuError> {
    alloc_device(cuda, len, true)
}

/// [`DeviceMemory::borrowed`]'s check: the stand-in keeps no table of allocations, so only a
/// null pointer and a range past the address space are refused.
pub(super) fn check_device_range(_cuda: &Cuda, ptr: u64, len: usize) -> Result<(), GpuError> {
    if ptr == 0 || ptr.checked_add(len as u64).is_none() {
        return Err(GpuError::InvalidArgument(format!(
            "{len} bytes at {ptr:#x} are not GPU memory"
        )));
    }
    Ok(())
}

/// [`Cuda::memory_info`](super::Cuda::memory_info): refused, the stand-in has no GPU memory.
pub(super) fn memory_info(_cuda: &Cuda) -> Result<(u64, u64), GpuError> {
    Err(GpuError::Unsupported(
        "GPU memory information: the host-gpu build has no GPU".into(),
    ))
}

/// [`DeviceMemory::write`]: a copy to the device address, which is a host address.
///
/// # Safety
/// `dst..dst + data.len()` lies in a live allocation.
pub(super) unsafe fn write_device(_cuda: &Cuda, dst: u64, data: &[u8]) -> Result<(), GpuError> {
    if !data.is_empty() {
        let p = std::ptr::with_exposed_provenance_mut::<u8>(dst as usize);
        // SAFETY: the destination range lies in a live allocation (the caller's promise),
        // whose provenance was exposed when it was made; the source is a live slice; `copy`
        // tolerates overlap.
        unsafe { std::ptr::copy(data.as_ptr(), p, data.len()) }
    }
    Ok(())
}

/// [`DeviceMemory::write_rows`]: a copy per row.
///
/// # Safety
/// As [`write_device`] for every row (`dst + i * pitch`, `row` bytes).
pub(super) unsafe fn write_device_rows(
    cuda: &Cuda,
    dst: u64,
    data: &[u8],
    row: usize,
    pitch: usize,
) -> Result<(), GpuError> {
    for (i, r) in data.chunks(row).enumerate() {
        // SAFETY: every row lies in the live allocation (the caller's promise).
        unsafe { write_device(cuda, dst + (i * pitch) as u64, r)? }
    }
    Ok(())
}

/// [`DeviceMemory::read`]: a copy from the device address, which is a host address.
///
/// # Safety
/// `src..src + buf.len()` lies in a live allocation.
pub(super) unsafe fn read_device(_cuda: &Cuda, src: u64, buf: &mut [u8]) -> Result<(), GpuError> {
    if !buf.is_empty() {
        let p = std::ptr::with_exposed_provenance::<u8>(src as usize);
        // SAFETY: the source range lies in a live allocation (the caller's promise), whose
        // provenance was exposed when it was made; the destination is a live slice; `copy`
        // tolerates overlap.
        unsafe { std::ptr::copy(p, buf.as_mut_ptr(), buf.len()) }
    }
    Ok(())
}

/// Refused: there is no GPU memory to export (the vfio-p2p transport skips the host build).
pub(super) fn export_dma_buf(
    _cuda: &Cuda,
    _ptr: u64,
    _len: usize,
) -> Result<std::os::fd::OwnedFd, GpuError> {
    Err(GpuError::Unsupported(
        "dma-buf export of GPU memory: the host-gpu build has no GPU".into(),
    ))
}

/// Nothing to do (host memory copies are synchronous already).
pub(super) fn set_sync_memops(_cuda: &Cuda, _ptr: u64) -> Result<(), GpuError> {
    Ok(())
}

/// [`PinnedMemory::alloc`]: zeroed anonymous memory in whole pages, whose device address is its
/// host address (provenance exposed).
pub(super) fn alloc_pinned(cuda: &Arc<Cuda>, len: usize) -> Result<PinnedMemory, GpuError> {
    let len = len.max(1).next_multiple_of(PINNED_UNIT);
    let host = map_zeroed(len, PINNED_UNIT, "host-gpu pinned memory")?;
    Ok(PinnedMemory {
        cuda: cuda.clone(),
        host,
        dev: host.expose_provenance() as u64,
        len,
        owner: PinnedOwner::Allocated,
    })
}

/// [`PinnedMemory::alloc_large`]: as [`alloc_pinned`] (nothing to pin on the host).
pub(super) fn alloc_pinned_large(cuda: &Arc<Cuda>, len: usize) -> Result<PinnedMemory, GpuError> {
    alloc_pinned(cuda, len)
}

/// Frees the memory of a dropped owner: unmaps it now if no stream has work in flight, else
/// once none has ([`release`]).
///
/// # Safety
/// `what` is an allocation of this crate whose owner is gone (nothing refers to it), freed
/// once.
pub(super) unsafe fn free(_cuda: &Cuda, what: Deferred) {
    release(what);
}

/// [`HostRegistration::register_with`]: nothing to register; the device address is the host
/// address (provenance exposed). `io_memory` and `read_only` are accepted and ignored.
///
/// # Safety
/// As for [`HostRegistration::register`].
pub(super) unsafe fn register(
    cuda: &Arc<Cuda>,
    host: *mut u8,
    len: usize,
    _io_memory: bool,
    _read_only: bool,
) -> Result<HostRegistration, GpuError> {
    Ok(HostRegistration {
        cuda: cuda.clone(),
        host,
        len,
        dev: host.expose_provenance() as u64,
    })
}

/// The device address of the registered byte at `offset`: its host address.
pub(super) fn registered_address(reg: &HostRegistration, offset: usize) -> Result<u64, GpuError> {
    Ok(reg.dev + offset as u64)
}

/// Nothing to unregister.
///
/// # Safety
/// Called once, from its drop (nothing is done either way).
pub(super) unsafe fn unregister(_cuda: &Cuda, _host: *mut u8) {}

// ---------------------------------------------------------------------------------------------
// Kernels.

/// [`super::Library`]'s backend part: nothing; the kernels are compiled into this build, and
/// loading PTX is a formality.
pub(super) struct RawLibrary;

/// [`super::Kernel`]'s backend part: its name, as the C++ runtime knows it.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawKernel {
    pub(super) name: &'static CStr,
}

/// Kernel names handed out, each leaked once so that [`RawKernel`] stays `Copy`.
static KERNEL_NAMES: Mutex<BTreeMap<String, &'static CStr>> = Mutex::new(BTreeMap::new());

impl RawLibrary {
    /// Nothing to unload: the kernels are compiled into this build.
    pub(super) fn unload_later(&self) -> Option<Deferred> {
        None
    }

    /// Ignores the PTX text: the kernels are compiled into this build from the CUDA sources.
    pub(super) fn load_ptx(_cuda: &Cuda, _ptx: &str) -> Result<Self, GpuError> {
        Ok(Self)
    }

    /// The kernel named `name`, if the host build has it; else `CUDA_ERROR_NOT_FOUND` from
    /// `cuLibraryGetKernel`, as CUDA says.
    pub(super) fn kernel(&self, name: &str, c_name: CString) -> Result<RawKernel, GpuError> {
        // SAFETY: a NUL-terminated string that outlives the call; the function only reads it.
        if unsafe { gpunvme_host_kernel_exists(c_name.as_ptr()) } != 1 {
            return Err(GpuError::Cuda {
                call: "cuLibraryGetKernel",
                code: 500,
                message: format!("CUDA_ERROR_NOT_FOUND (the host-gpu build has no kernel {name})"),
            });
        }
        let mut names = lock(&KERNEL_NAMES);
        let name = *names
            .entry(name.to_owned())
            .or_insert_with(|| Box::leak(c_name.into_boxed_c_str()));
        Ok(RawKernel { name })
    }
}

impl RawKernel {
    /// None: kernels declare no shared memory statically in the host build.
    pub(super) fn static_shared_bytes(self, _cuda: &Cuda) -> Result<u32, GpuError> {
        Ok(0)
    }

    /// Nothing to set: the host runtime allocates what a launch asks for.
    pub(super) fn set_max_dynamic_shared(self, _cuda: &Cuda, _bytes: u32) -> Result<(), GpuError> {
        Ok(())
    }
}

/// [`super::GreenPartition`]'s backend part: nothing; the host runs every launch on threads of
/// its own, so nothing is reserved.
pub(super) struct RawPartition;

impl RawPartition {
    /// The split by count only: `controller_sms` (at least 1) for the controller, the rest of
    /// the reported SMs for clients; refused if none would be left for clients.
    pub(super) fn split(cuda: &Cuda, controller_sms: u32) -> Result<(Self, u32, u32), GpuError> {
        Self::split_several(cuda, 1, controller_sms)?
            .pop()
            .ok_or_else(|| GpuError::Unsupported("the SM split made no partition".into()))
    }

    /// The split by count only: `groups` partitions of `controller_sms` (at least 1) each, the
    /// rest of the reported SMs for clients; refused if none would be left for clients.
    pub(super) fn split_several(
        cuda: &Cuda,
        groups: u32,
        controller_sms: u32,
    ) -> Result<Vec<(Self, u32, u32)>, GpuError> {
        let controller_sms = controller_sms.max(1);
        let groups = groups.max(1);
        let client_sms = cuda
            .sm_count
            .saturating_sub(controller_sms.saturating_mul(groups));
        if client_sms == 0 {
            return Err(GpuError::Unsupported(format!(
                "cannot reserve {groups} partitions of {controller_sms} SMs for controllers \
                 and keep SMs for clients: {} SMs in all",
                cuda.sm_count
            )));
        }
        Ok((0..groups)
            .map(|_| (Self, controller_sms, client_sms))
            .collect())
    }
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

/// A failure that sticks to a stream (or to the event recorded after it).
#[derive(Clone, Debug)]
struct Failure {
    call: &'static str,
    code: i32,
    message: String,
}

impl Failure {
    fn error(&self) -> GpuError {
        GpuError::Cuda {
            call: self.call,
            code: self.code,
            message: self.message.clone(),
        }
    }
}

/// One unit of a stream's work, run by its worker in order.
enum Job {
    /// A kernel launch, its arguments each in a 64-bit slot.
    Launch {
        kernel: RawKernel,
        grid: u32,
        block: u32,
        shared: u32,
        args: Vec<u64>,
    },
    /// A copy between raw addresses (pinned memory and device addresses).
    Copy { dst: usize, src: usize, len: usize },
    /// A copy of bytes taken at enqueue time to a device address.
    Upload { dst: usize, data: Vec<u8> },
    /// An event's record: marks generation `generation` of `event` reached.
    Record {
        event: Arc<Mutex<EventState>>,
        generation: u64,
    },
}

struct StreamState {
    queue: VecDeque<Job>,
    /// Whether the worker is running a job it took off the queue.
    running: bool,
    /// The first failure, sticky.
    failure: Option<Failure>,
    /// The `Stream` was dropped: the worker leaves once the queue is empty.
    closed: bool,
}

struct StreamShared {
    state: Mutex<StreamState>,
    wake: Condvar,
}

/// [`super::Stream`]'s backend part: a worker thread running its jobs (launches, copies, event
/// records) in order.
pub(super) struct RawStream {
    shared: Arc<StreamShared>,
}

impl RawStream {
    /// A new stream with a worker thread of its own. The placement (`green`, checked by the
    /// caller) has no effect.
    pub(super) fn new(
        _cuda: &Cuda,
        _green: Option<(&RawPartition, Placement)>,
    ) -> Result<Self, GpuError> {
        let shared = Arc::new(StreamShared {
            state: Mutex::new(StreamState {
                queue: VecDeque::new(),
                running: false,
                failure: None,
                closed: false,
            }),
            wake: Condvar::new(),
        });
        let worker = shared.clone();
        std::thread::Builder::new()
            .name("host-gpu-stream".into())
            .spawn(move || run_stream(&worker))
            .map_err(|source| GpuError::Os {
                op: "starting a host-gpu stream's worker thread".into(),
                source,
            })?;
        Ok(Self { shared })
    }

    /// Queues `job`, unless the stream has failed (then its error, as CUDA returns a sticky
    /// error from every later call).
    fn enqueue(&self, job: Job) -> Result<(), GpuError> {
        self.try_enqueue(job).map_err(|f| f.error())
    }

    /// [`RawStream::enqueue`], the failure as it sticks to the stream.
    fn try_enqueue(&self, job: Job) -> Result<(), Failure> {
        let mut st = lock(&self.shared.state);
        if let Some(f) = &st.failure {
            return Err(f.clone());
        }
        lock(&BUSY).jobs += 1;
        st.queue.push_back(job);
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Queues a launch of `kernel`, its arguments each in a 64-bit slot of `args`; refuses an
    /// empty grid or block, or more than 1024 threads a block, at once (not sticky), as
    /// cuLaunchKernel does.
    pub(super) fn launch(
        &self,
        _cuda: &Cuda,
        kernel: RawKernel,
        grid: u32,
        block: u32,
        shared: u32,
        args: Vec<u64>,
    ) -> Result<(), GpuError> {
        if grid == 0 || block == 0 || block > 1024 {
            // What cuLaunchKernel says at once for such a configuration (not sticky).
            return Err(GpuError::Cuda {
                call: "cuLaunchKernel",
                code: 1,
                message: format!(
                    "CUDA_ERROR_INVALID_VALUE ({grid} blocks of {block} threads of {:?})",
                    kernel.name
                ),
            });
        }
        self.enqueue(Job::Launch {
            kernel,
            grid,
            block,
            shared,
            args,
        })
    }

    /// Queues a copy of `len` bytes from device address `src` to host memory `dst`.
    ///
    /// # Safety
    /// `dst..dst + len` stays live until the copy has run.
    pub(super) unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        self.enqueue(Job::Copy {
            dst: dst.expose_provenance(),
            src: src as usize,
            len,
        })
    }

    /// Queues a copy of `len` bytes from host memory `src` to device address `dst`.
    ///
    /// # Safety
    /// `src..src + len` stays live and unchanged until the copy has run.
    pub(super) unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        self.enqueue(Job::Copy {
            dst: dst as usize,
            src: src.expose_provenance(),
            len,
        })
    }

    /// Queues a copy of `len` bytes from device address `src` to device address `dst`.
    ///
    /// # Safety
    /// Both ranges stay mapped until the copy has run.
    pub(super) unsafe fn copy_device(
        &self,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        self.enqueue(Job::Copy {
            dst: dst as usize,
            src: src as usize,
            len,
        })
    }

    /// [`super::copy_to_gpu`]: the bytes are taken now (the caller may reuse `data` at once),
    /// the copy runs in stream order.
    pub(super) fn upload(&self, _cuda: &Cuda, dst: u64, data: &[u8]) -> Result<(), GpuError> {
        self.enqueue(Job::Upload {
            dst: dst as usize,
            data: data.to_vec(),
        })
    }

    /// Whether the queue is empty and no job runs (an error if one failed).
    pub(super) fn is_idle(&self) -> Result<bool, GpuError> {
        let st = lock(&self.shared.state);
        if let Some(f) = &st.failure {
            return Err(f.error());
        }
        Ok(st.queue.is_empty() && !st.running)
    }

    /// Closes the stream: queued work still runs (as with cuStreamDestroy); the worker is not
    /// joined, since a persistent kernel may keep it for a long time.
    ///
    /// # Safety
    /// Called once, by the owner's drop (nothing is queued after).
    pub(super) unsafe fn destroy(&self, _cuda: &Cuda) {
        lock(&self.shared.state).closed = true;
        self.shared.wake.notify_all();
    }
}

/// A stream's worker: runs its jobs in order until the stream is dropped and the queue drained.
fn run_stream(shared: &StreamShared) {
    loop {
        let (job, failed) = {
            let mut st = lock(&shared.state);
            loop {
                if let Some(job) = st.queue.pop_front() {
                    st.running = true;
                    break (job, st.failure.clone());
                }
                if st.closed {
                    return;
                }
                st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let result = run_job(job, failed);
        {
            let mut st = lock(&shared.state);
            st.running = false;
            if let Err(f) = result {
                st.failure.get_or_insert(f);
            }
        }
        job_finished();
    }
}

/// Runs one job; `failed`: the stream's sticky failure, if any (then launches and copies are
/// skipped, and an event record carries the failure).
fn run_job(job: Job, failed: Option<Failure>) -> Result<(), Failure> {
    match job {
        Job::Record { event, generation } => {
            let mut e = lock(&event);
            e.completed = e.completed.max(generation);
            if generation == e.recorded {
                e.failure = failed;
            }
            Ok(())
        }
        _ if failed.is_some() => Ok(()),
        Job::Launch {
            kernel,
            grid,
            block,
            shared,
            mut args,
        } => launch_now(kernel, grid, block, shared, &mut args),
        Job::Copy { dst, src, len } => {
            if len > 0 {
                let d = std::ptr::with_exposed_provenance_mut::<u8>(dst);
                let s = std::ptr::with_exposed_provenance::<u8>(src);
                // SAFETY: one side is a range of live pinned memory checked by `at` when the
                // job was queued; the other a device address the caller vouches for (an
                // allocation or a registered range), as with cuMemcpy*Async. Neither can have
                // been freed since: frees wait while any job is queued or running (`release`).
                unsafe { std::ptr::copy(s, d, len) }
            }
            Ok(())
        }
        Job::Upload { dst, data } => {
            if !data.is_empty() {
                let d = std::ptr::with_exposed_provenance_mut::<u8>(dst);
                // SAFETY: `dst` is a device address the caller vouches for, holding
                // `data.len()` bytes (as with cuMemcpyHtoDAsync); the source is owned here.
                unsafe { std::ptr::copy(data.as_ptr(), d, data.len()) }
            }
            Ok(())
        }
    }
}

/// Runs a kernel to completion on CPU threads through the C++ runtime.
fn launch_now(
    kernel: RawKernel,
    grid: u32,
    block: u32,
    shared: u32,
    args: &mut [u64],
) -> Result<(), Failure> {
    let ptrs = param_pointers(args);
    let nargs = u32::try_from(ptrs.len()).unwrap_or(u32::MAX);
    let mut err = [0u8; 1024];
    // SAFETY: `kernel.name` is a NUL-terminated static string; `ptrs` points at one live
    // value per kernel parameter, in order, each at least as large as the parameter (u64, or
    // u32 on a little-endian target), and the runtime checks the count against the kernel's;
    // the caller passes the kernel's signature (checked by the tests of each launch site), as
    // with cuLaunchKernel. `err` is writable for the length passed.
    let rc = unsafe {
        gpunvme_host_launch(
            kernel.name.as_ptr(),
            grid,
            block,
            shared,
            ptrs.as_ptr(),
            nargs,
            err.as_mut_ptr().cast::<c_char>(),
            err.len(),
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let message = CStr::from_bytes_until_nul(&err)
        .ok()
        .map(|m| m.to_string_lossy().into_owned())
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| format!("{:?}: host launch failed", kernel.name));
    Err(Failure {
        call: "cuLaunchKernel",
        code: rc,
        message,
    })
}

/// An event's records and completions, by generation (each record a new one).
struct EventState {
    recorded: u64,
    completed: u64,
    /// The failure of the stream the last record ran on, if it had failed.
    failure: Option<Failure>,
}

/// [`super::Event`]'s backend part: its records and completions, shared with the jobs that
/// record it.
pub(super) struct RawEvent {
    state: Arc<Mutex<EventState>>,
}

impl RawEvent {
    /// A new event (not yet recorded: it counts as complete).
    pub(super) fn new(_cuda: &Cuda) -> Result<Self, GpuError> {
        Ok(Self {
            state: Arc::new(Mutex::new(EventState {
                recorded: 0,
                completed: 0,
                failure: None,
            })),
        })
    }

    /// A record on a stream of another library: the stand-in has none (nothing runs on
    /// them), so there is nothing to wait for and the event stays complete.
    ///
    /// # Safety
    /// Nothing is required here (CUDA's build requires a live stream).
    pub(super) unsafe fn record_foreign(&self, _cuda: &Cuda, _stream: u64) -> Result<(), GpuError> {
        Ok(())
    }

    /// Queues a record on `stream`: a new generation, completed when the job runs.
    pub(super) fn record(&self, stream: &RawStream) -> Result<(), GpuError> {
        let generation = {
            let mut e = lock(&self.state);
            e.recorded += 1;
            e.failure = None;
            e.recorded
        };
        stream
            .try_enqueue(Job::Record {
                event: self.state.clone(),
                generation,
            })
            .map_err(|f| {
                // The stream had failed: this record stands for that failure (as the sticky
                // error CUDA would report for it), not for work that never finishes.
                let mut e = lock(&self.state);
                if e.recorded == generation {
                    e.completed = generation;
                    e.failure = Some(f.clone());
                }
                f.error()
            })
    }

    /// Whether the last record has completed (an error if the stream had failed by then).
    pub(super) fn is_done(&self) -> Result<bool, GpuError> {
        let e = lock(&self.state);
        if let Some(f) = &e.failure {
            return Err(f.error());
        }
        Ok(e.completed >= e.recorded)
    }

    /// Nothing to destroy.
    ///
    /// # Safety
    /// Called once, by the owner's drop (nothing is done either way).
    pub(super) unsafe fn destroy(&self, _cuda: &Cuda) {}
}

#[cfg(test)]
mod tests {
    use super::super::{
        Arg, DeviceMemory, Event, GreenPartition, Library, Stream, copy_to_gpu, poll_until,
    };
    use super::*;
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(60);

    fn cuda() -> Arc<Cuda> {
        Cuda::open(0).expect("host-gpu opens")
    }

    #[test]
    fn reports_the_stand_in_and_only_gpu_0() {
        let cuda = cuda();
        assert!(cuda_present());
        assert!(cuda.name().contains("not a GPU"));
        assert_eq!(cuda.compute_capability(), (9, 0));
        assert!(matches!(Cuda::open(1), Err(GpuError::NoCuda { .. })));
        assert!(matches!(cuda.pci_bus_id(), Err(GpuError::Unsupported(_))));
    }

    #[test]
    fn device_memory_is_zeroed_aligned_and_bounds_checked() {
        let cuda = cuda();
        let m = DeviceMemory::alloc(&cuda, 100).unwrap();
        assert_eq!(m.ptr() % DEVICE_UNIT as u64, 0);
        let mut b = [0xffu8; 100];
        m.read(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        m.write(10, &[1, 2, 3]).unwrap();
        let mut c = [0u8; 3];
        m.read(10, &mut c).unwrap();
        assert_eq!(c, [1, 2, 3]);
        assert!(matches!(
            m.write(99, &[1, 2]),
            Err(GpuError::InvalidArgument(_))
        ));
        assert!(m.export_dma_buf(0, 100).is_err());
        let empty = DeviceMemory::alloc(&cuda, 0).unwrap();
        assert!(empty.is_empty());
    }

    #[test]
    fn pinned_memory_device_address_is_its_host_address() {
        let cuda = cuda();
        let p = PinnedMemory::alloc(&cuda, 10).unwrap();
        assert_eq!(p.len(), 4096);
        assert_eq!(p.device_ptr(), p.host_ptr() as u64);
        assert_eq!(p.load_u32(8), 0);
        p.store_u32(8, 0xdead_beef);
        assert_eq!(p.load_u32(8), 0xdead_beef);
        // SAFETY: the range is the live pinned allocation above, which outlives `reg`.
        let reg =
            unsafe { HostRegistration::register(&cuda, p.host_ptr(), p.len(), false) }.unwrap();
        assert_eq!(reg.device_ptr(), p.device_ptr());
        assert_eq!(reg.verify(4095).unwrap(), p.device_ptr() + 4095);
        assert!(reg.verify(4096).is_err());
    }

    #[test]
    fn kernels_are_looked_up_by_name() {
        let cuda = cuda();
        let lib = Library::load_ptx(&cuda, "").unwrap();
        let k = lib.kernel("gpunvme_warmup").unwrap();
        assert_eq!(k.raw.name, c"gpunvme_warmup");
        match lib.kernel("gpunvme_no_such_kernel") {
            Err(GpuError::Cuda { call, code, .. }) => {
                assert_eq!((call, code), ("cuLibraryGetKernel", 500));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(k.reserve_whole_sm(&cuda, true).unwrap(), 232_448);
        assert_eq!(
            k.reserve_whole_sm(&cuda, false).unwrap(),
            233_472 / 2 + 1024
        );
    }

    #[test]
    fn partitions_split_the_reported_sms() {
        let cuda = cuda();
        let p = GreenPartition::split(&cuda, 0).unwrap();
        assert_eq!(p.controller_sms() + p.client_sms(), cuda.sm_count());
        assert_eq!(p.controller_sms(), 1);
        assert!(GreenPartition::split(&cuda, cuda.sm_count()).is_err());
        assert!(Stream::new(&cuda, Placement::Client, None).is_err());
        Stream::new(&cuda, Placement::Client, Some(&p)).unwrap();
    }

    #[test]
    fn stream_runs_launches_copies_and_records_in_order() {
        let cuda = cuda();
        let lib = Library::load_ptx(&cuda, "").unwrap();
        let warmup = lib.kernel("gpunvme_warmup").unwrap();
        let s = Stream::new(&cuda, Placement::Anywhere, None).unwrap();
        let ev = Event::new(&cuda).unwrap();
        assert!(ev.is_done().unwrap());
        let mem = DeviceMemory::alloc(&cuda, 4096).unwrap();
        let pinned = PinnedMemory::alloc(&cuda, 4096).unwrap();
        s.launch(warmup, 2, 64, &[Arg::U64(0)]).unwrap();
        let mut data = vec![7u8; 64];
        copy_to_gpu(&s, mem.ptr() + 128, &data).unwrap();
        data.fill(0); // the copy took the bytes at the call
        s.copy_to_pinned(&pinned, 0, mem.ptr() + 128, 64).unwrap();
        ev.record(&s).unwrap();
        ev.wait(WAIT).unwrap();
        let mut out = [0u8; 64];
        pinned.read(0, &mut out);
        assert_eq!(out, [7u8; 64]);
        pinned.write(0, &[9u8; 16]);
        s.copy_from_pinned(&pinned, 0, mem.ptr(), 16).unwrap();
        s.wait_idle(WAIT).unwrap();
        let mut back = [0u8; 16];
        mem.read(0, &mut back).unwrap();
        assert_eq!(back, [9u8; 16]);
        assert!(
            s.launch(warmup, 0, 32, &[Arg::U64(0)]).is_err(),
            "an empty grid is refused at once"
        );
        assert!(s.is_idle().unwrap(), "that refusal does not stick");
    }

    #[test]
    fn a_failed_launch_sticks_to_its_stream() {
        let cuda = cuda();
        let lib = Library::load_ptx(&cuda, "").unwrap();
        let warmup = lib.kernel("gpunvme_warmup").unwrap();
        let s = Stream::new(&cuda, Placement::Anywhere, None).unwrap();
        // One parameter too many: the runtime refuses the launch.
        s.launch(warmup, 1, 32, &[Arg::U64(0), Arg::U32(1)])
            .unwrap();
        let err = poll_until("failure", WAIT, || match s.is_idle() {
            Ok(_) => Ok(false),
            Err(GpuError::Cuda { call, code, .. }) => {
                assert_eq!(call, "cuLaunchKernel");
                assert_ne!(code, 0);
                Ok(true)
            }
            Err(e) => Err(e),
        });
        err.unwrap();
        assert!(s.is_idle().is_err(), "sticky");
        assert!(s.launch(warmup, 1, 32, &[Arg::U64(0)]).is_err());
        let ev = Event::new(&cuda).unwrap();
        assert!(ev.record(&s).is_err());
        assert!(ev.is_done().is_err());
        // Other streams are unaffected.
        let t = Stream::new(&cuda, Placement::Anywhere, None).unwrap();
        t.launch(warmup, 1, 32, &[Arg::U64(0)]).unwrap();
        t.wait_idle(WAIT).unwrap();
    }
}
