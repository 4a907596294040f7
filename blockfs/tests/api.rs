//! The host API against the memory device: every operation, its errors, persistence across
//! remounts, the protection rules and the GPU extent table.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use blockfs::{
    BlockDevice, CreateOptions, DeviceError, Error, FileSystem, FsckOptions, MemDevice,
    MkfsOptions, OpenMode, ReadReq, WriteReq, fsck,
};
use common::*;
use rand::Rng;

#[test]
fn empty_file_system_mounts_and_reports_space() {
    let (dev, fs) = mem_fs(512, 8 << 20);
    assert!(fs.list("").is_empty());
    let df = fs.df();
    assert_eq!(df.total_blocks, 2048);
    assert_eq!(df.files, 0);
    assert_eq!(
        df.data_blocks + df.metadata_blocks + df.free_blocks + df.pending_blocks,
        df.total_blocks
    );
    let g = fs.generation();
    drop(fs);
    let fs = remount(&dev);
    assert_eq!(fs.generation(), g);
    assert!(
        fsck(dev.clone(), &FsckOptions::default())
            .unwrap()
            .is_clean()
    );
}

#[test]
fn write_read_round_trip_at_unaligned_offsets_and_short_reads() {
    for lba in [512, 4096] {
        let (_dev, fs) = mem_fs(lba, 8 << 20);
        let mut r = rng(1);
        let f = fs.create("f", &CreateOptions::default()).unwrap();
        let mut model = Vec::new();
        for _ in 0..60 {
            let off = r.random_range(0..70_000u64);
            let len = r.random_range(0..9000usize);
            let data = random_bytes(&mut r, len);
            f.write_at(off, &data).unwrap();
            let end = off as usize + len;
            if model.len() < end {
                model.resize(end, 0);
            }
            model[off as usize..end].copy_from_slice(&data);
            // A random read agrees with the model, short at end of file.
            let roff = r.random_range(0..80_000u64);
            let mut buf = vec![0xEEu8; r.random_range(0..10_000usize)];
            let n = f.read_at(roff, &mut buf).unwrap();
            let expect = model.len().saturating_sub(roff as usize).min(buf.len());
            assert_eq!(n, expect);
            if n > 0 {
                assert_same(&buf[..n], &model[roff as usize..roff as usize + n], "read");
            }
            assert!(
                buf[n..].iter().all(|&b| b == 0xEE),
                "bytes past a short read untouched"
            );
        }
        assert_eq!(f.len().unwrap(), model.len() as u64);
        assert_same(&read_all(&fs, "f"), &model, "whole file");
        assert_eq!(f.read_at(model.len() as u64, &mut [0u8; 10]).unwrap(), 0);
        assert_eq!(f.read_at(u64::MAX, &mut [0u8; 10]).unwrap(), 0);
    }
}

#[test]
fn vectored_reads_match_single_reads() {
    let (_dev, fs) = mem_fs(512, 8 << 20);
    let data = random_bytes(&mut rng(2), 300_000);
    put(&fs, "v", &data);
    let f = fs.open("v", OpenMode::ReadOnly).unwrap();
    let mut r = rng(3);
    let specs: Vec<(u64, usize)> = (0..200)
        .map(|_| (r.random_range(0..310_000u64), r.random_range(0..5000usize)))
        .collect();
    let mut bufs: Vec<Vec<u8>> = specs.iter().map(|&(_, n)| vec![0u8; n]).collect();
    let mut reqs: Vec<(u64, &mut [u8])> = specs
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(o, _), b)| (o, b.as_mut_slice()))
        .collect();
    let counts = f.read_vectored_at(&mut reqs).unwrap();
    for ((&(off, len), buf), n) in specs.iter().zip(&bufs).zip(counts) {
        let expect = data.len().saturating_sub(off as usize).min(len);
        assert_eq!(n, expect);
        if n > 0 {
            assert_same(&buf[..n], &data[off as usize..off as usize + n], "vectored");
        }
    }
}

#[test]
fn gaps_and_growth_read_as_zeroes_never_old_data() {
    let (dev, fs) = mem_fs(512, 4 << 20);
    // Fill most of the device with a recognizable file, then free it.
    let free_blocks = fs.df().free_blocks;
    let junk = vec![0xA5u8; ((free_blocks - 64) * 4096) as usize];
    put(&fs, "junk", &junk);
    fs.sync().unwrap();
    fs.remove("junk").unwrap();
    // Blocks freed by a commit are reusable two commits later.
    for _ in 0..3 {
        fs.set_immutable("x", false).unwrap_err();
        fs.create(
            &format!("tick{}", fs.generation()),
            &CreateOptions::default(),
        )
        .unwrap();
        fs.sync().unwrap();
    }
    let f = fs
        .create("new", &CreateOptions { size_hint: 1 << 20 })
        .unwrap();
    // Grow by set_len: zeroes.
    f.set_len(100_000).unwrap();
    let mut buf = vec![1u8; 100_000];
    assert_eq!(f.read_at(0, &mut buf).unwrap(), 100_000);
    assert!(
        buf.iter().all(|&b| b == 0),
        "set_len growth reads as zeroes"
    );
    // Write past the end: the gap is zeroes.
    f.write_at(300_001, b"tail").unwrap();
    let mut buf = vec![1u8; 200_001];
    assert_eq!(f.read_at(100_000, &mut buf).unwrap(), 200_001);
    assert!(buf.iter().all(|&b| b == 0), "gap reads as zeroes");
    // Shrink then grow: the cut part comes back as zeroes, not the old bytes.
    f.write_at(0, &[7u8; 5000]).unwrap();
    f.set_len(10).unwrap();
    f.set_len(5000).unwrap();
    let mut buf = vec![1u8; 5000];
    f.read_at(0, &mut buf).unwrap();
    assert_eq!(&buf[..10], &[7u8; 10]);
    assert!(buf[10..].iter().all(|&b| b == 0));
    // The GPU table covers the whole allocation but says where the file ends: what a reader
    // may reach (up to the length) is this file's.
    let t = f.extent_table().unwrap();
    let lbas: u64 = t.extents().iter().map(|e| e.nlb).sum();
    let st = f.stat().unwrap();
    assert_eq!(lbas * 512, st.allocated);
    assert_eq!(
        (t.files()[0].size_bytes, t.files()[0].alloc_bytes),
        (5000, st.allocated)
    );
    assert_eq!(t.translate(0, 5000), None);
    assert_eq!(t.translate(0, 4999).unwrap().contiguous_lbas, 1);
    for i in 0..5000u64.div_ceil(512) {
        let lba = t.translate(0, i * 512).unwrap().lba;
        let mut raw = vec![0u8; 512];
        dev.read(&mut [ReadReq { lba, buf: &mut raw }]).unwrap();
        assert!(
            !raw.contains(&0xA5),
            "extent table maps another file's old blocks below end of file"
        );
    }
}

