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
