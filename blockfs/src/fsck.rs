//! fsck: checks both generations on the device and, when asked, rebuilds a consistent one.

use std::sync::Arc;

use zerocopy::FromBytes;

use crate::commit::commit;
use crate::device::{BlockDevice, ReadReq};
use crate::error::{DeviceResultExt, Error, Result};
use crate::format::{
    ChunkDesc, ChunkHeader, DroppedRecord, FileRecord, PendingExtent, ROOT_MAGIC, RecordLimits,
    RootHeader, SUPERBLOCK_SLOTS, Superblock, check_run, crc, decode_chunk, decode_root,
    reserved_blocks, root_len, root_self_crc,
};
use crate::fs::FileSystem;
use crate::geometry::Geometry;
use crate::load::{Problem, RawState, check, geometry_of, read_raw_all, salvage};
use crate::superblock::{pick_superblock, read_slots, slot_name};

/// Options for [`fsck`].
#[derive(Clone, Debug, Default)]
pub struct FsckOptions {
    /// Fix what can be fixed (see [`fsck`]).
    pub repair: bool,
}

/// One superblock slot as found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotReport {
    /// Slot number.
    pub slot: usize,
    /// Byte offset on the device.
    pub byte_offset: u64,
    /// Generation, if the slot holds a valid superblock.
    pub generation: Option<u64>,
    /// Why the slot is unusable, if it is.
    pub problem: Option<String>,
}

/// What [`fsck`] found and did.
#[derive(Clone, Debug, Default)]
pub struct FsckReport {
    /// Both superblock slots.
    pub slots: Vec<SlotReport>,
    /// Generation checked: the newest valid superblock's.
    pub generation: Option<u64>,
    /// Problems that make mount refuse.
    pub problems: Vec<Problem>,
    /// The previous generation (the other slot), kept for rollback.
    pub older_generation: Option<u64>,
    /// Problems in the previous generation (only matter if the newest is damaged).
    pub older_problems: Vec<Problem>,
    /// Files in the checked generation.
    pub files: u64,
    /// Blocks in the file system.
    pub total_blocks: u64,
    /// Blocks allocated to files.
    pub data_blocks: u64,
    /// Metadata blocks (superblock area, chunks, root).
    pub metadata_blocks: u64,
    /// Free blocks, counting those a mount makes reusable (as [`crate::FsStats`] does).
    pub free_blocks: u64,
    /// Blocks freed by the newest commit, reusable once the next one is durable.
    pub pending_blocks: u64,
    /// What repair changed, one line each.
    pub repairs: Vec<String>,
    /// Files repair lost (filled by repair only): names in the newest generation's records, as
    /// far as they can be read, that the repaired file system does not have (by name or, for a
    /// file moved to `lost+found/`, by id), and records repair dropped as invalid (named by
    /// their file id's name in the older generation, or `<file id N>`, where the name itself
    /// does not read). Where the newest generation could not be read whole, the older
    /// generation's files the repair does not keep are named too (FORMAT.md, "Repair"). Sorted.
    pub lost: Vec<String>,
    /// Files repair reverted (filled by repair only): names present both in the newest
    /// generation whose records could be read and in the repaired file system whose record
    /// differs (another file id, size, extents, flags or data checksum): the repaired file is an
    /// older version (a rollback), or was cut short where its blocks overlapped others. Sorted.
    pub reverted: Vec<String>,
    /// Whether `lost` and `reverted` can be incomplete (filled by repair only): `None` when the
    /// repair read every record of the newest generation, so the two lists name every file it
    /// lost or reverted; else why it could not, naming the generation or structure whose files
    /// could not be listed (a root run that does not read, so a rollback does not know what the
    /// newest generation held; a chunk that fails its checksum or whose records cannot be parsed
    /// from some offset; a dropped record whose name does not read).
    pub lost_unknown: Option<String>,
    /// Why repair gave up, if it did.
    pub unrepairable: Option<String>,
    /// Problems left after the repair (re-checked from the device).
    pub remaining: Vec<Problem>,
}

impl FsckReport {
    /// No problems in the checked generation (before any repair).
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }

    /// The file system mounts now: clean, or repaired with nothing left.
    pub fn is_consistent(&self) -> bool {
        if self.repairs.is_empty() {
            self.problems.is_empty()
        } else {
            self.unrepairable.is_none() && self.remaining.is_empty()
        }
    }

    fn fill_stats(&mut self, raw: &RawState, reserved: u64) {
        let h = &raw.root.header;
        self.files = h.file_count;
        self.total_blocks = raw.sb.block_count;
        self.data_blocks = h.data_blocks;
        self.metadata_blocks = h.meta_blocks.saturating_add(reserved);
        // Counted as a mount sees them: runs freed by an older commit than the newest are
        // reusable (free), so `df` on the mounted file system reports the same numbers.
        let reusable = raw.sb.generation.saturating_sub(1);
        let (ready, waiting): (Vec<&PendingExtent>, Vec<&PendingExtent>) = raw
            .root
            .pending
            .iter()
            .partition(|p| p.freed_gen <= reusable);
        self.free_blocks = raw.root.free.iter().map(|f| f.len).sum::<u64>()
            + ready.iter().map(|p| p.len).sum::<u64>();
        self.pending_blocks = waiting.iter().map(|p| p.len).sum();
    }
}

/// A generation read and checked.
struct Checked {
    raw: Option<RawState>,
    problems: Vec<Problem>,
}

fn check_generation(dev: &dyn BlockDevice, sb: &Superblock) -> Result<(Checked, Option<Geometry>)> {
    let geo = match geometry_of(dev, sb) {
        Ok(g) => g,
        Err(e) => {
            let p = Problem {
                what: "device".into(),
                detail: e.to_string(),
            };
            return Ok((
                Checked {
                    raw: None,
                    problems: vec![p],
                },
                None,
            ));
        }
    };
    match read_raw_all(dev, &geo, sb) {
        Ok(raw) => {
            let problems = check(&geo, &raw);
            Ok((
                Checked {
                    raw: Some(raw),
                    problems,
                },
                Some(geo),
            ))
        }
        Err(Error::Corrupt { what, detail }) => Ok((
            Checked {
                raw: None,
                problems: vec![Problem { what, detail }],
            },
            Some(geo),
        )),
        Err(e) => Err(e),
    }
}

