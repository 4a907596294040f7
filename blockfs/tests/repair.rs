//! What repair keeps and what it says it lost (issue 53): one invalid record costs only that
//! record; a generation counter at its end is refused, never wrapped; a newest superblock
//! with another geometry is rolled back from whatever it claims; a rollback names the files it
//! lost or reverted; and a hostile image is refused before anything its sizes claim is read.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use blockfs::device::{DeviceError, ReadReq, WriteReq};
use blockfs::format::{
    self, RecordLimits, RootImage, SUPERBLOCK_SLOTS, Superblock, decode_chunk, decode_root,
    encode_root,
};
use blockfs::{BlockDevice, Error, FileSystem, FsckOptions, FsckReport, MemDevice, OpenMode, fsck};
use common::*;

const LBA: u32 = 512;
const BS: usize = 4096;

/// A device image edited in place, with the checksums of what is changed recomputed.
struct Img(Vec<u8>);

impl Img {
    fn of(dev: &MemDevice) -> Self {
        Img(dev.to_image())
    }

    fn device(&self) -> Arc<MemDevice> {
        Arc::new(MemDevice::from_image(&self.0, LBA))
    }

    /// Both superblocks, newest first.
    fn sbs(&self) -> (Superblock, Superblock) {
        let [a, b] = SUPERBLOCK_SLOTS
            .map(|o| Superblock::decode(&self.0[o as usize..o as usize + 512]).unwrap());
        if a.generation > b.generation {
            (a, b)
        } else {
            (b, a)
        }
    }

    fn root(&self, sb: &Superblock) -> RootImage {
        let at = sb.root_bno as usize * BS;
        decode_root(&self.0[at..at + sb.root_bytes as usize], sb).unwrap()
    }

    fn write_sb(&mut self, sb: &Superblock) {
        let at = SUPERBLOCK_SLOTS[sb.slot as usize] as usize;
        self.0[at..at + 256].copy_from_slice(&sb.encode());
    }

    /// Rewrites `sb`'s root as `root` (checksums recomputed) and `sb` to match.
    fn write_root(&mut self, sb: &mut Superblock, root: &RootImage) {
        let bytes = encode_root(&root.header, &root.chunks, &root.free, &root.pending);
        assert!(bytes.len() <= sb.root_blocks as usize * BS);
        let at = sb.root_bno as usize * BS;
        self.0[at..at + bytes.len()].copy_from_slice(&bytes);
        sb.root_bytes = bytes.len() as u32;
        sb.root_crc = format::crc(&bytes);
        self.write_sb(sb);
    }

    /// The chunk at `bno`'s bytes, as the newest root describes it.
    fn chunk(&self, bno: u64) -> Vec<u8> {
        let (new, _) = self.sbs();
        let d = self
            .root(&new)
            .chunks
            .into_iter()
            .find(|d| d.bno == bno)
            .unwrap();
        self.0[bno as usize * BS..][..d.bytes as usize].to_vec()
    }

    /// Replaces the chunk at `bno` (same length) and fixes its checksum in every root that
    /// names it.
    fn write_chunk(&mut self, bno: u64, bytes: &[u8]) {
        self.0[bno as usize * BS..][..bytes.len()].copy_from_slice(bytes);
        let (a, b) = self.sbs();
        for mut sb in [a, b] {
            let mut root = self.root(&sb);
            let mut named = false;
            for d in root.chunks.iter_mut().filter(|d| d.bno == bno) {
                assert_eq!(d.bytes as usize, bytes.len());
                d.crc = format::crc(bytes);
                named = true;
            }
            if named {
                self.write_root(&mut sb, &root);
            }
        }
    }
}

fn files_of(fs: &FileSystem) -> BTreeMap<String, Vec<u8>> {
    fs.list("")
        .into_iter()
        .map(|s| (s.name.clone(), read_all(fs, &s.name)))
        .collect()
}

fn repair(dev: &Arc<MemDevice>) -> FsckReport {
    fsck(dev.clone(), &FsckOptions { repair: true }).unwrap()
}

