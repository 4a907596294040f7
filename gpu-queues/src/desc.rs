//! The structs shared with the CUDA side, byte for byte: `#[repr(C)]` mirrors of
//! `ptx/gpunvme.cuh` and `ptx/gpunvme_kernels.cu`, with the header's status codes.
//!
//! The header carries the same numbers as `GPUNVME_*` defines and checks them with
//! `static_assert`; the tests below parse those defines and compare them with `offset_of!` here
//! and with `nvme_spec::wire`, so neither side can drift alone.
#![forbid(unsafe_code)]

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The device header, as committed (for embedders and for the layout test).
pub const HEADER: &str = include_str!("../../ptx/gpunvme.cuh");
/// The kernels' source, as committed.
pub const KERNELS_CU: &str = include_str!("../../ptx/gpunvme_kernels.cu");
/// The GPU-resident controller model's device code, as committed.
pub const CONTROLLER_CUH: &str = include_str!("../../ptx/gpunvme_controller.cuh");
/// The file layer's device code (extent tables, file ranges, CRC-32C), as committed.
pub const FILE_CUH: &str = include_str!("../../ptx/gpunvme_file.cuh");
/// The kernels' PTX (nvcc 13.0, compute_80), embedded and JIT-loaded at run time.
pub const KERNELS_PTX: &str = include_str!("../../ptx/gpunvme_kernels.ptx");

/// One I/O queue pair as kernels see it (`gpunvme::queue_desc`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct QueueDesc {
    /// GPU pointer: SQ ring.
    pub sq: u64,
    /// GPU pointer: CQ ring.
    pub cq: u64,
    /// GPU pointer: SQ tail doorbell.
    pub sq_doorbell: u64,
    /// GPU pointer: CQ head doorbell.
    pub cq_doorbell: u64,
    /// GPU pointer: [`QueueState`].
    pub state: u64,
    /// GPU pointer: `[SlotState; depth]`.
    pub slots: u64,
    /// GPU pointer: two 4 KiB PRP-list pages per slot, slot s at page 2s: the first holds the
    /// slot buffer's pre-built list, the second the list `build_prps` writes for other buffers.
    pub prp_lists: u64,
    /// Device address of the first PRP-list page (pages contiguous).
    pub prp_lists_bus: u64,
    /// GPU pointer: one data buffer per slot (0: none).
    pub slot_buffers: u64,
    /// Device address of the first slot buffer (contiguous).
    pub slot_buffers_bus: u64,
    /// GPU pointer: the host's abort word.
    pub host_flags: u64,
    /// Bound of every device-side wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Entries of the SQ and of the CQ (a power of two).
    pub depth: u32,
    /// NVMe queue id.
    pub qid: u16,
    /// `QF_*` bits.
    pub flags: u16,
    /// Bytes of each slot buffer.
    pub slot_buffer_bytes: u32,
    /// Most bytes one command may move.
    pub max_transfer: u32,
    /// Reserved.
    pub reserved1: [u64; 2],
}
const _: () = assert!(size_of::<QueueDesc>() == 128);

/// Per-queue protocol state (`gpunvme::queue_state`), in GPU memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct QueueState {
    /// Next ticket.
    pub ticket: u32,
    /// Padding (separate sector).
    pub pad0: [u32; 7],
    /// Tickets below this are published.
    pub sq_published: u32,
    /// Tail-mover lock.
    pub sq_lock: u32,
    /// Padding.
    pub pad1: [u32; 6],
    /// CQ drain lock.
    pub cq_lock: u32,
    /// Next CQ entry to look at.
    pub cq_head: u32,
    /// Expected phase there.
    pub cq_phase: u32,
    /// Completions consumed.
    pub cq_reaped: u32,
    /// Padding.
    pub pad2: [u32; 4],
    /// 0, or the [`DeviceStatus`] that failed the queue.
    pub failed: u32,
    /// Padding.
    pub pad3: u32,
    /// `%globaltimer` when a waiter last read the host's abort word.
    pub host_checked_ns: u64,
    /// Padding.
    pub pad4: [u32; 4],
}
const _: () = assert!(size_of::<QueueState>() == 128);

