//! Files on the GPU (blockfs_gpu, ptx/include/gpunvme_file.cuh): blockfs on the same controller,
//! extent tables in GPU memory, byte ranges read and written by GPU-issued commands.

use super::*;
use blockfs::{
    CreateOptions, FileSystem, MkfsOptions, NvmeBlockDevice, NvmeDeviceOptions, OpenMode,
};
use blockfs_gpu::{ChunkOrder, FileRange, GpuFiles, GpuFilesOptions, GpuSpan};

pub(super) fn data(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub(super) fn blockfs_dev(r: &Rig) -> Arc<NvmeBlockDevice> {
    let opts = NvmeDeviceOptions {
        queues: 2,
        ..NvmeDeviceOptions::default()
    };
    Arc::new(NvmeBlockDevice::new(&r.ctrl, 1, &opts).expect("blockfs device"))
}

/// A file system with `dir/a` and `dir/b` of `len` bytes each whose appends interleave (so
/// both are spread over many extents); returns the bytes of `dir/a`.
pub(super) fn fragmented(fs: &FileSystem, len: usize) -> Vec<u8> {
    let d = data(len as u64, len);
    let a = fs
        .create("dir/a", &CreateOptions::default())
        .expect("create a");
    let b = fs
        .create("dir/b", &CreateOptions::default())
        .expect("create b");
    let step = 64 * 1024 + 512;
    let mut at = 0;
    while at < len {
        let n = step.min(len - at);
        a.write_at(at as u64, &d[at..at + n]).expect("write a");
        b.write_at(at as u64, &d[at..at + n]).expect("write b");
        at += n;
    }
    fs.sync().expect("sync");
    d
}

fn host_bytes(buf: &gpu_queues::GpuBuffer, off: usize, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    buf.read(off, &mut v).expect("GPU buffer read");
    v
}

/// The software controller on the image file at `path` (4 KiB LBAs), 4 GPU queues of 256.
/// Small Reads go by `pread` too (on tmpfs they would copy from the CPU path's own mapping,
/// unguarded: a truncation of the image would kill the process there).
fn image_rig(path: &std::path::Path) -> Rig {
    rig_with(
        4096,
        |c| {
            c.namespaces = vec![NamespaceConfig {
                backend: nvme_emu::Backend::File(path.to_path_buf()),
                blocks: NS_BYTES / 4096,
                lba_size: 4096,
                read_only: false,
                format: nvme_emu::NsFormat::Plain,
            }];
            c.image_reads = nvme_emu::ImageReads::Pread;
        },
        GpuQueueOptions {
            queues: Some(4),
            depth: Some(256),
            ..Default::default()
        },
    )
}

/// A file system on an image file: the software controller moves Read data the way
/// `GPUNVME_EMU_READS` says (copies out of a mapping of the image or pread into staging, or
/// registered page-cache windows, every page
/// being resident since the file system was just written through it), and the GPU gets the
/// file's bytes, whole and at odd offsets. scripts/host-gpu-test.sh runs it in each mode.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn image_reads_take_the_chosen_path() {
    let path = image("windows");
    let r = image_rig(&path);
    let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
    let len = (3 << 20) + 4097;
    let want = fragmented(&fs, len);
    let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
    let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
    let g = files.open(&file).expect("open for the GPU");
    // A hint of the reads to come: the controller has the kernel read what of the file is
    // not in the page cache, on a thread of its own, while the read below runs.
    let ahead = files.will_read(&[&g]);
    // Taken unless turned off: by default, off where cold Reads go by direct I/O (the
    // `mapped` mode with GPUNVME_EMU_COLD_READS=direct); with `prefetch`, taken where some
    // of the file's data is not in the page cache (never on tmpfs).
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let mapped = r.gpu.window_stats().expect("software controller").0 == ReadMode::Mapped;
    let cold = var("GPUNVME_EMU_COLD_READS").map(|v| v.trim().to_owned());
    let on = if mapped && cold.as_deref() == Some("prefetch") {
        use std::os::fd::AsFd;
        let img = std::fs::File::open(&*path).expect("image");
        let lba = 1u64 << g.table().header().lba_shift;
        !blockfs_gpu::plan::read_runs(g.table(), 0)
            .iter()
            .all(|&(at, n)| {
                gpu_emu::os::range_cached(img.as_fd(), at * lba, n * lba).expect("cachestat")
            })
    } else {
        match var(gpu_emu::software::READAHEAD_ENV)
            .as_deref()
            .map(str::trim)
        {
            Some("off") => false,
            Some(_) => true,
            None => !mapped || cold.as_deref() != Some("direct"),
        }
    };
    assert_eq!(
        ahead.is_running(),
        on,
        "an image file: the hint is taken or not"
    );
    let buf = r.gpu.alloc_buffer(len).expect("buffer");
    let got = files.read(&g, GpuSpan::all(&buf), 0).expect("GPU read");
    assert_eq!(got, len as u64);
    assert!(host_bytes(&buf, 0, len) == want, "bytes of the whole file");
    drop(ahead);
    let (off, n) = (12_345u64, 1_000_003u64);
    let odd = r.gpu.alloc_buffer(n as usize + 3).expect("buffer");
    let span = GpuSpan::of(&odd, 3, n).expect("span");
    let res = files
        .run(&[FileRange::read(&g, off, span)])
        .expect("batch")
        .into_first_error()
        .expect("range");
    assert_eq!(res.bytes(), n);
    assert!(
        host_bytes(&odd, 3, n as usize) == want[off as usize..(off + n) as usize],
        "bytes at an odd offset"
    );
    let d = r.gpu.dma_stats().expect("software controller");
    let (mode, w) = r.gpu.window_stats().expect("software controller");
    eprintln!("{}: {d:?} {w:?}", mode.name());
    // Every whole block of the file went to GPU memory by the chosen path; the partial
    // last block goes through a slot buffer, which with host rings (the default) is host
    // memory the controller fills directly, neither staged nor copied.
    let whole = len as u64 / 4096 * 4096;
    match mode {
        ReadMode::Registered => {
            assert!(w.registered >= 1, "a window was registered: {w:?}");
            assert!(d.direct_bytes >= whole, "data from the windows: {d:?}");
        }
        ReadMode::Mapped | ReadMode::Pread => {
            assert_eq!((d.direct_bytes, w.registered), (0, 0));
            assert!(d.staged_file_bytes >= whole, "data staged: {d:?}");
            // Every page is in memory (just written through the controller): `mapped`
            // copies all of them out of its mapping, `pread` none.
            if mode == ReadMode::Mapped {
                assert!(d.mapped_bytes >= whole, "out of the mapping: {d:?}");
            } else {
                assert_eq!(d.mapped_bytes, 0, "{d:?}");
            }
            // Reads of 64 KiB and more (the file's 128 KiB chunks) go by copy engine, unless
            // pieces are copies already (compute-sanitizer, GPUNVME_EMU_DMA=memcpy) or
            // GPUNVME_EMU_STAGED=kernel asks for the scatter kernel.
            let engine = r.gpu.copy_mode() == Some(gpu_emu::CopyMode::Kernels)
                && std::env::var("GPUNVME_EMU_STAGED").map_or(true, |v| v.trim() != "kernel");
            if engine {
                assert!(d.engine_copies >= 1, "staged Reads by copy engine: {d:?}");
            } else {
                assert_eq!(d.engine_copies, 0, "no copy-engine Reads: {d:?}");
            }
        }
    }
    // The image cut short under the controller (its pages gone, as after an eviction and a
    // disk error): every Read of the lost blocks is an NVMe error (Unrecovered Read Error)
    // and the process lives on, in every mode (`mapped` sees the pages are not resident
    // and reads them by pread; a page lost during its copy would be a SIGBUS turned into
    // the same error, gpu_emu::os::guarded_copy's tests). Then the blocks come back
    // (as zeroes) and the same read succeeds.
    // (Registered windows pin their pages: they keep the old bytes, no error to see.)
    if mode == ReadMode::Registered {
        drop(r);
        let _ = std::fs::remove_file(&path);
        return;
    }
    let image = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("image");
    let full = image.metadata().expect("image size").len();
    image.set_len(0).expect("truncate the image");
    let e = files
        .run(&[FileRange::read(&g, 0, GpuSpan::all(&buf))])
        .expect("batch")
        .into_first_error()
        .expect_err("a read of a truncated image");
    match &e {
        blockfs_gpu::FilesError::FileIo { nvme_status, .. } => {
            assert_eq!(
                (nvme_status >> 1) & 0x7ff,
                0x281,
                "Unrecovered Read Error: {e}"
            );
        }
        other => panic!("expected a file I/O error, got {other}"),
    }
    image.set_len(full).expect("restore the image's length");
    let got = files.read(&g, GpuSpan::all(&buf), 0).expect("GPU read");
    assert_eq!(got, len as u64);
    assert!(
        host_bytes(&buf, 0, 4096).iter().all(|&b| b == 0),
        "the lost blocks read back as zeroes"
    );
    drop(r);
    let _ = std::fs::remove_file(&path);
}

