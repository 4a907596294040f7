//! Crafted-field mutations: every field of every metadata structure of the newest generation
//! (both superblock slots, the root header, chunk descriptors, free and pending runs, chunk
//! headers and the fields of file records) set to edge and random values, with every checksum
//! above it recomputed so the damage is invisible to the CRCs, plus random byte damage of the
//! same structures (the audit's corruption loop). For each image:
//!
//! - nothing panics (mount, listing, reads, fsck, repair, the remount after it);
//! - a mount that accepts the image returns no wrong bytes unnoticed: a file whose bytes differ
//!   from what was written fails its data checksum (`verify_data`);
//! - a mount that refuses is repaired: repair returns a file system that mounts, every file it
//!   keeps holds the bytes of the newest or the older generation (or is named as reverted, or
//!   fails its checksum), and every file of the newest generation it does not keep is named in
//!   the report's `lost` (by its name, or its name with at most two bytes damaged, as a dropped
//!   record's name reads), unless the report says that list can be incomplete (`lost_unknown`);
//! - where the damage is confined to one file record (its framing intact), repair keeps every
//!   other file of the newest generation with its bytes.
//!
//! `BLOCKFS_MUTATIONS_RECORDS` (default 12) is how many records get every field mutated;
//! `BLOCKFS_MUTATIONS_RANDOM` (default 300) how many random-damage images are tried.

mod common;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use blockfs::format::{self, SUPERBLOCK_SLOTS, Superblock, decode_root};
use blockfs::{
    CreateOptions, DataCheck, FileSystem, FsckOptions, FsckReport, MemDevice, MkfsOptions,
    OpenMode, fsck,
};
use common::*;
use rand::Rng;
use rand::rngs::SmallRng;

const LBA: u32 = 512;
const BS: usize = 4096;

type Files = BTreeMap<String, Vec<u8>>;

/// Two generations: `old` as of the older slot, `new` as of the newest; every file carries a
/// data checksum.
struct Fixture {
    image: Vec<u8>,
    old: Files,
    new: Files,
    /// Each file's id, for the report's `<file id N>` (a lost record whose name is unreadable).
    ids: BTreeMap<u64, String>,
}

fn put_checked(fs: &FileSystem, name: &str, data: &[u8]) {
    let f = fs
        .create(
            name,
            &CreateOptions {
                size_hint: data.len() as u64,
            },
        )
        .unwrap();
    f.write_at(0, data).unwrap();
    f.set_data_crc(format::crc(data)).unwrap();
}

fn fixture() -> Fixture {
    let dev = Arc::new(MemDevice::new(LBA, (4 << 20) / LBA as u64));
    let fs = FileSystem::mkfs(
        dev.clone(),
        &MkfsOptions {
            uuid: Some([9; 16]),
            ..Default::default()
        },
    )
    .unwrap();
    let mut r = rng(7);
    let mut files = Files::new();
    for i in 0..120 {
        let name = format!("data/{:02}/{i:03}-{}", i % 7, "x".repeat(i % 40));
        let data = random_bytes(&mut r, 1 + 61 * i);
        put_checked(&fs, &name, &data);
        files.insert(name, data);
    }
    fs.sync().unwrap();
    // A commit with a removal, so the newest root holds pending runs.
    fs.remove("data/03/010-xxxxxxxxxx").unwrap();
    files.remove("data/03/010-xxxxxxxxxx");
    fs.sync().unwrap();
    let old = files.clone();
    let data = random_bytes(&mut r, 5000);
    put_checked(&fs, "latest", &data);
    files.insert("latest".into(), data);
    fs.sync().unwrap();
    let ids = fs
        .list("")
        .into_iter()
        .map(|st| (st.file_id, st.name))
        .collect();
    drop(fs);
    Fixture {
        image: dev.to_image(),
        old,
        new: files,
        ids,
    }
}

/// Where a structure of the newest generation sits and how to reseal it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// Superblock slot `0` or `1` (the newest generation's or the older one's).
    Superblock(usize),
    /// The newest root run.
    Root,
    /// The newest root's chunk `i`.
    Chunk(usize),
}

