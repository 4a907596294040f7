// gpunvme_cache.cuh — a BaM-style page cache in GPU memory over storage ranges, and
// gpunvme::array<T>: GPU threads index storage as arrays, hits are served from GPU memory, warp
// accesses to one page are coalesced, and only misses become NVMe commands (on gpunvme.cuh's
// queues). Design and its reasons: docs/design/cache.md.
//
// Header-only, namespace gpunvme::cache (and gpunvme::array), no host state; nothing traps,
// prints or waits without a bound: every call returns a gpunvme::status. The host side is the
// Rust module gpu_queues::cache (GpuCache), which allocates the structures below, binds ranges
// and reads the statistics between kernels.
//
// Layout contract: the structs below are mirrored by #[repr(C)] structs in gpu-queues/src/desc.rs
// (CacheDesc, RangeDesc, PageEntry, FrameState, CacheState, CacheStats); the GPUNVME_* numbers
// are checked here by static_assert and on the Rust side by a test that parses this file.
//
// THE CACHE:
//  * Translation: one 8-byte page_entry per page of each bound range (a direct map, BaM's):
//    lookup is one atomic, and miss deduplication is one compare-and-swap on the entry. The
//    entry is ONE 64-bit word, changed only by 64-bit atomics: bits 31:0 the page state word
//    below, bits 63:32 the frame that holds the page while it is VALID (0 otherwise), so that
//    the hit path's atomic returns the frame with the state (a separate frame load after it
//    was an L2 round trip on every hit).
//  * Page state word (bits 31:0 of the entry), changed only by atomics:
//      bit 31 VALID   the frame page_entry.frame holds the page's bytes
//      bit 30 BUSY    one thread owns the page's fill
//      bit 29 DIRTY   the frame holds stores not yet written back
//      bit 28 ERROR   the last fill failed; bits 27:24 hold the status every holder returns
//      23:0   refs    threads holding OR WAITING FOR the page: a page someone waits for is
//                     never evicted.
//    Legal values: refs (INVALID), BUSY|refs (filling), VALID|refs, VALID|DIRTY|refs,
//    VALID|BUSY[|DIRTY]|refs (a write-back in flight: reads and stores go on), ERROR|code|refs.
//  * Frames: nframes frames of page_size bytes (one allocation the controller can reach; on the
//    BOUNCE data path plain GPU memory, filled through the queues' slot buffers), each
//    with a frame_state {flags, owner range, owner page}; flags FS_REF (clock bit), FS_LOCKED
//    (an evictor or filler owns the frame: only ever tried, never waited for), FS_QUARANTINED
//    (a fill on it timed out or was aborted: the command may still write it, so it is never
//    reused). The owner fields are written only under FS_LOCKED. Invariant: a frame whose owner
//    is a page (not GPUNVME_FRAME_EMPTY) holds it, and that page is VALID with the entry's frame
//    bits naming the frame; a failed fill resets the owner to EMPTY before unlocking.
//  * Replacement: a clock over the frames (cache_state.hand, one fetch_add per step): locked or
//    quarantined frames are skipped, a set REF bit is cleared (second chance), otherwise the
//    frame is try-locked and its page evicted by one exact CAS VALID -> 0, which fails if anyone
//    holds or waits for it. The search is bounded by full_wait_ns and the host's abort word: a
//    cache whose every frame is referenced returns GPUNVME_CACHE_FULL, never spins forever.
//
// TRANSITIONS (r = refs, n = the lanes of one warp on the page; their leader acts for them):
//   1 any -> +n            leader: fetch_add(n, acquire); the old value decides: VALID -> hit,
//                          ERROR -> 5, BUSY -> wait, else -> 2
//   2 r -> BUSY|r          the filler: CAS (acquire) from a value without VALID|BUSY|ERROR;
//                          at most one thread wins per fill episode (losers wait)
//   3 BUSY|r -> VALID|r    filler, data in the frame: fetch_add(VALID - BUSY + frame << 32,
//                          release): the frame bits were 0, so the add sets them
//   4 BUSY|r -> ERROR|c|r  filler, fill failed: fetch_add(ERROR + (c << 24) - BUSY, release)
//   5 ERROR|c|r -> r - n   every holder: fetch_sub(n); whoever leaves refs 0 CASes ERROR|c -> 0
//                          (a failed CAS means a newcomer, who does it on its way out); the
//                          next access after that retries the read
//   6 VALID|r -> r - n     leader after its lanes read: fetch_sub(n, release)
//   7 VALID.. -> |DIRTY    leader after its lanes stored: fetch_or(DIRTY, release), then 6
//   8 VALID -> 0           evictor, exact (r = 0, clean, the frame bits its frame): CAS acq_rel
//                          (clears the frame bits)
//   9 VALID|DIRTY -> VALID|BUSY   evictor, exact (r = 0): CAS acquire (DIRTY cleared before
//                          the write; the acquire orders the writers' stores before its DMA)
//  9f VALID|DIRTY|r -> VALID|BUSY|r   flusher (any r), holding the frame's lock: CAS acquire
//  10 VALID|BUSY.. -> VALID..     after a write-back (flusher; evictor that lost 11):
//                          fetch_sub(BUSY, release); a DIRTY set meanwhile by a writer stays
//  11 VALID|BUSY -> 0      evictor after its write-back, exact (r = 0, clean): CAS acq_rel
//  12 VALID|BUSY.. -> VALID|DIRTY..   write-back failed: CAS loop; the page stays cached
//
// FENCE DISCIPLINE (PTX ISA 9.0, "Memory Consistency Model"; on top of gpunvme.cuh's):
//  fill:  atom.cas.acquire entry(BUSY) -> atom.cas.acquire frame(LOCKED) -> st owner,
//         st entry.frame -> fill_slot st.release ticket -> publisher fence (sys | gpu) ->
//         doorbell -> device DMA into the frame -> reaper ld phase, fence (sys | gpu),
//         st.release slot.done -> filler ld.acquire slot.done -> atom.add.release entry
//         (VALID - BUSY) -> st.release frame.flags (REF)
//  hit:   ld.global.nc descriptors (cache::view_nc, before the lookup) -> atom.add.acquire.u64
//         entry (sees VALID and the frame; the gpu-scope acquire also invalidates the SM's L1)
//         -> ld frame data -> __syncwarp(peers) -> leader red.add.release.
//         Frames are NEVER read through the non-coherent path (ld.global.nc, __ldg, const
//         __restrict__): a reused frame would return the previous page's bytes.
//  store: as hit, st frame data -> __syncwarp(peers) -> leader atom.or.release DIRTY ->
//         atom.sub.release.
//  write-back: writers' atom.or.release DIRTY -> evictor / flusher atom.cas.acquire ->
//         fill_slot st.release -> publisher fence (sys | gpu) -> doorbell -> device reads the
//         frame.
//  evict -> reuse: holders' atom.sub.release -> evictor atom.cas.acq_rel (VALID -> 0) ->
//         fill_slot st.release -> publisher fence -> doorbell -> the device writes the frame
//         (every holder's reads came first).
//  BOUNCE (cache_desc.flags GPUNVME_CF_BOUNCE: frames the controller cannot reach): the fill
//         and write-back above with the slot buffer of each command's ticket in the frame's
//         place: a write-back's copies frame -> slot buffer come before fill_slot's st.release;
//         a fill's copies slot buffer -> frame after the filler's ld.acquire slot.done and
//         before its st.release slot.released and its atom.add.release (VALID - BUSY), which
//         publishes them with the page (rw_thread_bounce).
//  The fences between the queue and its controller are gpunvme.cuh's (system scope, or GPU
//  scope for the GPU-resident controller model).
//
// WAITING AND DEADLOCK. A page waiter waits (bounded by 2 x the queue's timeout, and the host's
// abort word) for that page's filler, a running thread; a filler waits for its queue (one
// ticket at a time: gpunvme.cuh's rule) and for a free frame (bounded by full_wait_ns). Entry
// BUSY, frame LOCKED and victim entries are only ever tried. A warp runs its own fills before
// its lanes wait for other warps' fills, so two warps never wait on each other. array::load
// holds no page while it looks for a frame: hits read and release before the warp's fills,
// and fills run in rounds (a fill that finds no frame soon is given back, the pages already
// filled are read and released, then it retries), so any cache with a frame free of
// in-flight fills makes progress. acquire_warp / acquire_thread callers hold pages by
// contract: a warp holding up to 32 pages while others look for frames can exhaust a small
// cache, and the search then ends in GPUNVME_CACHE_FULL after full_wait_ns (a status, not a
// hang).
#pragma once

#include "gpunvme.cuh"
#include "gpunvme_file.cuh"

// Layout of the structs shared with Rust (gpu-queues/src/desc.rs).
#define GPUNVME_CACHE_DESC_SIZE 128
#define GPUNVME_CD_FRAMES 0
#define GPUNVME_CD_FRAMES_BUS 8
#define GPUNVME_CD_FRAME_STATES 16
#define GPUNVME_CD_STATE 24
#define GPUNVME_CD_STATS 32
#define GPUNVME_CD_RANGES 40
#define GPUNVME_CD_QUEUES 48
#define GPUNVME_CD_NFRAMES 56
#define GPUNVME_CD_FULL_WAIT_NS 64
#define GPUNVME_CD_NRANGES 72
#define GPUNVME_CD_NQUEUES 76
#define GPUNVME_CD_PAGE_SHIFT 80
#define GPUNVME_CD_FLAGS 84
#define GPUNVME_CD_VOLUME 88
#define GPUNVME_VOLUME_MAX_MEMBERS 16
#define GPUNVME_VOLUME_DESC_SIZE 216
#define GPUNVME_VD_STRIPE_LBAS 0
#define GPUNVME_VD_LABEL_LBAS 8
#define GPUNVME_VD_NMEMBERS 16
#define GPUNVME_VD_QUEUES_PER_MEMBER 20
#define GPUNVME_VD_NSID 24
#define GPUNVME_VD_FRAMES_BUS 88
#define GPUNVME_RANGE_DESC_SIZE 64
#define GPUNVME_RD_ENTRIES 0
#define GPUNVME_RD_NPAGES 8
#define GPUNVME_RD_BYTES 16
#define GPUNVME_RD_FIRST_LBA 24
#define GPUNVME_RD_TABLE 32
#define GPUNVME_RD_NSID 40
#define GPUNVME_RD_LBA_SHIFT 44
#define GPUNVME_RD_FILE 48
#define GPUNVME_RD_FLAGS 52
#define GPUNVME_PAGE_ENTRY_SIZE 8
#define GPUNVME_PE_STATE 0
#define GPUNVME_PE_FRAME 4
#define GPUNVME_PE_FRAME_SHIFT 32
#define GPUNVME_FRAME_STATE_SIZE 16
#define GPUNVME_FRS_FLAGS 0
#define GPUNVME_FRS_RANGE 4
#define GPUNVME_FRS_PAGE 8
#define GPUNVME_CACHE_STATE_SIZE 64
#define GPUNVME_CS_HAND 0
#define GPUNVME_CS_FIRST_STATUS 32
#define GPUNVME_CS_FIRST_NVME_STATUS 36
#define GPUNVME_CS_FIRST_RANGE 40
#define GPUNVME_CS_QUARANTINED 44
#define GPUNVME_CS_FIRST_PAGE 48
#define GPUNVME_CACHE_STATS_SIZE 128
#define GPUNVME_CACHE_STAT_SLOTS 64
#define GPUNVME_ST_HITS 0
#define GPUNVME_ST_MISSES 8
#define GPUNVME_ST_WAITS 16
#define GPUNVME_ST_EVICTIONS 24
#define GPUNVME_ST_WRITEBACKS 32
#define GPUNVME_ST_READ_CMDS 40
#define GPUNVME_ST_WRITE_CMDS 48
#define GPUNVME_ST_FLUSH_CMDS 56
#define GPUNVME_ST_BYTES_READ 64
#define GPUNVME_ST_BYTES_WRITTEN 72
#define GPUNVME_ST_FULL 80
#define GPUNVME_ST_ERRORS 88

