//! The operating-system calls of the real-SSD transports (vfio-p2p, host-memory): owned
//! `mmap`s (anonymous, of a file, of a device or dma-buf descriptor), touching every page of a
//! mapping, `mincore`, GDRCopy's `gdrdrv` ioctls, and the VFIO mapping of a CPU mapping of GPU
//! memory for the SSD.
// UNSAFETY: this module is the FFI boundary to the kernel for the transports: raw mmap/munmap,
// volatile reads of mapped (possibly device) memory, ioctls with raw argument structs, and the
// `VFIO_IOMMU_MAP_DMA` of memory this process mapped.
#![expect(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::GpuError;

/// The page unit the transports work in (NVMe memory pages, VFIO mappings, BAR0 pages).
pub const PAGE: usize = 4096;

/// Read and write access, for [`Mapping::map`].
const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;

/// A mapping this process made and unmaps on drop. Never turned into Rust references: device
/// or GPU memory behind it may change at any time.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    _fd: Option<OwnedFd>,
}

// SAFETY: the mapping is owned by this value and only reached through raw pointers (volatile
// reads, the kernel, CUDA); any thread may do that.
unsafe impl Send for Mapping {}
// SAFETY: as above: no method hands out references into it.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mapping({:p}+{:#x})", self.ptr, self.len)
    }
}

impl Mapping {
    /// A private anonymous read-write mapping of `len` bytes (zero-filled on first touch).
    pub fn anonymous(len: usize) -> io::Result<Self> {
        Self::map(
            None,
            0,
            len,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            None,
            RW,
        )
    }

    /// A shared read-only mapping of the first `len` bytes of `fd` (an emulator's image file,
    /// for copies out of its page cache: `gpu_emu::os::copy_from_mapping`). The descriptor is
    /// not kept; the mapping stays valid after it is closed.
    pub fn read_only(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        Self::map(
            Some(fd.as_raw_fd()),
            0,
            len,
            libc::MAP_SHARED,
            None,
            libc::PROT_READ,
        )
    }

