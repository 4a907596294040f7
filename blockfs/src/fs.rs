//! The file system API: mkfs, mount, probe and the namespace operations of a mounted
//! [`FileSystem`], with their option and result types. The state they change lives in
//! `state.rs`, the commit that makes it durable in `commit.rs`, file data in `file.rs`.

use std::sync::Arc;

use crate::commit::{commit, sync_locked};
use crate::device::{BlockDevice, WriteReq};
use crate::error::{DeviceResultExt, Error, Result};
use crate::extents::ExtentList;
use crate::file::{File, OpenMode};
use crate::format::{
    ChunkDesc, FLAG_IMMUTABLE, MAX_FILE_SIZE, SUPERBLOCK_SLOTS, SuperblockProblem,
};
use crate::geometry::{Geometry, check_device};
use crate::load;
use crate::name::validate_name;
use crate::pin::{GenerationHold, PinnedTable};
use crate::state::{FileStat, Inner, Inode, State};
use crate::superblock::{pick_superblock, read_slots};
use crate::table::TableInput;

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
    /// Of the pending blocks, those an extent table still handed out names
    /// ([`crate::PinnedTable`]): they stay pending until every such table is released.
    pub pinned_blocks: u64,
    /// Extent tables handed out and not yet released (device-write reservations included).
    pub pinned_tables: u64,
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
    /// The file has no checksum because a device (a GPU kernel) wrote its bytes through an
    /// extent table and the commit recorded none ([`crate::DeviceWrite::commit`]): the host
    /// never saw them, so nothing can be checked.
    DeviceWritten,
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
            inner: Arc::new(Inner::new(dev, geo, state)),
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
            inner: Arc::new(Inner::new(dev, geo, state)),
        })
    }

    /// Mounts as [`FileSystem::mount`] does, for reading only: for a device nothing may
    /// change (a write-protected namespace, an image opened read-only). Every change
    /// (create, remove, rename, a write or a read-write open, the immutable flag, reclaim) is
    /// refused with [`Error::ReadOnly`] before anything is touched, so none can fail half-way
    /// at the device. A sync has nothing to write and succeeds.
    pub fn mount_read_only(dev: Arc<dyn BlockDevice>) -> Result<Self> {
        let slots = read_slots(dev.as_ref())?;
        let sb = pick_superblock(&slots)?;
        let geo = load::geometry_of(dev.as_ref(), &sb)?;
        let raw = load::read_raw(dev.as_ref(), &geo, &sb)?;
        let state = load::strict_state(&geo, &raw)?;
        let mut inner = Inner::new(dev, geo, state);
        inner.read_only = true;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Whether the file system was mounted read-only ([`FileSystem::mount_read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
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
            inner: Arc::new(Inner::new(dev, geo, state)),
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

    /// Whether the file system refuses changes until a remount ([`Error::Poisoned`]): a commit
    /// failed at a point where the in-memory state cannot tell which generation is durable.
    pub fn is_poisoned(&self) -> bool {
        self.inner.read_state().poisoned
    }

    /// Generation of the last commit.
    pub fn generation(&self) -> u64 {
        self.inner.read_state().generation
    }

    /// Holds generation `generation` (at most the current one) for a reader elsewhere: see
    /// [`GenerationHold`]. A generation after the current one is [`Error::FutureGeneration`].
    pub fn hold_generation(&self, generation: u64) -> Result<GenerationHold> {
        // Under the state lock: no commit runs between the check and the hold.
        let st = self.inner.read_state();
        if generation > st.generation {
            return Err(Error::FutureGeneration {
                asked: generation,
                current: st.generation,
            });
        }
        let hold = GenerationHold::new(&self.inner.pins, generation);
        drop(st);
        Ok(hold)
    }

    /// Creates an empty file, preallocating `opts.size_hint` bytes, and opens it read-write.
    pub fn create(&self, name: &str, opts: &CreateOptions) -> Result<File> {
        validate_name(name)?;
        self.inner.check_writable(name)?;
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
            let r = commit(&self.inner, &mut st, true);
            self.inner.undo_on_device_error(&mut st, r)?;
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
        if mode == OpenMode::ReadWrite {
            self.inner.check_writable(name)?;
        }
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
        if mode == OpenMode::ReadWrite {
            self.inner.check_writable(prefix)?;
        }
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
                    flags: 0,
                }
            })
            .collect();
        let table = self.inner.pinned_table(&inputs);
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

    /// Removes a file. Its blocks become reusable two commits later (or, while an extent table
    /// naming them is held, at the first commit after its [`crate::PinnedTable`] is released);
    /// open handles to it fail with [`Error::Removed`] from now on.
    pub fn remove(&self, name: &str) -> Result<()> {
        self.inner.check_writable(name)?;
        let mut st = self.inner.write_state();
        if st.poisoned {
            return Err(Error::Poisoned);
        }
        let id = st.lookup(name)?;
        if st.inodes[&id].flags & FLAG_IMMUTABLE != 0 {
            return Err(Error::ReadOnly(name.to_owned()));
        }
        st.remove(name, id);
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
        self.inner.check_writable(old)?;
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
            st.remove(new, victim);
        }
        st.names.remove(old);
        st.names.insert(new.to_owned(), id);
        st.inodes.get_mut(&id).expect("looked up").name = new.to_owned();
        st.touch(id);
        Ok(())
    }

    /// Sets or clears the immutable flag.
    pub fn set_immutable(&self, name: &str, immutable: bool) -> Result<()> {
        self.inner.check_writable(name)?;
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
            return Ok(if st.device_written {
                DataCheck::DeviceWritten
            } else {
                DataCheck::NoChecksum
            });
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
        let pins = crate::pin::lock(&self.inner.pins);
        FsStats {
            block_size: self.inner.geo.block_size,
            total_blocks: self.inner.geo.block_count,
            data_blocks: st.data_blocks(),
            metadata_blocks: st.meta_blocks() + self.inner.geo.reserved_blocks(),
            free_blocks: st.alloc.free_blocks(),
            available_blocks: st.available_blocks(self.inner.geo.block_size),
            pending_blocks: st.alloc.pending_blocks(),
            pinned_blocks: st.alloc.pending_within(&pins.runs()),
            pinned_tables: pins.count() as u64,
            files: st.inodes.len() as u64,
            generation: st.generation,
        }
    }

    /// Makes every change so far durable: flushes file data, then commits the metadata
    /// (FORMAT.md, "Commit protocol"). After it returns, a crash at any later point mounts in
    /// this state or a later one.
    ///
    /// A sync that fails at the device before its superblock write puts the in-memory state
    /// back to the medium's last commit (every change since is dropped, as a remount would
    /// drop it), so what is listed is what is on the medium; one that fails after it poisons
    /// the file system ([`Error::Poisoned`]).
    pub fn sync(&self) -> Result<()> {
        let mut st = self.inner.write_state();
        let r = sync_locked(&self.inner, &mut st);
        self.inner.undo_on_device_error(&mut st, r)
    }

    /// Syncs, then commits again until every block freed before the call (by removals,
    /// truncation or earlier commits) is reusable: two more generations. Blocks that extent
    /// tables still held name stay pending ([`crate::PinnedTable`]). Use it before reusing the
    /// space of a file just removed, on a nearly full file system.
    pub fn reclaim(&self) -> Result<()> {
        self.inner
            .check_writable("(every file: the file system is mounted read-only)")?;
        let mut st = self.inner.write_state();
        // Saturating: at the last generation the commit refuses (never wraps).
        let target = st.generation.saturating_add(2);
        while st.generation < target {
            let r = commit(&self.inner, &mut st, true);
            self.inner.undo_on_device_error(&mut st, r)?;
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

/// Files opened together by [`FileSystem::open_prefix`], with their shared extent table.
#[derive(Debug)]
pub struct Batch {
    /// Names, in table order.
    pub names: Vec<String>,
    /// Handles, in table order.
    pub files: Vec<File>,
    /// The extent table; file `i` of the table is `files[i]`. Its blocks are pinned until the
    /// batch (or the table) is dropped, as for [`File::extent_table`].
    pub table: PinnedTable,
}
