// gpunvme_cache_warp.cuh — a part of gpunvme_cache.cuh (include that header, not this one): the
// warp variants: warp-coalesced lookups (one per distinct page), resolution of a warp's misses in
// rounds, acquire_warp and release_warp. Included by gpunvme_cache.cuh after the layout and the
// parts before it; the protocol, fence discipline and waiting rules it implements are described
// there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_warp.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {
namespace cache {

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

}  // namespace cache
}  // namespace gpunvme