    /// A shared read-write mapping of `len` bytes at `offset` of the file at `path` (a sysfs
    /// `resource1`, a test file).
    pub fn file(path: &Path, offset: u64, len: usize) -> io::Result<Self> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        Self::shared(f.into(), offset, len)
    }

    /// A shared read-write mapping of `len` bytes at `offset` of `fd` (a device file, a
    /// dma-buf, a memfd); the descriptor is kept open as long as the mapping.
    pub fn shared(fd: OwnedFd, offset: u64, len: usize) -> io::Result<Self> {
        let raw = fd.as_raw_fd();
        Self::map(Some(raw), offset, len, libc::MAP_SHARED, Some(fd), RW)
    }

    /// A shared mapping of `fd` that does not take ownership of it (gdrdrv: one descriptor
    /// serves every pin).
    pub fn shared_borrowed(fd: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<Self> {
        Self::map(
            Some(fd.as_raw_fd()),
            offset,
            len,
            libc::MAP_SHARED,
            None,
            RW,
        )
    }

    fn map(
        fd: Option<i32>,
        offset: u64,
        len: usize,
        flags: i32,
        keep: Option<OwnedFd>,
        prot: i32,
    ) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: a fresh mapping chosen by the kernel (no MAP_FIXED), so no existing memory is
        // affected; the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                flags,
                fd.unwrap_or(-1),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr: NonNull::new(p.cast()).expect("mmap never returns null on success"),
            len,
            _fd: keep,
        })
    }

    /// The first byte (never dereferenced as a reference).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty (never: empty mappings are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads one 32-bit word of every 4 KiB page ([`touch_pages`]); returns the pages touched.
    pub fn touch_pages(&self) -> usize {
        // SAFETY: the whole range is mapped and readable while `self` lives.
        unsafe { touch_pages(self.ptr, self.len) }
    }

    /// Locks the mapping's pages in memory (`mlock`): each is read in now if it is not, and
    /// none is evicted (for a file mapping: its page-cache pages) until the mapping is dropped.
    /// For tests that need pages to stay cached on a machine that reclaims the page cache
    /// eagerly. Errors: over `RLIMIT_MEMLOCK` or without the privilege (`ENOMEM`, `EPERM`).
    pub fn lock(&self) -> io::Result<()> {
        // SAFETY: the range is one live mapping of ours; mlock changes no memory.
        let r = unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// How many of the mapping's 4 KiB pages are resident (`mincore`), for tests.
    pub fn resident_pages(&self) -> io::Result<usize> {
        let host_page = host_page_size();
        let mut vec = vec![0u8; self.len.div_ceil(host_page)];
        // SAFETY: the range is one live mapping of ours; `vec` holds one byte per host page.
        let r = unsafe { libc::mincore(self.ptr().cast(), self.len, vec.as_mut_ptr()) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let per = host_page / PAGE;
        Ok(vec.iter().filter(|b| **b & 1 != 0).count() * per.max(1))
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `map`, once; nothing refers to it any more (its
        // users hold the `Mapping` and are dropped first).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The host's page size.
pub fn host_page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(v).unwrap_or(PAGE).max(1)
}

/// Byte offsets of the words [`touch_pages`] reads in a mapping of `len` bytes: the first word
/// of every 4 KiB page, including a partial last page.
pub fn touch_offsets(len: usize) -> impl Iterator<Item = usize> {
    (0..len.div_ceil(PAGE)).map(|p| p * PAGE)
}

/// Reads (volatile, 32 bits) the first word of every 4 KiB page of `ptr..ptr + len`, so the
/// kernel has populated the page tables of the whole mapping before CUDA walks them: the
/// NVIDIA driver does not fault I/O pages in itself, and on a VFIO BAR0 mapping registrations
/// were seen to cover only the pages touched (../shared/design/hardware-paths.md). Reads only:
/// reading NVMe registers and doorbells has no side effects. Returns the pages touched.
///
/// # Safety
/// `ptr..ptr + len` is mapped readable in this process (device memory included), 4-byte
/// aligned at each page start.
pub unsafe fn touch_pages(ptr: NonNull<u8>, len: usize) -> usize {
    let mut n = 0;
    for off in touch_offsets(len) {
        // SAFETY: `off < len`, so the word lies in the mapped range (a page start, aligned);
        // volatile because it may be device memory that must really be read.
        unsafe { ptr.as_ptr().add(off).cast::<u32>().read_volatile() };
        n += 1;
    }
    n
}

// --- GDRCopy's gdrdrv (NVIDIA/gdrcopy src/gdrdrv/gdrdrv.h, ABI major version 2) ----------------

/// `GDRDRV_IOCTL`, the ioctl type byte.
const GDRDRV_IOCTL: u64 = 0xDA;

/// `_IOWR(GDRDRV_IOCTL, nr, size)` (asm-generic ioctl encoding: dir 3 in bits 30..31, size in
/// bits 16..29, type in 8..15, nr in 0..7).
pub const fn gdrdrv_iowr(nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (GDRDRV_IOCTL << 8) | nr
}

/// `struct GDRDRV_IOC_PIN_BUFFER_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GdrPinParams {
    /// In: GPU virtual address (64 KiB aligned here).
    pub addr: u64,
    /// In: bytes.
    pub size: u64,
    /// In: 0 (tokens are for CUDA before 6.0).
    pub p2p_token: u64,
    /// In: 0.
    pub va_space: u32,
    /// Padding the C layout has before the 64-bit handle.
    pub pad: u32,
    /// Out: the pin's handle; the mmap offset is `handle << PAGE_SHIFT`.
    pub handle: u64,
}
const _: () = assert!(size_of::<GdrPinParams>() == 40);

/// `struct GDRDRV_IOC_UNPIN_BUFFER_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GdrUnpinParams {
    /// In: the pin's handle.
    pub handle: u64,
}

/// `struct GDRDRV_IOC_GET_VERSION_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GdrVersionParams {
    /// Out: `major << 16 | minor`.
    pub gdrdrv_version: u32,
    /// Out: oldest gdrapi the module serves.
    pub minimum_gdr_api_version: u32,
}

