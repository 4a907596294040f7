//! Helpers shared by the blockfs integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use blockfs::{BlockDevice, CreateOptions, FileSystem, MemDevice, MkfsOptions, OpenMode};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

/// A software NVMe controller with one memory namespace of `bytes` bytes, brought up.
pub fn controller(bytes: u64, lba_size: u32) -> nvme::Controller {
    let cfg = nvme_emu::EmuConfig {
        namespaces: vec![nvme_emu::config::NamespaceConfig::memory(bytes, lba_size)],
        ..nvme_emu::EmuConfig::default()
    };
    let dev = nvme_emu::EmuDevice::start(cfg).expect("software controller");
    nvme::Controller::new(dev, nvme::ControllerOptions::default()).expect("controller bring-up")
}

pub fn rng(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

pub fn random_bytes(rng: &mut SmallRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

/// Deterministic pseudo-random content addressable by offset: byte `offset + i` of stream
/// `seed` is the same however the stream is cut into buffers.
pub fn fill_stream(seed: u64, offset: u64, buf: &mut [u8]) {
    fn word(seed: u64, i: u64) -> u64 {
        let mut z = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let mut pos = offset;
    let mut out = &mut buf[..];
    while !out.is_empty() {
        let w = word(seed, pos / 8).to_le_bytes();
        let skip = (pos % 8) as usize;
        let n = (8 - skip).min(out.len());
        out[..n].copy_from_slice(&w[skip..skip + n]);
        out = &mut out[n..];
        pos += n as u64;
    }
}

/// A fresh file system on a memory device of `bytes` bytes.
pub fn mem_fs(lba_size: u32, bytes: u64) -> (Arc<MemDevice>, FileSystem) {
    let dev = Arc::new(MemDevice::new(lba_size, bytes / lba_size as u64));
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    (dev, fs)
}

pub fn read_all(fs: &FileSystem, name: &str) -> Vec<u8> {
    let f = fs.open(name, OpenMode::ReadOnly).expect("open");
    let len = f.len().unwrap() as usize;
    let mut buf = vec![0u8; len];
    assert_eq!(f.read_at(0, &mut buf).unwrap(), len);
    buf
}

pub fn put(fs: &FileSystem, name: &str, data: &[u8]) {
    let f = fs
        .create(
            name,
            &CreateOptions {
                size_hint: data.len() as u64,
            },
        )
        .expect("create");
    f.write_at(0, data).expect("write");
}

pub fn remount(dev: &Arc<impl BlockDevice + 'static>) -> FileSystem {
    FileSystem::mount(dev.clone()).expect("mount")
}

/// Compares byte strings without dumping them: reports lengths and the first difference.
#[track_caller]
pub fn assert_same(actual: &[u8], expected: &[u8], ctx: &str) {
    if actual == expected {
        return;
    }
    let first = actual.iter().zip(expected).position(|(a, b)| a != b);
    panic!(
        "{ctx}: {} bytes vs {} expected; first difference at {:?}{}",
        actual.len(),
        expected.len(),
        first,
        first.map_or(String::new(), |i| format!(
            " (got {:#04x}, expected {:#04x})",
            actual[i], expected[i]
        ))
    );
}

/// Writes `data` at file offset `offset` of file 0 of `table` straight to `dev`, as a GPU
/// kernel does through a device-write reservation: whole LBAs, translated with
/// `translate_write`, with the partial LBAs at either end read first (read-modify-write).
/// One device write per contiguous run.
pub fn device_write(dev: &dyn BlockDevice, table: &blockfs::ExtentTable, offset: u64, data: &[u8]) {
    let l = 1u64 << table.header().lba_shift;
    let end = offset + data.len() as u64;
    let mut pos = offset;
    while pos < end {
        let run_start = pos / l * l;
        let tr = table
            .translate_write(0, run_start)
            .expect("inside the reservation");
        let n = tr.contiguous_lbas.min((end - run_start).div_ceil(l));
        let run_end = run_start + n * l;
        let mut buf = vec![0u8; (n * l) as usize];
        if pos > run_start || end < run_end {
            dev.read(&mut [blockfs::ReadReq {
                lba: tr.lba,
                buf: &mut buf,
            }])
            .expect("read for read-modify-write");
        }
        let stop = end.min(run_end);
        buf[(pos - run_start) as usize..(stop - run_start) as usize]
            .copy_from_slice(&data[(pos - offset) as usize..(stop - offset) as usize]);
        dev.write(&[blockfs::WriteReq {
            lba: tr.lba,
            buf: &buf,
        }])
        .expect("device write");
        pos = stop;
    }
}
