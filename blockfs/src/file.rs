//! Open files: reads and writes of file data, mapped to device LBAs through the extent list.
//!
//! Data moves between the caller's buffers and the device directly for every whole LBA; only
//! the partial LBAs at the ends of a request go through a small bounce buffer (read-modify-write
//! for writes). Each call issues one batch to the device, which keeps it many commands deep.
//! [`File::write_from`] takes its bytes from a [`DataSource`] instead of a buffer, and
//! [`File::read_to`] hands them to a [`DataSink`]: the device moves them command by command
//! while the batch runs ([`crate::BlockDevice::write_from`], [`crate::BlockDevice::read_into`]).
//!
//! Bytes between the old end of file and a write that starts past it, and bytes added by
//! [`File::set_len`], read as zeroes: they are written as zeroes (NVMe Write Zeroes for whole
//! LBAs) before the size grows, so a file never exposes what its blocks held before it owned
//! them. The one exception is a device-write commit ([`File::reserve_device_write`]), where
//! the caller vouches that the device wrote those bytes.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::device::{DataSink, DataSource, ReadReq, SinkReadReq, SourceWriteReq, WriteReq};
use crate::device_write::DeviceWrite;
use crate::error::{DeviceResultExt, Error, Result};
use crate::extents::ExtentList;
use crate::format::{FLAG_DATA_CRC, FLAG_DEVICE_WRITTEN, MAX_FILE_SIZE};
use crate::pin::PinnedTable;
use crate::state::{FileStat, Inner, State};
use crate::table::TableInput;

/// How a file is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Reads only; writes, resizes and allocations fail with [`Error::ReadOnly`].
    ReadOnly,
    /// Reads and writes.
    ReadWrite,
}

/// An open file. Handles are independent of each other and may be used from several threads;
/// they stay valid across renames, and fail with [`Error::Removed`] once the file is removed.
pub struct File {
    inner: Arc<Inner>,
    id: u64,
    name: String,
    mode: OpenMode,
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("File")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("mode", &self.mode)
            .finish()
    }
}

/// Device runs `(first LBA, LBAs)` holding file LBAs `file_lba..file_lba+n`.
fn lba_runs(ext: &ExtentList, spb: u64, file_lba: u64, n: u64) -> Vec<(u64, u64)> {
    let fb = file_lba / spb;
    let mut skip = file_lba % spb;
    let blocks = (skip + n).div_ceil(spb);
    let mut left = n;
    let mut out = Vec::new();
    for (bno, len) in ext.runs(fb, blocks) {
        let k = (len * spb - skip).min(left);
        out.push((bno * spb + skip, k));
        left -= k;
        skip = 0;
    }
    debug_assert_eq!(left, 0, "file LBAs {file_lba}+{n} not allocated");
    out
}

/// How one request's bytes split into whole LBAs and partial ones.
enum Seg {
    /// Whole LBAs read straight into the caller's buffer.
    Direct { file_lba: u64, lbas: u64 },
    /// Part of one LBA: `len` bytes starting `skip` bytes into it.
    Partial {
        file_lba: u64,
        skip: usize,
        len: usize,
    },
}

impl File {
    pub(crate) fn new(inner: Arc<Inner>, id: u64, name: String, mode: OpenMode) -> Self {
        Self {
            inner,
            id,
            name,
            mode,
        }
    }

    /// The name the file was opened under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file's unique id.
    pub fn file_id(&self) -> u64 {
        self.id
    }

    /// How the file was opened.
    pub fn mode(&self) -> OpenMode {
        self.mode
    }

    /// Current size in bytes.
    pub fn len(&self) -> Result<u64> {
        Ok(self.inner.read_state().inode(self.id, &self.name)?.size)
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Current metadata.
    pub fn stat(&self) -> Result<FileStat> {
        Ok(self
            .inner
            .read_state()
            .inode(self.id, &self.name)?
            .stat(self.inner.geo.block_size))
    }

    /// Reads up to `buf.len()` bytes at `offset`. Returns the bytes read: fewer than asked at
    /// end of file (a short read), 0 at or past it.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<usize> {
        Ok(self.read_vectored_at(&mut [(offset, buf)])?[0])
    }

