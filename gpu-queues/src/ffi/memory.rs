//! The memory types of both backends, defined once: [`DeviceMemory`], [`PinnedMemory`] and
//! [`HostRegistration`], with what they share (bounds checks, access to pinned memory by
//! volatile words and raw copies, how they print, frees held back while a kernel may be
//! waiting for a controller). Allocating, copying to and from the GPU, registering and freeing are each backend's
//! (`alloc_device`, `write_device`, `free`, `register`, ... in `cuda.rs` and `host_gpu.rs`).
// UNSAFETY: pinned memory is shared with the GPU, so the host reaches it only through raw
// pointers (volatile words, copies), never references; every access is bounds-checked first.
// The backend calls behind copies, frees and registrations are unsafe functions whose
// preconditions (a checked range, an owner that is gone) are met here.
#![expect(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use super::{Cuda, backend};
use crate::error::GpuError;

/// GPU memory, zeroed on allocation. With CUDA, from `cuMemAlloc` (not a stream-ordered pool:
/// this memory is registered with a controller and must stay put); with `host-gpu`, anonymous
/// host memory in 64 KiB units whose device address is its host address.
pub struct DeviceMemory {
    pub(super) cuda: Arc<Cuda>,
    /// Device address of the first byte (with `host-gpu`: the host address, its provenance
    /// exposed).
    pub(super) ptr: u64,
    /// Length asked for.
    pub(super) len: usize,
    /// For memory registered elsewhere ([`DeviceMemory::from_registered`]): what keeps it
    /// registered; dropped instead of freeing anything.
    pub(super) owner: Option<Box<dyn Send + Sync>>,
}

impl DeviceMemory {
    /// GPU addresses of memory that is not GPU memory but is mapped into the GPU's address
    /// space elsewhere (host memory registered with CUDA), presented as device memory so code
    /// that takes [`DeviceMemory`] (buffers, copies, kernels' pointers) works on it. Dropping
    /// it drops `owner`, which must undo the registration; nothing is freed here.
    ///
    /// # Safety
    /// `ptr..ptr + len` are GPU addresses of memory valid for reads and writes, from the GPU
    /// and through CUDA copies, for as long as `owner` lives, and nothing else frees it.
    pub(crate) unsafe fn from_registered(
        cuda: &Arc<Cuda>,
        ptr: u64,
        len: usize,
        owner: Box<dyn Send + Sync>,
    ) -> Self {
        Self {
            cuda: cuda.clone(),
            ptr,
            len,
            owner: Some(owner),
        }
    }

    /// GPU memory someone else allocated and owns (a framework's tensor: PyTorch, CuPy, JAX; a
    /// C caller's `cudaMalloc`), presented as [`DeviceMemory`] so buffers, copies and kernels
    /// take it. Checked first: `ptr..ptr + len` must lie inside one allocation of device or
    /// managed memory on `cuda`'s GPU (host memory, another GPU's memory or a range past its
    /// allocation is [`GpuError::InvalidArgument`]; the `host-gpu` build checks only for null).
    /// Dropping it drops `keep` and frees nothing.
    ///
    /// # Safety
    /// The memory stays allocated, and is not handed to anyone else to free, for as long as the
    /// returned value (and every buffer or region made from it) lives.
    pub unsafe fn borrowed(
        cuda: &Arc<Cuda>,
        ptr: u64,
        len: usize,
        keep: Box<dyn Send + Sync>,
    ) -> Result<Self, GpuError> {
        if len == 0 {
            return Err(GpuError::InvalidArgument(
                "an empty range of GPU memory".into(),
            ));
        }
        backend::check_device_range(cuda, ptr, len)?;
        Ok(Self {
            cuda: cuda.clone(),
            ptr,
            len,
            owner: Some(keep),
        })
    }

    /// Allocates `len` bytes, zeroed (CUDA rounds up to 64 KiB granularity; `host-gpu` maps
    /// 64 KiB units likewise).
    pub fn alloc(cuda: &Arc<Cuda>, len: usize) -> Result<Self, GpuError> {
        backend::alloc_device(cuda, len, true)
    }

    /// Allocates `len` bytes whose contents are undefined until written (not zeroed: for a
    /// buffer the caller overwrites whole before anyone reads it, such as a load's arena, where
    /// zeroing 13.5 GB costs milliseconds). Stale bytes are this process's own earlier GPU data
    /// at worst (the driver clears memory between processes).
    pub fn alloc_uninit(cuda: &Arc<Cuda>, len: usize) -> Result<Self, GpuError> {
        backend::alloc_device(cuda, len, false)
    }

