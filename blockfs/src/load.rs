//! Reading a generation's metadata from the device: strictly for mount and fsck, or salvaging
//! what can be kept for fsck's repair.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::device::{BlockDevice, ReadReq};
use crate::error::{DeviceResultExt, Error, Result, corrupt};
use crate::extents::ExtentList;
use zerocopy::FromBytes;

use crate::format::{
    self, ChunkDesc, ChunkImage, Extent, FileRecord, RecordLimits, RootImage, Superblock,
    decode_chunk, decode_root,
};
use crate::geometry::Geometry;
use crate::state::{ChunkSlot, Inode, State};

/// One inconsistency found in the metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Which structure ("file table chunk at block 12 (generation 4)", "block map").
    pub what: String,
    /// What is wrong.
    pub detail: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.what, self.detail)
    }
}

impl From<Problem> for Error {
    fn from(p: Problem) -> Self {
        Error::Corrupt {
            what: p.what,
            detail: p.detail,
        }
    }
}

/// A file-table chunk as read.
#[derive(Debug)]
pub(crate) struct RawChunk {
    pub desc: ChunkDesc,
    pub crc_ok: bool,
    pub image: ChunkImage,
    /// Why the chunk was not read at all (its descriptor claims more than the format allows).
    pub unread: Option<String>,
}

/// A generation's metadata as read, before any cross-checks.
#[derive(Debug)]
pub(crate) struct RawState {
    pub sb: Superblock,
    pub root: RootImage,
    pub chunks: Vec<RawChunk>,
}

pub(crate) fn root_name(sb: &Superblock) -> String {
    format!(
        "root run at block {} (generation {})",
        sb.root_bno, sb.generation
    )
}

pub(crate) fn chunk_name(d: &ChunkDesc, generation: u64) -> String {
    format!(
        "file table chunk at block {} (generation {generation})",
        d.bno
    )
}

/// The geometry a superblock describes on this device.
pub(crate) fn geometry_of(dev: &dyn BlockDevice, sb: &Superblock) -> Result<Geometry> {
    let lba = dev.lba_size();
    if sb.block_size % lba != 0 {
        return Err(Error::Geometry(format!(
            "block size {} is not a multiple of the device's {lba}-byte LBAs",
            sb.block_size
        )));
    }
    let have = dev.lba_count().saturating_mul(lba as u64);
    // Bounded by Superblock::decode, but repair also asks about damaged slots' fields.
    let Some(need) = sb.block_count.checked_mul(sb.block_size as u64) else {
        return Err(Error::Geometry(format!(
            "{} blocks of {} bytes do not fit a 64-bit byte count",
            sb.block_count, sb.block_size
        )));
    };
    if have < need {
        return Err(Error::Geometry(format!(
            "device holds {have} bytes but the file system spans {need} (truncated device?)"
        )));
    }
    Ok(Geometry {
        block_size: sb.block_size,
        lba_size: lba,
        mkfs_lba_size: sb.mkfs_lba_size,
        block_count: sb.block_count,
        uuid: sb.uuid,
    })
}

/// Most bytes of chunk buffers held at once while reading a file table: chunks are read in
/// batches of about this size, each batch decoded (and its checksums verified) and its buffers
/// dropped before the next is read. A chunk larger than this is read alone.
const CHUNK_BATCH_BYTES: u64 = 16 << 20;

/// Longest a file record can be apart from its extents: the fixed part plus the longest name,
/// padded.
const MAX_RECORD_FIXED: u64 = 48 + format::MAX_NAME_LEN as u64 + 7;

/// Reads the root run and the chunks of the generation `sb` names, for mount: stops at the
/// first chunk that fails its checksum or does not decode, with the error [`check`] would
/// report for it, so a damaged or hostile image fails after reading at most what precedes the
/// damage. Sizes are checked against the device and the format's bounds before anything is
/// allocated for them.
pub(crate) fn read_raw(dev: &dyn BlockDevice, geo: &Geometry, sb: &Superblock) -> Result<RawState> {
    read_raw_with(dev, geo, sb, true)
}

/// Reads the root run and every chunk of the generation `sb` names, for fsck. Fails only for
/// device errors and an unusable root run; chunk problems are left for the caller to judge.
pub(crate) fn read_raw_all(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    sb: &Superblock,
) -> Result<RawState> {
    read_raw_with(dev, geo, sb, false)
}

