// gpunvme_cache_array.cuh — a part of gpunvme_cache.cuh (include that header, not this one):
// gpunvme::array<T>, a device view of a cached range as elements of T. Included by
// gpunvme_cache.cuh after the layout and the parts before it; the protocol, fence discipline and
// waiting rules it implements are described there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_array.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {

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

}  // namespace gpunvme