    /// `len` bytes at `offset` of `parent` as memory of their own, which keeps `parent`
    /// allocated: many small areas cut from one allocation cost one `cuMemAlloc` (and one
    /// zeroing) instead of one each. Freed with the last view and `parent`'s own handle.
    pub fn view(parent: &Arc<DeviceMemory>, offset: usize, len: usize) -> Result<Self, GpuError> {
        if len == 0 {
            return Err(GpuError::InvalidArgument(
                "an empty view of GPU memory".into(),
            ));
        }
        let ptr = parent.range(offset, len)?;
        Ok(Self {
            cuda: parent.cuda.clone(),
            ptr,
            len,
            owner: Some(Box::new(parent.clone())),
        })
    }

    /// GPU address of the first byte (with `host-gpu`: the host address).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The GPU whose memory this is.
    pub fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of `offset..offset + len`, or an error if it leaves the allocation.
    pub(super) fn range(&self, offset: usize, len: usize) -> Result<u64, GpuError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.ptr + offset as u64),
            _ => Err(GpuError::InvalidArgument(format!(
                "GPU memory access {offset:#x}+{len:#x} outside {:#x} bytes",
                self.len
            ))),
        }
    }

    /// Copies `data` to `offset` (synchronous; set-up and test path, not the hot path).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), GpuError> {
        let dst = self.range(offset, data.len())?;
        // SAFETY: `range` checked that the destination lies in this allocation, which is live
        // (borrowed through `self`).
        unsafe { backend::write_device(&self.cuda, dst, data) }
    }

    /// Copies `data`, rows of `row` bytes, to rows `pitch` bytes apart from `offset`
    /// (synchronous, one `cuMemcpy2D`; the bytes between rows are left as they are): a table
    /// whose used part per page is small is written without its unused rest.
    pub fn write_rows(
        &self,
        offset: usize,
        data: &[u8],
        row: usize,
        pitch: usize,
    ) -> Result<(), GpuError> {
        if data.is_empty() {
            return Ok(());
        }
        if row == 0 || row > pitch || data.len() % row != 0 {
            return Err(GpuError::InvalidArgument(format!(
                "{} bytes as rows of {row} bytes {pitch} bytes apart",
                data.len()
            )));
        }
        let rows = data.len() / row;
        let dst = self.range(offset, (rows - 1) * pitch + row)?;
        // SAFETY: `range` checked that every row lies in this allocation, which is live
        // (borrowed through `self`).
        unsafe { backend::write_device_rows(&self.cuda, dst, data, row, pitch) }
    }

    /// Copies bytes at `offset` into `buf` (synchronous).
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), GpuError> {
        let src = self.range(offset, buf.len())?;
        // SAFETY: `range` checked that the source lies in this allocation, which is live
        // (borrowed through `self`).
        unsafe { backend::read_device(&self.cuda, src, buf) }
    }

    /// Exports `len` bytes at `offset` as a dma-buf file descriptor
    /// (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`). The range must
    /// be aligned to the GPU's page (64 KiB on current GPUs) or the driver refuses it. Refused
    /// by the `host-gpu` build, which has no GPU memory to export (vfio-p2p skips it).
    pub fn export_dma_buf(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<std::os::fd::OwnedFd, GpuError> {
        let ptr = self.range(offset, len)?;
        backend::export_dma_buf(&self.cuda, ptr, len)
    }

    /// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation, as GDRCopy asks of memory a
    /// third party reaches through BAR1: CUDA copies to it then complete before they return.
    /// Nothing to do with `host-gpu` (host memory copies are synchronous already).
    pub fn set_sync_memops(&self) -> Result<(), GpuError> {
        backend::set_sync_memops(&self.cuda, self.ptr)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.owner.is_some() {
            // Registered elsewhere: the owner (dropped with the fields) unregisters it.
            return;
        }
        free_or_defer(
            &self.cuda,
            Deferred::Device {
                ptr: self.ptr,
                len: self.len,
            },
        );
    }
}

/// Unified (managed) memory, `cuMemAllocManaged` with `CU_MEM_ATTACH_GLOBAL`: one address the
/// CPU and the GPU both use, pages migrating on demand (the baseline BaM's paper compares its
/// cache against). Written by the CPU ([`ManagedMemory::write`]), so its pages start on the
/// host and a kernel's first touches fault them over. With `host-gpu`: host memory, as
/// [`DeviceMemory`] is there.
pub struct ManagedMemory {
    /// The allocation (freed by `cuMemFree` like device memory).
    mem: DeviceMemory,
}

