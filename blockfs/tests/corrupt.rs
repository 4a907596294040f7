//! Damaged media: garbage, every flipped byte of every metadata structure, truncated devices,
//! and hand-made inconsistencies with valid checksums. Mount must refuse with an error naming
//! the structure and never panic; fsck --repair must bring back a consistent file system,
//! losing as little as the damage forces.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use blockfs::format::{
    self, ChunkDesc, RecordLimits, RootImage, SUPERBLOCK_SLOTS, Superblock, decode_chunk,
    decode_root, encode_chunk, encode_root,
};
use blockfs::{CreateOptions, Error, FileSystem, FsckOptions, MemDevice, MkfsOptions, fsck};
use common::*;
use rand::RngCore;

const LBA: u32 = 512;
const BS: usize = 4096;

/// An image with two generations on disk: `old` files as of the older slot, `new` as of the
/// newest, with one chunk rewritten by the last commit and others shared.
struct Fixture {
    image: Vec<u8>,
    old: BTreeMap<String, Vec<u8>>,
    new: BTreeMap<String, Vec<u8>>,
}

fn fixture() -> Fixture {
    let dev = Arc::new(MemDevice::new(LBA, (2 << 20) / LBA as u64));
    let fs = FileSystem::mkfs(
        dev.clone(),
        &MkfsOptions {
            uuid: Some([7; 16]),
            ..Default::default()
        },
    )
    .unwrap();
    let mut r = rng(42);
    let mut model = BTreeMap::new();
    // Enough records for several full chunks.
    for i in 0..100 {
        let name = format!("set/{i:03}/{}", "n".repeat(20 + i));
        let data = random_bytes(&mut r, 100 + 97 * i);
        put(&fs, &name, &data);
        model.insert(name, data);
    }
    fs.sync().unwrap();
    let old = model.clone();
    // The last commit touches one file: only its chunk is rewritten.
    let data = random_bytes(&mut r, 3000);
    put(&fs, "latest", &data);
    model.insert("latest".into(), data);
    fs.sync().unwrap();
    drop(fs);
    Fixture {
        image: dev.to_image(),
        old,
        new: model,
    }
}

fn slots(image: &[u8]) -> [Option<Superblock>; 2] {
    SUPERBLOCK_SLOTS.map(|off| Superblock::decode(&image[off as usize..off as usize + 512]).ok())
}

/// The newest superblock and its root.
fn newest(image: &[u8]) -> (Superblock, Superblock, RootImage, RootImage) {
    let [a, b] = slots(image);
    let (a, b) = (a.unwrap(), b.unwrap());
    let (new, old) = if a.generation > b.generation {
        (a, b)
    } else {
        (b, a)
    };
    let root = |sb: &Superblock| {
        let start = sb.root_bno as usize * BS;
        decode_root(&image[start..start + sb.root_bytes as usize], sb).unwrap()
    };
    let (rn, ro) = (root(&new), root(&old));
    (new, old, rn, ro)
}

fn mount_image(image: &[u8]) -> Result<FileSystem, Error> {
    FileSystem::mount(Arc::new(MemDevice::from_image(image, LBA)))
}

fn files_of(fs: &FileSystem) -> BTreeMap<String, Vec<u8>> {
    fs.list("")
        .into_iter()
        .map(|s| (s.name.clone(), read_all(fs, &s.name)))
        .collect()
}

/// Mount must fail with a corruption error whose `what` contains `needle`.
#[track_caller]
fn assert_refused(image: &[u8], needle: &str) {
    match mount_image(image) {
        Ok(_) => panic!("mounted an image with damaged {needle}"),
        Err(Error::Corrupt { what, detail }) => {
            assert!(
                what.contains(needle),
                "error names {what:?} ({detail}), expected {needle:?}"
            );
            let line = Error::Corrupt { what, detail }.to_string();
            assert!(!line.contains('\n'), "one-line error: {line}");
        }
        Err(e) => panic!("expected a corruption error naming {needle}, got {e}"),
    }
}

