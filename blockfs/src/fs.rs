//! The mounted file system: namespace operations, allocation and the commit protocol.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::alloc::Allocator;
use crate::device::{BlockDevice, ReadReq, WriteReq};
use crate::error::{DeviceResultExt, Error, Result};
use crate::extents::ExtentList;
use crate::file::{File, OpenMode};
use crate::format::{
    self, ChunkDesc, ChunkHeader, Extent, FLAG_DATA_CRC, FLAG_IMMUTABLE, FORMAT_VERSION,
    FileRecord, MAX_BLOCK_SIZE, MAX_FILE_SIZE, MAX_LBA_SIZE, MIN_BLOCK_SIZE, RootHeader,
    SUPERBLOCK_SIZE, SUPERBLOCK_SLOTS, Superblock, SuperblockProblem, encode_chunk, encode_root,
    reserved_blocks, root_len,
};
use crate::load;
use crate::name::validate_name;
use crate::table::{ExtentTable, TableInput};

/// Speculative preallocation on growth stops doubling at this many bytes.
const MAX_SPECULATIVE_BYTES: u64 = 256 << 20;

/// Sizes fixed at mkfs, plus the device's LBA size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// File system block size in bytes.
    pub block_size: u32,
    /// Device LBA size in bytes.
    pub lba_size: u32,
    /// LBA size the file system was made with.
    pub mkfs_lba_size: u32,
    /// Blocks in the file system.
    pub block_count: u64,
    /// File system UUID.
    pub uuid: [u8; 16],
}

impl Geometry {
    /// Device LBAs per file system block.
    pub fn lbas_per_block(&self) -> u64 {
        (self.block_size / self.lba_size) as u64
    }

    /// Blocks reserved for the superblock slots.
    pub fn reserved_blocks(&self) -> u64 {
        reserved_blocks(self.block_size)
    }

    /// Device LBA of block `bno`.
    pub fn lba(&self, bno: u64) -> u64 {
        bno * self.lbas_per_block()
    }
}

/// Options for [`FileSystem::mkfs`].
#[derive(Clone, Debug)]
pub struct MkfsOptions {
    /// File system block size: a power of two from 4 KiB to 1 MiB (default 4 KiB).
    pub block_size: u32,
    /// UUID to record (default: random).
    pub uuid: Option<[u8; 16]>,
}

impl Default for MkfsOptions {
    fn default() -> Self {
        Self {
            block_size: 4096,
            uuid: None,
        }
    }
}

/// Options for [`FileSystem::create`].
#[derive(Clone, Debug, Default)]
pub struct CreateOptions {
    /// Bytes to preallocate (the file's size stays 0): a file written up to this size stays in
    /// as few extents as the free space allows.
    pub size_hint: u64,
}

/// What [`FileSystem::stat`] and [`File::stat`] report.
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
    /// CRC-32C of the file's bytes, if one was recorded ([`File::set_data_crc`]) and nothing
    /// changed them since.
    pub data_crc: Option<u32>,
}

/// What [`FileSystem::df`] reports, in blocks of [`FsStats::block_size`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsStats {
    /// Block size in bytes.
    pub block_size: u32,
    /// Blocks in the file system.
    pub total_blocks: u64,
    /// Blocks allocated to files.
    pub data_blocks: u64,
    /// Blocks of metadata: superblock slots, file-table chunks and the root run.
    pub metadata_blocks: u64,
    /// Blocks free now.
    pub free_blocks: u64,
    /// Of the free blocks, those file data can take: a few stay free for the next commit's
    /// metadata. A file of `available_blocks * block_size` bytes fits.
    pub available_blocks: u64,
    /// Blocks freed by the last commits, free after up to two more commits.
    pub pending_blocks: u64,
    /// Files.
    pub files: u64,
    /// Generation of the last commit.
    pub generation: u64,
}