/// Checks the file system on `dev` (which must not be mounted).
///
/// Reports both superblock slots, every problem in the newest generation (bad checksums,
/// invalid records, blocks claimed twice or by nobody) and in the previous one. With
/// `opts.repair`, and if anything is wrong, rebuilds the file system from the best source:
/// the newest generation if only a superblock slot is damaged; the newest generation salvaged
/// if its damage is confined to file records (records that do not decode, or whose extents
/// claim blocks another file or metadata claims: where two files claim the same blocks, the
/// one whose data checksum verifies keeps them); the previous generation (the second
/// superblock) if the newest one's metadata is otherwise damaged and the previous one is
/// intact; otherwise whatever records of the newest generation still decode, with files that
/// overlap others cut short and the free-space map recomputed (an invalid record whose length
/// field still frames it costs only itself). Each generation is read with its own superblock's
/// geometry, so a slot whose geometry disagrees cannot stop a rollback to the other. It then
/// commits the result twice, so both slots hold valid consecutive generations, checks again,
/// and names in [`FsckReport::lost`] and [`FsckReport::reverted`] the files the repair lost or
/// reverted to an older version ([`FsckReport::lost_unknown`] says why, where those lists can
/// be incomplete). A repair that would take the generation counter past
/// `u64::MAX` is refused ([`FsckReport::unrepairable`]) with the device untouched. Fails only on
/// device errors.
pub fn fsck(dev: Arc<dyn BlockDevice>, opts: &FsckOptions) -> Result<FsckReport> {
    let mut report = run_check(dev.as_ref())?;
    if !opts.repair || report.problems.is_empty() {
        return Ok(report);
    }
    let slots = read_slots(dev.as_ref())?;
    let valid: Vec<Superblock> = slots
        .iter()
        .filter_map(|s| s.as_ref().ok().copied())
        .collect();
    let Some(newest) = valid.iter().max_by_key(|sb| sb.generation).copied() else {
        return repair_without_superblock(dev, report);
    };
    let older = valid
        .iter()
        .find(|sb| sb.generation < newest.generation)
        .copied();
    let (new_checked, new_geo) = check_generation(dev.as_ref(), &newest)?;
    let old_checked = match older {
        Some(sb) => Some(check_generation(dev.as_ref(), &sb)?),
        None => None,
    };
    let mut repairs = Vec::new();
    // One slot unreadable: it may have held the newest generation. Its root run is still on
    // the device; look for it where the allocator would have put it.
    let mut found: Option<(RawState, Geometry)> = None;
    // What is known of the newest generation's records, for naming what the repair loses.
    let mut seen: Option<Seen> = None;
    // The other slot holds no valid predecessor of the newest (unreadable, or a generation
    // that does not come right before): a newer generation's root may be on the device.
    let orphaned = older.is_none_or(|o| o.generation.checked_add(1) != Some(newest.generation));
    if orphaned
        && let Some(geo) = &new_geo
        && let Some(raw) = &new_checked.raw
        && let Some(target) = newest.generation.checked_add(1)
        && let Some(sb) = find_lost_root(dev.as_ref(), geo, raw, target)?
        && let Ok(lost) = read_raw_all(dev.as_ref(), geo, &sb)
    {
        if check(geo, &lost).is_empty() {
            repairs.push(format!(
                "superblock slot {} was unreadable; found the root run of generation {} at block {} and recovered that generation",
                sb.slot, sb.generation, sb.root_bno
            ));
            found = Some((lost, *geo));
        } else {
            seen = Some(seen_of(&lost));
        }
    }
    let clean = |c: &(Checked, Option<Geometry>)| matches!(c, (Checked { raw: Some(_), problems }, Some(_)) if problems.is_empty());
    let new_pair = (new_checked, new_geo);
    // The source and the geometry to rebuild with: each generation is read with the geometry
    // its own superblock gives, so a slot whose geometry disagrees with the other's cannot
    // drag a sound generation down with it.
    let (base, geo): (&RawState, Geometry) = if let Some((raw, geo)) = &found {
        (raw, *geo)
    } else if let (Checked { raw: Some(raw), .. }, Some(geo)) = &new_pair
        && clean(&new_pair)
    {
        (raw, *geo)
    } else if let (
        Checked {
            raw: Some(raw),
            problems,
        },
        Some(geo),
    ) = &new_pair
        && let Some((n, map)) = record_confined(raw, problems)
    {
        // Salvaging drops only those records; a rollback would lose the whole last commit.
        repairs.push(match (n, map) {
            (n, 0) => format!(
                "salvaging generation {}: its damage is confined to {n} invalid file record(s) (checksums intact), so it keeps more than a rollback would",
                raw.sb.generation
            ),
            (n, map) => format!(
                "salvaging generation {}: its root and chunks check out and its damage is confined to its file records ({n} invalid, {map} block map conflict(s)); blocks two files claim go to the one whose data checksum verifies, so it keeps more than a rollback would",
                raw.sb.generation
            ),
        });
        (raw, *geo)
    } else if let Some(old @ (Checked { raw: Some(raw), .. }, Some(geo))) = &old_checked
        && clean(old)
    {
        repairs.push(format!(
            "rolled back from generation {} to generation {} (the second superblock): {}",
            newest.generation,
            raw.sb.generation,
            first_problem(&new_pair.0)
        ));
        (raw, *geo)
    } else if let (Checked { raw: Some(raw), .. }, Some(geo)) = &new_pair {
        repairs.push(format!("salvaging generation {}", raw.sb.generation));
        (raw, *geo)
    } else if let Some((Checked { raw: Some(raw), .. }, Some(geo))) = &old_checked {
        repairs.push(format!(
            "salvaging generation {} (the second superblock): {}",
            raw.sb.generation,
            first_problem(&new_pair.0)
        ));
        (raw, *geo)
    } else {
        // Neither superblock names a readable root: look for older ones on the device.
        let why = format!(
            "the root run of every generation a superblock names is unreadable ({})",
            first_problem(&new_pair.0)
        );
        let geo = new_pair
            .1
            .or_else(|| old_checked.as_ref().and_then(|(_, g)| *g));
        let seen = seen.or_else(|| {
            let geo = geo?;
            lenient_records(dev.as_ref(), &geo, &newest).ok().flatten()
        });
        let hints: Vec<(Superblock, bool)> = valid.iter().map(|sb| (*sb, false)).collect();
        if !scan_and_rebuild(dev, &hints, seen, None, &why, &mut report)?
            && report.unrepairable.is_none()
        {
            report.unrepairable = Some(format!(
                "the root run of every generation is unreadable: {}",
                first_problem(&new_pair.0)
            ));
        }
        return Ok(report);
    };
    if !same_geometry(&newest, &base.sb) {
        repairs.push(format!(
            "superblock of generation {} describes another geometry (block size {}, {} blocks) than generation {} (block size {}, {} blocks), whose root checks out; rewrote it",
            newest.generation,
            newest.block_size,
            newest.block_count,
            base.sb.generation,
            base.sb.block_size,
            base.sb.block_count
        ));
    }
    // Repair writes two generations above every one on the device, so no root left behind is
    // taken for newer. A slot whose geometry is not the source's is not trusted for that.
    let mut top = newest.generation.max(base.sb.generation);
    if top.checked_add(2).is_none() && base.sb.generation != newest.generation {
        // The newest slot is not the source: its generation is not to be trusted either.
        top = base.sb.generation;
    }
    if let Some(why) = exhausted(top) {
        report.unrepairable = Some(why);
        return Ok(report);
    }
    let mut state = salvage(dev.as_ref(), &geo, base, top + 1, &mut repairs);
    state.generation = top;
    // What the newest generation held: read through its superblock; else its root found where
    // the allocator put it (in the blocks the older generation left free), which a damaged
    // root pointer or checksum in the newest slot does not hide; else whatever its root run
    // still holds, read leniently.
    let older_raw = old_checked.as_ref().and_then(|(c, _)| c.raw.as_ref());
    let seen = match (&found, &new_pair.0.raw) {
        (Some((raw, _)), _) => seen_of(raw),
        (None, Some(raw)) if valid.len() > 1 || seen.is_none() => seen_of(raw),
        _ => match seen {
            Some(s) => s,
            None => {
                let by_scan = match (older_raw, &old_checked) {
                    (Some(old), Some((_, Some(og)))) => match old.sb.generation.checked_add(1) {
                        Some(t) => find_lost_root(dev.as_ref(), og, old, t)?
                            .and_then(|sb| read_raw_all(dev.as_ref(), og, &sb).ok()),
                        None => None,
                    },
                    _ => None,
                };
                match by_scan {
                    Some(raw) => seen_of(&raw),
                    None => {
                        let mut sb = newest;
                        (sb.uuid, sb.block_size, sb.block_count, sb.mkfs_lba_size) = (
                            base.sb.uuid,
                            base.sb.block_size,
                            base.sb.block_count,
                            base.sb.mkfs_lba_size,
                        );
                        lenient_records(dev.as_ref(), &geo, &sb)?.unwrap_or_else(|| {
                            Seen::unknown(format!(
                                "the root run of generation {} does not read: the files only that generation held are unknown",
                                newest.generation
                            ))
                        })
                    }
                }
            }
        },
    };
    // Parts of the newest generation unread: chunks its commit wrote are where the allocator
    // put them, in the blocks the older generation left free; their records name files too.
    let mut seen = seen;
    // One slot unreadable and no newer root found: the slot held the older generation, or a
    // newer one whose root is damaged too. Its generation field, where it still reads, tells.
    if found.is_none()
        && valid.len() == 1
        && seen.incomplete.is_none()
        && let Some(why) = unreadable_slot_newer(dev.as_ref(), &newest)?
    {
        seen.incomplete = Some(why);
    }
    if seen.incomplete.is_some()
        && let (Some(old), Some((_, Some(og)))) = (older_raw, &old_checked)
        && let Some(target) = old.sb.generation.checked_add(1)
    {
        seen.records
            .extend(scan_chunks(dev.as_ref(), og, old, target)?);
    }
    // A generation other than the one `seen` describes, for files `seen` may miss.
    let other = if valid.len() == 1 {
        new_pair.0.raw.as_ref()
    } else {
        older_raw
    };
    let (lost, reverted, unknown) = changes(&seen, other, base, &state);
    rewrite(dev, geo, state, top, repairs, &mut report)?;
    report.lost = lost;
    report.reverted = reverted;
    report.lost_unknown = unknown;
    Ok(report)
}