fn read_raw_with(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    sb: &Superblock,
    strict: bool,
) -> Result<RawState> {
    let bs = geo.block_size as usize;
    let what = || root_name(sb);
    // `root_blocks` is `ceil(root_bytes / block_size)`, or one more when taking the root's own
    // blocks used up a whole free run after its size was fixed (FORMAT.md, "Root run").
    let least = (sb.root_bytes as u64).div_ceil(bs as u64);
    if !(least..=least + 1).contains(&(sb.root_blocks as u64)) {
        return Err(corrupt(
            what(),
            format!("{} bytes in {} blocks", sb.root_bytes, sb.root_blocks),
        ));
    }
    let data_area = geo.block_count.saturating_sub(geo.reserved_blocks());
    if sb.root_blocks as u64 > data_area {
        return Err(corrupt(
            what(),
            format!(
                "{} blocks, more than the {data_area}-block data area",
                sb.root_blocks
            ),
        ));
    }
    // The header's counts fix the root's length: check them against `root_bytes` and the
    // format's bounds from the first block before reading (and allocating) the whole run.
    let mut first = vec![0u8; bs];
    dev.read(&mut [ReadReq {
        lba: geo.lba(sb.root_bno),
        buf: &mut first,
    }])
    .during("reading the root run")?;
    if let Ok((h, _)) = format::RootHeader::read_from_prefix(&first[..]) {
        let (c, f, p) = (
            h.chunk_count as u64,
            h.free_count as u64,
            h.pending_count as u64,
        );
        let len = format::root_len(c as usize, f as usize, p as usize) as u64;
        if len != sb.root_bytes as u64 {
            return Err(corrupt(
                what(),
                format!(
                    "{c} chunks, {f} free and {p} pending runs do not fill {} bytes",
                    sb.root_bytes
                ),
            ));
        }
        if c > data_area || f > data_area || p > data_area {
            return Err(corrupt(
                what(),
                format!(
                    "{c} chunks, {f} free and {p} pending runs in a {data_area}-block data area"
                ),
            ));
        }
    }
    let mut buf = first;
    if sb.root_blocks > 1 {
        buf.resize(sb.root_blocks as usize * bs, 0);
        dev.read(&mut [ReadReq {
            lba: geo.lba(sb.root_bno + 1),
            buf: &mut buf[bs..],
        }])
        .during("reading the root run")?;
    }
    let bytes = &buf[..sb.root_bytes as usize];
    let computed = format::crc(bytes);
    if computed != sb.root_crc {
        return Err(corrupt(
            what(),
            format!(
                "checksum mismatch (superblock says {:#010x}, computed {computed:#010x})",
                sb.root_crc
            ),
        ));
    }
    let root = decode_root(bytes, sb).map_err(|d| corrupt(what(), d))?;
    drop(buf);
    // Sizes against the device and the format: all chunks fit in the data area beside the
    // root, and no chunk is longer than its records can be (each record's fixed part and name,
    // plus at most one extent per block of the file system).
    let mut total = 0u64;
    for d in &root.chunks {
        if d.nblocks as u64 != (d.bytes as u64).div_ceil(bs as u64) {
            return Err(corrupt(
                chunk_name(d, sb.generation),
                format!("{} bytes in {} blocks", d.bytes, d.nblocks),
            ));
        }
        total += d.nblocks as u64;
    }
    let room = data_area - sb.root_blocks as u64;
    if total > room {
        return Err(corrupt(
            what(),
            format!(
                "chunks claim {total} blocks, but the data area has {room} beside the root run"
            ),
        ));
    }
    let longest = |records: u64| {
        size_of::<format::ChunkHeader>() as u64
            + records.saturating_mul(MAX_RECORD_FIXED)
            + 16 * geo.block_count
    };
    // All chunks together: their records' fixed parts and names, and at most one extent per
    // block of the file system among them. (A chunk over its own bound is left unread below,
    // as a damaged chunk.)
    let claimed: u64 = root
        .chunks
        .iter()
        .filter(|d| d.bytes as u64 <= longest(d.records as u64))
        .map(|d| d.bytes as u64)
        .sum();
    let most = size_of::<format::ChunkHeader>() as u64 * root.chunks.len() as u64
        + root.header.file_count.saturating_mul(MAX_RECORD_FIXED)
        + 16 * geo.block_count;
    if claimed > most {
        return Err(corrupt(
            what(),
            format!(
                "chunks claim {claimed} bytes for {} records, more than such records can take ({most})",
                root.header.file_count
            ),
        ));
    }
    let lim = RecordLimits {
        block_size: geo.block_size,
        block_count: geo.block_count,
        generation: sb.generation,
    };
    let mut chunks: Vec<RawChunk> = Vec::with_capacity(root.chunks.len());
    let mut batch: Vec<ChunkDesc> = Vec::new();
    let mut batch_bytes = 0u64;
    let flush = |batch: &mut Vec<ChunkDesc>, chunks: &mut Vec<RawChunk>| -> Result<()> {
        let mut bufs: Vec<Vec<u8>> = batch
            .iter()
            .map(|d| vec![0u8; d.nblocks as usize * bs])
            .collect();
        let mut reqs: Vec<ReadReq<'_>> = batch
            .iter()
            .zip(bufs.iter_mut())
            .map(|(d, b)| ReadReq {
                lba: geo.lba(d.bno),
                buf: b,
            })
            .collect();
        dev.read(&mut reqs).during("reading the file table")?;
        drop(reqs);
        for (d, b) in batch.drain(..).zip(bufs) {
            let bytes = &b[..d.bytes as usize];
            let c = RawChunk {
                desc: d,
                crc_ok: format::crc(bytes) == d.crc,
                image: decode_chunk(bytes, d.records, &lim),
                unread: None,
            };
            if strict {
                strict_chunk(&c, sb.generation)?;
            }
            chunks.push(c);
        }
        Ok(())
    };
    for d in &root.chunks {
        let max = longest(d.records as u64);
        if d.bytes as u64 > max {
            let c = RawChunk {
                desc: *d,
                crc_ok: false,
                image: ChunkImage {
                    header: None,
                    records: Vec::new(),
                    error: None,
                    dropped: Vec::new(),
                    unparsed_from: None,
                    resumed_at: None,
                },
                unread: Some(format!(
                    "{} bytes for {} records, more than such records can take ({max}); not read",
                    d.bytes, d.records
                )),
            };
            if strict {
                strict_chunk(&c, sb.generation)?;
            }
            chunks.push(c);
            continue;
        }
        let len = d.nblocks as u64 * bs as u64;
        if !batch.is_empty() && batch_bytes + len > CHUNK_BATCH_BYTES {
            flush(&mut batch, &mut chunks)?;
            batch_bytes = 0;
        }
        batch.push(*d);
        batch_bytes += len;
    }
    if !batch.is_empty() {
        flush(&mut batch, &mut chunks)?;
    }
    Ok(RawState {
        sb: *sb,
        root,
        chunks,
    })
}

