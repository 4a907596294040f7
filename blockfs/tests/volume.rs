//! blockfs on striped volumes: 1 to 4 members, memory devices and software NVMe controllers;
//! files written, the volume assembled again from its members, every byte and fsck checked,
//! and each member holding exactly the stripe units the layout gives it.

mod common;

use std::sync::Arc;

use blockfs::device::ReadReq;
use blockfs::{
    BlockDevice, FileSystem, FsckOptions, MemDevice, MkfsOptions, NvmeBlockDevice,
    NvmeDeviceOptions, StripedVolume, VolumeError, fsck,
};
use common::*;
use nvme::Controller;

/// Writes files of awkward sizes, syncs, assembles the volume again from `members` and checks
/// every file, fsck, and that the member bytes are the volume's as the layout places them.
fn files_survive_reassembly(members: Vec<Arc<dyn BlockDevice>>, stripe: u64, seed: u64) {
    let n = members.len();
    let v =
        Arc::new(StripedVolume::create(members.clone(), stripe, [n as u8; 16]).expect("create"));
    let fs = FileSystem::mkfs(v.clone(), &MkfsOptions::default()).expect("mkfs");
    let mut r = rng(seed);
    let files: Vec<(String, Vec<u8>)> = [0usize, 1, 4095, 4096, 65537, 300_001, 1 << 20]
        .iter()
        .enumerate()
        .map(|(i, &len)| (format!("d/f{i}"), random_bytes(&mut r, len)))
        .collect();
    for (name, data) in &files {
        put(&fs, name, data);
    }
    fs.sync().expect("sync");
    drop(fs);
    let again = Arc::new(StripedVolume::open(members.clone()).expect("assemble"));
    let fs = FileSystem::mount(again.clone()).expect("mount");
    for (name, data) in &files {
        assert_same(&read_all(&fs, name), data, name);
    }
    drop(fs);
    assert!(
        fsck(again.clone(), &FsckOptions::default())
            .expect("fsck")
            .is_consistent()
    );
    // Every volume LBA's bytes are on the member and at the LBA the layout gives.
    let size = again.lba_size() as usize;
    let mut whole = vec![0u8; again.lba_count() as usize * size];
    again
        .read(&mut [ReadReq {
            lba: 0,
            buf: &mut whole,
        }])
        .expect("read the volume");
    let mut one = vec![0u8; size];
    for x in (0..again.lba_count()).step_by(97) {
        let (m, ml) = again.locate(x);
        members[m]
            .read(&mut [ReadReq {
                lba: ml,
                buf: &mut one,
            }])
            .expect("read a member");
        assert_eq!(
            one,
            whole[x as usize * size..][..size],
            "volume LBA {x} ({n} members)"
        );
    }
}

#[test]
fn blockfs_on_volumes_of_one_to_four_memory_devices() {
    for n in 1..=4 {
        for (lba, stripe) in [(512u32, 4096u64), (4096, 128 << 10)] {
            let members: Vec<Arc<dyn BlockDevice>> = (0..n)
                .map(|_| {
                    Arc::new(MemDevice::new(lba, (32 << 20) / lba as u64)) as Arc<dyn BlockDevice>
                })
                .collect();
            files_survive_reassembly(members, stripe, n as u64);
        }
    }
}

#[test]
fn blockfs_on_volumes_of_software_controllers() {
    for n in 1..=4 {
        let ctrls: Vec<Controller> = (0..n).map(|_| controller(24 << 20, 512)).collect();
        let members: Vec<Arc<dyn BlockDevice>> = ctrls
            .iter()
            .map(|c| {
                Arc::new(NvmeBlockDevice::new(c, 1, &NvmeDeviceOptions::default()).expect("dev"))
                    as Arc<dyn BlockDevice>
            })
            .collect();
        files_survive_reassembly(members, 128 << 10, 10 + n as u64);
    }
}

#[test]
fn a_wrong_member_set_is_refused_and_the_right_one_still_mounts() {
    let members: Vec<Arc<dyn BlockDevice>> = (0..3)
        .map(|_| Arc::new(MemDevice::new(512, 16384)) as Arc<dyn BlockDevice>)
        .collect();
    let v = Arc::new(StripedVolume::create(members.clone(), 65536, [9; 16]).unwrap());
    let fs = FileSystem::mkfs(v, &MkfsOptions::default()).unwrap();
    put(&fs, "kept", b"volume data");
    fs.sync().unwrap();
    drop(fs);
    let swapped = vec![members[1].clone(), members[0].clone(), members[2].clone()];
    assert!(matches!(
        StripedVolume::open(swapped),
        Err(VolumeError::Reordered {
            position: 0,
            member: 1
        })
    ));
    assert!(matches!(
        StripedVolume::open(members[..2].to_vec()),
        Err(VolumeError::Missing { .. })
    ));
    // A member alone is no file system: its first block is the volume label.
    assert!(FileSystem::mount(members[0].clone()).is_err());
    let fs = FileSystem::mount(Arc::new(StripedVolume::open(members).unwrap())).unwrap();
    assert_eq!(read_all(&fs, "kept"), b"volume data");
}