/// Whether a generation's damage is confined to its file records, and if so how many records
/// are invalid and how many block map conflicts there are: every chunk passed its checksum and
/// was read, and every problem is a record that was dropped whole (its framing intact), a
/// single record whose broken length field decoding resynchronized after, or a block claimed
/// twice or by nobody (the records decode, but one's extents are wrong; [`salvage`] settles
/// who keeps the blocks, by data checksum).
fn record_confined(raw: &RawState, problems: &[Problem]) -> Option<(usize, usize)> {
    // Every problem is a chunk's (records that do not decode, or ids and names that clash,
    // which salvage resolves record by record) or the block map's, none the root's.
    if problems
        .iter()
        .any(|p| !p.what.starts_with("file table chunk") && p.what != "block map")
    {
        return None;
    }
    let map = problems.iter().filter(|p| p.what == "block map").count();
    let mut n = problems
        .iter()
        .filter(|p| p.detail.contains("file id") || p.detail.starts_with("name "))
        .count();
    for c in &raw.chunks {
        if !c.crc_ok || c.unread.is_some() || c.image.header.is_none() {
            return None;
        }
        match c.image.error.as_deref() {
            None => continue,
            Some(e) if e.starts_with("record ") => {}
            Some(_) => return None, // the chunk header's, not a record's
        }
        let decoded = c.image.records.len() + c.image.dropped.len();
        let missing = (c.desc.records as usize).checked_sub(decoded)?;
        match (c.image.unparsed_from, c.image.resumed_at) {
            (None, _) if !c.image.dropped.is_empty() && missing == 0 => {}
            (Some(_), Some(_)) if missing + c.image.dropped.len() <= 1 => {}
            _ => return None,
        }
        n += c.image.dropped.len() + missing;
    }
    (n + map > 0).then_some((n, map))
}

fn first_problem(c: &Checked) -> String {
    c.problems
        .first()
        .map_or_else(|| "damaged".into(), |p| p.to_string())
}

