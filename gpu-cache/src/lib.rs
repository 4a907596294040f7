//! The host side of the page cache (`ptx/include/gpunvme_cache.cuh`, embedded as
//! [`gpu_queues::desc::CACHE_CUH`]): a BaM-style software cache in GPU memory over storage ranges,
//! through which GPU threads read elements (`gpunvme::array<T>`); hits are served from GPU
//! memory, the lanes of a warp on one page share one lookup, and only misses become NVMe
//! commands on the queues of a [`GpuQueues`]. Design: `docs/design/cache.md`.
//!
//! [`GpuCache`] allocates the frames (GPU memory the controller can reach, from
//! [`GpuQueues::alloc_buffer`]), the frame states, the per-range direct maps of page entries,
//! the shared words and the statistics slots, and hands kernels one pointer
//! ([`GpuCache::descriptor`]). Ranges are bound, and statistics read, **between kernels
//! only**: nothing here synchronises with a kernel that is running.
//!
//! Namespace LBA ranges and blockfs files (through their extent tables), reads and stores
//! (dirty pages written back on eviction and [`GpuCache::flush`]), fills straight into the
//! frames (the DIRECT data path: the software controller and the GPU-resident model, whose
//! buffers can be mapped after set-up), on one controller's queues or over a striped volume's
//! members ([`GpuCache::on_volume`]). On transports whose GPU memory is fixed at set-up (the
//! real-SSD transports), fills and write-backs go through the queues' slot buffers
//! instead, one copy each way (the BOUNCE data path, [`DataPath::Bounce`]).
//!
//! Layered as its CUDA header is (cache → files → queues): [`bind_file`] binds a blockfs file
//! (through its extent table in GPU memory, `blockfs_gpu`), [`volume_geometry`] and
//! [`bind_volume_file`] a striped volume's, all on the runtime's queues (`gpu_queues`).
#![forbid(unsafe_code)]

mod file;
mod volume;

pub use file::{bind_file, page_pieces};
pub use volume::{bind_volume_file, volume_geometry};

/// blockfs_gpu's test helpers (fragmented files on a memory device), shared.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../../blockfs/gpu/src/testutil.rs"]
mod testutil;

use std::ops::Range;
use std::time::Duration;

use zerocopy::IntoBytes;

use gpu_queues::desc::{
    CACHE_STAT_SLOTS, CF_BOUNCE, CacheCounters, CacheDesc, CacheState, DeviceStatus, FRAME_EMPTY,
    FS_LOCKED, FrameState, IoReq, PS_BUSY, PS_DIRTY, PS_ERROR, PS_REFS_MASK, PS_VALID, PageEntry,
    QueueDesc, RF_FILE, RF_WRITABLE, RangeDesc, VOLUME_MAX_MEMBERS, VolumeDesc,
};
use gpu_queues::error::GpuError;
use gpu_queues::ffi::Arg;
use gpu_queues::ffi::DeviceMemory;
use gpu_queues::kernels::IoBatch;
use gpu_queues::queues::{GpuBuffer, GpuQueues};

/// Smallest page size (the NVMe memory page).
pub const MIN_PAGE_SIZE: u32 = 4096;
/// Largest page size.
pub const MAX_PAGE_SIZE: u32 = 65536;
/// Most ranges one cache may bind (the device packs the range into a 16-bit key).
pub const MAX_RANGES: u32 = 4096;
/// Most pages of one range (the device packs the page into a 48-bit key).
pub const MAX_RANGE_PAGES: u64 = 1 << 48;

/// Where fills put the data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DataPath {
    /// DIRECT where the queues can map more GPU memory for the controller, else BOUNCE; BOUNCE
    /// also where their buffers are host memory mapped into the GPU (a served controller's:
    /// frames there would make every hit a read across PCIe).
    #[default]
    Auto,
    /// Commands move data straight between the device and the frames.
    Direct,
    /// Through the queues' slot buffers, for transports whose GPU memory is fixed at set-up:
    /// the frames are plain GPU memory, each command's data is copied between its slot buffer
    /// and the frame by the filling thread (one command in flight per fill, at most a slot
    /// buffer each).
    Bounce,
}

/// A file of an extent table in GPU memory, for [`GpuCache::bind_table`].
#[derive(Clone, Copy, Debug)]
pub struct TableRange {
    /// GPU pointer of the table (`gpunvme::fs::table_header`).
    pub table: u64,
    /// The file's index in the table.
    pub file: u32,
    /// The table's namespace.
    pub nsid: u32,
    /// The table's LBA size in bytes.
    pub lba_size: u32,
    /// Bytes of the file the cache serves: at most its length (or, writable, its allocation).
    pub bytes: u64,
    /// Whether kernels may store into it (the table's entry must allow device writes).
    pub writable: bool,
}

