// gpunvme_cache_primitives.cuh — a part of gpunvme_cache.cuh (include that header, not this one):
// the primitives: descriptor accessors, the hit path's range_view (view_nc), reference counting,
// the clock bit, and classify/lookup of a page entry. Included by gpunvme_cache.cuh after the
// layout and the parts before it; the protocol, fence discipline and waiting rules it implements
// are described there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_primitives.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {
namespace cache {

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
/// random loads but took registers from read_range's copy loop, slowing 64 KiB runs; figures in
/// benches/results/history.md.)
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

}  // namespace cache
}  // namespace gpunvme