/// One crafted change: `width` bytes at `offset` of `target` set to `value`.
#[derive(Clone, Debug)]
struct Mutation {
    target: Target,
    field: String,
    offset: usize,
    width: usize,
    value: u64,
    /// The damage is confined to one file record, framing intact: the record's name.
    confined_to: Option<String>,
}

/// The parsed newest generation of the fixture.
struct Layout {
    newest_slot: usize,
    sb: Superblock,
    root: Vec<u8>,
    chunks: Vec<(format::ChunkDesc, Vec<u8>)>,
}

fn layout(image: &[u8]) -> Layout {
    let sbs: Vec<Superblock> = SUPERBLOCK_SLOTS
        .iter()
        .map(|&o| Superblock::decode(&image[o as usize..o as usize + 512]).unwrap())
        .collect();
    let newest_slot = if sbs[0].generation > sbs[1].generation {
        0
    } else {
        1
    };
    let sb = sbs[newest_slot];
    let start = sb.root_bno as usize * BS;
    let root = image[start..start + sb.root_bytes as usize].to_vec();
    let img = decode_root(&root, &sb).unwrap();
    let chunks = img
        .chunks
        .iter()
        .map(|d| {
            let s = d.bno as usize * BS;
            (*d, image[s..s + d.bytes as usize].to_vec())
        })
        .collect();
    Layout {
        newest_slot,
        sb,
        root,
        chunks,
    }
}

fn get(buf: &[u8], off: usize, width: usize) -> u64 {
    let mut v = [0u8; 8];
    v[..width].copy_from_slice(&buf[off..off + width]);
    u64::from_le_bytes(v)
}

fn set(buf: &mut [u8], off: usize, width: usize, value: u64) {
    buf[off..off + width].copy_from_slice(&value.to_le_bytes()[..width]);
}

/// The image with `m` applied and every checksum above it recomputed (except the one the
/// mutation itself targets).
fn apply(image: &[u8], lay: &Layout, m: &Mutation) -> Vec<u8> {
    let mut img = image.to_vec();
    let mut root = lay.root.clone();
    let slot_off = |s: usize| SUPERBLOCK_SLOTS[s] as usize;
    let reseal_sb = |img: &mut Vec<u8>, s: usize, root_crc: Option<u32>, keep_crc: bool| {
        let o = slot_off(s);
        if let Some(c) = root_crc {
            set(&mut img[o..], 72, 4, c as u64);
        }
        if !keep_crc {
            let c = format::crc(&img[o..o + 252]);
            set(&mut img[o..], 252, 4, c as u64);
        }
    };
    let reseal_root = |img: &mut Vec<u8>, root: &mut Vec<u8>, keep_self: bool| {
        if !keep_self {
            let c = format::root_self_crc(root);
            set(root, 60, 4, c as u64);
        }
        let s = lay.sb.root_bno as usize * BS;
        img[s..s + root.len()].copy_from_slice(root);
        format::crc(root)
    };
    match m.target {
        Target::Superblock(s) => {
            let o = slot_off(s);
            set(&mut img[o..], m.offset, m.width, m.value);
            reseal_sb(&mut img, s, None, m.offset == 252);
        }
        Target::Root => {
            set(&mut root, m.offset, m.width, m.value);
            let c = reseal_root(&mut img, &mut root, m.offset == 60);
            reseal_sb(&mut img, lay.newest_slot, Some(c), false);
        }
        Target::Chunk(i) => {
            let (d, bytes) = &lay.chunks[i];
            let mut bytes = bytes.clone();
            set(&mut bytes, m.offset, m.width, m.value);
            let s = d.bno as usize * BS;
            img[s..s + bytes.len()].copy_from_slice(&bytes);
            // The descriptor's CRC (descriptor i at 96 + 24 i, crc at +16).
            set(&mut root, 96 + 24 * i + 16, 4, format::crc(&bytes) as u64);
            let c = reseal_root(&mut img, &mut root, false);
            reseal_sb(&mut img, lay.newest_slot, Some(c), false);
        }
    }
    img
}