    /// Reads many `(offset, buffer)` pairs in one device batch. Returns the bytes read for each,
    /// with [`File::read_at`]'s end-of-file rule.
    pub fn read_vectored_at(&self, reqs: &mut [(u64, &mut [u8])]) -> Result<Vec<usize>> {
        let st = self.inner.read_state();
        let inode = st.inode(self.id, &self.name)?;
        let geo = &self.inner.geo;
        let l = geo.lba_size as u64;
        let spb = geo.lbas_per_block();
        let size = inode.size;

        let mut counts = Vec::with_capacity(reqs.len());
        let mut plans: Vec<Vec<Seg>> = Vec::with_capacity(reqs.len());
        let mut partials = 0usize;
        for (off, buf) in reqs.iter() {
            let n = if *off >= size {
                0
            } else {
                (buf.len() as u64).min(size - off)
            };
            counts.push(n as usize);
            let mut plan = Vec::new();
            let (mut pos, end) = (*off, off + n);
            while pos < end {
                let in_lba = pos % l;
                if in_lba != 0 || end - pos < l {
                    let len = (l - in_lba).min(end - pos);
                    plan.push(Seg::Partial {
                        file_lba: pos / l,
                        skip: in_lba as usize,
                        len: len as usize,
                    });
                    partials += 1;
                    pos += len;
                } else {
                    let lbas = (end - pos) / l;
                    plan.push(Seg::Direct {
                        file_lba: pos / l,
                        lbas,
                    });
                    pos += lbas * l;
                }
            }
            plans.push(plan);
        }

        let mut temp = vec![0u8; partials * l as usize];
        let mut dreqs: Vec<ReadReq<'_>> = Vec::new();
        let mut temp_chunks = temp.chunks_mut(l as usize);
        for ((_, buf), plan) in reqs.iter_mut().zip(&plans) {
            let mut rest: &mut [u8] = buf;
            for seg in plan {
                match *seg {
                    Seg::Direct { file_lba, lbas } => {
                        let (mut head, tail) =
                            std::mem::take(&mut rest).split_at_mut((lbas * l) as usize);
                        rest = tail;
                        for (lba, n) in lba_runs(&inode.extents, spb, file_lba, lbas) {
                            let (a, b) = std::mem::take(&mut head).split_at_mut((n * l) as usize);
                            dreqs.push(ReadReq { lba, buf: a });
                            head = b;
                        }
                    }
                    Seg::Partial { file_lba, len, .. } => {
                        rest = &mut std::mem::take(&mut rest)[len..];
                        let chunk = temp_chunks.next().expect("one temp LBA per partial");
                        let lba = lba_runs(&inode.extents, spb, file_lba, 1)[0].0;
                        dreqs.push(ReadReq { lba, buf: chunk });
                    }
                }
            }
        }
        self.inner
            .dev
            .read(&mut dreqs)
            .during("reading file data")?;
        drop(dreqs);

        let mut ti = 0usize;
        for ((_, buf), plan) in reqs.iter_mut().zip(&plans) {
            let mut pos = 0usize;
            for seg in plan {
                match *seg {
                    Seg::Direct { lbas, .. } => pos += (lbas * l) as usize,
                    Seg::Partial { skip, len, .. } => {
                        let src = &temp[ti * l as usize + skip..][..len];
                        buf[pos..pos + len].copy_from_slice(src);
                        pos += len;
                        ti += 1;
                    }
                }
            }
        }
        Ok(counts)
    }

