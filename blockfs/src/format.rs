//! On-disk structures of blockfs format version 1, byte for byte as FORMAT.md documents them.
//!
//! Everything is little-endian (the crate refuses to build for big-endian targets). Decoders take
//! untrusted bytes and never panic: every count is checked against the bytes actually present
//! before anything is allocated from it.

use zerocopy::{FromBytes, FromZeros, Immutable, IntoBytes, KnownLayout};

use crate::name::check_name;

#[cfg(target_endian = "big")]
compile_error!(
    "blockfs's on-disk format is little-endian and this crate only runs on little-endian hosts"
);

/// Format version written by this build and the only one it reads.
pub const FORMAT_VERSION: u32 = 1;
/// First 8 bytes of a superblock.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"BLKFS_SB";
/// First 8 bytes of a root run.
pub const ROOT_MAGIC: [u8; 8] = *b"BLKFS_RT";
/// First 8 bytes of a file-table chunk.
pub const CHUNK_MAGIC: [u8; 8] = *b"BLKFS_CK";
/// Bytes of a superblock (the rest of its LBA is zero).
pub const SUPERBLOCK_SIZE: usize = 256;
/// Byte offsets of the two superblock slots.
pub const SUPERBLOCK_SLOTS: [u64; 2] = [0, 4096];
/// Bytes at the start of the device reserved for the superblock slots.
pub const RESERVED_BYTES: u64 = 8192;
/// Largest device LBA size supported (each superblock slot must be its own LBA).
pub const MAX_LBA_SIZE: u32 = 4096;
/// Smallest file system block size.
pub const MIN_BLOCK_SIZE: u32 = 4096;
/// Largest file system block size.
pub const MAX_BLOCK_SIZE: u32 = 1 << 20;
/// Longest file name in bytes (defined with the naming rules).
pub use crate::name::MAX_NAME_LEN;
/// Largest file size in bytes (2^62).
pub const MAX_FILE_SIZE: u64 = 1 << 62;
/// Incompatible feature bits this build understands (none yet).
pub const INCOMPAT_KNOWN: u64 = 0;
/// Read-only-compatible feature bits this build understands (none yet).
pub const RO_COMPAT_KNOWN: u64 = 0;
/// File flag: the file may not be opened for writing, resized, renamed or removed.
pub const FLAG_IMMUTABLE: u16 = 1 << 0;
/// File flag: the record's `data_crc` (the header's otherwise reserved word) holds the
/// CRC-32C of the file's bytes `0..size`, as recorded by whoever wrote them.
pub const FLAG_DATA_CRC: u16 = 1 << 1;
/// File flag: the file's bytes were last changed by a device writing through an extent table
/// (a GPU kernel), committed without a checksum: the host never saw them, so there is no data
/// checksum and readers say so. Never set together with [`FLAG_DATA_CRC`].
pub const FLAG_DEVICE_WRITTEN: u16 = 1 << 2;
/// Every file flag this build understands.
pub const FLAGS_KNOWN: u16 = FLAG_IMMUTABLE | FLAG_DATA_CRC | FLAG_DEVICE_WRITTEN;

/// Blocks reserved for the superblock slots at a given block size.
pub const fn reserved_blocks(block_size: u32) -> u64 {
    RESERVED_BYTES.div_ceil(block_size as u64)
}

/// CRC-32C (Castagnoli), the checksum of every metadata structure.
pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Superblock (FORMAT.md, "Superblock"). Stored in the first bytes of one LBA at each of
/// [`SUPERBLOCK_SLOTS`]; generation `g` always lives in slot `g % 2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Superblock {
    /// [`SUPERBLOCK_MAGIC`].
    pub magic: [u8; 8],
    /// [`FORMAT_VERSION`].
    pub version: u32,
    /// [`SUPERBLOCK_SIZE`].
    pub header_size: u32,
    /// File system UUID, random at mkfs, equal in both slots.
    pub uuid: [u8; 16],
    /// Commit generation; increases by one per commit.
    pub generation: u64,
    /// File system block size in bytes.
    pub block_size: u32,
    /// Device LBA size at mkfs time (informational).
    pub mkfs_lba_size: u32,
    /// Blocks in the file system.
    pub block_count: u64,
    /// First block of the root run.
    pub root_bno: u64,
    /// Blocks in the root run.
    pub root_blocks: u32,
    /// Bytes of the root run that hold data.
    pub root_bytes: u32,
    /// CRC-32C of those `root_bytes` bytes.
    pub root_crc: u32,
    /// Slot this superblock belongs in (`generation % 2`).
    pub slot: u32,
    /// Features a reader must understand to mount at all.
    pub incompat_features: u64,
    /// Features a reader must understand to write.
    pub ro_compat_features: u64,
    /// Features a reader may ignore.
    pub compat_features: u64,
    /// Zero.
    pub reserved: [u8; 148],
    /// CRC-32C of bytes 0..252.
    pub crc: u32,
}
const _: () = assert!(size_of::<Superblock>() == SUPERBLOCK_SIZE);