/// Whether two superblocks describe the same file system geometry.
fn same_geometry(a: &Superblock, b: &Superblock) -> bool {
    (a.uuid, a.block_size, a.block_count, a.mkfs_lba_size)
        == (b.uuid, b.block_size, b.block_count, b.mkfs_lba_size)
}

/// Why repair cannot commit two generations after `top`, if it cannot.
fn exhausted(top: u64) -> Option<String> {
    top.checked_add(2).is_none().then(|| {
        format!(
            "generation {top} leaves no room for the two commits a repair writes (generations \
             are 64-bit and never wrap); the image was left as it was"
        )
    })
}

/// What is known of a generation's records, for naming what a repair lost.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// Records that decoded.
    records: Vec<FileRecord>,
    /// Records skipped as invalid (their names, where readable).
    dropped: Vec<DroppedRecord>,
    /// Why some records of the generation may be neither among `records` nor `dropped`; `None`
    /// when every record is.
    incomplete: Option<String>,
}

impl Seen {
    /// Nothing known, for the reason given.
    fn unknown(why: String) -> Self {
        Seen {
            incomplete: Some(why),
            ..Seen::default()
        }
    }
}

fn seen_of(raw: &RawState) -> Seen {
    Seen {
        records: raw
            .chunks
            .iter()
            .flat_map(|c| c.image.records.iter().cloned())
            .collect(),
        dropped: raw
            .chunks
            .iter()
            .flat_map(|c| c.image.dropped.iter().cloned())
            .collect(),
        // Records were read from every chunk, checksum intact, as many as its descriptor counts
        // (some dropped as invalid, a broken length field costing one record).
        incomplete: raw.chunks.iter().find_map(|c| {
            let what = || crate::load::chunk_name(&c.desc, raw.sb.generation);
            let read = c.image.records.len() + c.image.dropped.len();
            if let Some(u) = &c.unread {
                Some(format!("{}: {u}", what()))
            } else if !c.crc_ok {
                Some(format!(
                    "{}: checksum mismatch, so its records cannot be trusted",
                    what()
                ))
            } else if let Some(at) = c.image.unparsed_from
                && (c.image.resumed_at.is_none() || read != c.desc.records as usize)
            {
                Some(format!(
                    "{}: its records cannot be told apart from byte {at}{}",
                    what(),
                    c.image
                        .resumed_at
                        .map_or_else(String::new, |r| format!(" to byte {r}"))
                ))
            } else if read != c.desc.records as usize {
                Some(format!(
                    "{}: {}; {read} of its {} records read",
                    what(),
                    c.image.error.as_deref().unwrap_or("damaged"),
                    c.desc.records
                ))
            } else {
                None
            }
        }),
    }
}

/// Why the one unreadable superblock slot may have held a generation newer than `newest`, the
/// other slot's, if it may: its generation field, where the slot still has the magic and
/// `newest`'s UUID, says whether it held an older one.
fn unreadable_slot_newer(dev: &dyn BlockDevice, newest: &Superblock) -> Result<Option<String>> {
    let lba = dev.lba_size() as u64;
    let slot = 1 - newest.slot as usize % 2;
    let off = SUPERBLOCK_SLOTS[slot];
    if off / lba >= dev.lba_count() {
        return Ok(None);
    }
    let mut buf = vec![0u8; lba as usize];
    dev.read(&mut [ReadReq {
        lba: off / lba,
        buf: &mut buf,
    }])
    .during("reading the superblocks")?;
    if let Ok((sb, _)) = Superblock::read_from_prefix(&buf)
        && sb.magic == crate::format::SUPERBLOCK_MAGIC
        && sb.uuid == newest.uuid
        && newest.generation.checked_sub(1) == Some(sb.generation)
    {
        return Ok(None);
    }
    Ok(Some(format!(
        "{} does not read and no root run of generation {} was found: if it held a generation newer than {}, the files only that generation held are unknown",
        slot_name(slot),
        newest.generation.saturating_add(1),
        newest.generation
    )))
}

/// Most bytes [`lenient_records`] reads for one root run or one chunk.
const LENIENT_READ_BYTES: u64 = 16 << 20;

/// The records of the generation whose root `sb` names, read as far as they can be whatever
/// checksums and counts say (for naming what a repair lost, never for rebuilding): the root at
/// `sb.root_bno` if it has the root magic and the UUID, its chunk descriptors as far as its
/// blocks hold them, and every chunk that lies inside the file system.
fn lenient_records(dev: &dyn BlockDevice, geo: &Geometry, sb: &Superblock) -> Result<Option<Seen>> {
    let bs = geo.block_size as u64;
    let reserved = geo.reserved_blocks();
    if sb.root_bno < reserved || sb.root_bno >= geo.block_count {
        return Ok(None);
    }
    let blocks = (sb.root_blocks as u64)
        .max(1)
        .min(LENIENT_READ_BYTES / bs)
        .min(geo.block_count - sb.root_bno);
    let mut buf = vec![0u8; (blocks * bs) as usize];
    dev.read(&mut [ReadReq {
        lba: geo.lba(sb.root_bno),
        buf: &mut buf,
    }])
    .during("reading a damaged root run")?;
    let Ok((h, rest)) = RootHeader::read_from_prefix(&buf[..]) else {
        return Ok(None);
    };
    if h.magic != ROOT_MAGIC || h.uuid != geo.uuid {
        return Ok(None);
    }
    let n = (h.chunk_count as usize).min(rest.len() / size_of::<ChunkDesc>());
    let lim = RecordLimits {
        block_size: geo.block_size,
        block_count: geo.block_count,
        generation: u64::MAX,
    };
    let mut seen = Seen::unknown(format!(
        "the root run of generation {} does not check out: the records it still names were read without trusting checksums or counts",
        sb.generation
    ));
    for raw in rest.chunks_exact(size_of::<ChunkDesc>()).take(n) {
        let Ok(d) = ChunkDesc::read_from_bytes(raw) else {
            continue;
        };
        if check_run(d.bno, d.nblocks as u64, reserved, geo.block_count).is_err()
            || (d.nblocks as u64) * bs > LENIENT_READ_BYTES
            || (d.bytes as usize) < size_of::<ChunkHeader>()
            || d.bytes as u64 > d.nblocks as u64 * bs
        {
            continue;
        }
        let mut chunk = vec![0u8; (d.nblocks as u64 * bs) as usize];
        dev.read(&mut [ReadReq {
            lba: geo.lba(d.bno),
            buf: &mut chunk,
        }])
        .during("reading a damaged file table")?;
        // The chunk's own header says how long it is and how many records it holds.
        let (len, records) = match ChunkHeader::read_from_prefix(&chunk[..]) {
            Ok((ch, _)) if (ch.bytes as usize) <= chunk.len() => (ch.bytes as usize, ch.records),
            _ => (d.bytes as usize, d.records),
        };
        let img = decode_chunk(&chunk[..len], records, &lim);
        seen.records.extend(img.records);
        seen.dropped.extend(img.dropped);
    }
    Ok(Some(seen))
}

