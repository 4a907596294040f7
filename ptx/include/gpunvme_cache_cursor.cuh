// gpunvme_cache_cursor.cuh — a part of gpunvme_cache.cuh (include that header, not this one):
// gpunvme::array_cursor<T>, a warp's scan through an array that keeps its pages between loads.
// Included by gpunvme_cache.cuh after the layout and the parts before it; the protocol, fence
// discipline and waiting rules it implements are described there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_cursor.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {

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
