//! The device algorithm's Rust twins: how a byte range of a file is cut into chunks and pieces
//! ([`plan_piece`], [`plan_range`], [`chunk_count`], [`chunk_of`]), CRC-32C combining
//! (`crc32c_*`), and the plan of a batch of ranges ([`plan_batch`]). Each is the twin of the
//! device function of the same name in `ptx/include/gpunvme_file.cuh` (or the file kernel), so
//! the algorithm is tested here, where there is no GPU.
#![forbid(unsafe_code)]

use blockfs::table::{ExtentTable, TABLE_FILE_WRITABLE};
use gpu_queues::{DeviceStatus, GpuBuffer};

use crate::desc::{
    CRC32C_COMBINE_THREADS, CRC32C_POLY, FileIo, PIECE_BOUNCE, PIECE_DIRECT, PIECE_RMW,
};
use crate::error::FilesError;

/// How a piece moves (`GPUNVME_PIECE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceKind {
    /// Whole LBAs straight between the device and the caller's GPU memory.
    Direct,
    /// Through the slot buffer of the command's ticket.
    Bounce,
    /// A write's partial LBA: read, overlay, write (two commands).
    Rmw,
}

impl PieceKind {
    /// The device code.
    pub fn code(self) -> u32 {
        match self {
            Self::Direct => PIECE_DIRECT,
            Self::Bounce => PIECE_BOUNCE,
            Self::Rmw => PIECE_RMW,
        }
    }
}

/// One command's worth of a file range (`gpunvme::fs::piece`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// File offset of its first byte.
    pub pos: u64,
    /// First device LBA.
    pub lba: u64,
    /// LBAs the command moves.
    pub blocks: u32,
    /// Bytes of the range it covers.
    pub bytes: u32,
    /// Where those bytes start in its first LBA.
    pub skip: u32,
    /// How it moves.
    pub kind: PieceKind,
}

/// The piece of `[pos, end)` of file `file` of `table` that starts at `pos`
/// (`gpunvme::fs::plan_piece`): `aligned` says whether the GPU address of byte `pos` is 4-byte
/// aligned, `max_blocks` is LBAs per command, `bounce_blocks` LBAs per slot buffer. Reads use
/// blockfs's [`ExtentTable::translate`] (stops at the length), writes
/// [`ExtentTable::translate_write`] (writable tables, up to the allocation); both are the
/// device's `lookup`. Past either: [`DeviceStatus::OutOfExtent`].
#[allow(clippy::too_many_arguments)]
pub fn plan_piece(
    table: &ExtentTable,
    file: usize,
    write: bool,
    pos: u64,
    end: u64,
    aligned: bool,
    max_blocks: u32,
    bounce_blocks: u32,
) -> Result<Piece, DeviceStatus> {
    if pos >= end {
        return Err(DeviceStatus::InvalidArgument);
    }
    let tr = if write {
        table.translate_write(file, pos)
    } else {
        table.translate(file, pos)
    }
    .ok_or(DeviceStatus::OutOfExtent)?;
    let shift = table.header().lba_shift;
    let lsize = 1u64 << shift;
    let skip = (pos & (lsize - 1)) as u32;
    let left = end - pos;
    if skip != 0 || left < lsize {
        return Ok(Piece {
            pos,
            lba: tr.lba,
            blocks: 1,
            bytes: (lsize - skip as u64).min(left) as u32,
            skip,
            kind: if write {
                PieceKind::Rmw
            } else {
                PieceKind::Bounce
            },
        });
    }
    let cap = if aligned { max_blocks } else { bounce_blocks };
    let n = (left >> shift).min(tr.contiguous_lbas).min(cap as u64);
    if n == 0 {
        return Err(DeviceStatus::InvalidArgument);
    }
    Ok(Piece {
        pos,
        lba: tr.lba,
        blocks: n as u32,
        bytes: (n << shift) as u32,
        skip: 0,
        kind: if aligned {
            PieceKind::Direct
        } else {
            PieceKind::Bounce
        },
    })
}

