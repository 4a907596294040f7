//! The in-memory state of a mounted file system: inodes, names, chunk bookkeeping, the
//! allocator, and the changes not yet committed. Everything here is guarded by one lock in
//! [`Inner`]; the commit (`commit.rs`) writes it out, the API (`fs.rs`, `file.rs`) changes it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::alloc::Allocator;
use crate::device::BlockDevice;
use crate::error::{Error, Result};
use crate::extents::ExtentList;
use crate::format::{
    ChunkDesc, Extent, FLAG_DATA_CRC, FLAG_DEVICE_WRITTEN, FLAG_IMMUTABLE, FileRecord, root_len,
};
use crate::geometry::Geometry;
use crate::pin::{PinnedTable, SharedPins};
use crate::table::{ExtentTable, TableInput};

/// Speculative preallocation on growth stops doubling at this many bytes.
const MAX_SPECULATIVE_BYTES: u64 = 256 << 20;

/// What [`crate::FileSystem::stat`] and [`crate::File::stat`] report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileStat {
    /// Name.
    pub name: String,
    /// Unique file id.
    pub file_id: u64,
    /// Size in bytes.
    pub size: u64,
    /// Bytes allocated (whole blocks, including preallocation past the end).
    pub allocated: u64,
    /// Number of extents.
    pub extents: usize,
    /// Generation of the commit that last changed the file's metadata (0 before its first commit).
    pub generation: u64,
    /// Whether the file is immutable.
    pub immutable: bool,
    /// CRC-32C of the file's bytes, if one was recorded ([`crate::File::set_data_crc`]) and nothing
    /// changed them since.
    pub data_crc: Option<u32>,
    /// Whether the file's bytes were last changed by a device (a GPU kernel) writing through an
    /// extent table, committed without a checksum ([`crate::DeviceWrite::commit`]): the host
    /// never saw them, so `data_crc` is `None` and readers cannot verify them.
    pub device_written: bool,
}

/// A file's in-memory metadata.
#[derive(Clone, Debug)]
pub(crate) struct Inode {
    pub id: u64,
    pub name: String,
    pub size: u64,
    pub flags: u16,
    pub generation: u64,
    pub extents: ExtentList,
    /// CRC-32C of the bytes, meaningful when `flags` has `FLAG_DATA_CRC`.
    pub data_crc: u32,
    /// Key of the chunk holding its record on disk (`None` until its first commit).
    pub chunk: Option<u64>,
    /// Metadata changed since the last commit.
    pub modified: bool,
}

impl Inode {
    pub fn stat(&self, block_size: u32) -> FileStat {
        FileStat {
            name: self.name.clone(),
            file_id: self.id,
            size: self.size,
            allocated: self.extents.blocks() * block_size as u64,
            extents: self.extents.as_slice().len(),
            generation: self.generation,
            immutable: self.flags & FLAG_IMMUTABLE != 0,
            data_crc: (self.flags & FLAG_DATA_CRC != 0).then_some(self.data_crc),
            device_written: self.flags & FLAG_DEVICE_WRITTEN != 0,
        }
    }

    pub fn record(&self, generation: u64) -> FileRecord {
        FileRecord {
            file_id: self.id,
            generation,
            size: self.size,
            flags: self.flags,
            extents: self.extents.as_slice().to_vec(),
            name: self.name.clone(),
            data_crc: if self.flags & FLAG_DATA_CRC != 0 {
                self.data_crc
            } else {
                0
            },
        }
    }
}

/// A file-table chunk as last committed.
#[derive(Clone, Debug)]
pub(crate) struct ChunkSlot {
    pub desc: ChunkDesc,
    pub files: BTreeSet<u64>,
    pub dirty: bool,
}

/// Everything mutable about a mounted file system.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Generation of the last commit.
    pub generation: u64,
    pub names: BTreeMap<String, u64>,
    pub inodes: HashMap<u64, Inode>,
    pub chunks: BTreeMap<u64, ChunkSlot>,
    pub next_chunk_key: u64,
    /// Files whose record is in no chunk yet.
    pub homeless: BTreeSet<u64>,
    pub alloc: Allocator,
    /// Root run of the last commit.
    pub root: Option<(u64, u32)>,
    pub next_file_id: u64,
    pub meta_dirty: bool,
    pub data_dirty: bool,
    pub poisoned: bool,
    /// File blocks freed since the last commit (removals, truncation): a sync that commits
    /// them commits once more, so they are free, not pending, when it returns.
    pub freed_data: u64,
}