/// The problem [`check`] reports first for a chunk on its own, if any.
fn chunk_problem(c: &RawChunk, generation: u64) -> Option<Problem> {
    let what = || chunk_name(&c.desc, generation);
    if let Some(u) = &c.unread {
        return Some(Problem {
            what: what(),
            detail: u.clone(),
        });
    }
    if !c.crc_ok {
        return Some(Problem {
            what: what(),
            detail: "checksum mismatch".into(),
        });
    }
    c.image.error.as_ref().map(|e| Problem {
        what: what(),
        detail: e.clone(),
    })
}

fn strict_chunk(c: &RawChunk, generation: u64) -> Result<()> {
    match chunk_problem(c, generation) {
        Some(p) => Err(p.into()),
        None => Ok(()),
    }
}

/// Who owns a run of blocks, for overlap messages.
#[derive(Clone, Debug)]
enum Owner {
    Reserved,
    Root,
    Chunk(u64),
    File(String),
    Free,
    Pending,
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Reserved => f.write_str("the superblock area"),
            Owner::Root => f.write_str("the root run"),
            Owner::Chunk(b) => write!(f, "the file table chunk at block {b}"),
            Owner::File(n) => write!(f, "file {n:?}"),
            Owner::Free => f.write_str("the free list"),
            Owner::Pending => f.write_str("the pending-free list"),
        }
    }
}