/// Header of the root run (FORMAT.md, "Root run").
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct RootHeader {
    /// [`ROOT_MAGIC`].
    pub magic: [u8; 8],
    /// The file system's UUID (as in the superblock).
    pub uuid: [u8; 16],
    /// Generation of the commit that wrote it (equal to the superblock's).
    pub generation: u64,
    /// Next file id to hand out; larger than every id in the file table.
    pub next_file_id: u64,
    /// Files in the file table.
    pub file_count: u64,
    /// [`ChunkDesc`] entries that follow the header.
    pub chunk_count: u32,
    /// [`FreeExtent`] entries that follow the chunk descriptors.
    pub free_count: u32,
    /// [`PendingExtent`] entries that follow the free extents.
    pub pending_count: u32,
    /// CRC-32C of the whole root (header and entries) with this field zero, so fsck can
    /// recognize a root whose superblock was lost.
    pub self_crc: u32,
    /// Blocks allocated to files.
    pub data_blocks: u64,
    /// Blocks of metadata (chunk runs plus the root run).
    pub meta_blocks: u64,
    /// Zero.
    pub reserved: [u8; 16],
}
const _: () = assert!(size_of::<RootHeader>() == ROOT_HEADER_SIZE);

/// Bytes of [`RootHeader`].
pub const ROOT_HEADER_SIZE: usize = 96;
/// Byte offset of [`RootHeader::self_crc`].
const ROOT_SELF_CRC_OFFSET: usize = 60;

/// The root's self-checksum: CRC-32C of `bytes` with the `self_crc` field taken as zero.
pub fn root_self_crc(bytes: &[u8]) -> u32 {
    let mut c = crc32c::crc32c(&bytes[..ROOT_SELF_CRC_OFFSET]);
    c = crc32c::crc32c_append(c, &[0u8; 4]);
    crc32c::crc32c_append(c, &bytes[ROOT_SELF_CRC_OFFSET + 4..])
}

/// Where one file-table chunk lives and what it must hash to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ChunkDesc {
    /// First block of the chunk run.
    pub bno: u64,
    /// Blocks in the chunk run.
    pub nblocks: u32,
    /// Bytes of the run that hold data (header plus records).
    pub bytes: u32,
    /// CRC-32C of those bytes.
    pub crc: u32,
    /// File records in the chunk.
    pub records: u32,
}
const _: () = assert!(size_of::<ChunkDesc>() == 24);

/// A run of free blocks.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FreeExtent {
    /// First block.
    pub bno: u64,
    /// Blocks.
    pub len: u64,
}
const _: () = assert!(size_of::<FreeExtent>() == 16);

/// A run of blocks freed by a recent commit, reusable from generation `freed_gen + 2` on.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PendingExtent {
    /// First block.
    pub bno: u64,
    /// Blocks.
    pub len: u64,
    /// Generation of the commit that freed them.
    pub freed_gen: u64,
}
const _: () = assert!(size_of::<PendingExtent>() == 24);

/// Header of a file-table chunk (FORMAT.md, "File-table chunk").
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct ChunkHeader {
    /// [`CHUNK_MAGIC`].
    pub magic: [u8; 8],
    /// Generation of the commit that wrote the chunk.
    pub generation: u64,
    /// File records that follow.
    pub records: u32,
    /// Bytes of header plus records.
    pub bytes: u32,
    /// Zero.
    pub reserved: u64,
}
const _: () = assert!(size_of::<ChunkHeader>() == 32);

/// Fixed part of a file record; followed by `extent_count` [`Extent`]s, `name_len` bytes of
/// UTF-8 name and zero padding to a multiple of 8 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct RecordHeader {
    /// Bytes of the whole record, padding included (a multiple of 8).
    pub record_len: u32,
    /// Bytes of the name.
    pub name_len: u16,
    /// `FLAG_*` bits.
    pub flags: u16,
    /// Unique, never reused file id (nonzero).
    pub file_id: u64,
    /// Generation of the commit that last changed this record.
    pub generation: u64,
    /// File size in bytes.
    pub size: u64,
    /// Blocks allocated to the file: the sum of its extent lengths.
    pub alloc_blocks: u64,
    /// Extents that follow.
    pub extent_count: u32,
    /// With [`FLAG_DATA_CRC`]: the CRC-32C of the file's bytes. Else zero.
    pub reserved: u32,
}
const _: () = assert!(size_of::<RecordHeader>() == 48);

/// A run of blocks of a file: extents follow each other in file order, so extent `i` covers
/// the file blocks after the lengths of extents `0..i`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct Extent {
    /// First block.
    pub bno: u64,
    /// Blocks (nonzero).
    pub len: u64,
}
const _: () = assert!(size_of::<Extent>() == 16);

