// gpunvme_cache_flush.cuh — a part of gpunvme_cache.cuh (include that header, not this one):
// write-back of dirty frames by one thread (flush_frames_thread, for the flush kernel). Included by
// gpunvme_cache.cuh after the layout and the parts before it; the protocol, fence discipline and
// waiting rules it implements are described there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_flush.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {
namespace cache {

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

}  // namespace cache
}  // namespace gpunvme