// Page state word.
#define GPUNVME_PS_VALID 0x80000000u
#define GPUNVME_PS_BUSY 0x40000000u
#define GPUNVME_PS_DIRTY 0x20000000u
#define GPUNVME_PS_ERROR 0x10000000u
#define GPUNVME_PS_STATUS_SHIFT 24
#define GPUNVME_PS_REFS_MASK 0x00ffffffu
// Frame flags, and the owner range of a frame that holds no page.
#define GPUNVME_FS_REF 1u
#define GPUNVME_FS_LOCKED 2u
#define GPUNVME_FS_QUARANTINED 4u
#define GPUNVME_FRAME_EMPTY 0xffffffffu
// cache_desc.flags: fills go through slot buffers (a later slice; refused by this one).
#define GPUNVME_CF_BOUNCE 1u
// range_desc.flags.
#define GPUNVME_RF_FILE 1u
#define GPUNVME_RF_WRITABLE 2u
// The status of an access that found every frame referenced for full_wait_ns.
#define GPUNVME_CACHE_FULL 8

namespace gpunvme {
namespace cache {

/// A cache as kernels see it. Built by the host (GpuCache::descriptor()); read-only on the GPU.
struct cache_desc {
    uint64_t frames;        // GPU pointer: nframes * page_size bytes
    uint64_t frames_bus;    // device address of the frames (the controller's view)
    uint64_t frame_states;  // GPU pointer: frame_state[nframes]
    uint64_t state;         // GPU pointer: cache_state
    uint64_t stats;         // GPU pointer: cache_stats[GPUNVME_CACHE_STAT_SLOTS]
    uint64_t ranges;        // GPU pointer: range_desc[nranges]
    uint64_t queues;        // GPU pointer: queue_desc[nqueues], the queues fills issue on
    uint64_t nframes;       // frames
    uint64_t full_wait_ns;  // bound of a search for a free frame
    uint32_t nranges;       // bound ranges
    uint32_t nqueues;       // queues (warp w fills on queue w % nqueues)
    uint32_t page_shift;    // log2 of the page size (12..16)
    uint32_t flags;         // GPUNVME_CF_*
    uint64_t volume;        // GPU pointer: volume_desc when the cache is over a striped volume
    uint64_t reserved[4];
};

/// A cache over a striped volume (RAID-0 over one namespace of each member controller,
/// blockfs::StripedVolume's layout): ranges are in volume LBAs, and every command of a fill or
/// write-back is cut at stripe units, each piece issued on a queue of the member that holds it.
/// The cache's queues are the members' in member order, queues_per_member each.
struct volume_desc {
    uint64_t stripe_lbas;        // LBAs per stripe unit
    uint64_t label_lbas;         // LBAs before each member's data (its label)
    uint32_t nmembers;           // members (1..GPUNVME_VOLUME_MAX_MEMBERS)
    uint32_t queues_per_member;  // member m's queues: queues[m * qpm, (m + 1) * qpm)
    uint32_t nsid[GPUNVME_VOLUME_MAX_MEMBERS];        // each member's namespace
    uint64_t frames_bus[GPUNVME_VOLUME_MAX_MEMBERS];  // the frames' device address per member
};

/// One bound range: an LBA range of a namespace, or a blockfs file (RF_FILE: its pages are found
/// through the file's extent table; first_lba unused).
struct range_desc {
    uint64_t entries;    // GPU pointer: page_entry[npages]
    uint64_t npages;     // pages of the range (the last one may be partial)
    uint64_t bytes;      // bytes of the range: elements stop here
    uint64_t first_lba;  // first LBA of the range
    uint64_t table;      // file ranges: GPU pointer of the blockfs extent table; 0 otherwise
    uint32_t nsid;       // namespace
    uint32_t lba_shift;  // log2 of its LBA size
    uint32_t file;       // file ranges: index in the table
    uint32_t flags;      // GPUNVME_RF_*
    uint64_t reserved;
};

/// The translation of one page of a range: one 64-bit word, only ever accessed whole by 64-bit
/// atomics (PTX orders atomics only between accesses of the same size and address). Bits 31:0
/// (bytes GPUNVME_PE_STATE..+4 on this little-endian machine) are the page state word above,
/// bits 63:32 (GPUNVME_PE_FRAME) the frame holding the page while VALID, 0 otherwise.
struct alignas(8) page_entry {
    uint64_t word;
};

/// One frame's state.
struct frame_state {
    uint32_t flags;  // GPUNVME_FS_*
    uint32_t range;  // owner range, or GPUNVME_FRAME_EMPTY
    uint64_t page;   // owner page
};

/// The cache's shared words (each role's on its own 32-byte sector).
struct cache_state {
    uint64_t hand;               // clock hand (steps taken)
    uint64_t pad0[3];
    uint32_t first_status;       // gpunvme status of the first failed fill (0: none)
    uint32_t first_nvme_status;  // its CQE status field
    uint32_t first_range;        // its range
    uint32_t quarantined;        // frames quarantined by fills that timed out or were aborted
    uint64_t first_page;         // its page
    uint64_t reserved;
};

/// Counters, one set per slot (blockIdx.x % GPUNVME_CACHE_STAT_SLOTS); the host sums them.
struct cache_stats {
    unsigned long long hits;           // element accesses served from a VALID page
    unsigned long long misses;         // fills (one per missing page)
    unsigned long long waits;          // element accesses that waited for another warp's fill
    unsigned long long evictions;      // pages evicted to make room
    unsigned long long writebacks;     // dirty pages written back (a later slice)
    unsigned long long read_cmds;      // NVMe reads issued by fills
    unsigned long long write_cmds;     // NVMe writes issued by write-backs
    unsigned long long flush_cmds;     // NVMe Flush commands
    unsigned long long bytes_read;     // bytes read by fills
    unsigned long long bytes_written;  // bytes written back
    unsigned long long full;           // fills that ended in GPUNVME_CACHE_FULL
    unsigned long long errors;         // fills that failed for any other reason
    unsigned long long reserved[4];
};

static_assert(sizeof(cache_desc) == GPUNVME_CACHE_DESC_SIZE, "cache_desc size");
static_assert(offsetof(cache_desc, frames) == GPUNVME_CD_FRAMES, "frames");
static_assert(offsetof(cache_desc, frames_bus) == GPUNVME_CD_FRAMES_BUS, "frames_bus");
static_assert(offsetof(cache_desc, frame_states) == GPUNVME_CD_FRAME_STATES, "frame_states");
static_assert(offsetof(cache_desc, state) == GPUNVME_CD_STATE, "state");
static_assert(offsetof(cache_desc, stats) == GPUNVME_CD_STATS, "stats");
static_assert(offsetof(cache_desc, ranges) == GPUNVME_CD_RANGES, "ranges");
static_assert(offsetof(cache_desc, queues) == GPUNVME_CD_QUEUES, "queues");
static_assert(offsetof(cache_desc, nframes) == GPUNVME_CD_NFRAMES, "nframes");
static_assert(offsetof(cache_desc, full_wait_ns) == GPUNVME_CD_FULL_WAIT_NS, "full_wait_ns");
static_assert(offsetof(cache_desc, nranges) == GPUNVME_CD_NRANGES, "nranges");
static_assert(offsetof(cache_desc, nqueues) == GPUNVME_CD_NQUEUES, "nqueues");
static_assert(offsetof(cache_desc, page_shift) == GPUNVME_CD_PAGE_SHIFT, "page_shift");
static_assert(offsetof(cache_desc, flags) == GPUNVME_CD_FLAGS, "flags");
static_assert(offsetof(cache_desc, volume) == GPUNVME_CD_VOLUME, "volume");
static_assert(sizeof(volume_desc) == GPUNVME_VOLUME_DESC_SIZE, "volume_desc size");
static_assert(offsetof(volume_desc, stripe_lbas) == GPUNVME_VD_STRIPE_LBAS, "stripe_lbas");
static_assert(offsetof(volume_desc, label_lbas) == GPUNVME_VD_LABEL_LBAS, "label_lbas");
static_assert(offsetof(volume_desc, nmembers) == GPUNVME_VD_NMEMBERS, "nmembers");
static_assert(offsetof(volume_desc, queues_per_member) == GPUNVME_VD_QUEUES_PER_MEMBER, "qpm");
static_assert(offsetof(volume_desc, nsid) == GPUNVME_VD_NSID, "vd nsid");
static_assert(offsetof(volume_desc, frames_bus) == GPUNVME_VD_FRAMES_BUS, "vd frames_bus");
static_assert(sizeof(range_desc) == GPUNVME_RANGE_DESC_SIZE, "range_desc size");
static_assert(offsetof(range_desc, entries) == GPUNVME_RD_ENTRIES, "entries");
static_assert(offsetof(range_desc, npages) == GPUNVME_RD_NPAGES, "npages");
static_assert(offsetof(range_desc, bytes) == GPUNVME_RD_BYTES, "bytes");
static_assert(offsetof(range_desc, first_lba) == GPUNVME_RD_FIRST_LBA, "first_lba");
static_assert(offsetof(range_desc, table) == GPUNVME_RD_TABLE, "table");
static_assert(offsetof(range_desc, nsid) == GPUNVME_RD_NSID, "nsid");
static_assert(offsetof(range_desc, lba_shift) == GPUNVME_RD_LBA_SHIFT, "lba_shift");
static_assert(offsetof(range_desc, file) == GPUNVME_RD_FILE, "file");
static_assert(offsetof(range_desc, flags) == GPUNVME_RD_FLAGS, "rd flags");
static_assert(sizeof(page_entry) == GPUNVME_PAGE_ENTRY_SIZE, "page_entry size");
static_assert(GPUNVME_PE_STATE == 0 && GPUNVME_PE_FRAME * 8 == GPUNVME_PE_FRAME_SHIFT,
              "page_entry: the state in the low half of the word, the frame in the high");
static_assert(sizeof(frame_state) == GPUNVME_FRAME_STATE_SIZE, "frame_state size");
static_assert(offsetof(frame_state, flags) == GPUNVME_FRS_FLAGS, "frs flags");
static_assert(offsetof(frame_state, range) == GPUNVME_FRS_RANGE, "frs range");
static_assert(offsetof(frame_state, page) == GPUNVME_FRS_PAGE, "frs page");
static_assert(sizeof(cache_state) == GPUNVME_CACHE_STATE_SIZE, "cache_state size");
static_assert(offsetof(cache_state, hand) == GPUNVME_CS_HAND, "hand");
static_assert(offsetof(cache_state, first_status) == GPUNVME_CS_FIRST_STATUS, "first_status");
static_assert(offsetof(cache_state, first_nvme_status) == GPUNVME_CS_FIRST_NVME_STATUS, "fns");
static_assert(offsetof(cache_state, first_range) == GPUNVME_CS_FIRST_RANGE, "first_range");
static_assert(offsetof(cache_state, quarantined) == GPUNVME_CS_QUARANTINED, "quarantined");
static_assert(offsetof(cache_state, first_page) == GPUNVME_CS_FIRST_PAGE, "first_page");
static_assert(sizeof(cache_stats) == GPUNVME_CACHE_STATS_SIZE, "cache_stats size");
static_assert(offsetof(cache_stats, hits) == GPUNVME_ST_HITS, "hits");
static_assert(offsetof(cache_stats, misses) == GPUNVME_ST_MISSES, "misses");
static_assert(offsetof(cache_stats, waits) == GPUNVME_ST_WAITS, "waits");
static_assert(offsetof(cache_stats, evictions) == GPUNVME_ST_EVICTIONS, "evictions");
static_assert(offsetof(cache_stats, writebacks) == GPUNVME_ST_WRITEBACKS, "writebacks");
static_assert(offsetof(cache_stats, read_cmds) == GPUNVME_ST_READ_CMDS, "read_cmds");
static_assert(offsetof(cache_stats, write_cmds) == GPUNVME_ST_WRITE_CMDS, "write_cmds");
static_assert(offsetof(cache_stats, flush_cmds) == GPUNVME_ST_FLUSH_CMDS, "flush_cmds");
static_assert(offsetof(cache_stats, bytes_read) == GPUNVME_ST_BYTES_READ, "bytes_read");
static_assert(offsetof(cache_stats, bytes_written) == GPUNVME_ST_BYTES_WRITTEN, "bytes_w");
static_assert(offsetof(cache_stats, full) == GPUNVME_ST_FULL, "full");
static_assert(offsetof(cache_stats, errors) == GPUNVME_ST_ERRORS, "errors");

// ---------------------------------------------------------------------------------------------
// Primitives.

__device__ __forceinline__ const range_desc& range_of(const cache_desc& c, uint32_t r) {
    return reinterpret_cast<const range_desc*>(c.ranges)[r];
}
__device__ __forceinline__ page_entry* entry_of(const range_desc& r, uint64_t page) {
    return reinterpret_cast<page_entry*>(r.entries) + page;
}
/// The entry's word, for the 64-bit atomics that are its only accesses.
__device__ __forceinline__ dev_u64 word_of(page_entry* e) { return dev_u64(e->word); }
/// The frame an entry word names (while the page is VALID).
__device__ __forceinline__ uint32_t frame_in(uint64_t w) {
    return (uint32_t)(w >> GPUNVME_PE_FRAME_SHIFT);
}
/// Frame f in an entry word's frame bits.
__device__ __forceinline__ uint64_t frame_bits(uint32_t f) {
    return (uint64_t)f << GPUNVME_PE_FRAME_SHIFT;
}
__device__ __forceinline__ frame_state* frame_of(const cache_desc& c, uint64_t f) {
    return reinterpret_cast<frame_state*>(c.frame_states) + f;
}
__device__ __forceinline__ cache_state* state_of(const cache_desc& c) {
    return reinterpret_cast<cache_state*>(c.state);
}
/// The bytes of frame f. Read them with plain loads, never the non-coherent path.
__device__ __forceinline__ uint8_t* frame_data(const cache_desc& c, uint32_t f) {
    return reinterpret_cast<uint8_t*>(c.frames + ((uint64_t)f << c.page_shift));
}
/// This block's statistics slot (one slot per block would be 64 K slots; 64 spread the atomics).
__device__ __forceinline__ cache_stats* stats_of(const cache_desc& c) {
    return reinterpret_cast<cache_stats*>(c.stats) + (blockIdx.x % GPUNVME_CACHE_STAT_SLOTS);
}
__device__ __forceinline__ void count(unsigned long long& counter, uint64_t n) {
    if (n) atomicAdd(&counter, (unsigned long long)n);
}
/// The queue this thread's warp fills on.
__device__ __forceinline__ const queue_desc& queue_for(const cache_desc& c) {
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    return reinterpret_cast<const queue_desc*>(c.queues)[(gtid / 32) % c.nqueues];
}

/// What the hit path needs of a cache and one of its ranges (view_nc), read once per access
/// before its lookup. Every gpu-scope acquire (each hit's atomic) invalidates the SM's L1, so
/// the descriptor fields read through plain loads after one were L2 round trips: one
/// (c.frames) between the lookup and the data, and the next access's chain c.ranges -> the
/// range's entries before its lookup. view_nc reads them all at the start of an access through
/// the read-only path. (Holding the view in array<T>'s registers instead did as well for
/// random loads but took registers from read_range's copy loop: 64 KiB runs fell from 0.92 to
/// 0.74-0.82 of a plain buffer's rate, H200, 2026-11-27.)
struct range_view {
    page_entry* entries;        // the range's entries; null when the range cannot be used
    uint8_t* frames;            // the frames' bytes
    frame_state* frame_states;  // the frames' states
    cache_stats* stats;         // this block's statistics slot
    uint64_t bytes;             // the range's bytes (0 when it cannot be used)
    uint32_t page_shift;        // log2 of the page size
    uint32_t flags;             // the range's GPUNVME_RF_*
};

/// A descriptor word through the non-coherent (read-only) path: descriptors never change while
/// kernels run (the host writes them between kernels). Never for frames or state words.
template <class T>
__device__ __forceinline__ T ld_desc(const T* p) {
#ifdef GPUNVME_HOST_BUILD
    return *p;
#else
    return __ldg(p);
#endif
}

/// The view of range `range` of *c (entries null and bytes 0 when the range is not bound or
/// the cache has no queues or frames), through ld_desc.
__device__ __forceinline__ range_view view_nc(const cache_desc* c, uint32_t range) {
    range_view v;
    v.entries = nullptr;
    v.frames = reinterpret_cast<uint8_t*>(ld_desc(&c->frames));
    v.frame_states = reinterpret_cast<frame_state*>(ld_desc(&c->frame_states));
    v.stats = reinterpret_cast<cache_stats*>(ld_desc(&c->stats)) +
              (blockIdx.x % GPUNVME_CACHE_STAT_SLOTS);
    v.bytes = 0;
    v.page_shift = ld_desc(&c->page_shift);
    v.flags = 0;
    if (range < ld_desc(&c->nranges) && ld_desc(&c->nqueues) != 0 && ld_desc(&c->nframes) != 0) {
        const range_desc* r = reinterpret_cast<const range_desc*>(ld_desc(&c->ranges)) + range;
        v.entries = reinterpret_cast<page_entry*>(ld_desc(&r->entries));
        v.bytes = ld_desc(&r->bytes);
        v.flags = ld_desc(&r->flags);
    }
    return v;
}

/// Why an access to byte `byte` (and `len` bytes from it) of the view's range cannot be
/// served, or GPUNVME_OK.
__device__ __forceinline__ status check_access(const range_view& v, uint64_t byte, uint64_t len) {
    if (v.entries == nullptr) return GPUNVME_INVALID_ARGUMENT;
    if (byte >= v.bytes || len > v.bytes - byte) return GPUNVME_OUT_OF_EXTENT;
    return GPUNVME_OK;
}

/// The bytes of frame f, through a view.
__device__ __forceinline__ uint8_t* frame_data(const range_view& v, uint32_t f) {
    return v.frames + ((uint64_t)f << v.page_shift);
}

/// Records the first failed fill for the host (cache_state.first_*).
__device__ inline void record_failure(const cache_desc& c, status s, uint32_t nvme_status,
                                      uint32_t range, uint64_t page) {
    cache_state* st = state_of(c);
    uint32_t expected = 0;
    if (dev_u32(st->first_status)
            .compare_exchange_strong(expected, (uint32_t)s, cuda::memory_order_relaxed)) {
        st->first_nvme_status = nvme_status;
        st->first_range = range;
        st->first_page = page;
    }
}

/// Gives back n references (transitions 5 and 6). Release: the holders' reads of the frame
/// happen before an evictor's CAS sees refs reach 0. Whoever leaves an ERROR page without
/// holders resets it, so that the next access retries the read.
__device__ inline void release_refs(page_entry* e, uint32_t n) {
    const uint64_t old = word_of(e).fetch_sub(n, cuda::memory_order_release);
    if ((old & GPUNVME_PS_ERROR) && (old & GPUNVME_PS_REFS_MASK) == n) {
        uint64_t expected = old - n;  // an ERROR page has no frame bits
        word_of(e).compare_exchange_strong(expected, 0ull, cuda::memory_order_relaxed);
    }
}

/// Gives back n references to a page the caller holds VALID (a hit; transition 6). While any
/// reference is held the page is neither evicted (transition 8 needs no holders) nor failed
/// (only a fill sets ERROR, on a page that is not VALID), so there is no ERROR page to reset
/// and the old value is not needed: a reduction the warp does not wait for (release_refs'
/// returning atomic is an L2 round trip per access). Release: as release_refs.
__device__ __forceinline__ void release_hit(page_entry* e, uint32_t n) {
    red_add_release(&e->word, 0ull - n);  // the refs are at least n: no borrow into the frame
}

/// Sets the frame's clock bit: a reduction the warp does not wait for (a load first, to spare
/// hot frames the write, put an L2 round trip and a branch on it on every hit's path).
/// Relaxed: the bit is a replacement hint only.
__device__ __forceinline__ void touch(frame_state* frame_states, uint32_t f) {
    red_or_relaxed(&frame_states[f].flags, GPUNVME_FS_REF);
}
__device__ __forceinline__ void touch(const cache_desc& c, uint32_t f) {
    touch(reinterpret_cast<frame_state*>(c.frame_states), f);
}

// How an access stands after its lookup.
enum : uint32_t {
    ACQ_NONE = 0,  // the lane asks for nothing
    ACQ_HIT,       // the page is VALID in *frame and referenced
    ACQ_FILL,      // this thread owns the page's fill (BUSY)
    ACQ_WAIT,      // another thread fills it
    ACQ_FAILED,    // *s says why; the references are still held
    ACQ_RETRY,     // the fill was given back (no frame yet); the references are still held
    ACQ_DONE,      // read and released, or failed and released (array::load's rounds)
};

/// Decides from the entry word `cur` (which includes the caller's references) how the access
/// stands, taking the fill (transition 2) when nobody has it. The CAS is retried only while
/// other threads change the reference count.
__device__ inline uint32_t classify(page_entry* e, uint64_t cur, status* s, uint32_t* frame) {
    for (;;) {
        if (cur & GPUNVME_PS_VALID) {
            // The frame came in the word that showed VALID (transition 3 set both at once).
            *frame = frame_in(cur);
            return ACQ_HIT;
        }
        if (cur & GPUNVME_PS_ERROR) {
            *s = (status)((cur >> GPUNVME_PS_STATUS_SHIFT) & 15u);
            return ACQ_FAILED;
        }
        if (cur & GPUNVME_PS_BUSY) return ACQ_WAIT;
        if (word_of(e).compare_exchange_weak(cur, cur | GPUNVME_PS_BUSY,
                                             cuda::memory_order_acquire,
                                             cuda::memory_order_acquire))
            return ACQ_FILL;
    }
}

/// Transition 1 for the leader of n lanes: take the references, then classify.
__device__ __forceinline__ uint32_t lookup(page_entry* e, uint32_t n, status* s,
                                           uint32_t* frame) {
    const uint64_t old = word_of(e).fetch_add(n, cuda::memory_order_acquire);
    if ((old & GPUNVME_PS_REFS_MASK) + n > (GPUNVME_PS_REFS_MASK >> 1)) {
        // 2^23 holders: far beyond any GPU's resident threads; refuse rather than overflow.
        *s = GPUNVME_INVALID_ARGUMENT;
        return ACQ_FAILED;
    }
    return classify(e, old + n, s, frame);
}

// ---------------------------------------------------------------------------------------------
// Replacement and fills.

/// Whether a command that ended with status `s` may still be in flight and move data to or
/// from its frame later: anything but a completion or a refusal before submission (review M3),
/// and never on the BOUNCE data path, where commands reach only slot buffers.
__device__ __forceinline__ bool late_dma_possible(const cache_desc& c, status s) {
    return !(c.flags & GPUNVME_CF_BOUNCE) && s != GPUNVME_OK && s != GPUNVME_NVME_ERROR &&
           s != GPUNVME_INVALID_ARGUMENT;
}

/// The part of page `page` of range `r` that exists: bytes [*pos, *end) of the range (the
/// whole page, or the range's tail).
__device__ __forceinline__ void page_span(const cache_desc& c, const range_desc& r,
                                          uint64_t page, uint64_t* pos, uint64_t* end) {
    *pos = page << c.page_shift;
    const uint64_t e = *pos + (1ull << c.page_shift);
    *end = e < r.bytes ? e : r.bytes;
}

/// LBAs per command through queue q's slot buffers (the BOUNCE data path): what one slot
/// buffer holds, at most a command's; 0 when the queue has none.
__device__ __forceinline__ uint32_t bounce_blocks(const queue_desc& q, uint32_t lba_shift) {
    const uint32_t per = blocks_per_command(q, lba_shift);
    const uint32_t fit = fs::slot_blocks(q, lba_shift);
    return fit < per ? fit : per;
}

/// rw_thread for the BOUNCE data path (frames the controller cannot reach: transports whose
/// GPU memory is fixed at set-up): `blocks` LBAs from `slba` move through the slot buffer of
/// each command's ticket, copied from `data` (GPU memory) before a write's submission and to
/// it after a read's completion, one command in flight at a time (the thread holds one
/// ticket). *cmds counts the commands. Fence discipline (gpunvme_file.cuh's bounce in and out,
/// for one thread): copies -> fill_slot's st.release of the ticket -> publication; and the
/// completion's ld.acquire (wait_done_thread) -> copies -> release_slot's st.release, so no
/// copy reads the slot buffer after its next owner may refill it. A command that does not end
/// (a timeout, an abort) moves data to or from the slot buffer, never the frame. Out of line:
/// one copy in the module (frames_rw calls it for a namespace and for each volume member).
__device__ GPUNVME_NOINLINE inline status rw_thread_bounce(const queue_desc& q, uint8_t opcode,
                                                         uint32_t nsid, uint32_t lba_shift,
                                                         uint64_t slba, uint64_t blocks,
                                                         uint8_t* data, uint32_t* nvme_status,
                                                         uint64_t* cmds) {
    if (blocks == 0 || lba_shift < 9 || lba_shift > 12) return GPUNVME_INVALID_ARGUMENT;
    const uint32_t per = bounce_blocks(q, lba_shift);
    if (per == 0) return GPUNVME_INVALID_ARGUMENT;  // no slot buffers to bounce through
    for (uint64_t done = 0; done < blocks;) {
        const uint32_t n = (uint32_t)(blocks - done < per ? blocks - done : per);
        const uint32_t bytes = n << lba_shift;
        uint8_t* at = data + (done << lba_shift);
        uint32_t t;
        status s = reserve_thread(q, &t);
        if (s) return s;
        uint8_t* sbuf = fs::slot_buffer(q, t);
        if (opcode == OPC_WRITE) copy_bytes(sbuf, at, bytes, 0, 1);
        io_req r;
        fs::slot_req(q, t, opcode, nsid, slba + done, n, lba_shift, &r);
        fill_slot(q, t, r);  // its release orders the copies above before the SQE
        ++*cmds;
        if ((s = publish_thread(q, t))) return s;
        uint32_t word = 0;
        if ((s = fs::wait_done_thread(q, t, &word))) return s;
        const uint32_t sf = word & 0xffffu;
        if (!sf && opcode == OPC_READ) copy_bytes(at, sbuf, bytes, 0, 1);
        release_slot(q, t);  // release: the copies out of sbuf come first
        if (sf) {
            if (nvme_status) *nvme_status = sf;
            return GPUNVME_NVME_ERROR;
        }
        done += n;
    }
    return GPUNVME_OK;
}

/// Moves `blocks` LBAs from `lba` (of namespace `nsid`; on a volume, volume LBAs) to or from
/// the frames' bytes from `frame_off` on, on queue `q` (rw_thread: one command per maximum
/// transfer; on the BOUNCE data path, rw_thread_bounce: one per slot buffer). On a volume
/// (c.volume) the run is cut at stripe units and each piece goes to the member that holds it:
/// that member's namespace and LBA, the queue in the same place among its queues as `q` among
/// the first member's (the warp's lane of queues), and the frames at that member's device
/// address. *cmds counts the commands.
/// Not inlined (as fill_page and write_back): the miss path is one copy in the module. Inlined
/// into every acquire variant, it made the kernels' PTX 410,000 lines, which a fresh machine's
/// driver took 129 s to JIT-compile (H200, 2026-11-26); a call costs nothing beside a command.
__device__ GPUNVME_NOINLINE inline status frames_rw(const cache_desc& c, const queue_desc& q,
                                                uint8_t opcode, uint32_t nsid, uint32_t lba_shift,
                                                uint64_t lba, uint64_t blocks, uint64_t frame_off,
                                                uint32_t* sf, uint64_t* cmds) {
    const bool bounce = (c.flags & GPUNVME_CF_BOUNCE) != 0;
    uint8_t* frames = reinterpret_cast<uint8_t*>(c.frames);
    const uint32_t per_cmd = blocks_per_command(q, lba_shift);
    if (per_cmd == 0) return GPUNVME_INVALID_ARGUMENT;
    if (!c.volume) {
        if (bounce)
            return rw_thread_bounce(q, opcode, nsid, lba_shift, lba, blocks, frames + frame_off,
                                    sf, cmds);
        *cmds += (blocks + per_cmd - 1) / per_cmd;
        return rw_thread(q, opcode, nsid, lba_shift, lba, blocks, c.frames_bus + frame_off, sf);
    }
    const volume_desc& v = *reinterpret_cast<const volume_desc*>(c.volume);
    if (v.stripe_lbas == 0 || v.nmembers == 0 || v.nmembers > GPUNVME_VOLUME_MAX_MEMBERS ||
        v.queues_per_member == 0 || (uint64_t)v.nmembers * v.queues_per_member > c.nqueues)
        return GPUNVME_INVALID_ARGUMENT;
    // q's place among the cache's queues (queue_for's choice); another queue: the first lane.
    const uint64_t at = (reinterpret_cast<uint64_t>(&q) - c.queues) / sizeof(queue_desc);
    const uint32_t lane = at < c.nqueues ? (uint32_t)(at % v.queues_per_member) : 0;
    const queue_desc* all = reinterpret_cast<const queue_desc*>(c.queues);
    for (uint64_t done = 0; done < blocks;) {
        const uint64_t vlba = lba + done;
        const uint64_t unit = vlba / v.stripe_lbas, within = vlba % v.stripe_lbas;
        uint64_t n = v.stripe_lbas - within;
        if (n > blocks - done) n = blocks - done;
        const uint32_t m = (uint32_t)(unit % v.nmembers);
        const uint64_t mlba = v.label_lbas + (unit / v.nmembers) * v.stripe_lbas + within;
        const queue_desc& mq = all[m * v.queues_per_member + lane];
        const uint64_t off = frame_off + (done << lba_shift);
        status s;
        if (bounce) {
            s = rw_thread_bounce(mq, opcode, v.nsid[m], lba_shift, mlba, n, frames + off, sf,
                                 cmds);
        } else {
            const uint32_t mper = blocks_per_command(mq, lba_shift);
            if (mper == 0) return GPUNVME_INVALID_ARGUMENT;
            *cmds += (n + mper - 1) / mper;
            s = rw_thread(mq, opcode, v.nsid[m], lba_shift, mlba, n, v.frames_bus[m] + off, sf);
        }
        if (s) return s;
        done += n;
    }
    return GPUNVME_OK;
}

/// page_io for a blockfs file range: the page's LBAs found through the file's extent table
/// (GPU memory, pinned by the host for the cache's lifetime), one command per run of
/// contiguous LBAs (a page inside one extent: one command). The last LBA of a file may hold
/// bytes past its end; the caller zeroes them in the frame after a read.
__device__ inline status file_page_io(const cache_desc& c, const queue_desc& q,
                                      const range_desc& r, uint64_t page, uint32_t f,
                                      uint8_t opcode, uint32_t* sf, uint64_t* bytes) {
    fs::table t;
    const fs::table_file* tf = nullptr;
    status s = fs::table_open(reinterpret_cast<const void*>(r.table), &t);
    if (!s) s = fs::table_file_at(t, r.file, &tf);
    if (s) return s;
    if (t.lba_shift != r.lba_shift || t.nsid != r.nsid) return GPUNVME_INVALID_ARGUMENT;
    const uint32_t per_cmd = blocks_per_command(q, r.lba_shift);
    if (per_cmd == 0) return GPUNVME_INVALID_ARGUMENT;
    uint64_t pos, end;
    page_span(c, r, page, &pos, &end);
    const uint64_t frame_off = (uint64_t)f << c.page_shift;
    uint64_t cmds = 0, moved = 0;
    for (uint64_t off = pos; off < end && !s;) {
        // r.bytes is at most the file's readable (or, writable, allocated) length: the
        // lookup's limit. A hole is a corrupt table: refused, like the file reads refuse it.
        uint64_t lba = 0, contig = 0;
        if (!fs::lookup(t, *tf, off, r.bytes, &lba, &contig)) {
            s = GPUNVME_OUT_OF_EXTENT;
            break;
        }
        uint64_t n = (end - off + (1ull << r.lba_shift) - 1) >> r.lba_shift;
        if (n > contig) n = contig;
        if (n > per_cmd) n = per_cmd;
        s = frames_rw(c, q, opcode, r.nsid, r.lba_shift, lba, n, frame_off + (off - pos), sf,
                      &cmds);
        moved += n << r.lba_shift;
        off += n << r.lba_shift;
    }
    count(opcode == OPC_READ ? stats_of(c)->read_cmds : stats_of(c)->write_cmds, cmds);
    *bytes = moved;
    return s;
}

/// Reads (OPC_READ) or writes (OPC_WRITE) page `page` of range `r` between the device and
/// frame f: the whole page, or the range's tail (bytes of the frame past the range's end are
/// never written to the device; after a read they are zero). *bytes gets the bytes moved.
__device__ inline status page_io(const cache_desc& c, const queue_desc& q, const range_desc& r,
                                 uint64_t page, uint32_t f, uint8_t opcode, uint32_t* sf,
                                 uint64_t* bytes) {
    status s;
    if (r.flags & GPUNVME_RF_FILE) {
        s = file_page_io(c, q, r, page, f, opcode, sf, bytes);
    } else {
        const uint32_t shift = c.page_shift - r.lba_shift;
        const uint64_t first = page << shift;
        const uint64_t range_blocks = r.bytes >> r.lba_shift;
        uint64_t blocks = range_blocks - first;
        if (blocks > (1ull << shift)) blocks = 1ull << shift;
        uint64_t cmds = 0;
        *bytes = blocks << r.lba_shift;
        s = frames_rw(c, q, opcode, r.nsid, r.lba_shift, r.first_lba + first, blocks,
                      (uint64_t)f << c.page_shift, sf, &cmds);
        count(opcode == OPC_READ ? stats_of(c)->read_cmds : stats_of(c)->write_cmds, cmds);
    }
    if (s == GPUNVME_OK && opcode == OPC_READ) {
        // The range's end inside the page: the bytes after it are zero, not what the last LBA
        // (or the frame's previous page) held. Plain stores after the completion was seen
        // (acquire), published with the page by transition 3's release.
        uint64_t pos, end;
        page_span(c, r, page, &pos, &end);
        uint8_t* d = frame_data(c, f);
        uint64_t i = end - pos;
        const uint64_t size = 1ull << c.page_shift;
        for (; i < size && (i & 7); ++i) d[i] = 0;
        for (; i < size; i += 8) *reinterpret_cast<uint64_t*>(d + i) = 0;
    }
    return s;
}

/// Writes back the VALID|BUSY page in frame f (its owner, which the caller has locked): the
/// write, then on success clears BUSY only (transition 10; the caller may try 11 first), on
/// failure makes the page DIRTY again and not BUSY (12), records the failure, and quarantines
/// the frame when the write may still be in flight (the frame keeps the page, which stays
/// served and dirty). Returns the write's status.
__device__ GPUNVME_NOINLINE inline status write_back(const cache_desc& c, const queue_desc& q,
                                                 uint32_t owner, uint64_t page, uint32_t f,
                                                 page_entry* e) {
    cache_stats* k = stats_of(c);
    uint32_t sf = 0;
    uint64_t bytes = 0;
    const status w = page_io(c, q, range_of(c, owner), page, f, OPC_WRITE, &sf, &bytes);
    if (w == GPUNVME_OK) {
        count(k->writebacks, 1);
        count(k->bytes_written, bytes);
        return w;
    }
    uint64_t cur = word_of(e).load(cuda::memory_order_relaxed);
    while (!word_of(e).compare_exchange_weak(cur, (cur | GPUNVME_PS_DIRTY) & ~(uint64_t)GPUNVME_PS_BUSY,
                                             cuda::memory_order_relaxed)) {
    }
    count(k->errors, 1);
    record_failure(c, w, sf, owner, page);
    if (late_dma_possible(c, w)) {
        dev_u32(frame_of(c, f)->flags).fetch_or(GPUNVME_FS_QUARANTINED, cuda::memory_order_relaxed);
        dev_u32(state_of(c)->quarantined).fetch_add(1u, cuda::memory_order_relaxed);
    }
    return w;
}

/// Finds a frame for a fill and returns it LOCKED (*frame), evicting its clean, unreferenced
/// page (a dirty one is written back first, on the caller's queue); bounded by `deadline` (%globaltimer ns) and the host's abort word
/// (GPUNVME_CACHE_FULL, ABORTED). At least GPUNVME_ABORT_POLL steps are tried.
__device__ inline status find_frame(const cache_desc& c, const queue_desc& q, uint32_t* frame,
                                    uint64_t* evictions, uint64_t deadline) {
    cache_state* st = state_of(c);
    cuda::atomic_ref<uint64_t, cuda::thread_scope_device> hand(st->hand);
    const uint64_t n = c.nframes;
    uint32_t sleep_ns = 32;
    for (uint64_t step = 1;; ++step) {
        const uint64_t f = hand.fetch_add(1, cuda::memory_order_relaxed) % n;
        frame_state* fs = frame_of(c, f);
        uint32_t fl = dev_u32(fs->flags).load(cuda::memory_order_relaxed);
        if (!(fl & (GPUNVME_FS_LOCKED | GPUNVME_FS_QUARANTINED))) {
            if (fl & GPUNVME_FS_REF) {
                // Second chance: used since the hand last passed.
                dev_u32(fs->flags).fetch_and(~GPUNVME_FS_REF, cuda::memory_order_relaxed);
            } else if (dev_u32(fs->flags).compare_exchange_strong(
                           fl, fl | GPUNVME_FS_LOCKED, cuda::memory_order_acquire,
                           cuda::memory_order_relaxed)) {
                // Ours: the owner fields are stable until we unlock.
                const uint32_t owner = fs->range;
                if (owner == GPUNVME_FRAME_EMPTY) {
                    *frame = (uint32_t)f;
                    return GPUNVME_OK;
                }
                if (owner < c.nranges && fs->page < range_of(c, owner).npages) {
                    page_entry* v = entry_of(range_of(c, owner), fs->page);
                    const uint64_t in_f = frame_bits((uint32_t)f);
                    // Transition 8: only a VALID page nobody holds or waits for.
                    uint64_t expected = GPUNVME_PS_VALID | in_f;
                    if (word_of(v).compare_exchange_strong(expected, 0ull,
                                                           cuda::memory_order_acq_rel,
                                                           cuda::memory_order_relaxed)) {
                        ++*evictions;
                        *frame = (uint32_t)f;
                        return GPUNVME_OK;
                    }
                    // Transition 9: a dirty page nobody holds is written back first (the
                    // acquire orders the writers' stores, published by their release of
                    // DIRTY, before the write's DMA). Readers and writers may come meanwhile:
                    // VALID stays set.
                    expected = GPUNVME_PS_VALID | GPUNVME_PS_DIRTY | in_f;
                    if (word_of(v).compare_exchange_strong(
                            expected, GPUNVME_PS_VALID | GPUNVME_PS_BUSY | in_f,
                            cuda::memory_order_acquire, cuda::memory_order_relaxed)) {
                        if (write_back(c, q, owner, fs->page, (uint32_t)f, v) == GPUNVME_OK) {
                            // Transition 11, or 10 when someone came meanwhile.
                            expected = GPUNVME_PS_VALID | GPUNVME_PS_BUSY | in_f;
                            if (word_of(v).compare_exchange_strong(
                                    expected, 0ull, cuda::memory_order_acq_rel,
                                    cuda::memory_order_relaxed)) {
                                ++*evictions;
                                *frame = (uint32_t)f;
                                return GPUNVME_OK;
                            }
                            word_of(v).fetch_sub(GPUNVME_PS_BUSY, cuda::memory_order_release);
                        }
                        fl = dev_u32(fs->flags).load(cuda::memory_order_relaxed) &
                             ~GPUNVME_FS_LOCKED;  // QUARANTINED, when write_back set it
                    }
                }
                dev_u32(fs->flags).store(fl, cuda::memory_order_release);
            }
        }
        if (step % GPUNVME_ABORT_POLL == 0) {
            const uint64_t now = now_ns();
            if (host_aborted(q, now)) return GPUNVME_ABORTED;
            if (now > deadline ||
                dev_u32(st->quarantined).load(cuda::memory_order_relaxed) >= n)
                return GPUNVME_CACHE_FULL;
        }
        if (step >= 2 * n) {
            // A whole sweep found nothing: every frame is held, locked or just used. Back
            // off so that holders run.
            __nanosleep(sleep_ns);
            if (sleep_ns < 4096) sleep_ns <<= 1;
        }
    }
}

/// What fill_page returns when it gave the fill back (`give_back`): no frame was free by the
/// deadline; the page is no longer BUSY and its holders keep their references. Never a
/// status any public call returns.
#define GPUNVME_CACHE_FILL_GIVEN_BACK (-1)

/// The fill of page `page` of range `range` by the thread that owns it (BUSY): a frame (looked
/// for until `deadline`), the read, then transition 3 (VALID) or 4 (ERROR with the status).
/// Returns the outcome; on success *frame holds the page. With `give_back`, a fill that
/// finds no frame drops BUSY instead of failing the page (GPUNVME_CACHE_FILL_GIVEN_BACK), so
/// that a warp can release what it holds and retry (array::load).
__device__ GPUNVME_NOINLINE inline status fill_page(const cache_desc& c, const queue_desc& q,
                                                uint32_t range, uint64_t page, page_entry* e,
                                                uint32_t* frame, uint64_t deadline,
                                                bool give_back = false) {
    const range_desc& r = range_of(c, range);
    cache_stats* k = stats_of(c);
    uint64_t evictions = 0;
    uint32_t sf = 0, f = 0;
    // A failed queue takes no command: fail before taking (and quarantining) a frame.
    status s = queue_failed(q);
    if (!s) s = find_frame(c, q, &f, &evictions, deadline);
    count(k->evictions, evictions);
    if (s == GPUNVME_CACHE_FULL && give_back) {
        word_of(e).fetch_sub(GPUNVME_PS_BUSY, cuda::memory_order_relaxed);
        return GPUNVME_CACHE_FILL_GIVEN_BACK;
    }
    if (!s) {
        frame_state* fs = frame_of(c, f);
        fs->range = range;
        fs->page = page;
        uint64_t bytes = 0;
        s = page_io(c, q, r, page, f, OPC_READ, &sf, &bytes);
        if (!s) {
            count(k->misses, 1);
            count(k->bytes_read, bytes);
            // Transition 3 (the frame bits were 0: the add sets them); then unlock with the
            // clock bit set (the new page's second chance).
            word_of(e).fetch_add(GPUNVME_PS_VALID - GPUNVME_PS_BUSY + frame_bits(f),
                                 cuda::memory_order_release);
            dev_u32(fs->flags).store(GPUNVME_FS_REF, cuda::memory_order_release);
            *frame = f;
            return GPUNVME_OK;
        }
        // The frame holds no page. After a timeout, an abort or a failed queue the command may
        // still be in flight and write the frame later (review M3): never reuse it.
        fs->range = GPUNVME_FRAME_EMPTY;
        fs->page = 0;
        if (!late_dma_possible(c, s)) {
            dev_u32(fs->flags).store(0u, cuda::memory_order_release);
        } else {
            dev_u32(fs->flags).store(GPUNVME_FS_QUARANTINED, cuda::memory_order_release);
            dev_u32(state_of(c)->quarantined).fetch_add(1u, cuda::memory_order_relaxed);
        }
    }
    count(s == GPUNVME_CACHE_FULL ? k->full : k->errors, 1);
    record_failure(c, s, sf, range, page);
    // Transition 4 (wrapping arithmetic: BUSY is set, ERROR and the status bits are clear, so
    // nothing borrows from or carries into the frame bits, which are 0).
    const uint64_t code = (uint64_t)s & 15u;
    word_of(e).fetch_add((uint64_t)GPUNVME_PS_ERROR + (code << GPUNVME_PS_STATUS_SHIFT) -
                             (uint64_t)GPUNVME_PS_BUSY,
                         cuda::memory_order_release);
    return s;
}

/// A device variable of the header: inline where the compilation allows it (separate
/// compilation, the host build), else one definition per module.
#if defined(GPUNVME_HOST_BUILD) || defined(__CUDACC_RDC__)
#define GPUNVME_PTR_VAR inline __device__
#else
// Whole-program compilation allows no inline device variable, and a static one gets a name
// that depends on the build path (the committed PTX must not): one module, one definition.
#define GPUNVME_PTR_VAR __device__
#endif

/// fill_page as the access paths call it: through a pointer the compiler cannot see through,
/// so that the call follows the ABI (the fill saves the registers it takes, on the miss path).
/// Called directly, ptxas allocated the caller and the fill (and the queue code below it)
/// together, and as they take every register a __launch_bounds__(256, 2) kernel has (128),
/// the values the caller kept across the call lived in local memory on the hit path too:
/// Nsight Compute counted 300 sectors of local loads per one-page read_range on an H100
/// (2026-11-28). Volatile, so that the pointer is not folded back into a direct call.
GPUNVME_PTR_VAR status (*volatile fill_page_abi)(const cache_desc&, const queue_desc&,
                                                   uint32_t, uint64_t, page_entry*, uint32_t*,
                                                   uint64_t, bool) = fill_page;

/// A page waiter's bound: twice the queue's, so that the filler's own bounded outcome (an
/// ERROR page with TIMEOUT or QUEUE_FAILED) normally reaches the waiter first.
__device__ __forceinline__ waiter page_waiter(const queue_desc& q) {
    waiter w(q);
    w.deadline += q.timeout_ns;
    return w;
}

// ---------------------------------------------------------------------------------------------
// Thread variants: any thread, alone (no coalescing; still one fill per missing page).

/// acquire_thread without the clock bit: *frame holds the page on GPUNVME_OK (the caller sets
/// the bit with touch() before it releases, off the path to the data).
__device__ inline status acquire_page(const cache_desc& c, uint32_t range, uint64_t page,
                                      uint32_t* frame) {
    if (range >= c.nranges || c.nqueues == 0 || c.nframes == 0) return GPUNVME_INVALID_ARGUMENT;
    const range_desc& r = range_of(c, range);
    if (page >= r.npages) return GPUNVME_OUT_OF_EXTENT;
    const queue_desc& q = queue_for(c);
    page_entry* e = entry_of(r, page);
    cache_stats* k = stats_of(c);
    status s = GPUNVME_OK;
    uint32_t f = 0;
    uint32_t how = lookup(e, 1, &s, &f);
    if (how == ACQ_HIT) count(k->hits, 1);
    if (how == ACQ_WAIT) {
        count(k->waits, 1);
        waiter w = page_waiter(q);
        while (how == ACQ_WAIT) {
            const uint64_t cur = word_of(e).load(cuda::memory_order_acquire);
            how = classify(e, cur, &s, &f);
            if (how != ACQ_WAIT) break;
            status t = w.tick(q);  // not a queue wait: the queue is not failed for it
            if (t) { s = t; how = ACQ_FAILED; }
        }
    }
    if (how == ACQ_FILL)
        how = (s = fill_page_abi(c, q, range, page, e, &f, now_ns() + c.full_wait_ns, false))
                  ? ACQ_FAILED
                  : ACQ_HIT;
    if (how != ACQ_HIT) {
        release_refs(e, 1);
        return s;
    }
    *frame = f;
    return GPUNVME_OK;
}

/// Takes a reference to page `page` (of a checked range) only if it is VALID: never fills and
/// never waits, so a caller may hold other pages while it asks (read_range's batches). On
/// true *frame holds the page until release_hit; not counted (the caller counts its hits).
__device__ inline bool try_hit(page_entry* e, uint32_t* frame) {
    const uint64_t old = word_of(e).fetch_add(1u, cuda::memory_order_acquire);
    if ((old & GPUNVME_PS_VALID) && (old & GPUNVME_PS_REFS_MASK) < (GPUNVME_PS_REFS_MASK >> 1)) {
        *frame = frame_in(old);  // in the word that showed VALID, as in classify
        return true;
    }
    release_refs(e, 1);  // not a hit: give the reference back (resetting an ERROR page)
    return false;
}

/// Acquires page `page` of range `range`: on GPUNVME_OK *data points at its bytes, which stay
/// valid until release_thread. Every wait is bounded.
__device__ inline status acquire_thread(const cache_desc& c, uint32_t range, uint64_t page,
                                        uint8_t** data) {
    uint32_t f = 0;
    status s = acquire_page(c, range, page, &f);
    if (s) return s;
    touch(c, f);
    *data = frame_data(c, f);
    return GPUNVME_OK;
}

/// Gives back a page acquire_thread returned GPUNVME_OK for.
__device__ inline void release_thread(const cache_desc& c, uint32_t range, uint64_t page) {
    release_hit(entry_of(range_of(c, range), page), 1);
}

// ---------------------------------------------------------------------------------------------
// Warp variants: all 32 lanes call together (active == false: a lane that asks for nothing).
// One lookup per distinct page per warp: the lanes on one page elect a leader
// (__match_any_sync) who takes their references with one atomic and acts for them.

/// One lane's view of a warp access.
struct warp_access {
    page_entry* e;    // the page's entry (lanes that ask for something)
    uint32_t leader;  // lowest lane on the same page
    uint32_t n;       // lanes on the page
    uint32_t how;     // ACQ_*: the leader's, for every lane of the group
    status s;         // the outcome when ACQ_FAILED (or the argument check's)
    uint32_t frame;   // the frame when ACQ_HIT
    bool lead;        // this lane is its group's leader and asks for something
};

/// Phase A: coalesce, and let each leader look its page up (transition 1). `pre` is the
/// lane's argument check; lanes with one ask for nothing. `entries` is the lane's range's
/// (read only when pre is GPUNVME_OK), `stats` the block's statistics slot.
__device__ inline warp_access lookup_warp(cache_stats* stats, page_entry* entries, bool active,
                                          status pre, uint32_t range, uint64_t page) {
    const uint32_t full = 0xffffffffu, lane = lane_id();
    const bool in = active && pre == GPUNVME_OK;
    // Inactive lanes get a key of their own (ranges are < 4096, so no real page has it).
    const uint64_t key = in ? ((uint64_t)range << 48 | page) : (0xffffull << 48 | lane);
    uint32_t peers;
    if (__all_sync(full, key == __shfl_sync(full, key, 0))) peers = full;  // one page: no match
    else peers = __match_any_sync(full, key);
    warp_access a;
    a.leader = __ffs(peers) - 1;
    a.n = __popc(peers);
    a.lead = in && lane == a.leader;
    a.e = in ? entries + page : nullptr;
    a.how = in ? ACQ_NONE : ACQ_FAILED;
    a.s = pre;
    a.frame = 0;
    if (!active) a.how = ACQ_NONE;
    if (a.lead) a.how = lookup(a.e, a.n, &a.s, &a.frame);
    const uint32_t hits = __reduce_add_sync(full, a.lead && a.how == ACQ_HIT ? a.n : 0u);
    if (lane == 0 && hits) count(stats->hits, hits);
    a.how = __shfl_sync(full, a.how, a.leader);
    a.s = __shfl_sync(full, a.s, a.leader);
    a.frame = __shfl_sync(full, a.frame, a.leader);
    return a;
}

/// Phases B and C: leaders that own fills run them (thread variant, divergent, one ticket per
/// lane), then the warp waits, converged, for the pages other warps fill. Afterwards every
/// asking lane's group is ACQ_HIT or ACQ_FAILED, and failed groups hold no references.
__device__ inline void resolve_warp(const cache_desc& c, uint32_t range, uint64_t page,
                                    warp_access& a) {
    const uint32_t full = 0xffffffffu;
    const queue_desc& q = queue_for(c);
    if (a.lead && a.how == ACQ_FILL)
        a.how = (a.s = fill_page_abi(c, q, range, page, a.e, &a.frame,
                                     now_ns() + c.full_wait_ns, false))
                    ? ACQ_FAILED
                    : ACQ_HIT;
    if (__any_sync(full, a.lead && a.how == ACQ_WAIT)) {
        if (a.lead && a.how == ACQ_WAIT) count(stats_of(c)->waits, a.n);
        waiter w = page_waiter(q);
        for (;;) {
            if (a.lead && a.how == ACQ_WAIT) {
                const uint64_t cur = word_of(a.e).load(cuda::memory_order_acquire);
                a.how = classify(a.e, cur, &a.s, &a.frame);
                if (a.how == ACQ_HIT) touch(c, a.frame);
                if (a.how == ACQ_FILL)  // the page's last fill failed meanwhile: ours now
                    a.how = (a.s = fill_page_abi(c, q, range, page, a.e, &a.frame,
                                                 now_ns() + c.full_wait_ns, false))
                                ? ACQ_FAILED
                                : ACQ_HIT;
            }
            if (!__any_sync(full, a.lead && a.how == ACQ_WAIT)) break;
            status t = warp_tick(q, w);  // not a queue wait: the queue is not failed for it
            if (t) {
                if (a.lead && a.how == ACQ_WAIT) {
                    a.how = ACQ_FAILED;
                    a.s = t;
                }
                break;
            }
        }
    }
    if (a.lead && a.how == ACQ_FAILED) release_refs(a.e, a.n);
    a.how = __shfl_sync(full, a.how, a.leader);
    a.s = __shfl_sync(full, a.s, a.leader);
    a.frame = __shfl_sync(full, a.frame, a.leader);
}

/// How long one round's fill in array::load looks for a frame before giving the fill back.
#define GPUNVME_CACHE_ROUND_NS 20000

/// Phases B and C for accesses that use the page at once (array::load, store), in rounds, so that a warp
/// never holds the pages it has read while its other lanes look for frames (that hold-and-wait
/// would need 32 free frames per missing warp). Each round: leaders that own fills fill with a
/// short frame search (GPUNVME_CACHE_ROUND_NS; a fill that finds no frame is given back and
/// retried); groups whose page is valid call read(frame) and their leaders release; failed
/// groups release (marking the page DIRTY first when `wrote`); waiting and given-back groups look at their page again; the warp sleeps
/// (bounded by lane 0's page waiter and the host's abort word) when nothing moved. A fill still
/// without a frame once full_wait_ns has passed makes a last search and fails the page with
/// GPUNVME_CACHE_FULL. Returns with every asking lane's group done; a.s is its outcome.
/// Gives back a group's references after its lanes accessed the page (transition 6), marking it
/// DIRTY first when they stored (transition 7). The caller's __syncwarp ordered every lane's
/// accesses before this leader's release.
__device__ __forceinline__ void release_after_access(page_entry* e, uint32_t n, bool wrote) {
    if (wrote) red_or_release(&e->word, (uint64_t)GPUNVME_PS_DIRTY);
    release_hit(e, n);
}

template <class F>
__device__ inline void resolve_warp_reading(const cache_desc& c, uint32_t range, uint64_t page,
                                            warp_access& a, bool wrote, F&& read) {
    const uint32_t full = 0xffffffffu;
    const queue_desc& q = queue_for(c);
    uint64_t give_up = lane_id() == 0 ? now_ns() + c.full_wait_ns : 0;
    give_up = __shfl_sync(full, give_up, 0);
    if (a.lead && a.how == ACQ_WAIT) count(stats_of(c)->waits, a.n);
    waiter w = page_waiter(q);
    for (;;) {
        // B: fills (divergent: the thread variant's calls, one ticket per lane).
        if (a.lead && a.how == ACQ_FILL) {
            const uint64_t now = now_ns();
            const bool last = now > give_up;
            const status s = fill_page_abi(c, q, range, page, a.e, &a.frame,
                                           last ? now : now + GPUNVME_CACHE_ROUND_NS, !last);
            a.s = s;
            a.how = s == GPUNVME_OK                      ? ACQ_HIT
                    : s == GPUNVME_CACHE_FILL_GIVEN_BACK ? ACQ_RETRY
                                                         : ACQ_FAILED;
        }
        // Settle: groups with a valid page read it and release it; failed groups release.
        const uint32_t how = __shfl_sync(full, a.how, a.leader);
        const uint32_t frame = __shfl_sync(full, a.frame, a.leader);
        if (how == ACQ_HIT) read(frame);
        __syncwarp();  // every lane's reads before its leader's release
        if (a.lead && (a.how == ACQ_HIT || a.how == ACQ_FAILED)) {
            if (a.how == ACQ_HIT) release_after_access(a.e, a.n, wrote);
            else release_refs(a.e, a.n);
            if (a.how == ACQ_HIT) a.s = GPUNVME_OK;
            a.how = ACQ_DONE;
        }
        if (!__any_sync(full, a.lead && a.how != ACQ_DONE && a.how != ACQ_NONE)) break;
        // C: waiting and given-back groups look at their page again.
        bool moved = false;
        if (a.lead && (a.how == ACQ_WAIT || a.how == ACQ_RETRY)) {
            const uint64_t cur = word_of(a.e).load(cuda::memory_order_acquire);
            const uint32_t was = a.how;
            a.how = classify(a.e, cur, &a.s, &a.frame);
            if (a.how == ACQ_HIT) touch(c, a.frame);
            if (was == ACQ_RETRY && a.how == ACQ_WAIT) count(stats_of(c)->waits, a.n);
            moved = a.how != ACQ_WAIT;
        }
        if (__any_sync(full, moved)) continue;
        const status t = warp_tick(q, w);  // not a queue wait: the queue is not failed for it
        if (t && a.lead && a.how == ACQ_WAIT) {
            a.how = ACQ_FAILED;
            a.s = t;
        }
    }
    a.how = __shfl_sync(full, a.how, a.leader);
    a.s = __shfl_sync(full, a.s, a.leader);
}

/// Acquires page `page` of range `range` for every active lane (warp-collective): on
/// GPUNVME_OK *data points at the page's bytes until release_warp. Lanes on one page share
/// one lookup and at most one fill.
__device__ inline status acquire_warp(const cache_desc& c, bool active, uint32_t range,
                                      uint64_t page, uint8_t** data) {
    status pre = GPUNVME_OK;
    if (active) {
        if (range >= c.nranges || c.nqueues == 0 || c.nframes == 0)
            pre = GPUNVME_INVALID_ARGUMENT;
        else if (page >= range_of(c, range).npages)
            pre = GPUNVME_OUT_OF_EXTENT;
    }
    page_entry* entries =
        active && pre == GPUNVME_OK ? reinterpret_cast<page_entry*>(range_of(c, range).entries)
                                    : nullptr;
    warp_access a = lookup_warp(stats_of(c), entries, active, pre, range, page);
    if (a.lead && a.how == ACQ_HIT) touch(c, a.frame);
    resolve_warp(c, range, page, a);
    if (!active) return GPUNVME_OK;
    if (a.how != ACQ_HIT) return a.s ? a.s : GPUNVME_INVALID_ARGUMENT;
    *data = frame_data(c, a.frame);
    return GPUNVME_OK;
}

/// Gives back what acquire_warp acquired (warp-collective; `held` = that call returned
/// GPUNVME_OK for this lane, with the same range and page).
__device__ inline void release_warp(const cache_desc& c, bool held, uint32_t range,
                                    uint64_t page) {
    const uint32_t full = 0xffffffffu, lane = lane_id();
    const uint64_t key = held ? ((uint64_t)range << 48 | page) : (0xffffull << 48 | lane);
    uint32_t peers;
    if (__all_sync(full, key == __shfl_sync(full, key, 0))) peers = full;
    else peers = __match_any_sync(full, key);
    // Every lane's reads of the frame come before its leader's release.
    __syncwarp();
    if (held && lane == (uint32_t)(__ffs(peers) - 1))
        release_hit(entry_of(range_of(c, range), page), __popc(peers));
}

/// Writes back every dirty page of frames [first, first + count) with this thread alone (the
/// flush kernel gives each thread its frames): takes each frame's lock (waiting, bounded, for
/// an evictor that holds it), then transition 9f (VALID|DIRTY -> VALID|BUSY, DIRTY cleared
/// before the write), the write, 10 or 12. Run it when no kernel stores into the cache: a store
/// during the write re-dirties the page, which the next flush writes. Returns the first failure
/// (GPUNVME_OK if none); a frame quarantined with a dirty page in it counts as failed
/// (GPUNVME_QUEUE_FAILED: its earlier write-back may still be in flight).
__device__ inline status flush_frames_thread(const cache_desc& c, uint64_t first, uint64_t count) {
    const queue_desc& q = queue_for(c);
    status out = GPUNVME_OK;
    for (uint64_t f = first; f < first + count && f < c.nframes; ++f) {
        frame_state* fs = frame_of(c, f);
        waiter w(q);
        uint32_t fl = 0;
        status s = GPUNVME_OK;
        for (;;) {
            fl = dev_u32(fs->flags).load(cuda::memory_order_relaxed);
            if (!(fl & GPUNVME_FS_LOCKED) &&
                dev_u32(fs->flags).compare_exchange_strong(fl, fl | GPUNVME_FS_LOCKED,
                                                           cuda::memory_order_acquire,
                                                           cuda::memory_order_relaxed))
                break;
            if ((s = w.tick(q))) break;
        }
        if (s) {
            if (!out) out = s;
            continue;
        }
        const uint32_t owner = fs->range;
        if (owner < c.nranges && fs->page < range_of(c, owner).npages) {
            page_entry* e = entry_of(range_of(c, owner), fs->page);
            uint64_t cur = word_of(e).load(cuda::memory_order_relaxed);
            bool mine = false;
            while ((cur & (GPUNVME_PS_VALID | GPUNVME_PS_DIRTY | GPUNVME_PS_BUSY)) ==
                   (GPUNVME_PS_VALID | GPUNVME_PS_DIRTY)) {
                if (fl & GPUNVME_FS_QUARANTINED) break;
                if (word_of(e).compare_exchange_weak(
                        cur, (cur & ~(uint64_t)GPUNVME_PS_DIRTY) | GPUNVME_PS_BUSY,
                        cuda::memory_order_acquire, cuda::memory_order_relaxed)) {
                    mine = true;
                    break;
                }
            }
            if (mine) {
                s = write_back(c, q, owner, fs->page, (uint32_t)f, e);
                if (s == GPUNVME_OK)
                    word_of(e).fetch_sub(GPUNVME_PS_BUSY, cuda::memory_order_release);
                else if (!out)
                    out = s;
                fl = dev_u32(fs->flags).load(cuda::memory_order_relaxed) & ~GPUNVME_FS_LOCKED;
            } else if ((fl & GPUNVME_FS_QUARANTINED) && (cur & GPUNVME_PS_DIRTY) && !out) {
                out = GPUNVME_QUEUE_FAILED;
            }
        }
        dev_u32(fs->flags).store(fl, cuda::memory_order_release);
    }
    return out;
}

/// 16-byte words of read_range's register-staged tail per warp (256: 4 KiB, 8 per lane), and
/// of copy_warp's batches.
#ifndef GPUNVME_TAIL_WORDS
#define GPUNVME_TAIL_WORDS 256
#endif
static_assert(GPUNVME_TAIL_WORDS >= 32 && GPUNVME_TAIL_WORDS % 32 == 0,
              "GPUNVME_TAIL_WORDS: whole 16-byte words per lane of a warp");

/// n bytes from src to dst by the 32 lanes of a warp (every lane passes the same arguments).
/// When both ends and n are 16-byte aligned, in batches of GPUNVME_TAIL_WORDS words: each lane
/// loads its GPUNVME_TAIL_WORDS / 32 words into registers, then stores them, so a batch's loads
/// are in flight together (copy_bytes stores each word as it arrives, and with the two buffers
/// possibly aliased the compiler keeps that order: one load's latency per word). Otherwise
/// copy_bytes. read_range copies with it, and so does the benchmark's plain buffer, its
/// denominator.
__device__ __forceinline__ void copy_warp(uint8_t* dst, const uint8_t* src, uint32_t n,
                                          uint32_t lane) {
    if ((((uintptr_t)dst | (uintptr_t)src | n) & 15) != 0) {
        copy_bytes(dst, src, n, lane, 32);
        return;
    }
    constexpr uint32_t per = GPUNVME_TAIL_WORDS / 32;
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    const uint32_t words = n / 16;
    uint32_t k = 0;
    for (; k + GPUNVME_TAIL_WORDS <= words; k += GPUNVME_TAIL_WORDS) {
        uint4 t[per];
#pragma unroll
        for (uint32_t w = 0; w < per; ++w) t[w] = s[k + lane + 32 * w];
#pragma unroll
        for (uint32_t w = 0; w < per; ++w) d[k + lane + 32 * w] = t[w];
    }
    for (k += lane; k < words; k += 32) d[k] = s[k];
}

/// The rest of a read_range batch once its pages are held: lane j < k holds page p0 + j (in
/// frame f) when `held`; pages p0 .. p0 + k - 1 in a row (k >= 1: lane 0 holds). Copies them
/// into out from byte *done of the run [first, first + len) on, advancing *done, sets each
/// frame's clock bit and gives the pages back (reductions the warp does not wait for). A
/// hit past the first gap is given back at once. `fast`: every held page is a try_hit, none
/// counted yet (else acquire_page counted lane 0's).
__device__ __forceinline__ void finish_batch(const range_view& v, uint64_t first, uint64_t len,
                                             uint64_t p0, bool held, uint32_t f, bool fast,
                                             uint8_t* out, uint64_t* done, uint32_t lane) {
    const uint32_t full = 0xffffffffu;
    const uint64_t page_bytes = 1ull << v.page_shift;
    const uint32_t got = __ballot_sync(full, held);
    const uint32_t k = ~got == 0 ? 32u : (uint32_t)__ffs(~got) - 1;
    if (held && lane >= k) release_hit(v.entries + p0 + lane, 1);
    const uint32_t hits = fast ? k : k - 1;
    if (lane == 0 && hits > 0) count(v.stats->hits, hits);
    // Every held page but the last, copied as it comes (a range's last byte is on the batch's
    // last page, so only the last page of a batch can end the run).
    uint64_t d = *done;
    for (uint32_t j = 0; j + 1 < k; ++j) {
        const uint64_t off = (first + d) & (page_bytes - 1);
        const uint32_t chunk = (uint32_t)(page_bytes - off);
        copy_warp(out + d, frame_data(v, __shfl_sync(full, f, j)) + off, chunk, lane);
        d += chunk;
    }
    const uint64_t off = (first + d) & (page_bytes - 1);
    const uint32_t chunk = (uint32_t)(len - d < page_bytes - off ? len - d : page_bytes - off);
    const uint8_t* src = frame_data(v, __shfl_sync(full, f, k - 1)) + off;
    uint8_t* to = out + d;
    *done = d + chunk;
    // The last page's last 4 KiB (when 16-byte aligned) is loaded into registers and stored
    // only after the releases: a release (`red.release.gpu`, MEMBAR.GPU in SASS) waits for
    // every earlier store of the thread, and with the copy's stores before it a 4 KiB run (one
    // page) waited for all of them to reach L2.
    const bool staged = (((uintptr_t)to | (uintptr_t)src | chunk) & 15) == 0;
    const uint32_t t = !staged ? 0u : chunk < 16 * GPUNVME_TAIL_WORDS ? chunk
                                                                       : 16 * GPUNVME_TAIL_WORDS;
    copy_warp(to, src, chunk - t, lane);
    uint4* tail_dst = reinterpret_cast<uint4*>(to + (chunk - t));
    const uint4* tail_src = reinterpret_cast<const uint4*>(src + (chunk - t));
    const uint32_t tail_words = t / 16;
    // Each word set on every path (zero where unused): a word left unset on some path would
    // carry the previous batch's value, and ptxas kept such words in local memory.
    uint4 tail[GPUNVME_TAIL_WORDS / 32];
#pragma unroll
    for (uint32_t w = 0; w < GPUNVME_TAIL_WORDS / 32; ++w)
        tail[w] = lane + 32 * w < tail_words ? tail_src[lane + 32 * w] : make_uint4(0, 0, 0, 0);
    // Every lane's reads of the frames (the tail's loads included: the release orders them, in
    // program order and through this barrier) before their holders' releases.
    __syncwarp();
    if (held && lane < k) {
        touch(v.frame_states, f);
        release_hit(v.entries + p0 + lane, 1);
    }
    // The tail's stores write the caller's buffer from registers, not the frames.
#pragma unroll
    for (uint32_t w = 0; w < GPUNVME_TAIL_WORDS / 32; ++w)
        if (lane + 32 * w < tail_words) tail_dst[lane + 32 * w] = tail[w];
}

/// The pages of read_range's batch from byte `done` of the run [first, first + len) on: up to
/// 32, to the run's last page.
__device__ __forceinline__ uint32_t batch_pages(const range_view& v, uint64_t first,
                                                uint64_t len, uint64_t done) {
    const uint64_t p0 = (first + done) >> v.page_shift;
    const uint64_t last_page = (first + len - 1) >> v.page_shift;
    return last_page - p0 < 32 ? (uint32_t)(last_page - p0) + 1 : 32u;
}

/// read_range from byte `done` of the run [first, first + len) of range `range` on (checked by
/// the caller), once the batch at `done` found its first page no hit (the warp holds nothing):
/// lane 0 acquires that page (acquire_page: one lookup, at most one fill, every wait bounded),
/// then, holding only that VALID page, the other lanes try theirs; later batches as
/// read_range's (every lane tries its page as a hit first). Out of line: the general path's
/// code stays off the hit path's loop. Every lane returns the same status.
__device__ GPUNVME_NOINLINE inline status read_bytes_from(const cache_desc* c, uint32_t range,
                                                          uint64_t first, uint64_t len,
                                                          uint64_t done, uint8_t* out) {
    const uint32_t full = 0xffffffffu, lane = lane_id();
    const range_view v = view_nc(c, range);
    for (bool missed = true; done < len; missed = false) {
        const uint64_t p0 = (first + done) >> v.page_shift;
        const uint32_t np = batch_pages(v, first, len, done);
        uint32_t f = 0;
        bool held = !missed && lane < np && try_hit(v.entries + p0 + lane, &f);
        const bool fast = __shfl_sync(full, held, 0);
        if (!fast) {
            if (held) release_hit(v.entries + p0 + lane, 1);
            status s = GPUNVME_OK;
            if (lane == 0) s = acquire_page(*c, range, p0, &f);
            s = __shfl_sync(full, s, 0);
            if (s) return s;
            held = lane == 0 || (lane < np && try_hit(v.entries + p0 + lane, &f));
        }
        finish_batch(v, first, len, p0, held, f, fast, out, &done, lane);
    }
    return GPUNVME_OK;
}

}  // namespace cache

// ---------------------------------------------------------------------------------------------
// gpunvme::array<T>: a device view of a cached range as elements of T.

/// Elements of type T over range `range` of a cache. T is trivially copyable and its size a
/// power of two up to 4096 (so it divides every page). load() and operator[] are
/// warp-collective (all 32 lanes together); the _thread forms are for divergent code.
template <class T>
struct array {
    static_assert(sizeof(T) <= 4096 && (sizeof(T) & (sizeof(T) - 1)) == 0,
                  "array<T>: sizeof(T) must be a power of two up to 4096");
    const cache::cache_desc* c;
    uint32_t range;
    status first;         // the first failure operator[] met (GPUNVME_OK if none)
    __device__ array(const cache::cache_desc* cache, uint32_t r)
        : c(cache), range(r), first(GPUNVME_OK) {}

