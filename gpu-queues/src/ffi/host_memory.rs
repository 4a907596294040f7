//! The host-side parts of [`DeviceMemory`], [`PinnedMemory`] and [`HostRegistration`] that both
//! backends share (their fields are the same: `ptr`/`len` of device memory, `host`/`len` of
//! pinned memory and registrations): bounds checks, access to pinned memory by volatile words
//! and raw copies, and how they print. Allocation, copies to and from the GPU, registering and
//! freeing are each backend's own.
// UNSAFETY: pinned memory is shared with the GPU, so the host reaches it only through raw
// pointers (volatile words, copies), never references; every access is bounds-checked first.
#![expect(unsafe_code)]

use std::sync::atomic::{Ordering, fence};

use std::sync::Arc;

use super::{Cuda, DeviceMemory, HostRegistration, PinnedMemory};
use crate::error::GpuError;

impl DeviceMemory {
    /// GPU address of the first byte (with `host-gpu`: the host address).
    pub fn ptr(&self) -> u64 {
        self.ptr
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
}

impl PinnedMemory {
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

    /// Copies bytes at `offset` out into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) {
        let p = self.at(offset, buf.len());
        // SAFETY: in bounds of this live allocation; the destination is a distinct live slice.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) }
    }
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceMemory({:#x}+{:#x})", self.ptr, self.len)
    }
}

impl std::fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedMemory(host {:p}, gpu {:#x}, {:#x})",
            self.host,
            self.device_ptr(),
            self.len
        )
    }
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostRegistration(host {:p}, gpu {:#x}, {:#x})",
            self.host,
            self.device_ptr(),
            self.len
        )
    }
}

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

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