/// Checks that the claims tile `0..block_count` exactly: no block twice, none left out.
/// Overlaps are reported before leaks (a moved extent shows up as both; the overlap is the
/// damage that matters).
fn check_tiling(mut claims: Vec<(u64, u64, Owner)>, block_count: u64, out: &mut Vec<Problem>) {
    claims.sort_by_key(|c| (c.0, c.1));
    let mut leaks = Vec::new();
    let mut end = 0u64;
    let mut last: Option<Owner> = None;
    let block_map = |detail: String| Problem {
        what: "block map".into(),
        detail,
    };
    for (start, len, owner) in claims {
        if start < end {
            out.push(block_map(format!(
                "blocks {start}..{} are claimed by both {} and {owner}",
                end.min(start + len),
                last.as_ref().map_or("?".to_string(), |o| o.to_string())
            )));
        } else if start > end {
            leaks.push(block_map(format!(
                "blocks {end}..{start} are neither used nor free (leaked)"
            )));
        }
        if start + len > end {
            end = start + len;
            last = Some(owner);
        }
    }
    if end < block_count {
        leaks.push(block_map(format!(
            "blocks {end}..{block_count} are neither used nor free (leaked)"
        )));
    }
    out.extend(leaks);
}

/// Every problem in a generation, strictly: bad checksums, bad records, duplicate names or
/// ids, wrong counters, and any block claimed twice or by nobody.
pub(crate) fn check(geo: &Geometry, raw: &RawState) -> Vec<Problem> {
    let mut out = Vec::new();
    let g = raw.sb.generation;
    let mut claims: Vec<(u64, u64, Owner)> = vec![
        (0, geo.reserved_blocks(), Owner::Reserved),
        (raw.sb.root_bno, raw.sb.root_blocks as u64, Owner::Root),
    ];
    let mut names: HashMap<&str, u64> = HashMap::new();
    let mut ids: BTreeSet<u64> = BTreeSet::new();
    let mut data_blocks = 0u64;
    for c in &raw.chunks {
        let what = chunk_name(&c.desc, g);
        claims.push((c.desc.bno, c.desc.nblocks as u64, Owner::Chunk(c.desc.bno)));
        if let Some(p) = chunk_problem(c, g) {
            out.push(p);
            if !c.crc_ok {
                continue;
            }
        }
        for r in &c.image.records {
            if let Some(other) = names.insert(&r.name, r.file_id) {
                out.push(Problem {
                    what: what.clone(),
                    detail: format!("name {:?} used by files {other} and {}", r.name, r.file_id),
                });
            }
            if !ids.insert(r.file_id) {
                out.push(Problem {
                    what: what.clone(),
                    detail: format!("file id {} appears twice", r.file_id),
                });
            }
            if r.file_id >= raw.root.header.next_file_id {
                out.push(Problem {
                    what: what.clone(),
                    detail: format!(
                        "file id {} is not below the next id {}",
                        r.file_id, raw.root.header.next_file_id
                    ),
                });
            }
            for e in &r.extents {
                claims.push((e.bno, e.len, Owner::File(r.name.clone())));
            }
            data_blocks += r.alloc_blocks();
        }
    }
    if !out.is_empty() {
        return out; // the block map of a damaged table would only repeat the damage
    }
    let h = &raw.root.header;
    let meta_blocks: u64 = raw
        .chunks
        .iter()
        .map(|c| c.desc.nblocks as u64)
        .sum::<u64>()
        + raw.sb.root_blocks as u64;
    if h.data_blocks != data_blocks || h.meta_blocks != meta_blocks {
        out.push(Problem {
            what: root_name(&raw.sb),
            detail: format!(
                "counts {} data and {} metadata blocks, the tables hold {data_blocks} and {meta_blocks}",
                h.data_blocks, h.meta_blocks
            ),
        });
    }
    claims.extend(raw.root.free.iter().map(|f| (f.bno, f.len, Owner::Free)));
    claims.extend(
        raw.root
            .pending
            .iter()
            .map(|p| (p.bno, p.len, Owner::Pending)),
    );
    check_tiling(claims, geo.block_count, &mut out);
    out
}