    /// What the hit path needs of the cache and the range, read at the start of each access.
    __device__ cache::range_view view() const { return cache::view_nc(c, range); }

    /// Elements in the range (0 for a range that is not bound).
    __device__ uint64_t size() const { return view().bytes / sizeof(T); }

    /// Element i into *out (warp-collective; inactive lanes pass active = false). Lanes on one
    /// page share one lookup and at most one fill; hits read and release before the warp's
    /// fills, and fills run in rounds (resolve_warp_reading), so a warp holds no page while
    /// it looks for frames.
    __device__ status load(uint64_t i, T* out, bool active = true) {
        return access_warp(i, active, false,
                           [&](uint8_t* p) { *out = *reinterpret_cast<const T*>(p); });
    }

    /// Stores v as element i (warp-collective like load(); the range must be writable, else
    /// GPUNVME_OUT_OF_EXTENT). A missing page is read first (read-modify-write of the page);
    /// the page is DIRTY until written back on eviction or by GpuCache::flush. Two lanes
    /// storing one element: either value wins.
    __device__ status store(uint64_t i, const T& v, bool active = true) {
        return access_warp(i, active, true, [&](uint8_t* p) { *reinterpret_cast<T*>(p) = v; });
    }

    /// Element i, alone.
    __device__ status load_thread(uint64_t i, T* out) {
        return access_thread(i, false,
                             [&](uint8_t* p) { *out = *reinterpret_cast<const T*>(p); });
    }