/// How to build a cache.
#[derive(Clone, Debug)]
pub struct CacheOptions {
    /// Bytes per page: a power of two from 4 KiB to 64 KiB, at most the queues' largest
    /// transfer and a multiple of every bound range's LBA size (default 4 KiB).
    pub page_size: u32,
    /// Bytes of frames (rounded down to whole pages; default 64 MiB).
    pub capacity: u64,
    /// The queues fills issue on, as indices into the [`GpuQueues`] (default all); warp `w`
    /// fills on the range's queue `w % len`.
    pub queues: Option<Range<usize>>,
    /// Where fills put the data (default [`DataPath::Auto`]).
    pub data_path: DataPath,
    /// How long a fill looks for a free frame before it returns `GPUNVME_CACHE_FULL` (default:
    /// the queues' timeout).
    pub full_wait: Option<Duration>,
    /// Ranges the cache may bind (1 to [`MAX_RANGES`]; default 16).
    pub max_ranges: u32,
}

impl Default for CacheOptions {
    fn default() -> Self {
        Self {
            page_size: 4096,
            capacity: 64 << 20,
            queues: None,
            data_path: DataPath::Auto,
            full_wait: None,
            max_ranges: 16,
        }
    }
}

/// A striped volume's layout as a cache over it needs it ([`GpuCache::on_volume`]; the file
/// layer builds it from a `blockfs::StripedVolume`): volume LBA `v` lives on member
/// `(v / stripe_lbas) % n` at LBA `label_lbas + (v / stripe_lbas / n) * stripe_lbas + v %
/// stripe_lbas`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeGeometry {
    /// LBAs per stripe unit.
    pub stripe_lbas: u64,
    /// LBAs before each member's data (its label).
    pub label_lbas: u64,
    /// Each member's namespace, in member order.
    pub nsids: Vec<u32>,
}

/// What a cache over a striped volume holds beyond a plain one.
struct VolumeParts {
    /// Each member's namespace, in member order.
    nsids: Vec<u32>,
    /// Queues per member (the cache's queues are the members', in member order).
    queues_per_member: usize,
    /// The `volume_desc`.
    _desc: DeviceMemory,
    /// The members' queue descriptors, side by side.
    _queue_descs: DeviceMemory,
    /// The frames mapped for members 1.. (member 0 allocated them).
    _mappings: Vec<GpuBuffer>,
}

/// A bound range: the `range` argument device calls take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RangeId(pub u32);

impl RangeId {
    /// The index kernels pass.
    pub fn index(self) -> u32 {
        self.0
    }
}

/// The first fill that failed, as the device recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheFailure {
    /// Its status.
    pub status: DeviceStatus,
    /// The CQE status field, for [`DeviceStatus::NvmeError`].
    pub nvme_status: u32,
    /// The range.
    pub range: u32,
    /// The page.
    pub page: u64,
}

/// What a cache did, summed over its statistics slots (since creation or
/// [`GpuCache::reset_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Hits, misses (successful fills), waits, evictions, commands, bytes, fills that found
    /// every frame referenced (`full`) and fills that failed otherwise (`errors`).
    pub counters: CacheCounters,
    /// Frames never to be reused: a fill on them timed out or was aborted, and its command
    /// might still write them.
    pub quarantined: u32,
    /// The first failed fill.
    pub first_failure: Option<CacheFailure>,
}

/// The geometry [`GpuCache::new`] derives from its options (a pure function, tested without
/// a GPU).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachePlan {
    /// Frames.
    pub nframes: u64,
    /// log2 of the page size.
    pub page_shift: u32,
    /// The queues fills issue on.
    pub queues: Range<usize>,
    /// Bound of a frame search, in nanoseconds.
    pub full_wait_ns: u64,
}

fn invalid(msg: String) -> GpuError {
    GpuError::InvalidArgument(msg)
}