impl ManagedMemory {
    /// Allocates `len` bytes of managed memory, zeroed by the CPU (so resident on the host).
    pub fn alloc(cuda: &Arc<Cuda>, len: usize) -> Result<Self, GpuError> {
        let mem = backend::alloc_managed(cuda, len)?;
        let m = Self { mem };
        m.fill_host(0, len, None)?;
        Ok(m)
    }

    /// The address kernels (and the CPU) use.
    pub fn ptr(&self) -> u64 {
        self.mem.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// Copies `data` to `offset` with CPU stores (the pages it touches become the host's).
    /// No kernel may be using the memory.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), GpuError> {
        self.fill_host(offset, data.len(), Some(data))
    }

    /// Copies bytes at `offset` into `buf` with CPU loads (pages migrate back to the host).
    /// No kernel may be using the memory.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), GpuError> {
        let src = self.mem.range(offset, buf.len())?;
        if !buf.is_empty() {
            // Kernels that wrote it have ended (the caller's promise) and the driver makes
            // their stores visible to the faulting CPU; a fence orders our loads after that.
            fence(Ordering::Acquire);
            let p = std::ptr::with_exposed_provenance::<u8>(src as usize);
            // SAFETY: the range lies in this live allocation (checked), which the CPU may
            // address (managed memory: one address for both); the destination is a live slice
            // distinct from it.
            unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) }
        }
        Ok(())
    }

    /// Writes `len` bytes at `offset`: `data`, or zeros.
    fn fill_host(&self, offset: usize, len: usize, data: Option<&[u8]>) -> Result<(), GpuError> {
        let dst = self.mem.range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let p = std::ptr::with_exposed_provenance_mut::<u8>(dst as usize);
        // SAFETY: the range lies in this live allocation (checked), which the CPU may address
        // (managed memory); no kernel is using it (the caller's promise); the source, if any,
        // is a live slice of `len` bytes distinct from it.
        unsafe {
            match data {
                Some(d) => std::ptr::copy_nonoverlapping(d.as_ptr(), p, len),
                None => std::ptr::write_bytes(p, 0, len),
            }
        }
        // Our stores before any kernel launched after this call.
        fence(Ordering::Release);
        Ok(())
    }
}

/// Page-locked host memory mapped into the GPU's address space: doorbell pages, the host's
/// abort word, staging areas. With CUDA, `cuMemHostAlloc` with DEVICEMAP | PORTABLE; with
/// `host-gpu`, zeroed anonymous host memory in whole pages whose device address is its host
/// address.
pub struct PinnedMemory {
    pub(super) cuda: Arc<Cuda>,
    /// Host address of the first byte (page-aligned).
    pub(super) host: *mut u8,
    /// Device address of the first byte.
    pub(super) dev: u64,
    /// Length in bytes (whole pages).
    pub(super) len: usize,
    /// What frees it.
    pub(super) owner: PinnedOwner,
}

/// How a [`PinnedMemory`] was made, and so how it is freed.
pub(super) enum PinnedOwner {
    /// Allocated by the backend (`cuMemHostAlloc`; with `host-gpu`, one mapping): freed with
    /// it.
    Allocated,
    /// Anonymous memory this crate mapped (exactly `host..host + len`) and registered with the
    /// driver: unregistered, then unmapped, with it.
    #[cfg_attr(feature = "host-gpu", allow(dead_code))]
    Registered,
    /// A part of another allocation ([`PinnedMemory::view`]), which it keeps allocated.
    View(#[allow(dead_code, reason = "held only to keep the parent allocated")] Arc<PinnedMemory>),
}

// SAFETY: the allocation is owned by this value; all access is through raw-pointer copies and
// volatile word accesses, which any thread may perform (the GPU, or the host-gpu kernels'
// threads, do too).
unsafe impl Send for PinnedMemory {}
// SAFETY: as above: no method hands out references into the memory.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// Allocates `len` bytes of zeroed pinned memory mapped into the GPU (rounded up to whole
    /// 4 KiB pages).
    pub fn alloc(cuda: &Arc<Cuda>, len: usize) -> Result<Self, GpuError> {
        backend::alloc_pinned(cuda, len)
    }