/// A file record, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileRecord {
    /// Unique file id.
    pub file_id: u64,
    /// Generation of the commit that last changed it.
    pub generation: u64,
    /// Size in bytes.
    pub size: u64,
    /// `FLAG_*` bits.
    pub flags: u16,
    /// Extents in file order.
    pub extents: Vec<Extent>,
    /// Name.
    pub name: String,
    /// CRC-32C of the file's bytes when `flags` has [`FLAG_DATA_CRC`], else 0.
    pub data_crc: u32,
}

impl FileRecord {
    /// Blocks allocated: the sum of the extent lengths.
    pub fn alloc_blocks(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }

    /// Bytes the encoded record takes.
    pub fn encoded_len(&self) -> usize {
        record_len(self.extents.len(), self.name.len())
    }
}

/// Bytes of an encoded record with `extents` extents and a name of `name_len` bytes.
pub fn record_len(extents: usize, name_len: usize) -> usize {
    (size_of::<RecordHeader>() + extents * size_of::<Extent>() + name_len).next_multiple_of(8)
}

/// A root run, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootImage {
    /// Header.
    pub header: RootHeader,
    /// File-table chunks.
    pub chunks: Vec<ChunkDesc>,
    /// Free runs.
    pub free: Vec<FreeExtent>,
    /// Recently freed runs.
    pub pending: Vec<PendingExtent>,
}

/// Bytes of a root run with these counts.
pub fn root_len(chunks: usize, free: usize, pending: usize) -> usize {
    size_of::<RootHeader>()
        + chunks * size_of::<ChunkDesc>()
        + free * size_of::<FreeExtent>()
        + pending * size_of::<PendingExtent>()
}

/// Why a superblock slot does not hold a usable superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SuperblockProblem {
    /// The slot does not start with [`SUPERBLOCK_MAGIC`].
    BadMagic,
    /// The checksum does not match.
    Checksum {
        /// CRC stored in the slot.
        stored: u32,
        /// CRC of the bytes.
        computed: u32,
    },
    /// A version or feature this build does not read.
    Unsupported(String),
    /// A field out of its valid range.
    Invalid(String),
}

impl std::fmt::Display for SuperblockProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadMagic => write!(f, "no blockfs magic"),
            Self::Checksum { stored, computed } => {
                write!(
                    f,
                    "checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
                )
            }
            Self::Unsupported(s) | Self::Invalid(s) => f.write_str(s),
        }
    }
}

impl Superblock {
    /// Encodes with a fresh checksum.
    pub fn encode(&self) -> [u8; SUPERBLOCK_SIZE] {
        let mut sb = *self;
        sb.crc = 0;
        let mut out = [0u8; SUPERBLOCK_SIZE];
        out.copy_from_slice(sb.as_bytes());
        let c = crc(&out[..SUPERBLOCK_SIZE - 4]);
        out[SUPERBLOCK_SIZE - 4..].copy_from_slice(&c.to_le_bytes());
        out
    }

    /// Decodes and checks a superblock slot's bytes (at least [`SUPERBLOCK_SIZE`] of them).
    pub fn decode(bytes: &[u8]) -> Result<Self, SuperblockProblem> {
        let Ok((sb, _)) = Superblock::read_from_prefix(bytes) else {
            return Err(SuperblockProblem::Invalid(format!(
                "only {} bytes",
                bytes.len()
            )));
        };
        if sb.magic != SUPERBLOCK_MAGIC {
            return Err(SuperblockProblem::BadMagic);
        }
        let computed = crc(&bytes[..SUPERBLOCK_SIZE - 4]);
        if computed != sb.crc {
            return Err(SuperblockProblem::Checksum {
                stored: sb.crc,
                computed,
            });
        }
        if sb.version != FORMAT_VERSION {
            return Err(SuperblockProblem::Unsupported(format!(
                "format version {} (this build reads version {FORMAT_VERSION})",
                sb.version
            )));
        }
        if sb.incompat_features & !INCOMPAT_KNOWN != 0 {
            return Err(SuperblockProblem::Unsupported(format!(
                "unknown incompatible features {:#x}",
                sb.incompat_features & !INCOMPAT_KNOWN
            )));
        }
        let invalid = |s: String| Err(SuperblockProblem::Invalid(s));
        if sb.header_size as usize != SUPERBLOCK_SIZE {
            return invalid(format!(
                "header size {} (expected {SUPERBLOCK_SIZE})",
                sb.header_size
            ));
        }
        if !sb.block_size.is_power_of_two()
            || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&sb.block_size)
        {
            return invalid(format!("block size {}", sb.block_size));
        }
        if !sb.mkfs_lba_size.is_power_of_two() || !(512..=MAX_LBA_SIZE).contains(&sb.mkfs_lba_size)
        {
            return invalid(format!("LBA size {}", sb.mkfs_lba_size));
        }
        let reserved = reserved_blocks(sb.block_size);
        if sb.block_count <= reserved || sb.block_count > (u64::MAX / sb.block_size as u64) {
            return invalid(format!("block count {}", sb.block_count));
        }
        if sb.slot > 1 || sb.generation % 2 != sb.slot as u64 {
            return invalid(format!("slot {} for generation {}", sb.slot, sb.generation));
        }
        let root_end = sb.root_bno.checked_add(sb.root_blocks as u64);
        if sb.root_blocks == 0
            || sb.root_bno < reserved
            || root_end.is_none_or(|end| end > sb.block_count)
        {
            return invalid(format!(
                "root run {}+{} outside blocks {reserved}..{}",
                sb.root_bno, sb.root_blocks, sb.block_count
            ));
        }
        if (sb.root_bytes as usize) < size_of::<RootHeader>()
            || sb.root_bytes as u64 > sb.root_blocks as u64 * sb.block_size as u64
        {
            return invalid(format!(
                "root size {} bytes in {} blocks",
                sb.root_bytes, sb.root_blocks
            ));
        }
        Ok(sb)
    }
}