/// The files the repaired `state` lost or holds an older version of, compared with what is
/// known of the newest generation's records (`seen`) and with the records the source (`base`)
/// had to drop. Where the newest generation could not be read whole, files of the `older`
/// generation (read through its superblock) that the repair does not keep are named lost too.
/// Returns (lost, reverted), each sorted, and why they may be incomplete
/// ([`FsckReport::lost_unknown`]).
fn changes(
    seen: &Seen,
    older: Option<&RawState>,
    base: &RawState,
    state: &crate::state::State,
) -> (Vec<String>, Vec<String>, Option<String>) {
    use std::collections::BTreeSet;
    let mut lost: BTreeSet<String> = BTreeSet::new();
    let mut reverted: BTreeSet<String> = BTreeSet::new();
    // Kept: under its name, or moved to lost+found (by id).
    let moved = |id: u64| {
        state
            .inodes
            .get(&id)
            .is_some_and(|i| i.name.starts_with("lost+found/"))
    };
    let kept = |name: &str, id: u64| state.names.contains_key(name) || moved(id);
    // A dropped record's name as it reads if it is a valid one; else the name its file id has
    // in the other generation; else its file id.
    let by_id = |id: u64| {
        older.and_then(|o| {
            o.chunks
                .iter()
                .flat_map(|c| c.image.records.iter())
                .find(|r| r.file_id == id)
                .map(|r| r.name.clone())
        })
    };
    let mut unknown = seen.incomplete.clone();
    let base_dropped = base.chunks.iter().flat_map(|c| c.image.dropped.iter());
    for d in seen.dropped.iter().chain(base_dropped) {
        if d.name.is_none() && unknown.is_none() {
            unknown = Some(format!(
                "record {} at byte {} of its chunk (file id {}, as far as it reads) was dropped and its name does not read",
                d.index, d.offset, d.file_id
            ));
        }
        let name = d
            .name
            .clone()
            .filter(|n| crate::name::check_name(n).is_ok())
            .or_else(|| by_id(d.file_id))
            .or_else(|| d.name.clone())
            .unwrap_or_else(|| format!("<file id {}>", d.file_id));
        if !kept(&name, d.file_id) {
            lost.insert(name);
        }
    }
    for r in &seen.records {
        match state.names.get(&r.name).and_then(|id| state.inodes.get(id)) {
            Some(i) => {
                if i.id != r.file_id
                    || i.size != r.size
                    || i.extents.as_slice() != r.extents.as_slice()
                    || i.data_crc != r.data_crc
                    || i.flags != r.flags
                {
                    reverted.insert(r.name.clone());
                }
            }
            // Kept under another name (lost+found): the repairs say so.
            None if moved(r.file_id) => {}
            None => {
                lost.insert(r.name.clone());
            }
        }
    }
    if seen.incomplete.is_some()
        && let Some(old) = older
    {
        for r in old.chunks.iter().flat_map(|c| c.image.records.iter()) {
            if !kept(&r.name, r.file_id) {
                lost.insert(r.name.clone());
            }
        }
    }
    (
        lost.into_iter().collect(),
        reverted.into_iter().collect(),
        unknown,
    )
}

/// Commits the repaired `state` twice (generations `top + 1` and `top + 2`, so both slots hold
/// valid consecutive generations), checks again, and fills `report` in.
fn rewrite(
    dev: Arc<dyn BlockDevice>,
    geo: Geometry,
    state: crate::state::State,
    top: u64,
    mut repairs: Vec<String>,
    report: &mut FsckReport,
) -> Result<()> {
    let fs = FileSystem::from_parts(dev.clone(), geo, state);
    {
        let mut st = fs.inner.write_state();
        commit(&fs.inner, &mut st, true)?;
        commit(&fs.inner, &mut st, true)?;
    }
    drop(fs);
    repairs.push(format!(
        "wrote generations {} and {} into both superblock slots",
        top.saturating_add(1),
        top.saturating_add(2)
    ));
    let after = run_check(dev.as_ref())?;
    report.remaining = after.problems.clone();
    report.repairs = repairs;
    report.slots = after.slots;
    report.generation = after.generation;
    report.older_generation = after.older_generation;
    report.older_problems = after.older_problems;
    report.files = after.files;
    report.total_blocks = after.total_blocks;
    report.data_blocks = after.data_blocks;
    report.metadata_blocks = after.metadata_blocks;
    report.free_blocks = after.free_blocks;
    report.pending_blocks = after.pending_blocks;
    Ok(())
}

/// Blocks scanned at most when looking for a lost root run.
const LOST_ROOT_SCAN_BLOCKS: u64 = 1 << 16;

/// The runs free for the commit after `raw` (its free runs and the pending ones it could
/// reuse), lowest address first, the order the allocator takes them in: where that commit's
/// root and chunks can be.
fn free_after(raw: &RawState) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = raw.root.free.iter().map(|f| (f.bno, f.len)).collect();
    runs.extend(
        raw.root
            .pending
            .iter()
            .filter(|p| p.freed_gen < raw.sb.generation)
            .map(|p| (p.bno, p.len)),
    );
    runs.sort_unstable();
    runs
}

/// Looks for the root run of generation `target` (one past `raw`'s) in the blocks that were
/// free when `raw` was committed, lowest address first, the order the allocator uses. Returns a
/// superblock naming it if one is found whose UUID, generation and self-checksum match.
fn find_lost_root(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    raw: &RawState,
    target: u64,
) -> Result<Option<Superblock>> {
    let runs = free_after(raw);
    let found = scan_roots(
        dev,
        geo,
        &raw.sb,
        &runs,
        LOST_ROOT_SCAN_BLOCKS,
        |h| h.uuid == raw.sb.uuid && h.generation == target,
        true,
    )?;
    Ok(found.into_iter().next())
}