/// Per-slot state (`gpunvme::slot_state`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct SlotState {
    /// Ticket that may take the slot next.
    pub released: u32,
    /// Ticket whose SQE is in the slot.
    pub ticket: u32,
    /// `DONE_BIT | status field` once completed.
    pub done: u32,
    /// Completion dword 0.
    pub dw0: u32,
}
const _: () = assert!(size_of::<SlotState>() == 16);

/// One command as the batch kernel takes it (`gpunvme::io_req`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct IoReq {
    /// First LBA.
    pub slba: u64,
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2.
    pub prp2: u64,
    /// Namespace.
    pub nsid: u32,
    /// Blocks - 1.
    pub nlb_z: u16,
    /// NVM opcode.
    pub opcode: u8,
    /// Reserved.
    pub reserved: u8,
}
const _: () = assert!(size_of::<IoReq>() == 32);

/// Parameters of the perf kernel (`perf_params` in gpunvme_kernels.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PerfParams {
    /// GPU pointer: `[QueueDesc; nqueues]`.
    pub queues: u64,
    /// GPU pointer: [`PerfCounters`].
    pub counters: u64,
    /// GPU pointer: `[u32; LAT_BUCKETS]`.
    pub lat_hist: u64,
    /// Pattern and offset seed.
    pub seed: u64,
    /// Blocks from LBA 0 the run touches.
    pub region_blocks: u64,
    /// I/Os to issue (0: until runtime_ns).
    pub ios: u64,
    /// Each thread starts no I/O after this long (0: stop by `ios`).
    pub runtime_ns: u64,
    /// Queues.
    pub nqueues: u32,
    /// 0 read, 1 write, 2 randread, 3 randwrite.
    pub rw: u32,
    /// Namespace.
    pub nsid: u32,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// Blocks per I/O.
    pub blocks_per_io: u32,
    /// 1: warp-cooperative submission.
    pub warp_mode: u32,
    /// 1: pattern writes and checked reads.
    pub verify: u32,
    /// Reserved.
    pub reserved: [u32; 3],
}
const _: () = assert!(size_of::<PerfParams>() == 96);

/// What the perf kernel reports (`perf_counters`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PerfCounters {
    /// I/O indices handed out.
    pub issued: u64,
    /// I/Os completed successfully and (with verify) matching.
    pub done: u64,
    /// I/Os that failed.
    pub errors: u64,
    /// Reads whose bytes differed from the pattern.
    pub mismatches: u64,
    /// [`DeviceStatus`] of the first failure.
    pub first_status: u32,
    /// Its CQE status field.
    pub first_nvme_status: u32,
    /// LBA of the first failure or mismatch.
    pub first_bad_lba: u64,
    /// Reserved.
    pub reserved: [u64; 2],
}
const _: () = assert!(size_of::<PerfCounters>() == 64);

/// One piece of the software controller's batched copies (`copy_desc`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CopyDesc {
    /// GPU pointer (destination of a scatter, source of a gather).
    pub dst: u64,
    /// Offset in the staging area.
    pub src: u32,
    /// Bytes, with [`COPY_LATE`] for pieces written after all others.
    pub len: u32,
}
const _: () = assert!(size_of::<CopyDesc>() == 16);

/// One byte range of one file for the batched file kernel (`file_io` in gpunvme_kernels.cu).
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
    /// Out: 0, or the first failure's [`DeviceStatus`] code.
    pub status: u32,
    /// Out: the CQE status field of an NVMe error.
    pub nvme_status: u32,
}
const _: () = assert!(size_of::<FileIo>() == 72);

/// Parameters of the batched file kernel (`file_params`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FileParams {
    /// GPU pointer: `[QueueDesc; nqueues]`.
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
    /// Reserved.
    pub reserved: [u64; 3],
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

/// `CopyDesc::len` flag: written by the scatter's last block, after every other piece.
pub const COPY_LATE: u32 = 0x8000_0000;
/// Buckets of the perf kernel's latency histogram.
pub const LAT_BUCKETS: usize = 1024;
/// `SlotState::done` flag.
pub const DONE_BIT: u32 = 0x8000_0000;
/// Host flags word: abort every wait.
pub const HOST_ABORT: u32 = 1;