/// What [`FileSystem::verify_data`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataCheck {
    /// The file has no recorded checksum (written without one, or changed since).
    NoChecksum,
    /// The bytes read match the recorded CRC-32C.
    Match,
    /// They do not: the data on the device is not what was written.
    Mismatch {
        /// The recorded CRC-32C.
        recorded: u32,
        /// The CRC-32C of the bytes read.
        found: u32,
    },
}

/// What [`FileSystem::probe`] found on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Existing {
    /// No blockfs: neither superblock slot holds a blockfs superblock.
    Nothing,
    /// A blockfs that mounts.
    FileSystem {
        /// Its files.
        files: u64,
        /// Bytes in them.
        bytes: u64,
        /// Generation of its last commit.
        generation: u64,
    },
    /// Something with a blockfs superblock that does not mount (`fsck --repair` may recover
    /// it).
    Damaged {
        /// Why it does not mount.
        reason: String,
    },
}

impl Existing {
    /// Whether there is a blockfs (whole or damaged) that overwriting the device would destroy.
    pub fn is_blockfs(&self) -> bool {
        !matches!(self, Existing::Nothing)
    }
}

impl std::fmt::Display for Existing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Existing::Nothing => write!(f, "no blockfs"),
            Existing::FileSystem { files, bytes, .. } => write!(
                f,
                "a blockfs with {files} file{} ({bytes} bytes)",
                if *files == 1 { "" } else { "s" }
            ),
            Existing::Damaged { reason } => write!(
                f,
                "a damaged blockfs ({reason}; `fsck --repair` may recover its files)"
            ),
        }
    }
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
        }
    }

    fn record(&self, generation: u64) -> FileRecord {
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

    fn lookup(&self, name: &str) -> Result<u64> {
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
        let freed_gen = self.generation + 1;
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
}

impl Inner {
    pub fn read_state(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write_state(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// A mounted blockfs.
///
/// Cheap to share between threads (`&self` everywhere); metadata changes are serialized by an
/// internal lock, reads of file data run in parallel. Changes are durable only after
/// [`FileSystem::sync`]; dropping the file system without syncing discards uncommitted metadata
/// (the medium then holds the last committed generation).
pub struct FileSystem {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for FileSystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSystem")
            .field("geometry", &self.inner.geo)
            .finish()
    }
}

/// Checks the device's LBA size and computes the block count for a block size.
pub(crate) fn check_device(dev: &dyn BlockDevice, block_size: u32) -> Result<(u32, u64)> {
    let lba = dev.lba_size();
    if !lba.is_power_of_two() || !(512..=MAX_LBA_SIZE).contains(&lba) {
        return Err(Error::Geometry(format!(
            "LBA size {lba} (blockfs needs a power of two from 512 to {MAX_LBA_SIZE})"
        )));
    }
    if !block_size.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) {
        return Err(Error::Geometry(format!(
            "block size {block_size} (must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE})"
        )));
    }
    let bytes = dev.lba_count().saturating_mul(lba as u64);
    Ok((lba, bytes / block_size as u64))
}

/// Reads both superblock slots.
pub(crate) fn read_slots(
    dev: &dyn BlockDevice,
) -> Result<[std::result::Result<Superblock, SuperblockProblem>; 2]> {
    let lba = dev.lba_size();
    if !lba.is_power_of_two() || !(512..=MAX_LBA_SIZE).contains(&lba) {
        return Err(Error::Geometry(format!(
            "LBA size {lba} (blockfs needs a power of two from 512 to {MAX_LBA_SIZE})"
        )));
    }
    let mut out = [
        Err(SuperblockProblem::BadMagic),
        Err(SuperblockProblem::BadMagic),
    ];
    for (i, &off) in SUPERBLOCK_SLOTS.iter().enumerate() {
        let slot_lba = off / lba as u64;
        if slot_lba >= dev.lba_count() {
            out[i] = Err(SuperblockProblem::Invalid(format!(
                "device of {} bytes ends before the slot",
                dev.lba_count() * lba as u64
            )));
            continue;
        }
        let mut buf = vec![0u8; lba as usize];
        dev.read(&mut [ReadReq {
            lba: slot_lba,
            buf: &mut buf,
        }])
        .during("reading the superblocks")?;
        out[i] = Superblock::decode(&buf).and_then(|sb| {
            if sb.slot as usize != i {
                Err(SuperblockProblem::Invalid(format!(
                    "superblock for slot {} found in slot {i}",
                    sb.slot
                )))
            } else {
                Ok(sb)
            }
        });
    }
    Ok(out)
}

/// Name of superblock slot `i` for messages.
pub(crate) fn slot_name(i: usize) -> String {
    format!("superblock slot {i} (byte {})", SUPERBLOCK_SLOTS[i])
}

/// Checks a pair of slots the way mount does: both valid, same file system, consecutive
/// generations. Returns the newest.
pub(crate) fn pick_superblock(
    slots: &[std::result::Result<Superblock, SuperblockProblem>; 2],
) -> Result<Superblock> {
    match slots {
        [
            Err(SuperblockProblem::BadMagic),
            Err(SuperblockProblem::BadMagic),
        ] => Err(Error::NotBlockfs(
            "neither superblock slot holds a blockfs superblock".into(),
        )),
        [Err(SuperblockProblem::Unsupported(s)), _]
        | [_, Err(SuperblockProblem::Unsupported(s))] => Err(Error::Unsupported(s.clone())),
        [Err(p), _] => Err(Error::Corrupt {
            what: slot_name(0),
            detail: p.to_string(),
        }),
        [_, Err(p)] => Err(Error::Corrupt {
            what: slot_name(1),
            detail: p.to_string(),
        }),
        [Ok(a), Ok(b)] => {
            let (new, old) = if a.generation > b.generation {
                (a, b)
            } else {
                (b, a)
            };
            if a.uuid != b.uuid
                || a.block_size != b.block_size
                || a.block_count != b.block_count
                || a.mkfs_lba_size != b.mkfs_lba_size
            {
                return Err(Error::Corrupt {
                    what: "superblock slots".into(),
                    detail: "the two slots describe different file systems".into(),
                });
            }
            if new.generation != old.generation + 1 {
                return Err(Error::Corrupt {
                    what: slot_name(old.slot as usize),
                    detail: format!(
                        "generation {} is not one before the other slot's {}",
                        old.generation, new.generation
                    ),
                });
            }
            Ok(*new)
        }
    }
}

fn random_uuid() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for half in out.chunks_mut(8) {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    out[6] = (out[6] & 0x0f) | 0x40; // RFC 4122 version 4
    out[8] = (out[8] & 0x3f) | 0x80;
    out
}

impl FileSystem {
    /// Makes a new, empty file system on `dev` and mounts it. Everything on the device is lost.
    pub fn mkfs(dev: Arc<dyn BlockDevice>, opts: &MkfsOptions) -> Result<Self> {
        let (lba, block_count) = check_device(dev.as_ref(), opts.block_size)?;
        let geo = Geometry {
            block_size: opts.block_size,
            lba_size: lba,
            mkfs_lba_size: lba,
            block_count,
            uuid: opts.uuid.unwrap_or_else(random_uuid),
        };
        let min = geo.reserved_blocks() + 8;
        if block_count < min {
            return Err(Error::Geometry(format!(
                "{block_count} blocks of {} bytes; blockfs needs at least {min}",
                opts.block_size
            )));
        }
        // Invalidate both slots first, so a crash during mkfs leaves no old superblock that
        // could pair with a new one.
        let zero = vec![0u8; lba as usize];
        let reqs: Vec<WriteReq<'_>> = SUPERBLOCK_SLOTS
            .iter()
            .map(|&off| WriteReq {
                lba: off / lba as u64,
                buf: &zero,
            })
            .collect();
        dev.write(&reqs).during("clearing the superblock slots")?;
        dev.flush()
            .during("flushing the cleared superblock slots")?;
        let mut state = State {
            next_file_id: 1,
            ..State::default()
        };
        state
            .alloc
            .insert_free(geo.reserved_blocks(), block_count - geo.reserved_blocks());
        let fs = Self {
            inner: Arc::new(Inner {
                dev,
                geo,
                state: RwLock::new(state),
            }),
        };
        {
            let mut st = fs.inner.write_state();
            // Two commits: generation 1 in slot 1, generation 2 in slot 0; both slots valid.
            commit(&fs.inner, &mut st, true)?;
            commit(&fs.inner, &mut st, true)?;
        }
        Ok(fs)
    }

    /// Mounts the file system on `dev`, verifying every metadata checksum and that no two
    /// files, and no file and the metadata, share a block. Refuses (with the structure and the
    /// problem named) if anything is wrong; `fsck` with repair fixes what it can.
    pub fn mount(dev: Arc<dyn BlockDevice>) -> Result<Self> {
        let slots = read_slots(dev.as_ref())?;
        let sb = pick_superblock(&slots)?;
        let geo = load::geometry_of(dev.as_ref(), &sb)?;
        let raw = load::read_raw(dev.as_ref(), &geo, &sb)?;
        let state = load::strict_state(&geo, &raw)?;
        Ok(Self {
            inner: Arc::new(Inner {
                dev,
                geo,
                state: RwLock::new(state),
            }),
        })
    }

    /// Whether `dev` holds a blockfs, and how many files it has: for refusing to overwrite one
    /// by accident. Reads only; a device error is an error, anything on the medium is an
    /// answer.
    pub fn probe(dev: Arc<dyn BlockDevice>) -> Result<Existing> {
        let slots = read_slots(dev.as_ref())?;
        if slots
            .iter()
            .all(|s| matches!(s, Err(SuperblockProblem::BadMagic)))
        {
            return Ok(Existing::Nothing);
        }
        match Self::mount(dev) {
            Ok(fs) => {
                let st = fs.inner.read_state();
                Ok(Existing::FileSystem {
                    files: st.inodes.len() as u64,
                    bytes: st.inodes.values().map(|i| i.size).sum(),
                    generation: st.generation,
                })
            }
            Err(e @ Error::Device { .. }) => Err(e),
            Err(e) => Ok(Existing::Damaged {
                reason: e.to_string(),
            }),
        }
    }

    pub(crate) fn from_parts(dev: Arc<dyn BlockDevice>, geo: Geometry, state: State) -> Self {
        Self {
            inner: Arc::new(Inner {
                dev,
                geo,
                state: RwLock::new(state),
            }),
        }
    }

    /// Block size, block count and UUID.
    pub fn geometry(&self) -> Geometry {
        self.inner.geo
    }

    /// The device underneath.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.inner.dev
    }

    /// Generation of the last commit.
    pub fn generation(&self) -> u64 {
        self.inner.read_state().generation
    }

    /// Creates an empty file, preallocating `opts.size_hint` bytes, and opens it read-write.
    pub fn create(&self, name: &str, opts: &CreateOptions) -> Result<File> {
        validate_name(name)?;
        if opts.size_hint > MAX_FILE_SIZE {
            return Err(Error::TooLarge(opts.size_hint));
        }
        let mut st = self.inner.write_state();
        if st.poisoned {
            return Err(Error::Poisoned);
        }
        if st.names.contains_key(name) {
            return Err(Error::AlreadyExists(name.to_owned()));
        }
        let id = st.next_file_id;
        let next_id = id.checked_add(1).ok_or(Error::OutOfFileIds(id))?;
        let bs = self.inner.geo.block_size;
        let blocks = opts.size_hint.div_ceil(bs as u64);
        // Blocks freed by earlier commits wait for one or two more before they are reused. With
        // nothing uncommitted, committing now is harmless and makes them usable.
        let mut empty_commits = 0;
        while blocks > st.available_blocks(bs)
            && st.alloc.pending_blocks() > 0
            && !st.meta_dirty
            && !st.data_dirty
            && empty_commits < 2
        {
            commit(&self.inner, &mut st, true)?;
            empty_commits += 1;
        }
        let extents = st.alloc_data(blocks, None, bs).ok_or(Error::NoSpace {
            needed: blocks,
            free: st.available_blocks(bs),
        })?;
        st.next_file_id = next_id;
        st.inodes.insert(
            id,
            Inode {
                id,
                name: name.to_owned(),
                size: 0,
                flags: 0,
                generation: 0,
                extents: ExtentList::from_vec(extents),
                data_crc: 0,
                chunk: None,
                modified: true,
            },
        );
        st.names.insert(name.to_owned(), id);
        st.touch(id);
        Ok(File::new(
            self.inner.clone(),
            id,
            name.to_owned(),
            OpenMode::ReadWrite,
        ))
    }

    /// Opens an existing file.
    pub fn open(&self, name: &str, mode: OpenMode) -> Result<File> {
        let st = self.inner.read_state();
        let id = st.lookup(name)?;
        if mode == OpenMode::ReadWrite && st.inodes[&id].flags & FLAG_IMMUTABLE != 0 {
            return Err(Error::ReadOnly(name.to_owned()));
        }
        Ok(File::new(self.inner.clone(), id, name.to_owned(), mode))
    }

    /// Opens every file whose name starts with `prefix` (all files for `""`), in name order,
    /// and builds one extent table for all of them (GoFS's batch open of a directory).
    pub fn open_prefix(&self, prefix: &str, mode: OpenMode) -> Result<Batch> {
        let st = self.inner.read_state();
        let ids: Vec<(String, u64)> = st
            .names
            .range(prefix.to_owned()..)
            .take_while(|(n, _)| n.starts_with(prefix))
            .map(|(n, &id)| (n.clone(), id))
            .collect();
        if mode == OpenMode::ReadWrite
            && let Some((n, _)) = ids
                .iter()
                .find(|(_, id)| st.inodes[id].flags & FLAG_IMMUTABLE != 0)
        {
            return Err(Error::ReadOnly(n.clone()));
        }
        let inputs: Vec<TableInput<'_>> = ids
            .iter()
            .map(|(_, id)| {
                let i = &st.inodes[id];
                TableInput {
                    file_id: i.id,
                    size: i.size,
                    extents: &i.extents,
                }
            })
            .collect();
        let table = self.build_table(&inputs);
        let files = ids
            .iter()
            .map(|(n, id)| File::new(self.inner.clone(), *id, n.clone(), mode))
            .collect();
        Ok(Batch {
            names: ids.into_iter().map(|(n, _)| n).collect(),
            files,
            table,
        })
    }

    pub(crate) fn build_table(&self, inputs: &[TableInput<'_>]) -> ExtentTable {
        build_table(&self.inner, inputs)
    }

    /// Removes a file. Its blocks become reusable two commits later; open handles to it fail
    /// with [`Error::Removed`] from now on.
    pub fn remove(&self, name: &str) -> Result<()> {
        let mut st = self.inner.write_state();
        if st.poisoned {
            return Err(Error::Poisoned);
        }
        let id = st.lookup(name)?;
        if st.inodes[&id].flags & FLAG_IMMUTABLE != 0 {
            return Err(Error::ReadOnly(name.to_owned()));
        }
        remove_locked(&mut st, name, id);
        Ok(())
    }

    /// Renames a file; fails if `new` exists.
    pub fn rename(&self, old: &str, new: &str) -> Result<()> {
        self.rename_inner(old, new, false)
    }

    /// Renames `old` to `new`, replacing `new` if it exists (whose blocks become reusable two
    /// commits later, as with [`FileSystem::remove`]). The removal and the rename reach the
    /// medium in the same commit (the next sync): after a crash the medium holds either both
    /// files as they were or only the renamed one under `new`. This is how a file is replaced
    /// atomically: write the new version under a temporary name, then `rename_replace` it over
    /// the old one and sync.
    pub fn rename_replace(&self, old: &str, new: &str) -> Result<()> {
        self.rename_inner(old, new, true)
    }

    fn rename_inner(&self, old: &str, new: &str, replace: bool) -> Result<()> {
        validate_name(new)?;
        let mut st = self.inner.write_state();
        if st.poisoned {
            return Err(Error::Poisoned);
        }
        let id = st.lookup(old)?;
        if st.inodes[&id].flags & FLAG_IMMUTABLE != 0 {
            return Err(Error::ReadOnly(old.to_owned()));
        }
        if old == new {
            return if replace {
                Ok(())
            } else {
                Err(Error::AlreadyExists(new.to_owned()))
            };
        }
        if let Some(&victim) = st.names.get(new) {
            if !replace {
                return Err(Error::AlreadyExists(new.to_owned()));
            }
            if st.inodes[&victim].flags & FLAG_IMMUTABLE != 0 {
                return Err(Error::ReadOnly(new.to_owned()));
            }
            remove_locked(&mut st, new, victim);
        }
        st.names.remove(old);
        st.names.insert(new.to_owned(), id);
        st.inodes.get_mut(&id).expect("looked up").name = new.to_owned();
        st.touch(id);
        Ok(())
    }

    /// Sets or clears the immutable flag.
    pub fn set_immutable(&self, name: &str, immutable: bool) -> Result<()> {
        let mut st = self.inner.write_state();
        if st.poisoned {
            return Err(Error::Poisoned);
        }
        let id = st.lookup(name)?;
        let inode = st.inodes.get_mut(&id).expect("looked up");
        let flags = if immutable {
            inode.flags | FLAG_IMMUTABLE
        } else {
            inode.flags & !FLAG_IMMUTABLE
        };
        if flags != inode.flags {
            inode.flags = flags;
            st.touch(id);
        }
        Ok(())
    }

    /// Reads file `name` from the device and compares its bytes with the CRC-32C recorded for
    /// it ([`File::set_data_crc`]), for finding bit rot and misdirected writes in file data.
    pub fn verify_data(&self, name: &str) -> Result<DataCheck> {
        let file = self.open(name, OpenMode::ReadOnly)?;
        let st = file.stat()?;
        let Some(recorded) = st.data_crc else {
            return Ok(DataCheck::NoChecksum);
        };
        const CALL: u64 = 256 << 20;
        let pieces = crate::Crc32cPieces::new();
        let mut off = 0;
        while off < st.size {
            let n = CALL.min(st.size - off);
            file.read_to(off, n, &pieces, off, &|_| {})?;
            off += n;
        }
        let found = pieces.finish(0, st.size).ok_or(Error::Corrupt {
            what: format!("file {name:?}"),
            detail: "its bytes could not all be read".into(),
        })?;
        Ok(if found == recorded {
            DataCheck::Match
        } else {
            DataCheck::Mismatch { recorded, found }
        })
    }

    /// Files whose names start with `prefix`, in name order.
    pub fn list(&self, prefix: &str) -> Vec<FileStat> {
        let st = self.inner.read_state();
        st.names
            .range(prefix.to_owned()..)
            .take_while(|(n, _)| n.starts_with(prefix))
            .map(|(_, id)| st.inodes[id].stat(self.inner.geo.block_size))
            .collect()
    }

    /// Metadata of one file.
    pub fn stat(&self, name: &str) -> Result<FileStat> {
        let st = self.inner.read_state();
        let id = st.lookup(name)?;
        Ok(st.inodes[&id].stat(self.inner.geo.block_size))
    }

    /// Space accounting.
    pub fn df(&self) -> FsStats {
        let st = self.inner.read_state();
        FsStats {
            block_size: self.inner.geo.block_size,
            total_blocks: self.inner.geo.block_count,
            data_blocks: st.data_blocks(),
            metadata_blocks: st.meta_blocks() + self.inner.geo.reserved_blocks(),
            free_blocks: st.alloc.free_blocks(),
            available_blocks: st.available_blocks(self.inner.geo.block_size),
            pending_blocks: st.alloc.pending_blocks(),
            files: st.inodes.len() as u64,
            generation: st.generation,
        }
    }

    /// Makes every change so far durable: flushes file data, then commits the metadata
    /// (FORMAT.md, "Commit protocol"). After it returns, a crash at any later point mounts in
    /// this state or a later one.
    pub fn sync(&self) -> Result<()> {
        let mut st = self.inner.write_state();
        sync_locked(&self.inner, &mut st)
    }

    /// Syncs, then commits again until every block freed before the call (by removals,
    /// truncation or earlier commits) is reusable: two more generations. Use it before
    /// reusing the space of a file just removed, on a nearly full file system.
    pub fn reclaim(&self) -> Result<()> {
        let mut st = self.inner.write_state();
        let target = st.generation + 2;
        while st.generation < target {
            commit(&self.inner, &mut st, true)?;
        }
        Ok(())
    }

    /// Syncs and unmounts.
    pub fn unmount(self) -> Result<()> {
        self.sync()
    }

    /// On-disk metadata bytes that describe one file: its record plus its share of a chunk
    /// descriptor (for the overhead comparison in FORMAT.md).
    pub fn metadata_bytes(&self, name: &str) -> Result<u64> {
        let st = self.inner.read_state();
        let id = st.lookup(name)?;
        let rec = st.inodes[&id].record(0);
        Ok((rec.encoded_len() + size_of::<ChunkDesc>()) as u64)
    }
}

/// Removes file `id`, named `name`, from the in-memory state (the caller checked it may).
fn remove_locked(st: &mut State, name: &str, id: u64) {
    st.truncate_blocks(id, 0);
    let inode = st.inodes.remove(&id).expect("looked up");
    st.names.remove(name);
    st.homeless.remove(&id);
    if let Some(key) = inode.chunk
        && let Some(c) = st.chunks.get_mut(&key)
    {
        c.files.remove(&id);
        c.dirty = true;
    }
    st.meta_dirty = true;
}

/// Files opened together by [`FileSystem::open_prefix`], with their shared extent table.
#[derive(Debug)]
pub struct Batch {
    /// Names, in table order.
    pub names: Vec<String>,
    /// Handles, in table order.
    pub files: Vec<File>,
    /// The extent table; file `i` of the table is `files[i]`.
    pub table: ExtentTable,
}

pub(crate) fn build_table(inner: &Inner, inputs: &[TableInput<'_>]) -> ExtentTable {
    ExtentTable::build(
        inner.geo.lba_size,
        inner.dev.nvme_nsid().unwrap_or(0),
        inner.geo.lbas_per_block(),
        inputs,
    )
}

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
    let new_gen = st.generation + 1;
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
    // Taking the root's blocks from the front of a free run never adds a run, so this bound holds.
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

    let mut sb = format::zeroed_superblock();
    sb.magic = format::SUPERBLOCK_MAGIC;
    sb.version = FORMAT_VERSION;
    sb.header_size = SUPERBLOCK_SIZE as u32;
    sb.uuid = geo.uuid;
    sb.generation = new_gen;
    sb.block_size = geo.block_size;
    sb.mkfs_lba_size = geo.mkfs_lba_size;
    sb.block_count = geo.block_count;
    sb.root_bno = root_bno;
    sb.root_blocks = root_blocks as u32;
    sb.root_bytes = root_bytes as u32;
    sb.root_crc = root_crc;
    sb.slot = (new_gen % 2) as u32;
    let mut slot = vec![0u8; geo.lba_size as usize];
    slot[..SUPERBLOCK_SIZE].copy_from_slice(&sb.encode());
    let slot_lba = SUPERBLOCK_SLOTS[sb.slot as usize] / geo.lba_size as u64;
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
    alloc.release(new_gen - 1);
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
