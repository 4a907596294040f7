//! Namespace media: the bytes behind each namespace, in memory, in a file, or nowhere.
//!
//! Every controller thread reads and writes the media of every namespace at once, so media are
//! shared (`&self` only):
//! - a file is written with positioned I/O (`pwrite`) and read with it (`pread`, which needs
//!   no lock) or, for small reads of an image in memory, by copying from a mapping of it
//!   ([`crate::ImageReads`]; the stripe locks of [`crate::image_map`] keep those copies and
//!   the writes apart);
//! - memory is cut into stripes of [`STRIPE`] bytes, each an anonymous mapping (zero pages
//!   until written, so a big namespace costs memory only for the blocks written) behind its own
//!   reader-writer lock. A block never spans two stripes (stripes are a multiple of every LBA
//!   size), so each block is read or written whole; a command spanning stripes takes their
//!   locks one at a time.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use memmap2::MmapMut;

use crate::config::{Backend, ImageReads, NamespaceConfig, open_image};
use crate::error::EmuError;
use crate::image_map::ImageMap;
use crate::stripes::{STRIPE, StripedBytes, stripe_pieces, stripe_single};

/// Zeroes written per call when zeroing a range of a file.
const ZERO_CHUNK: usize = 1 << 20;

/// A namespace's media.
pub(crate) enum Media {
    /// In memory.
    Memory(MemoryMedia),
    /// In an image file.
    File(FileMedia),
    /// Nowhere: reads and writes move no data.
    Null,
    /// On a far controller ([`crate::forward`]): the controller threads forward its commands.
    Forwarded(crate::forward::Forwarded),
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

    /// Calls `f` with the bytes at `offset..offset + len` (inside the media) under its stripe's
    /// write lock; `None` (without calling `f`) when the range spans stripes.
    pub(crate) fn with_bytes_mut<R>(
        &self,
        offset: u64,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Option<R> {
        let (i, at) = stripe_single(offset, len)?;
        Some(f(&mut self.write_stripe(i)[at..at + len]))
    }

    /// Copies `data` to `offset` (inside the media).
    pub(crate) fn write_from(&self, offset: u64, data: &[u8]) {
        stripe_pieces(offset, data.len() as u64, |i, off, at, n| {
            self.write_stripe(i)[off..off + n].copy_from_slice(&data[at..at + n]);
        });
    }

    /// Zeroes `len` bytes at `offset` (inside the media).
    fn zero(&self, offset: u64, len: u64) {
        stripe_pieces(offset, len, |i, off, _, n| {
            self.write_stripe(i)[off..off + n].fill(0);
        });
    }
}

impl StripedBytes for MemoryMedia {
    fn with_bytes<R>(&self, offset: u64, len: usize, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let (i, at) = stripe_single(offset, len)?;
        Some(f(&self.read_stripe(i)[at..at + len]))
    }

    fn read_into(&self, offset: u64, out: &mut [u8]) {
        stripe_pieces(offset, out.len() as u64, |i, off, at, n| {
            out[at..at + n].copy_from_slice(&self.read_stripe(i)[off..off + n]);
        });
    }
}

/// An image file, and its mapping when reads go through one ([`ImageReads::Mapped`]).
pub(crate) struct FileMedia {
    pub(crate) file: File,
    pub(crate) map: Option<ImageMap>,
    /// The image's path (for [`HostWriteError`]).
    pub(crate) path: PathBuf,
    /// Counts the writes made to the file ([`MediaWrites`]).
    pub(crate) writes: MediaWrites,
    /// The last host error a write or flush of the file met ([`HostWriteErrors`]).
    pub(crate) errors: HostWriteErrors,
}

/// A write or flush of an image file that the host refused: the controller completes the
/// command with Write Fault (all NVMe can say), and keeps the host's reason here so the
/// embedder can name the cause (a full host file system is ENOSPC, not a media defect).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostWriteError {
    /// The image file.
    pub path: PathBuf,
    /// The host's error number (`ENOSPC` is 28 on Linux), when it gave one.
    pub errno: Option<i32>,
    /// The host's error, in words.
    pub message: String,
}