    /// Element i stored alone (see store()).
    __device__ status store_thread(uint64_t i, const T& v) {
        return access_thread(i, true, [&](uint8_t* p) { *reinterpret_cast<T*>(p) = v; });
    }

    /// Why element i cannot be loaded (or, with `write`, stored), or GPUNVME_OK with *byte its
    /// offset in the range.
    __device__ status element(const cache::range_view& v, uint64_t i, bool write,
                              uint64_t* byte) const {
        if (i > ~0ull / sizeof(T)) return GPUNVME_OUT_OF_EXTENT;
        *byte = i * sizeof(T);
        status s = cache::check_access(v, *byte, sizeof(T));
        if (!s && write && !(v.flags & GPUNVME_RF_WRITABLE)) s = GPUNVME_OUT_OF_EXTENT;
        return s;
    }

    /// load() and store(): `op` reads or writes the element at the pointer it is given, by
    /// every lane whose group holds the page; the leaders then release (marking the page
    /// DIRTY when `write`).
    template <class F>
    __device__ status access_warp(uint64_t i, bool active, bool write, F&& op) {
        using namespace cache;
        const range_view v = view();
        status pre = GPUNVME_OK;
        uint64_t byte = 0;
        if (active) pre = element(v, i, write, &byte);
        const uint64_t page = byte >> v.page_shift;
        const uint32_t off = (uint32_t)(byte & ((1ull << v.page_shift) - 1));
        warp_access a = lookup_warp(v.stats, v.entries, active, pre, range, page);
        // The hit path: access, then the leaders release.
        const bool early = active && a.how == ACQ_HIT;
        if (early) op(frame_data(v, a.frame) + off);
        __syncwarp();
        if (early && a.lead) {
            touch(v.frame_states, a.frame);
            release_after_access(a.e, a.n, write);
        }
        if (early) a.how = ACQ_DONE;
        if (__any_sync(0xffffffffu, a.lead && (a.how == ACQ_FILL || a.how == ACQ_WAIT ||
                                               a.how == ACQ_FAILED))) {
            resolve_warp_reading(*c, range, page, a, write,
                                 [&](uint32_t f) { op(frame_data(v, f) + off); });
        }
        if (!active || early) return GPUNVME_OK;
        return a.s;
    }