/// Every piece of `[start, end)` in order, as `rw_file_thread` / `rw_file_warp` issue them for
/// a range whose memory starts at device address `bus` (an RMW piece is one entry here and two
/// commands there). The same checks as the device: the range must be readable (below the
/// length) or writable (a writable table, below the allocation), and a bounce must fit a slot
/// buffer.
#[allow(clippy::too_many_arguments)]
pub fn plan_range(
    table: &ExtentTable,
    file: usize,
    write: bool,
    start: u64,
    end: u64,
    bus: u64,
    max_blocks: u32,
    bounce_blocks: u32,
) -> Result<Vec<Piece>, DeviceStatus> {
    let f = table
        .files()
        .get(file)
        .ok_or(DeviceStatus::InvalidArgument)?;
    let limit = if write { f.alloc_bytes } else { f.size_bytes };
    if (write && f.flags & TABLE_FILE_WRITABLE == 0) || end > limit {
        return Err(DeviceStatus::OutOfExtent);
    }
    if max_blocks == 0 {
        return Err(DeviceStatus::InvalidArgument);
    }
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        let aligned = (bus + (pos - start)) & 3 == 0;
        let p = plan_piece(
            table,
            file,
            write,
            pos,
            end,
            aligned,
            max_blocks,
            bounce_blocks,
        )?;
        if p.kind != PieceKind::Direct && p.blocks > bounce_blocks {
            return Err(DeviceStatus::InvalidArgument);
        }
        pos += p.bytes as u64;
        out.push(p);
    }
    Ok(out)
}

/// Chunks of `[offset, offset + len)` cut at multiples of `chunk_bytes` of the file offset
/// (0 for an empty range).
pub fn chunk_count(offset: u64, len: u64, chunk_bytes: u32) -> u64 {
    if len == 0 {
        return 0;
    }
    let c = chunk_bytes as u64;
    (offset + len - 1) / c - offset / c + 1
}

/// Chunk `k` of `[offset, offset + len)`: its byte range (`gpunvme::fs::chunk_of`).
pub fn chunk_of(offset: u64, len: u64, chunk_bytes: u32, k: u64) -> (u64, u64) {
    let c = chunk_bytes as u64;
    let s = (offset / c + k) * c;
    (s.max(offset), (s + c).min(offset + len))
}

/// The chunks warp `warp` of `warps` takes in a round of the batch file kernel that starts at
/// chunk `start` and holds `n` chunks (at most 32 per warp): `start + lo .. start + hi`
/// (`gpunvme::fs::warp_span`), cut evenly (counts differ by at most one).
pub fn warp_span(start: u64, n: u64, warps: u64, warp: u64) -> (u64, u64) {
    (start + warp * n / warps, start + (warp + 1) * n / warps)
}

/// The device LBA runs `(first LBA, LBAs)` holding bytes `0..size_bytes` of file `index` of
/// `table`, in file order (its preallocation past the end left out): what a whole read of the
/// file will ask the controller for ([`crate::GpuFiles::will_read`]).
pub fn read_runs(table: &ExtentTable, index: usize) -> Vec<(u64, u64)> {
    let Some(f) = table.files().get(index) else {
        return Vec::new();
    };
    let lba_bytes = 1u64 << table.header().lba_shift;
    let eof_lba = f.size_bytes.div_ceil(lba_bytes);
    let first = usize::try_from(f.first_extent).unwrap_or(usize::MAX);
    let count = usize::try_from(f.extent_count).unwrap_or(0);
    table
        .extents()
        .iter()
        .skip(first)
        .take(count)
        .filter(|e| e.file_lba < eof_lba)
        .map(|e| (e.lba, e.nlb.min(eof_lba - e.file_lba)))
        .collect()
}

/// How many chunks a warp of the batch file kernel claims when it saw `seen` of `total` chunks
/// claimed, `warps` warps claiming (`gpunvme::fs::claim_size`): a warp's share of what is left,
/// at least `least` (1 to 32) and at most 32. The sight may be stale (the kernel's read of
/// the counter is relaxed); the fetch_add that takes the claim hands every chunk out once.
pub fn claim_size(total: u64, seen: u64, warps: u64, least: u64) -> u64 {
    let left = total.saturating_sub(seen);
    (left / warps.max(1)).clamp(least.clamp(1, 32), 32)
}

/// How many warps the batch file kernel runs for `chunks` chunks on `queues` queues, at most
/// `max_warps` (warp mode; [`warp_span`] spreads the chunks): enough for 32 chunks each, rounded
/// up to a multiple of the queue count (warp `w` uses queue `w % queues`, so every queue gets
/// the same number of warps and, the chunks being spread, the same work), but never more than
/// `max_warps` or than there are chunks.
pub fn file_warps(chunks: u64, queues: u32, max_warps: u32) -> u32 {
    let max = max_warps.max(1) as u64;
    let need = chunks.div_ceil(32).max(1);
    if need >= max || queues == 0 {
        return need.min(max) as u32;
    }
    let q = queues as u64;
    need.div_ceil(q)
        .saturating_mul(q)
        .min(max)
        .min(chunks.max(1)) as u32
}