/// Checks that `bno..bno+len` is a nonempty run inside the data area.
pub fn check_run(bno: u64, len: u64, reserved: u64, block_count: u64) -> Result<(), String> {
    if len == 0 {
        return Err(format!("empty run at block {bno}"));
    }
    match bno.checked_add(len) {
        Some(end) if bno >= reserved && end <= block_count => Ok(()),
        _ => Err(format!(
            "run {bno}+{len} outside blocks {reserved}..{block_count}"
        )),
    }
}

/// Encodes a root run, filling in its self-checksum.
pub fn encode_root(
    header: &RootHeader,
    chunks: &[ChunkDesc],
    free: &[FreeExtent],
    pending: &[PendingExtent],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(root_len(chunks.len(), free.len(), pending.len()));
    let mut h = *header;
    h.self_crc = 0;
    out.extend_from_slice(h.as_bytes());
    out.extend_from_slice(chunks.as_bytes());
    out.extend_from_slice(free.as_bytes());
    out.extend_from_slice(pending.as_bytes());
    let c = root_self_crc(&out);
    out[ROOT_SELF_CRC_OFFSET..ROOT_SELF_CRC_OFFSET + 4].copy_from_slice(&c.to_le_bytes());
    out
}

/// Decodes a root run of exactly the bytes the superblock gives (checksum already verified),
/// checking it against the superblock.
pub fn decode_root(bytes: &[u8], sb: &Superblock) -> Result<RootImage, String> {
    let Ok((header, rest)) = RootHeader::read_from_prefix(bytes) else {
        return Err(format!("only {} bytes", bytes.len()));
    };
    if header.magic != ROOT_MAGIC {
        return Err("no root magic".into());
    }
    if header.uuid != sb.uuid {
        return Err("UUID differs from the superblock's".into());
    }
    let self_crc = root_self_crc(bytes);
    if header.self_crc != self_crc {
        return Err(format!(
            "self-checksum mismatch (stored {:#010x}, computed {self_crc:#010x})",
            header.self_crc
        ));
    }
    if header.generation != sb.generation {
        return Err(format!(
            "generation {} in a root named by superblock generation {}",
            header.generation, sb.generation
        ));
    }
    let (c, f, p) = (
        header.chunk_count as usize,
        header.free_count as usize,
        header.pending_count as usize,
    );
    // Each count is at most 2^32 and each entry at most 24 bytes: no overflow on 64-bit hosts.
    if root_len(c, f, p) != bytes.len() {
        return Err(format!(
            "{c} chunks, {f} free and {p} pending runs do not fill {} bytes",
            bytes.len()
        ));
    }
    let (chunks, rest) = read_vec::<ChunkDesc>(rest, c)?;
    let (free, rest) = read_vec::<FreeExtent>(rest, f)?;
    let (pending, _) = read_vec::<PendingExtent>(rest, p)?;
    let reserved = reserved_blocks(sb.block_size);
    for (i, d) in chunks.iter().enumerate() {
        check_run(d.bno, d.nblocks as u64, reserved, sb.block_count)
            .map_err(|e| format!("chunk {i}: {e}"))?;
        if (d.bytes as usize) < size_of::<ChunkHeader>()
            || d.bytes as u64 > d.nblocks as u64 * sb.block_size as u64
        {
            return Err(format!(
                "chunk {i}: {} bytes in {} blocks",
                d.bytes, d.nblocks
            ));
        }
    }
    for (i, e) in free.iter().enumerate() {
        check_run(e.bno, e.len, reserved, sb.block_count)
            .map_err(|e| format!("free run {i}: {e}"))?;
    }
    for (i, e) in pending.iter().enumerate() {
        check_run(e.bno, e.len, reserved, sb.block_count)
            .map_err(|e| format!("pending run {i}: {e}"))?;
        if e.freed_gen > sb.generation {
            return Err(format!(
                "pending run {i} freed by generation {} after {}",
                e.freed_gen, sb.generation
            ));
        }
    }
    let records: u64 = chunks.iter().map(|d| d.records as u64).sum();
    if records != header.file_count {
        return Err(format!(
            "file count {} but chunks hold {records} records",
            header.file_count
        ));
    }
    Ok(RootImage {
        header,
        chunks,
        free,
        pending,
    })
}

