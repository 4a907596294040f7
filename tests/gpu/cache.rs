//! The page cache (gpu_queues::cache, ptx/include/gpunvme_cache.cuh): elements of an LBA range
//! read through a cache in GPU memory, on the software controller. The data is the perf pattern,
//! whose every 8-byte word encodes its LBA, so a stale or wrong frame shows.

use super::*;
use gpunvme::gpu_cache::{CacheOptions, CacheStats, DataPath, GpuCache};

/// Elements (8-byte words) per 4 KiB page.
const PER_PAGE: u64 = 512;

/// The pattern word of element `i` of a range that starts at LBA 0.
fn expected(lba_size: u32, i: u64) -> u64 {
    word_of(SEED, lba_size, i)
}

fn cache_of(r: &Rig, frames: u64, full_wait: Option<Duration>) -> GpuCache<'_> {
    GpuCache::new(
        &r.gpu,
        CacheOptions {
            page_size: 4096,
            capacity: frames * 4096,
            full_wait,
            ..Default::default()
        },
    )
    .expect("cache")
}

/// A cache over the first `pages` 4 KiB pages of namespace 1, prefilled with the pattern.
fn cached_range(r: &Rig, pages: u64, frames: u64, full_wait: Option<Duration>) -> GpuCache<'_> {
    let blocks = pages * 4096 / r.lba as u64;
    cpu_prefill(r, blocks);
    let mut c = cache_of(r, frames, full_wait);
    let id = c.bind_lba_range(1, r.lba, 0, blocks, false).expect("bind");
    assert_eq!(id.index(), 0);
    c
}

/// Runs `gpunvme_cache_test`: `threads` threads (whole warps launched) each read `per`
/// elements, thread t the indices `idx[t * per..]`; returns each value and status.
fn read_elements(
    r: &Rig,
    c: &GpuCache<'_>,
    warp: bool,
    threads: u32,
    per: u32,
    idx: &[u64],
) -> (Vec<u64>, Vec<DeviceStatus>) {
    access_elements(r, c, warp as u32, threads, per, idx, None)
}

/// Stores `vals` at `idx` (as `read_elements` reads); returns each status.
fn store_elements(
    r: &Rig,
    c: &GpuCache<'_>,
    warp: bool,
    threads: u32,
    per: u32,
    idx: &[u64],
    vals: &[u64],
) -> Vec<DeviceStatus> {
    access_elements(r, c, warp as u32 | 2, threads, per, idx, Some(vals)).1
}

fn access_elements(
    r: &Rig,
    c: &GpuCache<'_>,
    flags: u32,
    threads: u32,
    per: u32,
    idx: &[u64],
    stores: Option<&[u64]>,
) -> (Vec<u64>, Vec<DeviceStatus>) {
    let (v, st) = access_elements_raw(r, c, flags, threads, per, idx, stores);
    (v, st.into_iter().map(DeviceStatus::from_code).collect())
}

/// `access_elements` with each status word as the kernel wrote it.
fn access_elements_raw(
    r: &Rig,
    c: &GpuCache<'_>,
    flags: u32,
    threads: u32,
    per: u32,
    idx: &[u64],
    stores: Option<&[u64]>,
) -> (Vec<u64>, Vec<u32>) {
    access_on(&r.gpu, c, flags, threads, per, idx, stores)
}

/// `access_elements_raw` on any GPU queues' client stream (a served controller's too).
pub(super) fn access_on(
    gpu: &GpuQueues,
    c: &GpuCache<'_>,
    flags: u32,
    threads: u32,
    per: u32,
    idx: &[u64],
    stores: Option<&[u64]>,
) -> (Vec<u64>, Vec<u32>) {
    let n = threads as usize * per as usize;
    assert_eq!(idx.len(), n);
    let cuda = gpu.cuda();
    let idx_mem = DeviceMemory::alloc(cuda, n * 8).unwrap();
    idx_mem.write(0, idx.as_bytes()).unwrap();
    let values = DeviceMemory::alloc(cuda, n * 8).unwrap();
    if let Some(v) = stores {
        values.write(0, v.as_bytes()).unwrap();
    }
    let statuses = DeviceMemory::alloc(cuda, n * 4).unwrap();
    let block = threads.next_multiple_of(32).min(128);
    let grid = threads.div_ceil(block);
    let s = gpu.client_stream();
    s.launch(
        gpu.kernels().tools().unwrap().cache_test,
        grid,
        block,
        &[
            Arg::U64(c.descriptor()),
            Arg::U32(0),
            Arg::U32(flags),
            Arg::U32(per),
            Arg::U64(threads as u64),
            Arg::U64(idx_mem.ptr()),
            Arg::U64(values.ptr()),
            Arg::U64(statuses.ptr()),
        ],
    )
    .unwrap();
    s.wait_idle(Duration::from_secs(300))
        .expect("cache kernel ends");
    let mut v = vec![0u64; n];
    values.read(0, v.as_mut_bytes()).unwrap();
    let mut st = vec![0u32; n];
    statuses.read(0, st.as_mut_bytes()).unwrap();
    (v, st)
}

fn assert_values(r: &Rig, idx: &[u64], v: &[u64], st: &[DeviceStatus]) {
    for (k, (&i, (&got, &s))) in idx.iter().zip(v.iter().zip(st)).enumerate() {
        assert_eq!(s, DeviceStatus::Ok, "access {k} (element {i})");
        assert_eq!(got, expected(r.lba, i), "access {k}: element {i}");
    }
}

fn invariants(c: &GpuCache<'_>) {
    if let Err(e) = c.check_invariants() {
        panic!("cache invariants: {e}");
    }
}

fn seeded(seed: u64, n: usize, below: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % below
        })
        .collect()
}