    /// Allocates `len` bytes of zeroed pinned memory mapped into the GPU, as one allocation to
    /// be cut into many areas ([`PinnedMemory::view`]). With CUDA: anonymous memory in 2 MiB
    /// transparent huge pages (where the kernel grants them) registered with the driver, which
    /// measured half of `cuMemHostAlloc`'s cost per MiB on an H200 (`scripts/setup-costs.py`:
    /// 206 MiB in 62 ms against 116 ms), rounded up to whole 2 MiB; `cuMemHostAlloc` if the
    /// registration is refused. With `host-gpu`, as [`PinnedMemory::alloc`].
    pub fn alloc_large(cuda: &Arc<Cuda>, len: usize) -> Result<Self, GpuError> {
        match backend::alloc_pinned_large(cuda, len) {
            Ok(mem) => Ok(mem),
            Err(e) => {
                tracing::debug!("pinned memory by registration refused ({e}); cuMemHostAlloc");
                Self::alloc(cuda, len)
            }
        }
    }

    /// `len` bytes at `offset` of `parent` (both whole 4 KiB pages, so every view is
    /// page-aligned) as pinned memory of their own, which keeps `parent` allocated: many
    /// areas cut from one allocation pin their pages in one driver call.
    pub fn view(parent: &Arc<PinnedMemory>, offset: usize, len: usize) -> Result<Self, GpuError> {
        let inside = offset.checked_add(len).is_some_and(|e| e <= parent.len);
        if len == 0 || offset % 4096 != 0 || len % 4096 != 0 || !inside {
            return Err(GpuError::InvalidArgument(format!(
                "a view {offset:#x}+{len:#x} of {:#x} bytes of pinned memory (non-empty, \
                 inside, whole 4 KiB pages)",
                parent.len
            )));
        }
        Ok(Self {
            cuda: parent.cuda.clone(),
            host: parent.host.wrapping_add(offset),
            dev: parent.dev + offset as u64,
            len,
            owner: PinnedOwner::View(parent.clone()),
        })
    }

    /// The GPU's address of the first byte (with `host-gpu`: the host address).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// The host address of the first byte (never turned into a Rust reference).
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The host address of `offset`, after checking that `offset..offset + len` is inside.
    ///
    /// # Panics
    /// If it is not (a caller's bug: offsets into pinned memory come from the crate's layouts).
    pub(super) fn at(&self, offset: usize, len: usize) -> *mut u8 {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len),
            "pinned access {offset:#x}+{len:#x} outside {:#x}",
            self.len
        );
        self.host.wrapping_add(offset)
    }

    /// Loads the 32-bit word at `offset` (4-byte aligned) as a word the GPU may be writing:
    /// a volatile load, then an Acquire fence (what the GPU wrote before it is visible after).
    pub fn load_u32(&self, offset: usize) -> u32 {
        assert_eq!(offset % 4, 0);
        let p = self.at(offset, 4).cast::<u32>();
        // SAFETY: in bounds of this live allocation and aligned (checked above; the allocation
        // is page-aligned); volatile because the GPU writes it behind our back.
        let v = unsafe { p.read_volatile() };
        fence(Ordering::Acquire);
        v
    }

    /// Stores the 32-bit word at `offset`: a Release fence, then a volatile store.
    pub fn store_u32(&self, offset: usize, value: u32) {
        assert_eq!(offset % 4, 0);
        let p = self.at(offset, 4).cast::<u32>();
        fence(Ordering::Release);
        // SAFETY: in bounds and aligned (as in `load_u32`); volatile because the GPU reads it
        // behind our back.
        unsafe { p.write_volatile(value) }
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        let p = self.at(offset, data.len());
        // SAFETY: in bounds of this live allocation; the source is a distinct live slice.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) }
    }

    /// Fills `offset..offset + len` from `file` at `file_offset` with positioned reads
    /// (`pread`, repeated until done): the file's bytes land here with one copy by the kernel.
    /// A file shorter than the range is [`std::io::ErrorKind::UnexpectedEof`] (the bytes read
    /// so far are left in place).
    ///
    /// The caller makes sure no GPU work reads or writes the range meanwhile (the memory is
    /// written behind the GPU's back, as by [`PinnedMemory::write`]).
    pub fn read_file_at(
        &self,
        offset: usize,
        len: usize,
        file: &std::fs::File,
        file_offset: u64,
    ) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let p = self.at(offset, len);
        let mut done = 0usize;
        while done < len {
            let at = file_offset
                .checked_add(done as u64)
                .and_then(|o| libc::off_t::try_from(o).ok())
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
            // SAFETY: `p + done .. p + len` is inside this live allocation (checked by `at`);
            // the kernel writes it as plain memory, never through a Rust reference.
            let n = unsafe {
                libc::pread(
                    file.as_raw_fd(),
                    p.wrapping_add(done).cast(),
                    len - done,
                    at,
                )
            };
            match n {
                n if n > 0 => done += n as usize,
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Copies bytes at `offset` out into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) {
        let p = self.at(offset, buf.len());
        // SAFETY: in bounds of this live allocation; the destination is a distinct live slice.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) }
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        let (ptr, len) = (self.host.expose_provenance(), self.len);
        match self.owner {
            PinnedOwner::Allocated => free_or_defer(&self.cuda, Deferred::Host { ptr, len }),
            PinnedOwner::Registered => free_or_defer(&self.cuda, Deferred::Registered { ptr, len }),
            // The parent (dropped with the fields) frees it with its last view.
            PinnedOwner::View(_) => {}
        }
    }
}