fn repair(image: &[u8]) -> (Arc<MemDevice>, blockfs::FsckReport) {
    let dev = Arc::new(MemDevice::from_image(image, LBA));
    let report = fsck(dev.clone(), &FsckOptions { repair: true }).unwrap();
    (dev, report)
}

#[test]
fn the_fixture_is_clean() {
    let f = fixture();
    let fs = mount_image(&f.image).unwrap();
    assert_eq!(files_of(&fs), f.new);
    let (new, _, rn, ro) = newest(&f.image);
    assert!(
        rn.chunks.len() >= 3,
        "fixture wants several chunks: {:?}",
        rn.chunks
    );
    let shared = rn.chunks.iter().filter(|c| ro.chunks.contains(c)).count();
    assert!(
        shared >= 1 && shared < rn.chunks.len(),
        "some chunks shared, some rewritten"
    );
    assert_eq!(new.block_size as usize, BS);
}

#[test]
fn every_flipped_byte_of_every_metadata_structure_is_refused() {
    let f = fixture();
    let (new, old, rn, _) = newest(&f.image);
    let mut regions: Vec<(String, usize, usize)> = vec![
        (
            format!("superblock slot {}", new.slot),
            SUPERBLOCK_SLOTS[new.slot as usize] as usize,
            256,
        ),
        (
            format!("superblock slot {}", old.slot),
            SUPERBLOCK_SLOTS[old.slot as usize] as usize,
            256,
        ),
        (
            "root run".into(),
            new.root_bno as usize * BS,
            new.root_bytes as usize,
        ),
    ];
    for c in &rn.chunks {
        regions.push((
            "file table chunk".into(),
            c.bno as usize * BS,
            c.bytes as usize,
        ));
    }
    // One device, each byte flipped in place and restored: no image copies per try.
    let dev = Arc::new(MemDevice::from_image(&f.image, LBA));
    let mut tried = 0;
    for (what, start, len) in &regions {
        for i in 0..*len {
            let at = (start + i) as u64;
            let mut byte = [0u8];
            dev.load(at, &mut byte);
            dev.store(at, &[byte[0] ^ (1 << (i % 8))]);
            match FileSystem::mount(dev.clone()) {
                Ok(_) => panic!("mounted with byte {i} of {what} flipped"),
                Err(Error::Corrupt { what: w, detail }) => {
                    assert!(
                        w.contains(what.as_str()),
                        "byte {i} of {what}: error names {w:?} ({detail})"
                    )
                }
                Err(e) => panic!("byte {i} of {what}: {e}"),
            }
            dev.store(at, &byte);
            tried += 1;
        }
    }
    assert!(FileSystem::mount(dev).is_ok(), "every byte restored");
    println!(
        "{tried} single-bit corruptions of {} metadata structures, all refused",
        regions.len()
    );
}

#[test]
fn garbage_and_truncated_images_fail_cleanly() {
    let mut r = rng(7);
    for len in [0usize, 512, 4096, 8192, 65_536, 1 << 20] {
        let mut img = vec![0u8; len];
        r.fill_bytes(&mut img);
        let e = mount_image(&img).expect_err("garbage mounted");
        assert!(
            matches!(
                e,
                Error::NotBlockfs(_) | Error::Corrupt { .. } | Error::Geometry(_)
            ),
            "{e}"
        );
        let report = fsck(
            Arc::new(MemDevice::from_image(&img, LBA)),
            &FsckOptions { repair: true },
        )
        .unwrap();
        assert!(
            !report.is_clean() && !report.is_consistent(),
            "len {len}: {report:?}"
        );
        assert!(report.unrepairable.is_some(), "len {len}: {report:?}");
    }
    // Garbage with a valid-looking magic in both slots.
    let mut img = vec![0u8; 1 << 20];
    r.fill_bytes(&mut img);
    img[..8].copy_from_slice(&format::SUPERBLOCK_MAGIC);
    img[4096..4104].copy_from_slice(&format::SUPERBLOCK_MAGIC);
    assert!(matches!(mount_image(&img), Err(Error::Corrupt { .. })));

    let f = fixture();
    for cut in [
        0,
        511,
        4096,
        8192,
        12_288,
        f.image.len() / 2,
        f.image.len() - 512,
    ] {
        let e = mount_image(&f.image[..cut]).expect_err("truncated image mounted");
        assert!(
            matches!(
                e,
                Error::NotBlockfs(_) | Error::Corrupt { .. } | Error::Geometry(_)
            ),
            "cut {cut}: {e}"
        );
        if cut > 8192 {
            assert!(e.to_string().contains("truncated"), "cut {cut}: {e}");
        }
    }
}