/// `a * b` modulo the CRC-32C polynomial, reflected (`crc32c_multmodp`).
pub fn crc32c_multmodp(a: u32, mut b: u32) -> u32 {
    if a == 0 {
        return 0;
    }
    let mut m = 1u32 << 31;
    let mut p = 0;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 {
            (b >> 1) ^ CRC32C_POLY
        } else {
            b >> 1
        };
    }
    p
}

/// `x^(8n)` modulo the polynomial (`crc32c_x8n`).
pub fn crc32c_x8n(mut n: u64) -> u32 {
    let mut p = 1u32 << 31;
    let mut sq = 1u32 << 23;
    while n != 0 {
        if n & 1 != 0 {
            p = crc32c_multmodp(sq, p);
        }
        sq = crc32c_multmodp(sq, sq);
        n >>= 1;
    }
    p
}

/// The CRC-32C of `A || B` from `crc(A)`, `crc(B)` and `|B|` (`crc32c_combine`).
pub fn crc32c_combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    crc32c_multmodp(crc32c_x8n(len_b), crc_a) ^ crc_b
}

/// CRC-32C of `data` the way the GPU computes it: segments of `seg` bytes, each checksummed
/// alone, folded into runs the way the combining kernel's threads fold them, then a tree.
pub fn crc32c_segmented(data: &[u8], seg: u32) -> u32 {
    let crcs: Vec<u32> = data.chunks(seg as usize).map(crc32c_of).collect();
    combine_segments(&crcs, seg, data.len() as u64, CRC32C_COMBINE_THREADS)
}

/// The combining kernel's arithmetic (`gpunvme_crc32c_combine` with `threads` threads).
fn combine_segments(crcs: &[u32], seg: u32, len: u64, threads: u32) -> u32 {
    let nseg = crcs.len() as u64;
    let per = nseg.div_ceil(threads as u64);
    let mut run: Vec<(u32, u64)> = (0..threads as u64)
        .map(|t| {
            let (first, last) = ((t * per).min(nseg), ((t + 1) * per).min(nseg));
            let mut c = 0u32;
            let mut b = 0u64;
            for i in first..last {
                let n = (len - i * seg as u64).min(seg as u64);
                c = crc32c_multmodp(crc32c_x8n(n), c) ^ crcs[i as usize];
                b += n;
            }
            (c, b)
        })
        .collect();
    let mut stride = 1usize;
    while stride < run.len() {
        for t in (0..run.len()).step_by(2 * stride) {
            if t + stride < run.len() {
                let (r, rb) = run[t + stride];
                run[t] = (crc32c_combine(run[t].0, r, rb), run[t].1 + rb);
            }
        }
        stride *= 2;
    }
    run.first().map_or(0, |r| r.0)
}

/// Plain bytewise CRC-32C (the device's `crc32c_bytes`).
fn crc32c_of(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ CRC32C_POLY
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// Where a transfer's bytes are in GPU memory: a GPU pointer and the device address the
/// controller reaches it at (from a [`GpuBuffer`], whose memory is registered for the
/// controller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuSpan {
    /// GPU pointer of the first byte.
    pub ptr: u64,
    /// Its device (bus) address.
    pub bus: u64,
    /// Bytes.
    pub len: u64,
}

impl GpuSpan {
    /// Bytes `offset..offset + len` of `buf`.
    pub fn of(buf: &GpuBuffer, offset: u64, len: u64) -> Result<Self, FilesError> {
        match offset.checked_add(len) {
            Some(end) if end <= buf.len() as u64 => Ok(Self {
                ptr: buf.ptr() + offset,
                bus: buf.bus() + offset,
                len,
            }),
            _ => Err(FilesError::InvalidArgument(format!(
                "GPU buffer bytes {offset}..{} outside its {} bytes",
                offset.saturating_add(len),
                buf.len()
            ))),
        }
    }

    /// The whole of `buf`.
    pub fn all(buf: &GpuBuffer) -> Self {
        Self {
            ptr: buf.ptr(),
            bus: buf.bus(),
            len: buf.len() as u64,
        }
    }
}

