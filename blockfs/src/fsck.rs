//! fsck: checks both generations on the device and, when asked, rebuilds a consistent one.

use std::sync::Arc;

use zerocopy::FromBytes;

use crate::commit::commit;
use crate::device::{BlockDevice, ReadReq};
use crate::error::{DeviceResultExt, Error, Result};
use crate::format::{
    PendingExtent, ROOT_MAGIC, RootHeader, SUPERBLOCK_SLOTS, Superblock, crc, root_len,
    root_self_crc,
};
use crate::fs::FileSystem;
use crate::geometry::Geometry;
use crate::load::{Problem, RawState, check, geometry_of, read_raw, salvage};
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
        self.metadata_blocks = h.meta_blocks + reserved;
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
    match read_raw(dev, &geo, sb) {
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
/// the newest generation if only a superblock slot is damaged; the previous generation (the
/// second superblock) if the newest one's metadata is damaged and the previous one is intact;
/// otherwise whatever records of the newest generation still decode, with files that overlap
/// others cut short and the free-space map recomputed. It then commits the result twice, so
/// both slots hold valid consecutive generations, and checks again. Fails only on device
/// errors.
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
    let Some(geo) = new_geo else {
        report.unrepairable = Some(new_checked.problems[0].to_string());
        return Ok(report);
    };
    let mut repairs = Vec::new();
    // One slot unreadable: it may have held the newest generation. Its root run is still on
    // the device; look for it where the allocator would have put it.
    let mut found: Option<RawState> = None;
    if valid.len() == 1
        && let Some(raw) = &new_checked.raw
        && let Some(sb) = find_lost_root(dev.as_ref(), &geo, raw, newest.generation + 1)?
        && let Ok(lost) = read_raw(dev.as_ref(), &geo, &sb)
        && check(&geo, &lost).is_empty()
    {
        repairs.push(format!(
            "superblock slot {} was unreadable; found the root run of generation {} at block {} and recovered that generation",
            sb.slot, sb.generation, sb.root_bno
        ));
        found = Some(lost);
    }
    let base: &RawState = match (&new_checked, &old_checked) {
        _ if found.is_some() => found.as_ref().expect("checked"),
        (
            Checked {
                raw: Some(raw),
                problems,
            },
            _,
        ) if problems.is_empty() => raw,
        (
            _,
            Some((
                Checked {
                    raw: Some(raw),
                    problems,
                },
                _,
            )),
        ) if problems.is_empty() => {
            repairs.push(format!(
                "rolled back from generation {} to generation {} (the second superblock): {}",
                newest.generation, raw.sb.generation, new_checked.problems[0]
            ));
            raw
        }
        (Checked { raw: Some(raw), .. }, _) => {
            repairs.push(format!("salvaging generation {}", raw.sb.generation));
            raw
        }
        (_, Some((Checked { raw: Some(raw), .. }, _))) => {
            repairs.push(format!(
                "salvaging generation {} (the second superblock): {}",
                raw.sb.generation, new_checked.problems[0]
            ));
            raw
        }
        _ => {
            report.unrepairable = Some(format!(
                "the root run of every generation is unreadable: {}",
                new_checked.problems[0]
            ));
            return Ok(report);
        }
    };
    let top = newest.generation.max(base.sb.generation);
    let mut state = salvage(&geo, base, top + 1, &mut repairs);
    state.generation = top;
    rewrite(dev, geo, state, top, repairs, &mut report)?;
    Ok(report)
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
        top + 1,
        top + 2
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

/// Looks for the root run of generation `target` (one past `raw`'s) in the blocks that were
/// free when `raw` was committed, lowest address first, the order the allocator uses. Returns a
/// superblock naming it if one is found whose UUID, generation and self-checksum match.
fn find_lost_root(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    raw: &RawState,
    target: u64,
) -> Result<Option<Superblock>> {
    let mut runs: Vec<(u64, u64)> = raw.root.free.iter().map(|f| (f.bno, f.len)).collect();
    runs.extend(
        raw.root
            .pending
            .iter()
            .filter(|p| p.freed_gen < raw.sb.generation)
            .map(|p| (p.bno, p.len)),
    );
    runs.sort_unstable();
    let found = scan_roots(
        dev,
        geo,
        &raw.sb,
        &runs,
        LOST_ROOT_SCAN_BLOCKS,
        |g| g == target,
        true,
    )?;
    Ok(found.into_iter().next())
}

/// Scans the blocks of `runs` (at most `max_blocks` of them) for root runs of `template`'s file
/// system (same UUID, valid self-checksum) whose generation `want` accepts, and returns a
/// superblock for each: `template` with the generation, slot and root fields filled in. With
/// `first_only`, stops at the first.
fn scan_roots(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    template: &Superblock,
    runs: &[(u64, u64)],
    max_blocks: u64,
    want: impl Fn(u64) -> bool,
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
                if h.magic != ROOT_MAGIC || h.uuid != template.uuid || !want(h.generation) {
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
                sb.generation = h.generation;
                sb.slot = (h.generation % 2) as u32;
                sb.root_bno = bno;
                sb.root_blocks = blocks as u32;
                sb.root_bytes = bytes as u32;
                sb.root_crc = crc(root);
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
    for hint in hints {
        let Ok(geo) = geometry_of(dev.as_ref(), &hint) else {
            continue;
        };
        let runs = [(
            geo.reserved_blocks(),
            geo.block_count - geo.reserved_blocks(),
        )];
        let mut found = scan_roots(dev.as_ref(), &geo, &hint, &runs, u64::MAX, |_| true, false)?;
        found.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
        found.truncate(ROOT_CANDIDATES);
        let mut readable: Option<RawState> = None;
        let mut clean: Option<RawState> = None;
        for sb in &found {
            let Ok(raw) = read_raw(dev.as_ref(), &geo, sb) else {
                continue;
            };
            if check(&geo, &raw).is_empty() {
                clean = Some(raw);
                break;
            }
            if readable.is_none() {
                readable = Some(raw);
            }
        }
        let Some(base) = clean.or(readable) else {
            continue;
        };
        let mut repairs = vec![format!(
            "neither superblock slot was valid; found the root run of generation {} at block {} by scanning the device",
            base.sb.generation, base.sb.root_bno
        )];
        let top = base.sb.generation;
        let mut state = salvage(&geo, &base, top + 1, &mut repairs);
        state.generation = top;
        rewrite(dev.clone(), geo, state, top, repairs, &mut report)?;
        return Ok(report);
    }
    report.unrepairable = Some(
        "no valid superblock in either slot, and no intact root run found on the device".into(),
    );
    Ok(report)
}

/// Superblocks read from slots that hold the superblock magic but failed to decode, with the
/// fields repair does not trust (checksums, reserved bytes, version) set to what this build
/// writes. Geometry fields are taken as found; [`geometry_of`] vets them.
fn damaged_slot_hints(dev: &dyn BlockDevice) -> Result<Vec<Superblock>> {
    let lba = dev.lba_size() as u64;
    let mut out: Vec<Superblock> = Vec::new();
    for &off in SUPERBLOCK_SLOTS.iter() {
        if off / lba >= dev.lba_count() {
            continue;
        }
        let mut buf = vec![0u8; lba as usize];
        dev.read(&mut [ReadReq {
            lba: off / lba,
            buf: &mut buf,
        }])
        .during("reading the superblocks")?;
        let Ok((mut sb, _)) = Superblock::read_from_prefix(&buf) else {
            continue;
        };
        if sb.magic != crate::format::SUPERBLOCK_MAGIC
            || !sb.block_size.is_power_of_two()
            || !(crate::format::MIN_BLOCK_SIZE..=crate::format::MAX_BLOCK_SIZE)
                .contains(&sb.block_size)
        {
            continue;
        }
        sb.version = crate::format::FORMAT_VERSION;
        sb.header_size = crate::format::SUPERBLOCK_SIZE as u32;
        sb.reserved = [0; 148];
        sb.incompat_features = 0;
        sb.ro_compat_features = 0;
        sb.compat_features = 0;
        if !out.iter().any(|o| {
            o.uuid == sb.uuid && o.block_size == sb.block_size && o.block_count == sb.block_count
        }) {
            out.push(sb);
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