impl State {
    /// Marks a file's metadata changed.
    pub fn touch(&mut self, id: u64) {
        let Some(inode) = self.inodes.get_mut(&id) else {
            return;
        };
        inode.modified = true;
        match inode.chunk {
            Some(key) => {
                if let Some(c) = self.chunks.get_mut(&key) {
                    c.dirty = true;
                }
            }
            None => {
                self.homeless.insert(id);
            }
        }
        self.meta_dirty = true;
    }

    pub fn inode(&self, id: u64, name: &str) -> Result<&Inode> {
        self.inodes
            .get(&id)
            .ok_or_else(|| Error::Removed(name.to_owned()))
    }

    pub fn inode_mut(&mut self, id: u64, name: &str) -> Result<&mut Inode> {
        self.inodes
            .get_mut(&id)
            .ok_or_else(|| Error::Removed(name.to_owned()))
    }

    pub fn lookup(&self, name: &str) -> Result<u64> {
        self.names
            .get(name)
            .copied()
            .ok_or_else(|| Error::NotFound(name.to_owned()))
    }

    pub fn data_blocks(&self) -> u64 {
        self.inodes.values().map(|i| i.extents.blocks()).sum()
    }

    pub fn meta_blocks(&self) -> u64 {
        self.chunks
            .values()
            .map(|c| c.desc.nblocks as u64)
            .sum::<u64>()
            + self.root.map_or(0, |(_, n)| n as u64)
    }

    /// Makes sure file `id` has at least `blocks` blocks. With `speculative`, also tries to
    /// allocate as many blocks again as the file has (up to 256 MiB), so a file grown by appends
    /// ends up in a logarithmic number of runs, usually one.
    pub fn ensure_allocated(
        &mut self,
        id: u64,
        blocks: u64,
        block_size: u32,
        speculative: bool,
    ) -> Result<()> {
        let inode = self.inodes.get(&id).expect("caller checked the inode");
        let have = inode.extents.blocks();
        if blocks <= have {
            return Ok(());
        }
        let missing = blocks - have;
        let goal = inode.extents.next_goal();
        let cap = MAX_SPECULATIVE_BYTES / block_size as u64;
        let extra = if speculative { have.min(cap) } else { 0 };
        let got = (extra > 0)
            .then(|| self.alloc_data(missing + extra, goal, block_size))
            .flatten()
            .or_else(|| self.alloc_data(missing, goal, block_size))
            .ok_or(Error::NoSpace {
                needed: missing,
                free: self.available_blocks(block_size),
            })?;
        let inode = self.inodes.get_mut(&id).expect("checked above");
        for e in got {
            inode.extents.push(e);
        }
        self.touch(id);
        Ok(())
    }

    /// Forgets file `id`'s data checksum: its bytes or size are changing.
    pub fn content_changed(&mut self, id: u64) {
        if let Some(i) = self.inodes.get_mut(&id)
            && i.flags & FLAG_DATA_CRC != 0
        {
            i.flags &= !FLAG_DATA_CRC;
            i.data_crc = 0;
            self.touch(id);
        }
    }

    /// Frees file blocks past `keep`, to become reusable two commits from now.
    pub fn truncate_blocks(&mut self, id: u64, keep: u64) {
        // Saturating: at the last generation the commit refuses (never wraps).
        let freed_gen = self.generation.saturating_add(1);
        let inode = self.inodes.get_mut(&id).expect("caller checked the inode");
        let freed = inode.extents.truncate(keep);
        if !freed.is_empty() {
            for e in freed {
                self.alloc.free_later(e.bno, e.len, freed_gen);
                self.freed_data += e.len;
            }
            self.touch(id);
        }
    }

