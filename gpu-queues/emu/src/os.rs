//! The operating-system helpers only the emulated controllers (and the tests) use: page-cache
//! residency (`cachestat(2)`), direct-I/O descriptors and their alignment, `posix_fadvise`
//! hints, data runs of sparse image files, image files mapped and registered with CUDA
//! ([`MappedImage`]), and copies out of file mappings that survive SIGBUS ([`guarded_copy`],
//! [`copy_from_mapping`]). No embedder with a real SSD needs them; what the runtime's transports
//! need (mappings, `gdrdrv`, BAR0 doorbells, host arenas) stays in `gpu_queues::ffi::os`.
// UNSAFETY: this module is a boundary to the kernel for the emulated controllers: `cachestat`,
// `posix_fadvise` and `lseek` system calls, `mincore` over mappings made here, file mappings
// registered with CUDA, and the SIGBUS-guarded copy ([`guarded_copy`]).
#![expect(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use gpu_queues::GpuError;
use gpu_queues::ffi::os::{Mapping, PAGE, host_page_size};
use gpu_queues::ffi::{Cuda, HostRegistration, PinnedMemory};

pub mod guarded_copy;

/// Whether every page of `offset..offset + len` of `file` is in the page cache ([`residency`]
/// is [`Residency::All`]): `cachestat(2)`
/// (Linux 6.5), which looks at the file's page cache only (no page tables, no `mmap_lock`: a
/// `mincore` per Read, which takes it, made 16 controller threads copying out of a mapping
/// 1.7x slower on the lent H200, 2026-11-28). `Ok(false)` for an empty range; an error where
/// the kernel has no such call (`ENOSYS`) or refuses it, or the range overflows (`EOVERFLOW`).
pub fn range_cached(file: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<bool> {
    residency(file, offset, len).map(|r| r == Residency::All)
}

/// How much of a file range is in the page cache ([`residency`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// No page of it (or the range is empty).
    None,
    /// Some pages, not all.
    Part,
    /// Every page.
    All,
}

/// How much of `offset..offset + len` of `file` is in the page cache (`cachestat(2)`, as for
/// [`range_cached`]; a page under a read the kernel started counts as cached). An empty range
/// is [`Residency::None`].
pub fn residency(file: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<Residency> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    /// `__NR_cachestat`, the same on every architecture (the generic table).
    const SYS_CACHESTAT: libc::c_long = 451;
    if len == 0 {
        return Ok(Residency::None);
    }
    let last = offset
        .checked_add(len - 1)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
    let range = Range { off: offset, len };
    let mut st = Stat::default();
    // SAFETY: cachestat(fd, &range, &stat, 0) reads `range` and writes `st`, both live for
    // the call and laid out as the kernel's `struct cachestat_range` / `struct cachestat`.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut st as *mut Stat,
            0u32,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let pages = last / PAGE as u64 - offset / PAGE as u64 + 1;
    Ok(match st.nr_cache {
        0 => Residency::None,
        n if n >= pages => Residency::All,
        _ => Residency::Part,
    })
}

/// The alignment that keeps a read on a [`reopen_direct`] descriptor acceptable to the kernel:
/// its buffer address, file offset and length multiples of this. Direct I/O asks for the file
/// system's direct-I/O alignment (the disk's logical block, 512 or 4096 bytes on the disks one
/// meets); a page covers both.
pub const DIRECT_ALIGN: usize = 4096;

/// A second, read-only descriptor of `file`'s file for direct I/O (`O_DIRECT`: reads go from
/// the device into the caller's buffer, not through the page cache), opened through
/// `/proc/self/fd`. Reads on it keep to [`DIRECT_ALIGN`]. The kernel writes back dirty pages of
/// a range before a direct read of it, so such a read returns what buffered I/O wrote.
/// Errors: a file system without direct I/O (tmpfs before Linux 6.6, some FUSE ones) refuses
/// the open, or the first read, with `EINVAL`; no `/proc`: `ENOENT`.
pub fn reopen_direct(file: &File) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// Asks the kernel to read `offset..offset + len` of `file` into the page cache now
/// (`posix_fadvise(POSIX_FADV_WILLNEED)`): the reads are started (in readahead-sized requests,
/// as many as the device queue takes; the call may wait for room in it) and left to complete
/// in the background; nothing is copied, nothing waits for the data. A hint: the kernel may do
/// less. Errors: a bad descriptor or range (`EBADF`, `EINVAL`).
pub fn advise_willneed(file: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    fadvise(file, offset, len, libc::POSIX_FADV_WILLNEED)
}