/// Repairs `dev`, which must leave it consistent with a repair that says every one of `says`.
fn repair_saying(dev: &Arc<MemDevice>, says: &[&str]) -> FsckReport {
    let report = repair(dev);
    assert!(report.is_consistent(), "{report:#?}");
    assert!(
        report
            .repairs
            .iter()
            .any(|r| says.iter().all(|s| r.contains(s))),
        "{:#?}",
        report.repairs
    );
    report
}

/// 50 small files committed together: one chunk, records in creation order.
fn one_chunk_of_files() -> (Arc<MemDevice>, BTreeMap<String, Vec<u8>>) {
    let (dev, fs) = mem_fs(LBA, 4 << 20);
    let mut r = rng(53);
    let mut model = BTreeMap::new();
    for i in 0..50 {
        let name = format!("files/{i:03}");
        let data = random_bytes(&mut r, 10 + 37 * i);
        put(&fs, &name, &data);
        model.insert(name, data);
    }
    fs.sync().unwrap();
    // A second commit whose record does not fit in that chunk: both generations share it, so
    // damage to it leaves no intact generation to roll back to and repair salvages.
    let name = format!("long/{}", "n".repeat(1000));
    put(&fs, &name, b"long");
    model.insert(name, b"long".to_vec());
    fs.sync().unwrap();
    drop(fs);
    (dev, model)
}

/// The chunk holding `files/*` and the byte offset of each of its records.
fn record_offsets(img: &Img) -> (u64, Vec<(usize, String)>) {
    let (new, _) = img.sbs();
    let root = img.root(&new);
    let d = *root.chunks.iter().max_by_key(|d| d.records).unwrap();
    assert!(
        img.root(&img.sbs().1).chunks.contains(&d),
        "both generations share the chunk"
    );
    let bytes = img.chunk(d.bno);
    let lim = RecordLimits {
        block_size: BS as u32,
        block_count: new.block_count,
        generation: new.generation,
    };
    let recs = decode_chunk(&bytes, d.records, &lim).records;
    let mut at = 32;
    let mut out = Vec::new();
    for r in recs {
        out.push((at, r.name.clone()));
        at += r.encoded_len();
    }
    (d.bno, out)
}

/// Each record's byte offset in its chunk and its name, as [`record_offsets`] finds them.
type Records = Vec<(usize, String)>;

/// [`one_chunk_of_files`] with its `files/*` chunk edited by `edit` (given the chunk's bytes and
/// [`record_offsets`]' records), checksums recomputed: the damaged device, the files as
/// written, and the records.
fn one_damaged_chunk(
    edit: impl FnOnce(&mut Vec<u8>, &[(usize, String)]),
) -> (Arc<MemDevice>, BTreeMap<String, Vec<u8>>, Records) {
    let (dev, model) = one_chunk_of_files();
    let mut img = Img::of(&dev);
    let (bno, recs) = record_offsets(&img);
    let mut bytes = img.chunk(bno);
    edit(&mut bytes, &recs);
    img.write_chunk(bno, &bytes);
    (img.device(), model, recs)
}

/// Issue 53: one record crafted invalid (checksums recomputed) used to drop every later record
/// of its chunk. Repair now drops that record only, keeps the others byte for byte, and names
/// the one it lost.
#[test]
fn an_invalid_record_costs_only_itself() {
    let (dev, model, recs) = one_damaged_chunk(|bytes, recs| {
        assert_eq!(recs.len(), 50, "the fixture wants one chunk of 50 records");
        // An unknown flag: the record's framing holds, its contents are invalid.
        bytes[recs[12].0 + 6] = 0x08;
    });
    let victim = recs[12].1.clone();
    assert!(matches!(
        FileSystem::mount(dev.clone()),
        Err(Error::Corrupt { .. })
    ));
    let report = repair_saying(&dev, &["dropped that record only", &victim]);
    let got = files_of(&FileSystem::mount(dev.clone()).unwrap());
    let mut want = model.clone();
    want.remove(&victim);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "every other file kept"
    );
    assert_eq!(got, want, "with its bytes");
    assert_eq!(report.lost, vec![victim]);
    assert!(report.reverted.is_empty(), "{:?}", report.reverted);
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
}

