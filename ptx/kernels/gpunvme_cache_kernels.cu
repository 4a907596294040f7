// gpunvme_cache_kernels.cu — the project's kernels over the page cache
// (ptx/include/gpunvme_cache.cuh) for the tests, benchmarks and examples: thin loops over its
// calls. #included at the end of gpunvme_tool_kernels.cu, so they are that module and PTX (loaded
// by those who use them, and launched once before a GPU-resident controller spins:
// ToolKernels::warm_up_clients). The cache's write-back kernel, which embedders use
// (GpuCache::flush), is in the runtime's module, gpunvme_kernels.cu.
#include "gpunvme_cache.cuh"

// The kernels that time hits are bounded to 128 registers (__launch_bounds__(256, 2): two
// blocks of 256 per SM): the miss path (fills, write-backs, file extents) is inlined into
// array<T>'s calls, and at 150 registers only one block fits, which costs the hit path far
// more than the spills do. The spills land in the miss path, where an NVMe command dwarfs them.
#define GPUNVME_CACHE_TEST_WARP 1u
#define GPUNVME_CACHE_TEST_STORE 2u
#define GPUNVME_CACHE_TEST_CURSOR 4u

/// Test and tool kernel: thread i accesses the 8-byte elements idx[i * per_thread + j] of
/// `range` through the cache: loads into values[k] (or, with GPUNVME_CACHE_TEST_STORE in
/// `flags`, stores values[k]), by the warp's lanes together (GPUNVME_CACHE_TEST_WARP:
/// array::load / store; with GPUNVME_CACHE_TEST_CURSOR, loads through one array_cursor per
/// warp, released at the kernel's end, each status with the number of the warp's lanes that
/// hold a page after the load in bits 16 and up) or each thread alone (load_thread /
/// store_thread), writing each status.
/// Threads at or past `nthreads` take part in the warp calls without asking for anything. A
/// null cache returns at once (warm-up).
extern "C" __global__ void gpunvme_cache_test(const cache::cache_desc* c, uint32_t range,
                                              uint32_t flags, uint32_t per_thread,
                                              uint64_t nthreads, const uint64_t* idx,
                                              uint64_t* values, uint32_t* statuses) {
    if (c == nullptr) return;
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const bool mine = gtid < nthreads;
    const bool warp = flags & GPUNVME_CACHE_TEST_WARP, store = flags & GPUNVME_CACHE_TEST_STORE;
    const bool cursor = warp && !store && (flags & GPUNVME_CACHE_TEST_CURSOR);
    gpunvme::array<uint64_t> a(c, range);
    gpunvme::array_cursor<uint64_t> cur(a);
    for (uint32_t j = 0; j < per_thread; ++j) {
        const uint64_t k = gtid * per_thread + j;
        const uint64_t i = mine ? idx[k] : 0;
        uint64_t v = mine && store ? values[k] : 0;
        status s = GPUNVME_OK;
        uint32_t holders = 0;
        if (cursor) {
            s = cur.load(i, &v, mine);
            holders = (uint32_t)__popc(__ballot_sync(0xffffffffu, cur.holds())) << 16;
        } else if (warp) s = store ? a.store(i, v, mine) : a.load(i, &v, mine);
        else if (mine) s = store ? a.store_thread(i, v) : a.load_thread(i, &v);
        if (mine) {
            if (!store) values[k] = v;
            statuses[k] = (uint32_t)s | holders;
        }
    }
}