/// The copy engines' staging areas grow for a large job (`grow_staging`, what a `will_read`
/// hint of 4 GiB or more does): reads before, during and after the bigger areas' registration
/// move every byte exactly, and once the engines took them their areas are the bigger ones.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn staging_areas_grow_for_a_large_job_and_reads_stay_exact() {
    use gpu_emu::software::SoftwareTransport;
    let path = image("grow");
    let r = image_rig(&path);
    let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
    let len = (12 << 20) + 4097;
    let want = fragmented(&fs, len);
    let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
    let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
    let g = files.open(&file).expect("open for the GPU");
    let buf = r.gpu.alloc_buffer(len).expect("buffer");
    let sw = SoftwareTransport::of(&r.gpu).expect("the software controller");
    let before = sw.dma_stats();
    sw.grow_staging();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut rounds = 0;
    loop {
        let got = files.read(&g, GpuSpan::all(&buf), 0).expect("GPU read");
        assert_eq!(got, len as u64);
        assert!(
            host_bytes(&buf, 0, len) == want,
            "bytes of the whole file, round {rounds}"
        );
        rounds += 1;
        let d = sw.dma_stats();
        // Grown: the big pool allocated and every area used since is one of its own.
        let big = 2 * ((2048 * 16 + (4 << 20)) as u64);
        if d.pinned_pool_bytes > before.pinned_pool_bytes && d.pinned_bytes >= big && rounds > 2 {
            eprintln!("grown after {rounds} reads: {d:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the areas never grew: {d:?}");
    }
    drop(r);
    let _ = std::fs::remove_file(&path);
}