#[test]
fn a_damaged_older_slot_is_rewritten_without_loss() {
    let f = fixture();
    let (_, old, _, _) = newest(&f.image);
    let mut img = f.image.clone();
    img[SUPERBLOCK_SLOTS[old.slot as usize] as usize + 40] ^= 0xFF;
    assert_refused(&img, &format!("superblock slot {}", old.slot));
    let (dev, report) = repair(&img);
    assert!(
        !report.repairs.is_empty() && report.remaining.is_empty(),
        "{report:?}"
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    assert_eq!(files_of(&fs), f.new);
    drop(fs);
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
}

#[test]
fn a_damaged_newest_slot_is_recovered_from_its_root_run() {
    let f = fixture();
    let (new, _, _, _) = newest(&f.image);
    let mut img = f.image.clone();
    img[SUPERBLOCK_SLOTS[new.slot as usize] as usize..][..256].fill(0xEE);
    assert_refused(&img, &format!("superblock slot {}", new.slot));
    let (dev, report) = repair(&img);
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains("found the root run")),
        "{:?}",
        report.repairs
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    assert_eq!(files_of(&fs), f.new, "nothing lost");
    assert!(fs.generation() > new.generation);
}

#[test]
fn a_damaged_newest_generation_rolls_back_to_the_second_superblock() {
    let f = fixture();
    let (new, _, rn, ro) = newest(&f.image);
    // (a) The newest root run itself.
    let mut img = f.image.clone();
    img[new.root_bno as usize * BS + 100] ^= 0x10;
    assert_refused(&img, "root run");
    let (dev, report) = repair(&img);
    assert!(
        report.repairs[0].contains("rolled back"),
        "{:?}",
        report.repairs
    );
    assert_eq!(files_of(&FileSystem::mount(dev.clone()).unwrap()), f.old);
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());

    // (b) A chunk only the newest generation uses.
    let fresh: &ChunkDesc = rn.chunks.iter().find(|c| !ro.chunks.contains(c)).unwrap();
    let mut img = f.image.clone();
    img[fresh.bno as usize * BS + 50] ^= 0x01;
    assert_refused(&img, &format!("file table chunk at block {}", fresh.bno));
    let (dev, report) = repair(&img);
    assert!(
        report.repairs[0].contains("rolled back"),
        "{:?}",
        report.repairs
    );
    assert_eq!(files_of(&FileSystem::mount(dev.clone()).unwrap()), f.old);

    // (c) Both the newest superblock and its root: nothing to recover but the older slot.
    let mut img = f.image.clone();
    img[SUPERBLOCK_SLOTS[new.slot as usize] as usize + 3] ^= 0x01;
    img[new.root_bno as usize * BS..][..64].fill(0);
    let (dev, report) = repair(&img);
    assert!(report.remaining.is_empty(), "{report:?}");
    assert_eq!(files_of(&FileSystem::mount(dev).unwrap()), f.old);
}