    /// load_thread() and store_thread().
    template <class F>
    __device__ status access_thread(uint64_t i, bool write, F&& op) {
        const cache::range_view v = view();
        uint64_t byte = 0;
        status s = element(v, i, write, &byte);
        if (s) return s;
        const uint64_t page = byte >> v.page_shift;
        uint32_t f = 0;
        if ((s = cache::acquire_page(*c, range, page, &f))) return s;
        op(cache::frame_data(v, f) + (byte & ((1ull << v.page_shift) - 1)));
        cache::touch(v.frame_states, f);
        cache::release_after_access(v.entries + page, 1, write);
        return GPUNVME_OK;
    }

    /// Elements [i, i + n) into dst (GPU memory), by the whole warp: every lane passes the same
    /// arguments. In batches of up to 32 pages: lane j takes page j if it is a hit (try_hit:
    /// no fill, no wait, so a warp never holds pages while it waits for a frame and a full cache
    /// cannot deadlock it). If the first page was no hit, the warp gives its hits back, lane 0
    /// acquires the first page (acquire_page: one lookup, at most one fill), and then, holding
    /// only that VALID page, the other lanes try theirs again. The batch is its first page and
    /// the hits right after it; the lanes copy them (16-byte words when the ends allow), then
    /// each holder sets its frame's clock bit and releases, both reductions the warp does not
    /// wait for. One round of lookups per batch of hits, two when the first page misses. Every
    /// lane returns the same status; on failure dst holds the elements before the failing page.
    __device__ status read_range(uint64_t i, uint64_t n, T* dst) {
        const uint32_t full = 0xffffffffu, lane = lane_id();
        if (n == 0) return GPUNVME_OK;
        if (i > ~0ull / sizeof(T) || n > ~0ull / sizeof(T) - i) return GPUNVME_OUT_OF_EXTENT;
        const uint64_t first = i * sizeof(T), len = n * sizeof(T);
        const cache::range_view v = view();
        status s = cache::check_access(v, first, len);
        if (s) return s;
        uint8_t* out = reinterpret_cast<uint8_t*>(dst);
        for (uint64_t done = 0; done < len;) {
            const uint64_t p0 = (first + done) >> v.page_shift;
            const uint32_t np = cache::batch_pages(v, first, len, done);
            uint32_t f = 0;
            const bool held = lane < np && cache::try_hit(v.entries + p0 + lane, &f);
            if (!__shfl_sync(full, held, 0)) {
                if (held) cache::release_hit(v.entries + p0 + lane, 1);
                return cache::read_bytes_from(c, range, first, len, done, out);
            }
            cache::finish_batch(v, first, len, p0, held, f, true, out, &done, lane);
        }
        return GPUNVME_OK;
    }