/// Edge and random values for a field of `width` bytes holding `old`.
fn values(old: u64, width: usize, r: &mut SmallRng) -> Vec<u64> {
    let max = if width == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * width)) - 1
    };
    let mut v = vec![
        0,
        1,
        old.wrapping_add(1) & max,
        old.wrapping_sub(1) & max,
        max,
        max - 1,
        old ^ (1 << r.random_range(0..8 * width as u32)),
        r.random::<u64>() & max,
    ];
    v.retain(|&x| x != old);
    v.sort_unstable();
    v.dedup();
    v
}

/// Every crafted mutation of the fixture's newest generation.
fn mutations(lay: &Layout, records_per_run: usize, r: &mut SmallRng) -> Vec<Mutation> {
    let mut out = Vec::new();
    let mut field = |target: Target,
                     name: String,
                     buf: &[u8],
                     offset: usize,
                     width: usize,
                     confined_to: Option<String>,
                     r: &mut SmallRng| {
        for value in values(get(buf, offset, width), width, r) {
            out.push(Mutation {
                target,
                field: name.clone(),
                offset,
                width,
                value,
                confined_to: confined_to.clone(),
            });
        }
    };
    let sb_fields: &[(&str, usize, usize)] = &[
        ("version", 8, 4),
        ("header_size", 12, 4),
        ("uuid", 16, 8),
        ("generation", 32, 8),
        ("block_size", 40, 4),
        ("mkfs_lba_size", 44, 4),
        ("block_count", 48, 8),
        ("root_bno", 56, 8),
        ("root_blocks", 64, 4),
        ("root_bytes", 68, 4),
        ("root_crc", 72, 4),
        ("slot", 76, 4),
        ("incompat_features", 80, 8),
        ("ro_compat_features", 88, 8),
        ("compat_features", 96, 8),
        ("reserved", 104, 8),
        ("crc", 252, 4),
    ];
    for s in 0..2 {
        for &(n, o, w) in sb_fields {
            // Values are drawn around the newest slot's field; the older slot differs only in
            // generation, slot and root fields, for which edge values suffice.
            let bytes = zerocopy::IntoBytes::as_bytes(&lay.sb).to_vec();
            field(
                Target::Superblock(s),
                format!("superblock slot {s} {n}"),
                &bytes,
                o,
                w,
                None,
                r,
            );
        }
    }
    let root_fields: &[(&str, usize, usize)] = &[
        ("generation", 24, 8),
        ("next_file_id", 32, 8),
        ("file_count", 40, 8),
        ("chunk_count", 48, 4),
        ("free_count", 52, 4),
        ("pending_count", 56, 4),
        ("self_crc", 60, 4),
        ("data_blocks", 64, 8),
        ("meta_blocks", 72, 8),
        ("reserved", 80, 8),
    ];
    for &(n, o, w) in root_fields {
        field(Target::Root, format!("root {n}"), &lay.root, o, w, None, r);
    }
    let h: format::RootHeader = zerocopy::FromBytes::read_from_prefix(&lay.root[..])
        .map(|(h, _)| h)
        .unwrap();
    for i in 0..h.chunk_count as usize {
        let base = 96 + 24 * i;
        for (n, o, w) in [
            ("bno", 0, 8),
            ("nblocks", 8, 4),
            ("bytes", 12, 4),
            ("crc", 16, 4),
            ("records", 20, 4),
        ] {
            field(
                Target::Root,
                format!("chunk descriptor {i} {n}"),
                &lay.root,
                base + o,
                w,
                None,
                r,
            );
        }
    }
    let free0 = 96 + 24 * h.chunk_count as usize;
    for i in 0..h.free_count as usize {
        for (n, o) in [("bno", 0), ("len", 8)] {
            field(
                Target::Root,
                format!("free run {i} {n}"),
                &lay.root,
                free0 + 16 * i + o,
                8,
                None,
                r,
            );
        }
    }
    let pend0 = free0 + 16 * h.free_count as usize;
    for i in 0..h.pending_count as usize {
        for (n, o) in [("bno", 0), ("len", 8), ("freed_gen", 16)] {
            field(
                Target::Root,
                format!("pending run {i} {n}"),
                &lay.root,
                pend0 + 24 * i + o,
                8,
                None,
                r,
            );
        }
    }
    // Chunk headers, and the fields of a spread of records.
    let mut records = Vec::new();
    for (ci, (_, bytes)) in lay.chunks.iter().enumerate() {
        for (n, o, w) in [
            ("generation", 8, 8),
            ("records", 16, 4),
            ("bytes", 20, 4),
            ("reserved", 24, 8),
        ] {
            field(
                Target::Chunk(ci),
                format!("chunk {ci} header {n}"),
                bytes,
                o,
                w,
                None,
                r,
            );
        }
        let mut off = 32;
        while off + 48 <= bytes.len() {
            let len = get(bytes, off, 4) as usize;
            let name_len = get(bytes, off + 4, 2) as usize;
            let extents = get(bytes, off + 40, 4) as usize;
            let name_off = off + 48 + 16 * extents;
            let name = String::from_utf8(bytes[name_off..name_off + name_len].to_vec()).unwrap();
            records.push((ci, off, extents, name_off, name));
            off += len;
        }
    }
    let step = (records.len() / records_per_run.max(1)).max(1);
    for (ci, off, extents, name_off, name) in records.into_iter().step_by(step) {
        let bytes = &lay.chunks[ci].1;
        let t = Target::Chunk(ci);
        let mut fields = vec![
            ("record_len", 0, 4),
            ("name_len", 4, 2),
            ("flags", 6, 2),
            ("file_id", 8, 8),
            ("generation", 16, 8),
            ("size", 24, 8),
            ("alloc_blocks", 32, 8),
            ("extent_count", 40, 4),
            ("data_crc", 44, 4),
            ("name[0]", name_off - off, 1),
        ];
        for e in 0..extents.min(2) {
            fields.push(("extent bno", 48 + 16 * e, 8));
            fields.push(("extent len", 56 + 16 * e, 8));
        }
        for (n, o, w) in fields {
            // A broken length field loses the chunk's framing from there on: not confined.
            let confined = (n != "record_len").then(|| name.clone());
            field(
                t,
                format!("record {name:?} {n}"),
                bytes,
                off + o,
                w,
                confined,
                r,
            );
        }
    }
    out
}