/// A host range made reachable by GPU threads; unregistered on drop. With CUDA,
/// `cuMemHostRegister` (DEVICEMAP | PORTABLE, plus IOMEMORY for device registers); with
/// `host-gpu`, nothing is registered: the device address is the host address.
///
/// It does not own the range: whoever creates it keeps the range mapped for as long as it lives
/// (see [`HostRegistration::register`]).
pub struct HostRegistration {
    pub(super) cuda: Arc<Cuda>,
    /// Host address of the first byte (a key for the driver; never dereferenced here).
    pub(super) host: *mut u8,
    /// Length in bytes.
    pub(super) len: usize,
    /// Device address of the first byte.
    pub(super) dev: u64,
}

// SAFETY: the registration is a driver-side object (none with `host-gpu`); this type holds only
// its host address, as a key and a number to report, and never dereferences it.
unsafe impl Send for HostRegistration {}
// SAFETY: as above: no method reads or writes the range.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Makes `len` bytes at `host` reachable by kernels and returns the registration
    /// ([`HostRegistration::register_with`], not read-only). `io_memory`: the range is device
    /// memory (a BAR mapping), registered with `CU_MEMHOSTREGISTER_IOMEMORY` (root only:
    /// `CUDA_ERROR_NOT_PERMITTED` otherwise; the `host-gpu` build ignores it). The caller
    /// touches every page first where the mapping needs it (BAR0 through VFIO does).
    ///
    /// # Safety
    /// `host..host + len` is mapped in this process, page-aligned, and stays mapped until the
    /// returned value is dropped (the GPU keeps a translation for it; unmapping first would
    /// leave it a dangling mapping).
    pub unsafe fn register(
        cuda: &Arc<Cuda>,
        host: *mut u8,
        len: usize,
        io_memory: bool,
    ) -> Result<Self, GpuError> {
        // SAFETY: forwarded: the caller's promise.
        unsafe { Self::register_with(cuda, host, len, io_memory, false) }
    }

    /// [`HostRegistration::register`], optionally `CU_MEMHOSTREGISTER_READ_ONLY` (the GPU
    /// only reads the range: what a read-only file mapping allows; the `host-gpu` build accepts
    /// and ignores it, nothing enforcing it on the host).
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
        // SAFETY: forwarded: the caller's promise, which is the backend's precondition.
        unsafe { backend::register(cuda, host, len, io_memory, read_only) }
    }

    /// GPU address of the first byte (with `host-gpu`: the host address).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that the registration covers the byte at `offset` (a doorbell page, say) and
    /// returns its GPU address, `device_ptr() + offset`: CUDA is asked again for the address
    /// (`cuMemHostGetDevicePointer`), which must be that one.
    pub fn verify(&self, offset: usize) -> Result<u64, GpuError> {
        if offset >= self.len {
            return Err(GpuError::InvalidArgument(format!(
                "offset {offset:#x} outside a registration of {:#x} bytes",
                self.len
            )));
        }
        let got = backend::registered_address(self, offset)?;
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
        // SAFETY: the registration made when `self` was created, unregistered once, here; the
        // range is still mapped (the creator's contract).
        unsafe { backend::unregister(&self.cuda, self.host) }
    }
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMemory({:#x}+{:#x})", self.ptr, self.len)
    }
}

/// How [`PinnedMemory`] and [`HostRegistration`] print: `Type(host 0x…, gpu 0x…, 0x…)`.
fn fmt_host_range(
    f: &mut std::fmt::Formatter<'_>,
    ty: &str,
    host: *mut u8,
    dev: u64,
    len: usize,
) -> std::fmt::Result {
    write!(f, "{ty}(host {host:p}, gpu {dev:#x}, {len:#x})")
}

