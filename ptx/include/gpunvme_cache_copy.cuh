// gpunvme_cache_copy.cuh — a part of gpunvme_cache.cuh (include that header, not this one): bulk
// reads: the warp copy loop (copy_warp, GPUNVME_TAIL_WORDS), read_range's batches and its general
// path (read_bytes_from). Included by gpunvme_cache.cuh after the layout and the parts before it;
// the protocol, fence discipline and waiting rules it implements are described there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_copy.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {
namespace cache {

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
}  // namespace gpunvme