    /// Removes file `id`, named `name` (the caller checked it may): frees its blocks, to become
    /// reusable two commits from now, and drops it from its chunk.
    pub fn remove(&mut self, name: &str, id: u64) {
        self.truncate_blocks(id, 0);
        let inode = self.inodes.remove(&id).expect("looked up");
        self.names.remove(name);
        self.homeless.remove(&id);
        if let Some(key) = inode.chunk
            && let Some(c) = self.chunks.get_mut(&key)
        {
            c.files.remove(&id);
            c.dirty = true;
        }
        self.meta_dirty = true;
    }

    /// Free blocks kept back from file data so commits find room for their metadata: a root
    /// run for a few more chunk descriptors and runs than now, and a chunk block for the
    /// changed records, twice: once for the commit that records the data, once for the one
    /// after it, which must not reuse the blocks the first one freed (FORMAT.md,
    /// "Allocation").
    pub fn commit_reserve(&self, block_size: u32) -> u64 {
        let descs = self.chunks.len() + self.homeless.len() + 2;
        let root = root_len(
            descs,
            self.alloc.free_run_count() + 2,
            self.alloc.pending_runs().len() + 2,
        );
        2 * (root.div_ceil(block_size as usize) as u64 + 1)
    }

    /// Free blocks file data may take now: the free blocks less [`State::commit_reserve`].
    pub fn available_blocks(&self, block_size: u32) -> u64 {
        self.alloc
            .free_blocks()
            .saturating_sub(self.commit_reserve(block_size))
    }

    /// `n` blocks for file data (starting at `goal` if possible), leaving the commit reserve
    /// free.
    pub fn alloc_data(
        &mut self,
        n: u64,
        goal: Option<u64>,
        block_size: u32,
    ) -> Option<Vec<Extent>> {
        if n > self.available_blocks(block_size) {
            return None;
        }
        self.alloc.alloc_data(n, goal)
    }
}

/// Shared by the file system and its open files.
pub(crate) struct Inner {
    pub dev: Arc<dyn BlockDevice>,
    pub geo: Geometry,
    pub state: RwLock<State>,
    /// Blocks named by extent tables handed out; a separate lock (taken after `state` when
    /// both are held) so a table can be released from anywhere, callbacks included.
    pub pins: SharedPins,
    /// Mounted read-only ([`crate::FileSystem::mount_read_only`]): every change is refused
    /// with [`Error::ReadOnly`] before anything is touched.
    pub read_only: bool,
}

impl Inner {
    pub fn new(dev: Arc<dyn BlockDevice>, geo: Geometry, state: State) -> Self {
        Self {
            dev,
            geo,
            state: RwLock::new(state),
            pins: SharedPins::default(),
            read_only: false,
        }
    }

    /// Refuses a change to `name` on a read-only mount.
    pub fn check_writable(&self, name: &str) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly(name.to_owned()));
        }
        Ok(())
    }

    /// The state, locked for a change to file `id` (opened as `name`): fails if the file system
    /// is poisoned, the file was removed, or it is immutable.
    pub fn lock_for_change(&self, id: u64, name: &str) -> Result<RwLockWriteGuard<'_, State>> {
        self.check_writable(name)?;
        let st = self.write_state();
        if st.poisoned {
            return Err(Error::Poisoned);
        }
        if st.inode(id, name)?.flags & FLAG_IMMUTABLE != 0 {
            return Err(Error::ReadOnly(name.to_owned()));
        }
        Ok(st)
    }

    /// Builds an extent table for `inputs` and pins the blocks it names. The caller holds the
    /// state lock (read or write), so no commit frees them in between.
    pub fn pinned_table(&self, inputs: &[TableInput<'_>]) -> PinnedTable {
        let runs = inputs
            .iter()
            .flat_map(|i| i.extents.as_slice().iter().map(|e| (e.bno, e.len)))
            .collect();
        PinnedTable::new(&self.pins, self.build_table(inputs), runs)
    }

    pub fn read_state(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write_state(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Builds a GPU extent table for `inputs` on this device.
    pub fn build_table(&self, inputs: &[TableInput<'_>]) -> ExtentTable {
        ExtentTable::build(
            self.geo.lba_size,
            self.dev.nvme_nsid().unwrap_or(0),
            self.geo.lbas_per_block(),
            inputs,
        )
    }
}