/// [`QueueDesc::flags`]: the queue's controller runs on this GPU (the GPU-resident model), so
/// the header's fences are at GPU scope (`GPUNVME_QF_LOCAL_PEER`).
pub const QF_LOCAL_PEER: u16 = 1;

/// Lower bound in nanoseconds of latency bucket `b` (inverse of the kernel's `lat_bucket`).
pub fn lat_bucket_floor(b: usize) -> u64 {
    if b < 16 {
        return b as u64;
    }
    let e = (b / 16) as u32 + 3;
    let sub = (b % 16) as u64;
    (1u64 << e) + (sub << (e - 4))
}

/// A device-side call's outcome (the header's `GPUNVME_*` status codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceStatus {
    /// Success.
    Ok,
    /// A bounded wait ran out.
    Timeout,
    /// The controller completed the command with an error status.
    NvmeError,
    /// The queue failed earlier (timeout, abort, bad completion) and takes no commands.
    QueueFailed,
    /// The host aborted (controller fatal, device gone, shutdown).
    Aborted,
    /// Bad arguments (size above MDTS, unaligned buffer).
    InvalidArgument,
    /// The controller posted a completion for no command in flight.
    BadCompletion,
    /// A file access past the file's extents.
    OutOfExtent,
    /// A code this build does not know.
    Unknown(u32),
}

impl DeviceStatus {
    /// Decodes a status code.
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => Self::Ok,
            1 => Self::Timeout,
            2 => Self::NvmeError,
            3 => Self::QueueFailed,
            4 => Self::Aborted,
            5 => Self::InvalidArgument,
            6 => Self::BadCompletion,
            7 => Self::OutOfExtent,
            c => Self::Unknown(c),
        }
    }

    /// The code.
    pub fn code(self) -> u32 {
        match self {
            Self::Ok => 0,
            Self::Timeout => 1,
            Self::NvmeError => 2,
            Self::QueueFailed => 3,
            Self::Aborted => 4,
            Self::InvalidArgument => 5,
            Self::BadCompletion => 6,
            Self::OutOfExtent => 7,
            Self::Unknown(c) => c,
        }
    }
}

impl std::fmt::Display for DeviceStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Self::Ok => "ok",
            Self::Timeout => "timed out (GPUNVME_TIMEOUT)",
            Self::NvmeError => "NVMe error status (GPUNVME_NVME_ERROR)",
            Self::QueueFailed => "queue failed earlier (GPUNVME_QUEUE_FAILED)",
            Self::Aborted => "aborted by the host (GPUNVME_ABORTED)",
            Self::InvalidArgument => "invalid argument (GPUNVME_INVALID_ARGUMENT)",
            Self::BadCompletion => "completion for no command in flight (GPUNVME_BAD_COMPLETION)",
            Self::OutOfExtent => "outside the file's extents (GPUNVME_OUT_OF_EXTENT)",
            Self::Unknown(c) => return write!(f, "unknown status {c}"),
        };
        f.write_str(s)
    }
}

/// One queue pair of the GPU-resident controller's table (`gpunvme::ctrl::ctrl_queue`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlQueue {
    /// GPU pointer of the SQ ring (0: no SQ).
    pub sq: u64,
    /// GPU pointer of the CQ ring.
    pub cq: u64,
    /// SQ entries.
    pub sq_entries: u32,
    /// CQ entries.
    pub cq_entries: u32,
    /// Changes whenever the entry describes a new queue.
    pub serial: u32,
    /// Reserved.
    pub reserved: u32,
}
const _: () = assert!(size_of::<CtrlQueue>() == 32);

/// A range of device addresses (= GPU pointers) the controller may move data through.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlWindow {
    /// First address.
    pub base: u64,
    /// Bytes.
    pub len: u64,
}

/// One namespace of the GPU-resident controller (`gpunvme::ctrl::ctrl_ns`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlNs {
    /// Size in logical blocks.
    pub blocks: u64,
    /// GPU pointer of the media (0: null media).
    pub media: u64,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// `MEDIA_*`.
    pub kind: u32,
    /// `NS_*` bits.
    pub flags: u32,
    /// Reserved.
    pub reserved: u32,
}

/// [`CtrlNs::flags`]: write protected (`GPUNVME_NS_READ_ONLY`).
pub const NS_READ_ONLY: u32 = 1;