    /// Copies up to `len` file bytes from `offset` on (a short copy at end of file, none at or
    /// past it) to `sink` from byte `dst_offset` on, and returns how many were copied. One
    /// device batch moves every whole LBA: each command's bytes go to the sink from the device
    /// lane that completed it ([`crate::BlockDevice::read_into`]), so writing the destination
    /// overlaps reading the file and no buffer of the whole range is needed. The partial LBAs
    /// at the ends go through a small bounce buffer. `progress` is called, from any thread,
    /// with the byte count of each part as it reaches the sink. A failed sink write fails with
    /// [`Error::WriteSink`].
    pub fn read_to(
        &self,
        offset: u64,
        len: u64,
        sink: &dyn DataSink,
        dst_offset: u64,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<u64> {
        let st = self.inner.read_state();
        let inode = st.inode(self.id, &self.name)?;
        let geo = &self.inner.geo;
        let (l, spb) = (geo.lba_size as u64, geo.lbas_per_block());
        let n = len.min(inode.size.saturating_sub(offset));
        if n == 0 {
            return Ok(0);
        }
        let end = offset + n;
        // Whole file LBAs `first..last` go straight to the sink; the bytes before `first` and
        // after `last` (partial LBAs, or all of a range inside one LBA) go through `edges`.
        let (first, last) = (offset.div_ceil(l), end / l);
        let mut edges: Vec<std::ops::Range<u64>> = Vec::with_capacity(2);
        if first > last {
            edges.push(offset..end);
        } else {
            if offset < first * l {
                edges.push(offset..first * l);
            }
            if last * l < end {
                edges.push(last * l..end);
            }
        }
        let mut bounce = vec![0u8; edges.len() * l as usize];
        let mut reqs: Vec<ReadReq<'_>> = edges
            .iter()
            .zip(bounce.chunks_mut(l as usize))
            .map(|(r, buf)| ReadReq {
                lba: lba_runs(&inode.extents, spb, r.start / l, 1)[0].0,
                buf,
            })
            .collect();
        self.inner.dev.read(&mut reqs).during("reading file data")?;
        drop(reqs);
        for (r, buf) in edges.iter().zip(bounce.chunks(l as usize)) {
            let bytes = &buf[(r.start % l) as usize..][..(r.end - r.start) as usize];
            let at = dst_offset + (r.start - offset);
            sink.write_all_at(bytes, at)
                .map_err(|source| Error::WriteSink { offset: at, source })?;
            progress(bytes.len() as u64);
        }
        if first < last {
            let mut at = dst_offset + (first * l - offset);
            let mut whole = Vec::new();
            for (lba, k) in lba_runs(&inode.extents, spb, first, last - first) {
                let len = (k * l) as usize;
                whole.push(SinkReadReq {
                    lba,
                    dst_offset: at,
                    len,
                });
                at += len as u64;
            }
            self.inner
                .dev
                .read_into(&whole, sink, progress)
                .during("reading file data")?;
        }
        Ok(n)
    }

    fn check_writable(&self) -> Result<()> {
        match self.mode {
            OpenMode::ReadOnly => Err(Error::ReadOnly(self.name.clone())),
            OpenMode::ReadWrite => Ok(()),
        }
    }

    /// The state, locked for a change to this file: fails if the file system is poisoned, the
    /// file was removed, or it was made immutable after this handle was opened.
    fn lock_for_change(&self) -> Result<std::sync::RwLockWriteGuard<'_, State>> {
        self.inner.lock_for_change(self.id, &self.name)
    }

