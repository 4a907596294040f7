//! blockfs files in the GPU page cache ([`GpuCache`]): [`bind_file`] makes a
//! file a cached range that kernels read (and, for a reservation, write) as a
//! `gpunvme::array<T>`; fills find a page's LBAs through the file's extent table in GPU memory
//! (`file_page_io` in `ptx/include/gpunvme_cache.cuh`). [`page_pieces`] is that function's Rust
//! twin, tested here against blockfs's own translation.
#![forbid(unsafe_code)]

use blockfs::table::ExtentTable;
use blockfs_gpu::{FilesError, GpuFile};

use crate::{GpuCache, RangeId, TableRange};

/// Binds `file` to `cache`: kernels reach it as range [`RangeId::index`]. A file opened for
/// reading is served up to its length (bytes past it in its last page read as zero); a
/// reservation ([`blockfs_gpu::GpuFiles::reserve`]) up to its allocation, and kernels may store into
/// it: dirty pages reach the device on eviction and on [`GpuCache::flush`]. The cache holds the
/// file's table (and so the pin on its blocks, or the reservation) until it is closed or
/// dropped; a reservation commits only after that. Between kernels only.
pub fn bind_file(cache: &mut GpuCache<'_>, file: &GpuFile) -> Result<RangeId, FilesError> {
    let writable = file.is_writable();
    let bytes = if writable {
        file.alloc_bytes()
    } else {
        file.size()
    };
    if bytes == 0 {
        return Err(FilesError::InvalidArgument(format!(
            "{}: an empty file has no pages to cache",
            file.name()
        )));
    }
    let h = file.table().header();
    let r = TableRange {
        table: file.table_ptr(),
        file: file.index(),
        nsid: h.nsid,
        lba_size: 1 << h.lba_shift,
        bytes,
        writable,
    };
    Ok(cache.bind_table(r, file.keep_alive())?)
}

/// One command of a page fill or write-back: `blocks` LBAs from device LBA `lba`, to or from
/// bytes `frame_offset..` of the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagePiece {
    /// First device LBA.
    pub lba: u64,
    /// LBAs the command moves.
    pub blocks: u64,
    /// Where its data starts in the frame.
    pub frame_offset: u64,
}