/// Checks `opts` against queues of `max_transfer` bytes per command (`queues` of them, whose
/// waits are bounded at `timeout_ns`).
pub fn plan(
    opts: &CacheOptions,
    max_transfer: u32,
    queues: usize,
    timeout_ns: u64,
) -> Result<CachePlan, GpuError> {
    let p = opts.page_size;
    if !p.is_power_of_two() || !(MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&p) {
        return Err(invalid(format!(
            "cache page size {p}: a power of two from {MIN_PAGE_SIZE} to {MAX_PAGE_SIZE} bytes"
        )));
    }
    if p > max_transfer {
        return Err(invalid(format!(
            "cache page size {p} is more than one command moves on these queues ({max_transfer})"
        )));
    }
    let nframes = opts.capacity / p as u64;
    if nframes == 0 {
        return Err(invalid(format!(
            "cache capacity {} holds no {p}-byte page",
            opts.capacity
        )));
    }
    if nframes >= FRAME_EMPTY as u64 {
        return Err(invalid(format!(
            "cache of {nframes} frames: at most {} (32-bit frame numbers)",
            FRAME_EMPTY - 1
        )));
    }
    let q = opts.queues.clone().unwrap_or(0..queues);
    if q.is_empty() || q.end > queues {
        return Err(invalid(format!(
            "cache queues {q:?}: a non-empty range within the {queues} GPU queues"
        )));
    }
    if !(1..=MAX_RANGES).contains(&opts.max_ranges) {
        return Err(invalid(format!(
            "cache max_ranges {}: 1 to {MAX_RANGES}",
            opts.max_ranges
        )));
    }
    let full_wait_ns = match opts.full_wait {
        Some(d) => u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
        None => timeout_ns,
    };
    Ok(CachePlan {
        nframes,
        page_shift: p.trailing_zeros(),
        queues: q,
        full_wait_ns,
    })
}

/// Pages and bytes of a range of `blocks` LBAs of `lba_size` bytes from `first_lba`, cached
/// in `page_size` pages (the last page may be partial).
pub fn range_geometry(
    page_size: u32,
    lba_size: u32,
    first_lba: u64,
    blocks: u64,
) -> Result<(u64, u64), GpuError> {
    if !lba_size.is_power_of_two() || !(512..=4096).contains(&lba_size) {
        return Err(invalid(format!(
            "LBA size {lba_size}: a power of two from 512 to 4096"
        )));
    }
    if page_size % lba_size != 0 {
        return Err(invalid(format!(
            "cache page size {page_size} is not a multiple of the LBA size {lba_size}"
        )));
    }
    if blocks == 0 || first_lba.checked_add(blocks).is_none() {
        return Err(invalid(format!(
            "LBA range {first_lba}+{blocks}: empty or past the end of LBA space"
        )));
    }
    let bytes = blocks
        .checked_mul(lba_size as u64)
        .ok_or_else(|| invalid(format!("LBA range of {blocks} blocks overflows")))?;
    let npages = bytes.div_ceil(page_size as u64);
    if npages > MAX_RANGE_PAGES {
        return Err(invalid(format!(
            "range of {npages} pages: at most {MAX_RANGE_PAGES}"
        )));
    }
    Ok((npages, bytes))
}

/// Byte offsets of the cache's shared words in its control allocation (which starts at least
/// 256-byte aligned). The statistics slots start on a 128-byte boundary so that each slot is one
/// L2 line of its own: slots exist to spread the counters' atomics, and a slot straddling two
/// lines would share them with its neighbours.
const OFF_DESC: usize = 0;
const OFF_STATE: usize = 128;
const OFF_STATS: usize = (OFF_STATE + size_of::<CacheState>()).next_multiple_of(128);
const OFF_RANGES: usize = OFF_STATS + CACHE_STAT_SLOTS * size_of::<CacheCounters>();

/// A page cache in GPU memory over ranges of storage, filled through GPU queues.
pub struct GpuCache<'q> {
    queues: &'q GpuQueues,
    desc: CacheDesc,
    /// The descriptor, the shared words, the statistics slots and the range descriptors.
    control: DeviceMemory,
    frame_states: DeviceMemory,
    frames: Frames,
    /// Page entries of each bound range.
    entries: Vec<DeviceMemory>,
    ranges: Vec<RangeDesc>,
    max_ranges: u32,
    data_path: DataPath,
    /// The wait bound of the queues fills use, in nanoseconds.
    queue_timeout_ns: u64,
    /// What keeps bound tables alive (see [`GpuCache::bind_table`]); dropped after the frames'
    /// last write-back.
    keep: Vec<Box<dyn Send + Sync>>,
    /// Over a striped volume: the members' queues and what the device's `volume_desc` needs.
    volume: Option<VolumeParts>,
}

impl std::fmt::Debug for GpuCache<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuCache")
            .field("page_size", &self.page_size())
            .field("frames", &self.desc.nframes)
            .field("ranges", &self.ranges.len())
            .field("data_path", &self.data_path)
            .finish()
    }
}