/// A mountable state from a generation that passed [`check`].
fn build(raw: &RawState) -> State {
    let mut st = State {
        generation: raw.sb.generation,
        next_file_id: raw.root.header.next_file_id,
        root: Some((raw.sb.root_bno, raw.sb.root_blocks)),
        ..State::default()
    };
    for (key, c) in raw.chunks.iter().enumerate() {
        let key = key as u64;
        let mut files = BTreeSet::new();
        for r in &c.image.records {
            files.insert(r.file_id);
            st.names.insert(r.name.clone(), r.file_id);
            st.inodes.insert(r.file_id, inode_of(r, Some(key)));
        }
        st.chunks.insert(
            key,
            ChunkSlot {
                desc: c.desc,
                files,
                dirty: false,
            },
        );
    }
    st.next_chunk_key = raw.chunks.len() as u64;
    for f in &raw.root.free {
        st.alloc.insert_free(f.bno, f.len);
    }
    for p in &raw.root.pending {
        st.alloc.insert_pending(*p);
    }
    st.alloc.release(raw.sb.generation.saturating_sub(1), &[]);
    st
}

fn inode_of(r: &FileRecord, chunk: Option<u64>) -> Inode {
    Inode {
        id: r.file_id,
        name: r.name.clone(),
        size: r.size,
        flags: r.flags,
        generation: r.generation,
        extents: ExtentList::from_vec(r.extents.clone()),
        data_crc: r.data_crc,
        chunk,
        modified: false,
    }
}

/// The state to mount, or the first problem as an error.
pub(crate) fn strict_state(geo: &Geometry, raw: &RawState) -> Result<State> {
    match check(geo, raw).into_iter().next() {
        Some(p) => Err(p.into()),
        None => Ok(build(raw)),
    }
}

/// How a dropped record is named in messages: its name if readable, else its file id.
pub(crate) fn dropped_label(d: &format::DroppedRecord) -> String {
    match &d.name {
        Some(n) => format!("file {n:?}, id {}", d.file_id),
        None => format!("file id {}, name unreadable", d.file_id),
    }
}

/// Disjoint runs claimed so far, by start: `start -> (end, owner)`.
#[derive(Default)]
struct Claimed(BTreeMap<u64, (u64, String)>);

impl Claimed {
    /// The lowest claimed run overlapping `start..start+len`.
    fn first_conflict(&self, start: u64, len: u64) -> Option<(u64, u64, &str)> {
        if let Some((&s, (e, o))) = self.0.range(..=start).next_back()
            && *e > start
        {
            return Some((s, *e, o));
        }
        self.0
            .range(start..start + len)
            .next()
            .map(|(&s, (e, o))| (s, *e, o.as_str()))
    }

    fn claim(&mut self, start: u64, len: u64, owner: String) {
        self.0.insert(start, (start + len, owner));
    }
}

/// The owner label of the source's metadata runs in [`salvage`]'s block claims.
const OLD_META: &str = "old metadata";

/// Most bytes of file data buffered at once while [`salvage`] checks a data checksum.
const VERIFY_BATCH_BYTES: u64 = 1 << 20;

/// The file ids of the records that claim blocks another record claims too and whose data
/// checksum (FLAG_DATA_CRC) verifies against what the device holds in their extents. Only the
/// files in such a conflict are read.
fn verified_in_conflict(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    records: &[FileRecord],
) -> HashSet<u64> {
    let mut runs: Vec<(u64, u64, usize)> = records
        .iter()
        .enumerate()
        .flat_map(|(i, r)| r.extents.iter().map(move |e| (e.bno, e.bno + e.len, i)))
        .collect();
    runs.sort_unstable();
    // A run that overlaps any earlier one overlaps the one reaching furthest.
    let mut conflicted: BTreeSet<usize> = BTreeSet::new();
    let mut reach: Option<(u64, usize)> = None;
    for &(start, end, i) in &runs {
        if let Some((far, j)) = reach
            && start < far
            && j != i
        {
            conflicted.insert(i);
            conflicted.insert(j);
        }
        if reach.is_none_or(|(far, _)| end > far) {
            reach = Some((end, i));
        }
    }
    conflicted
        .into_iter()
        .map(|i| &records[i])
        .filter(|r| data_verifies(dev, geo, r))
        .map(|r| r.file_id)
        .collect()
}