/// One range of a batch as the planner sees it (what a [`FileRange`] says, with its file's
/// table entry).
#[derive(Clone, Debug)]
pub struct RangeSpec {
    /// The file's name (for errors).
    pub name: String,
    /// GPU pointer of its table.
    pub table_ptr: u64,
    /// Its index in the table.
    pub index: u32,
    /// Its table entry.
    pub entry: blockfs::table::TableFile,
    /// The table's log2 LBA size.
    pub lba_shift: u32,
    /// Write (else read).
    pub write: bool,
    /// First byte of the file.
    pub offset: u64,
    /// The GPU memory.
    pub span: GpuSpan,
}

/// A batch as the kernel gets it.
#[derive(Clone, Debug)]
pub struct BatchPlan {
    /// The kernel's ranges, in the caller's order; `scratch` is 1 + the index of the range's
    /// first scratch LBA (4 KiB apart) or 0, made a pointer once the scratch exists.
    pub ios: Vec<FileIo>,
    /// Each range's file name.
    pub names: Vec<String>,
    /// Bytes each range moves (reads clamped at the length).
    pub lens: Vec<u64>,
    /// Scratch LBAs the writes need (two per write with a partial LBA).
    pub scratch_lbas: u64,
    /// Chunks in all.
    pub chunks: u64,
}

/// Plans a batch: clamps reads at each file's length (like `pread`), refuses ranges past what
/// a file allows (writes: a writable table, below the allocation), counts each range's chunks
/// (prefix sums in `first_chunk`: the kernel finds a chunk's range by binary search, see
/// [`range_of_chunk`]) and gives scratch to writes with a partial LBA.
pub fn plan_batch(ranges: &[RangeSpec], chunk_bytes: u32) -> Result<BatchPlan, FilesError> {
    let mut plan = BatchPlan {
        ios: Vec::with_capacity(ranges.len()),
        names: Vec::with_capacity(ranges.len()),
        lens: Vec::with_capacity(ranges.len()),
        scratch_lbas: 0,
        chunks: 0,
    };
    for r in ranges {
        let f = &r.entry;
        let lsize = 1u64 << r.lba_shift;
        let out_of_file = |limit, what| FilesError::OutOfFile {
            name: r.name.clone(),
            offset: r.offset,
            end: r.offset.saturating_add(r.span.len),
            what,
            limit,
        };
        let (len, limit, what) = if r.write {
            if f.flags & TABLE_FILE_WRITABLE == 0 {
                return Err(out_of_file(0, "read-only table"));
            }
            (r.span.len, f.alloc_bytes, "allocation")
        } else {
            let len = r.span.len.min(f.size_bytes.saturating_sub(r.offset));
            (len, f.size_bytes, "length")
        };
        // A read at or past the end reads nothing (pread); anything else must fit.
        if (r.write || len > 0) && r.offset.checked_add(len).is_none_or(|e| e > limit) {
            return Err(out_of_file(limit, what));
        }
        let needs_scratch = r.write && len > 0 && (r.offset % lsize != 0 || len % lsize != 0);
        let scratch = if needs_scratch {
            plan.scratch_lbas += 2;
            plan.scratch_lbas - 1
        } else {
            0
        };
        plan.ios.push(FileIo {
            table: r.table_ptr,
            offset: r.offset,
            len,
            ptr: r.span.ptr,
            bus: r.span.bus,
            scratch,
            first_chunk: plan.chunks,
            file: r.index,
            write: r.write as u32,
            status: 0,
            nvme_status: 0,
        });
        plan.names.push(r.name.clone());
        plan.lens.push(len);
        plan.chunks += chunk_count(r.offset, len, chunk_bytes);
    }
    Ok(plan)
}

