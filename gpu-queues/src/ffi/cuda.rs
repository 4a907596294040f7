//! The CUDA driver backend of [`super`] (the default build): the driver API through cudarc's
//! `driver::sys` (dynamically loaded libcuda), as little of it as gpu-queues needs. It holds
//! the raw driver handles inside the shared types ([`RawCuda`] in [`Cuda`], [`RawStream`] in
//! [`super::Stream`], ...) and makes the driver calls behind their methods; the API, its checks
//! and its documentation are in `gpu.rs` and `memory.rs`. [`open`] checks that libcuda can be
//! loaded before the first CUDA call (cudarc panics otherwise) and returns
//! [`GpuError::NoCuda`].
// UNSAFETY: this module is the FFI boundary to libcuda: raw handles, raw pointers into pinned
// memory, and kernel launches with untyped argument arrays.
#![expect(unsafe_code)]

use std::ffi::{CStr, CString, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;

use super::memory::{Deferred, PinnedOwner, map_zeroed};
use super::{Cuda, DeviceMemory, HostRegistration, PinnedMemory, Placement, param_pointers};
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

/// The answer of a query call (`cuStreamQuery`, `cuEventQuery`): `CUDA_ERROR_NOT_READY` is
/// "not yet", success "done", anything else an error.
fn query(call: &'static str, r: sys::CUresult) -> Result<bool, GpuError> {
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(call, r).map(|()| true)
}

/// Whether libcuda can be loaded at all (checked once).
pub fn cuda_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the library; it has no preconditions.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// [`Cuda`]'s driver part: the device handle and its retained primary context (released on
/// drop).
pub(super) struct RawCuda {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: CUDA driver handles may be used from any thread; every thread that calls into the
// driver first makes the context current (`Cuda::make_current`).
unsafe impl Send for RawCuda {}
// SAFETY: as above; the type has no interior mutability of its own.
unsafe impl Sync for RawCuda {}

/// Loads libcuda (error if absent) and initialises the driver with eager module loading (lazy
/// loading deadlocks next to spinning kernels); returns the number of GPUs it sees.
fn init() -> Result<i32, GpuError> {
    if !cuda_present() {
        return Err(GpuError::NoCuda {
            reason: "libcuda.so could not be loaded (no NVIDIA driver on this machine, or it \
                     is not on LD_LIBRARY_PATH)"
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
        Ok(count)
    }
}

/// [`Cuda::count`].
pub(super) fn device_count() -> Result<i32, GpuError> {
    init()
}

/// The device of `ordinal`, refused by name when the driver has no such GPU.
fn device(ordinal: i32) -> Result<sys::CUdevice, GpuError> {
    let count = init()?;
    if ordinal < 0 || ordinal >= count {
        return Err(GpuError::NoCuda {
            reason: format!(
                "no GPU {ordinal} (the driver sees {count}{})",
                if count > 0 {
                    format!(", ordinals 0 to {}", count - 1)
                } else {
                    String::new()
                }
            ),
        });
    }
    let mut dev = 0;
    // SAFETY: valid out-pointer; the ordinal is in range.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    Ok(dev)
}

/// The name and UUID of `dev`.
fn name_and_uuid(dev: sys::CUdevice) -> Result<(String, String), GpuError> {
    let mut name = [0 as std::ffi::c_char; 128];
    // SAFETY: valid buffers of the lengths passed; the driver NUL-terminates the name (the
    // buffer is zeroed beforehand as well).
    unsafe {
        check(
            "cuDeviceGetName",
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
        )?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        check(
            "cuDeviceGetUuid_v2",
            sys::cuDeviceGetUuid_v2(&mut uuid, dev),
        )?;
        let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
        Ok((name, super::format_uuid(uuid.bytes.map(|b| b as u8))))
    }
}

/// [`Cuda::identify`]: name, UUID and PCI bus id, without retaining a context.
pub(super) fn identify(ordinal: i32) -> Result<super::GpuIdentity, GpuError> {
    let dev = device(ordinal)?;
    let (name, uuid) = name_and_uuid(dev)?;
    Ok(super::GpuIdentity {
        ordinal,
        name,
        uuid,
        pci_bus_id: Some(pci_bus_id_of(dev)?),
    })
}

/// [`Cuda::open`]: loads libcuda (error if absent), initialises the driver ([`init`]), retains
/// the primary context and reads the device's attributes.
pub(super) fn open(ordinal: i32) -> Result<Cuda, GpuError> {
    let dev = device(ordinal)?;
    let (name, uuid) = name_and_uuid(dev)?;
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        let mut ctx = std::ptr::null_mut();
        check(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
        )?;
        // Owned from here: released on every error below too.
        let raw = RawCuda { dev, ctx };
        check("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
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
        Ok(Cuda {
            raw,
            ordinal,
            name,
            sm_count,
            compute_capability: (major, minor),
            shared_per_sm: shared_per_sm.max(0) as u32,
            shared_per_block: shared_per_block.max(0) as u32,
            uuid,
            holds: super::memory::holds_of(ordinal),
        })
    }
}

/// The PCI address of `dev` as sysfs spells it (lower case).
fn pci_bus_id_of(dev: sys::CUdevice) -> Result<String, GpuError> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: valid buffer of the length passed; the driver NUL-terminates what it writes.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev)
    })?;
    // SAFETY: NUL-terminated by the driver within the buffer (zeroed beforehand as well).
    let id = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Ok(id.to_string_lossy().to_ascii_lowercase())
}