/// Test kernel for a cache whose every frame is referenced: warps 0 .. pinners-1 each acquire
/// page pages[w] (acquire_warp) and hold it until words[1] is set or hold_ns pass; warp
/// `pinners`, once words[0] says every pinner has its page, asks for page pages[pinners], then
/// sets words[1]. statuses[w] gets each warp's acquire status. Launch whole warps, at least
/// pinners + 1 of them, all resident at once. A null cache returns at once (warm-up).
extern "C" __global__ void gpunvme_cache_pin_test(const cache::cache_desc* c, uint32_t range,
                                                  const uint64_t* pages, uint32_t pinners,
                                                  uint32_t* words, uint32_t* statuses,
                                                  uint64_t hold_ns) {
    if (c == nullptr) return;
    const uint32_t full = 0xffffffffu, lane = threadIdx.x & 31u;
    const uint64_t warp = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (warp > pinners) return;
    const uint64_t until = now_ns() + hold_ns;
    uint8_t* data = nullptr;
    if (warp < pinners) {
        status s = cache::acquire_warp(*c, true, range, pages[warp], &data);
        if (lane == 0) {
            statuses[warp] = (uint32_t)s;
            dev_u32(words[0]).fetch_add(1u, cuda::memory_order_release);
        }
        for (;;) {  // hold, bounded
            bool stop = lane == 0 && (dev_u32(words[1]).load(cuda::memory_order_acquire) != 0 ||
                                      now_ns() > until);
            if (__shfl_sync(full, stop, 0)) break;
            __nanosleep(1000);
        }
        cache::release_warp(*c, s == GPUNVME_OK, range, pages[warp]);
        return;
    }
    for (;;) {  // until every pinner holds its page, bounded
        bool go = lane == 0 && (dev_u32(words[0]).load(cuda::memory_order_acquire) >= pinners ||
                                now_ns() > until);
        if (__shfl_sync(full, go, 0)) break;
        __nanosleep(1000);
    }
    status s = cache::acquire_warp(*c, true, range, pages[warp], &data);
    cache::release_warp(*c, s == GPUNVME_OK, range, pages[warp]);
    if (lane == 0) {
        statuses[warp] = (uint32_t)s;
        dev_u32(words[1]).store(1u, cuda::memory_order_release);
    }
}

/// A plain GPU buffer behind array<T>'s load interface: the benchmark's denominator.
template <class T>
struct plain_array {
    const T* p;
    __device__ status load(uint64_t i, T* out, bool active = true) {
        if (active) *out = p[i];
        return GPUNVME_OK;
    }
    __device__ status read_range(uint64_t i, uint64_t n, T* dst) {
        // The same warp copy as the cache's read_range (loads batched before their stores).
        cache::copy_warp(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(p + i),
                         (uint32_t)(n * sizeof(T)), threadIdx.x & 31u);
        __syncwarp();
        return GPUNVME_OK;
    }
};

/// A benchmark's sum and failure count into out[0] and out[1]: one atomic per warp for each.
__device__ inline void bench_result(unsigned long long sum, unsigned long long errors,
                                    unsigned long long* out) {
    for (int d = 16; d > 0; d >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, d);
        errors += __shfl_down_sync(0xffffffffu, errors, d);
    }
    if ((threadIdx.x & 31u) == 0) {
        atomicAdd(&out[0], sum);
        atomicAdd(&out[1], errors);
    }
}

template <class T, class A>
__device__ inline void cache_bench_loop(A& a, uint32_t mode, uint64_t n, uint64_t iters,
                                        uint64_t seed, uint8_t* scratch,
                                        unsigned long long* out) {
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t nthreads = (uint64_t)gridDim.x * blockDim.x;
    const uint64_t mask = n - 1;
    unsigned long long sum = 0, errors = 0;
    // 2, 3: warp-wide sequential reads of 4 KiB or 64 KiB runs (read_range into the warp's run
    // of scratch), then each lane sums its share of the scratch.
    const uint64_t run = mode == 3 ? 65536 : 4096;
    const uint64_t per = run / sizeof(T), warp = gtid / 32, nwarps = nthreads / 32;
    T* mine = reinterpret_cast<T*>(scratch + warp * run);
    for (uint64_t k = 0; (mode == 2 || mode == 3) && k < iters; ++k) {
        const uint64_t chunk = (warp + k * nwarps) & ((n / per) - 1);
        if (a.read_range(chunk * per, per, mine)) ++errors;
        __syncwarp();
        for (uint64_t e = threadIdx.x & 31u; e < per; e += 32) sum += (unsigned long long)mine[e];
        __syncwarp();
    }
    for (uint64_t k = 0; mode < 2 && k < iters; ++k) {
        // 0: random elements; 1: sequential (a warp's lanes read 32 consecutive elements).
        const uint64_t i = mode == 0 ? pattern_mix(seed ^ (gtid * iters + k)) & mask
                                     : (gtid + k * nthreads) & mask;
        T v{};
        if (a.load(i, &v, true)) ++errors;
        sum += (unsigned long long)v;
    }
    bench_result(sum, errors, out);
}