impl<'q> GpuCache<'q> {
    /// Builds an empty cache that fills on `queues` (see [`CacheOptions`]).
    pub fn new(queues: &'q GpuQueues, opts: CacheOptions) -> Result<Self, GpuError> {
        let descs: Vec<QueueDesc> = queues.descs();
        // The default frame-search bound is the wait bound of the first queue fills use (a
        // missing one is refused by `plan`, so the fallback is never used).
        let first = opts.queues.as_ref().map_or(0, |q| q.start);
        let timeout_ns = descs.get(first).map_or(10_000_000_000, |d| d.timeout_ns);
        let plan = plan(&opts, queues.max_transfer(), descs.len(), timeout_ns)?;
        let frame_bytes = usize::try_from(plan.nframes << plan.page_shift)
            .map_err(|_| invalid("cache capacity exceeds the address space".into()))?;
        let cuda = queues.cuda();
        let frames = match opts.data_path {
            DataPath::Bounce => Frames::Bounce(DeviceMemory::alloc(cuda, frame_bytes)?),
            DataPath::Direct => Frames::Direct(queues.alloc_buffer(frame_bytes)?),
            DataPath::Auto if queues.buffers_in_host_memory() => {
                Frames::Bounce(DeviceMemory::alloc(cuda, frame_bytes)?)
            }
            DataPath::Auto => match queues.alloc_buffer(frame_bytes) {
                Ok(b) => Frames::Direct(b),
                Err(GpuError::Unsupported(_)) => {
                    Frames::Bounce(DeviceMemory::alloc(cuda, frame_bytes)?)
                }
                Err(e) => return Err(e),
            },
        };
        if let Frames::Bounce(_) = frames {
            check_bounce(&descs[plan.queues.clone()])?;
        }
        let control = DeviceMemory::alloc(
            cuda,
            OFF_RANGES + opts.max_ranges as usize * size_of::<RangeDesc>(),
        )?;
        let nframes = plan.nframes as usize;
        let frame_states = DeviceMemory::alloc(cuda, nframes * size_of::<FrameState>())?;
        let empty = vec![
            FrameState {
                flags: 0,
                range: FRAME_EMPTY,
                page: 0,
            };
            nframes
        ];
        frame_states.write(0, empty.as_bytes())?;
        let (frames_bus, flags, data_path) = match &frames {
            Frames::Direct(b) => (b.bus(), 0, DataPath::Direct),
            Frames::Bounce(_) => (0, CF_BOUNCE, DataPath::Bounce),
        };
        let desc = CacheDesc {
            frames: frames.ptr(),
            frames_bus,
            frame_states: frame_states.ptr(),
            state: control.ptr() + OFF_STATE as u64,
            stats: control.ptr() + OFF_STATS as u64,
            ranges: control.ptr() + OFF_RANGES as u64,
            queues: queues.descriptors() + (plan.queues.start * size_of::<QueueDesc>()) as u64,
            nframes: plan.nframes,
            full_wait_ns: plan.full_wait_ns,
            nranges: 0,
            nqueues: plan.queues.len() as u32,
            page_shift: plan.page_shift,
            flags,
            volume: 0,
            reserved: [0; 4],
        };
        control.write(OFF_DESC, desc.as_bytes())?;
        Ok(Self {
            queues,
            desc,
            control,
            frame_states,
            frames,
            entries: Vec::new(),
            ranges: Vec::new(),
            max_ranges: opts.max_ranges,
            data_path,
            queue_timeout_ns: timeout_ns,
            keep: Vec::new(),
            volume: None,
        })
    }

