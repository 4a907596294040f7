//! Crash consistency: record every device write and flush of a workload, then rebuild the
//! medium as a power cut after each prefix of that log would leave it (also with the next write
//! torn, and with the writes since the last flush reordered), mount, fsck, and check that the
//! file system is exactly one of the synced states, with file data intact.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use blockfs::{
    BlockDevice, CrashDevice, CreateOptions, Error, FileSystem, FsckOptions, LoggedOp, MemDevice,
    MkfsOptions, OpenMode, fsck,
};
use common::*;
use rand::Rng;
use rand::rngs::SmallRng;

/// The namespace and contents after a completed sync.
struct Snapshot {
    /// Log length when the sync returned.
    log_end: usize,
    /// Generations the sync committed with these contents: one, or two when it freed file
    /// blocks (the second commit only makes them free).
    generations: std::ops::RangeInclusive<u64>,
    /// name -> (file id, contents)
    files: BTreeMap<String, (u64, Vec<u8>)>,
}

/// A write (or zero-fill) issued by the workload; its device writes start at `log_start`.
struct WriteEvent {
    log_start: usize,
    file_id: u64,
    offset: u64,
    data: Vec<u8>,
}

struct Workload {
    dev: Arc<CrashDevice>,
    fs: FileSystem,
    model: BTreeMap<String, Vec<u8>>,
    snapshots: Vec<Snapshot>,
    events: Vec<WriteEvent>,
    rng: SmallRng,
}

impl Workload {
    fn id(&self, name: &str) -> u64 {
        self.fs.stat(name).unwrap().file_id
    }

    fn create(&mut self, name: &str, hint: u64) {
        self.fs
            .create(name, &CreateOptions { size_hint: hint })
            .unwrap();
        self.model.insert(name.into(), Vec::new());
    }

    fn write(&mut self, name: &str, offset: u64, len: usize) {
        let data = random_bytes(&mut self.rng, len);
        let id = self.id(name);
        let cur = self.model[name].len() as u64;
        let log_start = self.dev.log_len();
        if offset > cur {
            self.events.push(WriteEvent {
                log_start,
                file_id: id,
                offset: cur,
                data: vec![0; (offset - cur) as usize],
            });
        }
        self.events.push(WriteEvent {
            log_start,
            file_id: id,
            offset,
            data: data.clone(),
        });
        self.fs
            .open(name, OpenMode::ReadWrite)
            .unwrap()
            .write_at(offset, &data)
            .unwrap();
        let m = self.model.get_mut(name).unwrap();
        let end = offset as usize + len;
        if m.len() < end {
            m.resize(end, 0);
        }
        m[offset as usize..end].copy_from_slice(&data);
    }

    fn set_len(&mut self, name: &str, len: u64) {
        let cur = self.model[name].len() as u64;
        if len > cur {
            let e = WriteEvent {
                log_start: self.dev.log_len(),
                file_id: self.id(name),
                offset: cur,
                data: vec![0; (len - cur) as usize],
            };
            self.events.push(e);
        }
        self.fs
            .open(name, OpenMode::ReadWrite)
            .unwrap()
            .set_len(len)
            .unwrap();
        self.model.get_mut(name).unwrap().resize(len as usize, 0);
    }

    /// A device write through a reservation (as a GPU kernel writes through its table, here
    /// straight to the device), committed as length `new_len` without zero fill. `offset` is
    /// at most the current length.
    fn device_write(&mut self, name: &str, offset: u64, len: usize, new_len: u64) {
        let data = random_bytes(&mut self.rng, len);
        let id = self.id(name);
        let f = self.fs.open(name, OpenMode::ReadWrite).unwrap();
        let w = f
            .reserve_device_write(new_len.max(offset + len as u64))
            .unwrap();
        self.events.push(WriteEvent {
            log_start: self.dev.log_len(),
            file_id: id,
            offset,
            data: data.clone(),
        });
        device_write(self.dev.as_ref(), w.table(), offset, &data);
        w.commit(new_len).unwrap();
        let m = self.model.get_mut(name).unwrap();
        assert!(offset <= m.len() as u64);
        let end = offset as usize + len;
        if m.len() < end {
            m.resize(end, 0);
        }
        m[offset as usize..end].copy_from_slice(&data);
        m.resize(new_len as usize, 0);
    }