/// Power cuts across the members of a volume: every member logs its writes and flushes while a
/// workload syncs eight times; a crash state keeps, on each member independently, any prefix
/// of its log between two volume flushes (a volume flush is one flush on every member, so
/// members drift apart only between flushes). Every such state must assemble, mount, pass
/// fsck and show exactly one synced state, no older than the last sync all members had
/// completed.
#[test]
fn crash_points_across_members_mount_a_synced_state() {
    use blockfs::{CrashDevice, LoggedOp};
    use rand::Rng;
    use std::collections::BTreeMap;

    let crash: Vec<Arc<CrashDevice>> = (0..3)
        .map(|_| Arc::new(CrashDevice::new(MemDevice::new(512, 8192))))
        .collect();
    let members: Vec<Arc<dyn BlockDevice>> = crash
        .iter()
        .map(|c| c.clone() as Arc<dyn BlockDevice>)
        .collect();
    let v = Arc::new(StripedVolume::create(members, 8192, [5; 16]).unwrap());
    let fs = FileSystem::mkfs(v.clone(), &MkfsOptions::default()).unwrap();
    fs.sync().unwrap();
    let bases: Vec<MemDevice> = crash.iter().map(|c| c.start_recording()).collect();
    let mut r = rng(21);
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    // (the state, each member's log length when the sync returned)
    type Synced = (BTreeMap<String, Vec<u8>>, Vec<usize>);
    let mut synced: Vec<Synced> = vec![(files.clone(), vec![0; crash.len()])];
    for round in 0..8 {
        let name = format!("f{}", round % 3);
        if round % 4 == 3 {
            if files.remove(&name).is_some() {
                fs.remove(&name).unwrap();
            }
        } else {
            let data = random_bytes(&mut r, 1000 + round * 9000);
            if files.contains_key(&name) {
                fs.remove(&name).unwrap();
            }
            put(&fs, &name, &data);
            files.insert(name, data);
        }
        fs.sync().unwrap();
        synced.push((files.clone(), crash.iter().map(|c| c.log_len()).collect()));
    }
    drop(fs);
    let logs: Vec<Vec<LoggedOp>> = crash.iter().map(|c| c.take_log()).collect();
    // Each member's flush positions: window j is [after flush j-1, through flush j).
    let flushes: Vec<Vec<usize>> = logs
        .iter()
        .map(|l| {
            let mut f = vec![0];
            f.extend(
                l.iter()
                    .enumerate()
                    .filter(|(_, op)| **op == LoggedOp::Flush)
                    .map(|(i, _)| i + 1),
            );
            f.push(l.len());
            f
        })
        .collect();
    let epochs = flushes.iter().map(|f| f.len() - 1).min().unwrap();
    assert!(
        flushes.iter().all(|f| f.len() - 1 == epochs),
        "a volume flush reaches every member"
    );
    let mut states = 0;
    for e in 0..epochs {
        for _ in 0..6 {
            let cut: Vec<usize> = flushes
                .iter()
                .map(|f| r.random_range(f[e]..=f[e + 1]))
                .collect();
            let replayed: Vec<Arc<dyn BlockDevice>> = bases
                .iter()
                .zip(&logs)
                .zip(&cut)
                .map(|((b, l), &n)| {
                    Arc::new(CrashDevice::replay(b, &l[..n])) as Arc<dyn BlockDevice>
                })
                .collect();
            let vol = Arc::new(StripedVolume::open(replayed).expect("the labels survive"));
            assert!(
                fsck(vol.clone(), &FsckOptions::default())
                    .expect("fsck")
                    .is_consistent(),
                "epoch {e}, cut {cut:?}"
            );
            let fs = FileSystem::mount(vol).expect("mount");
            let seen: BTreeMap<String, Vec<u8>> = fs
                .list("")
                .into_iter()
                .map(|st| (st.name.clone(), read_all(&fs, &st.name)))
                .collect();
            let floor = synced
                .iter()
                .rposition(|(_, lens)| lens.iter().zip(&cut).all(|(l, c)| c >= l))
                .unwrap();
            let k = synced
                .iter()
                .position(|(f, _)| *f == seen)
                .unwrap_or_else(|| panic!("epoch {e}, cut {cut:?}: not a synced state"));
            assert!(
                synced[floor..].iter().any(|(f, _)| *f == seen),
                "epoch {e}, cut {cut:?}: state {k} is older than the completed sync {floor}"
            );
            states += 1;
        }
    }
    assert!(states >= 6 * 8, "{states} crash states");
}

