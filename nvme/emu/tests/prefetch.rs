//! The prefetch hint: a batch's PRP list pages in one call per region, then its write data in
//! one more; reads served from what was fetched; correct results whatever a region does with
//! the hint.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use nvme::Device;
use nvme_emu::{EmuConfig, MemoryRegion, RegionError, controller_thread_index};
use nvme_spec::NvmOpcode;

const READ: u8 = NvmOpcode::READ.0;
const WRITE: u8 = NvmOpcode::WRITE.0;
const PAGE: usize = 4096;

/// What a region does with the hint.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Hint {
    /// Copies the ranges and serves reads inside them from the copy (as a GPU region serves
    /// them from one bulk transfer); the controller's writes invalidate overlapping copies.
    Fetch,
    /// Ignores it.
    Ignore,
    /// Fails it.
    Fail,
}

/// Prefetch calls: the controller thread that made each, and its ranges.
type Calls = Vec<(Option<usize>, Vec<(u64, usize)>)>;

/// Memory standing in for GPU memory, counting prefetches and reads.
struct CountingRegion {
    bytes: Mutex<Vec<u8>>,
    hint: Hint,
    /// Fetched copies: (offset, bytes).
    fetched: Mutex<Vec<(u64, Vec<u8>)>>,
    /// Every prefetch call's ranges, and the controller thread that made it.
    calls: Mutex<Calls>,
    hits: AtomicU32,
    misses: AtomicU32,
}

impl CountingRegion {
    fn new(len: usize, hint: Hint) -> Arc<Self> {
        Arc::new(Self {
            bytes: Mutex::new(vec![0; len]),
            hint,
            fetched: Mutex::new(Vec::new()),
            calls: Mutex::new(Vec::new()),
            hits: AtomicU32::new(0),
            misses: AtomicU32::new(0),
        })
    }

    fn calls(&self) -> Calls {
        self.calls.lock().unwrap().clone()
    }

    /// (hits, misses) since the last call, and forgets the fetched copies.
    fn take_counts(&self) -> (u32, u32) {
        self.fetched.lock().unwrap().clear();
        self.calls.lock().unwrap().clear();
        (
            self.hits.swap(0, Ordering::Relaxed),
            self.misses.swap(0, Ordering::Relaxed),
        )
    }

    fn host_write(&self, offset: usize, data: &[u8]) {
        self.bytes.lock().unwrap()[offset..offset + data.len()].copy_from_slice(data);
    }

    fn host_read(&self, offset: usize, len: usize) -> Vec<u8> {
        self.bytes.lock().unwrap()[offset..offset + len].to_vec()
    }
}