#[test]
fn read_only_handles_reject_changes() {
    let (_dev, fs) = mem_fs(512, 4 << 20);
    put(&fs, "ro", b"hello");
    let f = fs.open("ro", OpenMode::ReadOnly).unwrap();
    assert!(matches!(f.write_at(0, b"x"), Err(Error::ReadOnly(n)) if n == "ro"));
    assert!(matches!(f.set_len(0), Err(Error::ReadOnly(_))));
    assert!(matches!(f.allocate(1 << 20), Err(Error::ReadOnly(_))));
    assert_eq!(read_all(&fs, "ro"), b"hello");
    let rw = fs.open("ro", OpenMode::ReadWrite).unwrap();
    fs.set_immutable("ro", true).unwrap();
    assert!(
        matches!(rw.write_at(0, b"x"), Err(Error::ReadOnly(_))),
        "handles opened before"
    );
    assert!(matches!(
        fs.open("ro", OpenMode::ReadWrite),
        Err(Error::ReadOnly(_))
    ));
    assert!(matches!(fs.remove("ro"), Err(Error::ReadOnly(_))));
    assert!(matches!(fs.rename("ro", "r2"), Err(Error::ReadOnly(_))));
    assert!(fs.stat("ro").unwrap().immutable);
    fs.set_immutable("ro", false).unwrap();
    fs.remove("ro").unwrap();
}

#[test]
fn namespace_operations_and_their_errors() {
    let (dev, fs) = mem_fs(4096, 8 << 20);
    for n in ["a/1", "a/2", "a/sub/3", "b/1", "ab"] {
        put(&fs, n, n.as_bytes());
    }
    let names = |p: &str| fs.list(p).into_iter().map(|s| s.name).collect::<Vec<_>>();
    assert_eq!(names("a/"), ["a/1", "a/2", "a/sub/3"]);
    assert_eq!(names("a"), ["a/1", "a/2", "a/sub/3", "ab"]);
    assert_eq!(names("").len(), 5);
    assert_eq!(names("zzz").len(), 0);
    assert!(matches!(
        fs.create("a/1", &CreateOptions::default()),
        Err(Error::AlreadyExists(_))
    ));
    assert!(matches!(
        fs.create("a//b", &CreateOptions::default()),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        fs.create(&"n".repeat(1025), &CreateOptions::default()),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        fs.open("nope", OpenMode::ReadOnly),
        Err(Error::NotFound(_))
    ));
    assert!(matches!(fs.remove("nope"), Err(Error::NotFound(_))));
    assert!(matches!(
        fs.rename("a/1", "a/2"),
        Err(Error::AlreadyExists(_))
    ));
    assert!(matches!(
        fs.rename("a/1", "/abs"),
        Err(Error::InvalidName { .. })
    ));

    let h = fs.open("a/1", OpenMode::ReadWrite).unwrap();
    fs.rename("a/1", "c/1").unwrap();
    assert_eq!(read_all(&fs, "c/1"), b"a/1");
    h.write_at(3, b"!").unwrap(); // the handle follows the file across the rename
    assert_eq!(read_all(&fs, "c/1"), b"a/1!");
    fs.remove("c/1").unwrap();
    assert!(matches!(
        h.read_at(0, &mut [0u8; 4]),
        Err(Error::Removed(_))
    ));
    assert!(matches!(h.write_at(0, b"x"), Err(Error::Removed(_))));

    let long = "d/".to_string() + &"n".repeat(1022);
    put(&fs, &long, b"long name");
    fs.sync().unwrap();
    drop((h, fs));
    let fs = remount(&dev);
    let all: Vec<String> = fs.list("").into_iter().map(|s| s.name).collect();
    assert_eq!(all, ["a/2", "a/sub/3", "ab", "b/1", long.as_str()]);
    assert_eq!(read_all(&fs, &long), b"long name");
}

#[test]
fn unsynced_changes_vanish_synced_ones_persist() {
    let (dev, fs) = mem_fs(512, 8 << 20);
    put(&fs, "kept", b"synced");
    fs.sync().unwrap();
    let g = fs.generation();
    put(&fs, "lost", b"not synced");
    fs.rename("kept", "renamed-but-not-synced").unwrap();
    drop(fs);
    let fs = remount(&dev);
    assert_eq!(fs.generation(), g);
    assert_eq!(
        fs.list("").into_iter().map(|s| s.name).collect::<Vec<_>>(),
        ["kept"]
    );
    assert_eq!(read_all(&fs, "kept"), b"synced");
    // A sync with no metadata changes does not commit a generation.
    fs.sync().unwrap();
    assert_eq!(fs.generation(), g);
}