impl RawCuda {
    /// Makes the primary context current on the calling thread.
    pub(super) fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: the context is retained for as long as `self` lives.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
    pub(super) fn p2p_write_ordering(&self) -> Result<i32, GpuError> {
        let mut v = 0;
        // SAFETY: a valid out-pointer and the device this value retained.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut v,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
                self.dev,
            )
        })?;
        Ok(v)
    }

    /// The PCI address from `cuDeviceGetPCIBusId`, in lower case.
    pub(super) fn pci_bus_id(&self) -> Result<String, GpuError> {
        pci_bus_id_of(self.dev)
    }
}

impl Drop for RawCuda {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `open`.
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory.

/// [`DeviceMemory::alloc`]: `cuMemAlloc` (rounded up to 64 KiB granularity by the driver), then
/// zeroed.
pub(super) fn alloc_device(
    cuda: &Arc<Cuda>,
    len: usize,
    zeroed: bool,
) -> Result<DeviceMemory, GpuError> {
    cuda.make_current()?;
    let mut ptr = 0;
    // SAFETY: valid out-pointer; a zero-length request is refused by the driver. The memory
    // is owned (and freed on an error) from the moment it is allocated.
    unsafe {
        check("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, len.max(1)))?;
        let mem = DeviceMemory {
            cuda: cuda.clone(),
            ptr,
            len,
            owner: None,
        };
        if zeroed {
            check("cuMemsetD8", sys::cuMemsetD8_v2(ptr, 0, len.max(1)))?;
        }
        Ok(mem)
    }
}

/// [`ManagedMemory::alloc`](super::ManagedMemory::alloc): `cuMemAllocManaged` with
/// `CU_MEM_ATTACH_GLOBAL` (not zeroed here: the caller zeroes it from the CPU, which keeps its
/// pages on the host). Freed by `cuMemFree` as device memory is.
pub(super) fn alloc_managed(cuda: &Arc<Cuda>, len: usize) -> Result<DeviceMemory, GpuError> {
    cuda.make_current()?;
    let mut ptr = 0;
    // SAFETY: valid out-pointer; the flag is CU_MEM_ATTACH_GLOBAL. The memory is owned from
    // the moment it is allocated.
    unsafe {
        check(
            "cuMemAllocManaged",
            sys::cuMemAllocManaged(&mut ptr, len.max(1), 1),
        )?;
    }
    Ok(DeviceMemory {
        cuda: cuda.clone(),
        ptr,
        len,
        owner: None,
    })
}

/// [`Cuda::memory_info`](super::Cuda::memory_info): `cuMemGetInfo`.
pub(super) fn memory_info(cuda: &Cuda) -> Result<(u64, u64), GpuError> {
    cuda.make_current()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    check("cuMemGetInfo", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// [`DeviceMemory::write`]: `cuMemcpyHtoD`.
///
/// # Safety
/// `dst..dst + data.len()` lies in a live allocation.
pub(super) unsafe fn write_device(cuda: &Cuda, dst: u64, data: &[u8]) -> Result<(), GpuError> {
    cuda.make_current()?;
    // SAFETY: the destination range lies in a live allocation (the caller's promise); the
    // source is a live slice.
    check("cuMemcpyHtoD", unsafe {
        sys::cuMemcpyHtoD_v2(dst, data.as_ptr().cast(), data.len())
    })
}

/// [`DeviceMemory::write_rows`]: `cuMemcpy2D` from host rows of `row` bytes, packed, to device
/// rows `pitch` bytes apart.
///
/// # Safety
/// `dst..dst + (rows - 1) * pitch + row` lies in a live allocation, `data.len()` a non-zero
/// multiple of `row`, `row <= pitch`.
pub(super) unsafe fn write_device_rows(
    cuda: &Cuda,
    dst: u64,
    data: &[u8],
    row: usize,
    pitch: usize,
) -> Result<(), GpuError> {
    cuda.make_current()?;
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: data.as_ptr().cast(),
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: row,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: pitch,
        WidthInBytes: row,
        Height: data.len() / row,
    };
    // SAFETY: the destination rows lie in a live allocation (the caller's promise); the source
    // is a live slice of exactly `Height` rows of `row` bytes.
    check("cuMemcpy2D", unsafe { sys::cuMemcpy2D_v2(&copy) })
}

/// [`DeviceMemory::read`]: `cuMemcpyDtoH`.
///
/// # Safety
/// `src..src + buf.len()` lies in a live allocation.
pub(super) unsafe fn read_device(cuda: &Cuda, src: u64, buf: &mut [u8]) -> Result<(), GpuError> {
    cuda.make_current()?;
    // SAFETY: the source range lies in a live allocation (the caller's promise); the
    // destination is a live slice.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(buf.as_mut_ptr().cast(), src, buf.len())
    })
}

/// [`DeviceMemory::borrowed`]'s check: `ptr..ptr + len` lies inside one allocation of device
/// (or managed) memory of `cuda`'s GPU (`cuPointerGetAttribute`: memory type, device ordinal,
/// allocation range). Host memory, another GPU's memory and a range running past its
/// allocation are refused with what they are.
pub(super) fn check_device_range(cuda: &Cuda, ptr: u64, len: usize) -> Result<(), GpuError> {
    use sys::CUpointer_attribute as A;
    cuda.make_current()?;
    let attr = |a: A, out: *mut c_void| {
        // SAFETY: `out` points at a live value of the size the attribute writes (u32 for the
        // memory type and ordinal, a CUdeviceptr / size_t for the range); the driver only looks
        // the address up.
        unsafe { sys::cuPointerGetAttribute(out, a, ptr) }
    };
    let mut kind: u32 = 0;
    let r = attr(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (&raw mut kind).cast());
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::InvalidArgument(format!(
            "{ptr:#x} is not CUDA memory (cuPointerGetAttribute: {r:?}): host memory?"
        )));
    }
    let mut managed: u32 = 0;
    check(
        "cuPointerGetAttribute",
        attr(
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            (&raw mut managed).cast(),
        ),
    )?;
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 && managed == 0 {
        return Err(GpuError::InvalidArgument(format!(
            "{ptr:#x} is CUDA {} memory, not GPU memory",
            if kind == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
                "host (pinned)"
            } else {
                "non-device"
            }
        )));
    }
    let mut ordinal: i32 = -1;
    check(
        "cuPointerGetAttribute",
        attr(
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            (&raw mut ordinal).cast(),
        ),
    )?;
    if managed == 0 && ordinal != cuda.ordinal {
        return Err(GpuError::InvalidArgument(format!(
            "{ptr:#x} is memory of GPU {ordinal}, not of GPU {}",
            cuda.ordinal
        )));
    }
    let (mut start, mut size): (u64, usize) = (0, 0);
    check(
        "cuPointerGetAttribute",
        attr(
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            (&raw mut start).cast(),
        ),
    )?;
    check(
        "cuPointerGetAttribute",
        attr(A::CU_POINTER_ATTRIBUTE_RANGE_SIZE, (&raw mut size).cast()),
    )?;
    let end = start.saturating_add(size as u64);
    if ptr.checked_add(len as u64).is_none_or(|e| e > end) {
        return Err(GpuError::InvalidArgument(format!(
            "{len} bytes at {ptr:#x} run past their allocation ({size} bytes at {start:#x})"
        )));
    }
    Ok(())
}