/// `GDRDRV_IOC_PIN_BUFFER` (the header sizes it by the struct).
pub const GDRDRV_IOC_PIN_BUFFER: u64 = gdrdrv_iowr(1, size_of::<GdrPinParams>() as u64);
/// `GDRDRV_IOC_UNPIN_BUFFER` (the header sizes it by a *pointer* to the struct: 8).
pub const GDRDRV_IOC_UNPIN_BUFFER: u64 = gdrdrv_iowr(2, 8);
/// `GDRDRV_IOC_GET_VERSION` (sized by a pointer as well).
pub const GDRDRV_IOC_GET_VERSION: u64 = gdrdrv_iowr(255, 8);

/// An open `/dev/gdrdrv`.
#[derive(Debug)]
pub struct Gdrdrv {
    fd: OwnedFd,
}

impl Gdrdrv {
    /// Opens the device file at `path`.
    pub fn open(path: &Path) -> io::Result<Arc<Self>> {
        let f: File = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Arc::new(Self { fd: f.into() }))
    }

    fn ioctl<T>(&self, req: u64, arg: &mut T) -> io::Result<()> {
        // SAFETY: `arg` is a live, exclusively borrowed `#[repr(C)]` struct of the layout the
        // request number encodes (gdrdrv.h); the kernel reads and writes only within it. On a
        // file that is not gdrdrv the kernel rejects the request (ENOTTY) without touching it.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), req as _, arg as *mut T) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The module's version (`major << 16 | minor`).
    pub fn version(&self) -> io::Result<u32> {
        let mut p = GdrVersionParams::default();
        self.ioctl(GDRDRV_IOC_GET_VERSION, &mut p)?;
        Ok(p.gdrdrv_version)
    }

    /// Pins `size` bytes of GPU memory at `addr` in BAR1; the pin lasts until the returned
    /// value is dropped.
    pub fn pin(self: &Arc<Self>, addr: u64, size: u64) -> io::Result<GdrPin> {
        let mut p = GdrPinParams {
            addr,
            size,
            ..Default::default()
        };
        self.ioctl(GDRDRV_IOC_PIN_BUFFER, &mut p)?;
        Ok(GdrPin {
            drv: self.clone(),
            handle: p.handle,
        })
    }

    /// The descriptor (mmap of a pin's handle goes through it).
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }
}

/// A pinned range of GPU memory in BAR1 (gdrdrv); unpinned on drop.
#[derive(Debug)]
pub struct GdrPin {
    drv: Arc<Gdrdrv>,
    handle: u64,
}

impl GdrPin {
    /// Maps the pinned range into this process (`mmap` of gdrdrv at `handle << PAGE_SHIFT`).
    pub fn map(&self, len: usize) -> io::Result<Mapping> {
        let shift = host_page_size().trailing_zeros();
        let off = self
            .handle
            .checked_shl(shift)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        Mapping::shared_borrowed(self.drv.fd(), off, len)
    }
}

impl Drop for GdrPin {
    fn drop(&mut self) {
        let mut p = GdrUnpinParams {
            handle: self.handle,
        };
        if let Err(e) = self.drv.ioctl(GDRDRV_IOC_UNPIN_BUFFER, &mut p) {
            tracing::warn!(error = %e, "gdrdrv: unpinning GPU memory");
        }
    }
}

/// A CPU mapping of memory the SSD may DMA to, mapped into the SSD's VFIO container. Field
/// order is drop order: the SSD's access goes first, then the CPU mapping, then whatever
/// `keep` holds (a gdrdrv pin, the GPU memory).
pub struct SsdMapping {
    ext: vfio::ExternalMapping,
    _map: Arc<Mapping>,
    _keep: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for SsdMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdMapping")
            .field("ext", &self.ext)
            .finish()
    }
}