    /// Writes all of `data` at `offset`, growing the file (and its allocation) as needed. A
    /// write starting past the end of file zero-fills the gap. A write that fails at the
    /// device ([`Error::Device`]) puts the in-memory state back to the medium's last commit,
    /// dropping every change not yet synced (as [`crate::FileSystem::sync`] does when it
    /// fails): what is listed stays what is on the medium.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_writable()?;
        let mut st = self.lock_for_change()?;
        let r = write_range(
            &self.inner,
            &mut st,
            self.id,
            offset,
            Data::Slice(data),
            true,
        );
        self.inner.undo_on_device_error(&mut st, r)
    }

    /// Writes source bytes `src_range` at `offset` (a copy of part of a host file, say), with
    /// [`File::write_at`]'s rules, in one device batch: the device reads each command's bytes
    /// from `src` just before issuing it ([`crate::BlockDevice::write_from`]), so reading the
    /// source overlaps writing it and no buffer of the whole range is needed. `progress` is
    /// called, from any thread, with the byte count of each part as it reaches the device;
    /// the counts add up to the range's length when the call succeeds.
    ///
    /// Like every change, the call holds the file system's metadata lock for its whole
    /// duration: split a long copy into several calls where other threads need the file system
    /// meanwhile. A failed or short source read fails with [`Error::ReadSource`] and leaves the
    /// size as it was.
    pub fn write_from(
        &self,
        offset: u64,
        src: &dyn DataSource,
        src_range: std::ops::Range<u64>,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        self.check_writable()?;
        let len = src_range.end.saturating_sub(src_range.start);
        let mut st = self.lock_for_change()?;
        let data = Data::Source {
            src,
            start: src_range.start,
            len,
            progress,
        };
        let r = write_range(&self.inner, &mut st, self.id, offset, data, true);
        self.inner.undo_on_device_error(&mut st, r)
    }

    /// Sets the size. Growing zero-fills and allocates exactly what is needed; shrinking frees
    /// every block past the new end (preallocation included).
    pub fn set_len(&self, len: u64) -> Result<()> {
        self.check_writable()?;
        if len > MAX_FILE_SIZE {
            return Err(Error::TooLarge(len));
        }
        let mut st = self.lock_for_change()?;
        let size = st.inode(self.id, &self.name)?.size;
        if len > size {
            let r = write_range(&self.inner, &mut st, self.id, len, Data::Slice(&[]), false);
            self.inner.undo_on_device_error(&mut st, r)
        } else {
            if len < size {
                let bs = self.inner.geo.block_size as u64;
                st.content_changed(self.id);
                st.truncate_blocks(self.id, len.div_ceil(bs));
                let inode = st.inode_mut(self.id, &self.name)?;
                inode.size = len;
                if len == 0 {
                    // No byte a device wrote is left.
                    inode.flags &= !FLAG_DEVICE_WRITTEN;
                }
                st.touch(self.id);
            }
            Ok(())
        }
    }

    /// Makes sure at least `len` bytes are allocated without changing the size (fallocate with
    /// KEEP_SIZE): later writes up to `len` need no allocation and stay in few extents.
    pub fn allocate(&self, len: u64) -> Result<()> {
        self.check_writable()?;
        if len > MAX_FILE_SIZE {
            return Err(Error::TooLarge(len));
        }
        let mut st = self.lock_for_change()?;
        let bs = self.inner.geo.block_size;
        st.ensure_allocated(self.id, len.div_ceil(bs as u64), bs, false)
    }

    /// The file's GPU extent table (see [`crate::table`]), a snapshot of its current extents:
    /// its whole allocation (`alloc_bytes`, preallocation included) and its length
    /// (`size_bytes`, where reads stop). Read-only: it has no
    /// [`crate::table::TABLE_FILE_WRITABLE`] (device writes go through
    /// [`File::reserve_device_write`]). The blocks it names are pinned until it is dropped: a
    /// removal or truncation of the file meanwhile does not let them be reused.
    ///
    /// Reads through it do not check the file's data checksum ([`File::set_data_crc`]); a
    /// caller that needs that checks [`crate::FileSystem::verify_data`] separately.
    pub fn extent_table(&self) -> Result<PinnedTable> {
        let st = self.inner.read_state();
        let i = st.inode(self.id, &self.name)?;
        Ok(self.inner.pinned_table(&[TableInput {
            file_id: i.id,
            size: i.size,
            extents: &i.extents,
            flags: 0,
        }]))
    }

    /// Reserves the file for device writes up to `len` bytes: allocates what is missing
    /// (nothing if the file already has `len` bytes allocated, by a size hint or
    /// [`File::allocate`]) and hands out a [`DeviceWrite`] whose table the device (a GPU kernel)
    /// writes through, up to the whole allocation. Nothing about the file's length or
    /// contents changes until [`DeviceWrite::commit`]; see `DeviceWrite` for the sequence.
    pub fn reserve_device_write(&self, len: u64) -> Result<DeviceWrite> {
        self.check_writable()?;
        DeviceWrite::reserve(&self.inner, self.id, &self.name, len)
    }

    /// Records `crc`, the CRC-32C of the file's bytes `0..len` as the caller wrote them (for
    /// instance through a [`crate::ChecksummedSource`]), in its metadata with the next sync.
    /// Readers can then check what they read ([`crate::FileSystem::verify_data`], `gpunvme fs
    /// get`). Any later change to the bytes or the size forgets it.
    pub fn set_data_crc(&self, crc: u32) -> Result<()> {
        self.check_writable()?;
        let mut st = self.lock_for_change()?;
        let inode = st.inode_mut(self.id, &self.name)?;
        if inode.flags & FLAG_DATA_CRC == 0 || inode.data_crc != crc {
            inode.flags = (inode.flags | FLAG_DATA_CRC) & !FLAG_DEVICE_WRITTEN;
            inode.data_crc = crc;
            st.touch(self.id);
        }
        Ok(())
    }

    /// Syncs the whole file system (see [`crate::FileSystem::sync`]).
    pub fn sync(&self) -> Result<()> {
        let mut st = self.inner.write_state();
        let r = crate::commit::sync_locked(&self.inner, &mut st);
        self.inner.undo_on_device_error(&mut st, r)
    }
}