/// The GPU's view of files on a volume (issue 23): the file's extent table (volume LBAs) cut
/// into one table per member (`member_tables`) and a byte range cut into runs on one member
/// each (`member_runs`). For fragmented files of awkward sizes on volumes of 1 to 4 members
/// and several stripe sizes: the runs tile the range (up to the end of the file) in order,
/// every byte of a run is found by its member's table, and only by it, at the member LBA that
/// holds the file's byte there.
#[test]
fn member_tables_and_runs_find_every_byte_on_its_member() {
    let mut r = rng(23);
    for (n, stripe) in [
        (1usize, 4096u64),
        (2, 4096),
        (3, 8192),
        (4, 65536),
        (3, 1 << 20),
    ] {
        let members: Vec<Arc<dyn BlockDevice>> = (0..n)
            .map(|_| Arc::new(MemDevice::new(512, 24 << 11)) as Arc<dyn BlockDevice>)
            .collect();
        let v = Arc::new(StripedVolume::create(members.clone(), stripe, [3; 16]).expect("create"));
        let fs = FileSystem::mkfs(v.clone(), &MkfsOptions::default()).expect("mkfs");
        // Two files appended in turn, so both are fragmented.
        let a_len = 700_001usize;
        let (a, b) = (random_bytes(&mut r, a_len), random_bytes(&mut r, a_len));
        let fa = fs.create("v/a", &Default::default()).expect("create a");
        let fb = fs.create("v/b", &Default::default()).expect("create b");
        for at in (0..a_len).step_by(40_000) {
            let end = (at + 40_000).min(a_len);
            fa.write_at(at as u64, &a[at..end]).expect("write a");
            fb.write_at(at as u64, &b[at..end]).expect("write b");
        }
        fs.sync().expect("sync");
        let pinned = fa.extent_table().expect("table");
        let table = pinned.table();
        assert!(table.extents().len() > 1, "the file is fragmented");
        let tables = v.member_tables(table);
        assert_eq!(tables.len(), n);
        let mut one = vec![0u8; 512];
        for (offset, len) in [
            (0u64, a_len as u64),
            (1, 5000),
            (123_457, 300_000),
            (690_000, 99_999),
        ] {
            let runs = v.member_runs(table, 0, offset, len);
            let end = (offset + len).min(a_len as u64);
            let mut at = offset;
            for run in &runs {
                assert_eq!(
                    run.offset, at,
                    "{n} members, stripe {stripe}: runs in order"
                );
                assert!(run.len > 0 && run.member < n);
                // Sample the run's first, last and a middle byte.
                for pos in [
                    run.offset,
                    run.offset + run.len / 2,
                    run.offset + run.len - 1,
                ] {
                    let found: Vec<usize> = (0..n)
                        .filter(|&m| tables[m].translate(0, pos).is_some())
                        .collect();
                    assert_eq!(found, [run.member], "byte {pos}: only its member's table");
                    let t = tables[run.member].translate(0, pos).unwrap();
                    members[run.member]
                        .read(&mut [ReadReq {
                            lba: t.lba,
                            buf: &mut one,
                        }])
                        .expect("member read");
                    assert_eq!(
                        one[(pos % 512) as usize],
                        a[pos as usize],
                        "byte {pos} on member {} ({n} members, stripe {stripe})",
                        run.member
                    );
                }
                at += run.len;
            }
            assert_eq!(
                at, end,
                "the runs cover the range up to the end of the file"
            );
            if n > 1 && len > stripe * n as u64 {
                assert!(runs.len() > 1, "a long range spans members");
            }
        }
        // The other file's entries are in every member table too, with the same size.
        for t in &tables {
            assert_eq!(t.files().len(), 1);
            assert_eq!(t.files()[0].size_bytes, a_len as u64);
        }
        // A device-write reservation's runs reach the end of its allocation (a writer's
        // range), its read runs the old length.
        let dw = fb.reserve_device_write(2 * a_len as u64).expect("reserve");
        let wt = dw.table();
        let alloc = wt.files()[0].alloc_bytes;
        assert!(alloc >= 2 * a_len as u64, "{alloc}");
        let write_runs = v.member_write_runs(wt, 0, 0, u64::MAX);
        let reach = write_runs.last().map_or(0, |r| r.offset + r.len);
        assert_eq!(
            reach, alloc,
            "{n} members: writes reach the allocation's end"
        );
        assert!(
            write_runs
                .windows(2)
                .all(|w| w[0].offset + w[0].len == w[1].offset)
        );
        let read_runs = v.member_runs(wt, 0, 0, u64::MAX);
        let reach = read_runs.last().map_or(0, |r| r.offset + r.len);
        assert_eq!(reach, a_len as u64, "{n} members: reads stop at the length");
    }
}