impl SsdMapping {
    /// Maps the whole of `map` for the SSD behind `vfio` (`VFIO_IOMMU_MAP_DMA`, type1 only;
    /// for a PFNMAP of GPU BAR1 the kernel follows the page tables instead of pinning).
    pub fn new(
        vfio: &vfio::VfioNvme,
        map: Arc<Mapping>,
        keep: Box<dyn Send + Sync>,
    ) -> Result<Self, GpuError> {
        if map.ptr() as usize % PAGE != 0 || map.len() % PAGE != 0 {
            return Err(GpuError::InvalidArgument(format!(
                "{map:?} is not whole 4 KiB pages; VFIO maps only those"
            )));
        }
        // SAFETY: the range is `map`, which this value keeps alive (and mapped) until after the
        // ExternalMapping is dropped (field order), and which holds only memory meant for the
        // SSD (queue rings and data buffers). Alignment checked above.
        let ext = unsafe { vfio.map_external(map.ptr(), map.len()) }.map_err(|source| {
            GpuError::Vfio {
                op: "mapping memory for the SSD (VFIO_IOMMU_MAP_DMA)",
                source,
            }
        })?;
        Ok(Self {
            ext,
            _map: map,
            _keep: keep,
        })
    }

    /// The SSD's address of the first byte.
    pub fn bus(&self) -> u64 {
        self.ext.device_address(0)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.ext.len()
    }

    /// Whether empty (never).
    pub fn is_empty(&self) -> bool {
        self.ext.is_empty()
    }
}

/// A controller's doorbells registered with CUDA, so GPU threads can write them: an SSD's BAR0
/// touched page by page and registered as I/O memory, or the doorbell page a vfio-user server
/// shares as ordinary memory (and polls). Field order is drop order: unregistered before the
/// device (and with it the mapping) can go.
pub struct Bar0Doorbells {
    reg: crate::ffi::HostRegistration,
    /// BAR0 offset of the registration's first byte.
    base: usize,
    pages_touched: usize,
    _device: Arc<dyn Send + Sync>,
}

impl std::fmt::Debug for Bar0Doorbells {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bar0Doorbells")
            .field("reg", &self.reg)
            .field("pages_touched", &self.pages_touched)
            .finish()
    }
}

impl Bar0Doorbells {
    /// Touches every page of `vfio`'s BAR0 mapping, then registers it with
    /// `cuMemHostRegister(IOMEMORY | DEVICEMAP)` (root only). Register again after any reset
    /// of the controller or the VFIO device.
    pub fn register(
        cuda: &Arc<crate::ffi::Cuda>,
        vfio: Arc<vfio::VfioNvme>,
    ) -> Result<Self, GpuError> {
        let (ptr, len) = vfio.bar0_mapping().ok_or_else(|| {
            GpuError::Unsupported(format!(
                "BAR0 of {} cannot be mmapped whole (VFIO offers no single mapping of it), so \
                 its doorbells cannot be registered with CUDA",
                vfio.address()
            ))
        })?;
        // SAFETY: the mapping is BAR0 as mapped by `vfio`, readable, whole, page-aligned, and
        // kept mapped while `vfio` lives; we hold `vfio`.
        let pages_touched = unsafe { touch_pages(ptr, len) };
        // SAFETY: as above; the registration is dropped before `_vfio` (field order).
        let reg = unsafe { crate::ffi::HostRegistration::register(cuda, ptr.as_ptr(), len, true) }
            .map_err(|e| match e {
                GpuError::Cuda {
                    call,
                    code,
                    message,
                } if message.contains("NOT_PERMITTED") => GpuError::Cuda {
                    call,
                    code,
                    message: format!("{message}: registering device memory (IOMEMORY) needs root"),
                },
                e => e,
            })?;
        tracing::info!(
            bar0 = %vfio.address(),
            bytes = len,
            pages_touched,
            gpu_ptr = format_args!("{:#x}", reg.device_ptr()),
            "SSD doorbells registered with CUDA"
        );
        Ok(Self {
            reg,
            base: 0,
            pages_touched,
            _device: vfio,
        })
    }

