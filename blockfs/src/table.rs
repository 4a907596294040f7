//! GPU extent tables: one flat, read-only, contiguous array per open file or batch of files that
//! maps a file offset to a device LBA with a binary search and no pointer chasing.
//!
//! Layout (FORMAT.md, "GPU extent table"; the constants below are the single source of truth for
//! the CUDA side): a 64-byte [`TableHeader`], then `file_count` 48-byte [`TableFile`] entries,
//! then `extent_count` 24-byte [`TableExtent`] entries. Every field is a little-endian integer at
//! a naturally aligned offset; the whole table is 8-byte aligned.
//!
//! A table is a snapshot taken when it is built. It covers each file's whole allocation
//! (`alloc_bytes`, preallocation included) and says the file's length (`size_bytes`): a reader
//! stops at the length, a writer holding a table with [`TABLE_FILE_WRITABLE`] (from a
//! device-write reservation, `File::reserve_device_write`) may write up to the allocation.
//! Later growth, truncation or removal of the file is not reflected in it; the blocks it names
//! stay out of reuse while the table is pinned (`PinnedTable`).

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::extents::ExtentList;

/// `TableHeader::magic`: "BFXT" in little-endian byte order.
pub const TABLE_MAGIC: u32 = u32::from_le_bytes(*b"BFXT");
/// `TableHeader::version` this build writes.
pub const TABLE_VERSION: u16 = 2;
/// Size of [`TableHeader`].
pub const TABLE_HEADER_SIZE: usize = 64;
/// Size of [`TableFile`].
pub const TABLE_FILE_SIZE: usize = 48;
/// Size of [`TableExtent`].
pub const TABLE_EXTENT_SIZE: usize = 24;
/// Byte offset of `TableHeader::lba_shift`.
pub const TABLE_HEADER_LBA_SHIFT_OFFSET: usize = 8;
/// Byte offset of `TableHeader::nsid`.
pub const TABLE_HEADER_NSID_OFFSET: usize = 12;
/// Byte offset of `TableHeader::file_count`.
pub const TABLE_HEADER_FILE_COUNT_OFFSET: usize = 16;
/// Byte offset of `TableHeader::extent_count`.
pub const TABLE_HEADER_EXTENT_COUNT_OFFSET: usize = 24;
/// Byte offset of `TableHeader::files_offset`.
pub const TABLE_HEADER_FILES_OFFSET_OFFSET: usize = 32;
/// Byte offset of `TableHeader::extents_offset`.
pub const TABLE_HEADER_EXTENTS_OFFSET_OFFSET: usize = 40;
/// Byte offset of `TableFile::size_bytes`.
pub const TABLE_FILE_SIZE_BYTES_OFFSET: usize = 0;
/// Byte offset of `TableFile::first_extent`.
pub const TABLE_FILE_FIRST_EXTENT_OFFSET: usize = 8;
/// Byte offset of `TableFile::extent_count`.
pub const TABLE_FILE_EXTENT_COUNT_OFFSET: usize = 16;
/// Byte offset of `TableFile::file_id`.
pub const TABLE_FILE_FILE_ID_OFFSET: usize = 24;
/// Byte offset of `TableFile::alloc_bytes`.
pub const TABLE_FILE_ALLOC_BYTES_OFFSET: usize = 32;
/// Byte offset of `TableFile::flags`.
pub const TABLE_FILE_FLAGS_OFFSET: usize = 40;
/// `TableFile::flags` bit: the table was handed out by a device-write reservation; the device
/// may write any offset below `alloc_bytes` (else the table is for reading only).
pub const TABLE_FILE_WRITABLE: u32 = 1 << 0;
/// Byte offset of `TableExtent::file_lba`.
pub const TABLE_EXTENT_FILE_LBA_OFFSET: usize = 0;
/// Byte offset of `TableExtent::lba`.
pub const TABLE_EXTENT_LBA_OFFSET: usize = 8;
/// Byte offset of `TableExtent::nlb`.
pub const TABLE_EXTENT_NLB_OFFSET: usize = 16;