/// A record whose length field itself is broken: decoding resumes at the next offset where a
/// whole valid record starts, so only that record is lost, and it is named (its name still
/// fills the gap exactly).
#[test]
fn a_broken_record_length_costs_only_that_record() {
    let (dev, model, recs) = one_damaged_chunk(|bytes, recs| {
        let at = recs[30].0;
        bytes[at..at + 4].copy_from_slice(&12345u32.to_le_bytes());
    });
    let victim = recs[30].1.clone();
    let report = repair_saying(&dev, &["framing is broken", "starts again"]);
    let got = files_of(&FileSystem::mount(dev).unwrap());
    let mut want = model;
    want.remove(&victim);
    assert_eq!(got, want, "every other record kept");
    assert_eq!(report.lost, [victim]);
}

/// Where nothing valid follows a broken length field, the rest of the chunk is lost, and the
/// report says that it could not be parsed and how many records that cost.
#[test]
fn a_broken_record_length_before_garbage_says_the_rest_cannot_be_parsed() {
    let (dev, model, recs) = one_damaged_chunk(|bytes, recs| bytes[recs[30].0..].fill(0xA5));
    repair_saying(&dev, &["cannot be parsed", "20 records lost"]);
    let got = files_of(&FileSystem::mount(dev).unwrap());
    let kept: BTreeMap<String, Vec<u8>> = model
        .into_iter()
        .filter(|(n, _)| !recs[30..].iter().any(|(_, r)| r == n))
        .collect();
    assert_eq!(
        got, kept,
        "the records before the broken one, and the other chunk's"
    );
}

/// Rewrites both generations of `dev` as `top - 1` and `top` (roots and superblocks, every
/// checksum recomputed).
fn renumber(dev: &MemDevice, top: u64) -> Img {
    let mut img = Img::of(dev);
    let (new, old) = img.sbs();
    for (mut sb, g) in [(new, top), (old, top - 1)] {
        let mut root = img.root(&sb);
        root.header.generation = g;
        // Slots follow the generation's parity.
        sb.generation = g;
        sb.slot = (g % 2) as u32;
        img.write_root(&mut sb, &root);
    }
    img
}

/// Issue 53: at generation 2^64 - 1 a commit used to wrap (a debug build panics). It now
/// refuses with an error that says why, and the file system still mounts as it was.
#[test]
fn a_commit_at_the_last_generation_is_refused() {
    let (dev, fs) = mem_fs(LBA, 4 << 20);
    put(&fs, "kept", b"the bytes before the end of generations");
    fs.sync().unwrap();
    drop(fs);
    // The newest generation is odd: 2^64 - 1 goes to slot 1, as the renumbering needs.
    let img = renumber(&dev, u64::MAX);
    let dev = img.device();
    let fs = FileSystem::mount(dev.clone()).expect("a file system at the last generation mounts");
    assert_eq!(
        read_all(&fs, "kept"),
        b"the bytes before the end of generations"
    );
    put(&fs, "more", b"x");
    match fs.sync() {
        Err(e @ Error::Corrupt { .. }) => {
            assert!(e.to_string().contains("last generation"), "{e}")
        }
        other => panic!("a commit after generation 2^64-1: {other:?}"),
    }
    drop(fs);
    let fs = FileSystem::mount(dev.clone()).expect("still mounts");
    assert_eq!(
        fs.list("")
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>(),
        ["kept"]
    );
}