/// Whether `r` records a data checksum and the bytes `0..size` its extents hold match it (a
/// device error reading them counts as no).
fn data_verifies(dev: &dyn BlockDevice, geo: &Geometry, r: &FileRecord) -> bool {
    if r.flags & format::FLAG_DATA_CRC == 0 {
        return false;
    }
    let bs = geo.block_size as u64;
    let batch = (VERIFY_BATCH_BYTES / bs).max(1);
    let mut buf = vec![0u8; (batch * bs).min(r.size.next_multiple_of(bs)).max(bs) as usize];
    let mut left = r.size;
    let mut crc = 0u32;
    for e in &r.extents {
        let (mut b, end) = (e.bno, e.bno.saturating_add(e.len).min(geo.block_count));
        while left > 0 && b < end {
            let n = (buf.len() as u64 / bs).min(end - b);
            let bytes = (n * bs) as usize;
            if dev
                .read(&mut [ReadReq {
                    lba: geo.lba(b),
                    buf: &mut buf[..bytes],
                }])
                .is_err()
            {
                return false;
            }
            let take = left.min(n * bs) as usize;
            crc = crc32c::crc32c_append(crc, &buf[..take]);
            left -= take as u64;
            b += n;
        }
    }
    left == 0 && crc == r.data_crc
}