/// Copies `n` entries of `T` out of the front of `bytes` (no alignment needed).
fn read_vec<T: FromBytes + Copy>(bytes: &[u8], n: usize) -> Result<(Vec<T>, &[u8]), String> {
    let size = size_of::<T>();
    let need = n.checked_mul(size).filter(|&b| b <= bytes.len());
    let Some(need) = need else {
        return Err(format!(
            "{n} entries of {size} bytes do not fit in {} bytes",
            bytes.len()
        ));
    };
    let (head, rest) = bytes.split_at(need);
    let v = head
        .chunks_exact(size)
        .map(|c| T::read_from_bytes(c).map_err(|_| "entry size".to_string()))
        .collect::<Result<Vec<T>, String>>()?;
    Ok((v, rest))
}

/// Encodes one file record.
pub fn encode_record(rec: &FileRecord, out: &mut Vec<u8>) {
    let len = rec.encoded_len();
    let start = out.len();
    let header = RecordHeader {
        record_len: len as u32,
        name_len: rec.name.len() as u16,
        flags: rec.flags,
        file_id: rec.file_id,
        generation: rec.generation,
        size: rec.size,
        alloc_blocks: rec.alloc_blocks(),
        extent_count: rec.extents.len() as u32,
        reserved: if rec.flags & FLAG_DATA_CRC != 0 {
            rec.data_crc
        } else {
            0
        },
    };
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(rec.extents.as_bytes());
    out.extend_from_slice(rec.name.as_bytes());
    out.resize(start + len, 0);
}

/// Encodes a chunk (header plus records).
pub fn encode_chunk<'a>(
    generation: u64,
    records: impl IntoIterator<Item = &'a FileRecord>,
) -> Vec<u8> {
    let mut out = vec![0u8; size_of::<ChunkHeader>()];
    let mut n = 0u32;
    for r in records {
        encode_record(r, &mut out);
        n += 1;
    }
    let header = ChunkHeader {
        magic: CHUNK_MAGIC,
        generation,
        records: n,
        bytes: out.len() as u32,
        reserved: 0,
    };
    out[..size_of::<ChunkHeader>()].copy_from_slice(header.as_bytes());
    out
}

/// Geometry a record is checked against.
#[derive(Clone, Copy, Debug)]
pub struct RecordLimits {
    /// File system block size.
    pub block_size: u32,
    /// Blocks in the file system.
    pub block_count: u64,
    /// Generation of the root that names the chunk (records may not be newer).
    pub generation: u64,
}

/// The framing of the record at the front of `bytes`: its header and the bytes it takes, if
/// its length field agrees with its extent count and name length and the record fits. A record
/// whose framing holds can be skipped when its contents are invalid; one whose framing is
/// broken leaves the rest of its chunk unparseable.
pub fn record_frame(bytes: &[u8]) -> Result<(RecordHeader, usize), String> {
    let Ok((h, _)) = RecordHeader::read_from_prefix(bytes) else {
        return Err(format!(
            "record header needs 48 bytes, {} left",
            bytes.len()
        ));
    };
    let expected = record_len(h.extent_count as usize, h.name_len as usize);
    if h.record_len as usize != expected || expected > bytes.len() {
        return Err(format!(
            "record length {} (expected {expected}, {} bytes left)",
            h.record_len,
            bytes.len()
        ));
    }
    Ok((h, expected))
}