/// [`DeviceMemory::export_dma_buf`] of the checked range `ptr..ptr + len`:
/// `cuMemGetHandleForAddressRange`.
pub(super) fn export_dma_buf(
    cuda: &Cuda,
    ptr: u64,
    len: usize,
) -> Result<std::os::fd::OwnedFd, GpuError> {
    use std::os::fd::FromRawFd;
    cuda.make_current()?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is a valid out-pointer for an int; the driver only looks the range up (and
    // refuses one that is not GPU memory).
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

/// [`DeviceMemory::set_sync_memops`] of the allocation at `ptr`: `cuPointerSetAttribute`.
pub(super) fn set_sync_memops(cuda: &Cuda, ptr: u64) -> Result<(), GpuError> {
    cuda.make_current()?;
    let one: std::ffi::c_uint = 1;
    // SAFETY: valid pointer to a live value of the attribute's type; the driver refuses an
    // address that is not an allocation.
    check("cuPointerSetAttribute", unsafe {
        sys::cuPointerSetAttribute(
            (&one as *const std::ffi::c_uint).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
            ptr,
        )
    })
}

/// [`PinnedMemory::alloc`]: `cuMemHostAlloc` (DEVICEMAP | PORTABLE) of whole pages, zeroed,
/// and its device address.
pub(super) fn alloc_pinned(cuda: &Arc<Cuda>, len: usize) -> Result<PinnedMemory, GpuError> {
    cuda.make_current()?;
    let len = len.max(1).next_multiple_of(4096);
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the flags ask for a mapping usable from every context. The
    // memory is owned (and freed on an error) from the moment it is allocated, and zeroed
    // within its length before anything else sees it.
    unsafe {
        check(
            "cuMemHostAlloc",
            sys::cuMemHostAlloc(
                &mut host,
                len,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            ),
        )?;
        let mut mem = PinnedMemory {
            cuda: cuda.clone(),
            host: host.cast(),
            dev: 0,
            len,
            owner: PinnedOwner::Allocated,
        };
        std::ptr::write_bytes(mem.host, 0, len);
        check(
            "cuMemHostGetDevicePointer",
            sys::cuMemHostGetDevicePointer_v2(&mut mem.dev, host, 0),
        )?;
        Ok(mem)
    }
}

/// Transparent huge pages' size, the unit of [`alloc_pinned_large`].
const HUGE_PAGE: usize = 2 << 20;

/// [`PinnedMemory::alloc_large`]: anonymous memory in whole 2 MiB pages, aligned to them and
/// advised to be transparent huge pages (`MADV_HUGEPAGE`; a kernel that does not grant them
/// leaves 4 KiB pages, which still work), registered (DEVICEMAP | PORTABLE), and its device
/// address. The pages are not touched first: the registration pins (and so faults in) each,
/// and a fresh anonymous page reads as zero.
pub(super) fn alloc_pinned_large(cuda: &Arc<Cuda>, len: usize) -> Result<PinnedMemory, GpuError> {
    cuda.make_current()?;
    let len = len.max(1).next_multiple_of(HUGE_PAGE);
    let host = map_zeroed(len, HUGE_PAGE, "registered pinned memory")?;
    let unmap = || {
        // SAFETY: exactly the mapping made above, which nothing else refers to.
        unsafe { libc::munmap(host.cast(), len) };
    };
    // SAFETY: advice on the mapping just made; the kernel may ignore it.
    unsafe { libc::madvise(host.cast(), len, libc::MADV_HUGEPAGE) };
    // The pages faulted in (zeroed) here, outside the driver, so that the registration only
    // pins them: other threads' driver calls may wait behind a registration (not measured
    // apart). Kernels before 5.14 refuse the advice and the registration faults them in.
    // SAFETY: advice on the mapping just made, which nothing else refers to yet.
    unsafe { libc::madvise(host.cast(), len, libc::MADV_POPULATE_WRITE) };
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: the range is mapped, page-aligned, and stays mapped until the returned value's
    // free unregisters it first (`Deferred::Registered`).
    if let Err(e) = check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(host.cast(), len, flags)
    }) {
        unmap();
        return Err(e);
    }
    let mut mem = PinnedMemory {
        cuda: cuda.clone(),
        host,
        dev: 0,
        len,
        owner: PinnedOwner::Registered,
    };
    // SAFETY: valid out-pointer; the address was registered above. On an error `mem` is
    // dropped, which unregisters and unmaps it.
    check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut mem.dev, host.cast(), 0)
    })?;
    Ok(mem)
}

