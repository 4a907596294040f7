//! The structs the file layer shares with its device code, byte for byte: `#[repr(C)]` mirrors
//! of the file kernel's parameters (`ptx/kernels/gpunvme_kernels.cu`) and the numbers of
//! `ptx/include/gpunvme_file.cuh`, checked against them and against blockfs's extent-table
//! layout by the tests below.
#![forbid(unsafe_code)]

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The file layer's device header (extent tables, file ranges, CRC-32C), as committed.
pub use gpu_queues::desc::FILE_CUH;

/// One byte range of one file for the batched file kernel (`file_io` in ptx/kernels/gpunvme_kernels.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FileIo {
    /// GPU pointer of the file's extent table (blockfs layout).
    pub table: u64,
    /// First byte of the file.
    pub offset: u64,
    /// Bytes (nonzero).
    pub len: u64,
    /// GPU pointer of the memory for byte `offset`.
    pub ptr: u64,
    /// Its device address (for PRPs).
    pub bus: u64,
    /// GPU pointer of two LBAs of scratch for a write's partial head and tail (0: none).
    pub scratch: u64,
    /// Chunks of the ranges before this one in the batch.
    pub first_chunk: u64,
    /// Index of the file in its table.
    pub file: u32,
    /// 1: write the memory into the file; 0: read.
    pub write: u32,
    /// Out: 0, or the first failure's [`gpu_queues::DeviceStatus`] code.
    pub status: u32,
    /// Out: the CQE status field of an NVMe error.
    pub nvme_status: u32,
}
const _: () = assert!(size_of::<FileIo>() == 72);

/// Parameters of the batched file kernel (`file_params`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FileParams {
    /// GPU pointer: `[gpu_queues::QueueDesc; nqueues]`.
    pub queues: u64,
    /// GPU pointer: `[FileIo; nios]`.
    pub ios: u64,
    /// Chunks of all ranges together.
    pub total_chunks: u64,
    /// Queues.
    pub nqueues: u32,
    /// Ranges.
    pub nios: u32,
    /// Chunk size in bytes (a multiple of 4096).
    pub chunk_bytes: u32,
    /// 1: one chunk per lane of a warp; 0: one per thread.
    pub warp_mode: u32,
    /// Warp mode: the warps that take chunks, each round's chunks cut evenly over them
    /// ([`crate::plan::warp_span`]); 0: every warp of the grid.
    pub warps: u32,
    /// With `claims`: the fewest chunks a claim takes, 1 to 32 ([`crate::plan::claim_size`]).
    pub claim_least: u32,
    /// Warp mode, with `warps`: GPU pointer to the claims' counter, a `u64` that is 0 at launch
    /// (not in this block, which every GPU thread copies), from which warps claim their chunks
    /// instead of taking rounds in turn; 0: rounds in turn.
    pub claims: u64,
    /// Reserved.
    pub reserved: u64,
}
const _: () = assert!(size_of::<FileParams>() == 64);

/// Threads of the CRC combining kernel's one block (`GPUNVME_CRC32C_COMBINE_THREADS`).
pub const CRC32C_COMBINE_THREADS: u32 = 1024;
/// CRC-32C polynomial, reflected (`GPUNVME_CRC32C_POLY`).
pub const CRC32C_POLY: u32 = 0x82f6_3b78;
/// Piece kinds of the file layer (`GPUNVME_PIECE_*`): straight into the caller's memory.
pub const PIECE_DIRECT: u32 = 0;
/// Through the slot buffer.
pub const PIECE_BOUNCE: u32 = 1;
/// Read-modify-write of a partial LBA.
pub const PIECE_RMW: u32 = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_queues::desc::{KERNELS_CU, check_defines};
    use std::mem::offset_of;

    #[test]
    fn file_header_matches_blockfs_tables() {
        use blockfs::table::*;
        let want: &[(&str, u64)] = &[
            ("TABLE_MAGIC", TABLE_MAGIC as u64),
            ("TABLE_VERSION", TABLE_VERSION as u64),
            ("TABLE_HEADER_SIZE", TABLE_HEADER_SIZE as u64),
            ("TABLE_FILE_SIZE", TABLE_FILE_SIZE as u64),
            ("TABLE_EXTENT_SIZE", TABLE_EXTENT_SIZE as u64),
            ("TH_LBA_SHIFT", TABLE_HEADER_LBA_SHIFT_OFFSET as u64),
            ("TH_NSID", TABLE_HEADER_NSID_OFFSET as u64),
            ("TH_FILE_COUNT", TABLE_HEADER_FILE_COUNT_OFFSET as u64),
            ("TH_EXTENT_COUNT", TABLE_HEADER_EXTENT_COUNT_OFFSET as u64),
            ("TH_FILES_OFFSET", TABLE_HEADER_FILES_OFFSET_OFFSET as u64),
            (
                "TH_EXTENTS_OFFSET",
                TABLE_HEADER_EXTENTS_OFFSET_OFFSET as u64,
            ),
            (
                "TH_TOTAL_BYTES",
                offset_of!(TableHeader, total_bytes) as u64,
            ),
            ("TF_SIZE_BYTES", TABLE_FILE_SIZE_BYTES_OFFSET as u64),
            ("TF_FIRST_EXTENT", TABLE_FILE_FIRST_EXTENT_OFFSET as u64),
            ("TF_EXTENT_COUNT", TABLE_FILE_EXTENT_COUNT_OFFSET as u64),
            ("TF_FILE_ID", TABLE_FILE_FILE_ID_OFFSET as u64),
            ("TF_ALLOC_BYTES", TABLE_FILE_ALLOC_BYTES_OFFSET as u64),
            ("TF_FLAGS", TABLE_FILE_FLAGS_OFFSET as u64),
            ("TE_FILE_LBA", TABLE_EXTENT_FILE_LBA_OFFSET as u64),
            ("TE_LBA", TABLE_EXTENT_LBA_OFFSET as u64),
            ("TE_NLB", TABLE_EXTENT_NLB_OFFSET as u64),
            ("TABLE_FILE_WRITABLE", TABLE_FILE_WRITABLE as u64),
            ("PIECE_DIRECT", PIECE_DIRECT as u64),
            ("PIECE_BOUNCE", PIECE_BOUNCE as u64),
            ("PIECE_RMW", PIECE_RMW as u64),
            ("CRC32C_POLY", CRC32C_POLY as u64),
            ("CRC32C_COMBINE_THREADS", CRC32C_COMBINE_THREADS as u64),
            ("FILE_IO_SIZE", size_of::<FileIo>() as u64),
            ("FILE_PARAMS_SIZE", size_of::<FileParams>() as u64),
        ];
        check_defines(&[FILE_CUH, KERNELS_CU], want, "blockfs / Rust layout").unwrap();
        // The field offsets of the kernel structs, as the CUDA side lays them out (naturally
        // aligned, in declaration order).
        assert_eq!(offset_of!(FileIo, first_chunk), 48);
        assert_eq!(offset_of!(FileIo, status), 64);
        assert_eq!(offset_of!(FileParams, chunk_bytes), 32);
        assert_eq!(offset_of!(FileParams, warps), 40);
        assert_eq!(offset_of!(FileParams, claims), 48);
        // CRC-32C as blockfs records it (FORMAT.md): the polynomial here is the crc32c crate's.
        assert_eq!(crate::plan::crc32c_segmented(b"123456789", 4), 0xe306_9283);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }
}