#[test]
fn no_space_is_an_error_and_leaves_the_file_system_usable() {
    let (dev, fs) = mem_fs(512, 2 << 20);
    let free = fs.df().free_blocks;
    assert!(matches!(
        fs.create(
            "huge",
            &CreateOptions {
                size_hint: (free + 1) * 4096
            }
        ),
        Err(Error::NoSpace { .. })
    ));
    let f = fs.create("fill", &CreateOptions::default()).unwrap();
    let err = f
        .write_at(0, &vec![1u8; ((free + 10) * 4096) as usize])
        .unwrap_err();
    assert!(matches!(err, Error::NoSpace { .. }), "{err}");
    assert_eq!(f.len().unwrap(), 0);
    f.write_at(0, &vec![2u8; 100_000]).unwrap();
    fs.sync().unwrap();
    drop((f, fs));
    let fs = remount(&dev);
    assert_eq!(read_all(&fs, "fill"), vec![2u8; 100_000]);

    // A file of exactly the space df calls available fits, commit included. Removing it makes
    // its blocks free (not pending) by the time the sync returns, so the next one fits too.
    let big = (fs.df().available_blocks * 4096) as usize;
    put(&fs, "big", &vec![3u8; big]);
    fs.sync().unwrap();
    assert_eq!(fs.df().available_blocks, 0);
    fs.remove("big").unwrap();
    fs.sync().unwrap();
    let df = fs.df();
    assert!(
        df.available_blocks * 4096 >= big as u64 && df.pending_blocks < 8,
        "{df:?}"
    );
    put(&fs, "big2", &vec![4u8; big]);
    fs.sync().unwrap();
    assert_eq!(read_all(&fs, "fill"), vec![2u8; 100_000]);
    assert!(
        fsck(dev.clone(), &FsckOptions::default())
            .unwrap()
            .is_clean()
    );
}

#[test]
fn preallocation_keeps_files_in_one_extent() {
    let (_dev, fs) = mem_fs(512, 64 << 20);
    let f = fs
        .create("pre", &CreateOptions { size_hint: 8 << 20 })
        .unwrap();
    for i in 0..64u64 {
        f.write_at(i * 131_072, &vec![i as u8; 131_072]).unwrap();
        put(&fs, &format!("interleaved/{i}"), b"small"); // other allocations in between
    }
    assert_eq!(f.stat().unwrap().extents, 1);
    // Growth by appends without a hint: speculative doubling stays contiguous.
    let g = fs.create("grow", &CreateOptions::default()).unwrap();
    for i in 0..100u64 {
        g.write_at(i * 40_000, &vec![1u8; 40_000]).unwrap();
    }
    assert!(g.stat().unwrap().extents <= 3, "{:?}", g.stat().unwrap());
    // allocate() reserves without changing the size.
    let h = fs.create("fa", &CreateOptions::default()).unwrap();
    h.allocate(1 << 20).unwrap();
    let s = h.stat().unwrap();
    assert_eq!((s.size, s.allocated, s.extents), (0, 1 << 20, 1));
    h.set_len(10).unwrap();
    assert_eq!(
        h.stat().unwrap().allocated,
        1 << 20,
        "growing keeps preallocation"
    );
    h.set_len(5).unwrap();
    assert_eq!(
        h.stat().unwrap().allocated,
        4096,
        "shrinking frees preallocation"
    );
}

#[test]
fn extent_table_translates_to_the_bytes_on_the_device() {
    let (dev, fs) = mem_fs(512, 4 << 20);
    let mut r = rng(9);
    // Fill the device with small files, then free every other one: free space is all holes.
    let mut i = 0;
    while fs.df().free_blocks > 30 {
        put(&fs, &format!("frag/{i}"), &random_bytes(&mut r, 40_000));
        i += 1;
    }
    for j in (0..i).step_by(2) {
        fs.remove(&format!("frag/{j}")).unwrap();
    }
    for _ in 0..3 {
        fs.sync().unwrap();
        put(&fs, &format!("t{}", fs.generation()), b"t");
    }
    fs.sync().unwrap();
    let big = random_bytes(&mut r, 600_000);
    let f = fs.create("data/big", &CreateOptions::default()).unwrap();
    f.write_at(0, &big).unwrap();
    let small = random_bytes(&mut r, 1234);
    put(&fs, "data/small", &small);
    assert!(
        f.stat().unwrap().extents > 1,
        "test wants a fragmented file"
    );

    let batch = fs.open_prefix("data/", OpenMode::ReadOnly).unwrap();
    assert_eq!(batch.names, ["data/big", "data/small"]);
    let t = &batch.table;
    assert_eq!(t.header().total_bytes as usize, t.as_bytes().len());
    for (fi, content) in [(0usize, &big), (1, &small)] {
        for off in (0..content.len() as u64)
            .step_by(997)
            .chain([content.len() as u64 - 1])
        {
            let tr = t.translate(fi, off).expect("inside the file");
            let mut sector = vec![0u8; 512];
            dev.read(&mut [ReadReq {
                lba: tr.lba,
                buf: &mut sector,
            }])
            .unwrap();
            assert_eq!(
                sector[(off % 512) as usize],
                content[off as usize],
                "file {fi} offset {off}"
            );
        }
        assert_eq!(t.translate(fi, content.len() as u64), None);
    }
    assert_eq!(t.extents().len(), f.stat().unwrap().extents + 1);
    assert_eq!(f.extent_table().unwrap().files().len(), 1);
}