/// What one damaged image came to.
#[derive(Default, Debug)]
struct Tally {
    images: u64,
    mounted: u64,
    repaired: u64,
    /// Images repair refused, saying why, with the image left as it was (random damage only).
    gave_up: u64,
    /// Whether giving up is acceptable (random damage) or a failure (crafted fields).
    may_give_up: bool,
    failures: Vec<String>,
}

fn read_file(fs: &FileSystem, name: &str) -> Option<Vec<u8>> {
    let f = fs.open(name, OpenMode::ReadOnly).ok()?;
    let len = usize::try_from(f.len().ok()?).ok()?;
    if len > 64 << 20 {
        return None;
    }
    let mut buf = vec![0u8; len];
    let n = f.read_at(0, &mut buf).ok()?;
    buf.truncate(n);
    Some(buf)
}

fn detected(fs: &FileSystem, name: &str) -> bool {
    matches!(
        fs.verify_data(name),
        Ok(DataCheck::Mismatch { .. }) | Err(_)
    )
}

/// Checks one damaged image; returns what went wrong, if anything.
fn check_image(
    f: &Fixture,
    img: Vec<u8>,
    confined_to: Option<&str>,
    t: &mut Tally,
) -> Result<(), String> {
    t.images += 1;
    let dev = Arc::new(MemDevice::from_image(&img, LBA));
    match FileSystem::mount(dev.clone()) {
        Ok(fs) => {
            t.mounted += 1;
            for st in fs.list("") {
                let Some(bytes) = read_file(&fs, &st.name) else {
                    continue;
                };
                if let Some(want) = f.new.get(&st.name)
                    && &bytes != want
                    && !detected(&fs, &st.name)
                {
                    return Err(format!(
                        "mounted; {:?} reads wrong bytes and its checksum does not say so",
                        st.name
                    ));
                }
            }
            Ok(())
        }
        Err(_) => {
            t.repaired += 1;
            let report = fsck(dev.clone(), &FsckOptions { repair: true })
                .map_err(|e| format!("repair failed: {e}"))?;
            if std::env::var_os("BLOCKFS_MUTATIONS_SHOW").is_some() {
                eprintln!(
                    "repairs {:?} lost {:?} reverted {:?} lost_unknown {:?}",
                    report.repairs, report.lost, report.reverted, report.lost_unknown
                );
            }
            // Random damage can destroy what repair needs to go on (the magic of both
            // superblock slots, both roots): giving up is then the honest outcome, provided it
            // says why and leaves the image as it was. Crafted single-field damage never may.
            if t.may_give_up && !report.is_consistent() && report.unrepairable.is_some() {
                if dev.to_image() != img {
                    return Err(format!(
                        "repair gave up ({:?}) but changed the image",
                        report.unrepairable
                    ));
                }
                t.gave_up += 1;
                return Ok(());
            }
            if !report.is_consistent() {
                return Err(format!(
                    "repair left an inconsistent file system: unrepairable {:?}, remaining {:?}",
                    report.unrepairable, report.remaining
                ));
            }
            let fs = FileSystem::mount(dev).map_err(|e| format!("mount after repair: {e}"))?;
            check_repaired(f, &fs, &report, confined_to)
        }
    }
}