    /// Element i (warp-collective like load()); T{} on failure, the first failure in error().
    __device__ T operator[](uint64_t i) {
        T v{};
        status s = load(i, &v);
        if (s && !first) first = s;
        return v;
    }

    /// The first failure operator[] met, or GPUNVME_OK.
    __device__ status error() const { return first; }
};

// ---------------------------------------------------------------------------------------------
// gpunvme::array_cursor<T>: a warp's scan through an array, keeping its pages between loads.

/// A warp's read cursor over an array<T> (BaM's bam_ptr, for a warp): load() is array::load,
/// except that the pages a load used stay referenced after it, and the next load reads the
/// ones it still needs without looking them up. A warp scanning an array looks each page up
/// once instead of once per load (with 4-byte elements and 4 KiB pages, one lookup per 32
/// loads of the warp), and a load whose lanes are all on the one page the warp holds costs a
/// vote besides its read.
///
/// What it holds: one page per distinct page of its last load (a scan holds one, or two
/// where the lanes straddle a boundary), each referenced by one lane of the warp, and so not
/// evictable. A load first gives back the held pages it does not use, then looks its new
/// pages up as array::load does (one lookup per distinct page, at most one fill each), so a
/// warp never holds a page it does not use while it waits for a fill. Fills that find every
/// frame held, by cursors or by accesses, fail with GPUNVME_CACHE_FULL after the cache's
/// bound, as any access's. Matching a load's pages against the held ones costs one round of
/// shuffles per held page: for random indices array::load is the faster.
///
/// load() is warp-collective (all 32 lanes, inactive ones with active = false); release()
/// and the destructor are per lane (a warp may leave the cursor's scope diverged): each
/// holder gives its page back, and each lane adds the loads it served from held pages to the
/// cache's hits. Read-only; not copyable (a copy would give its pages back twice).
///
/// Fence discipline: a page's references are taken by a gpu-scope acquire (lookup_warp's
/// atomic) and given back by a release reduction (release_hit), as for array::load; every
/// lane's read of a held frame comes before the __syncwarp that ends the load, so before any
/// lane's later release of that frame.
template <class T>
struct array_cursor {
    static_assert(sizeof(T) <= 4096 && (sizeof(T) & (sizeof(T) - 1)) == 0,
                  "array_cursor<T>: sizeof(T) must be a power of two up to 4096");
    static constexpr uint64_t NONE = ~0ull;
    array<T> a;           // the array scanned (its cache, range and argument checks)
    cache::range_view v;  // read once: the cursor's accesses take few acquires
    uint64_t held;        // the page this lane holds for the warp (NONE: none)
    uint32_t held_frame;  // its frame
    uint32_t held_refs;   // the references held on it
    uint32_t reused;      // this lane's loads served from held pages, not yet counted as hits
    uint64_t only;        // warp-uniform: the warp's one held page (NONE: none, or several)
    uint32_t only_frame;  // warp-uniform: its frame