/// Media kinds (`GPUNVME_MEDIA_*`).
pub const MEDIA_NULL: u32 = 0;
/// Media in GPU memory.
pub const MEDIA_HBM: u32 = 1;
/// Media in host memory registered with CUDA.
pub const MEDIA_HOST: u32 = 2;

/// The GPU-resident controller's control block (`gpunvme::ctrl::ctrl_control`), in pinned
/// host memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlControl {
    /// Host: 1 = stop.
    pub stop: u32,
    /// Host: bumped after any table change.
    pub generation: u32,
    /// Queue ids 1..=nqueues may exist.
    pub nqueues: u32,
    /// Windows in use.
    pub nwindows: u32,
    /// Namespaces.
    pub nns: u32,
    /// Longest idle sleep, nanoseconds.
    pub idle_ns: u32,
    /// MDTS in bytes.
    pub max_transfer: u32,
    /// Entries of the media error table in use.
    pub nmedia_errors: u32,
    /// Mapped pointer: `[CtrlQueue; nqueues]`.
    pub queues: u64,
    /// Mapped pointer: `[CtrlWindow; CTRL_MAX_WINDOWS]`.
    pub windows: u64,
    /// Mapped pointer: `[CtrlNs; CTRL_MAX_NS]`.
    pub namespaces: u64,
    /// GPU pointer: doorbell pairs, `CTRL_DOORBELL_STRIDE` bytes apart.
    pub doorbells: u64,
    /// GPU pointer: `[CtrlCounters; warps]`.
    pub counters: u64,
    /// Mapped pointer: generation acknowledged per warp, then SM id + 1 per block.
    pub ack: u64,
    /// The kernel stops by itself after this long.
    pub lifetime_ns: u64,
    /// Mapped pointer: `[CtrlNsModel; CTRL_MAX_NS]`.
    pub models: u64,
    /// Mapped pointer: `[CtrlMediaError; CTRL_MAX_MEDIA_ERRORS]`.
    pub media_errors: u64,
    /// GPU pointer: completions still to drop, `u64` per queue id (`[0]`: on any queue;
    /// `u64::MAX`: every one).
    pub drops: u64,
    /// `FAULT_*` bits.
    pub faults: u32,
    /// Added to every completion's due time, nanoseconds ([`FAULT_DELAY`]).
    pub delay_ns: u32,
    /// GPU pointer: `[stop, generation]` (u32 each) as block 0's leader last read them.
    pub mirror: u64,
}

/// A namespace's SSD timing model as the controller kernel takes it
/// (`gpunvme::ctrl::ctrl_ns_model`); built by [`crate::ssd_model::SsdModel::to_ctrl`].
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct CtrlNsModel {
    /// GPU pointer: per drive the `%globaltimer` nanosecond until which it is busy,
    /// [`CTRL_DRIVE_STRIDE`] bytes apart.
    pub busy: u64,
    /// Bytes per second per drive (0: no bandwidth cap).
    pub bw: u64,
    /// Fixed latency of a Read after its service, nanoseconds.
    pub read_ns: u32,
    /// Fixed latency of a Write after its service, nanoseconds.
    pub write_ns: u32,
    /// Nanoseconds per command per drive, `ceil(1e9 / IOPS)` (0: no IOPS cap).
    pub op_ns: u32,
    /// Drives striped behind the namespace (0: no timing model).
    pub drives: u16,
    /// log2 of the stripe unit in bytes.
    pub stripe_shift: u16,
}

/// An injected media error of the GPU-resident controller (`gpunvme::ctrl::ctrl_media_error`).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct CtrlMediaError {
    /// First LBA.
    pub slba: u64,
    /// LBAs.
    pub nlb: u64,
    /// Namespace.
    pub nsid: u32,
    /// Reserved.
    pub reserved: u32,
}

/// A completion the model holds until it is due (`gpunvme::ctrl::ctrl_pending`, in the
/// controller warps' shared memory; mirrored for its size only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlPending {
    /// `%globaltimer` nanosecond from which it may be posted.
    pub due: u64,
    /// CID and status field, without the phase tag.
    pub dw3: u32,
    /// Owning lane and fetch sequence.
    pub meta: u32,
}