/// Warp w reads `iters` x 32 consecutive elements from element w * iters * 32 on (wrapping at
/// n, a power of two), lane l the l-th of each 32, through `load(i, &v)`.
template <class T, class L>
__device__ inline void cache_scan_loop(L&& load, uint64_t n, uint64_t iters,
                                       unsigned long long* out) {
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t base = gtid / 32 * iters * 32 + (threadIdx.x & 31u);
    unsigned long long sum = 0, errors = 0;
    for (uint64_t k = 0; k < iters; ++k) {
        T v{};
        if (load((base + k * 32) & (n - 1), &v)) ++errors;
        sum += (unsigned long long)v;
    }
    bench_result(sum, errors, out);
}

/// The page cache's scan benchmark: every warp scans `iters` x 32 consecutive elements of
/// `elem_bytes` (4 or 8) out of `n` (cache_scan_loop), through the cache's range `range` with
/// array::load (cursor 0) or with an array_cursor (cursor 1), or from the plain buffer `plain`
/// (plain != null: the denominator). out[0] += the elements' sum, out[1] += failed loads.
/// Launch whole warps. Both pointers null: returns at once (warm-up).
template <class T>
__device__ inline void cache_bench_scan_as(const cache::cache_desc* c, uint32_t range,
                                           const uint8_t* plain, uint32_t cursor, uint64_t n,
                                           uint64_t iters, unsigned long long* out) {
    if (plain != nullptr) {
        const T* p = reinterpret_cast<const T*>(plain);
        cache_scan_loop<T>([&](uint64_t i, T* v) -> status {
            *v = p[i];
            return GPUNVME_OK;
        }, n, iters,
                           out);
        return;
    }
    gpunvme::array<T> a(c, range);
    if (cursor) {
        gpunvme::array_cursor<T> cur(a);
        cache_scan_loop<T>([&](uint64_t i, T* v) -> status { return cur.load(i, v); }, n, iters, out);
    } else {
        cache_scan_loop<T>([&](uint64_t i, T* v) -> status { return a.load(i, v); }, n, iters, out);
    }
}

extern "C" __global__ void __launch_bounds__(256, 2)
    gpunvme_cache_bench_scan(const cache::cache_desc* c, uint32_t range, const uint8_t* plain,
                             uint32_t cursor, uint32_t elem_bytes, uint64_t n, uint64_t iters,
                             unsigned long long* out) {
    if (c == nullptr && plain == nullptr) return;
    if (elem_bytes == 4) cache_bench_scan_as<uint32_t>(c, range, plain, cursor, n, iters, out);
    else cache_bench_scan_as<uint64_t>(c, range, plain, cursor, n, iters, out);
}

/// The page cache's element benchmark: every thread loads `iters` elements of `elem_bytes` (4
/// or 8) out of `n` (a power of two, at least 4 KiB of elements), random (mode 0) or
/// sequential per lane (1), or every warp reads `iters` 4 KiB (2) or 64 KiB (3) runs with
/// read_range into its run of `scratch`; through the cache's range `range` (plain == null) or from the plain
/// buffer `plain` (the same kernel, the same access stream: the denominator of the cache's
/// overhead). out[0] += the elements' sum (equal for both when they hold the same bytes),
/// out[1] += failed loads. Launch whole warps. Both pointers null: returns at once (warm-up).
extern "C" __global__ void __launch_bounds__(256, 2) gpunvme_cache_bench(const cache::cache_desc* c, uint32_t range,
                                               const uint8_t* plain, uint32_t mode,
                                               uint32_t elem_bytes, uint64_t n, uint64_t iters,
                                               uint64_t seed, uint8_t* scratch,
                                               unsigned long long* out) {
    if (c == nullptr && plain == nullptr) return;
    if (plain != nullptr) {
        if (elem_bytes == 4) {
            plain_array<uint32_t> a{reinterpret_cast<const uint32_t*>(plain)};
            cache_bench_loop<uint32_t>(a, mode, n, iters, seed, scratch, out);
        } else {
            plain_array<uint64_t> a{reinterpret_cast<const uint64_t*>(plain)};
            cache_bench_loop<uint64_t>(a, mode, n, iters, seed, scratch, out);
        }
    } else if (elem_bytes == 4) {
        gpunvme::array<uint32_t> a(c, range);
        cache_bench_loop<uint32_t>(a, mode, n, iters, seed, scratch, out);
    } else {
        gpunvme::array<uint64_t> a(c, range);
        cache_bench_loop<uint64_t>(a, mode, n, iters, seed, scratch, out);
    }
}

