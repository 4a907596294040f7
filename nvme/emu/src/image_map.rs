//! An image file mapped for reading: a Read copies its blocks out of the page cache with no
//! system call ([`crate::ImageReads::Mapped`]).
//!
//! The mapping is shared and read-only. The controller writes the file only with positioned
//! writes, which change the mapped bytes in place (one page cache); so that no slice of the
//! mapping is ever read while such a write changes it, the image is cut into stripes of
//! [`STRIPE`] bytes, each behind a reader-writer lock: a read holds its stripe's read lock
//! while it copies (a read spanning stripes copies piece by piece), a write holds the write
//! locks of every stripe it touches, taken in ascending order (readers hold one lock at a
//! time, so the order cannot deadlock).
// UNSAFETY: creating a file mapping is unsafe because another writer could change or truncate
// the file under it; see `ImageMap::new` for why that cannot happen here.
#![expect(unsafe_code)]

use std::fs::File;
use std::sync::{RwLock, RwLockReadGuard};

use memmap2::{Mmap, MmapOptions};

use crate::stripes::{STRIPE, StripedBytes, stripe_pieces, stripe_single};

/// The first `len` bytes of an image file, mapped shared and read-only, with a lock per stripe.
pub(crate) struct ImageMap {
    map: Mmap,
    stripes: Box<[RwLock<()>]>,
}

impl ImageMap {
    /// Maps the first `len` bytes (nonzero, at most the file's length) of `file`.
    pub(crate) fn new(file: &File, len: u64) -> std::io::Result<Self> {
        let n = usize::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: the bytes behind a Mmap must not change while a slice of them is borrowed,
        // and the file must not shrink below the mapping. The controller holds a flock(2) on
        // the image for as long as it runs (exclusive when it may write; shared, with every
        // other holder a reader, when read-only), so no cooperating process writes or
        // truncates it; its own writes take the write locks of the stripes they touch
        // (ImageMap::write_locked), and every slice lives only under a stripe's read lock
        // (with_bytes, read_into). A process that ignores the lock and truncates the image
        // makes the next read of the lost pages raise SIGBUS (documented at ImageReads).
        let map = unsafe { MmapOptions::new().len(n).map(file)? };
        let stripes = (0..n.div_ceil(STRIPE)).map(|_| RwLock::new(())).collect();
        Ok(Self { map, stripes })
    }

    fn read_stripe(&self, i: usize) -> RwLockReadGuard<'_, ()> {
        self.stripes[i].read().unwrap_or_else(|e| e.into_inner())
    }

    /// A hint: starts moving the bytes at `offset..offset + len` (inside the mapping) into the
    /// CPU's caches, without waiting for them and without faulting in pages.
    pub(crate) fn prefetch(&self, offset: u64, len: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
            let start = offset as usize;
            let end = (start + len).min(self.map.len());
            let base = self.map.as_ptr();
            let mut at = start & !63;
            while at < end {
                // SAFETY: a prefetch is only a hint: it reads nothing into the program, cannot
                // fault (an unmapped or not-present page is skipped), and `at` lies inside the
                // mapping, so the pointer arithmetic stays in bounds.
                unsafe { _mm_prefetch::<{ _MM_HINT_T1 }>(base.add(at).cast::<i8>()) };
                at += 64;
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (offset, len);
    }

    /// Runs `write` (a positioned write of the file's bytes `offset..offset + len`) holding
    /// the write locks of every stripe the range touches, so that no read copies those bytes
    /// while they change.
    pub(crate) fn write_locked<R>(&self, offset: u64, len: u64, write: impl FnOnce() -> R) -> R {
        let mut held = Vec::new();
        stripe_pieces(offset, len, |i, _, _, _| {
            held.push(self.stripes[i].write().unwrap_or_else(|e| e.into_inner()));
        });
        write()
    }
}

impl StripedBytes for ImageMap {
    fn with_bytes<R>(&self, offset: u64, len: usize, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let (i, _) = stripe_single(offset, len)?;
        let _held = self.read_stripe(i);
        let at = offset as usize;
        Some(f(&self.map[at..at + len]))
    }

    fn read_into(&self, offset: u64, out: &mut [u8]) {
        stripe_pieces(offset, out.len() as u64, |i, _, at, n| {
            let _held = self.read_stripe(i);
            let from = offset as usize + at;
            out[at..at + n].copy_from_slice(&self.map[from..from + n]);
        });
    }
}