/// Issue 53: one flipped byte in one member's label locked the whole volume, and repair could
/// not rebuild the label from the other members. `StripedVolume::open_repairing` (what
/// `fs fsck --repair` on a volume assembles with) now rebuilds it from the others' labels when
/// exactly one is damaged and the device checks out as that member, and refuses otherwise.
#[test]
fn one_damaged_member_label_is_rebuilt_from_the_others() {
    use blockfs::device::WriteReq;
    let members: Vec<Arc<dyn BlockDevice>> = (0..3)
        .map(|_| Arc::new(MemDevice::new(512, 16384)) as Arc<dyn BlockDevice>)
        .collect();
    let v = Arc::new(StripedVolume::create(members.clone(), 4096, [5; 16]).unwrap());
    let fs = FileSystem::mkfs(v, &MkfsOptions::default()).unwrap();
    let mut r = rng(4);
    let data = random_bytes(&mut r, 200_000);
    put(&fs, "striped", &data);
    fs.sync().unwrap();
    drop(fs);
    let label_of = |m: &Arc<dyn BlockDevice>| {
        let mut b = vec![0u8; 4096];
        m.read(&mut [ReadReq {
            lba: 0,
            buf: &mut b,
        }])
        .unwrap();
        b
    };
    let good = label_of(&members[1]);
    for byte in [3usize, 20, 33, 44, 57] {
        let mut bad = good.clone();
        bad[byte] ^= 0x10;
        members[1].write(&[WriteReq { lba: 0, buf: &bad }]).unwrap();
        assert!(
            StripedVolume::open(members.clone()).is_err(),
            "byte {byte}: a damaged label is refused by open"
        );
        let (v, line) = StripedVolume::open_repairing(members.clone())
            .unwrap_or_else(|e| panic!("byte {byte}: {e}"));
        let line = line.expect("a label was rebuilt");
        assert!(
            line.contains("member 1") && line.contains("rebuilt"),
            "{line}"
        );
        assert_eq!(
            label_of(&members[1]),
            good,
            "byte {byte}: the label as created"
        );
        let v = Arc::new(v);
        let report = fsck(v.clone(), &FsckOptions::default()).unwrap();
        assert!(report.is_clean(), "{report:?}");
        let fs = FileSystem::mount(v).unwrap();
        assert_eq!(read_all(&fs, "striped"), data);
        drop(fs);
        // Intact labels: nothing to do.
        let (_, line) = StripedVolume::open_repairing(members.clone()).unwrap();
        assert_eq!(line, None);
    }

    // Not recognizably the member (a blank device in its place), two damaged labels, or a
    // member whose data is not the volume's: refused, nothing written.
    let blank: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(512, 16384));
    let set = vec![members[0].clone(), blank.clone(), members[2].clone()];
    let e = StripedVolume::open_repairing(set).unwrap_err();
    assert!(e.to_string().contains("not recognizably"), "{e}");
    assert!(label_of(&blank).iter().all(|&b| b == 0), "nothing written");
    let mut bad = good.clone();
    bad[20] ^= 1;
    members[1].write(&[WriteReq { lba: 0, buf: &bad }]).unwrap();
    let other = label_of(&members[2]);
    let mut bad2 = other.clone();
    bad2[21] ^= 1;
    members[2]
        .write(&[WriteReq { lba: 0, buf: &bad2 }])
        .unwrap();
    assert!(StripedVolume::open_repairing(members.clone()).is_err());
    members[2]
        .write(&[WriteReq {
            lba: 0,
            buf: &other,
        }])
        .unwrap();
    // The superblock slots wiped (volume units 0 and 1: the first data unit of members 0 and
    // 1): with the rebuilt label the volume holds no blockfs, so the label is not rewritten.
    for m in &members[..2] {
        m.write(&[WriteReq {
            lba: 8,
            buf: &[0u8; 4096],
        }])
        .unwrap();
    }
    let e = StripedVolume::open_repairing(members.clone()).unwrap_err();
    assert!(e.to_string().contains("no valid blockfs superblock"), "{e}");
    assert_eq!(label_of(&members[1]), bad, "nothing written");
}
