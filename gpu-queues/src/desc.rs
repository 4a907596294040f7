//! The structs shared with the CUDA side, byte for byte: `#[repr(C)]` mirrors of
//! `ptx/include/gpunvme.cuh` and the kernels' sources in `ptx/kernels/`, with the header's status
//! codes. (The file layer's structs are mirrored in `blockfs_gpu::desc`, the emulated
//! controllers' in `gpu_emu::desc`.)
//!
//! The header carries the same numbers as `GPUNVME_*` defines and checks them with
//! `static_assert`; the tests below parse those defines and compare them with `offset_of!` here
//! and with `nvme_spec::wire`, so neither side can drift alone.
#![forbid(unsafe_code)]

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The device header, as committed (for embedders and for the layout test).
pub const HEADER: &str = include_str!("../../ptx/include/gpunvme.cuh");
/// The file layer's device header (extent tables, file ranges, CRC-32C), as committed.
pub const FILE_CUH: &str = include_str!("../../ptx/include/gpunvme_file.cuh");
/// The page cache's device header (`gpunvme::cache`, `gpunvme::array<T>`), as committed.
pub const CACHE_CUH: &str = include_str!("../../ptx/include/gpunvme_cache.cuh");
/// The runtime's kernels' source (the module every embedder loads), as committed.
pub const KERNELS_CU: &str = include_str!("../../ptx/kernels/gpunvme_kernels.cu");
/// The runtime's kernels' PTX (nvcc 13.0, compute_80), embedded and JIT-loaded at run time
/// ([`crate::kernels::Kernels`]).
pub const KERNELS_PTX: &str = include_str!("../../ptx/kernels/gpunvme_kernels.ptx");
/// The tools' kernels' source (the perf kernel, the tests', benchmarks' and examples' kernels),
/// as committed; it `#include`s `ptx/kernels/gpunvme_cache_kernels.cu`.
pub const TOOL_KERNELS_CU: &str = include_str!("../../ptx/kernels/gpunvme_tool_kernels.cu");
/// The tools' kernels' PTX (nvcc 13.0, compute_80), embedded and JIT-loaded only when asked for
/// ([`crate::kernels::ToolKernels`]).
pub const TOOL_KERNELS_PTX: &str = include_str!("../../ptx/kernels/gpunvme_tool_kernels.ptx");

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
    /// The namespace formatted with 8-byte protection information whose Reads and Writes carry
    /// [`QueueDesc::pi_prinfo`] (0: none).
    pub pi_nsid: u32,
    /// PRINFO for `pi_nsid` (PRACT and PRCHK bits, `nvme::Namespace::prinfo`); with bit 0 the
    /// command's CDW14 holds its starting LBA's low 32 bits.
    pub pi_prinfo: u8,
    /// Padding.
    pub pad1: [u8; 3],
    /// Reserved.
    pub reserved1: u64,
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
    /// Completion dword 0 of a command that wants it (the header's `wants_dw0`: not Flush,
    /// Write, Read or Write Zeroes), else 0; until the completion, 1 if the command wants it.
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

/// Parameters of the perf kernel (`perf_params` in gpunvme_tool_kernels.cu).
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
    /// Blocks per command (at most a slot buffer's); an I/O above it is split into commands
    /// issued one after another. 0: the whole I/O.
    pub blocks_per_cmd: u32,
    /// With `warp_mode` 1: lanes of each warp that issue, 1 to 32 (0: 32).
    pub warp_lanes: u32,
    /// Reserved.
    pub reserved: u32,
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

