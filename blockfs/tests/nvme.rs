//! blockfs on the NVMe driver: `NvmeBlockDevice` over the software controller, including
//! multi-hundred-MiB put/get round trips with random content.
#![cfg(feature = "nvme")]

mod common;

use std::sync::Arc;
use std::time::Instant;

use blockfs::{
    BlockDevice, CreateOptions, FileSystem, FsckOptions, MkfsOptions, NvmeBlockDevice,
    NvmeDeviceOptions, OpenMode, ReadReq, fsck,
};
use common::*;
use nvme::Controller;

fn device(ctrl: &Controller) -> Arc<NvmeBlockDevice> {
    Arc::new(
        NvmeBlockDevice::new(ctrl, 1, &NvmeDeviceOptions::default()).expect("NVMe block device"),
    )
}

#[test]
fn file_system_on_the_software_controller() {
    for lba in [512u32, 4096] {
        let ctrl = controller(64 << 20, lba);
        let dev = device(&ctrl);
        assert!(dev.queue_pairs() > 1, "{}", dev.describe());
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let mut r = rng(lba as u64);
        let files: Vec<(String, Vec<u8>)> = (0..8)
            .map(|i| {
                (
                    format!("dir/{i}"),
                    random_bytes(&mut r, 1000 + i * 1_234_567),
                )
            })
            .collect();
        for (n, d) in &files {
            put(&fs, n, d);
        }
        // Unaligned overwrite spanning LBAs and a read of many ranges at once.
        let f = fs.open("dir/7", OpenMode::ReadWrite).unwrap();
        f.write_at(4097, &[0xAB; 10_000]).unwrap();
        let mut expect7 = files[7].1.clone();
        expect7[4097..14_097].fill(0xAB);
        fs.sync().unwrap();
        drop((f, fs));

        // A second block device (new queue pairs) on the same controller sees the same files.
        drop(dev);
        let dev = device(&ctrl);
        let fs = FileSystem::mount(dev.clone()).unwrap();
        for (n, d) in &files[..7] {
            assert_same(&read_all(&fs, n), d, n);
        }
        assert_same(&read_all(&fs, "dir/7"), &expect7, "dir/7");
        let batch = fs.open_prefix("dir/", OpenMode::ReadOnly).unwrap();
        assert_eq!(batch.table.header().nsid, 1);
        assert_eq!(batch.table.header().lba_shift, lba.trailing_zeros());
        let tr = batch.table.translate(3, 777_777).unwrap();
        let mut sector = vec![0u8; lba as usize];
        dev.read(&mut [ReadReq {
            lba: tr.lba,
            buf: &mut sector,
        }])
        .unwrap();
        assert_eq!(sector[777_777 % lba as usize], files[3].1[777_777]);
        drop((batch, fs));
        assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
    }
}

/// Streams `size` bytes of pseudo-random content into a file and back, `chunk` bytes per call,
/// and checks every byte. Returns (write, read) throughput in MiB/s.
fn round_trip(size: u64, chunk: usize) -> (f64, f64) {
    let ctrl = controller(size + (64 << 20), 512);
    let dev = device(&ctrl);
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
    let seed = 0x5EED_u64 ^ size;
    let f = fs
        .create("big.bin", &CreateOptions { size_hint: size })
        .unwrap();
    let mut buf = vec![0u8; chunk];
    let t = Instant::now();
    let mut off = 0u64;
    while off < size {
        let n = chunk.min((size - off) as usize);
        fill_stream(seed, off, &mut buf[..n]);
        f.write_at(off, &buf[..n]).unwrap();
        off += n as u64;
    }
    fs.sync().unwrap();
    let write_s = t.elapsed().as_secs_f64();
    assert_eq!(f.stat().unwrap().extents, 1);
    drop((f, fs));

    let fs = FileSystem::mount(dev.clone()).unwrap();
    let f = fs.open("big.bin", OpenMode::ReadOnly).unwrap();
    assert_eq!(f.len().unwrap(), size);
    let mut want = vec![0u8; chunk];
    let t = Instant::now();
    let mut off = 0u64;
    while off < size {
        let n = f.read_at(off, &mut buf).unwrap();
        assert_eq!(n, chunk.min((size - off) as usize));
        fill_stream(seed, off, &mut want[..n]);
        assert_same(
            &buf[..n],
            &want[..n],
            &format!("bytes {off}..{}", off + n as u64),
        );
        off += n as u64;
    }
    let read_s = t.elapsed().as_secs_f64();
    assert_eq!(f.read_at(size, &mut buf).unwrap(), 0);
    drop((f, fs));
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
    let mib = size as f64 / (1 << 20) as f64;
    (mib / write_s, mib / read_s)
}

#[test]
fn put_get_256_mib_round_trip() {
    let (w, r) = round_trip(256 << 20, 8 << 20);
    println!(
        "256 MiB through blockfs on the software controller: write {w:.0} MiB/s, read {r:.0} MiB/s (timings include content generation and checks)"
    );
}

#[test]
#[ignore = "multi-GiB: run with --ignored in release mode (cargo test --release -p blockfs --test nvme -- --ignored)"]
fn put_get_3_gib_round_trip() {
    let (w, r) = round_trip(3 << 30, 32 << 20);
    println!(
        "3 GiB through blockfs on the software controller: write {w:.0} MiB/s, read {r:.0} MiB/s"
    );
}