/// Builds the best consistent state the generation allows, saying what it dropped or cut, for
/// fsck's repair. Every record is rewritten by the next commit; the runs the old metadata sits
/// in wait two commits before reuse, so a crash during the repair leaves them readable.
pub(crate) fn salvage(
    dev: &dyn BlockDevice,
    geo: &Geometry,
    raw: &RawState,
    freed_gen: u64,
    repairs: &mut Vec<String>,
) -> State {
    let g = raw.sb.generation;
    let bs = geo.block_size as u64;
    let mut records: Vec<FileRecord> = Vec::new();
    for c in &raw.chunks {
        let what = chunk_name(&c.desc, g);
        let n = c.image.records.len();
        let sum = if c.crc_ok { "" } else { "checksum mismatch; " };
        if let Some(u) = &c.unread {
            repairs.push(format!(
                "{what}: {u}; its {} records are lost",
                c.desc.records
            ));
        }
        // The record whose framing broke is told of with the framing below.
        let gap = c.image.unparsed_from;
        for d in c.image.dropped.iter().filter(|d| Some(d.offset) != gap) {
            repairs.push(format!(
                "{what}: {sum}record {} at byte {} ({}) is invalid: {}; dropped that record only",
                d.index,
                d.offset,
                dropped_label(d),
                d.detail
            ));
        }
        match (&c.image.error, c.image.unparsed_from, c.crc_ok) {
            (_, Some(at), _) => {
                let e = c.image.error.as_deref().unwrap_or("damaged");
                let others = c.image.dropped.len().saturating_sub(1);
                let lost = (c.desc.records as usize).saturating_sub(n + others);
                repairs.push(match c.image.resumed_at {
                    Some(resumed) => format!(
                        "{what}: {sum}{e}; the record framing is broken from byte {at} to byte {resumed}, where a valid record starts again: kept the {n} valid records around it{}",
                        match lost {
                            0 | 1 => format!(", lost the record there ({})", c.image.dropped.iter().find(|d| Some(d.offset) == gap).map_or_else(|| "unnamed".into(), dropped_label)),
                            _ => format!(", {lost} records there lost"),
                        }
                    ),
                    None => format!(
                        "{what}: {sum}{e}; kept the {n} valid records before byte {at}; the rest of the chunk cannot be parsed (its record framing is broken): {lost} records lost"
                    ),
                });
            }
            (None, None, true) => {}
            (None, None, false) => repairs.push(format!(
                "{what}: checksum mismatch, but all {n} records decode and pass their checks; kept them"
            )),
            (Some(_), None, _) if !c.image.dropped.is_empty() => repairs.push(format!(
                "{what}: kept the other {n} records of the chunk"
            )),
            (Some(e), None, _) => repairs.push(format!(
                "{what}: {sum}{e}; kept the {n} records that decode"
            )),
        }
        records.extend(c.image.records.iter().cloned());
    }
    records.sort_by_key(|r| r.file_id);
    let mut st = State {
        generation: g,
        ..State::default()
    };
    let mut claimed = Claimed::default();
    claimed.claim(0, geo.reserved_blocks(), "the superblock area".into());
    // The source's metadata whose checksums hold is where it says: its root run and every
    // chunk that passed its checksum. A file claiming those blocks is the damaged party.
    let mut sound_meta: Vec<(u64, u64)> = vec![(raw.sb.root_bno, raw.sb.root_blocks as u64)];
    sound_meta.extend(
        raw.chunks
            .iter()
            .filter(|c| c.crc_ok && c.unread.is_none())
            .map(|c| (c.desc.bno, c.desc.nblocks as u64)),
    );
    sound_meta.sort_unstable();
    for (bno, len) in sound_meta {
        if bno >= geo.reserved_blocks() && claimed.first_conflict(bno, len).is_none() {
            claimed.claim(bno, len, OLD_META.into());
            st.alloc.free_later(bno, len, freed_gen);
        }
    }
    let mut max_id = 0u64;
    // Records sharing an id with an earlier one keep their file under a fresh id, given once
    // every other id is placed (ids are taken in order).
    let largest = records
        .iter()
        .map(|r| r.file_id)
        .filter(|&id| id != u64::MAX)
        .max()
        .unwrap_or(0);
    let mut fresh = largest;
    let mut seen_ids = std::collections::HashSet::new();
    let mut again: Vec<FileRecord> = Vec::new();
    records.retain(|r| {
        let first = seen_ids.insert(r.file_id);
        if !first {
            again.push(r.clone());
        }
        first
    });
    for mut r in again {
        match fresh.checked_add(1).filter(|&n| n != u64::MAX) {
            Some(n) => {
                fresh = n;
                repairs.push(format!(
                    "file {:?} shares file id {} with another file; gave it id {n}",
                    r.name, r.file_id
                ));
                r.file_id = n;
                records.push(r);
            }
            None => repairs.push(format!(
                "dropped a second record for file id {} ({:?}): no other id left",
                r.file_id, r.name
            )),
        }
    }
    let mut placed: Vec<FileRecord> = Vec::with_capacity(records.len());
    let mut placed_ids: HashSet<u64> = HashSet::new();
    for mut r in records {
        if !placed_ids.insert(r.file_id) {
            repairs.push(format!(
                "dropped a second record for file id {} ({:?})",
                r.file_id, r.name
            ));
            continue;
        }
        if st.names.contains_key(&r.name) {
            let new = format!("lost+found/{}", r.file_id);
            repairs.push(format!(
                "file {:?} (id {}) shares its name with an older file; renamed it to {new:?}",
                r.name, r.file_id
            ));
            r.name = new;
            if st.names.contains_key(&r.name) {
                repairs.push(format!("dropped file id {}: no free name", r.file_id));
                continue;
            }
        }
        if r.file_id == u64::MAX {
            // No id may be u64::MAX: it cannot be below the next id. Ids are taken in order, so
            // every other id is placed and the one after the largest is free.
            let new = max_id.max(fresh) + 1;
            if new == u64::MAX {
                repairs.push(format!(
                    "dropped file {:?}: file id {} and no other id left",
                    r.name, r.file_id
                ));
                continue;
            }
            repairs.push(format!(
                "file {:?} had file id {}, which no file may have (it cannot be below the next id); gave it id {new}",
                r.name, r.file_id
            ));
            r.file_id = new;
        }
        max_id = max_id.max(r.file_id);
        placed_ids.insert(r.file_id);
        st.names.insert(r.name.clone(), r.file_id);
        placed.push(r);
    }
    // Blocks claimed by two files: the claim of a file whose data checksum verifies is kept,
    // so such files take their blocks first; the others go by file id (FORMAT.md, "Repair").
    let trusted = verified_in_conflict(dev, geo, &placed);
    let trusted_owners: HashSet<String> = placed
        .iter()
        .filter(|r| trusted.contains(&r.file_id))
        .map(|r| format!("file {:?}", r.name))
        .collect();
    placed.sort_by_key(|r| (!trusted.contains(&r.file_id), r.file_id));
    for mut r in placed {
        let mut kept: Vec<Extent> = Vec::new();
        for e in &r.extents {
            if let Some((s, end, owner)) = claimed.first_conflict(e.bno, e.len) {
                let cut = s.max(e.bno);
                let head = (cut > e.bno).then_some(Extent {
                    bno: e.bno,
                    len: cut - e.bno,
                });
                let blocks: u64 = kept.iter().chain(&head).map(|k| k.len).sum();
                let size = r.size.min(blocks * bs);
                let why = match (trusted_owners.contains(owner), trusted.contains(&r.file_id)) {
                    (true, false) if r.flags & format::FLAG_DATA_CRC != 0 => {
                        " (whose data checksum verifies; this file's does not)"
                    }
                    (true, false) => " (whose data checksum verifies; this file has none)",
                    _ => "",
                };
                repairs.push(format!(
                    "file {:?}: blocks {cut}..{} also belong to {owner}{why}; cut the file from {} to {size} bytes",
                    r.name,
                    end.min(e.bno + e.len),
                    r.size
                ));
                r.size = size;
                if let Some(h) = head {
                    claimed.claim(h.bno, h.len, format!("file {:?}", r.name));
                    kept.push(h);
                }
                break;
            }
            // Claimed at once: a file's own extents may not overlap each other either.
            claimed.claim(e.bno, e.len, format!("file {:?}", r.name));
            kept.push(*e);
        }
        r.extents = kept;
        st.homeless.insert(r.file_id);
        st.inodes.insert(r.file_id, inode_of(&r, None));
    }
    // Old metadata runs: keep them from being overwritten while the repair commits.
    let mut old_meta: Vec<(u64, u64)> = vec![(raw.sb.root_bno, raw.sb.root_blocks as u64)];
    old_meta.extend(
        raw.chunks
            .iter()
            .map(|c| (c.desc.bno, c.desc.nblocks as u64)),
    );
    old_meta.sort();
    for (bno, len) in old_meta {
        if claimed.first_conflict(bno, len).is_none() {
            claimed.claim(bno, len, OLD_META.into());
            st.alloc.free_later(bno, len, freed_gen);
        }
    }
    // Everything else is free; count what the old maps got wrong.
    let mut old_free: Vec<(u64, u64)> = raw.root.free.iter().map(|f| (f.bno, f.len)).collect();
    old_free.extend(raw.root.pending.iter().map(|p| (p.bno, p.len)));
    let mut pos = 0u64;
    let runs: Vec<(u64, u64)> = claimed.0.iter().map(|(&s, (e, _))| (s, *e)).collect();
    let mut new_free: Vec<(u64, u64)> = Vec::new();
    for (s, e) in runs.into_iter().chain([(geo.block_count, geo.block_count)]) {
        if s > pos {
            new_free.push((pos, s - pos));
        }
        pos = pos.max(e);
    }
    for &(s, l) in &new_free {
        st.alloc.insert_free(s, l);
    }
    let covered = |runs: &[(u64, u64)], s: u64, l: u64| -> u64 {
        runs.iter()
            .map(|&(a, n)| (a + n).min(s + l).saturating_sub(a.max(s)))
            .sum()
    };
    let leaked: u64 = new_free
        .iter()
        .map(|&(s, l)| l - covered(&old_free, s, l).min(l))
        .sum();
    if leaked > 0 {
        repairs.push(format!(
            "free-space map: {leaked} blocks were neither used nor free; freed them"
        ));
    }
    let in_use: Vec<(u64, u64)> = claimed
        .0
        .iter()
        .filter(|(_, (_, o))| o != OLD_META)
        .map(|(&s, (e, _))| (s, e - s))
        .collect();
    let double: u64 = old_free.iter().map(|&(s, l)| covered(&in_use, s, l)).sum();
    if double > 0 {
        repairs.push(format!(
            "free-space map: {double} blocks listed as free belong to files; took them off the list"
        ));
    }
    // A record may claim the largest id (a forged image): then no new file gets one.
    st.next_file_id = raw.root.header.next_file_id.max(max_id.saturating_add(1));
    st.meta_dirty = true;
    st
}