/// The range holding chunk `c` (the kernel's `file_chunk_setup`): the last whose
/// `first_chunk` is at most `c`.
pub fn range_of_chunk(ios: &[FileIo], c: u64) -> usize {
    let (mut lo, mut hi) = (0usize, ios.len());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if ios[mid].first_chunk <= c {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{Lcg, bytes, fragmented};
    use blockfs::{FileSystem, MemDevice, OpenMode};

    /// The device model: runs `pieces` of a range whose memory is `mem` (byte `start` of the
    /// file at mem[0]) against the blocks of `dev`, as the kernels do (bounce and RMW through a
    /// buffer of whole LBAs).
    fn execute(
        dev: &MemDevice,
        lsize: u64,
        write: bool,
        start: u64,
        pieces: &[Piece],
        mem: &mut [u8],
    ) {
        for p in pieces {
            let at = (p.pos - start) as usize;
            let n = p.bytes as usize;
            let dev_at = p.lba * lsize;
            match (p.kind, write) {
                (PieceKind::Direct, false) => dev.load(dev_at, &mut mem[at..at + n]),
                (PieceKind::Direct, true) => dev.store(dev_at, &mem[at..at + n]),
                (PieceKind::Bounce, false) => {
                    let mut buf = vec![0u8; p.blocks as usize * lsize as usize];
                    dev.load(dev_at, &mut buf);
                    let s = p.skip as usize;
                    mem[at..at + n].copy_from_slice(&buf[s..s + n]);
                }
                (PieceKind::Bounce, true) => {
                    assert_eq!(n as u64, p.blocks as u64 * lsize, "whole LBAs");
                    dev.store(dev_at, &mem[at..at + n]);
                }
                (PieceKind::Rmw, true) => {
                    let mut buf = vec![0u8; lsize as usize];
                    dev.load(dev_at, &mut buf);
                    let s = p.skip as usize;
                    buf[s..s + n].copy_from_slice(&mem[at..at + n]);
                    dev.store(dev_at, &buf);
                }
                (PieceKind::Rmw, false) => panic!("a read planned a read-modify-write"),
            }
        }
    }

    /// Plans `[offset, offset + len)` chunk by chunk as the batch kernel does, checks the
    /// pieces' invariants, and runs them.
    #[allow(clippy::too_many_arguments)]
    fn run_range(
        dev: &MemDevice,
        table: &ExtentTable,
        write: bool,
        offset: u64,
        mem: &mut [u8],
        bus: u64,
        chunk: u32,
        max_blocks: u32,
        bounce_blocks: u32,
    ) -> Result<(), DeviceStatus> {
        let len = mem.len() as u64;
        let shift = table.header().lba_shift;
        let lsize = 1u64 << shift;
        let end = offset + len;
        let mut covered = offset;
        for k in 0..chunk_count(offset, len, chunk) {
            let (cs, ce) = chunk_of(offset, len, chunk, k);
            assert_eq!(cs, covered, "chunks tile the range");
            assert!(ce > cs && (cs == offset || cs % chunk as u64 == 0));
            let pieces = plan_range(
                table,
                0,
                write,
                cs,
                ce,
                bus + (cs - offset),
                max_blocks,
                bounce_blocks,
            )?;
            let mut pos = cs;
            for p in &pieces {
                assert_eq!(p.pos, pos);
                assert!(p.bytes > 0 && p.blocks > 0);
                match p.kind {
                    PieceKind::Direct => {
                        assert!(p.blocks <= max_blocks && p.skip == 0);
                        assert_eq!((bus + (p.pos - offset)) & 3, 0, "PRPs need dword alignment");
                    }
                    PieceKind::Bounce => assert!(p.blocks <= bounce_blocks),
                    PieceKind::Rmw => {
                        assert!(write && p.blocks == 1);
                        // The scratch rule of the kernel: a partial head is in the first
                        // chunk (scratch LBA 0), a partial tail in the last (scratch LBA 1).
                        assert!(cs == offset || ce == end, "RMW in a middle chunk");
                    }
                }
                // One extent: the last LBA of the piece is where the table says.
                let last = p.pos + p.bytes as u64 - 1;
                let tr = if write {
                    table.translate_write(0, last)
                } else {
                    table.translate(0, last)
                }
                .expect("inside the file");
                assert_eq!(tr.lba, p.lba + ((last >> shift) - (p.pos >> shift)));
                pos += p.bytes as u64;
            }
            assert_eq!(pos, ce, "pieces tile the chunk");
            let at = (cs - offset) as usize;
            execute(
                dev,
                lsize,
                write,
                cs,
                &pieces,
                &mut mem[at..(ce - offset) as usize],
            );
            covered = ce;
        }
        assert_eq!(covered, end);
        Ok(())
    }

    #[test]
    fn reads_of_any_range_match_the_host() {
        for lba in [512u32, 4096] {
            let len = 300_000 + 123;
            let (dev, fs, data) = fragmented(lba, len);
            let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            let table = file.extent_table().expect("table");
            assert!(
                table.extents().len() > 3,
                "fragmented: {:?}",
                table.extents().len()
            );
            let mut g = Lcg(lba as u64);
            let mut cases: Vec<(u64, u64)> = vec![
                (0, len as u64),
                (1, len as u64 - 1),
                (0, 1),
                (len as u64 - 1, 1),
                (4095, 2),
                (511, 4097 * 3),
                (len as u64 - 700, 700),
            ];
            for _ in 0..60 {
                let off = g.below(len as u64);
                cases.push((off, 1 + g.below(len as u64 - off)));
            }
            for (i, &(off, n)) in cases.iter().enumerate() {
                let bus = 0x10_0000 + (i as u64 % 5); // misaligned addresses bounce
                let chunk = [4096u32, 8192, 65536, 1 << 20][i % 4];
                let (max_blocks, bounce) = [(3, 2), (256, 8), (64, 1)][i % 3];
                let mut got = vec![0u8; n as usize];
                run_range(
                    &dev, &table, false, off, &mut got, bus, chunk, max_blocks, bounce,
                )
                .unwrap_or_else(|e| panic!("{off}+{n}: {e}"));
                assert_eq!(
                    got,
                    &data[off as usize..(off + n) as usize],
                    "{off}+{n} lba {lba}"
                );
            }
            // Past the length: refused, whole or in part.
            let mut buf = vec![0u8; 2];
            assert_eq!(
                run_range(&dev, &table, false, len as u64 - 1, &mut buf, 0, 4096, 8, 8),
                Err(DeviceStatus::OutOfExtent)
            );
            // Through a read-only table, no writes.
            assert_eq!(
                plan_range(&table, 0, true, 0, 1, 0, 8, 8),
                Err(DeviceStatus::OutOfExtent)
            );
        }
    }

    #[test]
    fn writes_through_a_reservation_read_back_after_remount() {
        for lba in [512u32, 4096] {
            let (dev, fs, mut data) = fragmented(lba, 50_000 + 77);
            let file = fs.open("dir/a", OpenMode::ReadWrite).expect("open");
            let new_len = 200_000u64 + 5;
            let dw = file.reserve_device_write(new_len).expect("reserve");
            let table = dw.table().clone();
            let alloc = dw.allocated();
            assert!(alloc >= new_len);
            data.resize(new_len as usize, 0);
            let mut g = Lcg(7 + lba as u64);
            // The new tail in one go (unaligned end), then overwrites at odd places.
            let mut ranges: Vec<(u64, u64)> =
                vec![(50_000 + 77, new_len - 50_077), (0, 1), (4095, 3)];
            for _ in 0..40 {
                let off = g.below(new_len);
                ranges.push((off, 1 + g.below((new_len - off).min(40_000))));
            }
            for (i, &(off, n)) in ranges.iter().enumerate() {
                let mut src = bytes(i as u64 * 31 + 5, n as usize);
                let bus = 0x20_0000 + (i as u64 % 3);
                let chunk = [4096u32, 16384, 1 << 20][i % 3];
                run_range(&dev, &table, true, off, &mut src, bus, chunk, 5, 2)
                    .unwrap_or_else(|e| panic!("{off}+{n}: {e}"));
                data[off as usize..(off + n) as usize].copy_from_slice(&src);
            }
            // Past the allocation: refused.
            let mut one = [0u8; 1];
            assert_eq!(
                run_range(&dev, &table, true, alloc, &mut one, 0, 4096, 8, 8),
                Err(DeviceStatus::OutOfExtent)
            );
            dw.commit(new_len).expect("commit");
            fs.sync().expect("sync");
            drop(file);
            fs.unmount().expect("unmount");
            let fs = FileSystem::mount(dev.clone()).expect("remount");
            let f = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            assert_eq!(f.len().expect("len"), new_len);
            let mut back = vec![0u8; new_len as usize];
            assert_eq!(f.read_at(0, &mut back).expect("read"), new_len as usize);
            assert!(
                back == data,
                "lba {lba}: the CPU reads what the device model wrote"
            );
        }
    }

    #[test]
    fn batch_plan_counts_chunks_clamps_reads_and_gives_writes_scratch() {
        let entry = |size, alloc, flags| blockfs::table::TableFile {
            size_bytes: size,
            first_extent: 0,
            extent_count: 1,
            file_id: 1,
            alloc_bytes: alloc,
            flags,
            reserved: 0,
        };
        let spec = |name: &str, e, write, offset, len| RangeSpec {
            name: name.into(),
            table_ptr: 0x1000,
            index: 0,
            entry: e,
            lba_shift: 9,
            write,
            offset,
            span: GpuSpan {
                ptr: 0x9000,
                bus: 0x9000,
                len,
            },
        };
        let ro = entry(10_000, 12_288, 0);
        let rw = entry(0, 1 << 20, TABLE_FILE_WRITABLE);
        let plan = plan_batch(
            &[
                spec("a", ro, false, 0, 10_000),    // chunks 0..3 of 4096
                spec("a", ro, false, 9_000, 5_000), // clamped to 1000 bytes: 1 chunk
                spec("a", ro, false, 20_000, 10),   // past the end: 0 bytes
                spec("w", rw, true, 4096, 8192),    // aligned: no scratch, 2 chunks
                spec("w", rw, true, 100, 5000),     // partial head and tail: scratch
                spec("w", rw, true, 8192, 4096),    // 1 chunk
            ],
            4096,
        )
        .expect("plan");
        assert_eq!(plan.lens, vec![10_000, 1000, 0, 8192, 5000, 4096]);
        let firsts: Vec<u64> = plan.ios.iter().map(|i| i.first_chunk).collect();
        assert_eq!(firsts, vec![0, 3, 4, 4, 6, 8]);
        assert_eq!(plan.chunks, 9);
        let scratch: Vec<u64> = plan.ios.iter().map(|i| i.scratch).collect();
        assert_eq!(scratch, vec![0, 0, 0, 0, 1, 0]);
        assert_eq!(plan.scratch_lbas, 2);
        // The kernel's search never lands on the empty range.
        let owners: Vec<usize> = (0..plan.chunks)
            .map(|c| range_of_chunk(&plan.ios, c))
            .collect();
        assert_eq!(owners, vec![0, 0, 0, 1, 3, 3, 4, 4, 5]);
        // Refusals.
        assert!(matches!(
            plan_batch(&[spec("a", ro, true, 0, 1)], 4096),
            Err(FilesError::OutOfFile {
                what: "read-only table",
                ..
            })
        ));
        assert!(matches!(
            plan_batch(&[spec("w", rw, true, (1 << 20) - 1, 2)], 4096),
            Err(FilesError::OutOfFile {
                what: "allocation",
                ..
            })
        ));
    }

    #[test]
    fn chunks_tile_ranges() {
        assert_eq!(chunk_count(0, 0, 4096), 0);
        assert_eq!(chunk_count(0, 4096, 4096), 1);
        assert_eq!(chunk_count(1, 4096, 4096), 2);
        assert_eq!(chunk_of(1, 4096, 4096, 0), (1, 4096));
        assert_eq!(chunk_of(1, 4096, 4096, 1), (4096, 4097));
        assert_eq!(chunk_count(8191, 2, 4096), 2);
    }

    #[test]
    fn crc_combine_and_segments_match_crc32c() {
        let data = bytes(3, 200_003);
        for split in [0usize, 1, 7, 4096, 100_000, 200_003] {
            let (a, b) = data.split_at(split);
            assert_eq!(
                crc32c_combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64),
                crc32c::crc32c(&data),
                "split {split}"
            );
        }
        assert_eq!(crc32c_x8n(0), 1 << 31, "x^0 is the identity");
        for (len, seg) in [
            (0usize, 16u32),
            (1, 16),
            (15, 16),
            (200_003, 16),
            (200_003, 4096),
            (4096 * 1500 + 9, 4096),
        ] {
            let d = &data.repeat(len.div_ceil(data.len()).max(1))[..len];
            assert_eq!(
                crc32c_segmented(d, seg),
                crc32c::crc32c(d),
                "{len} bytes, {seg}-byte segments"
            );
        }
        // Fewer combining threads than segments (each thread folds a run).
        let crcs: Vec<u32> = data.chunks(64).map(crc32c_of).collect();
        assert_eq!(
            combine_segments(&crcs, 64, data.len() as u64, 7),
            crc32c::crc32c(&data)
        );
    }

    /// Runs the file kernel's warp-mode rounds (as `gpunvme_file_rw` does) and returns the
    /// chunks each queue was given; checks that every chunk is taken once and that no warp
    /// takes more than 32 in a round.
    fn queue_loads(chunks: u64, queues: u32, warps: u64) -> Vec<u64> {
        let mut seen = vec![0u8; chunks as usize];
        let mut per_queue = vec![0u64; queues as usize];
        let mut start = 0;
        while start < chunks {
            let n = (chunks - start).min(32 * warps);
            for w in 0..warps {
                let (lo, hi) = warp_span(start, n, warps, w);
                assert!(lo <= hi && hi - lo <= 32, "warp {w}: {lo}..{hi}");
                assert!(lo >= start && hi <= start + n, "warp {w} leaves its round");
                for c in lo..hi {
                    seen[c as usize] += 1;
                }
                per_queue[(w % queues as u64) as usize] += hi - lo;
            }
            start += 32 * warps;
        }
        assert!(
            seen.iter().all(|&k| k == 1),
            "every chunk taken exactly once"
        );
        per_queue
    }

    #[test]
    fn read_runs_cover_the_file_s_lbas_in_order_and_stop_at_its_end() {
        for lba in [512u32, 4096] {
            let len = 300_001;
            let (_dev, fs, _) = crate::testutil::fragmented(lba, len);
            let f = fs.open("dir/a", blockfs::OpenMode::ReadOnly).unwrap();
            let pinned = f.extent_table().unwrap();
            let t = pinned.table();
            let runs = read_runs(t, 0);
            assert!(runs.len() > 1, "a fragmented file: {runs:?}");
            // Run by run, the LBAs the table translates each file LBA to, and nothing more.
            let want: Vec<u64> = (0..(len as u64).div_ceil(lba as u64))
                .map(|k| t.translate(0, k * lba as u64).unwrap().lba)
                .collect();
            let got: Vec<u64> = runs.iter().flat_map(|&(l, n)| l..l + n).collect();
            assert_eq!(got, want);
            assert!(read_runs(t, 1).is_empty(), "no such file");
        }
    }

    #[test]
    fn claims_hand_out_every_chunk_once_and_shrink_as_the_batch_ends() {
        // The kernel's loop on one counter: each warp in turn sees the counter as it was one
        // claim ago (a stale read), sizes its claim, takes it with a fetch_add.
        for (total, warps, least) in [(9095u64, 96u64, 4u64), (102_817, 96, 4), (700, 8, 1)] {
            let (mut counter, mut before) = (0u64, 0u64);
            let mut taken = vec![0u8; total as usize];
            let mut sizes = Vec::new();
            'claiming: loop {
                for _ in 0..warps {
                    let n = claim_size(total, before, warps, least);
                    assert!((least..=32).contains(&n), "{n}");
                    before = counter;
                    let got = counter;
                    counter += n;
                    if got >= total {
                        break 'claiming;
                    }
                    for c in got..(got + n).min(total) {
                        taken[c as usize] += 1;
                    }
                    sizes.push(n);
                }
            }
            assert!(taken.iter().all(|&t| t == 1), "every chunk once");
            assert_eq!(sizes[0], 32, "a large batch starts with whole claims");
            // The last claim of every warp is small: at most one warp holds more than `least`.
            let tail = &sizes[sizes.len() - warps as usize..];
            assert!(tail.iter().filter(|&&n| n > least).count() <= 1, "{tail:?}");
        }
        assert_eq!(
            claim_size(100, 200, 4, 0),
            1,
            "past the end, at least one (then none left)"
        );
        assert_eq!(claim_size(1 << 40, 0, 0, 64), 32);
    }

    #[test]
    fn warp_spans_cover_every_chunk_once_and_balance_queues() {
        let spread = |l: &[u64]| l.iter().max().unwrap() - l.iter().min().unwrap();
        // A Qwen3-0.6B-shaped load: 9,095 chunks of 128 KiB, 63 queues of 256 entries.
        let w = file_warps(9095, 63, 63 * 8);
        assert_eq!(w, 315, "5 warps per queue (not the 285 of 32 chunks each)");
        let even = queue_loads(9095, 63, w as u64);
        assert!(spread(&even) <= 5, "within a chunk per warp: {even:?}");
        // Several rounds (capped warps), small batches, more queues than chunks.
        for (chunks, queues, max) in [
            (102_817u64, 63u32, 504u32),
            (1, 63, 504),
            (10, 63, 504),
            (64, 7, 4096),
            (5000, 16, 40),
            (33, 1, 1),
        ] {
            let w = file_warps(chunks, queues, max);
            assert!(w >= 1 && w <= max, "{chunks} chunks: {w} warps");
            assert!(w as u64 <= chunks.max(1));
            let loads = queue_loads(chunks, queues, w as u64);
            assert_eq!(loads.iter().sum::<u64>(), chunks);
            if (w as u64) % queues as u64 == 0 {
                let per = w as u64 / queues as u64;
                assert!(spread(&loads) <= per, "{chunks} on {queues}: {loads:?}");
            }
        }
    }
}