    fn remove(&mut self, name: &str) {
        self.fs.remove(name).unwrap();
        self.model.remove(name);
    }

    fn rename(&mut self, from: &str, to: &str) {
        self.fs.rename(from, to).unwrap();
        let v = self.model.remove(from).unwrap();
        self.model.insert(to.into(), v);
    }

    fn sync(&mut self) {
        let first = self.fs.generation() + 1;
        self.fs.sync().unwrap();
        self.snapshot_from(first);
    }

    fn snapshot(&mut self) {
        self.snapshot_from(self.fs.generation());
    }

    fn snapshot_from(&mut self, first: u64) {
        let files = self
            .model
            .iter()
            .map(|(n, c)| (n.clone(), (self.id(n), c.clone())))
            .collect();
        self.snapshots.push(Snapshot {
            log_end: self.dev.log_len(),
            generations: first.min(self.fs.generation())..=self.fs.generation(),
            files,
        });
    }
}

/// Names of growing length, so chunks fill unevenly.
fn many(i: usize) -> String {
    format!("many/{i:02}/f{}", "x".repeat(i * 7))
}

/// Runs the workload and returns the base image, the log, snapshots and write events.
fn record(lba_size: u32, seed: u64) -> (MemDevice, Vec<LoggedOp>, Vec<Snapshot>, Vec<WriteEvent>) {
    let dev = Arc::new(CrashDevice::new(MemDevice::new(
        lba_size,
        (3u64 << 20) / lba_size as u64,
    )));
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let mut w = Workload {
        dev: dev.clone(),
        fs,
        model: BTreeMap::new(),
        snapshots: Vec::new(),
        events: Vec::new(),
        rng: rng(seed),
    };
    // Starting state, before recording.
    w.create("keep/a", 0);
    w.write("keep/a", 0, 10_000);
    w.create("keep/b", 0);
    w.write("keep/b", 0, 5000);
    w.fs.sync().unwrap();
    let base = dev.start_recording();
    w.snapshot();

    // 1. create with and without a hint, appends.
    w.create("w/one", 64 << 10);
    w.write("w/one", 0, 40_000);
    w.create("w/two", 0);
    for i in 0..3 {
        w.write("w/two", i * 3000, 3000);
    }
    w.sync();
    // 2. in-place overwrite of synced data; extend into preallocation.
    w.write("keep/a", 1000, 2000);
    w.write("w/one", 40_000, 9000);
    w.sync();
    // 3. rename, remove, many small files (several chunks).
    w.rename("w/two", "w/renamed");
    w.remove("keep/b");
    for i in 0..24 {
        let n = many(i);
        w.create(&n, 0);
        w.write(&n, 0, 100 * i + 1);
    }
    w.sync();
    // 4. grow with zero fill, shrink.
    w.set_len("w/one", 100_000);
    w.set_len("keep/a", 3000);
    w.sync();
    // 5. removals free blocks that later allocations may reuse; a write past the end.
    for i in (0..24).step_by(2) {
        let n = many(i);
        w.remove(&n);
    }
    w.create("big", 256 << 10);
    w.write("big", 0, 200_000);
    w.write("keep/a", 5000, 100);
    w.sync();
    // 6. overwrite in the middle, rename across prefixes, truncate to zero, grow again.
    w.write("big", 50_000, 30_000);
    w.rename(&many(3), "moved/3");
    w.set_len("w/renamed", 0);
    w.write("w/renamed", 0, 7000);
    w.sync();
    // 7. churn: files created, grown past their preallocation and removed in one interval.
    for round in 0..3 {
        let n = format!("churn/{round}");
        w.create(&n, 8192);
        w.write(&n, 0, 30_000);
        w.sync();
        w.remove(&n);
        w.write("big", 200_000 + round * 10_000, 10_000);
        w.sync();
    }
    // 8. device-write commits: into a preallocation, an append past the allocation (the
    // partial LBA at the old end read-modify-written), an in-place rewrite that shrinks.
    w.create("gpu/ckpt", 64 << 10);
    w.device_write("gpu/ckpt", 0, 50_000, 50_000);
    w.sync();
    let big = w.model["big"].len() as u64;
    w.device_write("big", big, 40_000, big + 40_000);
    w.sync();
    w.device_write("gpu/ckpt", 0, 20_000, 20_000);
    w.sync();
    // 9. changes never synced.
    w.create("tail", 0);
    w.write("tail", 0, 20_000);
    w.remove("w/one");
    w.write("moved/3", 0, 10);
    let log = dev.take_log();
    (base, log, w.snapshots, w.events)
}

