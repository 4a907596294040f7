//! The copy-on-write commit: new chunks for changed records, a new root, flush, the superblock
//! into the other slot, flush (FORMAT.md, "Commit protocol").

use std::collections::BTreeSet;

use crate::alloc::Allocator;
use crate::device::WriteReq;
use crate::error::{DeviceResultExt, Error, Result};
use crate::format::{
    self, ChunkDesc, ChunkHeader, FileRecord, RootHeader, encode_chunk, encode_root, root_len,
};
use crate::state::{ChunkSlot, Inner, State};
use crate::superblock;

/// Small chunks a commit takes in and repacks with the records it writes anyway, at most.
const MERGE_PER_COMMIT: usize = 8;

/// [`FileSystem::sync`] with the state locked: commits, and if the commit freed file blocks,
/// commits once more so they are free (not pending) afterwards, for whoever needs the space
/// next (FORMAT.md, "Allocation").
pub(crate) fn sync_locked(inner: &Inner, st: &mut State) -> Result<()> {
    let freed = st.freed_data;
    commit(inner, st, false)?;
    if freed > 0 {
        match commit(inner, st, true) {
            // The space stays pending until the next commit; nothing is lost.
            Ok(()) | Err(Error::NoSpace { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes a new generation: new chunks for changed records, a new root, flush, the superblock
/// into slot `generation % 2`, flush (FORMAT.md, "Commit protocol"). With `force`, commits even
/// when nothing changed.
pub(crate) fn commit(inner: &Inner, st: &mut State, force: bool) -> Result<()> {
    if st.poisoned {
        return Err(Error::Poisoned);
    }
    let dev = inner.dev.as_ref();
    let geo = &inner.geo;
    let bs = geo.block_size as usize;
    if !st.meta_dirty && !force {
        if st.data_dirty {
            dev.flush().during("flushing file data")?;
            st.data_dirty = false;
        }
        return Ok(());
    }
    // Generations never wrap (FORMAT.md, "Superblock"): at the last one, refuse.
    let Some(new_gen) = st.generation.checked_add(1) else {
        return Err(Error::Corrupt {
            what: "superblock generation".into(),
            detail: format!(
                "{} is the last generation; no commit can follow it",
                st.generation
            ),
        });
    };
    let mut alloc = st.alloc.clone();

    // Records to (re)write: new files plus every file in a changed chunk.
    let mut dirty: Vec<u64> = st
        .chunks
        .iter()
        .filter(|(_, c)| c.dirty)
        .map(|(&k, _)| k)
        .collect();
    // A commit that writes chunks anyway also takes in a few small ones (at most half a block
    // used), smallest first, so records share chunks instead of each commit leaving a chunk of
    // its own: after every such commit at most one small chunk remains (the last one packed),
    // and older images are compacted a few chunks per commit. Only while free space is ample,
    // so compaction never makes a commit run out of room.
    if !dirty.is_empty() || !st.homeless.is_empty() {
        // Bytes of the records to place so far.
        let record_bytes = |id: &u64| {
            let i = &st.inodes[id];
            format::record_len(i.extents.as_slice().len(), i.name.len())
        };
        let placing: usize = st.homeless.iter().map(record_bytes).sum::<usize>()
            + dirty
                .iter()
                .flat_map(|k| st.chunks[k].files.iter())
                .map(record_bytes)
                .sum::<usize>();
        let clean = || {
            st.chunks
                .iter()
                .filter(|(k, c)| !c.dirty && c.desc.nblocks == 1 && !dirty.contains(k))
        };
        // The fullest chunk the records fit into (copy-on-write of the chunk that changes)...
        let host = clean()
            .filter(|(_, c)| c.desc.bytes as usize + placing <= bs)
            .max_by_key(|(_, c)| c.desc.bytes)
            .map(|(&k, _)| k);
        // ...and the smallest ones, merged.
        let mut small: Vec<(u32, u64)> = clean()
            .filter(|(k, c)| c.desc.bytes as usize <= bs / 2 && Some(**k) != host)
            .map(|(&k, c)| (c.desc.bytes, k))
            .collect();
        small.sort_unstable();
        let spare = alloc
            .free_blocks()
            .saturating_sub(st.commit_reserve(geo.block_size));
        let take = (MERGE_PER_COMMIT as u64).min(spare) as usize;
        let pulled: Vec<u64> = host
            .into_iter()
            .chain(small.into_iter().map(|(_, k)| k))
            .take(take)
            .collect();
        dirty.extend(pulled);
    }
    let mut place: BTreeSet<u64> = st.homeless.clone();
    for k in &dirty {
        let c = &st.chunks[k];
        alloc.free_later(c.desc.bno, c.desc.nblocks as u64, new_gen);
        place.extend(c.files.iter().copied());
    }
    let records: Vec<FileRecord> = place
        .iter()
        .map(|id| {
            let i = &st.inodes[id];
            i.record(if i.modified { new_gen } else { i.generation })
        })
        .collect();

    // Pack records into chunks of one block; a record too big for one gets a run of its own.
    let header = size_of::<ChunkHeader>();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_bytes = header;
    for (i, r) in records.iter().enumerate() {
        let len = r.encoded_len();
        if header + len > bs {
            groups.push(vec![i]);
            continue;
        }
        if cur_bytes + len > bs {
            groups.push(std::mem::take(&mut cur));
            cur_bytes = header;
        }
        cur.push(i);
        cur_bytes += len;
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    let no_space = |alloc: &Allocator, n: u64| Error::NoSpace {
        needed: n,
        free: alloc.free_blocks(),
    };
    let mut new_chunks: Vec<(ChunkDesc, BTreeSet<u64>, Vec<u8>)> = Vec::with_capacity(groups.len());
    for g in &groups {
        let mut bytes = encode_chunk(new_gen, g.iter().map(|&i| &records[i]));
        let nblocks = bytes.len().div_ceil(bs) as u64;
        let bno = alloc
            .alloc_contiguous(nblocks)
            .ok_or_else(|| no_space(&alloc, nblocks))?;
        let desc = ChunkDesc {
            bno,
            nblocks: nblocks as u32,
            bytes: bytes.len() as u32,
            crc: format::crc(&bytes),
            records: g.len() as u32,
        };
        bytes.resize(nblocks as usize * bs, 0);
        new_chunks.push((desc, g.iter().map(|&i| records[i].file_id).collect(), bytes));
    }

    // The root: every chunk descriptor, then the free and pending runs as they will be.
    if let Some((bno, n)) = st.root {
        alloc.free_later(bno, n as u64, new_gen);
    }
    let rewritten: BTreeSet<u64> = dirty.iter().copied().collect();
    let mut descs: Vec<ChunkDesc> = st
        .chunks
        .iter()
        .filter(|(k, _)| !rewritten.contains(k))
        .map(|(_, c)| c.desc)
        .chain(new_chunks.iter().map(|(d, _, _)| *d))
        .collect();
    descs.sort_by_key(|d| d.bno);
    // Taking the root's blocks from the front of a free run never adds a run, so this bound
    // holds. It can remove one (a run of exactly `root_blocks`): the root is then 16 bytes
    // shorter than the bound and may need one block fewer than it occupies; the format allows
    // that one spare block (FORMAT.md, "Root run"), and `meta_blocks` counts it.
    let bound = root_len(
        descs.len(),
        alloc.free_run_count(),
        alloc.pending_runs().len(),
    );
    let root_blocks = bound.div_ceil(bs) as u64;
    let root_bno = alloc
        .alloc_contiguous(root_blocks)
        .ok_or_else(|| no_space(&alloc, root_blocks))?;
    let data_blocks = st.data_blocks();
    let meta_blocks = descs.iter().map(|d| d.nblocks as u64).sum::<u64>() + root_blocks;
    let header = RootHeader {
        magic: format::ROOT_MAGIC,
        uuid: geo.uuid,
        generation: new_gen,
        next_file_id: st.next_file_id,
        file_count: st.inodes.len() as u64,
        chunk_count: descs.len() as u32,
        free_count: alloc.free_run_count() as u32,
        pending_count: alloc.pending_runs().len() as u32,
        self_crc: 0,
        data_blocks,
        meta_blocks,
        reserved: [0; 16],
    };
    let mut root = encode_root(&header, &descs, &alloc.free_runs(), alloc.pending_runs());
    let root_bytes = root.len();
    debug_assert!(root_bytes <= bound);
    let root_crc = format::crc(&root);
    root.resize(root_blocks as usize * bs, 0);

    let mut reqs: Vec<WriteReq<'_>> = new_chunks
        .iter()
        .map(|(d, _, buf)| WriteReq {
            lba: geo.lba(d.bno),
            buf,
        })
        .collect();
    reqs.push(WriteReq {
        lba: geo.lba(root_bno),
        buf: &root,
    });
    dev.write(&reqs).during("writing metadata")?;
    dev.flush()
        .during("flushing data and metadata before the superblock")?;

    let (slot_lba, slot) = superblock::slot_image(
        geo,
        new_gen,
        superblock::RootRef {
            bno: root_bno,
            blocks: root_blocks as u32,
            bytes: root_bytes as u32,
            crc: root_crc,
        },
    );
    // From here on the medium may hold the new generation: a failure leaves the in-memory state
    // unable to tell which generation is durable, so it refuses further changes.
    let sb_result = dev
        .write(&[WriteReq {
            lba: slot_lba,
            buf: &slot,
        }])
        .and_then(|()| dev.flush());
    if let Err(source) = sb_result {
        st.poisoned = true;
        return Err(Error::Device {
            op: "writing the superblock",
            source,
        });
    }

    // Committed: adopt the new layout.
    for k in dirty {
        st.chunks.remove(&k);
    }
    for (desc, files, _) in new_chunks {
        let key = st.next_chunk_key;
        st.next_chunk_key += 1;
        for id in &files {
            if let Some(i) = st.inodes.get_mut(id) {
                i.chunk = Some(key);
            }
        }
        st.chunks.insert(
            key,
            ChunkSlot {
                desc,
                files,
                dirty: false,
            },
        );
    }
    for id in &place {
        if let Some(i) = st.inodes.get_mut(id)
            && i.modified
        {
            i.generation = new_gen;
            i.modified = false;
        }
    }
    {
        // Runs freed after a generation someone holds stay pending (GenerationHold): that
        // reader's view still uses them.
        let pins = crate::pin::lock(&inner.pins);
        let up_to = pins
            .oldest_generation()
            .map_or(new_gen - 1, |g| g.min(new_gen - 1));
        alloc.release(up_to, &pins.runs());
    }
    st.alloc = alloc;
    st.root = Some((root_bno, root_blocks as u32));
    st.generation = new_gen;
    st.homeless.clear();
    st.meta_dirty = false;
    st.data_dirty = false;
    st.freed_data = 0;
    tracing::debug!(generation = new_gen, root_bno, root_blocks, "committed");
    Ok(())
}
