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

// Lets the parts below check that they are included from here.
#define GPUNVME_CACHE_CUH

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

}  // namespace cache
}  // namespace gpunvme

// The code, by concept, in the order it builds up (each part is only ever included from here):
#include "gpunvme_cache_primitives.cuh"
#include "gpunvme_cache_fill.cuh"
#include "gpunvme_cache_thread.cuh"
#include "gpunvme_cache_warp.cuh"
#include "gpunvme_cache_flush.cuh"
#include "gpunvme_cache_copy.cuh"
#include "gpunvme_cache_array.cuh"
#include "gpunvme_cache_cursor.cuh"