/// Drops the clean pages of `offset..offset + len` of `file` from the page cache
/// (`posix_fadvise(POSIX_FADV_DONTNEED)`; dirty ones stay until written back): how tests and
/// benchmarks make a file cold. A file system without a page cache of its own (tmpfs) keeps
/// its pages; callers check with [`range_cached`].
pub fn advise_dontneed(file: BorrowedFd<'_>, offset: u64, len: u64) -> io::Result<()> {
    fadvise(file, offset, len, libc::POSIX_FADV_DONTNEED)
}

fn fadvise(file: BorrowedFd<'_>, offset: u64, len: u64, advice: libc::c_int) -> io::Result<()> {
    let (Ok(off), Ok(n)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(io::Error::from_raw_os_error(libc::EOVERFLOW));
    };
    // SAFETY: posix_fadvise on a descriptor the caller keeps open for the call; no memory is
    // passed.
    let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), off, n, advice) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Fills `offset..offset + len` of `mem` from `map` at `map_offset`: a copy out of the page
/// cache with no system call, and no marking of the pages as accessed beyond what a page fault
/// does (a `pread` moves a page read twice to the active LRU list under a lock every reader
/// shares; 2026-11-28, docs/benchmarks.md). A page that cannot be read (a disk error on a page
/// the kernel must bring back, a file truncated under the mapping) is an
/// [`std::io::ErrorKind::Other`] error naming the byte, not a SIGBUS ([`guarded_copy`]); the
/// bytes before it are left in place. Where guarded copies are not available
/// ([`guarded_copy::available`]): [`std::io::ErrorKind::Unsupported`].
///
/// The caller makes sure no GPU work reads or writes the range meanwhile (as for
/// [`PinnedMemory::read_file_at`]).
pub fn copy_from_mapping(
    mem: &PinnedMemory,
    offset: usize,
    len: usize,
    map: &Mapping,
    map_offset: usize,
) -> io::Result<()> {
    use std::io::{Error, ErrorKind};
    if !guarded_copy::available() {
        return Err(ErrorKind::Unsupported.into());
    }
    if map_offset.checked_add(len).is_none_or(|e| e > map.len()) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "bytes {map_offset:#x}+{len:#x} outside a mapping of {:#x}",
                map.len()
            ),
        ));
    }
    if offset.checked_add(len).is_none_or(|e| e > mem.len()) {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "bytes {offset:#x}+{len:#x} outside pinned memory of {:#x}",
                mem.len()
            ),
        ));
    }
    let dst = mem.host_ptr().wrapping_add(offset);
    // SAFETY: `dst..dst + len` is inside the live allocation `mem` (checked above) and no Rust
    // reference reaches it (pinned memory is only touched through raw pointers); the source
    // lies inside `map` (checked above), which the caller keeps alive across the call; the two
    // cannot overlap (pinned memory is not a file mapping).
    match unsafe { guarded_copy::copy(dst, map.ptr().wrapping_add(map_offset), len) } {
        Ok(()) => Ok(()),
        Err(copied) => Err(Error::other(format!(
            "the page at byte {:#x} of the mapped file could not be read (SIGBUS)",
            map_offset + copied
        ))),
    }
}