/// Frees the memory of a dropped owner (`cuMemFree`, `cuMemFreeHost`).
///
/// # Safety
/// `what` is an allocation of this crate whose owner is gone (nothing refers to it), freed
/// once.
pub(super) unsafe fn free(cuda: &Cuda, what: Deferred) {
    if cuda.make_current().is_err() {
        return;
    }
    // SAFETY: the caller's promise.
    unsafe {
        match what {
            Deferred::Device { ptr, .. } => {
                sys::cuMemFree_v2(ptr);
            }
            Deferred::Host { ptr, .. } => {
                sys::cuMemFreeHost(std::ptr::with_exposed_provenance_mut::<c_void>(ptr));
            }
            Deferred::Registered { ptr, len } => {
                let p = std::ptr::with_exposed_provenance_mut::<c_void>(ptr);
                sys::cuMemHostUnregister(p);
                libc::munmap(p, len);
            }
            Deferred::Library { handle } => {
                sys::cuLibraryUnload(std::ptr::with_exposed_provenance_mut(handle));
            }
        }
    }
}

/// [`HostRegistration::register_with`]: `cuMemHostRegister` with DEVICEMAP | PORTABLE, plus
/// IOMEMORY and READ_ONLY as asked, and the range's device address.
///
/// # Safety
/// As for [`HostRegistration::register`].
pub(super) unsafe fn register(
    cuda: &Arc<Cuda>,
    host: *mut u8,
    len: usize,
    io_memory: bool,
    read_only: bool,
) -> Result<HostRegistration, GpuError> {
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
    let mut reg = HostRegistration {
        cuda: cuda.clone(),
        host,
        len,
        dev: 0,
    };
    reg.dev = registered_address(&reg, 0)?;
    Ok(reg)
}

