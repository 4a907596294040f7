//! blockfs for device access: extent tables that cover the whole allocation, device-write
//! reservations committed without zero fill (written here through the raw device, as a GPU
//! kernel writes through its table), extent pins that keep a table's blocks from reuse, and
//! the crash points of a device-write commit.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use blockfs::table::TABLE_FILE_WRITABLE;
use blockfs::{
    BlockDevice, CrashDevice, CreateOptions, DataCheck, Error, ExtentTable, FileSystem,
    FsckOptions, LoggedOp, MemDevice, MkfsOptions, OpenMode, ReadReq, fsck,
};
use common::*;
use rand::Rng;

/// Device blocks `(bno, len)` a table names, at 4 KiB blocks.
fn table_blocks(t: &ExtentTable) -> BTreeSet<u64> {
    let spb = 4096 >> t.header().lba_shift;
    t.extents()
        .iter()
        .flat_map(|e| (e.lba / spb)..(e.lba + e.nlb) / spb)
        .collect()
}

/// Reads `len` bytes of file 0 of `t` from `offset` through the table, from the raw device.
fn read_through(dev: &dyn BlockDevice, t: &ExtentTable, offset: u64, len: u64) -> Vec<u8> {
    let l = 1u64 << t.header().lba_shift;
    let mut out = Vec::with_capacity(len as usize);
    let mut pos = offset;
    while pos < offset + len {
        let tr = t.translate(0, pos).expect("below end of file");
        let mut sector = vec![0u8; l as usize];
        dev.read(&mut [ReadReq {
            lba: tr.lba,
            buf: &mut sector,
        }])
        .unwrap();
        let skip = (pos % l) as usize;
        let n = ((l as usize) - skip).min((offset + len - pos) as usize);
        out.extend_from_slice(&sector[skip..skip + n]);
        pos += n as u64;
    }
    out
}

#[test]
fn tables_cover_the_allocation_and_say_both_lengths() {
    for lba in [512u32, 4096] {
        let (_dev, fs) = mem_fs(lba, 16 << 20);
        let f = fs
            .create("m/a", &CreateOptions { size_hint: 1 << 20 })
            .unwrap();
        f.write_at(0, &[3u8; 10_000]).unwrap();
        put(&fs, "m/b", b"bee");
        let t = f.extent_table().unwrap();
        let e = t.files()[0];
        assert_eq!((e.size_bytes, e.alloc_bytes, e.flags), (10_000, 1 << 20, 0));
        let lbas: u64 = t.extents().iter().map(|x| x.nlb).sum();
        assert_eq!(
            lbas * lba as u64,
            1 << 20,
            "extents cover the preallocation"
        );
        // Reads stop at the length; a read-only table translates no write.
        assert!(t.translate(0, 9_999).is_some());
        assert_eq!(t.translate(0, 10_000), None);
        assert_eq!(t.translate_write(0, 0), None);
        // allocate() grows the allocation, and the next table shows it.
        f.allocate(3 << 20).unwrap();
        assert_eq!(f.extent_table().unwrap().files()[0].alloc_bytes, 3 << 20);
        assert_eq!(f.stat().unwrap().size, 10_000);
        // The batch table too: each file's length and allocation.
        let batch = fs.open_prefix("m/", OpenMode::ReadOnly).unwrap();
        let files = batch.table.files();
        assert_eq!(
            files
                .iter()
                .map(|x| (x.size_bytes, x.alloc_bytes))
                .collect::<Vec<_>>(),
            [(10_000, 3 << 20), (3, 4096)]
        );
        assert_eq!(batch.table.translate(1, 3), None);
        // A reservation's table is writable up to the allocation, readable up to the length.
        let w = f.reserve_device_write(100).unwrap();
        let wt = w.table();
        assert_eq!(wt.files()[0].flags, TABLE_FILE_WRITABLE);
        assert_eq!(w.allocated(), 3 << 20);
        assert!(wt.translate_write(0, (3 << 20) - 1).is_some());
        assert_eq!(wt.translate_write(0, 3 << 20), None, "past the allocation");
        assert_eq!(wt.translate(0, 10_000), None);
    }
}