impl HostWriteError {
    /// Whether the host file system holding the image is full (`ENOSPC`) or the user's quota
    /// on it is spent (`EDQUOT`).
    pub fn is_no_space(&self) -> bool {
        self.errno == Some(rustix::io::Errno::NOSPC.raw_os_error())
            || self.errno == Some(rustix::io::Errno::DQUOT.raw_os_error())
    }
}

/// The last [`HostWriteError`] of one image file, shared by the controller threads that write
/// it and the [`crate::EmuDevice`] that reports it. Clones share the slot.
#[derive(Clone, Debug, Default)]
pub struct HostWriteErrors(Arc<Mutex<Option<HostWriteError>>>);

impl HostWriteErrors {
    /// Keeps `e`, met writing `path`, as the last error (replacing an older one).
    pub(crate) fn record(&self, path: &Path, e: &std::io::Error) {
        let err = HostWriteError {
            path: path.to_owned(),
            errno: e.raw_os_error(),
            message: e.to_string(),
        };
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(err);
    }

    /// The last error, cleared.
    pub fn take(&self) -> Option<HostWriteError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// How many writes an image file's media took, counted after each is in the file (so a reader
/// that sees a count saw every write before it): who keeps copies of the image's bytes outside
/// the page cache (the GPU transport's cold-read prefetch) notes the count before reading and
/// drops a copy once it changed. Clones share the count.
#[derive(Clone, Debug, Default)]
pub struct MediaWrites(Arc<AtomicU64>);

impl MediaWrites {
    /// Writes so far.
    pub fn count(&self) -> u64 {
        // Acquire: pairs with `record`'s release, so a reader that sees the count sees the
        // write's bytes in the file too (they were written before it was counted).
        self.0.load(Ordering::Acquire)
    }

    /// Counts one write, made before this call (the media's owner; tests).
    pub fn record(&self) {
        self.0.fetch_add(1, Ordering::Release);
    }
}

impl FileMedia {
    /// Opens the image of namespace `nsid` (`bytes` long), mapped if `reads` says so.
    fn open(
        nsid: u32,
        path: &Path,
        bytes: u64,
        read_only: bool,
        reads: ImageReads,
    ) -> Result<Self, EmuError> {
        let file = open_image(nsid, path, bytes, read_only)?;
        let env = gpunvme_settings::EMU_IMAGE_READS.value();
        let map = if reads.mapped(env.as_deref(), in_memory(&file))? {
            Some(
                ImageMap::new(&file, bytes).map_err(|source| EmuError::OpenImage {
                    path: path.to_owned(),
                    source,
                })?,
            )
        } else {
            None
        };
        Ok(Self {
            file,
            map,
            writes: MediaWrites::default(),
            errors: HostWriteErrors::default(),
            path: path.to_owned(),
        })
    }

    /// Writes `data` at `offset` (inside the media), excluding mapped reads of those stripes;
    /// counted in [`MediaWrites`] once in the file, failed or not (a failed write may have
    /// changed part of the range).
    pub(crate) fn write_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        let r = match &self.map {
            Some(m) => m.write_locked(offset, data.len() as u64, || {
                self.file.write_all_at(data, offset)
            }),
            None => self.file.write_all_at(data, offset),
        };
        self.writes.record();
        if let Err(e) = &r {
            self.errors.record(&self.path, e);
        }
        r
    }

    /// Makes the file's completed writes durable (`fdatasync`), keeping a failure's reason.
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        let r = self.file.sync_data();
        if let Err(e) = &r {
            self.errors.record(&self.path, e);
        }
        r
    }
}

