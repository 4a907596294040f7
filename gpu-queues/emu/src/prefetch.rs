//! Cold image Reads fed by a prefetch in file order (`GPUNVME_EMU_COLD_READS=prefetch`).
//!
//! A GPU load of a cold image asks the software controller for its chunks spread over a window
//! of the file (each warp claims 32 chunks, ~100 warps: hundreds of MiB), one Read per
//! controller thread at a time. fastsafetensors reads the same disk by direct I/O in file
//! order, 16 requests of 512 KiB in flight, and on the lent H200 that beat every buffered reader
//! (docs/benchmarks.md, 2026-11-29). A [`Prefetch`] reads the way it does: on a
//! [`gpu_queues::QueueTransport::will_read`] hint, reader threads of its own read the hinted
//! ranges of the image a [`BLOCK`] at a time, in the hint's order, by `O_DIRECT` into a bounded
//! pool of host memory, and controller threads copy their Reads' bytes out of it
//! ([`Prefetch::serve`]) into their staging memory, waiting (bounded) for a block on its way.
//!
//! The pool holds [`POOL_BYTES`] at most: block `i` goes to slot `i % slots`, once the block
//! there before it was consumed (as many of its bytes served as the hint covers). Blocks not
//! all in the page cache are read; the others are left to the page cache (`Skipped`). When a
//! reader waits for a slot whose block is not consumed while a controller thread waits for a
//! block not yet read (bytes nobody asks for, a file's header; or a Read queued behind the
//! waiting thread), the old block is evicted after `STUCK` (5 ms): the pool can never hold up the
//! Reads. Whatever a Read does not get from the pool (evicted, failed, past the file's end,
//! outside the hint, written since) it reads itself ([`Prefetch::serve`] says how much it got).
//!
//! Consistency: a block carries the image's write count ([`nvme_emu::MediaWrites`]) from
//! before its read, and is served only while the count is unchanged: a Read submitted after a
//! Write completed (its count was raised before its completion) never sees data older than the
//! Write. A direct read of a range with dirty pages returns them (the kernel writes them back
//! first).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use crate::os::range_cached;
use memmap2::MmapMut;
use nvme_emu::MediaWrites;

/// Bytes of the image one reader reads at a time (and the alignment of blocks in the file).
pub const BLOCK: usize = 1 << 20;

/// Reader threads by default (`GPUNVME_EMU_PREFETCH_READERS`, 1 to 64): fastsafetensors' 16.
pub const READERS: usize = 16;

/// The most host memory a prefetch holds: 1 GiB, more than the window a GPU load spreads its
/// Reads over (about 110 warps of 32 chunks of 128 KiB on the default queues), so the block a
/// waiting Read needs always has a slot to go to.
pub const POOL_BYTES: usize = 1 << 30;

/// How long a controller thread waits for one block before reading its bytes itself.
const WAIT: Duration = Duration::from_secs(5);

/// How long a reader waits for a slot held by a block not all consumed, while a Read waits for
/// a block not read yet, before evicting it.
const STUCK: Duration = Duration::from_millis(5);

/// `GPUNVME_EMU_PREFETCH_READERS=N`: reader threads of a prefetch.
pub const READERS_ENV: &str = gpunvme_settings::EMU_PREFETCH_READERS.name;

/// The reader count `GPUNVME_EMU_PREFETCH_READERS` asks for (unset: [`READERS`]).
pub fn readers_from_env() -> Result<usize, gpu_queues::GpuError> {
    readers_from(gpunvme_settings::EMU_PREFETCH_READERS.value().as_deref())
}

fn readers_from(v: Option<&str>) -> Result<usize, gpu_queues::GpuError> {
    match v.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(READERS),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=64).contains(&n) => Ok(n),
            _ => Err(gpu_queues::GpuError::InvalidArgument(format!(
                "{READERS_ENV}={v}: a reader count from 1 to 64"
            ))),
        },
    }
}