#[test]
fn device_write_commits_without_zero_fill_and_flushes_at_sync() {
    for lba in [512u32, 4096] {
        let dev = Arc::new(CrashDevice::new(MemDevice::new(
            lba,
            (16 << 20) / lba as u64,
        )));
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let f = fs
            .create(
                "ckpt",
                &CreateOptions {
                    size_hint: 256 << 10,
                },
            )
            .unwrap();
        let head = vec![0x11u8; 1000];
        f.write_at(0, &head).unwrap();
        f.set_data_crc(crc32c::crc32c(&head)).unwrap();
        fs.sync().unwrap();
        let before = f.stat().unwrap();

        // Inside the preallocation: nothing new is allocated.
        let mut r = rng(lba as u64);
        let body = random_bytes(&mut r, 200_000);
        let w = f.reserve_device_write(201_000).unwrap();
        assert_eq!(f.stat().unwrap().allocated, before.allocated);
        assert_eq!(f.stat().unwrap().extents, before.extents);
        dev.start_recording();
        device_write(dev.as_ref(), w.table(), 1000, &body);
        let device_ops = dev.log_len();
        w.commit(201_000).unwrap();
        assert_eq!(
            dev.log_len(),
            device_ops,
            "commit writes nothing (no zero fill)"
        );
        let mut want = head.clone();
        want.extend_from_slice(&body);
        assert_same(&read_all(&fs, "ckpt"), &want, "after commit");
        let st = f.stat().unwrap();
        assert_eq!(
            (st.size, st.data_crc, st.device_written),
            (201_000, None, true)
        );
        fs.sync().unwrap();
        let log = dev.take_log();
        assert!(
            log[device_ops..]
                .iter()
                .all(|op| !matches!(op, LoggedOp::Zeroes { .. })),
            "no zero fill"
        );
        assert!(
            log[device_ops..].contains(&LoggedOp::Flush),
            "sync flushes what the device wrote"
        );

        // Durable, and readers say why the data is not checked.
        drop((f, fs));
        let fs = FileSystem::mount(dev.clone()).unwrap();
        assert_same(&read_all(&fs, "ckpt"), &want, "after remount");
        assert!(fs.stat("ckpt").unwrap().device_written);
        assert_eq!(fs.verify_data("ckpt").unwrap(), DataCheck::DeviceWritten);

        // Growth past the allocation, committed with the device's checksum.
        let f = fs.open("ckpt", OpenMode::ReadWrite).unwrap();
        let more = random_bytes(&mut r, 300_000);
        let w = f.reserve_device_write(501_000).unwrap();
        assert!(w.allocated() >= 501_000);
        device_write(dev.as_ref(), w.table(), 201_000, &more);
        want.extend_from_slice(&more);
        w.commit_with_crc(501_000, crc32c::crc32c(&want)).unwrap();
        let st = f.stat().unwrap();
        assert_eq!(
            (st.size, st.data_crc, st.device_written),
            (501_000, Some(crc32c::crc32c(&want)), false)
        );
        assert_eq!(fs.verify_data("ckpt").unwrap(), DataCheck::Match);
        // A device checksum that is wrong is caught by the readers.
        let w = f.reserve_device_write(501_000).unwrap();
        w.commit_with_crc(501_000, 0xBAD).unwrap();
        assert!(matches!(
            fs.verify_data("ckpt").unwrap(),
            DataCheck::Mismatch {
                recorded: 0xBAD,
                ..
            }
        ));
        // Shrinking by a commit keeps the allocation.
        let alloc = f.stat().unwrap().allocated;
        f.reserve_device_write(0).unwrap().commit(4096).unwrap();
        assert_eq!(
            (f.stat().unwrap().size, f.stat().unwrap().allocated),
            (4096, alloc)
        );
        fs.sync().unwrap();
        drop((f, fs));
        assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
    }
}