// ---------------------------------------------------------------------------------------------
// The examples' kernels (examples/gpu_bfs.rs, examples/gpu_embedding.rs; host side in the
// gpunvme crate's `workloads` module): the same source reads through a cache (array<T>) or
// from a plain pointer (GPU memory, or unified memory: the baselines).

#define GPUNVME_BFS_UNVISITED 0xffffffffu

/// The neighbours [b0, e0) of a vertex at `level`, 32 at a time by the warp from b0 + `from`
/// on, every `step` (lane l element b0 + from + l + k * step): each still UNVISITED gets
/// level + 1 by a CAS, counted in *won; failed loads and neighbours past nvertices in *bad.
/// Warp-uniform arguments.
template <class C>
__device__ inline void bfs_expand(C& cols, uint32_t nvertices, uint32_t* levels, uint32_t level,
                                  uint64_t b0, uint64_t e0, uint64_t from, uint64_t step,
                                  unsigned long long* bad, unsigned long long* won) {
    const uint32_t lane = threadIdx.x & 31u;
    for (uint64_t b = b0 + from; b < e0; b += step) {
        const uint64_t e = b + lane;
        const bool active = e < e0;
        uint32_t u = 0;
        const status s = cols.load(e, &u, active);
        if (!active) continue;
        if (s || u >= nvertices) {
            ++*bad;
            continue;
        }
        // Relaxed is enough: the level word is the only thing claimed, and the kernel
        // boundary orders the levels before the next level reads them.
        *won += atomicCAS(&levels[u], GPUNVME_BFS_UNVISITED, level + 1) == GPUNVME_BFS_UNVISITED;
    }
}

/// Hands the neighbours [b0, e0) to the heavy list (`heavy`: word 0 the entries taken, word 1
/// the capacity, then (begin, end) pairs), cut into entries of `segment` neighbours.
/// Returns false, taking nothing, when the list has no room (the caller expands them itself).
/// Warp-uniform arguments; lane 0 reserves the entries (a CAS, so that a full list is never
/// over-counted), the lanes write them. The kernel boundary publishes them to the heavy kernel.
__device__ inline bool bfs_defer(unsigned long long* heavy, uint32_t segment, uint64_t b0,
                                 uint64_t e0) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint64_t n = (e0 - b0 + segment - 1) / segment;
    unsigned long long at = ~0ull;
    if (lane == 0) {
        const unsigned long long cap = heavy[1];
        unsigned long long cur = *(volatile unsigned long long*)&heavy[0];
        while (cur + n <= cap) {
            const unsigned long long was = atomicCAS(&heavy[0], cur, cur + n);
            if (was == cur) {
                at = cur;
                break;
            }
            cur = was;
        }
    }
    at = __shfl_sync(0xffffffffu, at, 0);
    if (at == ~0ull) return false;
    unsigned long long* entries = heavy + 2;
    for (uint64_t k = lane; k < n; k += 32) {
        const uint64_t b = b0 + k * segment;
        entries[2 * (at + k)] = b;
        entries[2 * (at + k) + 1] = b + segment < e0 ? b + segment : e0;
    }
    return true;
}