fn stats(c: &GpuCache<'_>) -> CacheStats {
    c.stats().expect("cache statistics")
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn concurrent_readers_of_one_page_issue_one_command() {
    let r = rig(512, 2, 64);
    let c = cached_range(&r, 64, 16, None);
    let before = r.emu().stats();
    // 256 threads in 8 warps, every lane on page 5: one lookup per warp, one fill in all.
    let idx: Vec<u64> = (0..256)
        .map(|t| 5 * PER_PAGE + (t * 7) % PER_PAGE)
        .collect();
    let (v, st) = read_elements(&r, &c, true, 256, 1, &idx);
    assert_values(&r, &idx, &v, &st);
    let s = stats(&c);
    assert_eq!((s.counters.misses, s.counters.read_cmds), (1, 1), "{s:?}");
    // Every access is a hit, a wait for another warp's fill, or one of the filling warp's.
    assert_eq!(s.counters.hits + s.counters.waits + 32, 256, "{s:?}");
    assert_eq!(
        r.emu().stats().reads - before.reads,
        1,
        "the controller saw one read"
    );
    invariants(&c);
    // Alone (thread variant), on pages 5 (cached) and 9 (not): one more command.
    let idx: Vec<u64> = (0..128)
        .map(|t| [5, 9][t as usize % 2] * PER_PAGE + t)
        .collect();
    let (v, st) = read_elements(&r, &c, false, 128, 1, &idx);
    assert_values(&r, &idx, &v, &st);
    let s = stats(&c);
    assert_eq!(
        (s.counters.misses, s.counters.read_cmds, s.counters.errors),
        (2, 2, 0),
        "{s:?}"
    );
    assert_eq!(r.emu().stats().reads - before.reads, 2);
    invariants(&c);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn eviction_under_pressure_keeps_every_value() {
    let r = rig(512, 2, 64);
    // 256 pages through 8 frames: threads alone (each holds one page at a time), then
    // warps whose 32 lanes want up to 32 pages each (fills run in rounds: a fill without a
    // frame is given back while the warp releases what it read, so no warp holds pages
    // while it looks for frames).
    for (warp, seed) in [(false, 0x5eed), (true, 0xbeef)] {
        let c = cached_range(&r, 256, 8, None);
        let idx = seeded(seed, 64 * 32, 256 * PER_PAGE);
        let (v, st) = read_elements(&r, &c, warp, 64, 32, &idx);
        assert_values(&r, &idx, &v, &st);
        let s = stats(&c).counters;
        assert!(s.evictions > 0 && s.misses >= 256 - 8, "warp {warp}: {s:?}");
        assert_eq!((s.errors, s.full), (0, 0), "warp {warp}: {s:?}");
        invariants(&c);
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn media_error_reaches_every_waiter() {
    let r = rig(512, 2, 64);
    let c = cached_range(&r, 64, 16, None);
    // Page 3 is LBAs 24..32.
    r.emu().faults().add_media_error(1, 27);
    let before = r.emu().stats();
    // 8 warps; half-warps alternate between pages 3 and 4.
    let idx: Vec<u64> = (0..256u64)
        .map(|t| [3, 4][(t / 16) as usize % 2] * PER_PAGE + t)
        .collect();
    let (v, st) = read_elements(&r, &c, true, 256, 1, &idx);
    for (k, &i) in idx.iter().enumerate() {
        if i / PER_PAGE == 3 {
            assert_eq!(st[k], DeviceStatus::NvmeError, "access {k}");
        } else {
            assert_eq!(st[k], DeviceStatus::Ok, "access {k}");
            assert_eq!(v[k], expected(r.lba, i), "access {k}");
        }
    }
    let s = stats(&c);
    let failed = r.emu().stats().errors - before.errors;
    assert!(
        failed >= 1 && s.counters.errors == failed,
        "{s:?}: {failed} failed reads"
    );
    assert_eq!(s.counters.misses, 1, "page 4 filled once: {s:?}");
    let f = s.first_failure.expect("first failure recorded");
    assert_eq!((f.status, f.range, f.page), (DeviceStatus::NvmeError, 0, 3));
    assert_eq!(
        (f.nvme_status >> 9) & 7,
        2,
        "SCT media error: {:#x}",
        f.nvme_status
    );
    invariants(&c);
    // The error is not cached: once the fault is gone, page 3 reads.
    r.emu().faults().clear_media_errors();
    let idx: Vec<u64> = (0..64).map(|t| 3 * PER_PAGE + t).collect();
    let (v, st) = read_elements(&r, &c, true, 64, 1, &idx);
    assert_values(&r, &idx, &v, &st);
    invariants(&c);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn dropped_completion_returns_to_every_waiter() {
    let r = rig_with(
        512,
        |_| {},
        GpuQueueOptions {
            queues: Some(1),
            depth: Some(64),
            timeout: Some(Duration::from_secs(2)),
            ..Default::default()
        },
    );
    let c = cached_range(&r, 16, 16, None);
    r.emu().faults().drop_completions(nvme_emu::DROP_ALL);
    let idx: Vec<u64> = (0..64u64).map(|t| (t % 4) * PER_PAGE + t).collect();
    let start = Instant::now();
    let (_, st) = read_elements(&r, &c, true, 64, 1, &idx);
    let took = start.elapsed();
    r.emu().faults().drop_completions(0);
    assert!(took < Duration::from_secs(60), "bounded: {took:?}");
    assert!(
        st.iter().all(|s| matches!(
            s,
            DeviceStatus::Timeout | DeviceStatus::QueueFailed | DeviceStatus::Aborted
        )),
        "{st:?}"
    );
    let s = stats(&c);
    assert!(
        s.quarantined >= 1,
        "a frame a late DMA may hit is never reused: {s:?}"
    );
    assert_eq!(s.counters.misses, 0, "{s:?}");
    invariants(&c);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn all_referenced_returns_cache_full() {
    let r = rig(512, 2, 64);
    let c = cached_range(&r, 16, 4, Some(Duration::from_secs(1)));
    let cuda = r.gpu.cuda();
    let pages = DeviceMemory::alloc(cuda, 5 * 8).unwrap();
    pages.write(0, [0u64, 1, 2, 3, 4].as_bytes()).unwrap();
    let words = DeviceMemory::alloc(cuda, 8).unwrap();
    let statuses = DeviceMemory::alloc(cuda, 5 * 4).unwrap();
    let s = r.gpu.client_stream();
    // Warps 0-3 pin pages 0-3 (every frame); warp 4 asks for page 4.
    s.launch(
        r.gpu.kernels().tools().unwrap().cache_pin_test,
        1,
        160,
        &[
            Arg::U64(c.descriptor()),
            Arg::U32(0),
            Arg::U64(pages.ptr()),
            Arg::U32(4),
            Arg::U64(words.ptr()),
            Arg::U64(statuses.ptr()),
            Arg::U64(60_000_000_000),
        ],
    )
    .unwrap();
    s.wait_idle(Duration::from_secs(300))
        .expect("pin kernel ends");
    let mut st = [0u32; 5];
    statuses.read(0, st.as_mut_bytes()).unwrap();
    let st = st.map(DeviceStatus::from_code);
    assert_eq!(
        st,
        [
            DeviceStatus::Ok,
            DeviceStatus::Ok,
            DeviceStatus::Ok,
            DeviceStatus::Ok,
            DeviceStatus::CacheFull
        ]
    );
    let stats = stats(&c);
    assert_eq!(
        (stats.counters.full, stats.counters.misses),
        (1, 4),
        "{stats:?}"
    );
    invariants(&c);
    // Nothing is held any more: page 4 reads.
    let idx: Vec<u64> = (0..32).map(|t| 4 * PER_PAGE + t).collect();
    let (v, st) = read_elements(&r, &c, true, 32, 1, &idx);
    assert_values(&r, &idx, &v, &st);
    invariants(&c);
}

/// The pattern word of element `i` under `seed` (a range from LBA 0).
fn word_of(seed: u64, lba_size: u32, i: u64) -> u64 {
    let byte = i * 8;
    gpu_queues::pattern::word(
        seed,
        1,
        byte / lba_size as u64,
        ((byte % lba_size as u64) / 8) as usize,
    )
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn dirty_pages_reach_the_device_after_flush() {
    const SEED2: u64 = 0x5eed_0002;
    for warp in [true, false] {
        let r = rig(512, 2, 64);
        let blocks = 64 * 4096 / r.lba as u64;
        cpu_prefill(&r, blocks);
        let mut c = cache_of(&r, 8, None);
        c.bind_lba_range(1, r.lba, 0, blocks, true).expect("bind");
        let flushes = r.emu().stats().flushes;
        // Every element of 64 pages through 8 frames: lanes of a warp on consecutive
        // elements, so pages are written back as they are evicted.
        let n = 64 * PER_PAGE;
        let idx: Vec<u64> = (0..n).map(|k| (k % 512) * 64 + k / 512).collect();
        let vals: Vec<u64> = idx.iter().map(|&i| word_of(SEED2, r.lba, i)).collect();
        let st = store_elements(&r, &c, warp, 64, 512, &idx, &vals);
        assert!(
            st.iter().all(|&s| s == DeviceStatus::Ok),
            "warp {warp}: {st:?}"
        );
        invariants(&c);
        let dirty = c.dirty_pages().unwrap();
        assert!(
            (1..=8).contains(&dirty),
            "the last pages stored are dirty: {dirty}"
        );
        // Read your writes through the cache, from frames and from pages written back
        // (which also writes back the dirty ones as their frames are reused).
        let (v, st) = read_elements(&r, &c, warp, 64, 512, &idx);
        assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "warp {warp}");
        assert!(v == vals, "warp {warp}: loads after stores");
        // Four pages stored again stay in the cache, dirty, until the flush.
        const SEED3: u64 = 0x5eed_0003;
        let idx3: Vec<u64> = (0..4 * PER_PAGE).collect();
        let vals3: Vec<u64> = idx3.iter().map(|&i| word_of(SEED3, r.lba, i)).collect();
        let st = store_elements(&r, &c, warp, 64, 32, &idx3, &vals3);
        assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "warp {warp}");
        assert_eq!(c.dirty_pages().unwrap(), 4);
        let report = c.flush().expect("flush");
        assert_eq!(c.dirty_pages().unwrap(), 0);
        assert_eq!((report.pages_written, report.flush_cmds), (4, 1));
        let s = stats(&c).counters;
        assert!(
            s.writebacks >= 64 && s.write_cmds >= 64,
            "warp {warp}: {s:?}"
        );
        assert_eq!(s.errors, 0, "{s:?}");
        assert_eq!(r.emu().stats().flushes - flushes, 1, "one NVMe Flush");
        // What the GPU stored, a CPU queue reads.
        let mut want = vec![0u8; (blocks * r.lba as u64) as usize];
        gpu_queues::pattern::fill(&mut want, SEED2, 1, 0, r.lba as usize);
        gpu_queues::pattern::fill(&mut want[..4 * 4096], SEED3, 1, 0, r.lba as usize);
        assert!(
            cpu_read(&r, 0, blocks) == want,
            "warp {warp}: device bytes after flush"
        );
        invariants(&c);
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn bounce_data_path_moves_pages_through_slot_buffers() {
    // The BOUNCE data path (transports whose GPU memory is fixed at set-up), chosen on the
    // software controller: 16 KiB pages through 4 KiB slot buffers (four commands a page),
    // reads under eviction, stores written back on eviction and by flush, and the bytes a
    // CPU queue then reads from the device.
    const SEED2: u64 = 0x5eed_0004;
    let r = rig_with(
        512,
        |_| {},
        GpuQueueOptions {
            queues: Some(2),
            depth: Some(64),
            slot_buffer_bytes: Some(4096),
            ..Default::default()
        },
    );
    let (page, pages) = (16384u64, 32u64);
    let blocks = pages * page / r.lba as u64;
    cpu_prefill(&r, blocks);
    let mut c = GpuCache::new(
        &r.gpu,
        CacheOptions {
            page_size: page as u32,
            capacity: 8 * page,
            data_path: DataPath::Bounce,
            ..Default::default()
        },
    )
    .expect("cache");
    assert_eq!(c.data_path(), DataPath::Bounce);
    c.bind_lba_range(1, r.lba, 0, blocks, true).expect("bind");
    let n = pages * page / 8;
    for warp in [true, false] {
        let idx = seeded(0xb0b + warp as u64, 64 * 32, n);
        let (v, st) = read_elements(&r, &c, warp, 64, 32, &idx);
        assert_values(&r, &idx, &v, &st);
    }
    let s = stats(&c).counters;
    assert!(s.evictions > 0, "{s:?}");
    assert_eq!(
        s.read_cmds,
        4 * s.misses,
        "four 4 KiB commands a page: {s:?}"
    );
    invariants(&c);
    // Every element stored (a warp's lanes on consecutive elements), then flushed.
    let per = (n / 64) as u32;
    let idx: Vec<u64> = (0..n)
        .map(|k| (k % per as u64) * 64 + k / per as u64)
        .collect();
    let vals: Vec<u64> = idx.iter().map(|&i| word_of(SEED2, r.lba, i)).collect();
    let st = store_elements(&r, &c, true, 64, per, &idx, &vals);
    assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "{st:?}");
    let report = c.flush().expect("flush");
    assert!(report.pages_written > 0, "{report:?}");
    assert_eq!(c.dirty_pages().unwrap(), 0);
    let s = stats(&c).counters;
    assert!(s.writebacks >= pages, "{s:?}");
    assert_eq!(
        s.write_cmds,
        4 * s.writebacks,
        "four 4 KiB commands a page: {s:?}"
    );
    assert_eq!(s.errors, 0, "{s:?}");
    let mut want = vec![0u8; (blocks * r.lba as u64) as usize];
    gpu_queues::pattern::fill(&mut want, SEED2, 1, 0, r.lba as usize);
    assert!(cpu_read(&r, 0, blocks) == want, "device bytes after flush");
    invariants(&c);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn stores_to_a_read_only_range_are_refused() {
    let r = rig(512, 2, 64);
    let c = cached_range(&r, 16, 8, None);
    let idx: Vec<u64> = (0..64).map(|t| t * 3).collect();
    for warp in [true, false] {
        let st = store_elements(&r, &c, warp, 64, 1, &idx, &idx);
        assert!(st.iter().all(|&s| s == DeviceStatus::OutOfExtent), "{st:?}");
    }
    assert_eq!(c.dirty_pages().unwrap(), 0);
    let (v, st) = read_elements(&r, &c, true, 64, 1, &idx);
    assert_values(&r, &idx, &v, &st);
    assert_eq!(c.flush().expect("flush").pages_written, 0);
}

/// Little-endian u64 element `i` of `bytes`.
fn le_word(bytes: &[u8], i: u64) -> u64 {
    let at = i as usize * 8;
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn file_ranges_read_and_write_through_the_extent_table() {
    use blockfs::{CreateOptions, FileSystem, MkfsOptions, OpenMode};
    use blockfs_gpu::{GpuFiles, GpuFilesOptions};
    use gpunvme::gpu_cache::bind_file;
    for lba in [512u32, 4096] {
        let r = rig(lba, 2, 64);
        let fs =
            FileSystem::mkfs(super::files::blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
        // A fragmented file whose length is not a multiple of the LBA size, in 16 KiB
        // pages (extents are 4 KiB blocks, so pages span them) through 8 frames.
        let len = 1_200_000 + 24;
        let want = super::files::fragmented(&fs, len);
        let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
        let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
        let g = files.open(&file).expect("open for the GPU");
        assert!(g.table().extents().len() > 3, "fragmented");
        let out = CacheOptions {
            page_size: 16384,
            capacity: 8 * 16384,
            ..Default::default()
        };
        let mut c = GpuCache::new(&r.gpu, out.clone()).expect("cache");
        let id = bind_file(&mut c, &g).expect("bind");
        assert_eq!((id.index(), c.range(id).unwrap().bytes), (0, len as u64));
        drop(g); // the cache keeps the table (and the pin) alive
        let n = len as u64 / 8;
        let mut idx = seeded(lba as u64, 128 * 8, n);
        idx[7] = n - 1; // the last element, in the partial last LBA
        for warp in [true, false] {
            let (v, st) = read_elements(&r, &c, warp, 128, 8, &idx);
            for (k, &i) in idx.iter().enumerate() {
                assert_eq!(
                    st[k],
                    DeviceStatus::Ok,
                    "lba {lba} warp {warp}: element {i}"
                );
                assert_eq!(
                    v[k],
                    le_word(&want, i),
                    "lba {lba} warp {warp}: element {i}"
                );
            }
        }
        let (_, st) = read_elements(&r, &c, false, 1, 1, &[n]);
        assert_eq!(st[0], DeviceStatus::OutOfExtent, "past the end");
        let k = stats(&c).counters;
        assert!(k.misses > 8 && k.evictions > 0, "{k:?}");
        assert!(k.read_cmds > k.misses, "some pages span extents: {k:?}");
        invariants(&c);
        drop(c);

        // A reservation through the cache: stores, close (write-back + NVMe Flush),
        // commit, and the CPU reads them after a remount.
        let f = fs
            .create("dir/new", &CreateOptions { size_hint: 0 })
            .expect("create");
        let new_len = 200_000u64 + 40;
        let g = files.reserve(&f, new_len).expect("reserve");
        let mut c = GpuCache::new(&r.gpu, out.clone()).expect("cache");
        let id = bind_file(&mut c, &g).expect("bind a reservation");
        let bytes = c.range(id).unwrap().bytes;
        assert!(bytes >= new_len);
        let idx: Vec<u64> = (0..new_len / 8).step_by(13).collect();
        let n = idx.len() as u64 / 64 * 64;
        let idx = &idx[..n as usize];
        let vals: Vec<u64> = idx.iter().map(|&i| word_of(99, lba, i)).collect();
        let st = store_elements(&r, &c, true, 64, (n / 64) as u32, idx, &vals);
        assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "stores");
        let report = c.close().expect("close");
        assert!(
            report.pages_written > 0 && report.flush_cmds == 1,
            "{report:?}"
        );
        g.commit(new_len).expect("commit after the cache let go");
        fs.sync().expect("sync");
        drop((f, file));
        fs.unmount().expect("unmount");
        let fs = FileSystem::mount(super::files::blockfs_dev(&r)).expect("remount");
        let back_file = fs.open("dir/new", OpenMode::ReadOnly).expect("open");
        let mut back = vec![0u8; new_len as usize];
        back_file.read_at(0, &mut back).expect("CPU read");
        for (&i, &v) in idx.iter().zip(&vals) {
            assert_eq!(le_word(&back, i), v, "lba {lba}: element {i} after remount");
        }
    }
}

/// A cache over a striped volume of three software controllers (issue 23): a fragmented
/// file's pages (16 KiB, through 8 frames, so with evictions) filled from every member,
/// each piece on its member's queues at its member LBA (the volume's layout); and a
/// writable volume LBA range whose stores, after `flush`, are where the layout puts them on
/// each member (read back through the volume and through each member).
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn volume_pages_are_filled_from_every_member() {
    use blockfs::{
        BlockDevice, FileSystem, MkfsOptions, OpenMode, ReadReq, StripedVolume, WriteReq,
    };
    use blockfs_gpu::{GpuFilesOptions, VolumeFiles};
    use gpunvme::gpu_cache::{bind_volume_file, volume_geometry};
    let rigs: Vec<Rig> = (0..3).map(|_| rig(512, 2, 64)).collect();
    let members: Vec<Arc<dyn BlockDevice>> = rigs
        .iter()
        .map(|r| super::files::blockfs_dev(r) as Arc<dyn BlockDevice>)
        .collect();
    let queues: Vec<&GpuQueues> = rigs.iter().map(|r| &r.gpu).collect();
    let opts = CacheOptions {
        page_size: 16384,
        capacity: 8 * 16384,
        ..Default::default()
    };
    {
        let volume =
            Arc::new(StripedVolume::create(members.clone(), 64 << 10, [31; 16]).expect("volume"));
        let fs = FileSystem::mkfs(volume.clone(), &MkfsOptions::default()).expect("mkfs");
        let len = 1_200_000 + 24;
        let want = super::files::fragmented(&fs, len);
        let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
        let vf = VolumeFiles::new(&queues, GpuFilesOptions::default());
        let vfile = vf.open(&volume, &file).expect("open on the volume");
        let geometry = volume_geometry(&volume).expect("geometry");
        assert_eq!(geometry.nsids, vec![1, 1, 1]);
        let mut c = GpuCache::on_volume(&queues, &geometry, opts.clone()).expect("cache");
        assert_eq!(c.volume_members(), Some((3, 2)));
        // A cache over one controller refuses a volume's file.
        {
            let mut one = GpuCache::new(&rigs[0].gpu, opts.clone()).expect("cache");
            let e = bind_volume_file(&mut one, &vf, &volume, &vfile).expect_err("one member");
            assert!(format!("{e}").contains("over that volume"), "{e}");
        }
        let id = bind_volume_file(&mut c, &vf, &volume, &vfile).expect("bind");
        assert_eq!(c.range(id).unwrap().bytes, len as u64);
        // The same file through a BOUNCE cache: every member's fills through its own
        // queues' slot buffers.
        let mut bounce = GpuCache::on_volume(
            &queues,
            &geometry,
            CacheOptions {
                data_path: DataPath::Bounce,
                ..opts.clone()
            },
        )
        .expect("BOUNCE cache");
        assert_eq!(bounce.data_path(), DataPath::Bounce);
        bind_volume_file(&mut bounce, &vf, &volume, &vfile).expect("bind");
        drop(vfile); // the caches keep the table and the pin
        let n = len as u64 / 8;
        let mut idx = seeded(77, 128 * 8, n);
        idx[5] = n - 1;
        for (cache, name) in [(&c, "DIRECT"), (&bounce, "BOUNCE")] {
            let before: Vec<u64> = rigs.iter().map(|r| r.emu().stats().reads).collect();
            for warp in [true, false] {
                let (v, st) = read_elements(&rigs[0], cache, warp, 128, 8, &idx);
                for (k, &i) in idx.iter().enumerate() {
                    assert_eq!(st[k], DeviceStatus::Ok, "{name}, warp {warp}: element {i}");
                    assert_eq!(v[k], le_word(&want, i), "{name}, warp {warp}: element {i}");
                }
            }
            let k = stats(cache).counters;
            assert!(k.misses > 8 && k.evictions > 0, "{name}: {k:?}");
            for (m, r) in rigs.iter().enumerate() {
                assert!(
                    r.emu().stats().reads > before[m],
                    "{name}: member {m} served fills"
                );
            }
            invariants(cache);
        }
        drop(c);
        drop(bounce);
        drop(file);
        fs.unmount().expect("unmount");
    }
    // A writable range of volume LBAs (no file system: a fresh volume), 3 stripe units of
    // 8 KiB per member and a partial one; stores, flush, then the bytes where the layout
    // puts them.
    let volume = StripedVolume::create(members.clone(), 8 << 10, [32; 16]).expect("volume");
    let blocks = 3 * 3 * 16 + 5;
    let old: Vec<u8> = (0..blocks * 512).map(|i| (i * 7 + 3) as u8).collect();
    volume
        .write(&[WriteReq { lba: 0, buf: &old }])
        .expect("CPU write through the volume");
    let geometry = volume_geometry(&volume).expect("geometry");
    let mut c = GpuCache::on_volume(
        &queues,
        &geometry,
        CacheOptions {
            page_size: 4096,
            capacity: 4 * 4096,
            ..Default::default()
        },
    )
    .expect("cache");
    let id = c
        .bind_lba_range(1, 512, 0, blocks as u64, true)
        .expect("bind");
    assert_eq!(id.index(), 0);
    let words = (blocks * 512 / 8) as u64;
    let idx: Vec<u64> = (0..words).step_by(3).take(64 * 8).collect();
    let (v, st) = read_elements(&rigs[0], &c, true, 64, 8, &idx);
    for (k, &i) in idx.iter().enumerate() {
        assert_eq!(st[k], DeviceStatus::Ok, "element {i}");
        assert_eq!(v[k], le_word(&old, i), "element {i} before the stores");
    }
    let vals: Vec<u64> = idx.iter().map(|&i| i ^ 0x5eed_0000_0000).collect();
    let st = store_elements(&rigs[0], &c, true, 64, 8, &idx, &vals);
    assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "stores");
    let report = c.close().expect("flush");
    assert!(
        report.pages_written > 0 && report.flush_cmds == 3,
        "{report:?}"
    );
    let mut want = old.clone();
    for (&i, &v) in idx.iter().zip(&vals) {
        want[i as usize * 8..i as usize * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    let mut back = vec![0u8; blocks * 512];
    volume
        .read(&mut [ReadReq {
            lba: 0,
            buf: &mut back,
        }])
        .expect("CPU read through the volume");
    assert!(back == want, "the stores, read back through the volume");
    // Each member holds its units at the layout's LBAs.
    for lba in (0..blocks as u64).step_by(7) {
        let (m, mlba) = volume.locate(lba);
        let mut one = vec![0u8; 512];
        members[m]
            .read(&mut [ReadReq {
                lba: mlba,
                buf: &mut one,
            }])
            .expect("member read");
        let at = lba as usize * 512;
        assert!(
            one == want[at..at + 512],
            "volume LBA {lba} on member {m} at {mlba}"
        );
    }
}

/// Writes `bytes` (padded to whole LBAs) at `lba` through a CPU queue; returns the LBAs.
fn cpu_write(r: &Rig, lba: u64, bytes: &[u8]) -> u64 {
    let mut buf = bytes.to_vec();
    buf.resize(bytes.len().next_multiple_of(r.lba as usize), 0);
    let mut q = r.ctrl.create_io_queue_pair(64).expect("CPU queue");
    q.write_from(1, lba, &buf).expect("CPU write");
    (buf.len() / r.lba as usize) as u64
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn bfs_and_gather_through_the_cache_match_the_cpu() {
    use crate::workloads::graph::{BfsDirection, BfsOptions, BfsSplit};
    use crate::workloads::{Source, embedding, graph};
    let r = rig(512, 2, 64);
    // A graph of 36 KiB and a table of 32 KiB through 4 frames of 4 KiB.
    let g = graph::rmat(9, 8, 11).expect("graph");
    let off_blocks = cpu_write(&r, 0, g.offsets.as_bytes());
    let col_lba = off_blocks.next_multiple_of(8);
    let col_blocks = cpu_write(&r, col_lba, g.cols.as_bytes());
    let (rows, dim) = (256u64, 32u32);
    let mut table = vec![0u8; (rows * dim as u64 * 4) as usize];
    embedding::table_bytes(SEED, 0, &mut table);
    let table_lba = (col_lba + col_blocks).next_multiple_of(8);
    let table_blocks = cpu_write(&r, table_lba, &table);
    let mut c = cache_of(&r, 4, None);
    let ranges = [
        c.bind_lba_range(1, 512, 0, off_blocks, false).unwrap(),
        c.bind_lba_range(1, 512, col_lba, col_blocks, false)
            .unwrap(),
        c.bind_lba_range(1, 512, table_lba, table_blocks, false)
            .unwrap(),
    ];
    let root = graph::root(&g, 3);
    let want = graph::cpu_bfs(&g, root);
    // Small dynamic runs: many draws of the shared counter, each block's barriers met; odd
    // levels take them from the top down.
    let through_cache = |direction| {
        graph::gpu_bfs(
            &r.gpu,
            Source::Cache(&c, &ranges[..2]),
            g.vertices(),
            root,
            BfsOptions {
                split: BfsSplit::Dynamic(64),
                hub_segment: Some(16),
                alternate: true,
                direction,
            },
        )
        .expect("BFS through the cache")
    };
    let run = through_cache(BfsDirection::TopDown);
    assert_eq!(graph::first_mismatch(&run.levels, &want), None, "levels");
    assert!(run.depth > 2 && run.reached > 400, "{run:?}");
    assert_eq!(run.level_secs.len(), run.depth as usize, "{run:?}");
    assert!(!run.bottom_up.contains(&true), "{run:?}");
    // Pieces of 16 neighbours: the graph's hubs went to the second kernel.
    assert!(run.hub_pieces > 0, "{run:?}");
    // Direction-optimising: some levels bottom-up, through the cache, same levels.
    let opt = through_cache(BfsDirection::Optimizing);
    assert_eq!(graph::first_mismatch(&opt.levels, &want), None, "{opt:?}");
    assert!(opt.bottom_up.contains(&true), "{opt:?}");
    assert!(!opt.bottom_up[0], "{opt:?}");
    let k = stats(&c).counters;
    assert!(k.evictions > 0, "the graph does not fit: {k:?}");
    invariants(&c);
    // The same kernel over plain GPU memory.
    let cuda = r.gpu.cuda();
    let po = DeviceMemory::alloc(cuda, g.offsets.len() * 8).unwrap();
    po.write(0, g.offsets.as_bytes()).unwrap();
    let pc = DeviceMemory::alloc(cuda, g.cols.len() * 4).unwrap();
    pc.write(0, g.cols.as_bytes()).unwrap();
    // The same kernel over plain GPU memory, with either split and either sweep (runs of 96
    // do not divide the vertex count: the partial run comes first going down).
    assert_ne!(g.vertices() % 96, 0);
    for (split, hub_segment, alternate, direction) in [
        (BfsSplit::Static, None, false, BfsDirection::TopDown),
        (BfsSplit::Dynamic(96), Some(8), true, BfsDirection::TopDown),
        (BfsSplit::Dynamic(32), None, false, BfsDirection::TopDown),
        (BfsSplit::Static, Some(8), false, BfsDirection::Optimizing),
        (BfsSplit::Dynamic(96), None, true, BfsDirection::Optimizing),
    ] {
        let opts = BfsOptions {
            split,
            hub_segment,
            alternate,
            direction,
        };
        let plain = graph::gpu_bfs(
            &r.gpu,
            Source::Plain(&[po.ptr(), pc.ptr()]),
            g.vertices(),
            root,
            opts,
        )
        .expect("BFS over GPU memory");
        assert_eq!(plain.levels, want, "{opts:?}");
    }
    // Embedding rows, Zipf-distributed, through the cache.
    let idx = embedding::zipf_indices(rows, 200, 0.99, 5).unwrap();
    let got =
        embedding::gpu_gather(&r.gpu, Source::Cache(&c, &ranges[2..]), dim, &idx).expect("gather");
    assert_eq!(embedding::first_mismatch(&got.out, &idx, dim, SEED), None);
    invariants(&c);
    // A wrong seed must not pass the check.
    assert!(embedding::first_mismatch(&got.out, &idx, dim, SEED + 1).is_some());
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn read_range_copies_runs_of_every_shape() {
    use crate::workloads::{Source, embedding};
    // Warp-wide read_range of rows of `dim` 4-byte words: rows that are not whole 16-byte
    // words and straddle pages (37 words), rows of a page and a bit (1100), rows of 36 KiB
    // (9000: runs of 9 or 10 pages), and whole pages (1024). Each table through 8 frames
    // of 4 KiB (misses, waits and evictions mid-run), then through a cache that holds it,
    // where a second gather is all hits (every batch on the fast path).
    let r = rig(512, 2, 64);
    let mut lba = 0u64;
    for (dim, rows) in [(37u32, 2000u64), (1100, 64), (9000, 12), (1024, 80)] {
        // Whole 4 KiB blocks of the table's pattern (its rows end inside the last).
        let bytes = (rows * dim as u64 * 4).next_multiple_of(4096);
        let mut table = vec![0u8; bytes as usize];
        embedding::table_bytes(SEED, 0, &mut table);
        let blocks = cpu_write(&r, lba, &table);
        let idx = embedding::zipf_indices(rows, 300, 0.5, dim as u64).unwrap();
        for frames in [8, bytes / 4096] {
            let mut c = cache_of(&r, frames, None);
            let range = c.bind_lba_range(1, 512, lba, blocks, false).unwrap();
            let gather = || {
                let got = embedding::gpu_gather(&r.gpu, Source::Cache(&c, &[range]), dim, &idx)
                    .expect("gather through the cache");
                assert_eq!(
                    embedding::first_mismatch(&got.out, &idx, dim, SEED),
                    None,
                    "rows of {dim} words through {frames} frames"
                );
            };
            gather();
            let before = stats(&c).counters;
            if frames == 8 {
                assert!(before.evictions > 0, "rows of {dim} words: {before:?}");
            } else {
                gather();
                let after = stats(&c).counters;
                assert_eq!(
                    after.misses, before.misses,
                    "rows of {dim} words: {after:?}"
                );
                assert!(after.hits > before.hits, "rows of {dim} words: {after:?}");
            }
            invariants(&c);
        }
        lba = (lba + blocks).next_multiple_of(8);
    }
}

/// One launch of `kernel` (a block of 64 threads) with the arguments `args(out)` makes,
/// `out` 16 zeroed bytes of GPU memory the kernel adds (sum, failures) into: those two.
fn bench_sums(r: &Rig, kernel: Kernel, args: impl FnOnce(u64) -> Vec<Arg>) -> (u64, u64) {
    let out = DeviceMemory::alloc(r.gpu.cuda(), 16).unwrap();
    out.write(0, &[0u8; 16]).unwrap();
    let s = r.gpu.client_stream();
    s.launch(kernel, 1, 64, &args(out.ptr())).unwrap();
    s.wait_idle(compute_wait_bound() * 5)
        .expect("benchmark kernel ends");
    let mut o = [0u64; 2];
    out.read(0, o.as_mut_bytes()).unwrap();
    (o[0], o[1])
}

/// One launch of `gpunvme_cache_bench` (through `c`, or from `plain`): (sum, failures).
fn bench_sum(
    r: &Rig,
    c: Option<&GpuCache<'_>>,
    plain: Option<&DeviceMemory>,
    mode: u32,
    elem: u32,
    n: u64,
) -> (u64, u64) {
    let scratch = DeviceMemory::alloc(r.gpu.cuda(), 2 * 65536).unwrap();
    bench_sums(r, r.gpu.kernels().tools().unwrap().cache_bench, |out| {
        let mut args = bench_args(c, plain, mode, elem, n, 16);
        args.extend([Arg::U64(SEED), Arg::U64(scratch.ptr()), Arg::U64(out)]);
        args
    })
}

/// The arguments both benchmark kernels begin with: (cache, range 0, plain, mode,
/// elem_bytes, n, iters).
fn bench_args(
    c: Option<&GpuCache<'_>>,
    plain: Option<&DeviceMemory>,
    mode: u32,
    elem: u32,
    n: u64,
    iters: u64,
) -> Vec<Arg> {
    vec![
        Arg::U64(c.map_or(0, |c| c.descriptor())),
        Arg::U32(0),
        Arg::U64(plain.map_or(0, |p| p.ptr())),
        Arg::U32(mode),
        Arg::U32(elem),
        Arg::U64(n),
        Arg::U64(iters),
    ]
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn benchmark_kernel_reads_what_a_plain_buffer_holds() {
    // 64 pages through 8 frames: random elements (4 and 8 bytes) and warp-wide read_range
    // of 4 KiB and of 64 KiB runs (16 pages, twice the frames: batches end at the first page
    // that is not a hit), each sum equal to the same kernel's over a plain copy of the bytes.
    let r = rig(512, 2, 64);
    let c = cached_range(&r, 64, 8, None);
    let plain = DeviceMemory::alloc(r.gpu.cuda(), 64 * 4096).unwrap();
    plain
        .write(0, &pattern(0, 64 * 4096 / r.lba as u64, r.lba))
        .unwrap();
    for (mode, elem) in [(0, 4), (0, 8), (2, 4), (2, 8), (3, 4), (3, 8)] {
        let n = 64 * 4096 / elem as u64;
        let cached = bench_sum(&r, Some(&c), None, mode, elem, n);
        let direct = bench_sum(&r, None, Some(&plain), mode, elem, n);
        assert_eq!(cached, direct, "mode {mode}, {elem}-byte elements");
        assert_ne!(direct.0, 0);
        invariants(&c);
    }
    assert!(stats(&c).counters.evictions > 0);
    // The scan benchmark: each warp 600 x 32 consecutive elements (19-38 pages through the
    // 8 frames), by array::load and by an array_cursor, against the plain buffer.
    for elem in [4, 8] {
        let n = 64 * 4096 / elem as u64;
        let direct = scan_sum(&r, None, Some(&plain), false, elem, n);
        assert_ne!(direct.0, 0);
        for cursor in [false, true] {
            let cached = scan_sum(&r, Some(&c), None, cursor, elem, n);
            assert_eq!(
                cached, direct,
                "scan, cursor {cursor}, {elem}-byte elements"
            );
            invariants(&c); // the cursors gave every page back
        }
    }
}

/// One launch of `gpunvme_cache_bench_scan` (2 warps of 600 loads each), through `c` (with
/// an array_cursor when `cursor`) or from `plain`: (sum, failures).
fn scan_sum(
    r: &Rig,
    c: Option<&GpuCache<'_>>,
    plain: Option<&DeviceMemory>,
    cursor: bool,
    elem: u32,
    n: u64,
) -> (u64, u64) {
    bench_sums(
        r,
        r.gpu.kernels().tools().unwrap().cache_bench_scan,
        |out| {
            let mut args = bench_args(c, plain, cursor as u32, elem, n, 600);
            args.push(Arg::U64(out));
            args
        },
    )
}

/// Warps scanning through `array_cursor`s (flag 4 of `gpunvme_cache_test`): an aligned
/// scan, one whose lanes straddle page boundaries (two pages held at once), one that jumps
/// half-way, one with 5 inactive lanes and an index past the range every 7th load; 64 pages
/// through 8 frames. Every value and status checked, every page given back at the end, and
/// one lookup per page a warp enters, not one per load.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn cursor_scans_keep_their_pages_between_loads() {
    let r = rig(512, 2, 64);
    let c = cached_range(&r, 64, 8, None);
    let n = 64 * PER_PAGE;
    let (threads, per) = (123u32, 64u32);
    let mut idx = vec![0u64; 128 * per as usize];
    for t in 0..128u64 {
        let (w, l) = (t / 32, t % 32);
        for j in 0..per as u64 {
            let e = match w {
                0 => j * 32 + l,
                1 => 700 + j * 32 + l,
                2 if j < 32 => 4992 + j * 32 + l,
                2 => 19968 + j * 32 + l,
                _ if l == 3 && j % 7 == 0 => n + 5,
                _ => 8992 + j * 32 + l,
            };
            idx[(t * per as u64 + j) as usize] = e;
        }
    }
    let idx = &idx[..(threads * per) as usize];
    let (v, raw) = access_elements_raw(&r, &c, 1 | 4, threads, per, idx, None);
    for (k, (&i, (&got, &word))) in idx.iter().zip(v.iter().zip(&raw)).enumerate() {
        let s = DeviceStatus::from_code(word & 0xffff);
        if i >= n {
            assert_eq!(s, DeviceStatus::OutOfExtent, "access {k} (element {i})");
        } else {
            assert_eq!(s, DeviceStatus::Ok, "access {k} (element {i})");
            assert_eq!(got, expected(r.lba, i), "access {k}: element {i}");
        }
        // After each load the warp holds exactly the distinct pages its lanes read.
        let (t, j) = (k / per as usize, k % per as usize);
        let warp = t / 32 * 32..(t / 32 * 32 + 32).min(threads as usize);
        let mut pages: Vec<u64> = warp
            .map(|u| idx[u * per as usize + j])
            .filter(|&e| e < n)
            .map(|e| e / PER_PAGE)
            .collect();
        pages.sort_unstable();
        pages.dedup();
        assert_eq!(word >> 16, pages.len() as u32, "access {k}: pages held");
    }
    invariants(&c); // and none after the kernel
    let s = stats(&c);
    assert_eq!((s.counters.errors, s.counters.full), (0, 0), "{s:?}");
    // Every load that did not fill or wait was a hit (reused ones counted on release), and
    // the warps filled about the 17 pages they entered.
    let served = raw.iter().filter(|&&w| w & 0xffff == 0).count() as u64;
    assert!(s.counters.misses <= 24, "{s:?}");
    assert!(
        s.counters.hits + s.counters.waits + 32 * s.counters.misses >= served,
        "{s:?}"
    );
}

/// The cache at GPU scale on `r`: 8192 threads reading random elements of the whole 64 MiB
/// namespace through 1024 frames (mostly misses), the same alone, then a hot set that fits
/// (mostly hits); every value checked.
fn at_scale(r: &Rig) {
    let pages = NS_BYTES / 4096;
    let mut c = cache_of(r, 1024, None);
    c.bind_lba_range(1, r.lba, 0, NS_BYTES / r.lba as u64, false)
        .expect("bind");
    let (threads, per) = (8192u32, 64u32);
    let n = (threads * per) as usize;
    let idx = seeded(0x5ca1e, n, pages * PER_PAGE);
    let (v, st) = read_elements(r, &c, true, threads, per, &idx);
    assert_values(r, &idx, &v, &st);
    let s = stats(&c);
    assert_eq!(
        (s.counters.errors, s.counters.full, s.quarantined),
        (0, 0, 0),
        "{s:?}"
    );
    assert!(
        s.counters.misses > n as u64 / 2 && s.counters.evictions > 0,
        "{s:?}"
    );
    invariants(&c);
    let idx = seeded(0x5ca1f, 2048 * 64, pages * PER_PAGE);
    let (v, st) = read_elements(r, &c, false, 2048, 64, &idx);
    assert_values(r, &idx, &v, &st);
    invariants(&c);
    // A hot set of 512 pages through 1024 frames: after its first touches, hits.
    c.reset_stats().unwrap();
    let idx = seeded(0x407, n, 512 * PER_PAGE);
    let (v, st) = read_elements(r, &c, true, threads, per, &idx);
    assert_values(r, &idx, &v, &st);
    let s = stats(&c);
    assert!(
        s.counters.misses <= 1024 && s.counters.hits >= n as u64 * 9 / 10,
        "{s:?}"
    );
    assert_eq!((s.counters.errors, s.counters.full), (0, 0), "{s:?}");
    invariants(&c);
    drop(c);
    // Stores: 524 k distinct random elements (an odd multiplier permutes the indices)
    // through 1024 frames by warps, flushed; a new cache then reads them back from the
    // device, and an element nobody stored still holds the old pattern.
    const SEED4: u64 = 0x5eed_0004;
    let elems = NS_BYTES / 8;
    let idx: Vec<u64> = (0..n as u64)
        .map(|k| k.wrapping_mul(0x9e37_79b1) & (elems - 1))
        .collect();
    let vals: Vec<u64> = idx.iter().map(|&i| word_of(SEED4, r.lba, i)).collect();
    let mut w = cache_of(r, 1024, None);
    w.bind_lba_range(1, r.lba, 0, NS_BYTES / r.lba as u64, true)
        .expect("bind");
    let st = store_elements(r, &w, true, threads, per, &idx, &vals);
    assert!(st.iter().all(|&s| s == DeviceStatus::Ok));
    let report = w.flush().expect("flush");
    let s = stats(&w);
    assert_eq!((s.counters.errors, s.counters.full), (0, 0), "{s:?}");
    assert!(
        s.counters.writebacks > n as u64 / 2 / 64,
        "{s:?} {report:?}"
    );
    invariants(&w);
    drop(w);
    let mut c = cache_of(r, 1024, None);
    c.bind_lba_range(1, r.lba, 0, NS_BYTES / r.lba as u64, false)
        .expect("bind");
    let (v, st) = read_elements(r, &c, true, threads, per, &idx);
    assert!(st.iter().all(|&s| s == DeviceStatus::Ok));
    assert!(v == vals, "stored elements read back through a new cache");
    let untouched = (0..elems)
        .find(|i| !idx.contains(i))
        .expect("an element nobody stored");
    let probe = vec![untouched; 32];
    let (v, st) = read_elements(r, &c, true, 32, 1, &probe);
    assert_values(r, &probe, &v, &st);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn at_scale_on_the_software_controller() {
    let r = rig(512, 4, 256);
    cpu_prefill(&r, NS_BYTES / 512);
    at_scale(&r);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn at_scale_on_the_gpu_controller_model() {
    let path = image("cache-scale");
    let r = model_rig(&path, 512, MediaKind::Hbm, 8, 256);
    at_scale(&r);
    drop(r);
    let _ = std::fs::remove_file(&path);
}