#[test]
fn a_chunk_damaged_in_both_generations_is_salvaged() {
    let f = fixture();
    let (_, _, rn, ro) = newest(&f.image);
    let shared = *rn.chunks.iter().find(|c| ro.chunks.contains(c)).unwrap();
    // Damage the chunk's tail: the records before the damage still decode.
    let mut img = f.image.clone();
    let at = shared.bno as usize * BS + shared.bytes as usize - 20;
    img[at..at + 8].fill(0xFF);
    assert_refused(&img, &format!("file table chunk at block {}", shared.bno));
    let (dev, report) = repair(&img);
    assert!(
        report.remaining.is_empty() && report.unrepairable.is_none(),
        "{report:?}"
    );
    assert!(
        report.repairs.iter().any(|r| r.contains("kept the")),
        "{:?}",
        report.repairs
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    let got = files_of(&fs);
    // Whatever survived is intact, and only the damaged chunk's last records are gone.
    for (n, d) in &got {
        assert_same(d, &f.new[n], n);
    }
    let lost = f.new.len() - got.len();
    assert!(
        (1..shared.records as usize).contains(&lost),
        "lost {lost} of {} records",
        shared.records
    );
    drop(fs);
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
}

/// Rewrites the newest generation's metadata after `edit` changes its records or free list,
/// with every checksum valid: the damage only consistency checks can see.
fn forge(
    image: &[u8],
    edit: impl FnOnce(&mut Vec<Vec<format::FileRecord>>, &mut RootImage),
) -> Vec<u8> {
    let mut img = image.to_vec();
    let (new, _, mut root, _) = newest(image);
    let lim = RecordLimits {
        block_size: BS as u32,
        block_count: new.block_count,
        generation: new.generation,
    };
    let mut chunks: Vec<Vec<format::FileRecord>> = root
        .chunks
        .iter()
        .map(|c| {
            decode_chunk(
                &img[c.bno as usize * BS..][..c.bytes as usize],
                c.records,
                &lim,
            )
            .records
        })
        .collect();
    edit(&mut chunks, &mut root);
    for (d, recs) in root.chunks.iter_mut().zip(&chunks) {
        let bytes = encode_chunk(new.generation, recs);
        assert!(bytes.len() <= d.nblocks as usize * BS);
        img[d.bno as usize * BS..][..bytes.len()].copy_from_slice(&bytes);
        d.bytes = bytes.len() as u32;
        d.crc = format::crc(&bytes);
        d.records = recs.len() as u32;
    }
    root.header.free_count = root.free.len() as u32;
    root.header.file_count = chunks.iter().map(|c| c.len() as u64).sum();
    let bytes = encode_root(&root.header, &root.chunks, &root.free, &root.pending);
    assert!(bytes.len() <= new.root_blocks as usize * BS);
    img[new.root_bno as usize * BS..][..bytes.len()].copy_from_slice(&bytes);
    let mut sb = new;
    sb.root_bytes = bytes.len() as u32;
    sb.root_crc = format::crc(&bytes);
    img[SUPERBLOCK_SLOTS[sb.slot as usize] as usize..][..256].copy_from_slice(&sb.encode());
    img
}

#[test]
fn overlapping_extents_with_valid_checksums_are_refused_and_cut_by_repair() {
    let f = fixture();
    let mut victim = String::new();
    let mut owner = String::new();
    let img = forge(&f.image, |chunks, _| {
        let all: Vec<(usize, usize)> = (0..chunks.len())
            .flat_map(|c| (0..chunks[c].len()).map(move |r| (c, r)))
            .collect();
        let (ca, ra) = all[0];
        let (cb, rb) = all[all.len() - 1];
        let first = chunks[ca][ra].extents[0];
        owner = chunks[ca][ra].name.clone();
        let b = &mut chunks[cb][rb];
        victim = b.name.clone();
        b.extents[0].bno = first.bno; // now shares blocks with the first file
    });
    match mount_image(&img) {
        Err(Error::Corrupt { what, detail }) => {
            assert_eq!(what, "block map");
            assert!(detail.contains("claimed by both"), "{detail}");
        }
        other => panic!("expected an overlap error, got {:?}", other.map(|_| ())),
    }
    let (dev, report) = repair(&img);
    assert!(report.remaining.is_empty(), "{report:?}");
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains(&victim) && r.contains("cut the file")),
        "{:?}",
        report.repairs
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    assert_eq!(
        read_all(&fs, &owner),
        f.new[&owner],
        "the file that owned the blocks is intact"
    );
    assert!(fs.stat(&victim).unwrap().size < f.new[&victim].len() as u64);
    drop(fs);
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
}