#[test]
fn device_write_commits_refuse_what_they_cannot_honour() {
    let (_dev, fs) = mem_fs(512, 8 << 20);
    let f = fs
        .create(
            "f",
            &CreateOptions {
                size_hint: 64 << 10,
            },
        )
        .unwrap();
    f.write_at(0, b"kept").unwrap();
    // Past the reservation.
    let w = f.reserve_device_write(10_000).unwrap();
    let allocated = w.allocated();
    assert!(matches!(
        w.commit(allocated + 1),
        Err(Error::BeyondReservation { len, .. }) if len == allocated + 1
    ));
    // Dropped without a commit: nothing changes.
    drop(f.reserve_device_write(30_000).unwrap());
    assert_eq!(f.len().unwrap(), 4);
    // The file's blocks changed in between (truncated and regrown).
    let w = f.reserve_device_write(60_000).unwrap();
    f.set_len(0).unwrap();
    f.write_at(0, &[1u8; 100]).unwrap();
    f.allocate(64 << 10).unwrap();
    let e = w.commit(60_000);
    assert!(matches!(e, Err(Error::ReservationStale(_))), "{e:?}");
    assert_eq!(f.len().unwrap(), 100);
    // Removed, read-only, too large.
    let w = f.reserve_device_write(100).unwrap();
    fs.remove("f").unwrap();
    assert!(matches!(w.commit(100), Err(Error::Removed(_))));
    put(&fs, "g", b"g");
    let ro = fs.open("g", OpenMode::ReadOnly).unwrap();
    assert!(matches!(
        ro.reserve_device_write(1),
        Err(Error::ReadOnly(_))
    ));
    let g = fs.open("g", OpenMode::ReadWrite).unwrap();
    assert!(matches!(
        g.reserve_device_write(u64::MAX),
        Err(Error::TooLarge(_))
    ));
    assert!(matches!(
        g.reserve_device_write(1 << 40),
        Err(Error::NoSpace { .. })
    ));
}

#[test]
fn pins_hold_blocks_through_remove_and_commits_and_release_after() {
    let (dev, fs) = mem_fs(512, 4 << 20);
    let mut r = rng(7);
    let victim = random_bytes(&mut r, 300_000);
    put(&fs, "victim", &victim);
    put(&fs, "batch/x", &random_bytes(&mut r, 50_000));
    fs.sync().unwrap();
    let f = fs.open("victim", OpenMode::ReadOnly).unwrap();
    let table = f.extent_table().unwrap();
    let batch = fs.open_prefix("batch/", OpenMode::ReadOnly).unwrap();
    let pinned = table_blocks(&table);
    let batch_blocks = table_blocks(&batch.table);
    assert_eq!(fs.df().pinned_tables, 2);

    // Removal, the sync's two commits, and two more: without pins all of it would be free.
    fs.remove("victim").unwrap();
    fs.remove("batch/x").unwrap();
    fs.sync().unwrap();
    fs.reclaim().unwrap();
    let df = fs.df();
    assert_eq!(df.pinned_blocks, (pinned.len() + batch_blocks.len()) as u64);
    assert!(df.pending_blocks >= df.pinned_blocks);

    // Fill the file system: no new file and no metadata gets a pinned block.
    let mut i = 0;
    loop {
        let name = format!("fill/{i}");
        let f = match fs.create(&name, &CreateOptions { size_hint: 40_000 }) {
            Ok(f) => f,
            Err(Error::NoSpace { .. }) => break,
            Err(e) => panic!("{e}"),
        };
        f.write_at(0, &random_bytes(&mut r, 40_000)).unwrap();
        let got = table_blocks(&f.extent_table().unwrap());
        assert!(got.is_disjoint(&pinned), "{name} got a pinned block");
        assert!(got.is_disjoint(&batch_blocks), "{name} got a pinned block");
        fs.sync().unwrap();
        i += 1;
    }
    assert!(i > 10, "only {i} files fit");
    // A kernel still reading through the table sees the removed file's bytes.
    assert_same(
        &read_through(dev.as_ref(), &table, 0, victim.len() as u64),
        &victim,
        "read through the pinned table",
    );

    // Released: the next commit frees the blocks, and they are used again.
    drop((table, batch));
    assert_eq!(fs.df().pinned_tables, 0);
    fs.reclaim().unwrap();
    let df = fs.df();
    assert_eq!(df.pinned_blocks, 0);
    assert!(df.pending_blocks < pinned.len() as u64, "{df:?}");
    let f = fs
        .create(
            "reuse",
            &CreateOptions {
                size_hint: df.available_blocks * 4096,
            },
        )
        .unwrap();
    let got = table_blocks(&f.extent_table().unwrap());
    assert!(!got.is_disjoint(&pinned), "released blocks are reused");
    fs.sync().unwrap();
    drop((f, fs));
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
}