    /// Registers the doorbell page a vfio-user server shares (BAR0 from 0x1000; SPDK polls it)
    /// with `cuMemHostRegister(DEVICEMAP | PORTABLE)`: ordinary shared memory, so no root and no
    /// peer-to-peer path is needed; GPU stores reach it over PCIe like stores to any registered
    /// host memory.
    pub fn register_shared(
        cuda: &Arc<crate::ffi::Cuda>,
        dev: Arc<vfio::VfioUserNvme>,
    ) -> Result<Self, GpuError> {
        let areas = dev.bar0_mapped_areas();
        let Some(&(base, ptr, len)) = areas
            .iter()
            .find(|&&(off, _, len)| off <= 0x1000 && 0x1000 < off + len)
        else {
            return Err(GpuError::Unsupported(format!(
                "the vfio-user server at {} shares no memory holding the doorbells (BAR0 0x1000); \
                 GPU threads cannot ring them",
                dev.socket_path().display()
            )));
        };
        // SAFETY: the area is a shared mapping of BAR0 made by `dev`, readable, page-aligned,
        // kept mapped while `dev` lives; we hold `dev`.
        let pages_touched = unsafe { touch_pages(ptr, len) };
        // SAFETY: as above; the registration is dropped before `_device` (field order).
        let reg = unsafe { crate::ffi::HostRegistration::register(cuda, ptr.as_ptr(), len, false) }
            .map_err(|e| {
                // SPDK keeps the page in a file beside its socket. On a disk file this failed
                // on the H200 machine and on tmpfs it worked; most likely Linux refuses the
                // long-term pin CUDA takes of a writable shared mapping of a disk file.
                GpuError::Unsupported(format!(
                    "registering with CUDA the doorbell page the server at {} shares: {e}; it keeps \
                     it in a file (SPDK: beside the socket), which CUDA can pin only on tmpfs \
                     or hugetlbfs: put the socket directory under /dev/shm",
                    dev.socket_path().display()
                ))
            })?;
        tracing::info!(
            socket = %dev.socket_path().display(),
            bar0_offset = base,
            bytes = len,
            gpu_ptr = format_args!("{:#x}", reg.device_ptr()),
            "vfio-user doorbells registered with CUDA"
        );
        Ok(Self {
            reg,
            base,
            pages_touched,
            _device: dev,
        })
    }

    /// The GPU address of the register at BAR0 byte `offset` (a doorbell), after checking that
    /// CUDA maps that page where the first page's address says it should.
    pub fn doorbell(&self, offset: usize) -> Result<u64, GpuError> {
        let rel = offset.checked_sub(self.base).ok_or_else(|| {
            GpuError::InvalidArgument(format!(
                "BAR0 offset {offset:#x} lies before the registered doorbells at {:#x}",
                self.base
            ))
        })?;
        self.reg.verify(rel)
    }

    /// Pages touched before registering.
    pub fn pages_touched(&self) -> usize {
        self.pages_touched
    }
}

/// Host DMA memory (the SSD's hugepage memory from `nvme::Device::alloc_dma`) registered with
/// CUDA, so GPU threads reach it over PCIe: the host-memory transport's rings and data. Field
/// order is drop order: unregistered before the memory is released.
pub struct HostArena {
    reg: crate::ffi::HostRegistration,
    mem: nvme::DmaMemory,
}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena").field("reg", &self.reg).finish()
    }
}