/// What one controller warp did (`gpunvme::ctrl::ctrl_counters`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlCounters {
    /// Commands completed (any status).
    pub commands: u64,
    /// Of which failed.
    pub errors: u64,
    /// Data bytes moved.
    pub bytes: u64,
    /// Doorbell values out of range, ignored.
    pub doorbell_errors: u64,
    /// Polling passes.
    pub passes: u64,
    /// Passes with nothing to do.
    pub idle_passes: u64,
    /// Table generations taken.
    pub reloads: u64,
    /// Completions dropped (fault injection).
    pub dropped: u32,
    /// Held completions never posted (the model stopped, or their queue was deleted).
    pub abandoned: u32,
}

/// Windows per controller (`GPUNVME_CTRL_MAX_WINDOWS`).
pub const CTRL_MAX_WINDOWS: usize = 64;
/// Namespaces per controller (`GPUNVME_CTRL_MAX_NS`).
pub const CTRL_MAX_NS: usize = 16;
/// Warps per controller block (`GPUNVME_CTRL_WARPS`).
pub const CTRL_WARPS: u32 = 16;
/// Bytes between two queues' doorbell pairs (`GPUNVME_CTRL_DOORBELL_STRIDE`).
pub const CTRL_DOORBELL_STRIDE: usize = 32;
/// Injected media error ranges per controller (`GPUNVME_CTRL_MAX_MEDIA_ERRORS`).
pub const CTRL_MAX_MEDIA_ERRORS: usize = 16;
/// Drives of one namespace's timing model (`GPUNVME_CTRL_MAX_DRIVES`).
pub const CTRL_MAX_DRIVES: usize = 64;
/// Bytes between two drives' busy-until words (`GPUNVME_CTRL_DRIVE_STRIDE`).
pub const CTRL_DRIVE_STRIDE: usize = 32;
/// Bytes of selection slots before each warp's held completions (`GPUNVME_CTRL_SEL_BYTES`).
pub const CTRL_SEL_BYTES: usize = 128;
/// Smallest stripe unit, log2 bytes (`GPUNVME_CTRL_MIN_STRIPE_SHIFT`).
pub const CTRL_MIN_STRIPE_SHIFT: u32 = 12;
/// Largest stripe unit, log2 bytes (`GPUNVME_CTRL_MAX_STRIPE_SHIFT`).
pub const CTRL_MAX_STRIPE_SHIFT: u32 = 30;
/// [`CtrlControl::faults`]: drop counters may be non-zero (`GPUNVME_FAULT_DROPS`).
pub const FAULT_DROPS: u32 = 1;
/// [`CtrlControl::faults`]: [`CtrlControl::delay_ns`] applies (`GPUNVME_FAULT_DELAY`).
pub const FAULT_DELAY: u32 = 2;
/// [`CtrlControl::faults`]: media error ranges are set (`GPUNVME_FAULT_MEDIA`).
pub const FAULT_MEDIA: u32 = 4;

/// Held completions per controller warp when the kernel gets `dynamic_bytes` of dynamic shared
/// memory per block (the kernel's own arithmetic: its slice, less the selection slots).
pub fn pending_capacity(dynamic_bytes: u32) -> u32 {
    let slice = (dynamic_bytes / CTRL_WARPS) & !15;
    slice.saturating_sub(CTRL_SEL_BYTES as u32) / size_of::<CtrlPending>() as u32
}

