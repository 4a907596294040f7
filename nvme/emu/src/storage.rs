//! Namespace media: the bytes behind each namespace, in memory, in a file, or nowhere.
//!
//! Every controller thread reads and writes the media of every namespace at once, so media are
//! shared (`&self` only):
//! - a file is read and written with positioned I/O (`pread`/`pwrite`), which needs no lock;
//! - memory is cut into stripes of [`STRIPE`] bytes, each an anonymous mapping (zero pages
//!   until written, so a big namespace costs memory only for the blocks written) behind its own
//!   reader-writer lock. A block never spans two stripes (stripes are a multiple of every LBA
//!   size), so each block is read or written whole; a command spanning stripes takes their
//!   locks one at a time.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use memmap2::MmapMut;

use crate::config::{Backend, NamespaceConfig, open_image};
use crate::error::EmuError;

/// Zeroes written per call when zeroing a range of a file.
const ZERO_CHUNK: usize = 1 << 20;

/// Bytes per lock (and per mapping) of a memory namespace.
pub(crate) const STRIPE: usize = 2 << 20;

/// A namespace's media.
pub(crate) enum Media {
    /// In memory.
    Memory(MemoryMedia),
    /// In an image file.
    File(File),
    /// Nowhere: reads and writes move no data.
    Null,
}

/// A memory namespace's bytes: stripes of [`STRIPE`] bytes (the last may be shorter), each
/// behind its own lock.
pub(crate) struct MemoryMedia {
    stripes: Box<[RwLock<MmapMut>]>,
}

impl MemoryMedia {
    /// `len` zeroed bytes, or `None` if the memory cannot be mapped.
    fn new(len: u64) -> Option<Self> {
        let len = usize::try_from(len).ok()?;
        let stripes = (0..len.div_ceil(STRIPE))
            .map(|i| {
                let n = (len - i * STRIPE).min(STRIPE);
                MmapMut::map_anon(n).ok().map(RwLock::new)
            })
            .collect::<Option<Box<[_]>>>()?;
        Some(Self { stripes })
    }