/// Decodes one record from the front of `bytes`; returns it and the bytes it took.
pub fn decode_record(bytes: &[u8], lim: &RecordLimits) -> Result<(FileRecord, usize), String> {
    let (h, expected) = record_frame(bytes)?;
    let rest = &bytes[size_of::<RecordHeader>()..];
    let (extents, rest) = read_vec::<Extent>(rest, h.extent_count as usize)?;
    let name_bytes = &rest[..h.name_len as usize];
    let name = std::str::from_utf8(name_bytes)
        .map_err(|_| format!("file {}: name is not UTF-8", h.file_id))?
        .to_owned();
    check_name(&name).map_err(|r| format!("file {}: name {name:?} {r}", h.file_id))?;
    if h.file_id == 0 {
        return Err(format!("file {name:?}: file id 0"));
    }
    if h.flags & !FLAGS_KNOWN != 0 {
        return Err(format!("file {name:?}: unknown flags {:#x}", h.flags));
    }
    if h.flags & FLAG_DATA_CRC != 0 && h.flags & FLAG_DEVICE_WRITTEN != 0 {
        return Err(format!(
            "file {name:?}: flags {:#x} say both checksummed and device-written",
            h.flags
        ));
    }
    if h.generation > lim.generation {
        return Err(format!(
            "file {name:?}: generation {} newer than the root's {}",
            h.generation, lim.generation
        ));
    }
    let reserved = reserved_blocks(lim.block_size);
    let mut total = 0u64;
    for e in &extents {
        check_run(e.bno, e.len, reserved, lim.block_count)
            .map_err(|err| format!("file {name:?}: extent {err}"))?;
        total += e.len; // each len <= block_count, count bounded by the chunk: no overflow
    }
    if total != h.alloc_blocks {
        return Err(format!(
            "file {name:?}: extents hold {total} blocks, record says {}",
            h.alloc_blocks
        ));
    }
    if h.size > MAX_FILE_SIZE || h.size.div_ceil(lim.block_size as u64) > total {
        return Err(format!(
            "file {name:?}: size {} exceeds its {total} allocated blocks",
            h.size
        ));
    }
    let rec = FileRecord {
        file_id: h.file_id,
        generation: h.generation,
        size: h.size,
        flags: h.flags,
        extents,
        name,
        data_crc: if h.flags & FLAG_DATA_CRC != 0 {
            h.reserved
        } else {
            0
        },
    };
    Ok((rec, expected))
}

/// A chunk decoded as far as it would go: every record that decodes, the invalid records that
/// were skipped (their length field still framed them), where parsing had to stop (a record
/// whose length field is broken), and the first problem.
#[derive(Debug)]
pub struct ChunkImage {
    /// Header, if it parsed.
    pub header: Option<ChunkHeader>,
    /// Records that decoded, in chunk order.
    pub records: Vec<FileRecord>,
    /// The first problem found, if any (mount refuses a chunk with one).
    pub error: Option<String>,
    /// Records skipped because their contents are invalid although their framing holds: the
    /// records after them were still decoded.
    pub dropped: Vec<DroppedRecord>,
    /// Byte offset in the chunk where a record's framing (its length field) was broken: the
    /// records from there on (up to `resumed_at`, if set) could not be told apart and are not
    /// in `records`.
    pub unparsed_from: Option<usize>,
    /// Where decoding resumed after broken framing: the next 8-byte-aligned offset at which a
    /// whole valid record decodes. The records after it are in `records` (or `dropped`).
    pub resumed_at: Option<usize>,
}

/// A record [`decode_chunk`] skipped: framed by a sane length field, but invalid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DroppedRecord {
    /// Its index in the chunk.
    pub index: u32,
    /// Its byte offset in the chunk.
    pub offset: usize,
    /// The file id its header gives (not trustworthy: the record is invalid).
    pub file_id: u64,
    /// Its name, if the name bytes are UTF-8.
    pub name: Option<String>,
    /// What is wrong with it.
    pub detail: String,
}

/// Decodes a chunk from exactly the bytes its descriptor gives.
pub fn decode_chunk(bytes: &[u8], records: u32, lim: &RecordLimits) -> ChunkImage {
    let mut img = ChunkImage {
        header: None,
        records: Vec::new(),
        error: None,
        dropped: Vec::new(),
        unparsed_from: None,
        resumed_at: None,
    };
    let Ok((h, _)) = ChunkHeader::read_from_prefix(bytes) else {
        img.error = Some(format!("only {} bytes", bytes.len()));
        return img;
    };
    img.header = Some(h);
    let fail = |mut img: ChunkImage, e: String| {
        img.error = Some(e);
        img
    };
    if h.magic != CHUNK_MAGIC {
        return fail(img, "no chunk magic".into());
    }
    // A header that disagrees with the descriptor (which the root's checksum covers) is an
    // error, but the records are still decoded, as the descriptor counts them: each is checked
    // on its own.
    if h.generation > lim.generation {
        img.error = Some(format!(
            "generation {} newer than the root's {}",
            h.generation, lim.generation
        ));
    } else if h.records != records || h.bytes as usize != bytes.len() {
        img.error = Some(format!(
            "header says {} records in {} bytes, descriptor {records} in {}",
            h.records,
            h.bytes,
            bytes.len()
        ));
    }
    let mut pos = size_of::<ChunkHeader>();
    let mut i = 0u32;
    while i < records && (img.resumed_at.is_none() || pos < bytes.len()) {
        let rest = &bytes[pos..];
        let used = match record_frame(rest) {
            Ok((_, used)) => used,
            Err(e) => {
                img.unparsed_from.get_or_insert(pos);
                let msg = format!("record {i} at byte {pos}: {e}");
                img.error.get_or_insert(msg);
                // Records start at multiples of 8: the next offset where a whole valid record
                // decodes is where parsing resumes (records between are lost).
                let resumed = resync(bytes, pos + 8, lim);
                let gap = resumed.unwrap_or(bytes.len()) - pos;
                // The broken record's own extent count and name length filling the gap exactly
                // make it that record: named. Else only its file id is known (the gap may hold
                // more than one record), for a reader to look the name up elsewhere.
                let mut d = dropped_record(&rest[..gap], i, pos, e);
                let fits = RecordHeader::read_from_prefix(rest).is_ok_and(|(rh, _)| {
                    record_len(rh.extent_count as usize, rh.name_len as usize) == gap
                });
                if !fits {
                    d.name = None;
                }
                img.dropped.push(d);
                match resumed {
                    Some(at) => {
                        img.resumed_at = Some(at);
                        pos = at;
                        // The records skipped are not counted: what follows is numbered as
                        // the chunk goes on.
                        i += 1;
                        continue;
                    }
                    None => return img,
                }
            }
        };
        match decode_record(&rest[..used], lim) {
            Ok((r, _)) => img.records.push(r),
            Err(e) => {
                let msg = format!("record {i} at byte {pos}: {e}");
                img.error.get_or_insert(msg);
                img.dropped.push(dropped_record(&rest[..used], i, pos, e));
            }
        }
        pos += used;
        i += 1;
    }
    if pos != bytes.len() && img.error.is_none() {
        return fail(
            img,
            format!("{} bytes after the last record", bytes.len() - pos),
        );
    }
    img
}