/// The run of allocated data of `file` (no holes: `SEEK_DATA`/`SEEK_HOLE`) that holds byte
/// `offset`, clipped to `lo..hi` and widened to whole host pages; `None` when `offset` is in a
/// hole or past the end. A file system without hole reporting shows the whole file as data.
/// Moves the descriptor's file position (positioned I/O does not use it).
pub fn data_run(file: &File, offset: u64, lo: u64, hi: u64) -> io::Result<Option<(u64, u64)>> {
    let seek = |pos: u64, whence: i32| -> io::Result<Option<u64>> {
        let pos = libc::off_t::try_from(pos).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: lseek on a descriptor this process owns (borrowed from `file`); no memory.
        let r = unsafe { libc::lseek(file.as_raw_fd(), pos, whence) };
        if r < 0 {
            let e = io::Error::last_os_error();
            // ENXIO: no data (or no hole) at or after `pos`.
            return if e.raw_os_error() == Some(libc::ENXIO) {
                Ok(None)
            } else {
                Err(e)
            };
        }
        Ok(Some(r as u64))
    };
    let page = host_page_size() as u64;
    let mut pos = lo;
    while pos < hi {
        let Some(d) = seek(pos, libc::SEEK_DATA)? else {
            return Ok(None);
        };
        if d > offset || d >= hi {
            return Ok(None);
        }
        let Some(h) = seek(d, libc::SEEK_HOLE)? else {
            return Ok(None);
        };
        if offset < h {
            let start = (d - d % page).max(lo);
            let end = h.min(hi).next_multiple_of(page);
            return Ok(Some((start, end)));
        }
        pos = h;
    }
    Ok(None)
}

/// An image file mapped into this process and registered with CUDA, so GPU threads read (and,
/// when writable, write) the file's page-cache pages over PCIe: the GPU-resident controller's
/// `host` media. Writable registration of a shared file mapping works on tmpfs but not on ext4
/// (`CUDA_ERROR_INVALID_VALUE`, ../shared/design/gpu.md); read-only registration works on both.
pub struct MappedImage {
    // Field order: the registration goes before the mapping it names.
    reg: HostRegistration,
    map: ImageMap,
}

enum ImageMap {
    ReadOnly(memmap2::Mmap),
    Writable(memmap2::MmapMut),
}

impl std::fmt::Debug for MappedImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedImage")
            .field("reg", &self.reg)
            .field("writable", &matches!(self.map, ImageMap::Writable(_)))
            .finish()
    }
}

impl MappedImage {
    /// Maps the first `len` bytes of `path` (shared) and registers them; `writable` maps and
    /// registers read-write, else read-only. The file must be at least `len` bytes long.
    pub fn open(
        cuda: &Arc<Cuda>,
        path: &std::path::Path,
        len: usize,
        writable: bool,
    ) -> Result<Self, GpuError> {
        let what = |e: &dyn std::fmt::Display| {
            GpuError::Unsupported(format!("host media {}: {e}", path.display()))
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| what(&e))?;
        let size = file.metadata().map_err(|e| what(&e))?.len();
        if size < len as u64 {
            return Err(what(&format!("{size} bytes, the namespace needs {len}")));
        }
        if len == 0 {
            return Err(what(&"empty namespace"));
        }
        // SAFETY: a shared mapping of a file that another process could change or truncate;
        // the controller holds the image's lock (nvme_emu) for as long as the model runs, and
        // every access to the mapping is by the GPU through the registration (never a Rust
        // reference), so a concurrent change cannot break Rust's aliasing rules here. A
        // truncation would fault GPU reads (a CUDA error), not this process.
        let mut map = unsafe {
            if writable {
                ImageMap::Writable(
                    memmap2::MmapOptions::new()
                        .len(len)
                        .map_mut(&file)
                        .map_err(|e| what(&e))?,
                )
            } else {
                ImageMap::ReadOnly(
                    memmap2::MmapOptions::new()
                        .len(len)
                        .map(&file)
                        .map_err(|e| what(&e))?,
                )
            }
        };
        let ptr = match &mut map {
            ImageMap::ReadOnly(m) => m.as_ptr().cast_mut(),
            ImageMap::Writable(m) => m.as_mut_ptr(),
        };
        // SAFETY: `ptr..ptr + len` is this value's page-aligned mapping, unmapped only after
        // the registration is dropped (field order).
        let reg = unsafe { HostRegistration::register_with(cuda, ptr, len, false, !writable) }
            .map_err(|e| {
                if writable {
                    GpuError::Unsupported(format!(
                        "host media {}: read-write registration refused ({e}); CUDA registers \
                     writable file mappings on tmpfs (e.g. /dev/shm) but not on ext4: put the \
                     image on tmpfs, make the namespace read-only, or use --media hbm",
                        path.display()
                    ))
                } else {
                    e
                }
            })?;
        Ok(Self { reg, map })
    }

