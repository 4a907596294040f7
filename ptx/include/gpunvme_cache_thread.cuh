// gpunvme_cache_thread.cuh — a part of gpunvme_cache.cuh (include that header, not this one): the
// thread variants: acquire_page, acquire_thread and release_thread for any thread alone. Included
// by gpunvme_cache.cuh after the layout and the parts before it; the protocol, fence discipline and
// waiting rules it implements are described there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_thread.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {
namespace cache {

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

}  // namespace cache
}  // namespace gpunvme
