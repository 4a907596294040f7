//! Entry points shared by the cargo-fuzz targets (`blockfs/fuzz/`) and the test that replays
//! their fixed corpus, so both exercise exactly the same code.

use std::sync::Arc;

use crate::format::{RecordLimits, Superblock, decode_chunk, decode_root};
use crate::{FileSystem, FsckOptions, MemDevice, OpenMode, fsck};

/// What [`exercise_image`] got to do with an image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Mounted; every file listed and read; fsck clean.
    Mounted,
    /// Mount refused it; fsck (with repair) ran on it.
    Refused,
}

/// Mounts `data` as a device of 512-byte LBAs; if that works lists and reads every file (up to
/// 1 MiB each) and checks fsck agrees; if not runs fsck with repair, then tries mounting
/// again. Must not panic, whatever `data` holds.
pub fn exercise_image(data: &[u8]) -> Outcome {
    let dev = Arc::new(MemDevice::from_image(data, 512));
    match FileSystem::mount(dev.clone()) {
        Ok(fs) => {
            let mut buf = vec![0u8; 1 << 20];
            for st in fs.list("") {
                if let Ok(f) = fs.open(&st.name, OpenMode::ReadOnly) {
                    let _ = f.read_at(0, &mut buf);
                    let _ = f.extent_table();
                }
            }
            drop(fs);
            let report = fsck(dev, &FsckOptions::default());
            assert!(
                report.is_ok_and(|r| r.problems.is_empty()),
                "mount accepted an image fsck finds problems in"
            );
            Outcome::Mounted
        }
        Err(_) => {
            if let Ok(report) = fsck(dev.clone(), &FsckOptions { repair: true })
                && !report.repairs.is_empty()
                && report.is_consistent()
            {
                assert!(
                    FileSystem::mount(dev).is_ok(),
                    "repair said consistent but mount refuses"
                );
            }
            Outcome::Refused
        }
    }
}

/// Feeds `data` to each metadata decoder directly, without checksums in the way: the first
/// 256 bytes as a superblock, the rest as a root run and as a chunk checked against it.
pub fn exercise_parsers(data: &[u8]) {
    let sb = Superblock::decode(data).ok();
    let sb = sb.unwrap_or_else(|| {
        let mut sb = crate::format::zeroed_superblock();
        sb.block_size = 4096;
        sb.block_count = 1 << 20;
        sb.generation = 5;
        sb
    });
    let rest = data.get(256..).unwrap_or(&[]);
    let _ = decode_root(rest, &sb);
    let lim = RecordLimits {
        block_size: 4096,
        block_count: 1 << 20,
        generation: 5,
    };
    let records = rest
        .get(8..12)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let _ = decode_chunk(rest, records.min(1 << 16), &lim);
}