/// The bytes of a write.
#[derive(Clone, Copy)]
enum Data<'a> {
    /// In memory.
    Slice(&'a [u8]),
    /// `len` bytes of `src` from `start` on; `progress` hears of each part written.
    Source {
        src: &'a dyn DataSource,
        start: u64,
        len: u64,
        progress: &'a (dyn Fn(u64) + Sync),
    },
}

impl Data<'_> {
    fn len(&self) -> u64 {
        match self {
            Data::Slice(d) => d.len() as u64,
            Data::Source { len, .. } => *len,
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies data bytes `at..at + buf.len()` into `buf`.
    fn copy_to(&self, at: u64, buf: &mut [u8]) -> Result<()> {
        match *self {
            Data::Slice(d) => {
                buf.copy_from_slice(&d[at as usize..][..buf.len()]);
                Ok(())
            }
            Data::Source { src, start, .. } => {
                src.read_exact_at(buf, start + at)
                    .map_err(|source| Error::ReadSource {
                        offset: start + at,
                        source,
                    })
            }
        }
    }
}

/// Writes `data` at `offset` into file `id`, zero-filling from the old end of file up to
/// `offset`; the size becomes at least `offset + data.len()`.
fn write_range(
    inner: &Inner,
    st: &mut State,
    id: u64,
    offset: u64,
    data: Data<'_>,
    speculative: bool,
) -> Result<()> {
    let end = offset
        .checked_add(data.len())
        .filter(|&e| e <= MAX_FILE_SIZE)
        .ok_or(Error::TooLarge(offset.saturating_add(data.len())))?;
    let geo = &inner.geo;
    let (l, spb, bs) = (geo.lba_size as u64, geo.lbas_per_block(), geo.block_size);
    let old = st.inodes[&id].size;
    let new_size = old.max(end);
    st.ensure_allocated(id, new_size.div_ceil(bs as u64), bs, speculative)?;
    if new_size == old && data.is_empty() {
        return Ok(());
    }
    st.content_changed(id);

    // Which file LBAs get what: runs of zeroes, one run of whole data LBAs, and partial LBAs
    // composed in a bounce buffer.
    let mut composed: BTreeSet<u64> = BTreeSet::new();
    let mut zero_runs: Vec<(u64, u64)> = Vec::new();
    if offset > old {
        let (g0, g1) = (old / l, offset.div_ceil(l));
        let (mut a, mut b) = (g0, g1);
        if old % l != 0 {
            composed.insert(g0);
            a = g0 + 1;
        }
        if offset % l != 0 && g1 > a {
            composed.insert(g1 - 1);
            b = g1 - 1;
        }
        if b > a {
            zero_runs.push((a, b - a));
        }
    }
    let mut data_run: Option<(u64, u64)> = None;
    if !data.is_empty() {
        let (h, last) = (offset / l, (end - 1) / l);
        let (mut a, mut b) = (h, last + 1);
        if offset % l != 0 {
            composed.insert(h);
            a = h + 1;
        }
        if end % l != 0 && last >= a {
            composed.insert(last);
            b = last;
        }
        if b > a {
            data_run = Some((a, b - a));
        }
    }

    let inode = &st.inodes[&id];
    let ext = &inode.extents;
    let composed: Vec<u64> = composed.into_iter().collect();
    let mut bounce = vec![0u8; composed.len() * l as usize];
    {
        let mut reads: Vec<ReadReq<'_>> = composed
            .iter()
            .zip(bounce.chunks_mut(l as usize))
            .filter(|(c, _)| **c * l < old)
            .map(|(&c, buf)| ReadReq {
                lba: lba_runs(ext, spb, c, 1)[0].0,
                buf,
            })
            .collect();
        if !reads.is_empty() {
            inner
                .dev
                .read(&mut reads)
                .during("reading partial blocks before a write")?;
        }
    }
    for (&c, buf) in composed.iter().zip(bounce.chunks_mut(l as usize)) {
        let start = c * l;
        let keep = old.saturating_sub(start).min(l) as usize;
        buf[keep..].fill(0);
        let (ds, de) = (start.max(offset), (start + l).min(end));
        if ds < de {
            data.copy_to(
                ds - offset,
                &mut buf[(ds - start) as usize..(de - start) as usize],
            )?;
        }
    }
    let mut writes: Vec<WriteReq<'_>> = composed
        .iter()
        .zip(bounce.chunks(l as usize))
        .map(|(&c, buf)| WriteReq {
            lba: lba_runs(ext, spb, c, 1)[0].0,
            buf,
        })
        .collect();
    // The whole data LBAs: straight from the caller's slice, or read from the source by the
    // device as it issues the commands.
    let mut from_source: Vec<SourceWriteReq> = Vec::new();
    let mut run_bytes = 0u64;
    if let Some((first, n)) = data_run {
        let mut at = first * l - offset;
        run_bytes = n * l;
        for (lba, k) in lba_runs(ext, spb, first, n) {
            let len = (k * l) as usize;
            match data {
                Data::Slice(d) => writes.push(WriteReq {
                    lba,
                    buf: &d[at as usize..][..len],
                }),
                Data::Source { start, .. } => from_source.push(SourceWriteReq {
                    lba,
                    src_offset: start + at,
                    len,
                }),
            }
            at += len as u64;
        }
    }
    let io = (|| -> Result<()> {
        if !writes.is_empty() {
            inner.dev.write(&writes).during("writing file data")?;
        }
        if let Data::Source {
            src, len, progress, ..
        } = data
        {
            // The partial LBAs' share of the data went out with `writes`.
            if len > run_bytes {
                progress(len - run_bytes);
            }
            if !from_source.is_empty() {
                inner
                    .dev
                    .write_from(&from_source, src, progress)
                    .during("writing file data")?;
            }
        }
        for (first, n) in zero_runs {
            for (lba, k) in lba_runs(ext, spb, first, n) {
                inner
                    .dev
                    .write_zeroes(lba, k)
                    .during("zero-filling a file")?;
            }
        }
        Ok(())
    })();
    drop(writes);
    st.data_dirty = true;
    io?;
    if new_size != old {
        st.inodes.get_mut(&id).expect("checked by the caller").size = new_size;
        st.touch(id);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::{CrashDevice, CreateOptions, FileSystem, MemDevice, MkfsOptions};

    /// Byte `i` of the test source.
    fn byte(i: u64) -> u8 {
        (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
    }

    fn source(len: usize) -> Vec<u8> {
        (0..len as u64).map(byte).collect()
    }

    /// A source whose reads fail from byte `bad` on.
    struct Failing {
        data: Vec<u8>,
        bad: u64,
    }

    impl DataSource for Failing {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            if offset + buf.len() as u64 > self.bad {
                return Err(std::io::Error::other("injected source failure"));
            }
            self.data.read_exact_at(buf, offset)
        }
    }

    fn read_all(f: &File) -> Vec<u8> {
        let mut out = vec![0u8; f.len().unwrap() as usize];
        assert_eq!(f.read_at(0, &mut out).unwrap(), out.len());
        out
    }

    #[test]
    fn write_from_matches_write_at_at_any_alignment() {
        let src = source(9 << 20);
        for lba in [512u32, 4096] {
            let dev = Arc::new(MemDevice::new(lba, (64 << 20) / lba as u64));
            let fs = FileSystem::mkfs(dev, &MkfsOptions::default()).unwrap();
            // (file offset, source range): aligned, partial head and tail, inside one LBA, a
            // gap past the end of file, an overwrite, and several stages of the default
            // `write_from`.
            let cases: &[(u64, std::ops::Range<u64>)] = &[
                (0, 0..8192),
                (100, 7..5000),
                (3, 10..20),
                (70_000, 123..300_001),
                (50, 0..40_000),
                (1 << 20, 1000..(9 << 20)),
                (17, 5..5),
            ];
            let f = fs.create("f", &CreateOptions::default()).unwrap();
            let mut model: Vec<u8> = Vec::new();
            for (off, range) in cases {
                let seen = AtomicU64::new(0);
                f.write_from(*off, &src, range.clone(), &|n| {
                    seen.fetch_add(n, Ordering::Relaxed);
                })
                .unwrap();
                assert_eq!(seen.into_inner(), range.end - range.start, "progress");
                let (o, s, e) = (*off as usize, range.start as usize, range.end as usize);
                if model.len() < o + e - s {
                    model.resize(o + e - s, 0);
                }
                model[o..o + e - s].copy_from_slice(&src[s..e]);
                assert_eq!(f.len().unwrap(), model.len() as u64);
                assert!(read_all(&f) == model, "lba {lba}: after {off} {range:?}");
            }
            fs.sync().unwrap();
        }
    }

    /// A sink whose writes touching byte `bad` fail.
    struct FailingSink {
        bad: u64,
    }

    impl DataSink for FailingSink {
        fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            if (offset..offset + buf.len() as u64).contains(&self.bad) {
                return Err(std::io::Error::other("injected sink failure"));
            }
            Ok(())
        }
    }

    #[test]
    fn read_to_matches_read_at_at_any_alignment() {
        let size = (9 << 20) + 777;
        let src = source(size);
        for lba in [512u32, 4096] {
            let dev = Arc::new(MemDevice::new(lba, (64 << 20) / lba as u64));
            let fs = FileSystem::mkfs(dev, &MkfsOptions::default()).unwrap();
            let f = fs.create("f", &CreateOptions::default()).unwrap();
            f.write_at(0, &src).unwrap();
            let size = size as u64;
            // (file offset, length, destination offset): everything, partial head and tail,
            // inside one LBA, ending exactly on an LBA boundary, several stages of the default
            // `read_into`, short at end of file, at and past end of file, empty.
            let cases: &[(u64, u64, u64)] = &[
                (0, size, 0),
                (100, 5000, 3),
                (3, 10, 0),
                (7, 8192 - 7, 1 << 20),
                (70_000, 300_001, 11),
                (1 << 20, 9 << 20, 0),
                (size - 10, 100, 5),
                (size, 10, 0),
                (size + 5, 10, 0),
                (17, 0, 0),
            ];
            for &(off, len, dst) in cases {
                let sink = std::sync::Mutex::new(Vec::new());
                let seen = AtomicU64::new(0);
                let n = f
                    .read_to(off, len, &sink, dst, &|k| {
                        seen.fetch_add(k, Ordering::Relaxed);
                    })
                    .unwrap();
                let want = len.min(size.saturating_sub(off));
                assert_eq!(n, want, "lba {lba}: {off} {len}");
                assert_eq!(seen.into_inner(), n, "progress");
                let got = sink.into_inner().unwrap();
                if n == 0 {
                    assert!(got.is_empty());
                    continue;
                }
                assert_eq!(got.len() as u64, dst + n);
                assert!(got[..dst as usize].iter().all(|&b| b == 0));
                assert!(
                    got[dst as usize..] == src[off as usize..(off + n) as usize],
                    "lba {lba}: {off} {len} {dst}"
                );
            }
        }
    }

    #[test]
    fn a_failed_sink_write_is_a_sink_error() {
        let dev = Arc::new(MemDevice::new(512, 1 << 16));
        let fs = FileSystem::mkfs(dev, &MkfsOptions::default()).unwrap();
        let f = fs.create("f", &CreateOptions::default()).unwrap();
        f.write_at(0, &source(1 << 20)).unwrap();
        // In the whole LBAs, and in the partial head.
        for (off, bad) in [(0u64, 300_000u64), (5, 100)] {
            let e = f
                .read_to(off, 1 << 20, &FailingSink { bad }, 0, &|_| {})
                .unwrap_err();
            match &e {
                Error::WriteSink { offset, source } => {
                    assert!(*offset <= bad, "{e}");
                    assert_eq!(source.kind(), ErrorKind::Other);
                }
                _ => panic!("{e}"),
            }
        }
    }

    #[test]
    fn failed_or_short_sources_leave_the_size_alone() {
        let dev = Arc::new(MemDevice::new(512, 1 << 16));
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let f = fs.create("f", &CreateOptions::default()).unwrap();
        f.write_at(0, b"kept").unwrap();
        let src = source(1 << 20);
        // The source ends before the range does: a short read (reported at the start of the
        // read that came up short).
        let e = f.write_from(4, &src, 0..(2 << 20), &|_| {}).unwrap_err();
        match &e {
            Error::ReadSource { offset, source } => {
                assert_eq!(source.kind(), ErrorKind::UnexpectedEof);
                assert!(*offset < 2 << 20, "{e}");
            }
            _ => panic!("{e}"),
        }
        // A read error in the middle of the whole LBAs and one in the partial tail.
        for bad in [300_000u64, (1 << 20) - 10] {
            let failing = Failing {
                data: src.clone(),
                bad,
            };
            let e = f
                .write_from(4, &failing, 0..(1 << 20), &|_| {})
                .unwrap_err();
            assert!(
                matches!(&e, Error::ReadSource { source, .. } if source.kind() == ErrorKind::Other),
                "{e}"
            );
            assert_eq!(f.len().unwrap(), 4);
        }
        assert_eq!(read_all(&f), b"kept");
        // Read-only handles refuse, as for write_at.
        let ro = fs.open("f", OpenMode::ReadOnly).unwrap();
        assert!(matches!(
            ro.write_from(0, &src, 0..10, &|_| {}),
            Err(Error::ReadOnly(_))
        ));
        fs.sync().unwrap();
        drop((f, ro, fs));
        let fs = FileSystem::mount(dev).unwrap();
        let f = fs.open("f", OpenMode::ReadOnly).unwrap();
        assert_eq!(read_all(&f), b"kept");
    }

    /// A power cut anywhere in a `write_from` and the sync after it mounts the file either as
    /// it was synced before or with every byte written.
    #[test]
    fn write_from_then_sync_is_crash_consistent() {
        let dev = Arc::new(CrashDevice::new(MemDevice::new(512, (64 << 20) / 512)));
        let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).unwrap();
        let f = fs.create("f", &CreateOptions::default()).unwrap();
        f.write_at(0, &[7u8; 1000]).unwrap();
        fs.sync().unwrap();
        let base = dev.start_recording();
        // Several device writes from the source (stages of the default write_from), a partial
        // head LBA, and a partial tail.
        let src = source(10 << 20);
        f.write_from(1000, &src, 3..(9 << 20) + 77, &|_| {})
            .unwrap();
        fs.sync().unwrap();
        let log = dev.take_log();
        let writes = log
            .iter()
            .filter(|op| matches!(op, crate::LoggedOp::Write { .. }))
            .count();
        assert!(writes >= 4, "{writes} writes logged");
        let mut new = vec![7u8; 1000];
        new.extend_from_slice(&src[3..(9 << 20) + 77]);
        let mut saw_new = false;
        for cut in 0..=log.len() {
            let image = Arc::new(CrashDevice::replay(&base, &log[..cut]));
            let fs = FileSystem::mount(image.clone()).unwrap();
            let got = read_all(&fs.open("f", OpenMode::ReadOnly).unwrap());
            if got.len() == 1000 {
                assert_eq!(got, vec![7u8; 1000], "cut after {cut} ops");
            } else {
                assert!(got == new, "cut after {cut} ops: {} bytes", got.len());
                saw_new = true;
            }
            drop(fs);
            let report = crate::fsck(image, &crate::FsckOptions::default()).unwrap();
            assert!(
                report.is_clean(),
                "cut after {cut} ops: {:?}",
                report.problems
            );
        }
        assert!(saw_new);
    }
}