/// The row offsets [*start, *end) of lane l's vertex v (v = a group's first vertex + l) by two
/// warp-wide loads (consecutive elements: one lookup per page; lanes not `mine` load nothing);
/// returns `todo` less the lanes whose row failed to load or goes backwards (a corrupt graph),
/// counted in *bad. Warp-collective.
template <class O>
__device__ inline uint32_t bfs_rows(O& offsets, uint64_t v, bool mine, uint32_t todo,
                                    uint64_t* start, uint64_t* end, unsigned long long* bad) {
    const status s = offsets.load(v, start, mine);
    const status s2 = offsets.load(v + 1, end, mine);
    const bool broken = ((todo >> (threadIdx.x & 31u)) & 1u) && (s || s2 || *end < *start);
    *bad += broken;
    return todo & ~__ballot_sync(0xffffffffu, broken);
}

/// Whether any of the neighbours [b0, e0) is at `level`, read 32 at a time by the warp until a
/// group holds one (failed loads and neighbours past nvertices counted in *bad). Warp-uniform
/// arguments and result.
template <class C>
__device__ inline bool bfs_find(C& cols, uint32_t nvertices, const uint32_t* levels,
                                uint32_t level, uint64_t b0, uint64_t e0,
                                unsigned long long* bad) {
    const uint32_t lane = threadIdx.x & 31u;
    for (uint64_t b = b0; b < e0; b += 32) {
        const uint64_t e = b + lane;
        const bool active = e < e0;
        uint32_t u = 0;
        const status s = cols.load(e, &u, active);
        const bool err = active && (s || u >= nvertices);
        *bad += err;
        if (__ballot_sync(0xffffffffu, active && !err && levels[u] == level)) return true;
    }
    return false;
}

