//! Test helpers shared by the crate's unit tests: a seeded generator and a fragmented blockfs
//! on memory.

use std::sync::Arc;

use blockfs::{CreateOptions, FileSystem, MemDevice, MkfsOptions};

/// A small deterministic generator (no dependency for the tests).
pub struct Lcg(pub u64);
impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 17
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut g = Lcg(seed);
    (0..n).map(|_| g.next() as u8).collect()
}

/// A file system on memory with `name` of `len` bytes spread over many extents (its
/// appends interleave with another file's), and the device to look at its blocks.
pub fn fragmented(lba: u32, len: usize) -> (Arc<MemDevice>, FileSystem, Vec<u8>) {
    let dev = Arc::new(MemDevice::new(lba, (64 << 20) / lba as u64));
    let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    let data = bytes(len as u64 ^ lba as u64, len);
    let a = fs
        .create("dir/a", &CreateOptions::default())
        .expect("create");
    let b = fs
        .create("dir/b", &CreateOptions::default())
        .expect("create");
    let step = 4096 * 3 + 512;
    let mut at = 0;
    while at < len {
        let n = step.min(len - at);
        a.write_at(at as u64, &data[at..at + n]).expect("write a");
        b.write_at(at as u64, &data[at..at + n]).expect("write b");
        at += n;
    }
    fs.sync().expect("sync");
    (dev, fs, data)
}