/// Mounts a crash image and checks every invariant. `applied` is how far into the log writes
/// may have reached.
fn check_image(
    img: MemDevice,
    applied: usize,
    snaps: &[Snapshot],
    events: &[WriteEvent],
    extra: bool,
) -> Result<(), String> {
    let dev = Arc::new(img);
    let fs = FileSystem::mount(dev.clone()).map_err(|e| format!("mount: {e}"))?;
    let g = fs.generation();
    let s = snaps
        .iter()
        .rposition(|sn| sn.log_end <= applied)
        .expect("snapshot 0 has log_end 0");
    let snap = [s, s + 1]
        .into_iter()
        .filter_map(|i| snaps.get(i))
        .find(|sn| sn.generations.contains(&g))
        .ok_or_else(|| {
            format!(
                "mounted generation {g}, but the last completed sync is generation {:?}",
                snaps[s].generations
            )
        })?;
    let listed: Vec<String> = fs.list("").into_iter().map(|st| st.name).collect();
    let expected: Vec<String> = snap.files.keys().cloned().collect();
    if listed != expected {
        return Err(format!(
            "generation {g}: files {listed:?}, expected {expected:?}"
        ));
    }
    for (name, (id, content)) in &snap.files {
        let st = fs.stat(name).unwrap();
        if st.file_id != *id || st.size != content.len() as u64 {
            return Err(format!(
                "{name}: id {} size {}, expected id {id} size {}",
                st.file_id,
                st.size,
                content.len()
            ));
        }
        let actual = read_all(&fs, name);
        let later: Vec<&WriteEvent> = events
            .iter()
            .filter(|e| e.file_id == *id && e.log_start >= snap.log_end && e.log_start <= applied)
            .collect();
        for (i, (&a, &b)) in actual.iter().zip(content).enumerate() {
            let i = i as u64;
            let ok = a == b
                || later.iter().any(|e| {
                    i >= e.offset
                        && i < e.offset + e.data.len() as u64
                        && e.data[(i - e.offset) as usize] == a
                });
            if !ok {
                return Err(format!(
                    "{name} byte {i}: {a:#04x}, synced {b:#04x}, and no later write put it there"
                ));
            }
        }
    }
    drop(fs);
    let report = fsck(dev.clone(), &FsckOptions::default()).map_err(|e| format!("fsck: {e}"))?;
    if !report.problems.is_empty() || !report.older_problems.is_empty() {
        return Err(format!(
            "fsck: {:?} / older generation: {:?}",
            report.problems, report.older_problems
        ));
    }
    if extra {
        // Repair has nothing to do, and the file system keeps working from here.
        let report = fsck(dev.clone(), &FsckOptions { repair: true }).unwrap();
        if !report.repairs.is_empty() {
            return Err(format!(
                "repair changed a clean file system: {:?}",
                report.repairs
            ));
        }
        let fs = FileSystem::mount(dev.clone()).map_err(|e| format!("remount: {e}"))?;
        let f = fs
            .create("after-crash", &CreateOptions::default())
            .map_err(|e| e.to_string())?;
        f.write_at(0, &[0x5A; 12_345]).map_err(|e| e.to_string())?;
        fs.sync().map_err(|e| e.to_string())?;
        drop((f, fs));
        let fs =
            FileSystem::mount(dev.clone()).map_err(|e| format!("mount after more work: {e}"))?;
        if read_all(&fs, "after-crash") != vec![0x5A; 12_345] {
            return Err("file written after the crash did not survive".into());
        }
        drop(fs);
        let report = fsck(dev, &FsckOptions::default()).unwrap();
        if !report.is_clean() {
            return Err(format!("fsck after more work: {:?}", report.problems));
        }
    }
    Ok(())
}