/// One BFS level over a CSR graph, vertex-centric (EMOGI's and BaM's shape). The vertices go
/// to the blocks in runs of consecutive vertices: with `chunk` > 0 each block takes runs of
/// `chunk` vertices from the counter *next (zero at launch) until none is left, so blocks that
/// drew few vertices at `level` take more runs and the level ends with its last run, not with
/// its unluckiest block; with `chunk` 0 block b takes the b-th of gridDim.x equal runs (the
/// static split, kept to compare). A block's warps take a run's groups of 32 vertices in turn
/// and expand those at `level`, so a block reads its column pages in order, each page shared by
/// its warps, while the blocks running at once are spread over the graph and so over every
/// drive of a striped volume. Pages in use at once: about two per resident block. With a run
/// per warp it was two per warp (~4,000 on an H100), more than a small cache of large pages
/// holds: in a small cache of large pages warps evicted each other's pages between their own
/// loads and read the graph many times over (figures in benches/results/history.md). A frontier
/// queue's order is the order CASes were won: random pages, read again
/// and again once the columns exceed the cache (5x the misses of vertex order).
/// The row offsets of 32 vertices come by two warp-wide loads (consecutive elements: one
/// lookup per page), skipped when none of the 32 is at `level`; each vertex at `level` has its
/// neighbours read 32 at a time (lane l the column start + l + 32k); a neighbour u still
/// UNVISITED gets level + 1 by a CAS, counted in *visited. A vertex of more than `segment`
/// neighbours goes to the heavy list instead (when `heavy` is not null, `segment` is not 0 and
/// the list has room), whose entries gpunvme_cache_bfs_heavy's blocks take in turn: R-MAT
/// hubs have 10^5 neighbours, and one warp walking them alone held a level for milliseconds.
/// Failed loads, rows whose offsets go backwards and neighbours past nvertices (a corrupt
/// graph) are counted in *errors and skipped.
/// With Up, the step runs bottom-up (Beamer's direction-optimising BFS): each vertex still
/// UNVISITED with neighbours looks through them (bfs_find) for one at `level` and stops at the
/// first group of 32 that holds one: the vertex gets level + 1 (a plain store: only its own
/// warp writes it; others compare levels with `level`, which it is not), counted in *won; one
/// that finds none is counted in *left (the unvisited vertices that have neighbours: what the
/// host weighs the next step's direction by). Late levels, when few vertices are left, read
/// those few vertices' lists (and often only their first page) instead of every list of a
/// frontier spread over the graph. Hubs are not deferred bottom-up (an unvisited vertex
/// usually stops within its first group).
template <bool Up, class O, class C>
__device__ inline void bfs_run(O& offsets, C& cols, uint32_t nvertices, uint32_t* levels,
                               uint32_t level, uint64_t first, uint64_t last,
                               unsigned long long* heavy, uint32_t segment,
                               unsigned long long* bad, unsigned long long* won,
                               unsigned long long* left) {
    const uint32_t lane = threadIdx.x & 31u;
    const uint64_t warps = blockDim.x / 32, step = 32 * warps;
    const uint32_t full = 0xffffffffu;
    const uint32_t wanted = Up ? GPUNVME_BFS_UNVISITED : level;
    // Warp-uniform bounds and conditions: every lane runs the same iterations (the loads are
    // collective). 32 vertices at a time: lane l's vertex g + l; the row offsets of all 32 by
    // two warp-wide loads (consecutive elements: one lookup per page), skipped when none is at
    // `level` (bottom-up: UNVISITED).
    for (uint64_t g = first + 32 * (threadIdx.x / 32); g < last; g += step) {
        const uint64_t v = g + lane;
        const bool mine = v < last;
        uint32_t todo = __ballot_sync(full, mine && levels[v] == wanted);
        if (!todo) continue;
        uint64_t start = 0, end = 0;
        todo = bfs_rows(offsets, v, mine, todo, &start, &end, bad);
        // Bottom-up, a vertex without neighbours cannot be reached.
        if (Up) todo &= ~__ballot_sync(full, end == start);
        while (todo) {
            const uint32_t j = __ffs(todo) - 1;
            todo &= todo - 1;
            const uint64_t b0 = __shfl_sync(full, start, j), e0 = __shfl_sync(full, end, j);
            if constexpr (Up) {
                const bool found = bfs_find(cols, nvertices, levels, level, b0, e0, bad);
                if (lane == j) {
                    if (found) {
                        levels[v] = level + 1;
                        ++*won;
                    } else {
                        ++*left;
                    }
                }
            } else {
                if (heavy != nullptr && segment != 0 && e0 - b0 > segment &&
                    bfs_defer(heavy, segment, b0, e0))
                    continue;
                bfs_expand(cols, nvertices, levels, level, b0, e0, 0, 32, bad, won);
            }
        }
    }
}

/// A BFS level's runs, top-down or, with Up, bottom-up (bfs_run; counting in *left the
/// vertices with neighbours it leaves unvisited): two kernels, so that each keeps its own
/// registers.
template <bool Up, class O, class C>
__device__ inline void bfs_level(O& offsets, C& cols, uint32_t nvertices, uint32_t* levels,
                                 uint32_t level, unsigned long long* visited,
                                 unsigned long long* errors, unsigned long long* next,
                                 uint32_t chunk, unsigned long long* heavy, uint32_t segment,
                                 bool reverse, unsigned long long* left) {
    unsigned long long bad = 0, won = 0, unreached = 0;
    auto run_of = [&](uint64_t first, uint64_t last) {
        bfs_run<Up>(offsets, cols, nvertices, levels, level, first, last, heavy, segment, &bad,
                    &won, &unreached);
    };
    if (chunk == 0 || next == nullptr) {
        // Runs are whole groups of 32.
        const uint64_t per = ((nvertices + gridDim.x - 1) / gridDim.x + 31) / 32 * 32;
        const uint64_t first = (uint64_t)blockIdx.x * per;
        const uint64_t last = first + per < nvertices ? first + per : nvertices;
        run_of(first, last);
    } else {
        // Thread 0 draws the block's next run; the first barrier publishes it to the block,
        // the second keeps thread 0 from drawing again before every thread has read it. The
        // loop's condition is block-uniform, so every thread meets both barriers.
        GPUNVME_SHARED(unsigned long long, drawn);
        const uint64_t run = ((uint64_t)chunk + 31) / 32 * 32;
        for (;;) {
            if (threadIdx.x == 0) drawn = atomicAdd(next, (unsigned long long)run);
            __syncthreads();
            uint64_t first = drawn;
            __syncthreads();
            if (first >= nvertices) break;
            if (reverse) first = ((nvertices + run - 1) / run - 1 - first / run) * run;
            const uint64_t last = first + run < nvertices ? first + run : nvertices;
            run_of(first, last);
        }
    }
    for (int d = 16; d > 0; d >>= 1) {
        bad += __shfl_down_sync(0xffffffffu, bad, d);
        won += __shfl_down_sync(0xffffffffu, won, d);
        unreached += __shfl_down_sync(0xffffffffu, unreached, d);
    }
    if ((threadIdx.x & 31u) == 0 && bad) atomicAdd(errors, bad);
    if ((threadIdx.x & 31u) == 0 && won) atomicAdd(visited, won);
    if (Up && (threadIdx.x & 31u) == 0 && unreached) atomicAdd(left, unreached);
}