/// The first offset from `from` on (a multiple of 8 from the chunk's start) where a whole valid
/// record decodes.
fn resync(bytes: &[u8], from: usize, lim: &RecordLimits) -> Option<usize> {
    let mut at = from.next_multiple_of(8);
    while at + size_of::<RecordHeader>() <= bytes.len() {
        if decode_record(&bytes[at..], lim).is_ok() {
            return Some(at);
        }
        at += 8;
    }
    None
}

/// What can be said about an invalid record whose framing holds.
fn dropped_record(bytes: &[u8], index: u32, offset: usize, detail: String) -> DroppedRecord {
    let (file_id, name) = match RecordHeader::read_from_prefix(bytes) {
        Ok((h, _)) => {
            let at = size_of::<RecordHeader>() + h.extent_count as usize * size_of::<Extent>();
            let name = bytes
                .get(at..at + h.name_len as usize)
                .and_then(|b| std::str::from_utf8(b).ok())
                // A name length one too long takes in a padding byte: names hold no NUL.
                .map(|n| n.trim_end_matches('\0'))
                .filter(|n| !n.is_empty())
                .map(str::to_owned);
            (h.file_id, name)
        }
        Err(_) => (0, None),
    };
    DroppedRecord {
        index,
        offset,
        file_id,
        name,
        detail,
    }
}