/// The device address of the registered byte at `offset`, asked of the driver again
/// (`cuMemHostGetDevicePointer`).
pub(super) fn registered_address(reg: &HostRegistration, offset: usize) -> Result<u64, GpuError> {
    let mut dev = 0;
    // SAFETY: valid out-pointer; the driver only looks the host address up (and refuses one
    // that is not registered).
    check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dev, reg.host.wrapping_add(offset).cast(), 0)
    })?;
    Ok(dev)
}

/// Unregisters the registration at `host`, being dropped (`cuMemHostUnregister`).
///
/// # Safety
/// Called once, from its drop; the range is still mapped.
pub(super) unsafe fn unregister(cuda: &Cuda, host: *mut u8) {
    if cuda.make_current().is_ok() {
        // SAFETY: the caller's promise.
        unsafe {
            sys::cuMemHostUnregister(host.cast());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels.

/// [`super::Library`]'s driver part: a context-independent library (`cuLibraryLoadData`),
/// unloaded when the [`super::Library`] is dropped, through the frees held back while a kernel
/// may wait for a controller ([`RawLibrary::unload_later`]).
pub(super) struct RawLibrary(sys::CUlibrary);

// SAFETY: library and kernel handles are context-independent driver objects, usable from any
// thread.
unsafe impl Send for RawLibrary {}
// SAFETY: as above.
unsafe impl Sync for RawLibrary {}

/// [`super::Kernel`]'s driver part: a `CUkernel` of a [`RawLibrary`].
#[derive(Clone, Copy, Debug)]
pub(super) struct RawKernel(sys::CUkernel);

// SAFETY: a CUkernel is a context-independent handle, valid while its library is loaded (the
// holder keeps the library).
unsafe impl Send for RawKernel {}
// SAFETY: as above.
unsafe impl Sync for RawKernel {}

impl RawLibrary {
    /// JIT-loads PTX text.
    pub(super) fn load_ptx(cuda: &Cuda, ptx: &str) -> Result<Self, GpuError> {
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
        Ok(Self(lib))
    }

    /// The kernel named `c_name` (`cuLibraryGetKernel`).
    pub(super) fn kernel(&self, _name: &str, c_name: CString) -> Result<RawKernel, GpuError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid library handle and NUL-terminated name.
        check("cuLibraryGetKernel", unsafe {
            sys::cuLibraryGetKernel(&mut raw, self.0, c_name.as_ptr())
        })?;
        Ok(RawKernel(raw))
    }
}

impl RawLibrary {
    /// What unloads this library (`cuLibraryUnload`, which waits for a running persistent
    /// kernel and blocks other threads meanwhile): [`super::Library`]'s drop hands it to
    /// [`super::memory::free_or_defer`], once.
    pub(super) fn unload_later(&self) -> Option<Deferred> {
        Some(Deferred::Library {
            handle: self.0.expose_provenance(),
        })
    }
}

impl RawKernel {
    /// The shared memory the kernel declares statically (bytes).
    pub(super) fn static_shared_bytes(self, cuda: &Cuda) -> Result<u32, GpuError> {
        let mut bytes = 0;
        // SAFETY: valid kernel handle and out-pointer.
        check("cuKernelGetAttribute", unsafe {
            sys::cuKernelGetAttribute(
                &mut bytes,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                self.0,
                cuda.raw.dev,
            )
        })?;
        Ok(bytes.max(0) as u32)
    }

    /// Lets a block of the kernel have `bytes` of dynamic shared memory.
    pub(super) fn set_max_dynamic_shared(self, cuda: &Cuda, bytes: u32) -> Result<(), GpuError> {
        // SAFETY: valid kernel handle; the value is within the device's opt-in limit (checked
        // by the caller).
        check("cuKernelSetAttribute", unsafe {
            sys::cuKernelSetAttribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
                self.0,
                cuda.raw.dev,
            )
        })
    }
}

/// [`super::GreenPartition`]'s driver part: the two green contexts, destroyed on drop.
pub(super) struct RawPartition {
    controller: sys::CUgreenCtx,
    client: sys::CUgreenCtx,
}

// SAFETY: green context handles are driver objects usable from any thread.
unsafe impl Send for RawPartition {}
// SAFETY: as above.
unsafe impl Sync for RawPartition {}

impl RawPartition {
    /// Splits the device's SM resource (`cuDevSmResourceSplitByCount`) and makes a green context
    /// of each part; returns them with the SMs of each ([`RawPartition::split_several`] with
    /// one group).
    pub(super) fn split(cuda: &Cuda, controller_sms: u32) -> Result<(Self, u32, u32), GpuError> {
        Self::split_several(cuda, 1, controller_sms)?
            .pop()
            .ok_or_else(|| GpuError::Unsupported("the SM split made no partition".into()))
    }

    /// `groups` disjoint controller partitions of at least `controller_sms` SMs each
    /// (`cuDevSmResourceSplitByCount` with `groups` groups) and, for each, a green context of
    /// the SMs left over for clients (every partition's client side is the same SMs); with the
    /// SMs of each side.
    pub(super) fn split_several(
        cuda: &Cuda,
        groups: u32,
        controller_sms: u32,
    ) -> Result<Vec<(Self, u32, u32)>, GpuError> {
        cuda.make_current()?;
        let dev = cuda.raw.dev;
        let want = groups.max(1);
        // SAFETY: plain driver calls on zeroed POD out-structures; `parts` has room for
        // `want` results, the count passed in.
        unsafe {
            let mut all: sys::CUdevResource = std::mem::zeroed();
            check(
                "cuDeviceGetDevResource",
                sys::cuDeviceGetDevResource(
                    dev,
                    &mut all,
                    sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
                ),
            )?;
            let mut parts: Vec<sys::CUdevResource> = vec![std::mem::zeroed(); want as usize];
            let mut rest: sys::CUdevResource = std::mem::zeroed();
            let mut got = want;
            check(
                "cuDevSmResourceSplitByCount",
                sys::cuDevSmResourceSplitByCount(
                    parts.as_mut_ptr(),
                    &mut got,
                    &all,
                    &mut rest,
                    0,
                    controller_sms.max(1),
                ),
            )?;
            let client_sms = rest.__bindgen_anon_1.sm.smCount;
            if got != want || client_sms == 0 {
                return Err(GpuError::Unsupported(format!(
                    "cannot reserve {want} partitions of {} SMs for controllers and keep SMs \
                     for clients: {} SMs in all",
                    controller_sms.max(1),
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
                        dev,
                        sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32,
                    ),
                )?;
                Ok(g)
            };
            let mut out = Vec::with_capacity(want as usize);
            for part in &mut parts {
                // Partitions made so far are destroyed by their drop if a later one fails.
                let controller = make(part)?;
                let client = match make(&mut rest) {
                    Ok(c) => c,
                    Err(e) => {
                        sys::cuGreenCtxDestroy(controller);
                        return Err(e);
                    }
                };
                out.push((
                    Self { controller, client },
                    part.__bindgen_anon_1.sm.smCount,
                    client_sms,
                ));
            }
            Ok(out)
        }
    }
}

impl Drop for RawPartition {
    fn drop(&mut self) {
        // SAFETY: destroys the contexts created in `split`, once; their streams are owned by
        // `Stream`s that hold an Arc to the partition, so they are gone already.
        unsafe {
            sys::cuGreenCtxDestroy(self.controller);
            sys::cuGreenCtxDestroy(self.client);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Streams and events.

/// [`super::Stream`]'s driver part: a non-blocking `CUstream`.
pub(super) struct RawStream(sys::CUstream);

// SAFETY: stream handles may be used from any thread (the driver serialises internally); one
// owner at a time issues work in this crate.
unsafe impl Send for RawStream {}
// SAFETY: as above.
unsafe impl Sync for RawStream {}

impl RawStream {
    /// A non-blocking stream (`cuStreamCreate`), or one of a green context when `green` names a
    /// partition and its side (`cuGreenCtxStreamCreate`).
    pub(super) fn new(
        cuda: &Cuda,
        green: Option<(&RawPartition, Placement)>,
    ) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the green context (if any) lives as long as its partition,
        // which the stream's owner keeps.
        unsafe {
            match green {
                None => check("cuStreamCreate", sys::cuStreamCreate(&mut raw, flags))?,
                Some((p, placement)) => {
                    let g = if placement == Placement::Controller {
                        p.controller
                    } else {
                        p.client
                    };
                    check(
                        "cuGreenCtxStreamCreate",
                        sys::cuGreenCtxStreamCreate(&mut raw, g, flags, 0),
                    )?
                }
            }
        }
        Ok(Self(raw))
    }

    /// `cuLaunchKernel` of `kernel`, its arguments each in a 64-bit slot of `args`.
    pub(super) fn launch(
        &self,
        cuda: &Cuda,
        kernel: RawKernel,
        grid: u32,
        block: u32,
        shared: u32,
        mut args: Vec<u64>,
    ) -> Result<(), GpuError> {
        let mut ptrs = param_pointers(&mut args);
        cuda.make_current()?;
        // SAFETY: `ptrs` points at one live value per kernel parameter, in order, each at
        // least as large as the parameter (u64 or u32 on a little-endian target); the caller
        // passes the kernel's signature (checked by the tests of each launch site). A CUkernel
        // may be passed where a CUfunction is expected (context-independent loading).
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                kernel.0.cast(),
                grid,
                1,
                1,
                block,
                1,
                1,
                shared,
                self.0,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// Queues `cuMemcpyDtoHAsync` of `len` bytes from GPU address `src` to host memory `dst`.
    ///
    /// # Safety
    /// `dst..dst + len` is page-locked memory that stays live until the copy has run.
    pub(super) unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's promise for the destination; the source is a GPU address the
        // public API's caller vouches for; the copy is stream ordered.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.0)
        })
    }

    /// Queues `cuMemcpyHtoDAsync` of `len` bytes from host memory `src` to GPU address `dst`.
    ///
    /// # Safety
    /// `src..src + len` is page-locked memory that stays live and unchanged until the copy has
    /// run.
    pub(super) unsafe fn copy_from_host(
        &self,
        src: *const u8,
        dst: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's promise for the source; the destination is a GPU address the
        // public API's caller vouches for.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.0)
        })
    }

    /// Queues `cuMemcpyDtoDAsync` of `len` bytes from GPU address `src` to GPU address `dst`.
    ///
    /// # Safety
    /// Both ranges lie in GPU memory that stays allocated until the copy has run.
    pub(super) unsafe fn copy_device(
        &self,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        // SAFETY: the caller's promise; the copy is stream ordered.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.0)
        })
    }

    /// [`super::copy_to_gpu`]: `cuMemcpyHtoDAsync` from pageable memory, which the driver
    /// stages before returning.
    pub(super) fn upload(&self, cuda: &Cuda, dst: u64, data: &[u8]) -> Result<(), GpuError> {
        cuda.make_current()?;
        // SAFETY: `dst` is a GPU address the caller vouches for; the source is a live slice that
        // the driver stages before returning (pageable memory).
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), self.0)
        })
    }

    /// `cuStreamQuery`.
    pub(super) fn is_idle(&self) -> Result<bool, GpuError> {
        // SAFETY: valid stream handle.
        query("cuStreamQuery", unsafe { sys::cuStreamQuery(self.0) })
    }

    /// `cuStreamDestroy` (pending work still runs).
    ///
    /// # Safety
    /// Called once, by the owner's drop; the handle is not used after.
    pub(super) unsafe fn destroy(&self, cuda: &Cuda) {
        if cuda.make_current().is_ok() {
            // SAFETY: the caller's promise.
            unsafe {
                sys::cuStreamDestroy_v2(self.0);
            }
        }
    }
}