#[test]
fn metadata_overhead_of_a_10_gib_file() {
    // A sparse 12 GiB memory device: only written chunks take memory.
    let dev = Arc::new(MemDevice::new(512, (12u64 << 30) / 512));
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let size = 10u64 << 30;
    let f = fs
        .create("model/weights.bin", &CreateOptions { size_hint: size })
        .unwrap();
    f.set_len(size).unwrap();
    f.write_at(size - 5, b"last!").unwrap();
    fs.sync().unwrap();
    let st = f.stat().unwrap();
    assert_eq!((st.size, st.extents), (size, 1));
    let on_disk = fs.metadata_bytes("model/weights.bin").unwrap();
    let table = f.extent_table().unwrap().as_bytes().len() as u64;
    let gemini = size / 4096 * 8;
    println!(
        "10 GiB file: {} extent(s); on-disk metadata {on_disk} bytes ({:.7} %), GPU table {table} bytes ({:.7} %); GeminiFS at 8 B per 4 KiB block: {gemini} bytes (0.195 %)",
        st.extents,
        on_disk as f64 * 100.0 / size as f64,
        table as f64 * 100.0 / size as f64,
    );
    assert!(
        on_disk < 200 && table <= 136,
        "on disk {on_disk}, table {table}"
    );
    drop((f, fs));
    let fs = remount(&dev);
    let f = fs.open("model/weights.bin", OpenMode::ReadOnly).unwrap();
    let mut tail = [0u8; 10];
    assert_eq!(f.read_at(size - 10, &mut tail).unwrap(), 10);
    assert_eq!(&tail, b"\0\0\0\0\0last!");
}