impl std::fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_host_range(f, "PinnedMemory", self.host, self.dev, self.len)
    }
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fmt_host_range(f, "HostRegistration", self.host, self.dev, self.len)
    }
}

/// Anonymous memory for either backend (host-gpu's memory, CUDA's registered pinned memory).
/// Maps `len` bytes (a multiple of the page size) of zeroed memory aligned to `align` (a
/// multiple of the page size, a power of two); returns its address. Unmapped by whoever
/// frees it (`munmap` of exactly `len` bytes there).
pub(super) fn map_zeroed(len: usize, align: usize, what: &str) -> Result<*mut u8, GpuError> {
    let reserve = len
        .checked_add(align)
        .ok_or_else(|| GpuError::InvalidArgument(format!("{what}: {len} bytes is too many")))?;
    // SAFETY: an anonymous private mapping at an address of the kernel's choosing; it
    // overlaps nothing.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(GpuError::Os {
            op: format!("mmap of {len} bytes of {what}"),
            source: std::io::Error::last_os_error(),
        });
    }
    let base = base.cast::<u8>();
    let head = base.addr().next_multiple_of(align) - base.addr();
    let tail = reserve - head - len;
    // SAFETY: `head <= align`, so `base + head .. + len` lies within the mapping just made; the
    // trimmed ends are page-aligned pieces of it that nothing refers to.
    unsafe {
        let start = base.add(head);
        if head > 0 {
            libc::munmap(base.cast(), head);
        }
        if tail > 0 {
            libc::munmap(start.add(len).cast(), tail);
        }
        Ok(start)
    }
}

// ---------------------------------------------------------------------------------------------
// Frees held back while a kernel may be waiting for a controller.

/// Memory whose free waits until no kernel may be waiting for a controller.
#[derive(Clone, Copy, Debug)]
pub(super) enum Deferred {
    /// GPU memory: its device address and the length asked for.
    Device {
        /// Device address of the first byte.
        ptr: u64,
        /// Length the owner was allocated with (the host backend's layout; CUDA needs none).
        #[cfg_attr(not(feature = "host-gpu"), allow(dead_code))]
        len: usize,
    },
    /// Pinned host memory: its host address (provenance exposed) and length.
    Host {
        /// Host address of the first byte.
        ptr: usize,
        /// Length the owner was allocated with (the host backend's layout; CUDA needs none).
        #[cfg_attr(not(feature = "host-gpu"), allow(dead_code))]
        len: usize,
    },
    /// Host memory this crate mapped and registered ([`PinnedOwner::Registered`]): its host
    /// address (provenance exposed) and the mapping's length; unregistered, then unmapped.
    #[cfg_attr(feature = "host-gpu", allow(dead_code))]
    Registered {
        /// Host address of the first byte.
        ptr: usize,
        /// Length of the mapping.
        len: usize,
    },
    /// A library of kernels (`cuLibraryUnload`): its handle (provenance exposed). With
    /// `host-gpu` there is none.
    #[cfg_attr(feature = "host-gpu", allow(dead_code))]
    Library {
        /// The `CUlibrary`.
        handle: usize,
    },
}

/// What frees wait for, and the frees held back meanwhile, for one GPU.
///
/// With CUDA, `cuMemFree` and `cuMemFreeHost` wait until the whole device is idle, and while
/// they wait other host threads' kernel launches wait too (measured on an H100 with
/// driver 580, `benches/probes/stream_progress.cu`: a free 5 ms into a client kernel's wait held
/// a second thread's launch until that kernel gave up, 2 s later; `cuMemHostUnregister` and
/// `cuModuleLoadData` did the same, allocations did not; `cuLibraryUnload` of one GPU-resident
/// model's library waited for another model's persistent kernel and held a third thread's
/// `cuStreamDestroy` behind a driver lock, H100 2026-11-26 under gdb). A kernel waiting for a controller
/// that runs on the host (the software controller, whose threads launch copy kernels) or in
/// another kernel (the GPU-resident model, a persistent kernel) would then wait forever, and
/// the free with it: the stall of docs/testing.md. So a free is held back while
///
/// - a persistent kernel runs ([`persistent_kernel_started`]), or
/// - a client stream ([`super::Placement::Client`], where every kernel that drives GPU queues
///   runs) has work in flight;
///
/// and performed by the first free, or the first client stream seen idle, once neither holds.
/// The check and the frees happen under the GPU's launch gate, which launches on its client
/// streams share, so no client kernel starts between "all idle" and the free. With `host-gpu`,
/// the backend also holds frees while any of its streams has work (CPU threads may still read
/// the memory).
///
/// **Per GPU.** Each GPU (ordinal) has its own [`GpuHolds`]: a GPU-memory free waits only for
/// its own GPU's kernels, and a launch on one GPU's client stream never waits for another
/// GPU's free. Pinned host memory and libraries of kernels are not one GPU's: pinned memory is
/// mapped into every context (allocated portable) and a library is loaded into each context
/// that used it, and whether their frees wait for other devices' kernels has not been measured
/// (one GPU lent so far). They are held back while any GPU is busy, checked and freed under
/// every GPU's gate (taken in ordinal order), so they delay other GPUs' launches only for the
/// moment of that check and free, never a GPU-memory free.
struct Holds {
    /// Persistent kernels running.
    persistent: usize,
    /// Client streams, by id ([`track_client_stream`]).
    streams: Vec<(u64, std::sync::Weak<backend::RawStream>)>,
    next_id: u64,
    /// Frees of this GPU's memory held back, in the order they were asked for.
    held: Vec<Deferred>,
}