/// A page cache as kernels see it (`gpunvme::cache::cache_desc`); built by
/// [`crate::cache::GpuCache`], read-only on the GPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CacheDesc {
    /// GPU pointer: `nframes * page_size` bytes of frames.
    pub frames: u64,
    /// Device address of the frames (the controller's view).
    pub frames_bus: u64,
    /// GPU pointer: `[FrameState; nframes]`.
    pub frame_states: u64,
    /// GPU pointer: [`CacheState`].
    pub state: u64,
    /// GPU pointer: `[CacheCounters; CACHE_STAT_SLOTS]`.
    pub stats: u64,
    /// GPU pointer: `[RangeDesc; nranges]`.
    pub ranges: u64,
    /// GPU pointer: `[QueueDesc; nqueues]`, the queues fills issue on.
    pub queues: u64,
    /// Frames.
    pub nframes: u64,
    /// Bound of a search for a free frame, in nanoseconds.
    pub full_wait_ns: u64,
    /// Bound ranges.
    pub nranges: u32,
    /// Queues.
    pub nqueues: u32,
    /// log2 of the page size.
    pub page_shift: u32,
    /// `CF_*` bits.
    pub flags: u32,
    /// GPU pointer: [`VolumeDesc`] when the cache is over a striped volume, else 0.
    pub volume: u64,
    /// Reserved.
    pub reserved: [u64; 4],
}
const _: () = assert!(size_of::<CacheDesc>() == 128);

/// Members a cache over a striped volume spans at most (`GPUNVME_VOLUME_MAX_MEMBERS`).
pub const VOLUME_MAX_MEMBERS: usize = 16;

/// A striped volume as a cache's fills see it (`gpunvme::cache::volume_desc`): ranges in volume
/// LBAs, every command cut at stripe units and issued on the member that holds each piece.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct VolumeDesc {
    /// LBAs per stripe unit.
    pub stripe_lbas: u64,
    /// LBAs before each member's data (its label).
    pub label_lbas: u64,
    /// Members.
    pub nmembers: u32,
    /// Queues per member: member `m`'s are the cache's queues `m * qpm..(m + 1) * qpm`.
    pub queues_per_member: u32,
    /// Each member's namespace.
    pub nsid: [u32; VOLUME_MAX_MEMBERS],
    /// The frames' device address on each member's controller.
    pub frames_bus: [u64; VOLUME_MAX_MEMBERS],
}
const _: () = assert!(size_of::<VolumeDesc>() == 216);

/// One range bound to a cache (`gpunvme::cache::range_desc`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct RangeDesc {
    /// GPU pointer: `[PageEntry; npages]`.
    pub entries: u64,
    /// Pages (the last may be partial).
    pub npages: u64,
    /// Bytes of the range.
    pub bytes: u64,
    /// First LBA.
    pub first_lba: u64,
    /// File ranges: GPU pointer of the blockfs extent table (0 for LBA ranges).
    pub table: u64,
    /// Namespace.
    pub nsid: u32,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// File ranges: index of the file in the table.
    pub file: u32,
    /// `RF_*` bits.
    pub flags: u32,
    /// Reserved.
    pub reserved: u64,
}
const _: () = assert!(size_of::<RangeDesc>() == 64);

/// The translation of one page (`gpunvme::cache::page_entry`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct PageEntry {
    /// The page state word (`PS_*` bits and the reference count).
    pub state: u32,
    /// The frame holding the page while it is valid.
    pub frame: u32,
}
const _: () = assert!(size_of::<PageEntry>() == 8);

/// One frame's state (`gpunvme::cache::frame_state`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct FrameState {
    /// `FS_*` bits.
    pub flags: u32,
    /// Owner range, or [`FRAME_EMPTY`].
    pub range: u32,
    /// Owner page.
    pub page: u64,
}
const _: () = assert!(size_of::<FrameState>() == 16);

/// The cache's shared words (`gpunvme::cache::cache_state`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CacheState {
    /// Clock hand (steps taken).
    pub hand: u64,
    /// Padding (separate sector).
    pub pad0: [u64; 3],
    /// [`DeviceStatus`] code of the first failed fill (0: none).
    pub first_status: u32,
    /// Its CQE status field.
    pub first_nvme_status: u32,
    /// Its range.
    pub first_range: u32,
    /// Frames quarantined by fills that timed out or were aborted.
    pub quarantined: u32,
    /// Its page.
    pub first_page: u64,
    /// Reserved.
    pub reserved: u64,
}
const _: () = assert!(size_of::<CacheState>() == 64);