/// [`super::Event`]'s driver part: a `CUevent` without timing.
pub(super) struct RawEvent(sys::CUevent);

// SAFETY: event handles may be used from any thread.
unsafe impl Send for RawEvent {}
// SAFETY: as above.
unsafe impl Sync for RawEvent {}

impl RawEvent {
    /// `cuEventCreate` without timing.
    pub(super) fn new(cuda: &Cuda) -> Result<Self, GpuError> {
        cuda.make_current()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(Self(raw))
    }

    /// `cuEventRecord` on `stream`.
    pub(super) fn record(&self, stream: &RawStream) -> Result<(), GpuError> {
        // SAFETY: both handles are live.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.0, stream.0)
        })
    }

    /// `cuEventRecord` on a stream someone else created (a `CUstream` handle as an integer;
    /// 1 and 2 are the legacy and per-thread default streams).
    ///
    /// # Safety
    /// `stream` is a live stream of this context, or 1 or 2.
    pub(super) unsafe fn record_foreign(&self, cuda: &Cuda, stream: u64) -> Result<(), GpuError> {
        cuda.make_current()?;
        // SAFETY: the event is live; the stream handle is the caller's promise.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.0, stream as usize as sys::CUstream)
        })
    }

    /// `cuEventQuery`.
    pub(super) fn is_done(&self) -> Result<bool, GpuError> {
        // SAFETY: live handle.
        query("cuEventQuery", unsafe { sys::cuEventQuery(self.0) })
    }

    /// `cuEventDestroy`.
    ///
    /// # Safety
    /// Called once, by the owner's drop; the handle is not used after.
    pub(super) unsafe fn destroy(&self, cuda: &Cuda) {
        if cuda.make_current().is_ok() {
            // SAFETY: the caller's promise.
            unsafe {
                sys::cuEventDestroy_v2(self.0);
            }
        }
    }
}