    /// A read-only window of `file`: `len` bytes at `offset` (a multiple of the host page
    /// size) mapped shared and registered with CUDA, so that copies read the file's page-cache
    /// pages straight over PCIe; but only if every page of the window is in the page cache now
    /// (`mincore`): `Ok(None)` otherwise, before anything is registered (registering faults
    /// every missing page in, one at a time, far slower than reading the file). The window must
    /// lie inside the file (its last page may be partial).
    pub fn resident_window(
        cuda: &Arc<Cuda>,
        file: &File,
        offset: u64,
        len: usize,
    ) -> Result<Option<Self>, GpuError> {
        let what = |e: &dyn std::fmt::Display| GpuError::Unsupported(format!("image window: {e}"));
        let host_page = host_page_size();
        if len == 0 || offset % host_page as u64 != 0 {
            return Err(what(&format!(
                "window {offset:#x}+{len:#x} is not page-aligned"
            )));
        }
        // Whole pages (the last one may run past the end of the file, within its page).
        let len = len.next_multiple_of(host_page);
        // SAFETY: as in `open`: a shared mapping of the image that the controller holds locked;
        // it is read only by the GPU through the registration and by `mincore` (which reads
        // no bytes), never through a Rust reference.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(offset)
                .len(len)
                .map(file)
        }
        .map_err(|e| what(&e))?;
        let mut vec = vec![0u8; len.div_ceil(host_page)];
        // SAFETY: `map` is one live mapping of `len` bytes; `vec` holds a byte per host page.
        let r = unsafe { libc::mincore(map.as_ptr().cast_mut().cast(), len, vec.as_mut_ptr()) };
        if r != 0 {
            return Err(what(&io::Error::last_os_error()));
        }
        if vec.iter().any(|b| b & 1 == 0) {
            return Ok(None);
        }
        // SAFETY: the page-aligned mapping `map`, unmapped only after the registration is
        // dropped (field order).
        let reg = unsafe {
            HostRegistration::register_with(cuda, map.as_ptr().cast_mut(), len, false, true)
        }?;
        Ok(Some(Self {
            reg,
            map: ImageMap::ReadOnly(map),
        }))
    }

    /// The registration (for copies out of the mapping).
    pub fn registration(&self) -> &HostRegistration {
        &self.reg
    }

    /// GPU address of the file's first byte.
    pub fn device_ptr(&self) -> u64 {
        self.reg.device_ptr()
    }

    /// Writes dirty pages back to the file (msync) for a writable mapping.
    pub fn flush(&self) -> Result<(), GpuError> {
        match &self.map {
            ImageMap::Writable(m) => m
                .flush()
                .map_err(|e| GpuError::Unsupported(format!("msync of host media: {e}"))),
            ImageMap::ReadOnly(_) => Ok(()),
        }
    }
}