/// A cache's counters (`gpunvme::cache::cache_stats`): one set per statistics slot on the GPU,
/// and their sum on the host ([`crate::cache::CacheStats::counters`]).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct CacheCounters {
    /// Element accesses served from a valid page.
    pub hits: u64,
    /// Fills (one per missing page).
    pub misses: u64,
    /// Element accesses that waited for another warp's fill.
    pub waits: u64,
    /// Pages evicted to make room.
    pub evictions: u64,
    /// Dirty pages written back.
    pub writebacks: u64,
    /// NVMe reads issued by fills.
    pub read_cmds: u64,
    /// NVMe writes issued by write-backs.
    pub write_cmds: u64,
    /// NVMe Flush commands.
    pub flush_cmds: u64,
    /// Bytes read by fills.
    pub bytes_read: u64,
    /// Bytes written back.
    pub bytes_written: u64,
    /// Fills that ended in [`DeviceStatus::CacheFull`].
    pub full: u64,
    /// Fills that failed for any other reason.
    pub errors: u64,
    /// Reserved.
    pub reserved: [u64; 4],
}
const _: () = assert!(size_of::<CacheCounters>() == 128);

impl CacheCounters {
    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &Self) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.waits += o.waits;
        self.evictions += o.evictions;
        self.writebacks += o.writebacks;
        self.read_cmds += o.read_cmds;
        self.write_cmds += o.write_cmds;
        self.flush_cmds += o.flush_cmds;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.full += o.full;
        self.errors += o.errors;
    }
}

/// Statistics slots of a cache (one per `blockIdx.x % CACHE_STAT_SLOTS`).
pub const CACHE_STAT_SLOTS: usize = 64;
/// Page state: the frame holds the page.
pub const PS_VALID: u32 = 0x8000_0000;
/// Page state: one thread owns the page's fill.
pub const PS_BUSY: u32 = 0x4000_0000;
/// Page state: the frame holds stores not yet written back.
pub const PS_DIRTY: u32 = 0x2000_0000;
/// Page state: the last fill failed (the status in bits 27:24).
pub const PS_ERROR: u32 = 0x1000_0000;
/// Page state: where the failed fill's status sits.
pub const PS_STATUS_SHIFT: u32 = 24;
/// Page state: threads holding or waiting for the page.
pub const PS_REFS_MASK: u32 = 0x00ff_ffff;
/// Frame flag: used since the clock hand last passed.
pub const FS_REF: u32 = 1;
/// Frame flag: an evictor or filler owns the frame.
pub const FS_LOCKED: u32 = 2;
/// Frame flag: a command that timed out may still write the frame; never reused.
pub const FS_QUARANTINED: u32 = 4;
/// [`FrameState::range`] of a frame that holds no page.
pub const FRAME_EMPTY: u32 = 0xffff_ffff;
/// [`CacheDesc::flags`]: fills and write-backs go through the queues' slot buffers (BOUNCE).
pub const CF_BOUNCE: u32 = 1;
/// [`RangeDesc::flags`]: a blockfs file.
pub const RF_FILE: u32 = 1;
/// [`RangeDesc::flags`]: the device may store into the range.
pub const RF_WRITABLE: u32 = 2;

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
    // Buckets from 61 * 16 on start past u64: saturate (no latency gets there).
    if e >= 64 {
        return u64::MAX;
    }
    (1u64 << e).saturating_add(sub << (e - 4))
}

/// A device-side call's outcome (the header's `GPUNVME_*` status codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceStatus {
    /// Success.
    Ok,
    /// A bounded wait ran out. The command may still be in flight: its data buffer stays the
    /// controller's until the queue is deleted (drop the [`crate::GpuQueues`]) or the
    /// controller reset; do not free or reuse it before (the same holds for
    /// [`DeviceStatus::Aborted`] and [`DeviceStatus::QueueFailed`]).
    Timeout,
    /// The controller completed the command with an error status.
    NvmeError,
    /// The queue failed earlier (timeout, abort, bad completion) and takes no commands.
    QueueFailed,
    /// The host aborted (controller fatal, device gone, shutdown). Buffers: as for
    /// [`DeviceStatus::Timeout`].
    Aborted,
    /// Bad arguments (size above MDTS, unaligned buffer).
    InvalidArgument,
    /// The controller posted a completion for no command in flight.
    BadCompletion,
    /// A file access past the file's extents (or an element past a cached range's end).
    OutOfExtent,
    /// A page cache found every frame referenced for its whole wait.
    CacheFull,
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
            8 => Self::CacheFull,
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
            Self::CacheFull => 8,
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
            Self::CacheFull => "every cache frame referenced (GPUNVME_CACHE_FULL)",
            Self::Unknown(c) => return write!(f, "unknown status {c}"),
        };
        f.write_str(s)
    }
}