/// The records of file-table chunks of generation `target` in the blocks that were free when
/// `raw` was committed (at most [`LOST_ROOT_SCAN_BLOCKS`] of them): what the commit after `raw`
/// wrote, for naming the files a repair loses when that commit's own root cannot say.
fn scan_chunks(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    raw: &RawState,
    target: u64,
) -> Result<Vec<FileRecord>> {
    let bs = geo.block_size as usize;
    let runs = free_after(raw);
    let lim = RecordLimits {
        block_size: geo.block_size,
        block_count: geo.block_count,
        generation: target,
    };
    const BATCH: u64 = 64;
    let mut buf = vec![0u8; BATCH as usize * bs];
    let mut scanned = 0u64;
    let mut out = Vec::new();
    for (start, len) in runs {
        let end = start.saturating_add(len).min(geo.block_count);
        let mut b = start;
        while b < end && scanned < LOST_ROOT_SCAN_BLOCKS {
            let n = BATCH.min(end - b);
            dev.read(&mut [ReadReq {
                lba: geo.lba(b),
                buf: &mut buf[..n as usize * bs],
            }])
            .during("scanning for file table chunks")?;
            for i in 0..n as usize {
                let blk = &buf[i * bs..(i + 1) * bs];
                let Ok((h, _)) = ChunkHeader::read_from_prefix(blk) else {
                    continue;
                };
                // One-block chunks only: the records of small files, most of them.
                if h.magic != crate::format::CHUNK_MAGIC
                    || h.generation != target
                    || h.bytes as usize > bs
                    || (h.bytes as usize) < size_of::<ChunkHeader>()
                {
                    continue;
                }
                let bytes = &blk[..h.bytes as usize];
                out.extend(decode_chunk(bytes, h.records, &lim).records);
            }
            b += n;
            scanned += n;
        }
    }
    Ok(out)
}

/// Scans the blocks of `runs` (at most `max_blocks` of them) for root runs (valid
/// self-checksum) whose header `want` accepts (its UUID and generation, usually), and returns a
/// superblock for each: `template` with the UUID, generation, slot and root fields filled in.
/// With `first_only`, stops at the first.
fn scan_roots(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    template: &Superblock,
    runs: &[(u64, u64)],
    max_blocks: u64,
    want: impl Fn(&RootHeader) -> bool,
    first_only: bool,
) -> Result<Vec<Superblock>> {
    let bs = geo.block_size as usize;
    const BATCH: u64 = 64;
    let mut buf = vec![0u8; BATCH as usize * bs];
    let mut scanned = 0u64;
    let mut out = Vec::new();
    for &(start, len) in runs {
        let end = (start + len).min(geo.block_count);
        let mut b = start;
        while b < end && scanned < max_blocks {
            let n = BATCH.min(end - b);
            dev.read(&mut [ReadReq {
                lba: geo.lba(b),
                buf: &mut buf[..n as usize * bs],
            }])
            .during("scanning for a root run")?;
            for i in 0..n {
                let blk = &buf[i as usize * bs..(i as usize + 1) * bs];
                let Ok((h, _)) = RootHeader::read_from_prefix(blk) else {
                    continue;
                };
                if h.magic != ROOT_MAGIC || !want(&h) {
                    continue;
                }
                let bytes = root_len(
                    h.chunk_count as usize,
                    h.free_count as usize,
                    h.pending_count as usize,
                );
                let blocks = bytes.div_ceil(bs) as u64;
                let bno = b + i;
                if bytes > u32::MAX as usize || bno + blocks > geo.block_count {
                    continue;
                }
                let mut root = vec![0u8; blocks as usize * bs];
                dev.read(&mut [ReadReq {
                    lba: geo.lba(bno),
                    buf: &mut root,
                }])
                .during("reading a root run found by scanning")?;
                let root = &root[..bytes];
                if root_self_crc(root) != h.self_crc {
                    continue;
                }
                let mut sb = *template;
                sb.uuid = h.uuid;
                sb.generation = h.generation;
                sb.slot = (h.generation % 2) as u32;
                sb.root_bno = bno;
                sb.root_blocks = blocks as u32;
                sb.root_bytes = bytes as u32;
                sb.root_crc = crc(root);
                // The run may hold one spare block (FORMAT.md, "Root run"): the header's
                // metadata count less the chunks' blocks says how long the run really is.
                if let Ok(img) = decode_root(root, &sb) {
                    let chunk_blocks: u64 = img.chunks.iter().map(|d| d.nblocks as u64).sum();
                    if h.meta_blocks.checked_sub(chunk_blocks) == Some(blocks + 1)
                        && bno + blocks < geo.block_count
                    {
                        sb.root_blocks = blocks as u32 + 1;
                    }
                }
                out.push(sb);
                if first_only {
                    return Ok(out);
                }
            }
            b += n;
            scanned += n;
        }
    }
    Ok(out)
}

/// Bytes of a root's UUID that may agree with neither damaged slot's (both damaged there) for
/// repair to take that root's UUID as the file system's. A foreign UUID agrees with one of two
/// given ones in 12 of its 16 bytes with a chance of about 10^-22.
const UUID_BYTES_BOTH_DAMAGED: usize = 4;

/// Root runs tried, newest first, when both superblock slots are damaged.
const ROOT_CANDIDATES: usize = 8;