impl MemoryRegion for CountingRegion {
    fn len(&self) -> usize {
        self.bytes.lock().unwrap().len()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        let fetched = self.fetched.lock().unwrap();
        let end = offset + buf.len() as u64;
        if let Some((at, copy)) = fetched
            .iter()
            .find(|(at, copy)| offset >= *at && end <= at + copy.len() as u64)
        {
            let from = (offset - at) as usize;
            buf.copy_from_slice(&copy[from..from + buf.len()]);
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let m = self.bytes.lock().unwrap();
        buf.copy_from_slice(&m[offset as usize..end as usize]);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let end = offset + data.len() as u64;
        self.fetched
            .lock()
            .unwrap()
            .retain(|(at, copy)| end <= *at || offset >= at + copy.len() as u64);
        let mut m = self.bytes.lock().unwrap();
        m[offset as usize..end as usize].copy_from_slice(data);
        Ok(())
    }

    fn prefetch(&self, ranges: &[(u64, usize)]) -> Result<(), RegionError> {
        self.calls
            .lock()
            .unwrap()
            .push((controller_thread_index(), ranges.to_vec()));
        match self.hint {
            Hint::Fetch => {
                let m = self.bytes.lock().unwrap();
                let mut fetched = self.fetched.lock().unwrap();
                for &(at, len) in ranges {
                    assert!(at as usize + len <= m.len(), "a range outside the region");
                    fetched.push((at, m[at as usize..at as usize + len].to_vec()));
                }
                Ok(())
            }
            Hint::Ignore => Ok(()),
            Hint::Fail => Err(RegionError::new("prefetch refused")),
        }
    }
}

const LISTS: usize = 0;
const DATA: usize = 4 * PAGE;
/// Bytes per command: four pages, so PRP2 is a list of three entries.
const CMD: usize = 4 * PAGE;
const CMDS: usize = 64;
/// Where the read-back batch puts its data.
const READ_DATA: usize = DATA + CMDS * CMD;

/// Submits CMDS commands of four pages in one batch on `q` and waits for them: command i moves
/// 32 blocks at LBA 32 * i, data at `data(i)` in `region` (at `base`), its PRP list (three
/// entries, written here) at `list(i)`.
fn run_batch(
    h: &Host,
    q: &mut QueuePair,
    region: &CountingRegion,
    base: u64,
    opcode: u8,
    list: impl Fn(usize) -> usize,
    data: impl Fn(usize) -> usize,
) {
    for i in 0..CMDS {
        for k in 1..4 {
            let entry = base + (data(i) + k * PAGE) as u64;
            region.host_write(list(i) + (k - 1) * 8, &entry.to_le_bytes());
        }
    }
    for i in 0..CMDS {
        let mut cmd = rw(
            opcode,
            1,
            i as u64 * 32,
            32,
            base + data(i) as u64,
            base + list(i) as u64,
        );
        cmd.cdw0 = cmd.cdw0.with_cid(i as u16);
        q.push(&cmd);
    }
    q.ring(&h.dev);
    for _ in 0..CMDS {
        assert_ok(&q.wait(&h.dev));
    }
}

/// 64 writes of four pages each, data and PRP lists in `region` (at `base`), submitted in one
/// batch on queue 2; then 64 reads of the same blocks into other pages of the region, also
/// in one batch. Returns the region's counts after each batch.
fn write_then_read_batch(
    threads: usize,
    region: &Arc<CountingRegion>,
) -> ((u32, u32), Calls, (u32, u32)) {
    let mut h = Host::enabled(EmuConfig {
        controller_threads: threads,
        max_io_queue_pairs: 4,
        ..small_config(64 * 1024, 512)
    });
    let map = h.dev.address_map().clone();
    let base = map.register_region(region.clone()).unwrap();
    let owner = h.dev.thread_for_cq(2);
    // A completion queue with room for both batches: the thread may take the read batch in
    // with a head doorbell value seen before the host consumed the write batch (it reads the
    // heads, then the tails, and may be descheduled in between), and a smaller queue would
    // then split that batch in two, and its prefetch call with it.
    let mut q = h.create_io_pair(2, 128, 256);
    // Lists 32 bytes apart (three entries each), all in the first page.
    let list = |i: usize| LISTS + i * 32;
    let data = |i: usize| DATA + i * CMD;
    for i in 0..CMDS {
        region.host_write(data(i), &pattern(CMD, i as u64));
    }
    run_batch(&h, &mut q, region, base, WRITE, list, data);
    let write_calls = region.calls();
    for (thread, _) in &write_calls {
        assert_eq!(*thread, Some(owner), "prefetch from the queue's thread");
    }
    let write_counts = region.take_counts();

    // Read back into the region, through new lists.
    let read_list = |i: usize| PAGE + i * 32;
    let read_data = |i: usize| READ_DATA + i * CMD;
    run_batch(&h, &mut q, region, base, READ, read_list, read_data);
    let read_calls = region.calls();
    let read_counts = region.take_counts();
    for i in 0..CMDS {
        assert!(
            region.host_read(read_data(i), CMD) == pattern(CMD, i as u64),
            "command {i}: bytes differ ({:?} hint, {threads} threads)",
            region.hint
        );
    }
    // The device holds the bytes too, read through host memory.
    let buf = h.dev.alloc_dma(CMD).unwrap();
    let list_buf = h.dev.alloc_dma(PAGE).unwrap();
    for k in 1..4 {
        list_buf.write((k - 1) * 8, &buf.device_address(k * PAGE).to_le_bytes());
    }
    for i in [0, 17, CMDS - 1] {
        let cmd = rw(
            READ,
            1,
            i as u64 * 32,
            32,
            buf.device_address(0),
            list_buf.device_address(0),
        );
        assert_ok(&q.run(&h.dev, &cmd));
        let mut back = vec![0u8; CMD];
        buf.read(0, &mut back);
        assert!(back == pattern(CMD, i as u64));
    }
    assert_eq!(h.dev.stats().errors, 0);
    let mut calls = write_calls;
    calls.extend(read_calls);
    (write_counts, calls, read_counts)
}

#[test]
fn a_batch_prefetches_its_list_pages_once_and_its_write_data_once() {
    for threads in [1, 2] {
        let region = CountingRegion::new(READ_DATA + CMDS * CMD, Hint::Fetch);
        let ((hits, misses), calls, (read_hits, read_misses)) =
            write_then_read_batch(threads, &region);
        // Writes: one call with the 64 lists, one with the 64 data ranges (merged pages).
        assert_eq!(calls.len(), 3, "{threads} threads: {calls:?}");
        let lists: Vec<(u64, usize)> = (0..CMDS).map(|i| ((i * 32) as u64, 24)).collect();
        assert_eq!(calls[0].1, lists);
        let data: Vec<(u64, usize)> = (0..CMDS).map(|i| ((DATA + i * CMD) as u64, CMD)).collect();
        assert_eq!(calls[1].1, data);
        // Every read of the region was served from what was fetched: each list twice (the
        // pre-pass walk and the command's), and each command's data once.
        assert_eq!((hits, misses), (3 * CMDS as u32, 0));
        // Reads: one call with the lists; the data goes the other way.
        let read_lists: Vec<(u64, usize)> =
            (0..CMDS).map(|i| ((PAGE + i * 32) as u64, 24)).collect();
        assert_eq!(calls[2].1, read_lists);
        assert_eq!((read_hits, read_misses), (CMDS as u32, 0));
    }
}

#[test]
fn results_do_not_depend_on_the_hint() {
    for hint in [Hint::Ignore, Hint::Fail] {
        for threads in [1, 2] {
            let region = CountingRegion::new(READ_DATA + CMDS * CMD, hint);
            let ((hits, misses), calls, _) = write_then_read_batch(threads, &region);
            assert_eq!(calls.len(), 3, "the hint is given all the same");
            assert_eq!((hits, misses), (0, 3 * CMDS as u32));
        }
    }
}

#[test]
fn chained_list_pages_are_prefetched_level_by_level() {
    // Two writes of 1100 pages each: PRP1, then lists of 511 + chain, 511 + chain, 77.
    const PAGES: usize = 1100;
    let mut h = Host::enabled(EmuConfig {
        mdts: 0,
        controller_threads: 2,
        max_io_queue_pairs: 2,
        ..small_config(2 * PAGES as u64 * 8, 512)
    });
    let lists_at = |cmd: usize, level: usize| (cmd * 3 + level) * PAGE;
    let data_at = |cmd: usize| 6 * PAGE + cmd * PAGES * PAGE;
    let region = CountingRegion::new(data_at(2), Hint::Fetch);
    let base = h.dev.address_map().register_region(region.clone()).unwrap();
    let mut q = h.create_io_pair(2, 8, 8);
    for c in 0..2 {
        let page = |p: usize| base + (data_at(c) + p * PAGE) as u64;
        let mut entries: Vec<u64> = (1..PAGES).map(page).collect();
        for level in 0..3 {
            let n = entries.len().min(511);
            let mut slots: Vec<u64> = entries.drain(..n).collect();
            if !entries.is_empty() {
                slots.push(base + lists_at(c, level + 1) as u64);
            }
            for (i, e) in slots.iter().enumerate() {
                region.host_write(lists_at(c, level) + i * 8, &e.to_le_bytes());
            }
        }
        assert!(entries.is_empty());
        region.host_write(data_at(c), &pattern(PAGES * PAGE, c as u64));
        let mut cmd = rw(
            WRITE,
            1,
            (c * PAGES * 8) as u64,
            (PAGES * 8) as u16,
            page(0),
            base + lists_at(c, 0) as u64,
        );
        cmd.cdw0 = cmd.cdw0.with_cid(c as u16);
        q.push(&cmd);
    }
    q.ring(&h.dev);
    for _ in 0..2 {
        assert_ok(&q.wait(&h.dev));
    }
    let calls = region.calls();
    let level = |l: usize, len: usize| -> Vec<(u64, usize)> {
        (0..2).map(|c| (lists_at(c, l) as u64, len)).collect()
    };
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert_eq!(calls[0].1, level(0, PAGE));
    assert_eq!(calls[1].1, level(1, PAGE));
    assert_eq!(calls[2].1, level(2, 77 * 8));
    let data: Vec<(u64, usize)> = (0..2).map(|c| (data_at(c) as u64, PAGES * PAGE)).collect();
    assert_eq!(calls[3].1, data);
    let (_, misses) = region.take_counts();
    assert_eq!(misses, 0, "every list and data read was prefetched");
    // The bytes reached the device.
    let buf = h.dev.alloc_dma(PAGE).unwrap();
    for c in 0..2 {
        let lba = (c * PAGES * 8 + 7 * PAGES) as u64;
        assert_ok(&q.run(&h.dev, &rw(READ, 1, lba, 8, buf.device_address(0), 0)));
        let mut back = vec![0u8; PAGE];
        buf.read(0, &mut back);
        let expect = pattern(PAGES * PAGE, c as u64);
        assert!(back[..] == expect[7 * PAGES * 512..7 * PAGES * 512 + PAGE]);
    }
}