    __device__ explicit array_cursor(const array<T>& arr)
        : a(arr), v(arr.view()), held(NONE), held_frame(0), held_refs(0), reused(0), only(NONE),
          only_frame(0) {}
    array_cursor(const array_cursor&) = delete;
    array_cursor& operator=(const array_cursor&) = delete;
    __device__ ~array_cursor() { release(); }

    /// Element i into *out (warp-collective; inactive lanes pass active = false). Every lane
    /// returns its own status; on failure *out is untouched and the lane holds nothing for it.
    __device__ status load(uint64_t i, T* out, bool active = true) {
        using namespace cache;
        const uint32_t full = 0xffffffffu, lane = lane_id();
        status pre = GPUNVME_OK;
        uint64_t byte = 0;
        if (active) pre = a.element(v, i, false, &byte);
        const bool in = active && pre == GPUNVME_OK;
        const uint64_t page = byte >> v.page_shift;
        const uint32_t off = (uint32_t)(byte & ((1ull << v.page_shift) - 1));
        // 0. A scan's usual load: every asking lane on the one page the warp holds. (A lane
        //    that released since has `only` NONE, which sends the whole warp to the full path.)
        if (__all_sync(full, only != NONE && (!active || (in && page == only)))) {
            if (active) {
                *out = *reinterpret_cast<const T*>(frame_data(v, only_frame) + off);
                ++reused;
            }
            __syncwarp();  // as below
            return GPUNVME_OK;
        }
        // 1. Which held pages this load uses: for each holder j, the lanes on its page (src =
        //    j), the lowest of which takes the holding over (take = j). Held pages are
        //    distinct, so a lane matches at most one.
        uint32_t keep = 0;
        int32_t src = -1, take = -1;
        for (uint32_t m = __ballot_sync(full, held != NONE); m != 0; m &= m - 1) {
            const uint32_t j = (uint32_t)__ffs(m) - 1;
            const uint64_t hp = __shfl_sync(full, held, j);
            const bool want = in && hp == page;
            const uint32_t wanters = __ballot_sync(full, want);
            if (wanters != 0) keep |= 1u << j;
            if (want) src = (int32_t)j;
            if (wanters != 0 && lane == (uint32_t)__ffs(wanters) - 1) take = (int32_t)j;
        }
        const uint32_t kept_frame = __shfl_sync(full, held_frame, src < 0 ? lane : (uint32_t)src);
        const uint32_t kept_refs = __shfl_sync(full, held_refs, take < 0 ? lane : (uint32_t)take);
        // 2. Pages this load does not use go back before it looks new ones up. (Every lane's
        //    reads of them came before the last load's closing __syncwarp.)
        if (held != NONE && !((keep >> lane) & 1u)) give_back();
        held = NONE;
        // 3. The other pages: one lookup per distinct page, fills and waits resolved, the
        //    references kept (acquire_warp's path). Failed groups hold nothing afterwards.
        warp_access w = lookup_warp(v.stats, v.entries, active && src < 0, pre, a.range, page);
        if (w.lead && w.how == ACQ_HIT) touch(v.frame_states, w.frame);
        if (__any_sync(full, w.lead && (w.how == ACQ_FILL || w.how == ACQ_WAIT ||
                                        w.how == ACQ_FAILED)))
            resolve_warp(*a.c, a.range, page, w);
        // 4. The holdings after this load: each kept page by its first lane, each page looked
        //    up by its group's leader.
        if (take >= 0) {
            held = page;
            held_frame = kept_frame;
            held_refs = kept_refs;
        } else if (w.lead && w.how == ACQ_HIT) {
            held = page;
            held_frame = w.frame;
            held_refs = w.n;
        }
        const bool kept = src >= 0;
        const bool served = in && (kept || w.how == ACQ_HIT);
        if (served) *out = *reinterpret_cast<const T*>(frame_data(v, kept ? kept_frame : w.frame) + off);
        if (kept) ++reused;
        const uint32_t holders = __ballot_sync(full, held != NONE);
        const uint32_t h = holders ? (uint32_t)__ffs(holders) - 1 : 0;
        only = __shfl_sync(full, held, h);
        only_frame = __shfl_sync(full, held_frame, h);
        if (__popc(holders) != 1) only = NONE;
        __syncwarp();  // every lane's read of a held frame before any later release of it
        if (!active) return GPUNVME_OK;
        if (!in) return pre;
        if (served) return GPUNVME_OK;
        return w.s ? w.s : GPUNVME_INVALID_ARGUMENT;
    }

    /// Gives back this lane's page and counts its reused loads as hits (per lane; the warp's
    /// other lanes keep theirs until they release or load).
    __device__ void release() {
        only = NONE;  // the warp's next load takes the full path, which knows what is held
        if (held != NONE) {
            give_back();
            held = NONE;
        }
        if (reused) {
            cache::count(v.stats->hits, reused);
            reused = 0;
        }
    }

    /// Whether this lane holds a page (for tests: a warp holds one per distinct page of its
    /// last load).
    __device__ bool holds() const { return held != NONE; }

  private:
    __device__ void give_back() {
        cache::touch(v.frame_states, held_frame);
        cache::release_hit(v.entries + held, held_refs);
    }
};

}  // namespace gpunvme