/// Table header.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct TableHeader {
    /// [`TABLE_MAGIC`].
    pub magic: u32,
    /// [`TABLE_VERSION`].
    pub version: u16,
    /// [`TABLE_HEADER_SIZE`].
    pub header_bytes: u16,
    /// log2 of the device LBA size: byte offset `o` is file LBA `o >> lba_shift`.
    pub lba_shift: u32,
    /// NVMe namespace id the LBAs belong to (0 when the device is not NVMe).
    pub nsid: u32,
    /// [`TableFile`] entries.
    pub file_count: u32,
    /// [`TABLE_FILE_SIZE`].
    pub file_entry_bytes: u16,
    /// [`TABLE_EXTENT_SIZE`].
    pub extent_entry_bytes: u16,
    /// [`TableExtent`] entries, all files together.
    pub extent_count: u64,
    /// Byte offset of the first [`TableFile`] from the start of the table.
    pub files_offset: u64,
    /// Byte offset of the first [`TableExtent`] from the start of the table.
    pub extents_offset: u64,
    /// Bytes of the whole table.
    pub total_bytes: u64,
    /// Zero.
    pub reserved: u64,
}
const _: () = assert!(size_of::<TableHeader>() == TABLE_HEADER_SIZE);

/// One file of a table.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct TableFile {
    /// File size in bytes; offsets at or past it are end of file.
    pub size_bytes: u64,
    /// Index (into the extent array) of the file's first extent.
    pub first_extent: u64,
    /// Extents of this file; they cover file LBAs `0..alloc_bytes / lba_size` without gaps
    /// (except in a striped volume's member tables, [`crate::StripedVolume::member_tables`],
    /// which hold only the pieces on their member).
    pub extent_count: u64,
    /// The file's id (FORMAT.md, "File record").
    pub file_id: u64,
    /// Bytes the extents cover: the file's whole allocation, a multiple of the block size and at
    /// least `size_bytes` (preallocated space past end of file included).
    pub alloc_bytes: u64,
    /// `TABLE_FILE_*` bits.
    pub flags: u32,
    /// Zero.
    pub reserved: u32,
}
const _: () = assert!(size_of::<TableFile>() == TABLE_FILE_SIZE);

/// One extent: file LBAs `file_lba..file_lba+nlb` live at device LBAs `lba..lba+nlb`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct TableExtent {
    /// First file LBA (sorted ascending within a file; the first is 0).
    pub file_lba: u64,
    /// First device LBA.
    pub lba: u64,
    /// LBAs in the run (nonzero).
    pub nlb: u64,
}
const _: () = assert!(size_of::<TableExtent>() == TABLE_EXTENT_SIZE);

/// Where a file offset lives on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Translation {
    /// Device LBA holding the byte.
    pub lba: u64,
    /// LBAs from `lba` to the end of its extent (how far a single command may go).
    pub contiguous_lbas: u64,
}

/// A flat extent table (see the module docs), kept 8-byte aligned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtentTable {
    words: Vec<u64>,
}

/// One file's input to [`ExtentTable::build`].
pub(crate) struct TableInput<'a> {
    pub file_id: u64,
    pub size: u64,
    pub extents: &'a ExtentList,
    /// `TABLE_FILE_*` bits.
    pub flags: u32,
}