/// Whether `file` lives in memory (tmpfs or ramfs), where copying from a mapping cannot meet
/// an I/O error.
fn in_memory(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    rustix::fs::fstatfs(file).is_ok_and(|st| {
        // f_type is a C long on this target and narrower on others.
        #[allow(clippy::unnecessary_cast)]
        let kind = st.f_type as i64;
        kind == TMPFS_MAGIC || kind == RAMFS_MAGIC
    })
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
    pub(crate) fn open(
        nsid: u32,
        config: &NamespaceConfig,
        reads: ImageReads,
    ) -> Result<Self, EmuError> {
        let bytes = config.bytes();
        let media = match &config.backend {
            Backend::Memory => Media::Memory(
                MemoryMedia::new(bytes).ok_or(EmuError::AllocateNamespace { nsid, bytes })?,
            ),
            Backend::File(path) => {
                Media::File(FileMedia::open(nsid, path, bytes, config.read_only, reads)?)
            }
            Backend::Null => Media::Null,
            Backend::Forwarded(f) => Media::Forwarded(f.clone()),
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
            Media::File(f) => f.sync(),
            // A forwarded namespace's Flush is forwarded by the controller thread.
            Media::Memory(_) | Media::Null | Media::Forwarded(_) => Ok(()),
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
                    f.write_at(&ZEROES[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
            Media::Null => Ok(()),
            // Forwarded by the controller thread (never reaches here).
            Media::Forwarded(_) => Err(std::io::ErrorKind::Unsupported.into()),
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
        let ns = Namespace::open(1, &cfg, ImageReads::Pread).unwrap();
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
            Namespace::open(1, &big, ImageReads::Pread),
            Err(EmuError::InvalidImage { .. })
        ));
    }

    #[test]
    fn mapped_image_reads_see_every_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let len = 2 * STRIPE + 4096;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let cfg = NamespaceConfig {
            backend: Backend::File(path.clone()),
            blocks: len as u64 / 512,
            lba_size: 512,
            read_only: false,
            format: crate::NsFormat::Plain,
        };
        let ns = Namespace::open(1, &cfg, ImageReads::Mapped).unwrap();
        let Media::File(f) = &ns.media else {
            panic!("a file namespace")
        };
        let m = f.map.as_ref().expect("mapped reads were asked for");
        assert_eq!(
            m.with_bytes(4096, 512, |b| b.to_vec()).unwrap(),
            data[4096..4608]
        );
        // Across a stripe boundary: refused in place, copied piecewise.
        let at = STRIPE as u64 - 1024;
        assert!(m.with_bytes(at, 2048, |_| ()).is_none());
        let mut back = vec![0u8; 2048];
        m.read_into(at, &mut back);
        assert_eq!(back, data[at as usize..at as usize + 2048]);
        // Positioned writes and zeroing land in the mapping (one page cache), each counted.
        let writes = f.writes.clone();
        assert_eq!(writes.count(), 0);
        f.write_at(&[7u8; 2048], at).unwrap();
        assert_eq!(writes.count(), 1, "a write is counted once in the file");
        m.read_into(at, &mut back);
        assert!(back.iter().all(|&b| b == 7));
        ns.zero(at + 1024, 1024).unwrap();
        assert_eq!(writes.count(), 2, "zeroing writes too");
        m.read_into(at, &mut back);
        assert!(back[..1024].iter().all(|&b| b == 7) && back[1024..].iter().all(|&b| b == 0));
        // The last partial stripe is mapped too.
        assert_eq!(
            m.with_bytes(len as u64 - 512, 512, |b| b.to_vec()).unwrap(),
            data[len - 512..]
        );
        // Positioned reads map nothing.
        drop(ns);
        let ns = Namespace::open(1, &cfg, ImageReads::Pread).unwrap();
        assert!(matches!(
            &ns.media,
            Media::File(FileMedia { map: None, .. })
        ));
    }

    #[test]
    fn image_reads_choice() {
        use ImageReads::*;
        assert!(!Pread.mapped(Some("mapped"), true).unwrap());
        assert!(Mapped.mapped(Some("pread"), false).unwrap());
        assert!(Auto.mapped(None, true).unwrap());
        assert!(!Auto.mapped(None, false).unwrap());
        assert!(Auto.mapped(Some("mapped"), false).unwrap());
        assert!(!Auto.mapped(Some(" pread\n"), true).unwrap());
        let e = Auto.mapped(Some("bogus"), true).unwrap_err().to_string();
        assert!(
            e.contains("NVME_EMU_IMAGE_READS=\"bogus\": expected"),
            "{e}"
        );
        assert!(!Auto.mapped(Some(""), false).unwrap());
        // tmpfs counts as memory.
        match tempfile::tempfile_in("/dev/shm") {
            Ok(f) => assert!(in_memory(&f)),
            Err(e) => eprintln!("skipped: no /dev/shm here ({e})"),
        }
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