    fn read_stripe(&self, i: usize) -> RwLockReadGuard<'_, MmapMut> {
        self.stripes[i].read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_stripe(&self, i: usize) -> RwLockWriteGuard<'_, MmapMut> {
        self.stripes[i].write().unwrap_or_else(|e| e.into_inner())
    }

    /// The stripe holding all of `offset..offset + len`, and the offset in it; `None` when the
    /// range spans stripes.
    fn single(offset: u64, len: usize) -> Option<(usize, usize)> {
        let (i, at) = (
            (offset / STRIPE as u64) as usize,
            (offset % STRIPE as u64) as usize,
        );
        (at + len <= STRIPE).then_some((i, at))
    }

    /// Calls `f` with the bytes at `offset..offset + len` (inside the media) under its stripe's
    /// read lock; `None` (without calling `f`) when the range spans stripes.
    pub(crate) fn with_bytes<R>(
        &self,
        offset: u64,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Option<R> {
        let (i, at) = Self::single(offset, len)?;
        Some(f(&self.read_stripe(i)[at..at + len]))
    }

    /// Calls `f` with the bytes at `offset..offset + len` (inside the media) under its stripe's
    /// write lock; `None` (without calling `f`) when the range spans stripes.
    pub(crate) fn with_bytes_mut<R>(
        &self,
        offset: u64,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Option<R> {
        let (i, at) = Self::single(offset, len)?;
        Some(f(&mut self.write_stripe(i)[at..at + len]))
    }

    /// Calls `f(stripe index, offset in the stripe, offset in the range, length)` for each
    /// piece of `offset..offset + len` that lies in one stripe, in order.
    fn pieces(offset: u64, len: u64, mut f: impl FnMut(usize, usize, usize, usize)) {
        let mut done = 0u64;
        while done < len {
            let at = offset + done;
            let (i, off) = ((at / STRIPE as u64) as usize, (at % STRIPE as u64) as usize);
            let n = (len - done).min((STRIPE - off) as u64) as usize;
            f(i, off, done as usize, n);
            done += n as u64;
        }
    }

    /// Copies the bytes at `offset` (inside the media) into `out`.
    pub(crate) fn read_into(&self, offset: u64, out: &mut [u8]) {
        Self::pieces(offset, out.len() as u64, |i, off, at, n| {
            out[at..at + n].copy_from_slice(&self.read_stripe(i)[off..off + n]);
        });
    }

    /// Copies `data` to `offset` (inside the media).
    pub(crate) fn write_from(&self, offset: u64, data: &[u8]) {
        Self::pieces(offset, data.len() as u64, |i, off, at, n| {
            self.write_stripe(i)[off..off + n].copy_from_slice(&data[at..at + n]);
        });
    }

    /// Zeroes `len` bytes at `offset` (inside the media).
    fn zero(&self, offset: u64, len: u64) {
        Self::pieces(offset, len, |i, off, _, n| {
            self.write_stripe(i)[off..off + n].fill(0);
        });
    }
}

/// An active namespace.
pub(crate) struct Namespace {
    /// Size in logical blocks (NSZE).
    pub(crate) blocks: u64,
    /// Logical block size in bytes.
    pub(crate) lba_size: u32,
    /// log2 of `lba_size`.
    pub(crate) lba_shift: u32,
    /// Write protected ([`NamespaceConfig::read_only`]).
    pub(crate) read_only: bool,
    /// Format and command set ([`NamespaceConfig::format`]).
    pub(crate) format: crate::NsFormat,
    pub(crate) media: Media,
}

impl Namespace {
    /// Opens or allocates the media for namespace `nsid` (the config is already validated).
    pub(crate) fn open(nsid: u32, config: &NamespaceConfig) -> Result<Self, EmuError> {
        let bytes = config.bytes();
        let media = match &config.backend {
            Backend::Memory => Media::Memory(
                MemoryMedia::new(bytes).ok_or(EmuError::AllocateNamespace { nsid, bytes })?,
            ),
            Backend::File(path) => Media::File(open_image(nsid, path, bytes, config.read_only)?),
            Backend::Null => Media::Null,
        };
        Ok(Self {
            blocks: config.blocks,
            lba_size: config.lba_size,
            lba_shift: config.lba_size.trailing_zeros(),
            read_only: config.read_only,
            format: config.format,
            media,
        })
    }

    /// Whether the media is a file (whose writes need syncing for durability).
    pub(crate) fn is_file(&self) -> bool {
        matches!(self.media, Media::File(_))
    }

    /// Makes every completed write durable.
    pub(crate) fn flush(&self) -> std::io::Result<()> {
        match &self.media {
            Media::File(f) => f.sync_data(),
            Media::Memory(_) | Media::Null => Ok(()),
        }
    }

    /// Fills `len` bytes at byte offset `offset` with zeroes (the range is inside the media).
    pub(crate) fn zero(&self, offset: u64, len: u64) -> std::io::Result<()> {
        match &self.media {
            Media::Memory(m) => {
                m.zero(offset, len);
                Ok(())
            }
            Media::File(f) => {
                static ZEROES: [u8; ZERO_CHUNK] = [0; ZERO_CHUNK];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(ZERO_CHUNK as u64) as usize;
                    f.write_all_at(&ZEROES[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
            Media::Null => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_zero_and_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0xaau8; 8192]).unwrap();
        let cfg = NamespaceConfig {
            backend: Backend::File(path.clone()),
            blocks: 16,
            lba_size: 512,
            read_only: false,
            format: crate::NsFormat::Plain,
        };
        let ns = Namespace::open(1, &cfg).unwrap();
        assert!(ns.is_file());
        ns.zero(512, 1024).unwrap();
        ns.flush().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes[..512].iter().all(|&b| b == 0xaa));
        assert!(bytes[512..1536].iter().all(|&b| b == 0));
        assert!(bytes[1536..].iter().all(|&b| b == 0xaa));
        // A file shorter than the namespace is refused.
        drop(ns);
        let big = NamespaceConfig { blocks: 17, ..cfg };
        assert!(matches!(
            Namespace::open(1, &big),
            Err(EmuError::InvalidImage { .. })
        ));
    }

    #[test]
    fn memory_stripes() {
        // Two and a half stripes.
        let len = 2 * STRIPE as u64 + 4096;
        let m = MemoryMedia::new(len).unwrap();
        assert_eq!(m.stripes.len(), 3);
        assert_eq!(m.stripes[2].read().unwrap().len(), 4096);
        // A range across the first boundary is refused by the direct accessors and goes
        // through the piecewise ones.
        let at = STRIPE as u64 - 512;
        assert!(m.with_bytes(at, 1024, |_| ()).is_none());
        assert!(m.with_bytes_mut(at, 1024, |_| ()).is_none());
        let data: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
        m.write_from(at, &data);
        let mut back = vec![0u8; 1024];
        m.read_into(at, &mut back);
        assert_eq!(back, data);
        assert_eq!(m.with_bytes(at, 512, |b| b.to_vec()).unwrap(), data[..512]);
        assert_eq!(
            m.with_bytes(STRIPE as u64, 512, |b| b.to_vec()).unwrap(),
            data[512..]
        );
        m.with_bytes_mut(len - 8, 8, |b| b.fill(7)).unwrap();
        m.zero(at, 1024);
        m.read_into(at, &mut back);
        assert!(back.iter().all(|&b| b == 0));
        let mut tail = [0u8; 8];
        m.read_into(len - 8, &mut tail);
        assert_eq!(tail, [7; 8]);
    }
}