impl Holds {
    /// Whether a persistent kernel runs or a client stream has work in flight (a stream that
    /// reports an error has none running).
    fn busy(&self) -> bool {
        self.persistent > 0
            || self
                .streams
                .iter()
                .filter_map(|(_, s)| s.upgrade())
                .any(|s| matches!(s.is_idle(), Ok(false)))
    }
}

/// One GPU's frees held back and what holds them (see [`Holds`]); every [`Cuda`] of that
/// ordinal shares it.
pub(super) struct GpuHolds {
    ordinal: i32,
    /// Shared by launches on this GPU's client streams, exclusive while frees check that
    /// nothing runs and free.
    gate: std::sync::RwLock<()>,
    holds: std::sync::Mutex<Holds>,
    /// Frees held back (read without the lock, to keep "nothing held" cheap).
    held: std::sync::atomic::AtomicUsize,
}

impl GpuHolds {
    fn holds(&self) -> std::sync::MutexGuard<'_, Holds> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gate_exclusive(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.gate.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// Every GPU opened in this process, by ordinal (ascending: the order gates are taken in).
static GPUS: std::sync::Mutex<Vec<Arc<GpuHolds>>> = std::sync::Mutex::new(Vec::new());

/// Frees that are no one GPU's (pinned host memory, libraries), with the GPU each was made on,
/// held back while any GPU is busy.
static SHARED: std::sync::Mutex<Vec<(Arc<Cuda>, Deferred)>> = std::sync::Mutex::new(Vec::new());

/// `SHARED`'s length (read without the lock).
static SHARED_HELD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn gpus() -> std::sync::MutexGuard<'static, Vec<Arc<GpuHolds>>> {
    GPUS.lock().unwrap_or_else(|e| e.into_inner())
}

fn shared() -> std::sync::MutexGuard<'static, Vec<(Arc<Cuda>, Deferred)>> {
    SHARED.lock().unwrap_or_else(|e| e.into_inner())
}

/// GPU `ordinal`'s holds, made on its first open.
pub(super) fn holds_of(ordinal: i32) -> Arc<GpuHolds> {
    let mut all = gpus();
    match all.binary_search_by_key(&ordinal, |g| g.ordinal) {
        Ok(i) => all[i].clone(),
        Err(i) => {
            let g = Arc::new(GpuHolds {
                ordinal,
                gate: std::sync::RwLock::new(()),
                holds: std::sync::Mutex::new(Holds {
                    persistent: 0,
                    streams: Vec::new(),
                    next_id: 0,
                    held: Vec::new(),
                }),
                held: std::sync::atomic::AtomicUsize::new(0),
            });
            all.insert(i, g.clone());
            g
        }
    }
}

/// Registers a client stream of `cuda`'s GPU: that GPU's frees are held back while it has work
/// in flight. Returns the id [`untrack_stream`] takes.
pub(super) fn track_client_stream(cuda: &Cuda, raw: &Arc<backend::RawStream>) -> u64 {
    let mut h = cuda.holds.holds();
    h.next_id += 1;
    let id = h.next_id;
    h.streams.push((id, Arc::downgrade(raw)));
    id
}

/// Forgets a client stream being destroyed (no query reaches it after this returns).
pub(super) fn untrack_stream(cuda: &Cuda, id: u64) {
    cuda.holds.holds().streams.retain(|(i, _)| *i != id);
}