/// An image on a disk file system, cold (written back and dropped from the page cache): the
/// software controller reads a file's staged Reads from the disk by direct I/O with
/// `GPUNVME_EMU_COLD_READS=direct` (none by default, `buffered`, nor in any
/// `GPUNVME_EMU_READS` mode but `mapped`), or copies them all out of a prefetch's pool (read
/// by direct I/O on the read's hint) with `prefetch`, leaving the page cache empty; once the image is
/// back in the page cache it copies every staged Read out of its mapping. The GPU gets the
/// file's bytes each time. Skipped where the file system keeps the pages (tmpfs).
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn cold_image_reads_by_direct_io_when_chosen() {
    use gpu_emu::os::{Residency, advise_dontneed, residency};
    use std::os::fd::AsFd;
    let p = std::env::temp_dir().join(format!("gpunvme-cold-{}", std::process::id()));
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(NS_BYTES))
        .expect("image");
    let path = ShmImage(p);
    let r = image_rig(&path);
    let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
    let len = (6 << 20) + 4097;
    let want = data(77, len);
    let f = fs
        .create("model", &CreateOptions::default())
        .expect("create");
    f.write_at(0, &want).expect("write");
    fs.sync().expect("sync");
    let file = fs.open("model", OpenMode::ReadOnly).expect("open");
    let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
    let g = files.open(&file).expect("open for the GPU");
    let img = std::fs::File::open(&*path).expect("image");
    img.sync_all().expect("write the image back");
    advise_dontneed(img.as_fd(), 0, 0).expect("drop the image's pages");
    let left = residency(img.as_fd(), 0, NS_BYTES);
    if !matches!(left, Ok(Residency::None)) {
        eprintln!("skipped: the image's pages stay in memory here ({left:?})");
        return;
    }
    let read = |what: &str| {
        let before = r.gpu.dma_stats().expect("software controller");
        let buf = r.gpu.alloc_buffer(len).expect("buffer");
        // As a load does: the hint (a prefetch's start, with `prefetch`) over the reads.
        let _ahead = files.will_read(&[&g]);
        let got = files.read(&g, GpuSpan::all(&buf), 0).expect("GPU read");
        assert_eq!(got, len as u64);
        assert!(host_bytes(&buf, 0, len) == want, "bytes of the {what} file");
        let after = r.gpu.dma_stats().expect("software controller");
        (
            after.staged_file_bytes - before.staged_file_bytes,
            after.cold_direct_bytes - before.cold_direct_bytes,
            after.mapped_bytes - before.mapped_bytes,
        )
    };
    let (staged, direct, mapped) = read("cold");
    let (mode, _) = r.gpu.window_stats().expect("software controller");
    eprintln!(
        "{}: cold: staged {staged} direct {direct} mapped {mapped}",
        mode.name()
    );
    // Staged Reads of 64 KiB and more go by copy engine (as in the test above), and those
    // are the ones read direct: the file's 128 KiB chunks, all but its tail.
    let engine = r.gpu.copy_mode() == Some(gpu_emu::CopyMode::Kernels)
        && std::env::var("GPUNVME_EMU_STAGED").map_or(true, |v| v.trim() != "kernel");
    let cold = std::env::var("GPUNVME_EMU_COLD_READS").unwrap_or_default();
    if mode == ReadMode::Mapped && cold.trim() == "prefetch" {
        // Every staged Read out of the prefetch's pool, which direct I/O filled.
        assert_eq!(
            direct, staged,
            "the cold file by the prefetch: staged {staged}"
        );
        assert_eq!(mapped, 0, "nothing was in the page cache");
        let whole = residency(img.as_fd(), 1 << 20, 4 << 20).expect("cachestat");
        assert_eq!(whole, Residency::None, "direct reads bypass the page cache");
    } else if mode == ReadMode::Mapped && engine && cold.trim() == "direct" {
        assert!(
            direct >= staged - (128 << 10) && direct > 0,
            "the cold chunks by direct I/O: staged {staged}, direct {direct}"
        );
        assert_eq!(mapped, 0, "nothing was in the page cache");
        // Direct reads leave the page cache alone.
        let whole = residency(img.as_fd(), 1 << 20, 4 << 20).expect("cachestat");
        assert_eq!(whole, Residency::None, "direct reads bypass the page cache");
    } else {
        assert_eq!(direct, 0, "no direct reads in this mode");
    }
    // Back in the page cache, and kept there while the GPU reads (locked: a machine that
    // reclaims the page cache eagerly can evict a chunk between a plain read of the image
    // and the GPU's): copies out of the mapping, no direct read.
    let held = gpu_queues::ffi::os::Mapping::read_only(img.as_fd(), NS_BYTES as usize)
        .expect("map the image");
    if let Err(e) = held.lock() {
        eprintln!("skipped the warm check: the image's pages cannot be locked here ({e})");
        return;
    }
    let (staged, direct, mapped) = read("warm");
    eprintln!(
        "{}: warm: staged {staged} direct {direct} mapped {mapped}",
        mode.name()
    );
    assert_eq!(direct, 0, "a warm image is not read direct");
    if mode == ReadMode::Mapped {
        assert_eq!(mapped, staged, "every staged Read out of the mapping");
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn file_of_unaligned_size_loads_with_gpu_checksum() {
    for lba in [512u32, 4096] {
        let r = rig(lba, 4, 256);
        let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
        let len = (5 << 20) + 333;
        let want = fragmented(&fs, len);
        let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
        for warp in [true, false] {
            let files = GpuFiles::new(
                &r.gpu,
                GpuFilesOptions {
                    warp,
                    ..Default::default()
                },
            );
            let g = files.open(&file).expect("open for the GPU");
            assert!(g.table().extents().len() > 3, "fragmented");
            let buf = r.gpu.alloc_buffer(len).expect("buffer");
            let got = match files.read(&g, GpuSpan::all(&buf), 0) {
                Ok(got) => got,
                // A timeout here says where every queue stood.
                Err(e) => panic!(
                    "GPU read of the whole file (lba {lba}, warp {warp}): {e:?}\n\
                     queues: {:#?}\ncopy engines: {:?}",
                    r.gpu.queue_states(),
                    r.gpu.dma_stats()
                ),
            };
            assert_eq!(got, len as u64);
            let crc = files.crc32c(buf.ptr(), len as u64).expect("GPU crc");
            assert_eq!(
                crc,
                crc32c::crc32c(&want),
                "lba {lba} warp {warp}: GPU CRC-32C"
            );
            assert!(
                host_bytes(&buf, 0, len) == want,
                "lba {lba} warp {warp}: bytes"
            );
        }
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn byte_ranges_at_odd_offsets_match_the_host() {
    for lba in [512u32, 4096] {
        let r = rig(lba, 2, 64);
        let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
        let len = 3 * 1024 * 1024 + 4097;
        let want = fragmented(&fs, len);
        let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
        let cases: &[(u64, u64)] = &[
            (0, 1),
            (1, 1),
            (511, 2),
            (4095, 4098),
            (12_345, 1_000_000),
            (len as u64 - 1, 1),
            (len as u64 - 5000, 5000),
            (65_536 + 511, 3 * 65_536 + 3),
            (7, len as u64 - 7),
        ];
        // Warps claiming chunks (8 KiB chunks: several rounds on 2 queues) or spreading
        // them; threads alone.
        for (warp, chunk, order) in [
            (true, None, ChunkOrder::Claim),
            (false, None, ChunkOrder::Claim),
            (true, Some(8192), ChunkOrder::Claim),
            (true, Some(8192), ChunkOrder::Spread),
            (false, Some(4096), ChunkOrder::Claim),
        ] {
            let files = GpuFiles::new(
                &r.gpu,
                GpuFilesOptions {
                    warp,
                    chunk_bytes: chunk,
                    chunks: order,
                    ..Default::default()
                },
            );
            let g = files.open(&file).expect("open for the GPU");
            // One batch: every range into its own place of one buffer, at addresses that
            // are aligned, odd and 2 mod 4 (those bounce through slot buffers).
            let total: u64 = cases.iter().map(|c| c.1 + 8).sum();
            let buf = r.gpu.alloc_buffer(total as usize).expect("buffer");
            let mut at = 0u64;
            let mut ranges = Vec::new();
            for (i, &(off, n)) in cases.iter().enumerate() {
                let skew = [0u64, 1, 2, 3, 4][i % 5];
                ranges.push((at + skew, off, n));
                at += n + 8;
            }
            let reqs: Vec<FileRange<'_>> = ranges
                .iter()
                .map(|&(b, off, n)| FileRange::read(&g, off, GpuSpan::of(&buf, b, n).unwrap()))
                .collect();
            let res = files
                .run(&reqs)
                .expect("batch")
                .into_first_error()
                .expect("ranges");
            for &(b, off, n) in &ranges {
                assert!(
                    host_bytes(&buf, b as usize, n as usize)
                        == want[off as usize..(off + n) as usize],
                    "lba {lba} warp {warp} chunk {chunk:?} {order:?}: {off}+{n} at buffer {b}"
                );
            }
            assert_eq!(res.bytes(), cases.iter().map(|c| c.1).sum::<u64>());
            assert_eq!(
                res.shape.claim,
                warp && chunk == Some(8192) && order == ChunkOrder::Claim,
                "{:?}",
                res.shape
            );
            // Reads stop at the length (pread): 3 bytes asked at len - 1, 1 read.
            let small = r.gpu.alloc_buffer(4096).expect("buffer");
            let got = files
                .read(&g, GpuSpan::of(&small, 0, 3).unwrap(), len as u64 - 1)
                .expect("read at the end");
            assert_eq!(got, 1);
            assert_eq!(host_bytes(&small, 0, 1), want[len - 1..]);
        }
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn gpu_writes_into_a_preallocated_file_read_back_after_remount() {
    for lba in [512u32, 4096] {
        let r = rig(lba, 2, 64);
        let dev = blockfs_dev(&r);
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
        let len = 2 * 1024 * 1024 + 1001;
        let mut want: Vec<Vec<u8>> = Vec::new();
        for (i, warp) in [true, false].into_iter().enumerate() {
            let name = format!("ckpt/{i}");
            let f = fs
                .create(
                    &name,
                    &CreateOptions {
                        size_hint: len as u64,
                    },
                )
                .expect("create");
            // Old contents below 10000 bytes: the GPU's partial LBAs keep their neighbours.
            let mut expect = data(100 + i as u64, 10_000);
            f.write_at(0, &expect).expect("host write");
            fs.sync().expect("sync");
            expect.resize(len, 0);
            let files = GpuFiles::new(
                &r.gpu,
                GpuFilesOptions {
                    warp,
                    ..Default::default()
                },
            );
            let g = files.reserve(&f, len as u64).expect("reserve");
            assert!(g.is_writable() && g.alloc_bytes() >= len as u64);
            let src = data(7 + i as u64, len);
            let buf = r.gpu.alloc_buffer(len + 64).expect("buffer");
            buf.write(0, &src).expect("upload");
            // The tail from an unaligned file offset, then overwrites at odd places, some
            // from odd buffer addresses.
            let writes: &[(u64, u64, u64)] = &[
                (10_000, 10_000, len as u64 - 10_000),
                (1, 3, 700),
                (513, 4095, 10_000),
                (0, 0, 1),
                (4096, 65_536, 200_000),
            ];
            for &(b, off, n) in writes {
                files
                    .write(&g, GpuSpan::of(&buf, b, n).unwrap(), off)
                    .unwrap_or_else(|e| panic!("write {off}+{n}: {e}"));
                expect[off as usize..(off + n) as usize]
                    .copy_from_slice(&src[b as usize..(b + n) as usize]);
            }
            // Past the allocation: refused before anything runs.
            assert!(
                files
                    .write(&g, GpuSpan::of(&buf, 0, 2).unwrap(), g.alloc_bytes() - 1)
                    .is_err()
            );
            g.commit(len as u64).expect("commit");
            want.push(expect);
        }
        fs.sync().expect("sync");
        fs.unmount().expect("unmount");
        let fs = FileSystem::mount(blockfs_dev(&r)).expect("remount");
        for (i, expect) in want.iter().enumerate() {
            let f = fs
                .open(&format!("ckpt/{i}"), OpenMode::ReadOnly)
                .expect("open");
            assert_eq!(f.len().unwrap(), len as u64);
            let mut back = vec![0u8; len];
            f.read_at(0, &mut back).expect("CPU read");
            assert!(
                &back == expect,
                "lba {lba} file {i}: the CPU reads what the GPU wrote"
            );
        }
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn batch_open_by_prefix_reads_every_file() {
    let r = rig(512, 4, 128);
    let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
    let sizes = [
        0usize,
        1,
        511,
        512,
        4096,
        4097,
        100_000,
        1 << 20,
        (1 << 20) + 3,
        77,
    ];
    let mut want = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let d = data(i as u64 + 50, n);
        let f = fs
            .create(&format!("shard/{i:02}"), &CreateOptions::default())
            .expect("create");
        f.write_at(0, &d).expect("write");
        want.push(d);
    }
    fs.create("other", &CreateOptions::default())
        .expect("create");
    fs.sync().expect("sync");
    let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
    let handles = files.open_prefix(&fs, "shard/").expect("batch open");
    assert_eq!(handles.len(), sizes.len());
    assert!(
        handles
            .iter()
            .all(|h| h.table_ptr() == handles[0].table_ptr()),
        "one table"
    );
    let total: usize = sizes.iter().map(|n| n + 1).sum();
    let buf = r.gpu.alloc_buffer(total).expect("buffer");
    let mut at = 0u64;
    let mut reqs = Vec::new();
    for h in &handles {
        reqs.push(FileRange::read(
            h,
            0,
            GpuSpan::of(&buf, at, h.size()).unwrap(),
        ));
        at += h.size() + 1;
    }
    files
        .run(&reqs)
        .expect("batch")
        .into_first_error()
        .expect("ranges");
    let mut at = 0usize;
    for (i, h) in handles.iter().enumerate() {
        assert_eq!(h.name(), format!("shard/{i:02}"));
        assert!(host_bytes(&buf, at, sizes[i]) == want[i], "shard {i}");
        at += sizes[i] + 1;
    }
}
