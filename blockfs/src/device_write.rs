//! Device-write reservations: a file's blocks handed to a device (a GPU kernel) to write
//! through an extent table, then committed as the file's new length without the zero fill a
//! host-side growth does.
//!
//! The sequence is [`crate::File::reserve_device_write`] (allocate up to a target length, or
//! reuse what the file has, and hand out a writable, pinned table), device writes through the
//! table (any byte below the table's `alloc_bytes`; whole LBAs, so a write that starts inside
//! the LBA holding the old end of file reads it first), then [`DeviceWrite::commit`] (the new
//! length, marked device-written) or [`DeviceWrite::commit_with_crc`] (the new length with a
//! checksum the device computed), then [`crate::FileSystem::sync`], whose commit flushes what
//! the device wrote before the new length reaches the medium. A crash before that sync
//! completes mounts the old length; after it, the new one.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::extents::ExtentList;
use crate::format::{FLAG_DATA_CRC, FLAG_DEVICE_WRITTEN, MAX_FILE_SIZE};
use crate::pin::PinnedTable;
use crate::state::Inner;
use crate::table::{ExtentTable, TABLE_FILE_WRITABLE, TableInput};

/// A reservation of a file's blocks for device writes (see the module docs of
/// `device_write`, and [`crate::File::reserve_device_write`]).
///
/// Its table (one file, [`crate::table::TABLE_FILE_WRITABLE`] set) stays pinned until the
/// reservation is committed or dropped; dropping it without committing leaves the file's
/// length and contents' metadata as they were (the allocation stays). Whatever the device
/// wrote past the old end of file is then unreachable until something writes there again.
///
/// The host and the device share the file meanwhile without coordination: a host write past
/// the end of file or a growing `set_len` zero-fills the bytes between the length and where it
/// writes, over whatever the device put there, and a truncation makes the commit fail with
/// [`Error::ReservationStale`]. Leave the file's length to the reservation until it commits.
pub struct DeviceWrite {
    inner: Arc<Inner>,
    id: u64,
    name: String,
    /// The file's extents when the reservation was made.
    extents: ExtentList,
    table: PinnedTable,
}

impl std::fmt::Debug for DeviceWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceWrite")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("allocated", &self.allocated())
            .finish()
    }
}

impl DeviceWrite {
    /// Allocates file `id` (opened as `name`) up to `len` bytes (nothing if it has that much
    /// already) and hands out a writable table of its whole allocation.
    pub(crate) fn reserve(inner: &Arc<Inner>, id: u64, name: &str, len: u64) -> Result<Self> {
        if len > MAX_FILE_SIZE {
            return Err(Error::TooLarge(len));
        }
        let mut st = inner.lock_for_change(id, name)?;
        let bs = inner.geo.block_size;
        st.ensure_allocated(id, len.div_ceil(bs as u64), bs, false)?;
        let inode = st.inode(id, name)?;
        let table = inner.pinned_table(&[TableInput {
            file_id: id,
            size: inode.size,
            extents: &inode.extents,
            flags: TABLE_FILE_WRITABLE,
        }]);
        Ok(Self {
            inner: inner.clone(),
            id,
            name: name.to_owned(),
            extents: inode.extents.clone(),
            table,
        })
    }

    /// The table the device writes through: file 0, `size_bytes` the length when reserved,
    /// `alloc_bytes` how far it may write.
    pub fn table(&self) -> &ExtentTable {
        &self.table
    }

    /// Bytes the device may write (the file's allocation when reserved).
    pub fn allocated(&self) -> u64 {
        self.table.files()[0].alloc_bytes
    }

    /// The file's id.
    pub fn file_id(&self) -> u64 {
        self.id
    }

    /// Makes `len` the file's length, after the device finished writing: no byte is zero
    /// filled or touched, the data is marked dirty (the next sync flushes it before committing
    /// the length) and the file is marked device-written: its data checksum is absent
    /// ([`crate::FileStat::device_written`], FORMAT.md "Data checksums").
    ///
    /// The caller vouches that the device wrote every byte between the file's length and
    /// `len` (bytes the device did not write read as whatever the blocks held before). `len`
    /// may be below the current length: the file shrinks, keeping its allocation. Fails with
    /// [`Error::BeyondReservation`] past [`DeviceWrite::allocated`], with
    /// [`Error::ReservationStale`] if the file's blocks below `len` changed since the
    /// reservation (a truncation in between), and as any change does for a removed, immutable
    /// or poisoned file; on failure the length stays as it was.
    pub fn commit(self, len: u64) -> Result<()> {
        self.commit_inner(len, None)
    }

    /// [`DeviceWrite::commit`] with `crc`, the CRC-32C of the file's bytes `0..len` that the
    /// device computed as it wrote (or the host computed by reading them back): recorded as the
    /// file's data checksum, so readers check it as they do for host writes.
    pub fn commit_with_crc(self, len: u64, crc: u32) -> Result<()> {
        self.commit_inner(len, Some(crc))
    }

    fn commit_inner(self, len: u64, crc: Option<u32>) -> Result<()> {
        let allocated = self.allocated();
        if len > allocated {
            return Err(Error::BeyondReservation {
                name: self.name.clone(),
                len,
                allocated,
            });
        }
        let mut st = self.inner.lock_for_change(self.id, &self.name)?;
        let blocks = len.div_ceil(self.inner.geo.block_size as u64);
        let inode = st.inode_mut(self.id, &self.name)?;
        if inode.extents.blocks() < blocks
            || !inode
                .extents
                .runs(0, blocks)
                .eq(self.extents.runs(0, blocks))
        {
            return Err(Error::ReservationStale(self.name.clone()));
        }
        inode.size = len;
        match crc {
            Some(crc) => {
                inode.flags = (inode.flags | FLAG_DATA_CRC) & !FLAG_DEVICE_WRITTEN;
                inode.data_crc = crc;
            }
            None => {
                inode.flags = (inode.flags | FLAG_DEVICE_WRITTEN) & !FLAG_DATA_CRC;
                inode.data_crc = 0;
            }
        }
        st.data_dirty = true;
        st.touch(self.id);
        Ok(())
    }
}
