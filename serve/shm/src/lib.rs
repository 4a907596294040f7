//! Memory shared between `gpunvme serve` and its clients ([`SharedMemory`]): a `memfd`, sealed
//! so that its size can never change, mapped `MAP_SHARED` by the daemon (which creates it and
//! registers it with the controller) and by the client it is passed to (which drives queues in
//! it). The controller reads and writes the same bytes.
//!
//! Every byte of it can change underneath any of them at any time (another process, the
//! controller's threads), so it is never reached through Rust references: bulk data by raw
//! copies, protocol words (doorbells, completion dwords) by atomics with the ordering each
//! caller names. A client cannot shrink the memory under the daemon (the seals refuse
//! `ftruncate`), so no access here can fault on a page the file lost.
// UNSAFETY: this module owns the raw pointer of each shared mapping and must dereference it.
#![expect(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

/// Pages, for sizes: every shared memory is whole pages.
pub const PAGE: usize = 4096;

/// Seals every shared memory carries: its size is fixed, and the seals themselves too.
const SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Why shared memory could not be made, mapped or used.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A system call failed.
    #[error("{doing}")]
    Os {
        /// What was being done.
        doing: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The descriptor is not the shared memory it was said to be.
    #[error("{0}")]
    NotShared(String),
    /// An access outside the memory, or misaligned for a word.
    #[error(
        "{what} at offset {offset} of {len} bytes: outside the {size}-byte memory or misaligned"
    )]
    OutOfRange {
        /// What was accessed.
        what: &'static str,
        /// Where.
        offset: usize,
        /// How many bytes.
        len: usize,
        /// The memory's size.
        size: usize,
    },
}

fn os(doing: &'static str) -> impl FnOnce(rustix::io::Errno) -> ShmError {
    move |e| ShmError::Os {
        doing,
        source: e.into(),
    }
}

/// A sealed memfd mapped shared (see the module documentation).
pub struct SharedMemory {
    map: MmapRaw,
    file: File,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("len", &self.len())
            .finish()
    }
}