#[test]
fn leaked_blocks_are_refused_and_freed_by_repair() {
    let f = fixture();
    let img = forge(&f.image, |_, root| {
        let last = root.free.last_mut().unwrap();
        last.len -= 5; // five blocks neither used nor free
    });
    match mount_image(&img) {
        Err(Error::Corrupt { what, detail }) => {
            assert_eq!(what, "block map");
            assert!(detail.contains("leaked"), "{detail}");
        }
        other => panic!("expected a leak error, got {:?}", other.map(|_| ())),
    }
    let (dev, report) = repair(&img);
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains("5 blocks were neither used nor free")),
        "{:?}",
        report.repairs
    );
    assert!(report.remaining.is_empty());
    let fs = FileSystem::mount(dev.clone()).unwrap();
    assert_eq!(files_of(&fs), f.new);
    drop(fs);
    let after = fsck(dev, &FsckOptions::default()).unwrap();
    assert!(
        after.is_clean(),
        "no leaked blocks after repair: {:?}",
        after.problems
    );
}

#[test]
fn exhausted_file_ids_refuse_new_files_and_keep_the_old_ones() {
    let f = fixture();
    // A file table (checksums valid) whose next id is the last one, as the fuzzer's forged
    // record with id u64::MAX made repair compute.
    let img = forge(&f.image, |_, root| root.header.next_file_id = u64::MAX);
    let fs = mount_image(&img).unwrap();
    match fs.create("one/more", &CreateOptions::default()) {
        Err(Error::OutOfFileIds(id)) => assert_eq!(id, u64::MAX),
        other => panic!("expected OutOfFileIds, got {:?}", other.map(|_| ())),
    }
    assert_eq!(files_of(&fs), f.new);
}

#[test]
fn both_slots_damaged_are_rebuilt_from_the_newest_root_run() {
    let f = fixture();
    let (new, _, _, _) = newest(&f.image);
    // One byte of each slot's reserved area: both fail their checksums, the metadata they
    // point to is intact.
    let mut img = f.image.clone();
    for &slot in SUPERBLOCK_SLOTS.iter() {
        img[slot as usize + 150] ^= 0x01;
    }
    assert!(mount_image(&img).is_err());
    let (dev, report) = repair(&img);
    assert!(report.unrepairable.is_none(), "{report:?}");
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains("neither superblock slot was valid")
                && r.contains(&format!("generation {}", new.generation))),
        "{:?}",
        report.repairs
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    assert_eq!(files_of(&fs), f.new, "nothing lost");
    assert!(fs.generation() > new.generation);
    drop(fs);
    let again = fsck(dev.clone(), &FsckOptions::default()).unwrap();
    assert!(again.is_clean(), "{again:?}");
    assert!(again.slots.iter().all(|s| s.generation.is_some()));

    // Whole slots overwritten with garbage that keeps no magic: nothing to take the geometry
    // from, and repair says so instead of guessing.
    let mut img = f.image.clone();
    for &slot in SUPERBLOCK_SLOTS.iter() {
        img[slot as usize..][..256].fill(0xEE);
    }
    let (_, report) = repair(&img);
    assert!(
        report
            .unrepairable
            .as_deref()
            .is_some_and(|u| u.contains("neither holds a blockfs superblock")),
        "{report:?}"
    );

    // The newest generation's root damaged too: the scan falls back to the previous one.
    let (_, old, _, _) = newest(&f.image);
    let mut img = f.image.clone();
    for &slot in SUPERBLOCK_SLOTS.iter() {
        img[slot as usize + 150] ^= 0x01;
    }
    img[new.root_bno as usize * BS + 40] ^= 0xff;
    let (dev, report) = repair(&img);
    assert!(report.unrepairable.is_none(), "{report:?}");
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains(&format!("generation {}", old.generation))),
        "{:?}",
        report.repairs
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    assert_eq!(files_of(&fs), f.old, "rolled back one commit");
}