/// Issue 53: repair at generation 2^64 - 1 used to wrap its `+1` (a debug build panics in
/// fsck). It now refuses, says why, and leaves the image as it was.
#[test]
fn repair_at_the_last_generation_refuses_and_leaves_the_image() {
    let (dev, fs) = mem_fs(LBA, 4 << 20);
    put(&fs, "kept", b"the bytes before the end of generations");
    fs.sync().unwrap();
    drop(fs);
    let dev = renumber(&dev, u64::MAX).device();
    // Damage the newest root: repair would roll back and commit twice, past the counter.
    let mut img = Img::of(&dev);
    let (new, _) = img.sbs();
    img.0[new.root_bno as usize * BS + 70] ^= 0x40;
    let dev = img.device();
    let report = repair(&dev);
    let why = report.unrepairable.clone().expect("refused");
    assert!(why.contains("generation") && why.contains("wrap"), "{why}");
    assert!(!report.is_consistent());
    assert_eq!(dev.to_image(), img.0, "the image is left as it was");
    // The intact older slot is still there for a build that can renumber.
    let (_, old) = Img::of(&dev).sbs();
    assert_eq!(old.generation, u64::MAX - 1);
}

/// Two generations: `old` files, then `new` adds one and replaces another.
struct TwoGens {
    dev: Arc<MemDevice>,
    old: BTreeMap<String, Vec<u8>>,
    new: BTreeMap<String, Vec<u8>>,
}