impl HostArena {
    /// Registers all of `mem` with CUDA (DEVICEMAP | PORTABLE).
    pub fn register(cuda: &Arc<crate::ffi::Cuda>, mem: nvme::DmaMemory) -> Result<Self, GpuError> {
        // SAFETY: `mem` is page-aligned host memory of `mem.len()` bytes that this value owns
        // and releases only after the registration (field order).
        let reg = unsafe {
            crate::ffi::HostRegistration::register(cuda, mem.as_ptr(), mem.len(), false)
        }?;
        Ok(Self { reg, mem })
    }

    /// At least `len` bytes of `dev`'s own DMA memory (`nvme::Device::alloc_dma`), contiguous
    /// in the controller's address space (rings need that), registered with CUDA. Memory that
    /// is not contiguous is refused, `hint` saying why it might not be.
    pub fn alloc_contiguous<D: nvme::Device + ?Sized>(
        cuda: &Arc<crate::ffi::Cuda>,
        dev: &D,
        len: usize,
        hint: &str,
    ) -> Result<Self, GpuError> {
        let mem = dev
            .alloc_dma(len)
            .map_err(|e| GpuError::Nvme(nvme::Error::from(e)))?;
        if !mem.is_device_contiguous() {
            return Err(GpuError::Unsupported(format!(
                "{} bytes of DMA memory are not contiguous for the controller{hint}; rings \
                 need contiguous device addresses",
                mem.len()
            )));
        }
        Self::register(cuda, mem)
    }

    /// GPU address of the first byte.
    pub fn gpu_ptr(&self) -> u64 {
        self.reg.device_ptr()
    }

    /// The memory (host side and device addresses).
    pub fn memory(&self) -> &nvme::DmaMemory {
        &self.mem
    }

    /// The first `len` bytes as [`crate::ffi::DeviceMemory`] (GPU addresses of this host
    /// memory; CUDA copies and kernels reach it over PCIe), keeping the arena registered for
    /// as long as the result lives.
    pub fn as_device_memory(
        self: &Arc<Self>,
        cuda: &Arc<crate::ffi::Cuda>,
        len: usize,
    ) -> Result<crate::ffi::DeviceMemory, GpuError> {
        if len > self.mem.len() {
            return Err(GpuError::InvalidArgument(format!(
                "{len:#x} bytes of a {:#x}-byte host arena",
                self.mem.len()
            )));
        }
        // SAFETY: the registration covers `self.mem.len() >= len` bytes from `gpu_ptr()`, valid
        // from the GPU and for CUDA copies while the registration (held by the arena, which the
        // owner keeps alive) lives; the arena frees its memory only after unregistering.
        Ok(unsafe {
            crate::ffi::DeviceMemory::from_registered(
                cuda,
                self.gpu_ptr(),
                len,
                Box::new(self.clone()),
            )
        })
    }
}

/// Memory another process shares with this one (a `gpunvme serve` arena or doorbell page: a
/// memfd sealed against resizing, mapped shared) registered with CUDA (DEVICEMAP | PORTABLE),
/// so GPU threads reach it over PCIe as they reach any registered host memory. Field order is
/// drop order: unregistered before the mapping can go.
pub struct SharedRegistration {
    reg: crate::ffi::HostRegistration,
    mem: Arc<gpunvme_serve_shm::SharedMemory>,
    /// The byte of `mem` the registration starts at.
    at: usize,
}

impl std::fmt::Debug for SharedRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRegistration")
            .field("reg", &self.reg)
            .finish()
    }
}

impl SharedRegistration {
    /// Registers all of `mem` with CUDA.
    pub fn register(
        cuda: &Arc<crate::ffi::Cuda>,
        mem: Arc<gpunvme_serve_shm::SharedMemory>,
    ) -> Result<Self, GpuError> {
        // SAFETY: `mem` is a shared mapping of `mem.len()` bytes (whole pages, page-aligned, as
        // mmap returns it) of a memfd sealed against shrinking, so no one can truncate it
        // under the mapping; this value holds `mem` and drops the registration first (field
        // order), so the range stays mapped while registered.
        let reg = unsafe {
            crate::ffi::HostRegistration::register(cuda, mem.as_mut_ptr(), mem.len(), false)
        }?;
        Ok(Self { reg, mem, at: 0 })
    }