#[test]
fn reservations_pin_and_a_remount_starts_clean() {
    let (dev, fs) = mem_fs(4096, 4 << 20);
    put(&fs, "a", &[9u8; 100_000]);
    fs.sync().unwrap();
    let f = fs.open("a", OpenMode::ReadWrite).unwrap();
    let w = f.reserve_device_write(100_000).unwrap();
    let blocks = table_blocks(w.table());
    // Truncated under the reservation: its blocks stay pinned, and the commit is refused.
    f.set_len(0).unwrap();
    fs.sync().unwrap();
    fs.reclaim().unwrap();
    assert_eq!(fs.df().pinned_blocks, blocks.len() as u64);
    // The medium records them as pending (the image checks out as it is): a remount (of the
    // image as it is now) holds no pins, so they are free at once.
    let image = Arc::new(dev.duplicate());
    assert!(
        fsck(image.clone(), &FsckOptions::default())
            .unwrap()
            .is_clean()
    );
    let other = FileSystem::mount(image.clone()).unwrap();
    let (mine, theirs) = (fs.df(), other.df());
    assert_eq!(theirs.pinned_blocks, 0);
    assert!(theirs.pending_blocks < blocks.len() as u64);
    assert_eq!(theirs.free_blocks, mine.free_blocks + mine.pinned_blocks);
    other.reclaim().unwrap();
    drop(other);
    assert!(fsck(image, &FsckOptions::default()).unwrap().is_clean());
    assert!(matches!(w.commit(1), Err(Error::ReservationStale(_))));
    fs.reclaim().unwrap();
    let df = fs.df();
    assert_eq!(df.pinned_blocks, 0);
    assert!(df.pending_blocks < blocks.len() as u64);
}

/// Every prefix of the device writes and the sync after a device-write commit (and every
/// prefix plus a torn next write) mounts with the old length and old bytes or the new length
/// and exactly the device's bytes: never a zero-filled or foreign block.
#[test]
fn every_crash_point_of_a_device_write_mounts_old_or_new_length() {
    let mut points = 0;
    for (lba, prealloc) in [(512u32, true), (512, false), (4096, true), (4096, false)] {
        let dev = Arc::new(CrashDevice::new(MemDevice::new(
            lba,
            (8 << 20) / lba as u64,
        )));
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let mut r = rng(lba as u64 + prealloc as u64);
        // Stale bytes in free space, so a foreign block would show: a file written and removed.
        put(&fs, "stale", &vec![0xA5; 2 << 20]);
        fs.sync().unwrap();
        fs.remove("stale").unwrap();
        fs.sync().unwrap();
        let hint = if prealloc { 512 << 10 } else { 0 };
        let f = fs
            .create("ckpt", &CreateOptions { size_hint: hint })
            .unwrap();
        let old = random_bytes(&mut r, 3333);
        f.write_at(0, &old).unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();

        let body = random_bytes(&mut r, 400_000);
        let new_len = 3333 + body.len() as u64;
        let w = f.reserve_device_write(new_len).unwrap();
        device_write(dev.as_ref(), w.table(), 3333, &body);
        w.commit(new_len).unwrap();
        fs.sync().unwrap();
        let log = dev.take_log();
        let mut new = old.clone();
        new.extend_from_slice(&body);

        let check = |img: MemDevice, what: &str| -> bool {
            let img = Arc::new(img);
            let fs = FileSystem::mount(img.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
            let got = read_all(&fs, "ckpt");
            let is_new = if got.len() == old.len() {
                assert_same(&got, &old, what);
                false
            } else {
                assert_same(&got, &new, what);
                true
            };
            drop(fs);
            let rep = fsck(img, &FsckOptions::default()).unwrap();
            assert!(rep.is_clean(), "{what}: {:?}", rep.problems);
            is_new
        };
        let mut saw = (false, false);
        let cur = base.duplicate();
        for k in 0..=log.len() {
            let is_new = check(cur.duplicate(), &format!("lba {lba}: prefix {k}"));
            if is_new {
                saw.1 = true
            } else {
                saw.0 = true
            }
            points += 1;
            if let Some(op) = log.get(k) {
                let n = op.lba_len(lba);
                for _ in 0..if n > 1 { 3 } else { 0 } {
                    let img = cur.duplicate();
                    let keep: Vec<bool> = (0..n).map(|_| r.random_bool(0.5)).collect();
                    CrashDevice::apply_torn(&img, op, |i| keep[i as usize]);
                    check(img, &format!("lba {lba}: prefix {k} + torn"));
                    points += 1;
                }
                CrashDevice::apply(&cur, op);
            }
        }
        assert_eq!(saw, (true, true), "lba {lba}: both lengths reached");
    }
    println!("device-write commits: {points} crash points, each the old or the new length");
}