/// Repair when neither slot holds a valid superblock: take the geometry from a slot that still
/// has the superblock magic (its checksum or another field is damaged, but block size, block
/// count and UUID are usually intact), scan the whole file system for root runs, and rebuild
/// from the newest generation that checks out (or the newest readable one, salvaged). Both
/// slots are then rewritten.
fn repair_without_superblock(
    dev: Arc<dyn BlockDevice>,
    mut report: FsckReport,
) -> Result<FsckReport> {
    let hints = damaged_slot_hints(dev.as_ref())?;
    if hints.is_empty() {
        report.unrepairable =
            Some("no valid superblock in either slot, and neither holds a blockfs superblock to take the geometry from".into());
        return Ok(report);
    }
    let seen = hints.iter().find_map(|(h, _)| {
        let geo = geometry_of(dev.as_ref(), h).ok()?;
        lenient_records(dev.as_ref(), &geo, h).ok().flatten()
    });
    let why = "neither superblock slot was valid";
    if scan_and_rebuild(dev.clone(), &hints, seen.clone(), None, why, &mut report)?
        || report.unrepairable.is_some()
    {
        return Ok(report);
    }
    // No root carries either slot's UUID: both may be damaged, mostly in different bytes. A root
    // whose UUID agrees, byte by byte, with one slot or the other (but for a few bytes) is this
    // file system's.
    let uuids: Vec<[u8; 16]> = read_raw_slots(dev.as_ref())?
        .iter()
        .flatten()
        .map(|sb| sb.uuid)
        .collect();
    let plausible = |u: &[u8; 16]| {
        uuids.len() > 1
            && (0..16)
                .filter(|&i| !uuids.iter().any(|s| s[i] == u[i]))
                .count()
                <= UUID_BYTES_BOTH_DAMAGED
    };
    for (hint, guessed) in &hints {
        let Ok(geo) = geometry_of(dev.as_ref(), hint) else {
            continue;
        };
        let runs = [(
            geo.reserved_blocks(),
            geo.block_count - geo.reserved_blocks(),
        )];
        let found = scan_roots(
            dev.as_ref(),
            &geo,
            hint,
            &runs,
            u64::MAX,
            |h| h.uuid != hint.uuid && plausible(&h.uuid),
            true,
        )?;
        if let Some(sb) = found.first() {
            let mut fixed = *hint;
            fixed.uuid = sb.uuid;
            let why = format!(
                "{why}, and neither slot's UUID is any root's; took the UUID of the root run at block {}, which agrees with one slot or the other in all but at most {UUID_BYTES_BOTH_DAMAGED} of its bytes",
                sb.root_bno
            );
            if scan_and_rebuild(dev, &[(fixed, *guessed)], seen, None, &why, &mut report)?
                || report.unrepairable.is_some()
            {
                return Ok(report);
            }
            break;
        }
    }
    report.unrepairable = Some(
        "no valid superblock in either slot, and no intact root run found on the device".into(),
    );
    Ok(report)
}

/// Scans the whole file system that each of `hints` describes for root runs of its UUID, and
/// rebuilds from the newest generation that checks out (or the newest readable one, salvaged),
/// saying `why` first. `seen` (what is known of the newest generation's records) and `older`
/// (a generation read through a superblock) name what the rebuild lost. Returns whether it
/// rebuilt; refuses (setting `report.unrepairable`) where the generation counter has no room.
/// A hint whose block count is a guess (`true` beside it: no slot's reads as one that fits the
/// device) has it replaced by the end of the blocks each root found claims.
fn scan_and_rebuild(
    dev: Arc<dyn BlockDevice>,
    hints: &[(Superblock, bool)],
    seen: Option<Seen>,
    older: Option<&RawState>,
    why: &str,
    report: &mut FsckReport,
) -> Result<bool> {
    let mut repairs_note: Option<String> = None;
    for (hint, guessed) in hints {
        let Ok(geo) = geometry_of(dev.as_ref(), hint) else {
            continue;
        };
        let runs = [(
            geo.reserved_blocks(),
            geo.block_count - geo.reserved_blocks(),
        )];
        let mut found = scan_roots(
            dev.as_ref(),
            &geo,
            hint,
            &runs,
            u64::MAX,
            |h| h.uuid == hint.uuid,
            false,
        )?;
        found.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
        found.truncate(ROOT_CANDIDATES);
        let mut readable: Option<(RawState, Geometry)> = None;
        let mut clean: Option<(RawState, Geometry)> = None;
        for sb in &found {
            let Ok(mut raw) = read_raw_all(dev.as_ref(), &geo, sb) else {
                continue;
            };
            let mut geo = geo;
            if *guessed {
                // The block map tiles the file system: its last claimed block is the last one.
                let end = claimed_end(&raw);
                if end > geo.reserved_blocks() && end < geo.block_count {
                    geo.block_count = end;
                    raw.sb.block_count = end;
                }
            }
            if check(&geo, &raw).is_empty() {
                clean = Some((raw, geo));
                break;
            }
            if readable.is_none() {
                readable = Some((raw, geo));
            }
        }
        // `readable`, if set, is newer than `clean`: what a rollback to `clean` loses.
        let ((base, geo), newest) = match (clean, readable) {
            (Some(c), r) => (c, r.map(|(r, _)| r)),
            (None, Some(r)) => (r, None),
            (None, None) => continue,
        };
        if *guessed {
            repairs_note = Some(format!(
                "no superblock slot gave a block count that fits the device; took {} blocks, where the block map of generation {} ends",
                geo.block_count, base.sb.generation
            ));
        }
        let mut repairs = vec![format!(
            "{why}; found the root run of generation {} at block {} by scanning the device",
            base.sb.generation, base.sb.root_bno
        )];
        repairs.extend(repairs_note.take());
        let top = base.sb.generation.max(hint.generation);
        let top = if top.checked_add(2).is_some() {
            top
        } else {
            base.sb.generation
        };
        if let Some(why) = exhausted(top) {
            report.unrepairable = Some(why);
            return Ok(false);
        }
        let mut state = salvage(dev.as_ref(), &geo, &base, top + 1, &mut repairs);
        state.generation = top;
        let seen = match (newest.as_ref().map(seen_of), seen.clone()) {
            (Some(n), _) if n.incomplete.is_none() => n,
            (Some(n), Some(s)) if s.records.len() > n.records.len() => s,
            (Some(n), _) => n,
            (None, Some(s)) => s,
            // No newer root reads: complete only if no slot claims a newer generation.
            (None, None) if hint.generation <= base.sb.generation => seen_of(&base),
            (None, None) => Seen::unknown(format!(
                "no root run of generation {} or any newer than {} reads: the files only those generations held are unknown",
                hint.generation, base.sb.generation
            )),
        };
        let (lost, reverted, unknown) = changes(&seen, older, &base, &state);
        rewrite(dev.clone(), geo, state, top, repairs, report)?;
        report.lost = lost;
        report.reverted = reverted;
        report.lost_unknown = unknown;
        return Ok(true);
    }
    Ok(false)
}