    /// Registers bytes `at..at + len` of `mem` with CUDA (whole pages: `at` and `len` multiples
    /// of 4096), so a large buffer can be registered piece by piece while earlier pieces are
    /// in use. Offsets of the result ([`SharedRegistration::verify`],
    /// [`SharedRegistration::as_device_memory`]) count from `at`.
    pub fn register_range(
        cuda: &Arc<crate::ffi::Cuda>,
        mem: Arc<gpunvme_serve_shm::SharedMemory>,
        at: usize,
        len: usize,
    ) -> Result<Self, GpuError> {
        let inside = at.checked_add(len).is_some_and(|end| end <= mem.len());
        if !inside || len == 0 || at % 4096 != 0 || len % 4096 != 0 {
            return Err(GpuError::InvalidArgument(format!(
                "registering {at:#x}+{len:#x} of {:#x} bytes of shared memory (whole pages inside it)",
                mem.len()
            )));
        }
        // SAFETY: `at..at + len` lies inside the shared mapping (checked), page-aligned (the
        // mapping starts on a page, `at` and `len` are whole pages), of a memfd sealed against
        // shrinking; this value holds `mem` and drops the registration first (field order).
        let reg = unsafe {
            crate::ffi::HostRegistration::register(cuda, mem.as_mut_ptr().add(at), len, false)
        }?;
        Ok(Self { reg, mem, at })
    }

    /// GPU address of the first byte registered.
    pub fn gpu_ptr(&self) -> u64 {
        self.reg.device_ptr()
    }

    /// The GPU address of byte `offset`, checked with CUDA ([`crate::ffi::HostRegistration::verify`]).
    pub fn verify(&self, offset: usize) -> Result<u64, GpuError> {
        self.reg.verify(offset)
    }

    /// The memory (host side).
    pub fn memory(&self) -> &Arc<gpunvme_serve_shm::SharedMemory> {
        &self.mem
    }

    /// Bytes `offset..offset + len` as [`crate::ffi::DeviceMemory`] (GPU addresses of this
    /// shared memory), keeping the registration for as long as the result lives.
    pub fn as_device_memory(
        self: &Arc<Self>,
        cuda: &Arc<crate::ffi::Cuda>,
        offset: usize,
        len: usize,
    ) -> Result<crate::ffi::DeviceMemory, GpuError> {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.reg.len())
        {
            return Err(GpuError::InvalidArgument(format!(
                "{offset:#x}+{len:#x} of {:#x} bytes of shared memory registered from byte {:#x}",
                self.reg.len(),
                self.at
            )));
        }
        // SAFETY: the registration covers `offset..offset + len` (checked) from `gpu_ptr()`,
        // valid from the GPU and for CUDA copies while the registration lives; the owner
        // passed keeps it (and with it the mapping) alive.
        Ok(unsafe {
            crate::ffi::DeviceMemory::from_registered(
                cuda,
                self.gpu_ptr() + offset as u64,
                len,
                Box::new(self.clone()),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdrdrv_request_numbers_match_the_header() {
        // _IOWR(0xDA, 1, 40-byte struct), _IOWR(0xDA, 2, pointer), _IOWR(0xDA, 255, pointer).
        assert_eq!(GDRDRV_IOC_PIN_BUFFER, 0xC028_DA01);
        assert_eq!(GDRDRV_IOC_UNPIN_BUFFER, 0xC008_DA02);
        assert_eq!(GDRDRV_IOC_GET_VERSION, 0xC008_DAFF);
        assert_eq!(std::mem::offset_of!(GdrPinParams, handle), 32);
    }

    #[test]
    fn empty_mappings_are_refused() {
        assert!(Mapping::anonymous(0).is_err());
    }
}