/// Where a block of the hint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Not taken by a reader yet.
    Pending,
    /// Taken by a reader: its residency checked, then a slot awaited.
    Claimed,
    /// Being read into its slot.
    Reading,
    /// In its slot.
    Ready,
    /// In the page cache when its turn came: not read (Reads use the page cache).
    Skipped,
    /// Its read failed, or the prefetch stopped before it.
    Failed,
    /// Its slot went to a later block.
    Evicted,
}

/// A block of the image the hint covers.
#[derive(Debug)]
struct Block {
    /// Its offset in the image (a multiple of [`BLOCK`]).
    at: u64,
    /// Bytes of it the hint covers: served that many, its slot is free.
    expected: u64,
}

/// What the scheduling lock guards.
struct State {
    /// The next block for a reader.
    next: usize,
    phase: Vec<Phase>,
    /// Bytes of each block served.
    consumed: Vec<u64>,
    /// The block in each slot (reading or ready).
    holder: Vec<Option<usize>>,
    /// Controller threads waiting for a block no reader has started.
    waiting: usize,
    stop: bool,
    /// Counters (logged when the prefetch ends).
    read_bytes: u64,
    served_bytes: u64,
    evicted: u64,
}

/// A slot's memory and what is in it.
struct SlotData {
    /// The block its bytes are (`None`: nothing yet, or being read).
    block: Option<usize>,
    /// Bytes of the block read (less than [`BLOCK`] at the file's end).
    len: usize,
    /// The image's write count from before the read.
    writes: u64,
    mem: Option<MmapMut>,
}

/// A prefetch at work: see the module's documentation.
pub struct Prefetch {
    /// The image file (device, inode).
    key: (u64, u64),
    /// The image opened for direct reads.
    direct: File,
    writes: MediaWrites,
    blocks: Vec<Block>,
    /// Block number (offset / BLOCK) to index in `blocks`.
    index: HashMap<u64, usize>,
    slots: Vec<RwLock<SlotData>>,
    state: Mutex<State>,
    /// Signalled whenever a block's phase changes or a block is consumed.
    changed: Condvar,
}

impl std::fmt::Debug for Prefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetch")
            .field("key", &self.key)
            .field("blocks", &self.blocks.len())
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// A running prefetch; dropping it stops the readers (each after the block in hand) and lets
/// the pool go once they have.
pub struct Running {
    prefetch: Arc<Prefetch>,
}

impl Running {
    /// The prefetch (to register with the controller's Read path).
    pub fn prefetch(&self) -> &Arc<Prefetch> {
        &self.prefetch
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.prefetch.stop();
    }
}