/// Both superblock slots' bytes as superblocks, whatever they hold (`None` past the device's
/// end).
fn read_raw_slots(dev: &dyn BlockDevice) -> Result<Vec<Option<Superblock>>> {
    let lba = dev.lba_size() as u64;
    let mut raws: Vec<Option<Superblock>> = Vec::new();
    for &off in SUPERBLOCK_SLOTS.iter() {
        if off / lba >= dev.lba_count() {
            raws.push(None);
            continue;
        }
        let mut buf = vec![0u8; lba as usize];
        dev.read(&mut [ReadReq {
            lba: off / lba,
            buf: &mut buf,
        }])
        .during("reading the superblocks")?;
        raws.push(Superblock::read_from_prefix(&buf).ok().map(|(sb, _)| sb));
    }
    Ok(raws)
}

/// The end of the blocks a generation's metadata claims: its root run, chunk runs, free and
/// pending runs and the extents of every record that decoded.
fn claimed_end(raw: &RawState) -> u64 {
    let ends = [raw.sb.root_bno + raw.sb.root_blocks as u64]
        .into_iter()
        .chain(raw.root.chunks.iter().map(|d| d.bno + d.nblocks as u64))
        .chain(raw.root.free.iter().map(|f| f.bno.saturating_add(f.len)))
        .chain(raw.root.pending.iter().map(|p| p.bno.saturating_add(p.len)))
        .chain(
            raw.chunks
                .iter()
                .flat_map(|c| c.image.records.iter())
                .flat_map(|r| r.extents.iter())
                .map(|e| e.bno.saturating_add(e.len)),
        );
    ends.max().unwrap_or(0)
}

/// Superblocks read from slots that hold the superblock magic but failed to decode, with the
/// fields repair does not trust (checksums, reserved bytes, version) set to what this build
/// writes. Geometry fields are taken as found where they are usable, else from the other slot
/// (whether or not it has the magic): the block size where this slot's is not one; the block
/// count where this slot's does not fit the device ([`geometry_of`]), else the device's whole
/// capacity, marked `true` as a guess for the root scan to correct; and the other slot's UUID
/// as a second hint where the two differ (one of them damaged: the root scan tells which).
fn damaged_slot_hints(dev: &dyn BlockDevice) -> Result<Vec<(Superblock, bool)>> {
    let lba = dev.lba_size() as u64;
    let raws = read_raw_slots(dev)?;
    let usable_bs = |bs: u32| {
        bs.is_power_of_two()
            && (crate::format::MIN_BLOCK_SIZE..=crate::format::MAX_BLOCK_SIZE).contains(&bs)
    };
    let mut out: Vec<(Superblock, bool)> = Vec::new();
    for (i, raw) in raws.iter().enumerate() {
        let Some(mut sb) = *raw else {
            continue;
        };
        if sb.magic != crate::format::SUPERBLOCK_MAGIC {
            continue;
        }
        let other = raws.get(1 - i).copied().flatten();
        if !usable_bs(sb.block_size) {
            match other.filter(|o| usable_bs(o.block_size)) {
                Some(o) => sb.block_size = o.block_size,
                None => continue,
            }
        }
        // Informational, but a superblock must carry a usable one: the other slot's, else the
        // device's.
        let usable_lba =
            |l: u32| l.is_power_of_two() && (512..=crate::format::MAX_LBA_SIZE).contains(&l);
        if !usable_lba(sb.mkfs_lba_size) {
            sb.mkfs_lba_size = other
                .map(|o| o.mkfs_lba_size)
                .filter(|&l| usable_lba(l))
                .unwrap_or(dev.lba_size());
        }
        sb.version = crate::format::FORMAT_VERSION;
        sb.header_size = crate::format::SUPERBLOCK_SIZE as u32;
        sb.reserved = [0; 148];
        sb.incompat_features = 0;
        sb.ro_compat_features = 0;
        sb.compat_features = 0;
        let fits = |count: u64| {
            let mut t = sb;
            t.block_count = count;
            geometry_of(dev, &t).is_ok() && count > reserved_blocks(sb.block_size)
        };
        let mut guessed = false;
        if !fits(sb.block_count) {
            match other.map(|o| o.block_count).filter(|&c| fits(c)) {
                Some(c) => sb.block_count = c,
                None => {
                    sb.block_count = dev.lba_count().saturating_mul(lba) / sb.block_size as u64;
                    guessed = true;
                }
            }
        }
        let mut uuids = vec![sb.uuid];
        if let Some(o) = other
            && o.uuid != sb.uuid
        {
            uuids.push(o.uuid);
        }
        for uuid in uuids {
            sb.uuid = uuid;
            if !out.iter().any(|(o, _)| {
                o.uuid == sb.uuid
                    && o.block_size == sb.block_size
                    && o.block_count == sb.block_count
            }) {
                out.push((sb, guessed));
            }
        }
    }
    Ok(out)
}

/// The read-only part of fsck.
fn run_check(dev: &dyn BlockDevice) -> Result<FsckReport> {
    let slots = read_slots(dev)?;
    let mut report = FsckReport::default();
    for (i, s) in slots.iter().enumerate() {
        report.slots.push(SlotReport {
            slot: i,
            byte_offset: SUPERBLOCK_SLOTS[i],
            generation: s.as_ref().ok().map(|sb| sb.generation),
            problem: s.as_ref().err().map(|p| p.to_string()),
        });
        if let Err(p) = s {
            report.problems.push(Problem {
                what: slot_name(i),
                detail: p.to_string(),
            });
        }
    }
    if slots.iter().all(|s| s.is_ok())
        && let Err(e) = pick_superblock(&slots)
    {
        report.problems.push(match e {
            Error::Corrupt { what, detail } => Problem { what, detail },
            other => Problem {
                what: "superblock slots".into(),
                detail: other.to_string(),
            },
        });
    }
    let mut valid: Vec<Superblock> = slots
        .iter()
        .filter_map(|s| s.as_ref().ok().copied())
        .collect();
    valid.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
    let Some(newest) = valid.first() else {
        return Ok(report);
    };
    report.generation = Some(newest.generation);
    let (checked, geo) = check_generation(dev, newest)?;
    report.problems.extend(checked.problems);
    if let (Some(raw), Some(geo)) = (&checked.raw, geo) {
        report.fill_stats(raw, geo.reserved_blocks());
    }
    if let Some(older) = valid.get(1) {
        report.older_generation = Some(older.generation);
        let (checked, _) = check_generation(dev, older)?;
        report.older_problems = checked.problems;
    }
    Ok(report)
}