/// Compares the `GPUNVME_*` defines of `sources` with the values the Rust side gives them (the
/// layout tests of every crate that mirrors CUDA structs); `Err` lists every name that is
/// missing or differs, against `what`.
pub fn check_defines<V: Copy + TryInto<u64>>(
    sources: &[&str],
    want: &[(&str, V)],
    what: &str,
) -> Result<(), String> {
    let defined: std::collections::HashMap<String, u64> =
        sources.iter().flat_map(|s| header_defines(s)).collect();
    let bad: Vec<String> = want
        .iter()
        .filter_map(|&(name, value)| {
            let value = value.try_into().ok();
            let found = defined.get(name).copied();
            (found.is_none() || found != value)
                .then(|| format!("GPUNVME_{name}: CUDA {found:?}, {what} {value:?}"))
        })
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join("\n"))
    }
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
        m.extend(header_defines(TOOL_KERNELS_CU));
        m.extend(header_defines(CACHE_CUH));
        m
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
            ("QD_PI_NSID", offset_of!(QueueDesc, pi_nsid)),
            ("QD_PI_PRINFO", offset_of!(QueueDesc, pi_prinfo)),
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
            ("LAT_BUCKETS", LAT_BUCKETS),
            ("DONE_BIT", DONE_BIT as usize),
            ("HOST_ABORT", HOST_ABORT as usize),
        ];
        check_defines(&[HEADER, KERNELS_CU, TOOL_KERNELS_CU], want, "Rust layout").unwrap();
        for code in 0..9 {
            let name = match DeviceStatus::from_code(code) {
                DeviceStatus::Ok => "OK",
                DeviceStatus::Timeout => "TIMEOUT",
                DeviceStatus::NvmeError => "NVME_ERROR",
                DeviceStatus::QueueFailed => "QUEUE_FAILED",
                DeviceStatus::Aborted => "ABORTED",
                DeviceStatus::InvalidArgument => "INVALID_ARGUMENT",
                DeviceStatus::BadCompletion => "BAD_COMPLETION",
                DeviceStatus::OutOfExtent => "OUT_OF_EXTENT",
                DeviceStatus::CacheFull => "CACHE_FULL",
                DeviceStatus::Unknown(_) => unreachable!(),
            };
            assert_eq!(d.get(name).copied(), Some(code as u64), "GPUNVME_{name}");
        }
    }

    #[test]
    fn cache_header_matches_rust_layouts() {
        let want: &[(&str, usize)] = &[
            ("CACHE_DESC_SIZE", size_of::<CacheDesc>()),
            ("CD_FRAMES", offset_of!(CacheDesc, frames)),
            ("CD_FRAMES_BUS", offset_of!(CacheDesc, frames_bus)),
            ("CD_FRAME_STATES", offset_of!(CacheDesc, frame_states)),
            ("CD_STATE", offset_of!(CacheDesc, state)),
            ("CD_STATS", offset_of!(CacheDesc, stats)),
            ("CD_RANGES", offset_of!(CacheDesc, ranges)),
            ("CD_QUEUES", offset_of!(CacheDesc, queues)),
            ("CD_NFRAMES", offset_of!(CacheDesc, nframes)),
            ("CD_FULL_WAIT_NS", offset_of!(CacheDesc, full_wait_ns)),
            ("CD_NRANGES", offset_of!(CacheDesc, nranges)),
            ("CD_NQUEUES", offset_of!(CacheDesc, nqueues)),
            ("CD_PAGE_SHIFT", offset_of!(CacheDesc, page_shift)),
            ("CD_FLAGS", offset_of!(CacheDesc, flags)),
            ("CD_VOLUME", offset_of!(CacheDesc, volume)),
            ("VOLUME_MAX_MEMBERS", VOLUME_MAX_MEMBERS),
            ("VOLUME_DESC_SIZE", size_of::<VolumeDesc>()),
            ("VD_STRIPE_LBAS", offset_of!(VolumeDesc, stripe_lbas)),
            ("VD_LABEL_LBAS", offset_of!(VolumeDesc, label_lbas)),
            ("VD_NMEMBERS", offset_of!(VolumeDesc, nmembers)),
            (
                "VD_QUEUES_PER_MEMBER",
                offset_of!(VolumeDesc, queues_per_member),
            ),
            ("VD_NSID", offset_of!(VolumeDesc, nsid)),
            ("VD_FRAMES_BUS", offset_of!(VolumeDesc, frames_bus)),
            ("RANGE_DESC_SIZE", size_of::<RangeDesc>()),
            ("RD_ENTRIES", offset_of!(RangeDesc, entries)),
            ("RD_NPAGES", offset_of!(RangeDesc, npages)),
            ("RD_BYTES", offset_of!(RangeDesc, bytes)),
            ("RD_FIRST_LBA", offset_of!(RangeDesc, first_lba)),
            ("RD_TABLE", offset_of!(RangeDesc, table)),
            ("RD_NSID", offset_of!(RangeDesc, nsid)),
            ("RD_LBA_SHIFT", offset_of!(RangeDesc, lba_shift)),
            ("RD_FILE", offset_of!(RangeDesc, file)),
            ("RD_FLAGS", offset_of!(RangeDesc, flags)),
            ("PAGE_ENTRY_SIZE", size_of::<PageEntry>()),
            ("PE_STATE", offset_of!(PageEntry, state)),
            ("PE_FRAME", offset_of!(PageEntry, frame)),
            ("FRAME_STATE_SIZE", size_of::<FrameState>()),
            ("FRS_FLAGS", offset_of!(FrameState, flags)),
            ("FRS_RANGE", offset_of!(FrameState, range)),
            ("FRS_PAGE", offset_of!(FrameState, page)),
            ("CACHE_STATE_SIZE", size_of::<CacheState>()),
            ("CS_HAND", offset_of!(CacheState, hand)),
            ("CS_FIRST_STATUS", offset_of!(CacheState, first_status)),
            (
                "CS_FIRST_NVME_STATUS",
                offset_of!(CacheState, first_nvme_status),
            ),
            ("CS_FIRST_RANGE", offset_of!(CacheState, first_range)),
            ("CS_QUARANTINED", offset_of!(CacheState, quarantined)),
            ("CS_FIRST_PAGE", offset_of!(CacheState, first_page)),
            ("CACHE_STATS_SIZE", size_of::<CacheCounters>()),
            ("CACHE_STAT_SLOTS", CACHE_STAT_SLOTS),
            ("ST_HITS", offset_of!(CacheCounters, hits)),
            ("ST_MISSES", offset_of!(CacheCounters, misses)),
            ("ST_WAITS", offset_of!(CacheCounters, waits)),
            ("ST_EVICTIONS", offset_of!(CacheCounters, evictions)),
            ("ST_WRITEBACKS", offset_of!(CacheCounters, writebacks)),
            ("ST_READ_CMDS", offset_of!(CacheCounters, read_cmds)),
            ("ST_WRITE_CMDS", offset_of!(CacheCounters, write_cmds)),
            ("ST_FLUSH_CMDS", offset_of!(CacheCounters, flush_cmds)),
            ("ST_BYTES_READ", offset_of!(CacheCounters, bytes_read)),
            ("ST_BYTES_WRITTEN", offset_of!(CacheCounters, bytes_written)),
            ("ST_FULL", offset_of!(CacheCounters, full)),
            ("ST_ERRORS", offset_of!(CacheCounters, errors)),
        ];
        check_defines(&[CACHE_CUH], want, "Rust layout").unwrap();
        let bits: &[(&str, u32)] = &[
            ("PS_VALID", PS_VALID),
            ("PS_BUSY", PS_BUSY),
            ("PS_DIRTY", PS_DIRTY),
            ("PS_ERROR", PS_ERROR),
            ("PS_STATUS_SHIFT", PS_STATUS_SHIFT),
            ("PS_REFS_MASK", PS_REFS_MASK),
            ("FS_REF", FS_REF),
            ("FS_LOCKED", FS_LOCKED),
            ("FS_QUARANTINED", FS_QUARANTINED),
            ("FRAME_EMPTY", FRAME_EMPTY),
            ("CF_BOUNCE", CF_BOUNCE),
            ("RF_FILE", RF_FILE),
            ("RF_WRITABLE", RF_WRITABLE),
        ];
        check_defines(&[CACHE_CUH], bits, "Rust constant").unwrap();
    }

    #[test]
    fn header_matches_nvme_spec_wire_offsets() {
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
        check_defines(&[HEADER], want, "nvme_spec::wire").unwrap();
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
    fn latency_bucket_floors_rise_and_saturate_without_overflow() {
        let floors: Vec<u64> = (0..=LAT_BUCKETS).map(lat_bucket_floor).collect();
        assert!(floors.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(floors[LAT_BUCKETS], u64::MAX);
    }

    /// The runtime's kernels (every embedder loads them).
    const RUNTIME_KERNELS: &[&str] = &[
        "gpunvme_io_batch",
        "gpunvme_pattern",
        "gpunvme_warmup",
        "gpunvme_file_rw",
        "gpunvme_crc32c",
        "gpunvme_crc32c_combine",
        "gpunvme_cache_flush",
    ];

    /// The tools' kernels (perf, tests, benchmarks, examples).
    const TOOL_KERNELS: &[&str] = &[
        "gpunvme_perf",
        "gpunvme_rw_range",
        "gpunvme_cache_test",
        "gpunvme_cache_pin_test",
        "gpunvme_cache_bench",
        "gpunvme_cache_bench_scan",
        "gpunvme_cache_bfs_level",
        "gpunvme_cache_gather",
        "gpunvme_cache_bfs_heavy",
        "gpunvme_cache_bfs_up",
    ];

    fn has_entry(ptx: &str, k: &str) -> bool {
        ptx.contains(&format!(".entry {k}("))
    }

    #[test]
    fn ptx_is_embedded_with_every_kernel() {
        for k in RUNTIME_KERNELS {
            assert!(
                has_entry(KERNELS_PTX, k),
                "{k} missing from the runtime's PTX"
            );
            assert!(!has_entry(TOOL_KERNELS_PTX, k), "{k} in the tools' PTX too");
        }
        for k in TOOL_KERNELS {
            assert!(
                has_entry(TOOL_KERNELS_PTX, k),
                "{k} missing from the tools' PTX"
            );
            assert!(!has_entry(KERNELS_PTX, k), "{k} in the runtime's PTX");
        }
        for ptx in [KERNELS_PTX, TOOL_KERNELS_PTX] {
            assert!(ptx.contains(".target sm_80"));
            // The emulated controllers' kernels are not the runtime's.
            for k in ["gpunvme_scatter", "gpunvme_gather", "gpunvme_controller"] {
                assert!(!has_entry(ptx, k), "{k}");
            }
            assert!(ptx.contains("st.mmio.relaxed.sys.global.u32"));
        }
        // Every entry of either module is one the tests above name (a new kernel is placed
        // in one module or the other on purpose).
        for ptx in [KERNELS_PTX, TOOL_KERNELS_PTX] {
            for line in ptx.lines() {
                if let Some(rest) = line.trim_start().strip_prefix(".visible .entry ") {
                    let name = rest.split('(').next().unwrap_or_default();
                    assert!(
                        RUNTIME_KERNELS.contains(&name) || TOOL_KERNELS.contains(&name),
                        "{name} is in neither list"
                    );
                }
            }
        }
    }
}