/// An all-zero superblock, for building one field by field.
pub fn zeroed_superblock() -> Superblock {
    Superblock::new_zeroed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn layouts_match_format_md() {
        assert_eq!(offset_of!(Superblock, generation), 32);
        assert_eq!(offset_of!(Superblock, block_count), 48);
        assert_eq!(offset_of!(Superblock, root_bno), 56);
        assert_eq!(offset_of!(Superblock, root_crc), 72);
        assert_eq!(offset_of!(Superblock, incompat_features), 80);
        assert_eq!(offset_of!(Superblock, crc), 252);
        assert_eq!(offset_of!(RootHeader, generation), 24);
        assert_eq!(offset_of!(RootHeader, chunk_count), 48);
        assert_eq!(offset_of!(RootHeader, self_crc), ROOT_SELF_CRC_OFFSET);
        assert_eq!(offset_of!(RootHeader, data_blocks), 64);
        assert_eq!(offset_of!(ChunkDesc, crc), 16);
        assert_eq!(offset_of!(RecordHeader, file_id), 8);
        assert_eq!(offset_of!(RecordHeader, size), 24);
        assert_eq!(offset_of!(RecordHeader, extent_count), 40);
    }

    fn limits() -> RecordLimits {
        RecordLimits {
            block_size: 4096,
            block_count: 1000,
            generation: 7,
        }
    }

    #[test]
    fn record_round_trip_and_rejections() {
        let rec = FileRecord {
            file_id: 3,
            generation: 7,
            size: 5000,
            flags: 0,
            extents: vec![Extent { bno: 10, len: 1 }, Extent { bno: 20, len: 2 }],
            name: "dir/file".into(),
            data_crc: 0,
        };
        let chunk = encode_chunk(7, [&rec]);
        assert_eq!(chunk.len(), 32 + 48 + 32 + 8);
        let img = decode_chunk(&chunk, 1, &limits());
        assert_eq!(img.error, None);
        assert_eq!(img.records, vec![rec.clone()]);

        let mut bad = rec.clone();
        bad.size = 3 * 4096 + 1;
        let img = decode_chunk(&encode_chunk(7, [&bad]), 1, &limits());
        assert!(img.error.unwrap().contains("exceeds"));

        let mut bad = rec.clone();
        bad.extents[1].bno = 999;
        let img = decode_chunk(&encode_chunk(7, [&bad]), 1, &limits());
        assert!(img.error.unwrap().contains("outside"));

        let img = decode_chunk(&chunk, 2, &limits());
        assert!(img.error.is_some());
        let img = decode_chunk(&chunk[..chunk.len() - 8], 1, &limits());
        assert!(img.error.is_some());

        // Device-written (bit 2) round-trips; with a checksum (bit 1) it is refused, as are
        // unknown bits.
        let mut dev = rec.clone();
        dev.flags = FLAG_DEVICE_WRITTEN;
        let img = decode_chunk(&encode_chunk(7, [&dev]), 1, &limits());
        assert_eq!((img.error, img.records), (None, vec![dev.clone()]));
        dev.flags = FLAG_DEVICE_WRITTEN | FLAG_DATA_CRC;
        dev.data_crc = 1;
        let img = decode_chunk(&encode_chunk(7, [&dev]), 1, &limits());
        assert!(img.error.unwrap().contains("device-written"));
        dev.flags = 1 << 3;
        let img = decode_chunk(&encode_chunk(7, [&dev]), 1, &limits());
        assert!(img.error.unwrap().contains("unknown flags 0x8"));
    }

    /// An invalid record whose length field frames it is dropped alone; a broken length field
    /// stops the parse there.
    #[test]
    fn an_invalid_record_is_skipped_by_its_framing() {
        let recs: Vec<FileRecord> = (1..=3)
            .map(|i| FileRecord {
                file_id: i,
                generation: 7,
                size: 10,
                flags: 0,
                extents: vec![Extent {
                    bno: 10 + i,
                    len: 1,
                }],
                name: format!("f{i}"),
                data_crc: 0,
            })
            .collect();
        let mut chunk = encode_chunk(7, &recs);
        let second = 32 + recs[0].encoded_len();
        chunk[second + 6] = 0x08; // unknown flag
        let img = decode_chunk(&chunk, 3, &limits());
        assert_eq!(img.records, vec![recs[0].clone(), recs[2].clone()]);
        assert!(img.error.unwrap().contains("unknown flags"));
        assert_eq!(img.unparsed_from, None);
        assert_eq!(img.dropped.len(), 1);
        assert_eq!(
            (img.dropped[0].index, img.dropped[0].file_id),
            (1, 2),
            "{:?}",
            img.dropped
        );
        assert_eq!(img.dropped[0].name.as_deref(), Some("f2"));
        chunk[second..second + 4].copy_from_slice(&7u32.to_le_bytes());
        // Decoding resumes at the next valid record, and the gap, one record long, is named.
        let img = decode_chunk(&chunk, 3, &limits());
        assert_eq!(img.records, vec![recs[0].clone(), recs[2].clone()]);
        assert_eq!(img.unparsed_from, Some(second));
        assert_eq!(img.resumed_at, Some(second + recs[1].encoded_len()));
        assert_eq!(img.dropped.len(), 1);
        assert_eq!(img.dropped[0].name.as_deref(), Some("f2"));
        // A gap of garbage: nothing resumes, nothing is named.
        let end = chunk.len();
        chunk[second..end].fill(0xA5);
        let img = decode_chunk(&chunk, 3, &limits());
        assert_eq!(img.records, vec![recs[0].clone()]);
        assert_eq!((img.unparsed_from, img.resumed_at), (Some(second), None));
        assert_eq!(img.dropped.len(), 1, "the broken record, by file id");
        assert_eq!(img.dropped[0].name, None);
    }

    #[test]
    fn superblock_checks() {
        let mut sb = zeroed_superblock();
        sb.magic = SUPERBLOCK_MAGIC;
        sb.version = FORMAT_VERSION;
        sb.header_size = SUPERBLOCK_SIZE as u32;
        sb.generation = 3;
        sb.slot = 1;
        sb.block_size = 4096;
        sb.mkfs_lba_size = 512;
        sb.block_count = 100;
        sb.root_bno = 2;
        sb.root_blocks = 1;
        sb.root_bytes = 96;
        let bytes = sb.encode();
        let back = Superblock::decode(&bytes).unwrap();
        assert_eq!(back.generation, 3);
        let mut flipped = bytes;
        flipped[40] ^= 1;
        assert!(matches!(
            Superblock::decode(&flipped),
            Err(SuperblockProblem::Checksum { .. })
        ));
        assert_eq!(
            Superblock::decode(&[0u8; 256]),
            Err(SuperblockProblem::BadMagic)
        );
        let mut wrong_slot = sb;
        wrong_slot.slot = 0;
        assert!(matches!(
            Superblock::decode(&wrong_slot.encode()),
            Err(SuperblockProblem::Invalid(_))
        ));
        let mut newer = sb;
        newer.version = 2;
        assert!(matches!(
            Superblock::decode(&newer.encode()),
            Err(SuperblockProblem::Unsupported(_))
        ));
    }
}