/// A new, empty read-write file in the temporary directory, already unlinked (gone when
/// closed), for tests: `tag` keeps tests that run at once apart.
#[cfg(test)]
pub(crate) fn scratch_file(tag: &str) -> File {
    let path = std::env::temp_dir().join(format!("gpunvme-{tag}-{}", std::process::id()));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_cached_sees_written_pages_and_evicted_ones() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let mut f = scratch_file("cached");
        f.write_all(&vec![7u8; 64 << 10]).unwrap();
        let cached = match range_cached(f.as_fd(), 0, 64 << 10) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("skipped: no cachestat(2) here ({e})");
                return;
            }
        };
        assert!(cached, "just-written pages are in the page cache");
        assert!(
            range_cached(f.as_fd(), 4096 + 100, 5000).unwrap(),
            "an unaligned range"
        );
        assert!(!range_cached(f.as_fd(), 0, 0).unwrap(), "an empty range");
        assert!(
            !range_cached(f.as_fd(), 60 << 10, 8192).unwrap(),
            "past the end"
        );
        assert_eq!(
            residency(f.as_fd(), 60 << 10, 8192).unwrap(),
            Residency::Part,
            "the last page, and one past the end"
        );
        assert_eq!(residency(f.as_fd(), 0, 64 << 10).unwrap(), Residency::All);
        assert_eq!(
            residency(f.as_fd(), 64 << 10, 4096).unwrap(),
            Residency::None
        );
        // Written back, then dropped: no longer cached (where the file system can drop its
        // pages at all: tmpfs cannot).
        f.sync_all().unwrap();
        // SAFETY: posix_fadvise on our open descriptor; no memory is passed.
        let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
        if range_cached(f.as_fd(), 0, 64 << 10).unwrap() {
            eprintln!("skipped the eviction check: this file system keeps the pages");
        } else {
            assert!(!range_cached(f.as_fd(), 4096, 4096).unwrap());
            assert_eq!(residency(f.as_fd(), 0, 64 << 10).unwrap(), Residency::None);
        }
    }

    #[test]
    fn a_direct_descriptor_reads_what_buffered_writes_left_dirty() {
        use std::io::Write;
        use std::os::unix::fs::FileExt;
        let mut f = scratch_file("direct");
        let data: Vec<u8> = (0..64u32 << 10).map(|i| (i * 7 + i / 4096) as u8).collect();
        // Written, not synced: the pages are dirty in the page cache.
        f.write_all(&data).unwrap();
        let d = match reopen_direct(&f) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("skipped: this file system refuses O_DIRECT ({e})");
                return;
            }
        };
        let mut buf = vec![0u8; (32 << 10) + DIRECT_ALIGN];
        let at = buf.as_ptr().align_offset(DIRECT_ALIGN);
        let dst = &mut buf[at..at + (32 << 10)];
        match d.read_at(dst, 16 << 10) {
            Ok(n) => {
                assert_eq!(n, 32 << 10);
                assert!(dst == &data[16 << 10..48 << 10], "the bytes written");
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
                eprintln!("skipped: this file system refuses direct reads ({e})");
                return;
            }
            Err(e) => panic!("{e}"),
        }
        // Direct I/O keeps to the alignment: an odd offset is refused, not read.
        let e = d.read_at(&mut buf[at..at + 4096], 100).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    }

    #[test]
    fn willneed_brings_an_evicted_range_back_into_the_page_cache() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let mut f = scratch_file("willneed");
        f.write_all(&vec![5u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        advise_willneed(f.as_fd(), 0, 1 << 20).unwrap();
        assert!(
            advise_willneed(f.as_fd(), u64::MAX, 1).is_err(),
            "a range past off_t"
        );
        // SAFETY: posix_fadvise on our open descriptor; no memory is passed.
        let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
        match range_cached(f.as_fd(), 0, 1 << 20) {
            Err(e) => eprintln!("skipped: no cachestat(2) here ({e})"),
            Ok(true) => eprintln!("skipped: this file system keeps the pages (nothing evicted)"),
            Ok(false) => {
                advise_willneed(f.as_fd(), 0, 1 << 20).unwrap();
                // The reads run in the background: bounded wait for them to land.
                let t = std::time::Instant::now();
                while !range_cached(f.as_fd(), 0, 1 << 20).unwrap() {
                    assert!(
                        t.elapsed().as_secs() < 10,
                        "the range came back within 10 s"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    #[test]
    fn data_runs_skip_holes_and_stay_inside_their_bounds() {
        use std::os::unix::fs::FileExt;
        let f = scratch_file("data-run");
        let page = host_page_size() as u64;
        // Data in pages 0-1 and 256, holes elsewhere; 300 pages long.
        f.write_all_at(&vec![1u8; 2 * page as usize], 0).unwrap();
        f.write_all_at(&vec![2u8; page as usize], 256 * page)
            .unwrap();
        f.set_len(300 * page).unwrap();
        let end = 300 * page;
        assert_eq!(data_run(&f, 100, 0, end).unwrap(), Some((0, 2 * page)));
        assert_eq!(
            data_run(&f, 256 * page + 5, 0, end).unwrap(),
            Some((256 * page, 257 * page))
        );
        // Clipped to the bounds asked for.
        assert_eq!(
            data_run(&f, page + 1, page, end).unwrap(),
            Some((page, 2 * page))
        );
        assert_eq!(data_run(&f, 5, 0, page).unwrap(), Some((0, page)));
        // Past the end: nothing.
        assert_eq!(data_run(&f, end + 1, 0, end + 2 * page).unwrap(), None);
        match data_run(&f, 100 * page, 0, end).unwrap() {
            None => {}
            // A file system that reports no holes shows the whole file as data.
            Some(run) => {
                eprintln!("{}: no hole reporting here", std::env::temp_dir().display());
                assert_eq!(run, (0, end));
            }
        }
    }
}