fn run(lba_size: u32, seed: u64) -> (usize, usize, usize) {
    let (base, log, snaps, events) = record(lba_size, seed);
    let mut r = rng(seed ^ 0xC0FFEE);
    let (mut prefixes, mut torn, mut reordered) = (0, 0, 0);
    let mut failures = Vec::new();
    let cur = base.duplicate();
    let mut last_flush: Option<usize> = None;
    let at_flush = base.duplicate(); // image with every op up to and including the last flush
    for k in 0..=log.len() {
        // Power cut after the first k operations.
        prefixes += 1;
        if let Err(e) = check_image(cur.duplicate(), k, &snaps, &events, k % 10 == 0) {
            failures.push(format!("prefix {k}: {e}"));
        }
        if let Some(op) = log.get(k) {
            let lbas = op.lba_len(lba_size);
            // The next write torn: a random nonempty proper subset of its LBAs reached the medium.
            for _ in 0..if lbas > 1 { 3 } else { 0 } {
                torn += 1;
                let img = cur.duplicate();
                let keep: Vec<bool> = loop {
                    let v: Vec<bool> = (0..lbas).map(|_| r.random_bool(0.5)).collect();
                    if v.iter().any(|&b| b) && !v.iter().all(|&b| b) {
                        break v;
                    }
                };
                CrashDevice::apply_torn(&img, op, |i| keep[i as usize]);
                if let Err(e) = check_image(img, k, &snaps, &events, false) {
                    failures.push(format!("prefix {k} + torn op {k}: {e}"));
                }
            }
            // The writes since the last flush in any order: a random subset of them.
            let since = last_flush.map_or(0, |f| f + 1);
            for _ in 0..if k > since + 1 { 3 } else { 0 } {
                reordered += 1;
                let img = at_flush.duplicate();
                for op in &log[since..k] {
                    if r.random_bool(0.5) {
                        CrashDevice::apply(&img, op);
                    }
                }
                if let Err(e) = check_image(img, k, &snaps, &events, false) {
                    failures.push(format!(
                        "flush at {since:?}, random subset of ops {since}..{k}: {e}"
                    ));
                }
            }
            CrashDevice::apply(&cur, op);
            if *op == LoggedOp::Flush {
                for o in &log[last_flush.map_or(0, |f| f + 1)..=k] {
                    CrashDevice::apply(&at_flush, o);
                }
                last_flush = Some(k);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of the crash points failed:\n{}",
        failures.len(),
        failures
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(cur.to_image(), CrashDevice::replay(&base, &log).to_image());
    (prefixes, torn, reordered)
}

#[test]
fn every_crash_point_mounts_a_synced_state() {
    let mut total = 0;
    for (lba, seed) in [(512u32, 1u64), (4096, 2)] {
        let (p, t, r) = run(lba, seed);
        println!(
            "crash points with {lba}-byte LBAs: {p} log prefixes + {t} torn writes + {r} reordered-cache states = {}",
            p + t + r
        );
        assert!(
            p > 100 && t > 30 && r > 100,
            "workload too small: {p} {t} {r}"
        );
        total += p + t + r;
    }
    println!(
        "crash-consistency: {total} crash points tried, all mounted a synced state with fsck clean"
    );
}

#[test]
fn a_crash_during_mkfs_leaves_no_file_system_or_an_empty_one() {
    let dev = Arc::new(CrashDevice::new(MemDevice::new(512, 4096)));
    // An old blockfs with files, then mkfs over it.
    {
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        put(&fs, "old", b"old data");
        fs.sync().unwrap();
    }
    let base = dev.start_recording();
    FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let log = dev.take_log();
    let mut mounted = HashMap::new();
    for k in 0..=log.len() {
        let img = Arc::new(CrashDevice::replay(&base, &log[..k]));
        match FileSystem::mount(img.clone()) {
            Ok(fs) => {
                let names: Vec<String> = fs.list("").into_iter().map(|s| s.name).collect();
                // Before the slots are cleared the old file system is intact; after, only the new one.
                assert!(
                    names.is_empty() || names == ["old"],
                    "prefix {k}: {names:?}"
                );
                *mounted.entry(names.is_empty()).or_insert(0) += 1;
                drop(fs);
                assert!(fsck(img, &FsckOptions::default()).unwrap().is_clean());
            }
            Err(e) => assert!(
                matches!(e, Error::NotBlockfs(_) | Error::Corrupt { .. }),
                "prefix {k}: {e}"
            ),
        }
    }
    assert!(mounted.contains_key(&true), "the finished mkfs mounts");
    let img = Arc::new(CrashDevice::replay(&base, &log));
    assert_eq!(img.lba_size(), 512);
    assert!(FileSystem::mount(img).unwrap().list("").is_empty());
}