    /// Builds an empty cache over a striped volume whose members' GPU queues are `members` (in
    /// member order, one namespace each as `geometry` says): ranges bound to it are in volume
    /// LBAs (namespace ranges) or come from a table of volume LBAs (files), and every command
    /// of a fill or write-back is cut at stripe units and issued on the member that holds the
    /// piece, on the queue in the warp's place among that member's queues
    /// ([`CacheOptions::queues`] picks the same queues of every member). The frames are
    /// allocated through the first member's queues and mapped for the others. Every member
    /// needs the same queues; 1 to 16 members.
    pub fn on_volume(
        members: &[&'q GpuQueues],
        geometry: &VolumeGeometry,
        opts: CacheOptions,
    ) -> Result<Self, GpuError> {
        let n = members.len();
        if n == 0 || n > VOLUME_MAX_MEMBERS || geometry.nsids.len() != n {
            return Err(invalid(format!(
                "a volume cache over {n} members with {} namespaces (1 to {VOLUME_MAX_MEMBERS} \
                 members, a namespace each)",
                geometry.nsids.len()
            )));
        }
        if geometry.stripe_lbas == 0 {
            return Err(invalid("a stripe unit of 0 LBAs".into()));
        }
        if let Some(&bad) = geometry.nsids.iter().find(|&&ns| ns == 0 || ns == u32::MAX) {
            return Err(invalid(format!("namespace id {bad:#x}")));
        }
        let first = members[0];
        let mut cache = Self::new(first, opts)?;
        let start =
            ((cache.desc.queues - first.descriptors()) / size_of::<QueueDesc>() as u64) as usize;
        let qpm = cache.desc.nqueues as usize;
        let range = start..start + qpm;
        let mut descs = Vec::with_capacity(n * qpm);
        for (m, q) in members.iter().enumerate() {
            let d = q.descs();
            let Some(part) = d.get(range.clone()) else {
                return Err(invalid(format!(
                    "volume member {m} has {} GPU queues; the cache uses queues {range:?} of \
                     every member",
                    d.len()
                )));
            };
            descs.extend_from_slice(part);
        }
        let cuda = first.cuda();
        let queue_descs = DeviceMemory::alloc(cuda, descs.len() * size_of::<QueueDesc>())?;
        queue_descs.write(0, descs.as_bytes())?;
        // The frames on every member's controller: member 0 allocated them; the others map the
        // same memory (its start may lie before the frames'). On the BOUNCE path no controller
        // reaches them: each member's fills go through its own queues' slot buffers.
        let mut frames_bus = [0u64; VOLUME_MAX_MEMBERS];
        let mut mappings = Vec::with_capacity(n - 1);
        if let Frames::Direct(direct) = &cache.frames {
            frames_bus[0] = cache.desc.frames_bus;
            let mem = direct.shared_memory().clone();
            let lead = direct.ptr() - mem.ptr();
            let frame_bytes = cache.desc.nframes << cache.desc.page_shift;
            for (m, q) in members.iter().enumerate().skip(1) {
                let b = q.map_memory(mem.clone())?;
                if (b.len() as u64) < lead + frame_bytes {
                    return Err(GpuError::Unsupported(format!(
                        "volume member {m} maps {} bytes of the cache's {} bytes of frames",
                        b.len(),
                        lead + frame_bytes
                    )));
                }
                frames_bus[m] = b.bus() + lead;
                mappings.push(b);
            }
        } else {
            // Member 0's queues were checked by `new`.
            for (m, q) in members.iter().enumerate().skip(1) {
                check_bounce(&q.descs()[range.clone()]).map_err(|e| match e {
                    GpuError::Unsupported(why) => {
                        GpuError::Unsupported(format!("volume member {m}: {why}"))
                    }
                    e => e,
                })?;
            }
        }
        let mut nsid = [0u32; VOLUME_MAX_MEMBERS];
        nsid[..n].copy_from_slice(&geometry.nsids);
        let vd = VolumeDesc {
            stripe_lbas: geometry.stripe_lbas,
            label_lbas: geometry.label_lbas,
            nmembers: n as u32,
            queues_per_member: qpm as u32,
            nsid,
            frames_bus,
        };
        let vmem = DeviceMemory::alloc(cuda, size_of::<VolumeDesc>())?;
        vmem.write(0, vd.as_bytes())?;
        cache.desc.queues = queue_descs.ptr();
        cache.desc.nqueues = (n * qpm) as u32;
        cache.desc.volume = vmem.ptr();
        cache.control.write(OFF_DESC, cache.desc.as_bytes())?;
        cache.volume = Some(VolumeParts {
            nsids: geometry.nsids.clone(),
            queues_per_member: qpm,
            _desc: vmem,
            _queue_descs: queue_descs,
            _mappings: mappings,
        });
        Ok(cache)
    }

    /// Over a striped volume: its members, and the queues per member.
    pub fn volume_members(&self) -> Option<(usize, usize)> {
        self.volume
            .as_ref()
            .map(|v| (v.nsids.len(), v.queues_per_member))
    }

    /// Binds `blocks` LBAs of `lba_size` bytes from `first_lba` of namespace `nsid`; kernels
    /// reach it as range [`RangeId::index`], and may store into it when `writable` (dirty pages
    /// reach the device when evicted and on [`GpuCache::flush`]). Between kernels only.
    pub fn bind_lba_range(
        &mut self,
        nsid: u32,
        lba_size: u32,
        first_lba: u64,
        blocks: u64,
        writable: bool,
    ) -> Result<RangeId, GpuError> {
        let (npages, bytes) = range_geometry(self.page_size(), lba_size, first_lba, blocks)?;
        self.bind(
            RangeDesc {
                npages,
                bytes,
                first_lba,
                nsid,
                lba_shift: lba_size.trailing_zeros(),
                flags: if writable { RF_WRITABLE } else { 0 },
                ..Default::default()
            },
            None,
        )
    }

    /// Binds a file of an extent table in GPU memory (`gpunvme_file.cuh`'s layout): fills find
    /// a page's LBAs through the table. `keep` is held until the cache is closed or dropped:
    /// whatever keeps the table's memory alive and its blocks out of reuse (the file layer's
    /// `blockfs_gpu::cache::bind_file` passes the file's pinned table). Between kernels only.
    pub fn bind_table(
        &mut self,
        t: TableRange,
        keep: Box<dyn Send + Sync>,
    ) -> Result<RangeId, GpuError> {
        if t.table == 0 || t.table % 8 != 0 {
            return Err(invalid(format!("extent table pointer {:#x}", t.table)));
        }
        if t.bytes == 0 {
            return Err(invalid("an empty file has no pages to cache".into()));
        }
        let blocks = t.bytes.div_ceil(t.lba_size as u64);
        let (npages, _) = range_geometry(self.page_size(), t.lba_size, 0, blocks)?;
        self.bind(
            RangeDesc {
                npages,
                bytes: t.bytes,
                table: t.table,
                nsid: t.nsid,
                lba_shift: t.lba_size.trailing_zeros(),
                file: t.file,
                flags: RF_FILE | if t.writable { RF_WRITABLE } else { 0 },
                ..Default::default()
            },
            Some(keep),
        )
    }

    /// Allocates the page entries of range `r` (npages set) and publishes it.
    fn bind(
        &mut self,
        mut r: RangeDesc,
        keep: Option<Box<dyn Send + Sync>>,
    ) -> Result<RangeId, GpuError> {
        if self.ranges.len() >= self.max_ranges as usize {
            return Err(invalid(format!(
                "the cache binds at most {} ranges (CacheOptions::max_ranges)",
                self.max_ranges
            )));
        }
        // Over a volume the members' namespaces are the volume's (VolumeGeometry); a range's
        // own is the table's (unused by fills).
        if self.volume.is_none() && (r.nsid == 0 || r.nsid == u32::MAX) {
            return Err(invalid(format!("namespace id {:#x}", r.nsid)));
        }
        let len = usize::try_from(r.npages * size_of::<PageEntry>() as u64).map_err(|_| {
            invalid(format!(
                "{} page entries exceed the address space",
                r.npages
            ))
        })?;
        let entries = DeviceMemory::alloc(self.queues.cuda(), len.max(8))?;
        r.entries = entries.ptr();
        let id = self.ranges.len() as u32;
        self.control.write(
            OFF_RANGES + id as usize * size_of::<RangeDesc>(),
            r.as_bytes(),
        )?;
        self.desc.nranges = id + 1;
        self.control.write(OFF_DESC, self.desc.as_bytes())?;
        self.entries.push(entries);
        self.ranges.push(r);
        self.keep.extend(keep);
        Ok(RangeId(id))
    }

    /// GPU pointer of the cache's descriptor: the argument kernels take
    /// (`const gpunvme::cache::cache_desc*`).
    pub fn descriptor(&self) -> u64 {
        self.control.ptr() + OFF_DESC as u64
    }

    /// The data path fills take.
    pub fn data_path(&self) -> DataPath {
        self.data_path
    }

    /// Frames.
    pub fn nframes(&self) -> u64 {
        self.desc.nframes
    }

    /// Bytes per page.
    pub fn page_size(&self) -> u32 {
        1 << self.desc.page_shift
    }

    /// The descriptor of a bound range.
    pub fn range(&self, id: RangeId) -> Option<RangeDesc> {
        self.ranges.get(id.0 as usize).copied()
    }

    /// The statistics, summed over the slots (between kernels).
    pub fn stats(&self) -> Result<CacheStats, GpuError> {
        let mut slots = vec![CacheCounters::default(); CACHE_STAT_SLOTS];
        self.control.read(OFF_STATS, slots.as_mut_bytes())?;
        let mut state = CacheState::default();
        self.control.read(OFF_STATE, state.as_mut_bytes())?;
        let mut s = CacheStats {
            quarantined: state.quarantined,
            first_failure: (state.first_status != 0).then(|| CacheFailure {
                status: DeviceStatus::from_code(state.first_status),
                nvme_status: state.first_nvme_status,
                range: state.first_range,
                page: state.first_page,
            }),
            ..CacheStats::default()
        };
        for x in &slots {
            s.counters.add(x);
        }
        Ok(s)
    }

    /// Zeroes the statistics and the first-failure record (not the quarantine count, which
    /// describes frames, nor the clock hand). Between kernels.
    pub fn reset_stats(&self) -> Result<(), GpuError> {
        let zero = vec![0u8; CACHE_STAT_SLOTS * size_of::<CacheCounters>()];
        self.control.write(OFF_STATS, &zero)?;
        let mut state = CacheState::default();
        self.control.read(OFF_STATE, state.as_mut_bytes())?;
        state.first_status = 0;
        state.first_nvme_status = 0;
        state.first_range = 0;
        state.first_page = 0;
        self.control.write(OFF_STATE, state.as_bytes())
    }

    /// Writes every dirty page back (`gpunvme_cache_flush`: the frames shared among GPU
    /// threads, each write on the queues fills use), then sends one NVMe Flush per namespace
    /// with a writable range, so the data is on stable media when it returns. Between kernels:
    /// a store during the flush may stay dirty. Every wait is bounded (the kernel by the
    /// queues' own bounds; the host by twice the queue timeout per step).
    pub fn flush(&self) -> Result<FlushReport, GpuError> {
        let q = self.queues;
        let before = self.stats()?.counters;
        let out = DeviceMemory::alloc(q.cuda(), 4)?;
        let threads = self
            .desc
            .nframes
            .div_ceil(64)
            .clamp(32, 8192)
            .next_multiple_of(32);
        let block = threads.min(256) as u32;
        let bound = self.wait_bound();
        let stream = q.client_stream();
        stream.launch(
            q.kernels().cache_flush,
            threads.div_ceil(block as u64) as u32,
            block,
            &[Arg::U64(self.descriptor()), Arg::U64(out.ptr())],
        )?;
        stream.wait_idle(bound)?;
        let mut code = [0u8; 4];
        out.read(0, &mut code)?;
        let status = DeviceStatus::from_code(u32::from_le_bytes(code));
        if status != DeviceStatus::Ok {
            return Err(GpuError::Device {
                status,
                nvme_status: self
                    .stats()?
                    .first_failure
                    .map_or(0, |f| f.nvme_status as u16),
            });
        }
        // One Flush per namespace with a writable range (over a volume, per member), after
        // every write-back completed (the kernel boundary orders them).
        let writable = self.ranges.iter().any(|r| r.flags & RF_WRITABLE != 0);
        let targets: Vec<(u32, u64)> = match &self.volume {
            // Member m's queues start at its m * qpm-th descriptor among the cache's.
            Some(v) if writable => (0..v.nsids.len())
                .map(|m| {
                    let first = m * v.queues_per_member * size_of::<QueueDesc>();
                    (v.nsids[m], self.desc.queues + first as u64)
                })
                .collect(),
            Some(_) => Vec::new(),
            None => {
                let mut nsids: Vec<u32> = self
                    .ranges
                    .iter()
                    .filter(|r| r.flags & RF_WRITABLE != 0)
                    .map(|r| r.nsid)
                    .collect();
                nsids.sort_unstable();
                nsids.dedup();
                nsids.into_iter().map(|ns| (ns, self.desc.queues)).collect()
            }
        };
        for &(nsid, qdesc) in &targets {
            let req = IoReq {
                nsid,
                opcode: 0, // Flush
                ..IoReq::default()
            };
            let batch = IoBatch::new(q.cuda(), &[req])?;
            batch.launch(q.kernels(), stream, qdesc, 1, false)?;
            stream.wait_idle(bound)?;
            let (status, sf) = batch.results()?[0];
            if status != DeviceStatus::Ok {
                return Err(GpuError::Device {
                    status,
                    nvme_status: sf as u16,
                });
            }
        }
        let after = self.stats()?.counters;
        Ok(FlushReport {
            pages_written: after.writebacks - before.writebacks,
            bytes_written: after.bytes_written - before.bytes_written,
            flush_cmds: targets.len() as u32,
        })
    }

    /// Pages that hold stores not yet written back (between kernels).
    pub fn dirty_pages(&self) -> Result<u64, GpuError> {
        let mut n = 0;
        for (r, mem) in self.ranges.iter().zip(&self.entries) {
            if r.flags & RF_WRITABLE == 0 {
                continue;
            }
            let mut e = vec![PageEntry::default(); r.npages as usize];
            mem.read(0, e.as_mut_bytes())?;
            n += e.iter().filter(|e| e.state & PS_DIRTY != 0).count() as u64;
        }
        Ok(n)
    }

    /// Flushes, then takes the cache down.
    pub fn close(self) -> Result<FlushReport, GpuError> {
        self.flush()
    }

    /// The host's bound on one kernel of the cache: twice the queues' wait bound, plus the
    /// bound of the kernel's own work ([`gpu_queues::queues::compute_wait_bound`]).
    fn wait_bound(&self) -> Duration {
        Duration::from_nanos(self.queue_timeout_ns.saturating_mul(2))
            + gpu_queues::queues::compute_wait_bound()
    }

    /// Checks the cache's structures between kernels (for tests): no page held, filling or in
    /// error, no frame locked, and every valid page and its frame naming each other. Returns
    /// the first problems found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let read_err = |e: GpuError| format!("reading the cache: {e}");
        let nframes = self.desc.nframes as usize;
        let mut frames = vec![FrameState::default(); nframes];
        self.frame_states
            .read(0, frames.as_mut_bytes())
            .map_err(read_err)?;
        let mut entries = Vec::with_capacity(self.ranges.len());
        for (r, mem) in self.ranges.iter().zip(&self.entries) {
            let mut e = vec![PageEntry::default(); r.npages as usize];
            mem.read(0, e.as_mut_bytes()).map_err(read_err)?;
            entries.push(e);
        }
        let problems = invariant_problems(&self.ranges, &entries, &frames);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

impl Drop for GpuCache<'_> {
    fn drop(&mut self) {
        // Writing back here could block or fail with nowhere to report it: say so instead.
        match self.dirty_pages() {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                pages = n,
                "a GPU page cache dropped with dirty pages: they are lost (call flush or close)"
            ),
            Err(e) => tracing::warn!(error = %e, "a GPU page cache dropped unchecked"),
        }
    }
}