#[test]
fn random_operations_match_a_model_across_remounts() {
    for (seed, lba) in [(11u64, 512u32), (12, 4096)] {
        let dev = Arc::new(MemDevice::new(lba, (6u64 << 20) / lba as u64));
        let mut fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let mut r = rng(seed);
        let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        let mut synced = model.clone();
        // Byte ranges written since the last sync, by file id: after a crash these may hold the
        // new bytes even inside the synced size (in-place overwrites are not atomic).
        let mut dirty: std::collections::HashMap<u64, Vec<(u64, u64)>> = Default::default();
        for step in 0..400 {
            let names: Vec<String> = model.keys().cloned().collect();
            let pick = |r: &mut rand::rngs::SmallRng| names[r.random_range(0..names.len())].clone();
            let op = r.random_range(0..100);
            if std::env::var("TRACE").is_ok() {
                eprintln!(
                    "step {step} op {op} gen {} files {:?}",
                    fs.generation(),
                    names
                        .iter()
                        .map(|n| (
                            n,
                            model[n].len(),
                            fs.stat(n).unwrap().file_id,
                            fs.stat(n).unwrap().extents
                        ))
                        .collect::<Vec<_>>()
                );
            }
            match op {
                0..15 => {
                    let n = format!("d{}/f{step}", r.random_range(0..4));
                    let hint = r.random_range(0..100_000u64);
                    fs.create(&n, &CreateOptions { size_hint: hint }).unwrap();
                    model.insert(n, Vec::new());
                }
                15..50 if !names.is_empty() => {
                    let n = pick(&mut r);
                    let cur = model[&n].len() as u64;
                    let off = r.random_range(0..cur + 20_000);
                    let len = r.random_range(1..30_000);
                    let data = random_bytes(&mut r, len);
                    let id = fs.stat(&n).unwrap().file_id;
                    dirty
                        .entry(id)
                        .or_default()
                        .push((cur.min(off), off + data.len() as u64));
                    match fs
                        .open(&n, OpenMode::ReadWrite)
                        .unwrap()
                        .write_at(off, &data)
                    {
                        Ok(()) => {
                            let m = model.get_mut(&n).unwrap();
                            let end = off as usize + data.len();
                            if m.len() < end {
                                m.resize(end, 0);
                            }
                            m[off as usize..end].copy_from_slice(&data);
                        }
                        Err(Error::NoSpace { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
                50..58 if !names.is_empty() => {
                    let n = pick(&mut r);
                    let len = r.random_range(0..60_000u64);
                    let id = fs.stat(&n).unwrap().file_id;
                    dirty
                        .entry(id)
                        .or_default()
                        .push((model[&n].len() as u64, len));
                    match fs.open(&n, OpenMode::ReadWrite).unwrap().set_len(len) {
                        Ok(()) => model.get_mut(&n).unwrap().resize(len as usize, 0),
                        Err(Error::NoSpace { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
                58..68 if !names.is_empty() => {
                    let n = pick(&mut r);
                    fs.remove(&n).unwrap();
                    model.remove(&n);
                }
                68..75 if !names.is_empty() => {
                    let n = pick(&mut r);
                    let to = format!("renamed/{step}");
                    fs.rename(&n, &to).unwrap();
                    let v = model.remove(&n).unwrap();
                    model.insert(to, v);
                }
                75..90 => {
                    fs.sync().unwrap();
                    synced = model.clone();
                    dirty.clear();
                }
                90..95 => {
                    // Crash without sync: back to the last synced state, except that bytes
                    // written in place since then may be new.
                    drop(fs);
                    fs = remount(&dev);
                    model = synced.clone();
                    for (n, content) in model.iter_mut() {
                        let actual = read_all(&fs, n);
                        assert_eq!(actual.len(), content.len(), "step {step} file {n}");
                        let ranges = dirty.get(&fs.stat(n).unwrap().file_id);
                        for (i, (a, b)) in actual.iter().zip(content.iter()).enumerate() {
                            let i = i as u64;
                            assert!(
                                a == b
                                    || ranges.is_some_and(|rs| {
                                        rs.iter().any(|&(s, e)| s <= i && i < e)
                                    }),
                                "step {step} file {n}: byte {i} changed outside any write since the sync"
                            );
                        }
                        *content = actual;
                    }
                    synced = model.clone();
                    dirty.clear();
                }
                _ if !names.is_empty() => {
                    let n = pick(&mut r);
                    assert_same(
                        &read_all(&fs, &n),
                        &model[&n],
                        &format!("step {step} file {n}"),
                    );
                }
                _ => {}
            }
        }
        fs.sync().unwrap();
        drop(fs);
        let fs = remount(&dev);
        let listed: Vec<String> = fs.list("").into_iter().map(|s| s.name).collect();
        assert_eq!(listed, model.keys().cloned().collect::<Vec<_>>());
        for (n, content) in &model {
            assert_same(&read_all(&fs, n), content, &format!("file {n}"));
        }
        let report = fsck(dev.clone(), &FsckOptions::default()).unwrap();
        assert!(report.is_clean(), "{:?}", report.problems);
        assert!(
            report.older_problems.is_empty(),
            "{:?}",
            report.older_problems
        );
    }
}

/// A memory device whose writes and flushes can be made to fail.
struct Faulty {
    inner: MemDevice,
    fail_writes: AtomicBool,
    /// Flushes left before they start failing (u32::MAX: never).
    flushes_left: AtomicU32,
}

impl BlockDevice for Faulty {
    fn lba_size(&self) -> u32 {
        self.inner.lba_size()
    }
    fn lba_count(&self) -> u64 {
        self.inner.lba_count()
    }
    fn read(&self, reqs: &mut [ReadReq<'_>]) -> Result<(), DeviceError> {
        self.inner.read(reqs)
    }
    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError> {
        if self.fail_writes.load(Ordering::Relaxed) {
            return Err(DeviceError::Io {
                op: "write",
                lba: reqs[0].lba,
                source: "injected media error".into(),
            });
        }
        self.inner.write(reqs)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        if self
            .flushes_left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_err()
        {
            return Err(DeviceError::Io {
                op: "flush",
                lba: 0,
                source: "injected flush failure".into(),
            });
        }
        self.inner.flush()
    }
    fn describe(&self) -> String {
        "faulty".into()
    }
}

#[test]
fn device_errors_surface_as_typed_errors() {
    let dev = Arc::new(Faulty {
        inner: MemDevice::new(512, 8192),
        fail_writes: AtomicBool::new(false),
        flushes_left: AtomicU32::new(u32::MAX),
    });
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    put(&fs, "a", b"before");
    fs.sync().unwrap();
    dev.fail_writes.store(true, Ordering::Relaxed);
    let f = fs.open("a", OpenMode::ReadWrite).unwrap();
    let e = f.write_at(6, b" after").unwrap_err();
    assert!(
        matches!(
            e,
            Error::Device {
                op: "writing file data",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(f.len().unwrap(), 6, "a failed write does not grow the file");
    put_fails(&fs);
    // A change made in memory, then a sync that fails writing its metadata: the change is
    // dropped with the failure (the state goes back to what the medium holds).
    fs.rename("a", "renamed").unwrap();
    let e = fs.sync().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Device {
                op: "writing metadata",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(names(&fs), ["a"], "the failed sync's rename is dropped");
    dev.fail_writes.store(false, Ordering::Relaxed);
    fs.sync().unwrap(); // the file system goes on after a failure before the superblock
    // Fail the second flush of a sync: the one after the superblock write.
    dev.flushes_left.store(1, Ordering::Relaxed);
    fs.rename("a", "b").unwrap();
    let e = fs.sync().unwrap_err();
    assert!(
        matches!(
            e,
            Error::Device {
                op: "writing the superblock",
                ..
            }
        ),
        "{e}"
    );
    dev.flushes_left.store(u32::MAX, Ordering::Relaxed);
    // The medium may hold either generation: no more changes until a remount says which.
    assert!(matches!(fs.rename("b", "c"), Err(Error::Poisoned)));
    assert!(matches!(fs.sync(), Err(Error::Poisoned)));
    drop((f, fs));
    let fs = FileSystem::mount(dev.clone()).unwrap();
    assert_eq!(read_all(&fs, "b"), b"before");
}

fn put_fails(fs: &FileSystem) {
    let f = fs.create("doomed", &CreateOptions::default()).unwrap();
    assert!(f.write_at(0, b"x").is_err());
}

fn names(fs: &FileSystem) -> Vec<String> {
    fs.list("").into_iter().map(|st| st.name).collect()
}

fn faulty(blocks: u64) -> Arc<Faulty> {
    Arc::new(Faulty {
        inner: MemDevice::new(512, blocks),
        fail_writes: AtomicBool::new(false),
        flushes_left: AtomicU32::new(u32::MAX),
    })
}

/// Issue 53: a put or rm that failed at the device left the mounted file system listing a
/// 0-byte file the medium lacks, or hiding one it has. After each failed change the listing
/// is the medium's (a remount agrees), and the file system goes on once writes work again.
#[test]
fn a_change_that_fails_at_the_device_leaves_the_listing_as_the_medium_has_it() {
    let dev = faulty(16384);
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    put(&fs, "a", b"kept bytes");
    put(&fs, "dir/b", &[7u8; 10_000]);
    fs.sync().unwrap();
    let before = fs.list("");
    dev.fail_writes.store(true, Ordering::Relaxed);

    // A put (create, write, sync) of a new file: the write fails.
    let f = fs
        .create("new", &CreateOptions { size_hint: 5000 })
        .unwrap();
    let e = f.write_at(0, &[1u8; 5000]).unwrap_err();
    assert!(matches!(e, Error::Device { .. }), "{e}");
    assert_eq!(fs.list(""), before, "after a failed write of a new file");
    assert!(matches!(fs.stat("new"), Err(Error::NotFound(_))));
    // Its handle is of a file that never was.
    assert!(matches!(f.write_at(0, b"x"), Err(Error::Removed(_))));

    // A put whose data write worked but whose commit fails.
    dev.fail_writes.store(false, Ordering::Relaxed);
    dev.flushes_left.store(0, Ordering::Relaxed);
    put(&fs, "new", b"written, never committed");
    assert!(matches!(fs.sync(), Err(Error::Device { .. })));
    assert_eq!(fs.list(""), before, "after a failed commit of a new file");
    dev.flushes_left.store(u32::MAX, Ordering::Relaxed);
    dev.fail_writes.store(true, Ordering::Relaxed);

    // An rm: the removal is in memory until the sync, which fails.
    fs.remove("a").unwrap();
    assert!(matches!(fs.sync(), Err(Error::Device { .. })));
    assert_eq!(fs.list(""), before, "after a failed rm");
    assert_eq!(read_all(&fs, "a"), b"kept bytes");

    // A replacement (write under a temporary name, rename over, sync).
    put_fails(&fs);
    fs.rename_replace("dir/b", "a").unwrap();
    assert!(matches!(fs.sync(), Err(Error::Device { .. })));
    assert_eq!(fs.list(""), before, "after a failed replace");

    // A remount agrees, and so does fsck.
    assert_eq!(remount(&dev).list(""), before);
    assert!(
        fsck(dev.clone(), &FsckOptions::default())
            .unwrap()
            .is_clean()
    );

    // Writes work again: the same mount goes on.
    dev.fail_writes.store(false, Ordering::Relaxed);
    put(&fs, "new", b"now it lands");
    fs.remove("a").unwrap();
    fs.sync().unwrap();
    assert_eq!(names(&fs), ["dir/b", "new"]);
    let again = remount(&dev);
    assert_eq!(again.list(""), fs.list(""));
    assert_eq!(read_all(&again, "new"), b"now it lands");
    assert_eq!(read_all(&again, "dir/b"), [7u8; 10_000]);
}

/// Issue 53: a file system on a device that must not change refuses every change up front
/// with `ReadOnly` (never a device error half-way), and its listing stays the medium's.
#[test]
fn a_read_only_mount_refuses_every_change_up_front() {
    let dev = faulty(16384);
    {
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        put(&fs, "a", b"bytes of a");
        put(&fs, "b", b"bytes of b");
        fs.sync().unwrap();
    }
    // Any write reaching the device would come back as a device error, not ReadOnly.
    dev.fail_writes.store(true, Ordering::Relaxed);
    dev.flushes_left.store(0, Ordering::Relaxed);
    let fs = FileSystem::mount_read_only(dev.clone()).unwrap();
    assert!(fs.is_read_only());
    assert!(!remount(&dev).is_read_only());
    let before = fs.list("");
    let ro = |r: Result<(), Error>, what: &str| {
        assert!(matches!(r, Err(Error::ReadOnly(_))), "{what}: {r:?}");
    };
    ro(
        fs.create("c", &CreateOptions::default()).map(drop),
        "create",
    );
    ro(fs.remove("a"), "remove");
    ro(fs.rename("a", "c"), "rename");
    ro(fs.rename_replace("a", "b"), "rename_replace");
    ro(fs.set_immutable("a", true), "set_immutable");
    ro(
        fs.open("a", OpenMode::ReadWrite).map(drop),
        "open read-write",
    );
    ro(
        fs.open_prefix("", OpenMode::ReadWrite).map(drop),
        "open_prefix read-write",
    );
    ro(fs.reclaim(), "reclaim");
    let f = fs.open("a", OpenMode::ReadOnly).unwrap();
    ro(f.write_at(0, b"x"), "write_at");
    ro(f.set_len(0), "set_len");
    fs.sync().unwrap(); // nothing to write
    assert_eq!(fs.list(""), before);
    assert_eq!(read_all(&fs, "a"), b"bytes of a");
    assert_eq!(read_all(&fs, "b"), b"bytes of b");
}

#[test]
fn fsck_counts_space_as_the_mounted_file_system_does() {
    let (dev, fs) = mem_fs(512, 8 << 20);
    let mut r = rng(7);
    // Files made, rewritten smaller and removed over several commits leave runs pending at
    // different generations.
    for round in 0..4 {
        for i in 0..3 {
            let name = format!("f{i}");
            let f = fs
                .create(
                    &name,
                    &CreateOptions {
                        size_hint: 64 << 10,
                    },
                )
                .or_else(|_| fs.open(&name, OpenMode::ReadWrite))
                .unwrap();
            f.write_at(0, &random_bytes(&mut r, (round + 1) * 20_000))
                .unwrap();
            fs.sync().unwrap();
        }
        fs.remove(&format!("f{}", round % 3)).unwrap();
        fs.sync().unwrap();
    }
    drop(fs);
    let report = fsck(dev.clone(), &FsckOptions::default()).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    let df = remount(&dev).df();
    assert_eq!(
        (
            report.data_blocks,
            report.metadata_blocks,
            report.free_blocks,
            report.pending_blocks,
            report.total_blocks
        ),
        (
            df.data_blocks,
            df.metadata_blocks,
            df.free_blocks,
            df.pending_blocks,
            df.total_blocks
        )
    );
}

#[test]
fn probe_tells_nothing_a_file_system_and_a_damaged_one_apart() {
    let dev = Arc::new(MemDevice::new(512, 16384));
    assert_eq!(
        FileSystem::probe(dev.clone()).unwrap(),
        blockfs::Existing::Nothing
    );
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    put(&fs, "a", &[1u8; 5000]);
    put(&fs, "b", &[2u8; 10]);
    fs.sync().unwrap();
    let gen_ = fs.generation();
    drop(fs);
    let found = FileSystem::probe(dev.clone()).unwrap();
    assert_eq!(
        found,
        blockfs::Existing::FileSystem {
            files: 2,
            bytes: 5010,
            generation: gen_
        }
    );
    assert_eq!(found.to_string(), "a blockfs with 2 files (5010 bytes)");
    // One slot's checksum broken: still a blockfs, damaged.
    let mut sb = vec![0u8; 512];
    dev.read(&mut [ReadReq {
        lba: 0,
        buf: &mut sb,
    }])
    .unwrap();
    sb[100] ^= 0xff;
    dev.write(&[WriteReq { lba: 0, buf: &sb }]).unwrap();
    let found = FileSystem::probe(dev.clone()).unwrap();
    assert!(
        matches!(found, blockfs::Existing::Damaged { .. }) && found.is_blockfs(),
        "{found:?}"
    );
}

#[test]
fn rename_replace_swaps_in_one_commit() {
    let (dev, fs) = mem_fs(512, 8 << 20);
    put(&fs, "a", &[1u8; 9000]);
    put(&fs, "b", &[2u8; 3000]);
    fs.sync().unwrap();
    // Plain rename refuses an existing name; replace does not.
    assert!(matches!(fs.rename("b", "a"), Err(Error::AlreadyExists(_))));
    put(&fs, "tmp", &[3u8; 7000]);
    fs.rename_replace("tmp", "a").unwrap();
    assert_eq!(read_all(&fs, "a"), vec![3u8; 7000]);
    assert!(matches!(fs.stat("tmp"), Err(Error::NotFound(_))));
    // Not synced: the medium still holds the old "a", and no "tmp".
    drop(fs);
    let fs = remount(&dev);
    assert_eq!(read_all(&fs, "a"), vec![1u8; 9000]);
    assert!(fs.stat("tmp").is_err());
    // Synced: one commit holds the new "a" and no trace of the old one.
    let g = fs.generation();
    put(&fs, "tmp", &[3u8; 7000]);
    fs.rename_replace("tmp", "a").unwrap();
    fs.sync().unwrap();
    // The commit that swapped them, and one that makes the old "a"'s blocks free.
    assert_eq!(fs.generation(), g + 2);
    assert!(fs.df().pending_blocks <= 4, "{:?}", fs.df());
    drop(fs);
    let fs = remount(&dev);
    assert_eq!(read_all(&fs, "a"), vec![3u8; 7000]);
    assert_eq!(
        fs.list("")
            .iter()
            .map(|f| f.name.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );
    let report = fsck(dev.clone(), &FsckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    // An immutable target is not replaced; renaming onto itself is a no-op.
    fs.set_immutable("b", true).unwrap();
    assert!(matches!(
        fs.rename_replace("a", "b"),
        Err(Error::ReadOnly(n)) if n == "b"
    ));
    fs.rename_replace("a", "a").unwrap();
    assert_eq!(read_all(&fs, "a"), vec![3u8; 7000]);
}

#[test]
fn space_left_pending_by_an_earlier_commit_is_reclaimed_when_needed() {
    // An image whose last commit freed a file's blocks, with no commit after it (what syncs
    // before this fix left, or a crash between a removal's two commits): the blocks are
    // pending at mount, and a create that needs them commits them free instead of failing.
    let dev = Arc::new(blockfs::CrashDevice::new(MemDevice::new(512, 4096)));
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let big = (fs.df().available_blocks * 4096) as usize;
    put(&fs, "big", &vec![5u8; big]);
    fs.sync().unwrap();
    let base = dev.start_recording();
    fs.remove("big").unwrap();
    fs.sync().unwrap();
    drop(fs);
    let log = dev.take_log();
    // Cut the log after the first commit: its superblock write and the flush after it.
    let slots: Vec<u64> = blockfs::format::SUPERBLOCK_SLOTS
        .iter()
        .map(|b| b / 512)
        .collect();
    let sb = log
        .iter()
        .position(|op| matches!(op, blockfs::LoggedOp::Write { lba, .. } if slots.contains(lba)))
        .unwrap();
    let img = Arc::new(blockfs::CrashDevice::replay(&base, &log[..sb + 2]));
    let fs = FileSystem::mount(img.clone()).unwrap();
    let df = fs.df();
    assert!(df.pending_blocks * 4096 >= big as u64, "{df:?}");
    assert!(df.available_blocks * 4096 < big as u64, "{df:?}");
    put(&fs, "again", &vec![6u8; big]);
    fs.sync().unwrap();
    drop(fs);
    let fs = remount(&img);
    assert_same(&read_all(&fs, "again"), &vec![6u8; big], "again");
    assert!(
        fsck(img.clone(), &FsckOptions::default())
            .unwrap()
            .is_clean()
    );
}

#[test]
fn data_checksums_are_recorded_kept_and_checked() {
    use blockfs::{ChecksummedSource, Crc32cPieces, DataCheck};
    let (dev, fs) = mem_fs(512, 8 << 20);
    let data: Vec<u8> = (0..300_001u32).map(|i| (i * 31 + i / 7) as u8).collect();
    let f = fs
        .create(
            "w",
            &CreateOptions {
                size_hint: data.len() as u64,
            },
        )
        .unwrap();
    let pieces = Crc32cPieces::new();
    // In two calls, as the CLI's --chunk does.
    let src = ChecksummedSource::new(&data, &pieces);
    f.write_from(0, &src, 0..100_000, &|_| {}).unwrap();
    f.write_from(100_000, &src, 100_000..data.len() as u64, &|_| {})
        .unwrap();
    let crc = pieces.finish(0, data.len() as u64).unwrap();
    assert_eq!(crc, crc32c::crc32c(&data));
    f.set_data_crc(crc).unwrap();
    fs.sync().unwrap();
    assert_eq!(fs.verify_data("w").unwrap(), DataCheck::Match);
    drop((f, fs));
    // Kept across a remount, and fsck accepts it.
    let fs = remount(&dev);
    assert_eq!(fs.stat("w").unwrap().data_crc, Some(crc));
    assert!(
        fsck(dev.clone(), &FsckOptions::default())
            .unwrap()
            .is_clean()
    );
    // A flipped data bit is found.
    let ext = fs
        .open("w", OpenMode::ReadOnly)
        .unwrap()
        .extent_table()
        .unwrap();
    let lba = ext.extents()[0].lba + 100;
    let mut sector = vec![0u8; 512];
    dev.read(&mut [ReadReq {
        lba,
        buf: &mut sector,
    }])
    .unwrap();
    sector[17] ^= 0x10;
    dev.write(&[WriteReq { lba, buf: &sector }]).unwrap();
    assert!(matches!(
        fs.verify_data("w").unwrap(),
        DataCheck::Mismatch { recorded, .. } if recorded == crc
    ));
    // Metadata is fine: fsck (without reading data) stays clean.
    assert!(
        fsck(dev.clone(), &FsckOptions::default())
            .unwrap()
            .is_clean()
    );
    // Any change forgets the checksum.
    let f = fs.open("w", OpenMode::ReadWrite).unwrap();
    f.write_at(0, b"x").unwrap();
    assert_eq!(fs.stat("w").unwrap().data_crc, None);
    assert_eq!(fs.verify_data("w").unwrap(), DataCheck::NoChecksum);
    f.set_data_crc(7).unwrap();
    f.set_len(10).unwrap();
    assert_eq!(fs.stat("w").unwrap().data_crc, None);
}

/// Metadata bytes on disk (superblock area, root, chunks) after `files` files of `size` bytes
/// were created one commit each, as `gpunvme fs put` does.
fn metadata_after(block_size: u32, files: usize, size: usize, device_bytes: u64) -> (u64, u64) {
    let dev = Arc::new(MemDevice::new(512, device_bytes / 512));
    let fs = FileSystem::mkfs(
        dev.clone(),
        &MkfsOptions {
            block_size,
            ..Default::default()
        },
    )
    .unwrap();
    for i in 0..files {
        put(&fs, &format!("models/file-{i:05}.bin"), &vec![7u8; size]);
        fs.sync().unwrap();
    }
    let df = fs.df();
    drop(fs);
    let report = fsck(dev.clone(), &FsckOptions::default()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    let fs = remount(&dev);
    assert_eq!(fs.list("").len(), files);
    (
        df.metadata_blocks * block_size as u64,
        (df.metadata_blocks - blockfs::format::reserved_blocks(block_size)) * block_size as u64,
    )
}

#[test]
fn metadata_stays_proportional_to_the_records() {
    // 80 small files with 4 KiB blocks took 332 KiB, one chunk per commit; packed, the 80
    // records (about 80 bytes each) fit in two chunks plus the root.
    let (_, meta) = metadata_after(4096, 80, 10, 16 << 20);
    assert!(meta <= 4 * 4096, "{meta} bytes of metadata for 80 files");
    // 30 ten-byte files with 1 MiB blocks took 32 MiB; now a chunk block and a root block.
    let (_, meta) = metadata_after(1 << 20, 30, 10, 64 << 20);
    assert!(meta <= 2 << 20, "{meta} bytes of metadata for 30 files");
}

/// The figures of FORMAT.md's overhead paragraph (run with `--ignored --nocapture`).
#[test]
#[ignore = "prints a table; slow in debug builds"]
fn metadata_overhead_table() {
    for (bs, label) in [(4096u32, "4 KiB"), (1 << 20, "1 MiB")] {
        for files in [1usize, 100, 10_000] {
            // One-block files where memory allows; empty files (no extent) for 10,000 1 MiB
            // blocks, whose data alone would be 10 GiB.
            let size = if bs == 1 << 20 && files == 10_000 {
                0
            } else {
                10
            };
            let device = (files as u64 + 64) * bs as u64 * 2;
            let (all, meta) = metadata_after(bs, files, size, device.max(16 << 20));
            println!(
                "{label} blocks, {files} files of {size} bytes: metadata {meta} bytes ({} per file); with the superblock area {all} bytes",
                meta / files as u64
            );
        }
    }
}

/// A reader with a read-only mount of its own (another process behind `gpunvme serve`) reads
/// what it mounted while the writer's mount removes that file and fills the space over many
/// commits, as long as the writer holds the reader's generation; without the hold the same
/// churn reuses the blocks (the control, so the test can fail).
#[test]
fn a_held_generation_keeps_its_blocks_for_a_reader_elsewhere() {
    let churn = |fs: &FileSystem, round: u32| {
        for k in 0..6u32 {
            let name = format!("churn-{round}-{k}");
            put(fs, &name, &vec![(round * 7 + k) as u8 ^ 0x5a; 300 << 10]);
            fs.sync().unwrap();
            fs.remove(&name).unwrap();
            fs.sync().unwrap();
        }
        // Fill what is free now, so that freed blocks are certainly reused.
        let free = fs.df().free_blocks * u64::from(fs.geometry().block_size);
        let fill = free.saturating_sub(256 << 10) / 2;
        put(fs, &format!("fill-{round}"), &vec![0xee; fill as usize]);
        fs.sync().unwrap();
    };
    for held in [true, false] {
        let (dev, fs) = mem_fs(4096, 8 << 20);
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        put(&fs, "weights", &data);
        fs.sync().unwrap();
        let reader = FileSystem::mount_read_only(dev.clone()).unwrap();
        assert_eq!(reader.generation(), fs.generation());
        let hold = held.then(|| fs.hold_generation(reader.generation()).unwrap());
        assert!(matches!(
            fs.hold_generation(fs.generation() + 1),
            Err(Error::FutureGeneration { .. })
        ));
        let f = reader.open("weights", OpenMode::ReadOnly).unwrap();
        fs.remove("weights").unwrap();
        fs.sync().unwrap();
        churn(&fs, 0);
        let mut got = vec![0u8; data.len()];
        assert_eq!(f.read_at(0, &mut got).unwrap(), data.len());
        if held {
            assert_same(&got, &data, "read through the held generation");
            assert!(fs.df().pending_blocks >= 256, "{:?}", fs.df());
            drop(hold);
            // Two commits (a sync with nothing to write commits nothing).
            for k in 0..2 {
                put(&fs, &format!("after-{k}"), b"x");
                fs.sync().unwrap();
            }
            assert!(fs.df().pending_blocks < 256, "{:?}", fs.df());
        } else {
            assert_ne!(got, data, "without a hold the blocks were reused");
        }
    }
}