/// Launches bfs_level through the cache (plain_offsets null: ranges offsets_range and
/// cols_range of c) or over plain pointers, the vertices split as `chunk` says (`next` zeroed
/// before the launch; with `reverse` != 0 the dynamic split hands the runs out from the last
/// one down), vertices of more than `segment` neighbours deferred to `heavy` in entries of
/// `segment` (word 0 zeroed, word 1 its capacity in entries; null or 0: none deferred). A
/// level that sweeps the other way from the last one starts on the column pages that level
/// left in the cache: a clock cache smaller than a sweep keeps the sweep's tail, which the
/// next sweep in the same direction evicts before it gets there. Launch whole warps.
/// Everything null: returns at once (warm-up).
extern "C" __global__ void __launch_bounds__(256, 2) gpunvme_cache_bfs_level(
    const cache::cache_desc* c, uint32_t offsets_range, uint32_t cols_range,
    const uint64_t* plain_offsets, const uint32_t* plain_cols, uint32_t nvertices,
    uint32_t* levels, uint32_t level, unsigned long long* visited,
    unsigned long long* errors, unsigned long long* next, uint32_t chunk,
    unsigned long long* heavy, uint32_t segment, uint32_t reverse) {
    if (c == nullptr && plain_offsets == nullptr) return;
    if (plain_offsets != nullptr) {
        plain_array<uint64_t> o{plain_offsets};
        plain_array<uint32_t> k{plain_cols};
        bfs_level<false>(o, k, nvertices, levels, level, visited, errors, next, chunk, heavy,
                         segment, reverse != 0, nullptr);
    } else {
        gpunvme::array<uint64_t> o(c, offsets_range);
        gpunvme::array<uint32_t> k(c, cols_range);
        bfs_level<false>(o, k, nvertices, levels, level, visited, errors, next, chunk, heavy,
                         segment, reverse != 0, nullptr);
    }
}

/// One bottom-up BFS level (bfs_run<true>), split and swept as gpunvme_cache_bfs_level's; the
/// vertices with neighbours it leaves unvisited are counted in *left. Launch whole warps.
/// Everything null: returns at once (warm-up).
extern "C" __global__ void __launch_bounds__(256, 2) gpunvme_cache_bfs_up(
    const cache::cache_desc* c, uint32_t offsets_range, uint32_t cols_range,
    const uint64_t* plain_offsets, const uint32_t* plain_cols, uint32_t nvertices,
    uint32_t* levels, uint32_t level, unsigned long long* visited,
    unsigned long long* errors, unsigned long long* next, uint32_t chunk, uint32_t reverse,
    unsigned long long* left) {
    if (c == nullptr && plain_offsets == nullptr) return;
    if (plain_offsets != nullptr) {
        plain_array<uint64_t> o{plain_offsets};
        plain_array<uint32_t> k{plain_cols};
        bfs_level<true>(o, k, nvertices, levels, level, visited, errors, next, chunk, nullptr,
                        0, reverse != 0, left);
    } else {
        gpunvme::array<uint64_t> o(c, offsets_range);
        gpunvme::array<uint32_t> k(c, cols_range);
        bfs_level<true>(o, k, nvertices, levels, level, visited, errors, next, chunk, nullptr,
                        0, reverse != 0, left);
    }
}