fn check_repaired(
    f: &Fixture,
    fs: &FileSystem,
    report: &FsckReport,
    confined_to: Option<&str>,
) -> Result<(), String> {
    // `lost` names files, or `<file id N>` where a record's name was unreadable.
    let lost: Vec<String> = report
        .lost
        .iter()
        .map(|l| {
            l.strip_prefix("<file id ")
                .and_then(|r| r.strip_suffix('>'))
                .and_then(|id| id.parse::<u64>().ok())
                .and_then(|id| f.ids.get(&id).cloned())
                .unwrap_or_else(|| l.clone())
        })
        .collect();
    // A lost entry names a file if it is its name, or its name with a byte or two damaged (a
    // dropped record's name as read), unless it is another file's name exactly.
    let named_lost = |name: &str| {
        lost.iter().any(|l| {
            l == name
                || (l.len() == name.len()
                    && !f.new.contains_key(l)
                    && !f.old.contains_key(l)
                    && l.bytes().zip(name.bytes()).filter(|(a, b)| a != b).count() <= 2)
        })
    };
    let mut kept = BTreeMap::new();
    for st in fs.list("") {
        let bytes = read_file(fs, &st.name);
        let ok = bytes
            .as_ref()
            .is_some_and(|b| f.new.get(&st.name) == Some(b) || f.old.get(&st.name) == Some(b));
        if !ok
            && !report.reverted.contains(&st.name)
            && !lost.contains(&st.name)
            && !detected(fs, &st.name)
            && (f.new.contains_key(&st.name) || f.old.contains_key(&st.name))
        {
            return Err(format!(
                "repaired; {:?} holds bytes of neither generation, not named as reverted, checksum silent",
                st.name
            ));
        }
        kept.insert(st.name.clone(), bytes);
    }
    for (name, want) in &f.new {
        match kept.get(name) {
            // Unnamed only where the report says its loss list can be incomplete.
            None if !named_lost(name)
                && !report.reverted.contains(name)
                && report.lost_unknown.is_none() =>
            {
                return Err(format!(
                    "repaired; {name:?} is gone and the report does not name it (lost: {:?})",
                    report.lost
                ));
            }
            // Bytes of neither generation are acceptable where the data checksum says so.
            Some(Some(b))
                if b != want
                    && !report.reverted.contains(name)
                    && (f.old.get(name) == Some(b) || !detected(fs, name)) =>
            {
                return Err(format!(
                    "repaired; {name:?} holds an older version and the report does not name it as reverted"
                ));
            }
            _ => {}
        }
    }
    if let Some(damaged) = confined_to {
        for (name, want) in &f.new {
            if name != damaged && kept.get(name).and_then(|b| b.as_ref()) != Some(want) {
                return Err(format!(
                    "repaired; the damage was confined to the record of {damaged:?}, yet {name:?} was lost or changed (lost {:?}, reverted {:?})",
                    report.lost, report.reverted
                ));
            }
        }
    }
    Ok(())
}

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}: a number")))
        .unwrap_or(default)
}