/// Held while a kernel is launched on a client stream of `cuda`'s GPU (see [`Holds`]).
pub(super) fn client_launch_gate(cuda: &Cuda) -> std::sync::RwLockReadGuard<'_, ()> {
    cuda.holds.gate.read().unwrap_or_else(|e| e.into_inner())
}

/// Frees the memory of a dropped owner (`what`), or holds it back while a kernel may be waiting
/// for a controller (see [`Holds`]).
pub(super) fn free_or_defer(cuda: &Arc<Cuda>, what: Deferred) {
    if what.is_shared() {
        {
            let mut s = shared();
            s.push((cuda.clone(), what));
            SHARED_HELD.store(s.len(), Ordering::Relaxed);
        }
        settle(cuda, None);
    } else {
        settle(cuda, Some(what));
    }
}

/// Performs the frees held back, if any and if nothing holds them any more (see [`Holds`]).
pub(super) fn release_held(cuda: &Cuda) {
    if cuda.holds.held.load(Ordering::Relaxed) != 0 || SHARED_HELD.load(Ordering::Relaxed) != 0 {
        settle(cuda, None);
    }
}

/// Under `cuda`'s GPU's gate: adds `new` (memory of that GPU) to the frees held back, then
/// performs them all (in the order they were asked for) unless something on that GPU still
/// holds them; then the shared frees, if nothing holds them on any GPU.
fn settle(cuda: &Cuda, new: Option<Deferred>) {
    let gpu = &cuda.holds;
    let held = {
        let _gate = gpu.gate_exclusive();
        let held = {
            let mut h = gpu.holds();
            h.held.extend(new);
            if h.held.is_empty() || h.busy() {
                gpu.held.store(h.held.len(), Ordering::Relaxed);
                None
            } else {
                gpu.held.store(0, Ordering::Relaxed);
                Some(std::mem::take(&mut h.held))
            }
        };
        for d in held.iter().flatten() {
            // SAFETY: each is the allocation of an owner that was dropped (nothing refers to it
            // any more), on this GPU, held back at most once, freed once, here.
            unsafe { backend::free(cuda, *d) }
        }
        held
    };
    drop(held);
    if SHARED_HELD.load(Ordering::Relaxed) != 0 {
        settle_shared();
    }
}

/// Performs the shared frees if no GPU is busy, under every GPU's gate (ascending ordinals; a
/// thread holds at most one gate anywhere else, so no cycle forms).
fn settle_shared() {
    let all: Vec<Arc<GpuHolds>> = gpus().clone();
    let _gates: Vec<_> = all.iter().map(|g| g.gate_exclusive()).collect();
    if all.iter().any(|g| g.holds().busy()) {
        return;
    }
    let frees = {
        let mut s = shared();
        SHARED_HELD.store(0, Ordering::Relaxed);
        std::mem::take(&mut *s)
    };
    for (cuda, d) in frees {
        // SAFETY: each is the allocation (or library) of an owner that was dropped, held back
        // at most once, freed once, here, with the GPU it was made on.
        unsafe { backend::free(&cuda, d) }
    }
}

impl Deferred {
    /// Whether the free is no one GPU's (see [`Holds`]).
    fn is_shared(self) -> bool {
        !matches!(self, Deferred::Device { .. })
    }
}

/// Frees held back now, on every GPU (for reports and tests).
pub fn held_frees() -> usize {
    let per_gpu: usize = gpus().iter().map(|g| g.held.load(Ordering::Relaxed)).sum();
    per_gpu + SHARED_HELD.load(Ordering::Relaxed)
}

/// Frees of `cuda`'s GPU memory held back now (for reports and tests; pinned memory and
/// libraries, which are no one GPU's, are counted by [`held_frees`]).
pub fn held_frees_on(cuda: &Cuda) -> usize {
    cuda.holds.held.load(Ordering::Relaxed)
}

/// Marks a persistent kernel as running on `cuda`'s GPU: until [`persistent_kernel_ended`],
/// frees of that GPU's memory (and of pinned memory) are held back instead of synchronising
/// with the device.
pub fn persistent_kernel_started(cuda: &Cuda) {
    cuda.holds.holds().persistent += 1;
}

/// Marks a persistent kernel of `cuda`'s GPU as ended (its stream is idle); performs the frees
/// held back meanwhile once nothing else holds them (with `host-gpu`, each once no stream has
/// work in flight).
pub fn persistent_kernel_ended(cuda: &Cuda) {
    {
        let mut h = cuda.holds.holds();
        h.persistent = h.persistent.saturating_sub(1);
    }
    release_held(cuda);
}