/// The commands that move page `page` of file `file` of `table` (cached with pages of
/// `page_size` bytes over its first `bytes` bytes; `writable`: through the write translation,
/// as a reservation is): one per run of contiguous LBAs, at most `max_blocks` each. The twin of
/// the device's `file_page_io`. An error for a page past `bytes` or a hole in the table.
pub fn page_pieces(
    table: &ExtentTable,
    file: u32,
    page_size: u32,
    bytes: u64,
    writable: bool,
    page: u64,
    max_blocks: u64,
) -> Result<Vec<PagePiece>, FilesError> {
    let lba_shift = table.header().lba_shift;
    let pos = page
        .checked_mul(page_size as u64)
        .filter(|&p| p < bytes)
        .ok_or_else(|| FilesError::InvalidArgument(format!("page {page} is past the range")))?;
    if max_blocks == 0 {
        return Err(FilesError::InvalidArgument("max_blocks 0".into()));
    }
    let end = (pos + page_size as u64).min(bytes);
    let mut pieces = Vec::new();
    let mut off = pos;
    while off < end {
        let t = if writable {
            table.translate_write(file as usize, off)
        } else {
            table.translate(file as usize, off)
        }
        .ok_or_else(|| {
            FilesError::InvalidArgument(format!("file {file}: byte {off} is in no extent"))
        })?;
        let n = (end - off)
            .div_ceil(1 << lba_shift)
            .min(t.contiguous_lbas)
            .min(max_blocks);
        pieces.push(PagePiece {
            lba: t.lba,
            blocks: n,
            frame_offset: off - pos,
        });
        off += n << lba_shift;
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{Lcg, fragmented};
    use blockfs::{FileSystem, MemDevice, OpenMode};

    /// Runs page `page`'s pieces against `dev` as a fill does: the frame after the read, with
    /// the bytes past the range zeroed.
    fn fill(dev: &MemDevice, t: &ExtentTable, ps: u32, bytes: u64, w: bool, page: u64) -> Vec<u8> {
        let lsize = 1u64 << t.header().lba_shift;
        let mut frame = vec![0xa5u8; ps as usize];
        let pieces = page_pieces(t, 0, ps, bytes, w, page, 5).expect("pieces");
        for p in &pieces {
            let at = p.frame_offset as usize;
            dev.load(
                p.lba * lsize,
                &mut frame[at..at + (p.blocks * lsize) as usize],
            );
        }
        let end = (bytes - page * ps as u64).min(ps as u64) as usize;
        frame[end..].fill(0);
        frame
    }

    #[test]
    fn every_page_of_a_fragmented_file_fills_with_its_bytes_and_zeros_past_the_end() {
        for lba in [512u32, 4096] {
            let len = 200_000 + 77;
            let (dev, fs, data) = fragmented(lba, len);
            let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            let table = file.extent_table().expect("table");
            assert!(table.extents().len() > 3, "fragmented");
            for ps in [4096u32, 16384, 65536] {
                let npages = (len as u64).div_ceil(ps as u64);
                let mut split = 0;
                for page in 0..npages {
                    split += (page_pieces(&table, 0, ps, len as u64, false, page, 1 << 20)
                        .expect("pieces")
                        .len()
                        > 1) as u32;
                    let frame = fill(&dev, &table, ps, len as u64, false, page);
                    let at = (page * ps as u64) as usize;
                    let n = (len - at).min(ps as usize);
                    assert!(frame[..n] == data[at..at + n], "lba {lba} page {ps}/{page}");
                    assert!(frame[n..].iter().all(|&b| b == 0), "tail {lba} {ps}/{page}");
                }
                // Extents are whole 4 KiB blocks: larger pages span them.
                assert_eq!(split > 0, ps > 4096, "{ps}-byte pages split (lba {lba})");
                assert!(page_pieces(&table, 0, ps, len as u64, false, npages, 8).is_err());
            }
        }
    }

    #[test]
    fn pages_written_through_a_reservation_read_back_after_remount() {
        for lba in [512u32, 4096] {
            let (dev, fs, mut data) = fragmented(lba, 30_000 + 5);
            let file = fs.open("dir/a", OpenMode::ReadWrite).expect("open");
            let new_len = 150_000u64 + 3;
            let dw = file.reserve_device_write(new_len).expect("reserve");
            let table = dw.table().clone();
            let alloc = dw.allocated();
            let lsize = lba as u64;
            let ps = 16384u32;
            // Write-back of every page over the allocation: the old bytes with a new value
            // every 97 bytes (the frame after a fill, then stores).
            data.resize(alloc as usize, 0);
            let mut g = Lcg(lba as u64);
            for page in 0..alloc.div_ceil(ps as u64) {
                let mut frame = fill(&dev, &table, ps, alloc, true, page);
                let at = (page * ps as u64) as usize;
                let n = (alloc as usize - at).min(ps as usize);
                frame[..n].copy_from_slice(&data[at..at + n]);
                for i in (0..n).step_by(97) {
                    frame[i] = g.next() as u8;
                }
                data[at..at + n].copy_from_slice(&frame[..n]);
                for p in page_pieces(&table, 0, ps, alloc, true, page, 3).expect("pieces") {
                    let off = p.frame_offset as usize;
                    dev.store(
                        p.lba * lsize,
                        &frame[off..off + (p.blocks * lsize) as usize],
                    );
                }
            }
            // Read translation of a reservation's new bytes: past the length, refused.
            assert!(page_pieces(&table, 0, ps, alloc, false, alloc / ps as u64 - 1, 8).is_err());
            dw.commit(new_len).expect("commit");
            fs.sync().expect("sync");
            drop(file);
            fs.unmount().expect("unmount");
            let fs = FileSystem::mount(dev.clone()).expect("remount");
            let f = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            let mut back = vec![0u8; new_len as usize];
            assert_eq!(f.read_at(0, &mut back).expect("read"), new_len as usize);
            assert!(back[..] == data[..new_len as usize], "lba {lba}");
        }
    }
}