impl ExtentTable {
    /// Builds a table. `spb` is LBAs per file system block.
    pub(crate) fn build(lba_size: u32, nsid: u32, spb: u64, files: &[TableInput<'_>]) -> Self {
        let lba = lba_size as u64;
        let mut entries: Vec<TableFile> = Vec::with_capacity(files.len());
        let mut extents: Vec<TableExtent> = Vec::new();
        for f in files {
            let first = extents.len() as u64;
            let mut file_lba = 0u64;
            for e in f.extents.as_slice() {
                let nlb = e.len * spb;
                extents.push(TableExtent {
                    file_lba,
                    lba: e.bno * spb,
                    nlb,
                });
                file_lba += nlb;
            }
            entries.push(TableFile {
                size_bytes: f.size,
                first_extent: first,
                extent_count: extents.len() as u64 - first,
                file_id: f.file_id,
                alloc_bytes: file_lba * lba,
                flags: f.flags,
                reserved: 0,
            });
        }
        Self::from_parts(lba_size, nsid, &entries, &extents)
    }

    /// A table of one file of `size_bytes` on namespace `nsid` with `lba_size`-byte LBAs,
    /// whose runs are `(file LBA, device LBA, LBAs)` in file order (for tools and tests that
    /// plan reads without a file system).
    pub fn of_runs(lba_size: u32, nsid: u32, size_bytes: u64, runs: &[(u64, u64, u64)]) -> Self {
        let extents: Vec<TableExtent> = runs
            .iter()
            .map(|&(file_lba, lba, nlb)| TableExtent { file_lba, lba, nlb })
            .collect();
        let alloc: u64 = runs.iter().map(|r| r.2).sum();
        let entry = TableFile {
            size_bytes,
            first_extent: 0,
            extent_count: extents.len() as u64,
            file_id: 1,
            alloc_bytes: alloc * u64::from(lba_size),
            flags: 0,
            reserved: 0,
        };
        Self::from_parts(lba_size, nsid, &[entry], &extents)
    }

    /// A table of these entries (each file's `first_extent` and `extent_count` indexing
    /// `extents`), on namespace `nsid` with `lba_size`-byte LBAs. For a striped volume's
    /// member tables ([`crate::StripedVolume::member_tables`]), whose files' extents leave gaps
    /// where other members hold the data.
    pub(crate) fn from_parts(
        lba_size: u32,
        nsid: u32,
        entries: &[TableFile],
        extents: &[TableExtent],
    ) -> Self {
        let files_offset = TABLE_HEADER_SIZE as u64;
        let extents_offset = files_offset + (entries.len() * TABLE_FILE_SIZE) as u64;
        let total = extents_offset + (extents.len() * TABLE_EXTENT_SIZE) as u64;
        let header = TableHeader {
            magic: TABLE_MAGIC,
            version: TABLE_VERSION,
            header_bytes: TABLE_HEADER_SIZE as u16,
            lba_shift: lba_size.trailing_zeros(),
            nsid,
            file_count: entries.len() as u32,
            file_entry_bytes: TABLE_FILE_SIZE as u16,
            extent_entry_bytes: TABLE_EXTENT_SIZE as u16,
            extent_count: extents.len() as u64,
            files_offset,
            extents_offset,
            total_bytes: total,
            reserved: 0,
        };
        let mut words = vec![0u64; (total / 8) as usize];
        let bytes = words.as_mut_bytes();
        bytes[..TABLE_HEADER_SIZE].copy_from_slice(header.as_bytes());
        bytes[files_offset as usize..extents_offset as usize].copy_from_slice(entries.as_bytes());
        bytes[extents_offset as usize..].copy_from_slice(extents.as_bytes());
        Self { words }
    }

    /// A table from bytes another process built (the `gpunvme serve` daemon's reservations),
    /// checked before anything is read through it: the header's magic, version and sizes, every
    /// entry inside the bytes, each file's extents covering its LBAs from 0 without gaps or
    /// empty runs and summing to its allocation, its length within the allocation, and no LBA
    /// past `max_lba` (the namespace's size). The error says what is wrong.
    pub fn from_bytes(bytes: &[u8], max_lba: u64) -> std::result::Result<Self, String> {
        let h = TableHeader::read_from_prefix(bytes)
            .map_err(|_| format!("{} bytes are too few for a table header", bytes.len()))?
            .0;
        if h.magic != TABLE_MAGIC || h.version != TABLE_VERSION {
            return Err(format!(
                "not an extent table of version {TABLE_VERSION} (magic {:#x}, version {})",
                h.magic, h.version
            ));
        }
        if usize::from(h.header_bytes) != TABLE_HEADER_SIZE
            || usize::from(h.file_entry_bytes) != TABLE_FILE_SIZE
            || usize::from(h.extent_entry_bytes) != TABLE_EXTENT_SIZE
            || !(9..=16).contains(&h.lba_shift)
        {
            return Err("a table header with other entry sizes or LBA size".into());
        }
        let files_end = (h.file_count as u64)
            .checked_mul(TABLE_FILE_SIZE as u64)
            .and_then(|n| n.checked_add(TABLE_HEADER_SIZE as u64));
        let total = h
            .extent_count
            .checked_mul(TABLE_EXTENT_SIZE as u64)
            .and_then(|n| n.checked_add(files_end?));
        if h.files_offset != TABLE_HEADER_SIZE as u64
            || Some(h.extents_offset) != files_end
            || Some(h.total_bytes) != total
            || h.total_bytes != bytes.len() as u64
        {
            return Err(format!(
                "a table whose offsets do not match its {} files, {} extents and {} bytes",
                h.file_count,
                h.extent_count,
                bytes.len()
            ));
        }
        let mut words = vec![0u64; bytes.len() / 8];
        words.as_mut_bytes().copy_from_slice(bytes);
        let table = Self { words };
        let lba = 1u64 << h.lba_shift;
        let extents = table.extents();
        for (i, f) in table.files().iter().enumerate() {
            let run = f
                .first_extent
                .checked_add(f.extent_count)
                .filter(|&end| end <= extents.len() as u64)
                .map(|end| &extents[f.first_extent as usize..end as usize])
                .ok_or_else(|| format!("file {i}'s extents lie outside the table"))?;
            let mut next = 0u64;
            for e in run {
                if e.nlb == 0 || e.file_lba != next {
                    return Err(format!(
                        "file {i}: an extent at file LBA {} (expected {next}) of {} LBAs",
                        e.file_lba, e.nlb
                    ));
                }
                if e.lba.checked_add(e.nlb).is_none_or(|end| end > max_lba) {
                    return Err(format!(
                        "file {i}: LBAs {}+{} are past the namespace's {max_lba}",
                        e.lba, e.nlb
                    ));
                }
                next = next
                    .checked_add(e.nlb)
                    .ok_or_else(|| format!("file {i}: its extents overflow"))?;
            }
            if next.checked_mul(lba) != Some(f.alloc_bytes) || f.size_bytes > f.alloc_bytes {
                return Err(format!(
                    "file {i}: {} bytes long, {} allocated, its extents cover {next} LBAs",
                    f.size_bytes, f.alloc_bytes
                ));
            }
        }
        Ok(table)
    }

    /// The table's bytes, exactly as a GPU kernel reads them.
    pub fn as_bytes(&self) -> &[u8] {
        self.words.as_bytes()
    }

    /// The header.
    pub fn header(&self) -> TableHeader {
        TableHeader::read_from_bytes(&self.as_bytes()[..TABLE_HEADER_SIZE])
            .expect("table built with a full header")
    }

    /// The file entries.
    pub fn files(&self) -> &[TableFile] {
        let h = self.header();
        let bytes = &self.as_bytes()[h.files_offset as usize..h.extents_offset as usize];
        <[TableFile]>::ref_from_bytes(bytes).expect("8-byte aligned whole entries")
    }

    /// All extents (each file's are at `first_extent..first_extent+extent_count`).
    pub fn extents(&self) -> &[TableExtent] {
        let h = self.header();
        let bytes = &self.as_bytes()[h.extents_offset as usize..h.total_bytes as usize];
        <[TableExtent]>::ref_from_bytes(bytes).expect("8-byte aligned whole entries")
    }

    /// Translates byte `offset` of file `file` (its index in the table) for a read, the way the
    /// GPU kernels do: at or past `size_bytes` is end of file (`None`); one extent is a direct
    /// computation; otherwise a binary search for the last extent whose `file_lba` is at most
    /// `offset >> lba_shift`. `contiguous_lbas` stops at the LBA holding the last byte of the file.
    pub fn translate(&self, file: usize, offset: u64) -> Option<Translation> {
        let f = self.files().get(file)?;
        let lba_shift = self.header().lba_shift;
        let eof_lba = f.size_bytes.div_ceil(1u64 << lba_shift);
        let mut t = self.lookup(f, offset, f.size_bytes)?;
        let flba = offset >> lba_shift;
        t.contiguous_lbas = t.contiguous_lbas.min(eof_lba - flba);
        Some(t)
    }

    /// Translates byte `offset` of file `file` for a device write: only in a table with
    /// [`TABLE_FILE_WRITABLE`], and only below `alloc_bytes` (past it is out of extent: `None`).
    /// `contiguous_lbas` runs to the end of the extent.
    pub fn translate_write(&self, file: usize, offset: u64) -> Option<Translation> {
        let f = self.files().get(file)?;
        if f.flags & TABLE_FILE_WRITABLE == 0 {
            return None;
        }
        self.lookup(f, offset, f.alloc_bytes)
    }

    /// The extent lookup shared by reads and writes: `offset` must be below `limit`.
    fn lookup(&self, f: &TableFile, offset: u64, limit: u64) -> Option<Translation> {
        if offset >= limit {
            return None;
        }
        let flba = offset >> self.header().lba_shift;
        let all = self.extents();
        let ext = all.get(f.first_extent as usize..(f.first_extent + f.extent_count) as usize)?;
        let (mut lo, mut hi) = (0usize, ext.len());
        // Invariant: ext[lo].file_lba <= flba < ext[hi].file_lba (hi = len means +inf).
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if ext[mid].file_lba <= flba {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let e = ext.get(lo)?;
        let within = flba.checked_sub(e.file_lba).filter(|&w| w < e.nlb)?;
        Some(Translation {
            lba: e.lba + within,
            contiguous_lbas: e.nlb - within,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Extent;
    use std::mem::offset_of;

    #[test]
    fn tables_from_bytes_are_checked_field_by_field() {
        let t = ExtentTable::of_runs(4096, 1, 20_000, &[(0, 100, 2), (2, 500, 3)]);
        let back = ExtentTable::from_bytes(t.as_bytes(), 600).unwrap();
        assert_eq!(back, t);
        assert!(
            ExtentTable::from_bytes(t.as_bytes(), 502).is_err(),
            "past the namespace"
        );
        assert!(ExtentTable::from_bytes(&t.as_bytes()[..40], 600).is_err());
        assert!(ExtentTable::from_bytes(&t.as_bytes()[..t.as_bytes().len() - 8], 600).is_err());
        // Every word of the table changed to a bad value is refused or still a valid table;
        // never a panic.
        let words = t.as_bytes().len() / 8;
        for w in 0..words {
            for v in [0u64, 1, u64::MAX, 1 << 40] {
                let mut b = t.as_bytes().to_vec();
                b[w * 8..w * 8 + 8].copy_from_slice(&v.to_le_bytes());
                if let Ok(ok) = ExtentTable::from_bytes(&b, 600) {
                    for f in 0..ok.files().len() {
                        let _ = ok.translate(f, 4096);
                    }
                }
            }
        }
        // A gap between extents, and a length past the allocation.
        let gap = ExtentTable::of_runs(4096, 1, 4096, &[(0, 100, 1), (2, 500, 1)]);
        assert!(ExtentTable::from_bytes(gap.as_bytes(), 600).is_err());
        let long = ExtentTable::of_runs(4096, 1, 9000, &[(0, 100, 2)]);
        assert!(ExtentTable::from_bytes(long.as_bytes(), 600).is_err());
    }

    #[test]
    fn offsets_match_exported_constants() {
        assert_eq!(
            offset_of!(TableHeader, lba_shift),
            TABLE_HEADER_LBA_SHIFT_OFFSET
        );
        assert_eq!(offset_of!(TableHeader, nsid), TABLE_HEADER_NSID_OFFSET);
        assert_eq!(
            offset_of!(TableHeader, file_count),
            TABLE_HEADER_FILE_COUNT_OFFSET
        );
        assert_eq!(
            offset_of!(TableHeader, extent_count),
            TABLE_HEADER_EXTENT_COUNT_OFFSET
        );
        assert_eq!(
            offset_of!(TableHeader, files_offset),
            TABLE_HEADER_FILES_OFFSET_OFFSET
        );
        assert_eq!(
            offset_of!(TableHeader, extents_offset),
            TABLE_HEADER_EXTENTS_OFFSET_OFFSET
        );
        assert_eq!(
            offset_of!(TableFile, size_bytes),
            TABLE_FILE_SIZE_BYTES_OFFSET
        );
        assert_eq!(
            offset_of!(TableFile, first_extent),
            TABLE_FILE_FIRST_EXTENT_OFFSET
        );
        assert_eq!(
            offset_of!(TableFile, extent_count),
            TABLE_FILE_EXTENT_COUNT_OFFSET
        );
        assert_eq!(
            offset_of!(TableExtent, file_lba),
            TABLE_EXTENT_FILE_LBA_OFFSET
        );
        assert_eq!(offset_of!(TableFile, file_id), TABLE_FILE_FILE_ID_OFFSET);
        assert_eq!(
            offset_of!(TableFile, alloc_bytes),
            TABLE_FILE_ALLOC_BYTES_OFFSET
        );
        assert_eq!(offset_of!(TableFile, flags), TABLE_FILE_FLAGS_OFFSET);
        assert_eq!(offset_of!(TableExtent, lba), TABLE_EXTENT_LBA_OFFSET);
        assert_eq!(offset_of!(TableExtent, nlb), TABLE_EXTENT_NLB_OFFSET);
    }

    #[test]
    fn builds_covers_allocation_and_translates() {
        // 4 KiB blocks, 512-byte LBAs: 8 LBAs per block.
        let a = ExtentList::from_vec(vec![Extent { bno: 10, len: 2 }, Extent { bno: 40, len: 3 }]);
        let b = ExtentList::from_vec(vec![Extent { bno: 100, len: 1 }]);
        let t = ExtentTable::build(
            512,
            1,
            8,
            &[
                TableInput {
                    file_id: 7,
                    size: 3 * 4096 + 1,
                    extents: &a,
                    flags: 0,
                },
                TableInput {
                    file_id: 8,
                    size: 0,
                    extents: &b,
                    flags: TABLE_FILE_WRITABLE,
                },
            ],
        );
        let h = t.header();
        assert_eq!(
            (
                h.magic,
                h.version,
                h.lba_shift,
                h.nsid,
                h.file_count,
                h.extent_count
            ),
            (TABLE_MAGIC, 2, 9, 1, 2, 3)
        );
        assert_eq!(h.total_bytes as usize, t.as_bytes().len());
        assert_eq!(t.as_bytes().len(), 64 + 2 * 48 + 3 * 24);
        // The whole allocation, preallocated blocks past end of file included.
        assert_eq!(
            t.extents(),
            &[
                TableExtent {
                    file_lba: 0,
                    lba: 80,
                    nlb: 16
                },
                TableExtent {
                    file_lba: 16,
                    lba: 320,
                    nlb: 24
                },
                TableExtent {
                    file_lba: 0,
                    lba: 800,
                    nlb: 8
                },
            ]
        );
        let f = t.files();
        assert_eq!(
            (f[0].size_bytes, f[0].alloc_bytes),
            (3 * 4096 + 1, 5 * 4096)
        );
        assert_eq!((f[1].size_bytes, f[1].alloc_bytes), (0, 4096));
        assert_eq!((f[1].first_extent, f[1].extent_count), (2, 1));
        assert_eq!(
            t.translate(0, 0),
            Some(Translation {
                lba: 80,
                contiguous_lbas: 16
            })
        );
        // Reads stop at the LBA holding the last byte.
        assert_eq!(
            t.translate(0, 2 * 4096 + 513),
            Some(Translation {
                lba: 321,
                contiguous_lbas: 8
            })
        );
        assert_eq!(
            t.translate(0, 3 * 4096),
            Some(Translation {
                lba: 320 + 8,
                contiguous_lbas: 1
            })
        );
        assert_eq!(t.translate(0, 3 * 4096 + 1), None);
        assert_eq!(t.translate(1, 0), None);
        assert_eq!(t.translate(2, 0), None);
        // Writes: only through a writable entry, up to the allocation.
        assert_eq!(t.translate_write(0, 0), None);
        assert_eq!(
            t.translate_write(1, 4095),
            Some(Translation {
                lba: 807,
                contiguous_lbas: 1
            })
        );
        assert_eq!(t.translate_write(1, 4096), None);
    }
}