fn two_generations() -> TwoGens {
    let (dev, fs) = mem_fs(LBA, 4 << 20);
    let mut r = rng(7);
    let mut model = BTreeMap::new();
    for i in 0..20 {
        let name = format!("keep/{i:02}");
        let data = random_bytes(&mut r, 500 + 311 * i);
        put(&fs, &name, &data);
        model.insert(name, data);
    }
    fs.sync().unwrap();
    let old = model.clone();
    put(&fs, "added", &random_bytes(&mut r, 777));
    // Grown (nothing freed, so the sync commits once and the older slot is exactly `old`).
    let f = fs.open("keep/03", OpenMode::ReadWrite).unwrap();
    let len = f.len().unwrap();
    f.write_at(len, &random_bytes(&mut r, 9000)).unwrap();
    drop(f);
    fs.sync().unwrap();
    drop(fs);
    let img = Img::of(&dev);
    let (newest, older) = img.sbs();
    assert_eq!(
        newest.generation,
        older.generation + 1,
        "consecutive generations"
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    let new = files_of(&fs);
    drop(fs);
    TwoGens { dev, old, new }
}

/// Issue 53: a rollback never said which files it lost or reverted. It now fills
/// `FsckReport::lost` and `FsckReport::reverted`.
#[test]
fn a_rollback_names_the_files_it_lost_and_reverted() {
    let t = two_generations();
    let mut img = Img::of(&t.dev);
    let (new, _) = img.sbs();
    // A chunk only the newest generation uses, damaged: its records still decode.
    let (_, older) = img.sbs();
    let old_root = img.root(&older);
    let fresh = img
        .root(&new)
        .chunks
        .into_iter()
        .find(|d| !old_root.chunks.contains(d))
        .unwrap();
    img.0[fresh.bno as usize * BS + 28] ^= 0x01; // the chunk header's reserved bytes
    let dev = img.device();
    let report = repair(&dev);
    assert!(
        report.repairs.iter().any(|r| r.contains("rolled back")),
        "{:#?}",
        report.repairs
    );
    assert_eq!(files_of(&FileSystem::mount(dev).unwrap()), t.old);
    assert_eq!(report.lost, vec!["added".to_string()]);
    assert_eq!(report.reverted, vec!["keep/03".to_string()]);
    assert!(t.new.contains_key("added"));
}

/// Issue 53: a newest superblock with another block size (checksum fixed) made repair give up
/// although the older slot was intact. Repair now rolls back to the slot whose root checks
/// out, and rewrites the other with the right geometry.
#[test]
fn a_newest_superblock_with_another_block_size_rolls_back() {
    rolls_back_from_another_geometry("block size", |sb| sb.block_size *= 2);
}

/// The same for a changed block count, which repair used to adopt for the rebuilt file system.
#[test]
fn a_newest_superblock_with_another_block_count_rolls_back() {
    rolls_back_from_another_geometry("block count", |sb| sb.block_count -= 100);
}

fn rolls_back_from_another_geometry(field: &str, edit: fn(&mut Superblock)) {
    let t = two_generations();
    {
        let mut img = Img::of(&t.dev);
        let (mut new, old) = img.sbs();
        edit(&mut new);
        img.write_sb(&new);
        let dev = img.device();
        assert!(FileSystem::mount(dev.clone()).is_err(), "{field}");
        let report = repair(&dev);
        assert!(report.is_consistent(), "{field}: {report:#?}");
        assert!(
            report.repairs.iter().any(|r| r.contains("rolled back")),
            "{field}: {:#?}",
            report.repairs
        );
        let fs = FileSystem::mount(dev.clone()).unwrap();
        assert_eq!(files_of(&fs), t.old, "{field}");
        drop(fs);
        // The newest root is still readable with the true geometry: what the rollback lost.
        assert_eq!(report.lost, ["added"], "{field}");
        assert_eq!(report.reverted, ["keep/03"], "{field}");
        let (a, b) = Img::of(&dev).sbs();
        for sb in [a, b] {
            assert_eq!(
                (sb.block_size, sb.block_count),
                (old.block_size, old.block_count),
                "{field}: both slots hold the true geometry"
            );
        }
    }
}

/// A device that records the largest read it was asked for, so a test can see how much a
/// mount or fsck allocated for what the metadata claims.
struct Watched {
    inner: Arc<MemDevice>,
    largest_read: AtomicU64,
}

impl BlockDevice for Watched {
    fn lba_size(&self) -> u32 {
        self.inner.lba_size()
    }
    fn lba_count(&self) -> u64 {
        self.inner.lba_count()
    }
    fn read(&self, reqs: &mut [ReadReq<'_>]) -> Result<(), DeviceError> {
        let bytes: u64 = reqs.iter().map(|r| r.buf.len() as u64).sum();
        self.largest_read.fetch_max(bytes, Ordering::Relaxed);
        self.inner.read(reqs)
    }
    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError> {
        self.inner.write(reqs)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()
    }
    fn describe(&self) -> String {
        "watched memory device".into()
    }
}

/// Issue 53: mounting a hostile image allocated (and read) everything its root's chunk list
/// claimed before checking any checksum. Sizes are now checked against the device and the
/// format's bounds first: the image is refused with a corruption error after reading a few
/// blocks.
#[test]
fn a_hostile_chunk_size_is_refused_before_it_is_read() {
    // A sparse 1 GiB device with a few files.
    let (dev, fs) = mem_fs(LBA, 1 << 30);
    put(&fs, "a", b"alpha");
    put(&fs, "b", b"beta");
    fs.sync().unwrap();
    drop(fs);
    let mut image = MemDeviceImage::of(&dev);

    // (a) A chunk descriptor claiming 600 MiB for its two records (root checksums fixed).
    let (mut new, _) = image.sbs();
    let mut root = image.root(&new);
    let d = &mut root.chunks[0];
    d.bytes = 600 << 20;
    d.nblocks = (d.bytes as usize).div_ceil(BS) as u32;
    let meta: u64 =
        root.chunks.iter().map(|d| d.nblocks as u64).sum::<u64>() + new.root_blocks as u64;
    root.header.meta_blocks = meta;
    image.write_root(&mut new, &root);
    image.check_refused("file table chunk", 1 << 20);
}

/// The same for a superblock claiming a 500 MiB root run (its checksum fixed).
#[test]
fn a_hostile_root_size_is_refused_before_it_is_read() {
    let (dev, fs) = mem_fs(LBA, 1 << 30);
    put(&fs, "a", b"alpha");
    fs.sync().unwrap();
    drop(fs);
    let mut image = MemDeviceImage::of(&dev);
    let (mut new, _) = image.sbs();
    new.root_bytes = 500 << 20;
    new.root_blocks = (new.root_bytes as usize).div_ceil(BS) as u32;
    image.write_sb(&new);
    image.check_refused("root run", 1 << 20);
}

/// [`Img`] for a large sparse device: edits go to the device itself, not a copy.
struct MemDeviceImage {
    dev: Arc<MemDevice>,
}

impl MemDeviceImage {
    /// A copy of `dev` (sparse: only the written chunks are copied).
    fn of(dev: &Arc<MemDevice>) -> Self {
        let copy = Arc::new(MemDevice::new(dev.lba_size(), dev.lba_count()));
        // Metadata and data of the small fixture live in the first megabytes.
        let mut buf = vec![0u8; 8 << 20];
        dev.read(&mut [ReadReq {
            lba: 0,
            buf: &mut buf,
        }])
        .unwrap();
        copy.write(&[WriteReq { lba: 0, buf: &buf }]).unwrap();
        MemDeviceImage { dev: copy }
    }

    fn head(&self) -> Img {
        let mut buf = vec![0u8; 8 << 20];
        self.dev
            .read(&mut [ReadReq {
                lba: 0,
                buf: &mut buf,
            }])
            .unwrap();
        Img(buf)
    }

    fn sbs(&self) -> (Superblock, Superblock) {
        self.head().sbs()
    }

    fn root(&self, sb: &Superblock) -> RootImage {
        self.head().root(sb)
    }

    fn store(&self, img: &Img) {
        self.dev
            .write(&[WriteReq {
                lba: 0,
                buf: &img.0,
            }])
            .unwrap();
    }

    fn write_root(&mut self, sb: &mut Superblock, root: &RootImage) {
        let mut img = self.head();
        img.write_root(sb, root);
        self.store(&img);
    }

    fn write_sb(&mut self, sb: &Superblock) {
        let mut img = self.head();
        img.write_sb(sb);
        self.store(&img);
    }

    /// Mount and fsck refuse the image naming `what`, reading at most `max_read` bytes at once.
    #[track_caller]
    fn check_refused(&self, what: &str, max_read: u64) {
        let w = Arc::new(Watched {
            inner: self.dev.clone(),
            largest_read: AtomicU64::new(0),
        });
        let started = std::time::Instant::now();
        match FileSystem::mount(w.clone()) {
            Err(Error::Corrupt { what: got, detail }) => {
                assert!(got.contains(what), "{got}: {detail} (expected {what})")
            }
            Err(e) => panic!("expected a corruption error naming {what}, got {e}"),
            Ok(_) => panic!("mounted a hostile image"),
        }
        let read = w.largest_read.load(Ordering::Relaxed);
        assert!(
            read <= max_read,
            "mount read {read} bytes at once for a claim it should have refused unread"
        );
        let report = fsck(w.clone(), &FsckOptions::default()).unwrap();
        assert!(!report.is_clean());
        let read = w.largest_read.load(Ordering::Relaxed);
        assert!(read <= max_read, "fsck read {read} bytes at once");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "refused in {:?}",
            started.elapsed()
        );
    }
}

/// Issue 53: one record's extent crafted to overlap another file's blocks (the chunk's
/// checksum recomputed) made repair roll back, losing the last commit, or cut the file that
/// lost the lower-id race without naming it. Repair now salvages the newest generation and
/// settles the claim by the data checksums: the file whose bytes verify keeps its blocks, the
/// damaged one is cut and named, and the last commit's file survives.
#[test]
fn an_overlapping_extent_is_settled_by_the_data_checksum() {
    let (dev, fs) = mem_fs(LBA, 4 << 20);
    let mut r = rng(54);
    let mut model = BTreeMap::new();
    let put_checked = |name: &str, data: &[u8]| {
        put(&fs, name, data);
        let f = fs.open(name, OpenMode::ReadWrite).unwrap();
        f.set_data_crc(format::crc(data)).unwrap();
    };
    for i in 0..20 {
        let name = format!("keep/{i:02}");
        let data = random_bytes(&mut r, 500 + 97 * i);
        put_checked(&name, &data);
        model.insert(name, data);
    }
    fs.sync().unwrap();
    let data = random_bytes(&mut r, 3000);
    put_checked("latest", &data);
    model.insert("latest".into(), data);
    fs.sync().unwrap();
    drop(fs);
    let mut img = Img::of(&dev);
    let (new, older) = img.sbs();
    let old_root = img.root(&older);
    // The chunk the last commit rewrote (only the newest generation names it).
    let d = img
        .root(&new)
        .chunks
        .into_iter()
        .filter(|d| !old_root.chunks.contains(d))
        .max_by_key(|d| d.records)
        .unwrap();
    let mut bytes = img.chunk(d.bno);
    let lim = RecordLimits {
        block_size: BS as u32,
        block_count: new.block_count,
        generation: new.generation,
    };
    let recs = decode_chunk(&bytes, d.records, &lim).records;
    let at = |i: usize| 32 + recs[..i].iter().map(|r| r.encoded_len()).sum::<usize>();
    // keep/03 (the lower file id, which the old rule let win) now claims keep/05's block.
    let (victim, other) = (3, 5);
    assert_eq!(recs[victim].name, "keep/03");
    assert_eq!(recs[other].name, "keep/05");
    assert!(recs[victim].file_id < recs[other].file_id);
    assert!(
        recs.iter().any(|r| r.name == "latest"),
        "the chunk holds the last commit's file"
    );
    let target = recs[other].extents[0].bno;
    bytes[at(victim) + 48..at(victim) + 56].copy_from_slice(&target.to_le_bytes());
    img.write_chunk(d.bno, &bytes);
    let dev = img.device();
    assert!(matches!(
        FileSystem::mount(dev.clone()),
        Err(Error::Corrupt { .. })
    ));
    let report = repair_saying(&dev, &["keep/03", "whose data checksum verifies"]);
    assert!(
        !report.repairs.iter().any(|r| r.contains("rolled back")),
        "{:#?}",
        report.repairs
    );
    let fs = FileSystem::mount(dev.clone()).unwrap();
    let got = files_of(&fs);
    for (name, want) in &model {
        if name != "keep/03" {
            assert_eq!(got.get(name), Some(want), "{name} kept with its bytes");
        }
    }
    assert!(
        got.get("keep/03").is_none_or(|b| b != &model["keep/03"]),
        "the damaged file cannot have its bytes"
    );
    assert_eq!(report.reverted, vec!["keep/03".to_string()]);
    assert!(report.lost.is_empty(), "{:?}", report.lost);
    assert_eq!(report.lost_unknown, None);
    drop(fs);
    assert!(fsck(dev, &FsckOptions::default()).unwrap().is_clean());
}

/// Issue 53: a rollback past a newest root that does not read cannot know every file that
/// generation held. The report says so (`lost_unknown`) instead of passing its loss list off as
/// complete; a repair that read every record says nothing of the kind.
#[test]
fn a_rollback_past_an_unreadable_root_says_its_loss_list_may_be_incomplete() {
    let t = two_generations();
    let mut img = Img::of(&t.dev);
    let (new, _) = img.sbs();
    // A byte of the newest root's header: its checksum and self-checksum both fail.
    img.0[new.root_bno as usize * BS + 40] ^= 0x01;
    let dev = img.device();
    let report = repair_saying(&dev, &["rolled back"]);
    assert_eq!(files_of(&FileSystem::mount(dev).unwrap()), t.old);
    let why = report
        .lost_unknown
        .expect("the loss list may be incomplete");
    assert!(
        why.contains(&format!("root run of generation {}", new.generation)),
        "{why}"
    );

    // One invalid record, everything else read: the list is complete.
    let (dev, _, recs) = one_damaged_chunk(|bytes, recs| bytes[recs[7].0 + 6] = 0x08);
    let report = repair(&dev);
    assert_eq!(report.lost, vec![recs[7].1.clone()]);
    assert_eq!(report.lost_unknown, None);
}