fn run_case(f: &Fixture, img: Vec<u8>, confined_to: Option<&str>, what: &str, t: &mut Tally) {
    let got = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut sub = Tally {
            may_give_up: t.may_give_up,
            ..Tally::default()
        };
        let r = check_image(f, img, confined_to, &mut sub);
        (r, sub)
    }));
    match got {
        Ok((r, sub)) => {
            t.images += sub.images;
            t.mounted += sub.mounted;
            t.repaired += sub.repaired;
            t.gave_up += sub.gave_up;
            if let Err(e) = r {
                t.failures.push(format!("{what}: {e}"));
            }
        }
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            t.images += 1;
            t.failures.push(format!("{what}: panicked: {msg}"));
        }
    }
}

fn report(t: &Tally, what: &str) {
    println!(
        "{what}: {} images, {} mounted, {} repaired, {} refused by repair (said why, image untouched), {} failures",
        t.images,
        t.mounted,
        t.repaired,
        t.gave_up,
        t.failures.len()
    );
    assert!(
        t.failures.is_empty(),
        "{} of {} images failed:\n{}",
        t.failures.len(),
        t.images,
        t.failures
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn crafted_fields_with_checksums_recomputed() {
    let f = fixture();
    let lay = layout(&f.image);
    assert!(lay.chunks.len() >= 3, "fixture wants several chunks");
    let mut r = rng(11);
    let ms = mutations(&lay, env_count("BLOCKFS_MUTATIONS_RECORDS", 12), &mut r);
    let mut t = Tally::default();
    for m in &ms {
        let img = apply(&f.image, &lay, m);
        let what = format!("{} := {:#x}", m.field, m.value);
        run_case(&f, img, m.confined_to.as_deref(), &what, &mut t);
    }
    report(&t, "crafted fields");
}

#[test]
fn random_damage_of_metadata_blocks() {
    let f = fixture();
    let lay = layout(&f.image);
    let mut r = rng(12);
    // The metadata blocks: both slots, the newest root, every chunk.
    let mut spans: Vec<(usize, usize)> = SUPERBLOCK_SLOTS
        .iter()
        .map(|&o| (o as usize, 256))
        .collect();
    spans.push((lay.sb.root_bno as usize * BS, lay.root.len()));
    spans.extend(
        lay.chunks
            .iter()
            .map(|(d, b)| (d.bno as usize * BS, b.len())),
    );
    let mut t = Tally {
        may_give_up: true,
        ..Tally::default()
    };
    for i in 0..env_count("BLOCKFS_MUTATIONS_RANDOM", 300) {
        let mut img = f.image.clone();
        let hits = r.random_range(1..=4);
        let mut what = format!("random damage {i}:");
        for _ in 0..hits {
            let (start, len) = spans[r.random_range(0..spans.len())];
            let at = start + r.random_range(0..len);
            let n = r.random_range(1..=16).min(start + len - at);
            for b in &mut img[at..at + n] {
                *b = r.random();
            }
            what.push_str(&format!(" {n} bytes at {at}"));
        }
        run_case(&f, img, None, &what, &mut t);
    }
    report(&t, "random damage");
}