/// What [`GpuCache::flush`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Dirty pages written back.
    pub pages_written: u64,
    /// Their bytes.
    pub bytes_written: u64,
    /// NVMe Flush commands sent (one per namespace with a writable range).
    pub flush_cmds: u32,
}

/// Everything [`GpuCache::check_invariants`] finds wrong (at most 8 problems).
fn invariant_problems(
    ranges: &[RangeDesc],
    entries: &[Vec<PageEntry>],
    frames: &[FrameState],
) -> Vec<String> {
    let mut out = Vec::new();
    let mut owner: Vec<Option<(usize, usize)>> = vec![None; frames.len()];
    for (r, es) in entries.iter().enumerate() {
        for (p, e) in es.iter().enumerate() {
            let refs = e.state & PS_REFS_MASK;
            if refs != 0 || e.state & (PS_BUSY | PS_ERROR) != 0 {
                out.push(format!(
                    "range {r} page {p}: state {:#010x} (held, filling or failed)",
                    e.state
                ));
            }
            if e.state & PS_VALID != 0 {
                let f = e.frame as usize;
                match frames.get(f) {
                    None => out.push(format!("range {r} page {p}: frame {f} out of range")),
                    Some(fs) if (fs.range as usize, fs.page as usize) != (r, p) => {
                        out.push(format!(
                            "range {r} page {p} is valid in frame {f}, which names range {} page {}",
                            fs.range, fs.page
                        ))
                    }
                    Some(_) => {
                        if let Some((r2, p2)) = owner[f].replace((r, p)) {
                            out.push(format!(
                                "frame {f} holds range {r2} page {p2} and range {r} page {p}"
                            ));
                        }
                    }
                }
            }
        }
    }
    for (f, fs) in frames.iter().enumerate() {
        if fs.flags & FS_LOCKED != 0 {
            out.push(format!("frame {f} left locked"));
        }
        if fs.range != FRAME_EMPTY {
            let (r, p) = (fs.range as usize, fs.page as usize);
            let ok = ranges.get(r).is_some()
                && entries
                    .get(r)
                    .and_then(|es| es.get(p))
                    .is_some_and(|e| e.state & PS_VALID != 0 && e.frame as usize == f);
            if !ok {
                out.push(format!(
                    "frame {f} names range {r} page {p}, which is not valid in it"
                ));
            }
        }
    }
    out.truncate(8);
    out
}

/// The BOUNCE data path moves every command's data through its ticket's slot buffer: each
/// queue a cache fills on needs them (whole 4 KiB pages: any LBA size fits).
fn check_bounce(descs: &[QueueDesc]) -> Result<(), GpuError> {
    match descs
        .iter()
        .position(|d| d.slot_buffers == 0 || d.slot_buffer_bytes < MIN_PAGE_SIZE)
    {
        Some(i) => Err(GpuError::Unsupported(format!(
            "the page cache's BOUNCE data path needs slot buffers of at least {MIN_PAGE_SIZE} \
             bytes on every queue it fills on; queue {i} of them has {}",
            descs[i].slot_buffer_bytes
        ))),
        None => Ok(()),
    }
}

/// The frames' memory.
enum Frames {
    /// Mapped for the controller: commands move data straight in and out (DIRECT).
    Direct(GpuBuffer),
    /// Plain GPU memory, filled and written back through slot buffers (BOUNCE).
    Bounce(DeviceMemory),
}

impl Frames {
    fn ptr(&self) -> u64 {
        match self {
            Frames::Direct(b) => b.ptr(),
            Frames::Bounce(m) => m.ptr(),
        }
    }
}

#[cfg(test)]
mod tests;