/// The heavy list's entries of the level gpunvme_cache_bfs_level just ran (launched after it on
/// the same stream): block b expands entries b, b + gridDim.x, ... (at most the list's
/// capacity), its warps taking an entry's groups of 32 neighbours in turn, so that a block's
/// warps share one page as bfs_level's do: with a warp per entry, thousands of warps on as many
/// pages thrash a small cache. Through the cache's range cols_range or from plain_cols. Counts as
/// bfs_level does. Launch whole warps. Everything null: returns at once (warm-up).
extern "C" __global__ void __launch_bounds__(256, 2) gpunvme_cache_bfs_heavy(
    const cache::cache_desc* c, uint32_t cols_range, const uint32_t* plain_cols,
    uint32_t nvertices, uint32_t* levels, uint32_t level, unsigned long long* visited,
    unsigned long long* errors, const unsigned long long* heavy) {
    if ((c == nullptr && plain_cols == nullptr) || heavy == nullptr) return;
    const uint64_t n = heavy[0] < heavy[1] ? heavy[0] : heavy[1];
    const unsigned long long* entries = heavy + 2;
    const uint64_t from = 32 * (threadIdx.x / 32), step = blockDim.x / 32 * 32;
    unsigned long long bad = 0, won = 0;
    for (uint64_t k = blockIdx.x; k < n; k += gridDim.x) {
        const uint64_t b0 = entries[2 * k], e0 = entries[2 * k + 1];
        if (plain_cols != nullptr) {
            plain_array<uint32_t> a{plain_cols};
            bfs_expand(a, nvertices, levels, level, b0, e0, from, step, &bad, &won);
        } else {
            gpunvme::array<uint32_t> a(c, cols_range);
            bfs_expand(a, nvertices, levels, level, b0, e0, from, step, &bad, &won);
        }
    }
    for (int d = 16; d > 0; d >>= 1) {
        bad += __shfl_down_sync(0xffffffffu, bad, d);
        won += __shfl_down_sync(0xffffffffu, won, d);
    }
    if ((threadIdx.x & 31u) == 0 && bad) atomicAdd(errors, bad);
    if ((threadIdx.x & 31u) == 0 && won) atomicAdd(visited, won);
}

/// Embedding lookups: a warp per index (warps stride over them) copies row idx[k] (dim 4-byte
/// words, row r at word r * dim) into out + k * dim with a warp-wide read_range, through the
/// cache (plain null) or from a plain pointer. Failed rows are counted in *errors (and their
/// words left as they were). Launch whole warps. Everything null: returns at once (warm-up).
extern "C" __global__ void __launch_bounds__(256, 2) gpunvme_cache_gather(const cache::cache_desc* c, uint32_t range,
                                                const uint32_t* plain, uint32_t dim,
                                                const uint64_t* idx, uint64_t n,
                                                uint32_t* out, unsigned long long* errors) {
    if (c == nullptr && plain == nullptr) return;
    const uint64_t gtid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t nwarps = (uint64_t)gridDim.x * blockDim.x / 32;
    unsigned long long bad = 0;
    for (uint64_t k = gtid / 32; k < n; k += nwarps) {
        const uint64_t first = idx[k] * dim;
        status s;
        if (plain != nullptr) {
            plain_array<uint32_t> a{plain};
            s = a.read_range(first, dim, out + k * dim);
        } else {
            gpunvme::array<uint32_t> a(c, range);
            s = a.read_range(first, dim, out + k * dim);
        }
        bad += s != GPUNVME_OK && (threadIdx.x & 31u) == 0;
    }
    for (int d = 16; d > 0; d >>= 1) bad += __shfl_down_sync(0xffffffffu, bad, d);
    if ((threadIdx.x & 31u) == 0 && bad) atomicAdd(errors, bad);
}