impl Prefetch {
    /// Starts reading `ranges` (byte ranges of the image, in the order Reads will come) of the
    /// image `direct` (opened with `O_DIRECT`; `image` is the same file, for its identity) on
    /// `readers` threads into a pool of at most `pool_bytes`. `writes` counts the image's
    /// writes. Errors: no thread could be started.
    pub fn start(
        image: &File,
        direct: File,
        writes: MediaWrites,
        ranges: &[(u64, u64)],
        readers: usize,
        pool_bytes: usize,
    ) -> std::io::Result<Running> {
        let meta = image.metadata()?;
        let mut blocks: Vec<Block> = Vec::new();
        let mut index = HashMap::new();
        for &(start, len) in ranges {
            let end = start.saturating_add(len);
            let mut at = start;
            while at < end {
                let no = at / BLOCK as u64;
                let block_end = (no + 1) * BLOCK as u64;
                let n = end.min(block_end) - at;
                let i = *index.entry(no).or_insert_with(|| {
                    blocks.push(Block {
                        at: no * BLOCK as u64,
                        expected: 0,
                    });
                    blocks.len() - 1
                });
                blocks[i].expected += n;
                at += n;
            }
        }
        let nslots = (pool_bytes / BLOCK).clamp(1, blocks.len().max(1));
        let prefetch = Arc::new(Prefetch {
            key: (meta.dev(), meta.ino()),
            direct,
            writes,
            index,
            slots: (0..nslots)
                .map(|_| {
                    RwLock::new(SlotData {
                        block: None,
                        len: 0,
                        writes: 0,
                        mem: None,
                    })
                })
                .collect(),
            state: Mutex::new(State {
                next: 0,
                phase: vec![Phase::Pending; blocks.len()],
                consumed: vec![0; blocks.len()],
                holder: vec![None; nslots],
                waiting: 0,
                stop: false,
                read_bytes: 0,
                served_bytes: 0,
                evicted: 0,
            }),
            changed: Condvar::new(),
            blocks,
        });
        let mut started = 0;
        let mut first_error = None;
        for _ in 0..readers.clamp(1, prefetch.blocks.len().max(1)) {
            let p = prefetch.clone();
            match std::thread::Builder::new()
                .name("gpunvme-prefetch".into())
                .spawn(move || p.read_blocks())
            {
                Ok(_) => started += 1,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if started == 0 {
            prefetch.stop();
            return Err(first_error.unwrap_or_else(|| std::io::Error::other("no reader")));
        }
        Ok(Running { prefetch })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The image file this prefetch reads: (device, inode).
    pub fn file_id(&self) -> (u64, u64) {
        self.key
    }

    /// Whether the byte at `offset` of the image is in a block this prefetch reads or read
    /// (not one left to the page cache): its Reads should [`serve`](Self::serve) from it.
    pub fn covers(&self, offset: u64) -> bool {
        self.index
            .get(&(offset / BLOCK as u64))
            .is_some_and(|&i| self.lock().phase[i] != Phase::Skipped)
    }

    /// Stops the readers (each after the block in hand); Reads waiting for blocks not read get
    /// none.
    fn stop(&self) {
        let mut st = self.lock();
        if !st.stop {
            st.stop = true;
            tracing::debug!(
                read = st.read_bytes,
                served = st.served_bytes,
                evicted = st.evicted,
                blocks = self.blocks.len(),
                "image prefetch ended"
            );
        }
        drop(st);
        self.changed.notify_all();
    }

    /// Hands bytes `offset..offset + len` of the image to `put(done, bytes)` (bytes
    /// `offset + done..` in order) out of the pool, waiting (at most `WAIT`, 5 s, per block) for
    /// blocks being read or about to be. Returns how many bytes from the start were handed
    /// over; the caller reads the rest itself (a block evicted, failed, left to the page cache,
    /// written since, past the file's end, or not in the hint).
    pub fn serve(&self, offset: u64, len: usize, mut put: impl FnMut(usize, &[u8])) -> usize {
        let mut done = 0;
        while done < len {
            let at = offset + done as u64;
            let Some(&i) = self.index.get(&(at / BLOCK as u64)) else {
                break;
            };
            let within = (at - self.blocks[i].at) as usize;
            let n = (len - done).min(BLOCK - within);
            if !self.await_block(i) {
                break;
            }
            let slot = self.slots[i % self.slots.len()]
                .read()
                .unwrap_or_else(|e| e.into_inner());
            let fresh = slot.block == Some(i)
                && slot.len >= within + n
                && slot.writes == self.writes.count();
            let Some(mem) = slot.mem.as_ref().filter(|_| fresh) else {
                break;
            };
            put(done, &mem[within..within + n]);
            drop(slot);
            let mut st = self.lock();
            st.consumed[i] += n as u64;
            st.served_bytes += n as u64;
            let freed = st.consumed[i] >= self.blocks[i].expected;
            drop(st);
            if freed {
                self.changed.notify_all();
            }
            done += n;
        }
        done
    }

    /// Waits until block `i` is in its slot (true) or will not be (false), at most `WAIT`.
    fn await_block(&self, i: usize) -> bool {
        let deadline = Instant::now() + WAIT;
        let mut st = self.lock();
        let mut counted = false;
        let ready = loop {
            let phase = st.phase[i];
            let unstarted = matches!(phase, Phase::Pending | Phase::Claimed);
            match phase {
                Phase::Ready => break true,
                Phase::Skipped | Phase::Failed | Phase::Evicted => break false,
                Phase::Pending | Phase::Claimed | Phase::Reading => {}
            }
            if st.stop {
                break false;
            }
            if unstarted != counted {
                // Readers evict stuck slots only while some Read waits for an unread block.
                if unstarted {
                    st.waiting += 1;
                } else {
                    st.waiting -= 1;
                }
                counted = unstarted;
            }
            let now = Instant::now();
            if now >= deadline {
                tracing::debug!(block = i, "prefetch: a Read gave up waiting for its block");
                break false;
            }
            st = self
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        if counted {
            st.waiting -= 1;
        }
        ready
    }

    /// A reader thread: takes the next block until none is left or the prefetch stops.
    fn read_blocks(&self) {
        loop {
            let mut st = self.lock();
            if st.stop || st.next >= self.blocks.len() {
                return;
            }
            let i = st.next;
            st.next += 1;
            st.phase[i] = Phase::Claimed;
            drop(st);
            let block = &self.blocks[i];
            // A block wholly in the page cache is left there (a warm or partly warm image).
            if range_cached(self.direct.as_fd(), block.at, BLOCK as u64).unwrap_or(false) {
                self.set_phase(i, Phase::Skipped);
                continue;
            }
            let Some(slot) = self.take_slot(i) else {
                self.set_phase(i, Phase::Failed);
                return;
            };
            let mut data = self.slots[slot].write().unwrap_or_else(|e| e.into_inner());
            data.block = None;
            let writes = self.writes.count();
            let read = match data.mem.as_mut() {
                Some(mem) => Ok(mem),
                None => MmapMut::map_anon(BLOCK).map(|m| data.mem.insert(m)),
            }
            .and_then(|mem| read_full(&self.direct, mem, block.at));
            let (phase, len) = match read {
                Ok(len) => {
                    data.block = Some(i);
                    data.len = len;
                    data.writes = writes;
                    (Phase::Ready, len)
                }
                Err(e) => {
                    tracing::debug!(at = block.at, "prefetch read failed: {e}");
                    (Phase::Failed, 0)
                }
            };
            drop(data);
            let mut st = self.lock();
            st.read_bytes += len as u64;
            st.phase[i] = phase;
            if phase == Phase::Failed {
                st.holder[slot] = None;
            }
            drop(st);
            self.changed.notify_all();
        }
    }

    fn set_phase(&self, i: usize, phase: Phase) {
        self.lock().phase[i] = phase;
        self.changed.notify_all();
    }

    /// Waits for block `i`'s slot to be free (its block consumed, or evicted when stuck) and
    /// takes it; `None` when the prefetch stopped.
    fn take_slot(&self, i: usize) -> Option<usize> {
        let s = i % self.slots.len();
        let mut st = self.lock();
        let mut stuck_since: Option<Instant> = None;
        loop {
            if st.stop {
                return None;
            }
            let free = match st.holder[s] {
                None => true,
                Some(j) => {
                    let consumed = st.consumed[j] >= self.blocks[j].expected;
                    match st.phase[j] {
                        Phase::Ready if consumed => true,
                        Phase::Ready if st.waiting > 0 => {
                            let since = *stuck_since.get_or_insert_with(Instant::now);
                            if since.elapsed() >= STUCK {
                                st.phase[j] = Phase::Evicted;
                                st.evicted += 1;
                                true
                            } else {
                                false
                            }
                        }
                        Phase::Reading | Phase::Ready => {
                            stuck_since = None;
                            false
                        }
                        _ => true,
                    }
                }
            };
            if free {
                st.holder[s] = Some(i);
                st.phase[i] = Phase::Reading;
                return Some(i % self.slots.len());
            }
            st = self
                .changed
                .wait_timeout(st, STUCK)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Reads `mem.len()` bytes of `file` at `offset` (fewer at its end), retrying short reads.
fn read_full(file: &File, mem: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < mem.len() {
        match file.read_at(&mut mem[done..], offset + done as u64) {
            Ok(0) => break,
            // A direct read ends at the file's end, a multiple of the alignment or not; a
            // short read in between is retried from where it ended (aligned: the device
            // returns whole blocks).
            Ok(n) if n % crate::os::DIRECT_ALIGN != 0 => {
                done += n;
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::{advise_dontneed, reopen_direct};
    use std::io::Write;

    /// A file of `len` patterned bytes on a disk file system (not tmpfs: direct I/O; the system's
    /// temporary directory, else the workspace's `target`), written back and dropped from the
    /// page cache; `None` where that cannot be done here.
    fn cold_file(name: &str, len: usize) -> Option<(std::path::PathBuf, Vec<u8>)> {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
        for dir in [std::env::temp_dir(), target] {
            let path = dir.join(format!("gpunvme-prefetch-{name}-{}", std::process::id()));
            let made = (|| {
                let mut f = File::create(&path).ok()?;
                f.write_all(&bytes).ok()?;
                f.sync_all().ok()?;
                advise_dontneed(f.as_fd(), 0, len as u64).ok()?;
                let direct = reopen_direct(&f).ok()?;
                let mut probe = MmapMut::map_anon(4096).ok()?;
                direct.read_at(&mut probe, 0).ok()
            })();
            if made.is_some() {
                return Some((path, bytes));
            }
            let _ = std::fs::remove_file(&path);
        }
        None
    }

    fn start(
        path: &std::path::Path,
        ranges: &[(u64, u64)],
        readers: usize,
        pool: usize,
        writes: &MediaWrites,
    ) -> (File, Running) {
        let f = File::open(path).unwrap();
        let direct = reopen_direct(&f).unwrap();
        let r = Prefetch::start(&f, direct, writes.clone(), ranges, readers, pool).unwrap();
        (f, r)
    }

    /// Serves `len` bytes at `offset`, reading what the pool did not hand over from `f`.
    fn read(p: &Prefetch, f: &File, offset: u64, len: usize) -> (Vec<u8>, usize) {
        let mut out = vec![0u8; len];
        let got = p.serve(offset, len, |d, b| out[d..d + b.len()].copy_from_slice(b));
        f.read_exact_at(&mut out[got..], offset + got as u64)
            .unwrap();
        (out, got)
    }

    #[test]
    fn reads_spread_over_the_hint_get_the_image_bytes_from_the_pool() {
        let len = 6 * BLOCK + 12345;
        let Some((path, bytes)) = cold_file("spread", len) else {
            eprintln!("skipped: no direct I/O here");
            return;
        };
        let writes = MediaWrites::default();
        // A pool of 3 blocks for 7: slots are reused as Reads consume them.
        let (f, run) = start(&path, &[(0, len as u64)], 4, 3 * BLOCK, &writes);
        let p = run.prefetch().clone();
        let meta = f.metadata().unwrap();
        assert_eq!(p.file_id(), (meta.dev(), meta.ino()));
        assert!(p.covers(0) && p.covers(len as u64 - 1));
        // 128 KiB Reads, taken by 4 threads from a counter: out of order within a window.
        let chunk = 128 << 10;
        let next = std::sync::atomic::AtomicUsize::new(0);
        let served = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let at = k * chunk;
                        if at >= len {
                            return;
                        }
                        let n = chunk.min(len - at);
                        let (got, from_pool) = read(&p, &f, at as u64, n);
                        assert!(got == bytes[at..at + n], "bytes at {at}");
                        served.fetch_add(from_pool, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        let st = p.lock();
        assert_eq!(
            st.read_bytes, len as u64,
            "every byte read once, by direct I/O"
        );
        let served = served.into_inner();
        assert_eq!(st.served_bytes, served as u64);
        // A block is evicted only when a reader waited 5 ms for its slot while a Read waited
        // for a later block: a thread of this test descheduled that long on a busy machine.
        if st.evicted == 0 {
            assert_eq!(served, len, "every Read served from the pool");
        } else {
            assert!(served > 0, "some Reads served from the pool");
        }
        drop(st);
        drop(run);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_write_makes_the_pool_stale_and_bytes_nobody_reads_are_evicted_not_waited_on() {
        let len = 4 * BLOCK;
        let Some((path, bytes)) = cold_file("stale", len) else {
            eprintln!("skipped: no direct I/O here");
            return;
        };
        let writes = MediaWrites::default();
        // One slot: block 1 can only be read once block 0 goes, and nobody reads block 0.
        let (f, run) = start(&path, &[(0, len as u64)], 2, BLOCK, &writes);
        let p = run.prefetch().clone();
        let (got, from_pool) = read(&p, &f, BLOCK as u64 + 4096, 8192);
        assert!(got == bytes[BLOCK + 4096..BLOCK + 12288]);
        assert_eq!(from_pool, 8192, "block 1 read once block 0 was evicted");
        assert!(p.lock().evicted >= 1);
        // A Write counted since: the pool's copy is not served.
        writes.record();
        let (got, from_pool) = read(&p, &f, BLOCK as u64, 4096);
        assert!(got == bytes[BLOCK..BLOCK + 4096]);
        assert_eq!(from_pool, 0, "written since: read by the caller");
        // Outside the hint: nothing from the pool.
        assert_eq!(p.serve(len as u64 + 4096, 10, |_, _| ()), 0);
        drop(run);
        // Stopped: a Read waiting for an unread block gets nothing, at once.
        let t = Instant::now();
        assert_eq!(p.serve(3 * BLOCK as u64, 10, |_, _| ()), 0);
        assert!(t.elapsed() < WAIT, "no wait once stopped");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn blocks_in_the_page_cache_are_left_to_it() {
        let len = 2 * BLOCK;
        let Some((path, bytes)) = cold_file("warm", len) else {
            eprintln!("skipped: no direct I/O here");
            return;
        };
        // Block 1 made resident by a buffered read.
        let f = File::open(&path).unwrap();
        let mut buf = vec![0u8; BLOCK];
        f.read_exact_at(&mut buf, BLOCK as u64).unwrap();
        if !range_cached(f.as_fd(), BLOCK as u64, BLOCK as u64).unwrap_or(false) {
            eprintln!("skipped: the page cache did not keep the block");
            let _ = std::fs::remove_file(&path);
            return;
        }
        let writes = MediaWrites::default();
        let (f, run) = start(&path, &[(0, len as u64)], 1, 4 * BLOCK, &writes);
        let p = run.prefetch().clone();
        let (got, from_pool) = read(&p, &f, 0, 4096);
        assert!(got == bytes[..4096]);
        assert_eq!(from_pool, 4096);
        // Block 1's phase is settled once a Read of it returns; it is the page cache's.
        let (got, from_pool) = read(&p, &f, BLOCK as u64, 4096);
        assert!(got == bytes[BLOCK..BLOCK + 4096]);
        assert_eq!(from_pool, 0);
        assert!(!p.covers(BLOCK as u64));
        drop(run);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn reader_counts_parse_and_bad_ones_are_refused() {
        assert_eq!(readers_from(None).unwrap(), READERS);
        assert_eq!(readers_from(Some(" 8 ")).unwrap(), 8);
        for bad in ["0", "65", "many", "-1"] {
            let e = readers_from(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("1 to 64"), "{bad}: {e}");
        }
    }
}