/// Every `#define GPUNVME_NAME <integer>` in `text`, as (NAME without the prefix, value).
pub fn header_defines(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("#define GPUNVME_")?;
            let mut it = rest.split_whitespace();
            let name = it.next()?;
            let value = it.next()?.trim_end_matches('u');
            let v = if let Some(hex) = value.strip_prefix("0x") {
                u64::from_str_radix(hex, 16).ok()?
            } else {
                value.parse().ok()?
            };
            Some((name.to_string(), v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_spec::wire;
    use std::collections::HashMap;
    use std::mem::offset_of;

    fn defines() -> HashMap<String, u64> {
        let mut m: HashMap<String, u64> = header_defines(HEADER).into_iter().collect();
        m.extend(header_defines(KERNELS_CU));
        m.extend(header_defines(CONTROLLER_CUH));
        m.extend(header_defines(FILE_CUH));
        m
    }

    #[test]
    fn file_header_matches_blockfs_tables() {
        use blockfs::table::*;
        let d = defines();
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
        for (name, value) in want {
            assert_eq!(
                d.get(*name).copied(),
                Some(*value),
                "GPUNVME_{name} in the CUDA sources vs blockfs / the Rust layout"
            );
        }
        // The field offsets of the kernel structs, as the CUDA side lays them out (naturally
        // aligned, in declaration order).
        assert_eq!(offset_of!(FileIo, first_chunk), 48);
        assert_eq!(offset_of!(FileIo, status), 64);
        assert_eq!(offset_of!(FileParams, chunk_bytes), 32);
        // CRC-32C as blockfs records it (FORMAT.md): the polynomial here is the crc32c crate's.
        assert_eq!(crate::files::crc32c_segmented(b"123456789", 4), 0xe306_9283);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn header_matches_rust_layouts() {
        let d = defines();
        let want: &[(&str, usize)] = &[
            ("QUEUE_DESC_SIZE", size_of::<QueueDesc>()),
            ("QD_SQ", offset_of!(QueueDesc, sq)),
            ("QD_CQ", offset_of!(QueueDesc, cq)),
            ("QD_SQ_DOORBELL", offset_of!(QueueDesc, sq_doorbell)),
            ("QD_CQ_DOORBELL", offset_of!(QueueDesc, cq_doorbell)),
            ("QD_STATE", offset_of!(QueueDesc, state)),
            ("QD_SLOTS", offset_of!(QueueDesc, slots)),
            ("QD_PRP_LISTS", offset_of!(QueueDesc, prp_lists)),
            ("QD_PRP_LISTS_BUS", offset_of!(QueueDesc, prp_lists_bus)),
            ("QD_SLOT_BUFFERS", offset_of!(QueueDesc, slot_buffers)),
            (
                "QD_SLOT_BUFFERS_BUS",
                offset_of!(QueueDesc, slot_buffers_bus),
            ),
            ("QD_HOST_FLAGS", offset_of!(QueueDesc, host_flags)),
            ("QD_TIMEOUT_NS", offset_of!(QueueDesc, timeout_ns)),
            ("QD_DEPTH", offset_of!(QueueDesc, depth)),
            ("QD_QID", offset_of!(QueueDesc, qid)),
            ("QD_FLAGS", offset_of!(QueueDesc, flags)),
            ("QF_LOCAL_PEER", QF_LOCAL_PEER as usize),
            (
                "QD_SLOT_BUFFER_BYTES",
                offset_of!(QueueDesc, slot_buffer_bytes),
            ),
            ("QD_MAX_TRANSFER", offset_of!(QueueDesc, max_transfer)),
            ("QUEUE_STATE_SIZE", size_of::<QueueState>()),
            ("QS_TICKET", offset_of!(QueueState, ticket)),
            ("QS_SQ_PUBLISHED", offset_of!(QueueState, sq_published)),
            ("QS_SQ_LOCK", offset_of!(QueueState, sq_lock)),
            ("QS_CQ_LOCK", offset_of!(QueueState, cq_lock)),
            ("QS_CQ_HEAD", offset_of!(QueueState, cq_head)),
            ("QS_CQ_PHASE", offset_of!(QueueState, cq_phase)),
            ("QS_CQ_REAPED", offset_of!(QueueState, cq_reaped)),
            ("QS_FAILED", offset_of!(QueueState, failed)),
            (
                "QS_HOST_CHECKED_NS",
                offset_of!(QueueState, host_checked_ns),
            ),
            ("SLOT_STATE_SIZE", size_of::<SlotState>()),
            ("SS_RELEASED", offset_of!(SlotState, released)),
            ("SS_TICKET", offset_of!(SlotState, ticket)),
            ("SS_DONE", offset_of!(SlotState, done)),
            ("SS_DW0", offset_of!(SlotState, dw0)),
            ("IO_REQ_SIZE", size_of::<IoReq>()),
            ("PERF_PARAMS_SIZE", size_of::<PerfParams>()),
            ("PERF_COUNTERS_SIZE", size_of::<PerfCounters>()),
            ("COPY_DESC_SIZE", size_of::<CopyDesc>()),
            ("LAT_BUCKETS", LAT_BUCKETS),
            ("COPY_LATE", COPY_LATE as usize),
            ("DONE_BIT", DONE_BIT as usize),
            ("HOST_ABORT", HOST_ABORT as usize),
            ("CTRL_QUEUE_SIZE", size_of::<CtrlQueue>()),
            ("CTRL_WINDOW_SIZE", size_of::<CtrlWindow>()),
            ("CTRL_NS_SIZE", size_of::<CtrlNs>()),
            ("CTRL_CONTROL_SIZE", size_of::<CtrlControl>()),
            ("CTRL_COUNTERS_SIZE", size_of::<CtrlCounters>()),
            ("CC_STOP", offset_of!(CtrlControl, stop)),
            ("CC_GENERATION", offset_of!(CtrlControl, generation)),
            ("CC_QUEUES", offset_of!(CtrlControl, queues)),
            ("CC_ACK", offset_of!(CtrlControl, ack)),
            ("CC_LIFETIME_NS", offset_of!(CtrlControl, lifetime_ns)),
            ("CC_MIRROR", offset_of!(CtrlControl, mirror)),
            ("CC_NMEDIA_ERRORS", offset_of!(CtrlControl, nmedia_errors)),
            ("CC_MODELS", offset_of!(CtrlControl, models)),
            ("CC_MEDIA_ERRORS", offset_of!(CtrlControl, media_errors)),
            ("CC_DROPS", offset_of!(CtrlControl, drops)),
            ("CC_FAULTS", offset_of!(CtrlControl, faults)),
            ("CC_DELAY_NS", offset_of!(CtrlControl, delay_ns)),
            ("CTRL_NS_MODEL_SIZE", size_of::<CtrlNsModel>()),
            ("CTRL_MEDIA_ERROR_SIZE", size_of::<CtrlMediaError>()),
            ("CTRL_PENDING_SIZE", size_of::<CtrlPending>()),
            ("CTRL_MAX_MEDIA_ERRORS", CTRL_MAX_MEDIA_ERRORS),
            ("CTRL_MAX_DRIVES", CTRL_MAX_DRIVES),
            ("CTRL_DRIVE_STRIDE", CTRL_DRIVE_STRIDE),
            ("CTRL_SEL_BYTES", CTRL_SEL_BYTES),
            ("CTRL_MIN_STRIPE_SHIFT", CTRL_MIN_STRIPE_SHIFT as usize),
            ("CTRL_MAX_STRIPE_SHIFT", CTRL_MAX_STRIPE_SHIFT as usize),
            ("FAULT_DROPS", FAULT_DROPS as usize),
            ("FAULT_DELAY", FAULT_DELAY as usize),
            ("FAULT_MEDIA", FAULT_MEDIA as usize),
            ("CTRL_MAX_WINDOWS", CTRL_MAX_WINDOWS),
            ("CTRL_MAX_NS", CTRL_MAX_NS),
            ("CTRL_WARPS", CTRL_WARPS as usize),
            ("CTRL_DOORBELL_STRIDE", CTRL_DOORBELL_STRIDE),
            ("MEDIA_NULL", MEDIA_NULL as usize),
            ("MEDIA_HBM", MEDIA_HBM as usize),
            ("MEDIA_HOST", MEDIA_HOST as usize),
            ("NS_READ_ONLY", NS_READ_ONLY as usize),
        ];
        for (name, value) in want {
            assert_eq!(
                d.get(*name).copied(),
                Some(*value as u64),
                "GPUNVME_{name} in the CUDA sources vs the Rust layout"
            );
        }
        for code in 0..8 {
            let name = match DeviceStatus::from_code(code) {
                DeviceStatus::Ok => "OK",
                DeviceStatus::Timeout => "TIMEOUT",
                DeviceStatus::NvmeError => "NVME_ERROR",
                DeviceStatus::QueueFailed => "QUEUE_FAILED",
                DeviceStatus::Aborted => "ABORTED",
                DeviceStatus::InvalidArgument => "INVALID_ARGUMENT",
                DeviceStatus::BadCompletion => "BAD_COMPLETION",
                DeviceStatus::OutOfExtent => "OUT_OF_EXTENT",
                DeviceStatus::Unknown(_) => unreachable!(),
            };
            assert_eq!(d.get(name).copied(), Some(code as u64), "GPUNVME_{name}");
        }
    }

    #[test]
    fn model_tables_have_the_kernels_layout() {
        // reload() reads drives and stripe_shift as one 32-bit word at `drives`.
        assert_eq!(offset_of!(CtrlNsModel, drives), 28);
        assert_eq!(offset_of!(CtrlNsModel, stripe_shift), 30);
        assert_eq!(offset_of!(CtrlMediaError, nsid), 16);
        assert_eq!(size_of::<CtrlControl>(), 128);
        assert_eq!(size_of::<CtrlCounters>(), 64);
        // H100: 227 KiB per block less ~39 KiB of tables, or just over half of 228 KiB.
        assert_eq!(pending_capacity(232_448 - 39_568), 745);
        assert_eq!(pending_capacity(117_760 - 39_568), 297);
        assert_eq!(pending_capacity(0), 0);
        assert_eq!(pending_capacity(100), 0);
    }

    #[test]
    fn header_matches_nvme_spec_wire_offsets() {
        let d = defines();
        let want: &[(&str, usize)] = &[
            ("SQE_SIZE", wire::SQE_SIZE),
            ("SQE_OPC", wire::SQE_OPC),
            ("SQE_FLAGS", wire::SQE_FLAGS),
            ("SQE_CID", wire::SQE_CID),
            ("SQE_NSID", wire::SQE_NSID),
            ("SQE_MPTR", wire::SQE_MPTR),
            ("SQE_PRP1", wire::SQE_PRP1),
            ("SQE_PRP2", wire::SQE_PRP2),
            ("SQE_CDW10", wire::SQE_CDW10),
            ("SQE_CDW11", wire::SQE_CDW11),
            ("SQE_CDW12", wire::SQE_CDW12),
            ("SQE_CDW13", wire::SQE_CDW13),
            ("SQE_CDW14", wire::SQE_CDW14),
            ("SQE_CDW15", wire::SQE_CDW15),
            ("CQE_SIZE", wire::CQE_SIZE),
            ("CQE_DW0", wire::CQE_DW0),
            ("CQE_DW1", wire::CQE_DW1),
            ("CQE_SQHD", wire::CQE_SQHD),
            ("CQE_SQID", wire::CQE_SQID),
            ("CQE_CID", wire::CQE_CID),
            ("CQE_STATUS", wire::CQE_STATUS),
        ];
        for (name, value) in want {
            assert_eq!(
                d.get(*name).copied(),
                Some(*value as u64),
                "GPUNVME_{name} in ptx/gpunvme.cuh vs nvme_spec::wire"
            );
        }
    }

    #[test]
    fn latency_buckets_invert() {
        // The kernel's bucket function, in Rust, against the floor function.
        fn bucket(ns: u64) -> usize {
            if ns < 16 {
                return ns as usize;
            }
            let e = 63 - ns.leading_zeros();
            (((e - 3) * 16) as u64 + ((ns >> (e - 4)) & 15)).min(LAT_BUCKETS as u64 - 1) as usize
        }
        for ns in [0u64, 15, 16, 17, 100, 1000, 7_700, 123_456, 10_000_000] {
            let b = bucket(ns);
            assert!(lat_bucket_floor(b) <= ns, "{ns}");
            assert!(lat_bucket_floor(b + 1) > ns, "{ns}");
        }
    }

    #[test]
    fn ptx_is_embedded_with_every_kernel() {
        for k in [
            "gpunvme_perf",
            "gpunvme_io_batch",
            "gpunvme_rw_range",
            "gpunvme_pattern",
            "gpunvme_scatter",
            "gpunvme_gather",
            "gpunvme_warmup",
            "gpunvme_controller",
            "gpunvme_file_rw",
            "gpunvme_crc32c",
            "gpunvme_crc32c_combine",
        ] {
            assert!(
                KERNELS_PTX.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX"
            );
        }
        assert!(KERNELS_PTX.contains(".target sm_80"));
        // The model's held completions use the kernel's dynamic shared memory.
        assert!(KERNELS_PTX.contains("%dynamic_smem_size"));
        assert!(KERNELS_PTX.contains("st.mmio.relaxed.sys.global.u32"));
    }
}