impl SharedMemory {
    /// `len` bytes (a nonzero multiple of [`PAGE`]) of new shared memory named `name` (shown in
    /// `/proc/PID/maps`), zeroed, sealed against resizing.
    pub fn create(name: &str, len: usize) -> Result<Self, ShmError> {
        if len == 0 || len % PAGE != 0 {
            return Err(ShmError::NotShared(format!(
                "shared memory of {len} bytes: whole {PAGE}-byte pages, at least one"
            )));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(os("creating a memfd"))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(os("sizing a memfd"))?;
        rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(os("sealing a memfd"))?;
        Self::map_file(File::from(fd), len)
    }

    /// Maps shared memory received from the other side, which must be a memfd of exactly
    /// `len` bytes sealed against resizing (anything else, such as a regular file that could
    /// be truncated under the mapping, is refused by name).
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<Self, ShmError> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            ShmError::NotShared(format!(
                "the descriptor is not a sealable memfd ({}): shared memory must be one",
                std::io::Error::from(e)
            ))
        })?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(ShmError::NotShared(format!(
                "the memfd is not sealed against resizing (seals {seals:?})"
            )));
        }
        let st = rustix::fs::fstat(&fd).map_err(os("reading a memfd's size"))?;
        if u64::try_from(st.st_size).ok() != Some(len as u64) || len == 0 || len % PAGE != 0 {
            return Err(ShmError::NotShared(format!(
                "the memfd holds {} bytes, {len} were announced",
                st.st_size
            )));
        }
        Self::map_file(File::from(fd), len)
    }

    fn map_file(file: File, len: usize) -> Result<Self, ShmError> {
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|source| ShmError::Os {
                doing: "mapping shared memory",
                source,
            })?;
        Ok(Self { map, file })
    }

    /// The memfd, to pass to the other side.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The mapping's first byte, for registering the memory with an IOMMU (VFIO's MAP_DMA) or
    /// a GPU driver. Never turn it into a Rust reference: every party may write the bytes.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Never: shared memory is at least a page.
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn check(
        &self,
        what: &'static str,
        offset: usize,
        len: usize,
        align: usize,
    ) -> Result<(), ShmError> {
        let inside = offset.checked_add(len).is_some_and(|end| end <= self.len());
        if !inside || offset % align != 0 {
            return Err(ShmError::OutOfRange {
                what,
                offset,
                len,
                size: self.len(),
            });
        }
        Ok(())
    }

    /// Copies `buf.len()` bytes at `offset` out.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), ShmError> {
        self.check("a read", offset, buf.len(), 1)?;
        // SAFETY: in bounds (checked); the mapping lives as long as `self` and cannot shrink
        // (sealed); the source is not a Rust reference and the destination is a distinct
        // slice. Concurrent writers can only make the bytes stale, as a device's would.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                buf.as_mut_ptr(),
                buf.len(),
            );
        }
        Ok(())
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), ShmError> {
        self.check("a write", offset, data.len(), 1)?;
        // SAFETY: as in `read`, with the roles swapped; the mapping is writable.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                data.len(),
            );
        }
        Ok(())
    }

    /// Zeroes `len` bytes at `offset`.
    pub fn zero(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        self.check("zeroing", offset, len, 1)?;
        // SAFETY: in bounds (checked), writable, no Rust reference into it.
        unsafe { std::ptr::write_bytes(self.map.as_mut_ptr().add(offset), 0, len) };
        Ok(())
    }

    fn word(&self, what: &'static str, offset: usize) -> Result<&AtomicU32, ShmError> {
        self.check(what, offset, 4, 4)?;
        // SAFETY: in bounds and 4-aligned (checked; the mapping is page-aligned); every
        // access to protocol words by any party is atomic (the other side's by contract,
        // the controller's by its doorbell and completion code), and the mapping outlives
        // the returned reference (it borrows `self`).
        Ok(unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(offset).cast()) })
    }

    /// The little-endian `u32` at `offset` (4-aligned), loaded with `order`.
    pub fn load_u32(&self, offset: usize, order: Ordering) -> Result<u32, ShmError> {
        Ok(u32::from_le(self.word("a word load", offset)?.load(order)))
    }

    /// Stores `value` as the little-endian `u32` at `offset` (4-aligned) with `order`.
    pub fn store_u32(&self, offset: usize, value: u32, order: Ordering) -> Result<(), ShmError> {
        self.word("a word store", offset)?
            .store(value.to_le(), order);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_memory_is_zeroed_sealed_and_shared_through_its_descriptor() {
        let a = SharedMemory::create("test", 2 * PAGE).unwrap();
        let mut buf = [1u8; 16];
        a.read(PAGE - 8, &mut buf).unwrap();
        assert_eq!(buf, [0; 16]);
        a.write(100, b"hello").unwrap();
        a.store_u32(PAGE, 0xdead_beef, Ordering::Release).unwrap();
        // The other side: the same pages through a duplicate of the descriptor.
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = SharedMemory::from_fd(fd, 2 * PAGE).unwrap();
        let mut got = [0u8; 5];
        b.read(100, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        assert_eq!(b.load_u32(PAGE, Ordering::Acquire).unwrap(), 0xdead_beef);
        // Sealed: the size cannot change under either mapping.
        assert!(rustix::fs::ftruncate(b.fd(), 0).is_err());
        assert!(rustix::fs::ftruncate(b.fd(), 8 * PAGE as u64).is_err());
    }

    #[test]
    fn accesses_outside_or_misaligned_are_refused() {
        let a = SharedMemory::create("test", PAGE).unwrap();
        let mut buf = [0u8; 8];
        assert!(matches!(
            a.read(PAGE - 4, &mut buf),
            Err(ShmError::OutOfRange {
                offset: 4092,
                len: 8,
                size: 4096,
                ..
            })
        ));
        assert!(a.write(usize::MAX, b"x").is_err());
        assert!(a.load_u32(2, Ordering::Relaxed).is_err());
        assert!(a.store_u32(PAGE, 1, Ordering::Relaxed).is_err());
        assert!(a.zero(PAGE, 1).is_err());
        assert!(SharedMemory::create("test", 100).is_err());
        assert!(SharedMemory::create("test", 0).is_err());
    }

    #[test]
    fn a_descriptor_that_is_not_sealed_shared_memory_of_the_size_is_refused() {
        // A regular file: could be truncated under the mapping.
        let f = tempfile_fd();
        let e = SharedMemory::from_fd(f, PAGE).unwrap_err().to_string();
        assert!(e.contains("sealed") || e.contains("memfd"), "{e}");
        // A memfd without seals.
        let fd = rustix::fs::memfd_create("unsealed", MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, PAGE as u64).unwrap();
        let e = SharedMemory::from_fd(fd, PAGE).unwrap_err().to_string();
        assert!(e.contains("not sealed"), "{e}");
        // Sealed, but of another size than announced.
        let a = SharedMemory::create("test", PAGE).unwrap();
        let e = SharedMemory::from_fd(a.fd().try_clone_to_owned().unwrap(), 2 * PAGE)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4096 bytes, 8192 were announced"), "{e}");
    }

    fn tempfile_fd() -> OwnedFd {
        let dir = std::env::temp_dir().join(format!("gpunvme-shm-test-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; PAGE]).unwrap();
        let f = File::open(&dir).unwrap();
        std::fs::remove_file(&dir).unwrap();
        f.into()
    }
}
