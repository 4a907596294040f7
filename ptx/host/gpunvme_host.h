// gpunvme_host.h — the CUDA device vocabulary that ptx/{include,emu}/*.cuh and ptx/*/*.cu use,
// defined for the host, so that g++ compiles the project's own device code unchanged and CPU
// threads run it (the `host-gpu` feature of gpu_queues; runtime in gpunvme_host.cpp).
//
// WHAT THIS IS: a correctness harness for machines without a GPU (CI). A kernel launch becomes
// one OS thread per GPU thread; blocks run concurrently up to a residency limit, like SMs; warp
// collectives (__shfl_sync, __ballot_sync, __syncwarp, ...) are rendezvous of exactly the lanes
// their mask names, so a mask that names an exited or absent lane, or a lane that never arrives,
// is reported as an error instead of hanging; __syncthreads is a barrier of the block's live
// threads; shared memory is per block (GPUNVME_SHARED in gpunvme_kernels.cu) and dynamic shared
// memory starts filled with 0xCD, never zero, so code that relies on its contents being zero
// fails here as it may on a GPU.
//
// WHAT THIS IS NOT: a GPU. Nothing measured through it means anything about GPU performance, and
// the host's memory model (x86-TSO, fences mapped to std::atomic_thread_fence) is stronger than
// the GPU's: a missing fence that the PTX memory model needs will not show here (that is what
// the fence discipline comments and the GPU runs are for).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
// Not `__noinline__`: libstdc++ spells its attributes `__attribute__((__noinline__))`.
#define GPUNVME_NOINLINE __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct uint3 {
    unsigned x, y, z;
};
struct __attribute__((aligned(8))) uint2 {
    unsigned x, y;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}

// CUDA's min/max take mixed integer types (the common type).
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
    return a < b ? a : b;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
    return a < b ? b : a;
}

namespace gpunvme_host {

struct block_ctx;
struct warp_ctx;

/// Who the calling OS thread is in the grid it runs (null outside a kernel).
struct thread_ctx {
    uint3 thread_idx, block_idx, block_dim, grid_dim;
    unsigned lane;
    block_ctx* block;
    warp_ctx* warp;
};
extern thread_local thread_ctx* current;

// Warp collectives: the calling lane contributes `value`, waits for every lane of `mask`, and
// gets every lane's contribution in `out` (indexed by lane). Throws on a broken mask.
void warp_exchange(unsigned mask, uint64_t value, uint64_t out[32]);
// __syncthreads with an OR of `pred` over the block's live threads.
bool block_barrier(bool pred);
// The per-block object for shared variable `key` (bytes zero-filled on first use, like a
// declaration the kernel is expected to initialise; one per block).
void* block_shared_bytes(int key, size_t bytes, size_t align);
// The block's dynamic shared memory and its size.
unsigned char* dynamic_shared();
unsigned dynamic_shared_size();
// An SM id for the block (distinct among co-resident blocks).
unsigned sm_id();
// CLOCK_MONOTONIC in nanoseconds (%globaltimer).
uint64_t global_timer_ns();
// A polling thread's pause (__nanosleep): sleeps, so that hundreds of waiting threads leave the
// CPU to the threads they wait for.
void nanosleep_ns(unsigned ns);

template <class T>
T& block_shared(int key) {
    return *static_cast<std::remove_reference_t<T>*>(
        block_shared_bytes(key, sizeof(T), alignof(T)));
}

template <class T>
uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "a shuffled value is at most 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

/// The value of lane `src` after an exchange: `src` must be in `mask` (reading an inactive
/// lane is undefined on a GPU; here it is an error).
uint64_t shuffled(unsigned mask, const uint64_t vals[32], unsigned src);

}  // namespace gpunvme_host

#define threadIdx (gpunvme_host::current->thread_idx)
#define blockIdx (gpunvme_host::current->block_idx)
#define blockDim (gpunvme_host::current->block_dim)
#define gridDim (gpunvme_host::current->grid_dim)

// --- warp collectives --------------------------------------------------------------------------

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, 0, vals);
}

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, gpunvme_host::to_bits(v), vals);
    const unsigned lane = gpunvme_host::current->lane;
    const unsigned base = lane & ~(unsigned)(width - 1);
    const unsigned s = base + ((unsigned)src & (unsigned)(width - 1));
    return gpunvme_host::from_bits<T>(gpunvme_host::shuffled(mask, vals, s));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, gpunvme_host::to_bits(v), vals);
    const unsigned lane = gpunvme_host::current->lane;
    const unsigned s = lane ^ (unsigned)lane_mask;
    if ((s & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1))) return v;
    return gpunvme_host::from_bits<T>(gpunvme_host::shuffled(mask, vals, s));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, gpunvme_host::to_bits(v), vals);
    const unsigned lane = gpunvme_host::current->lane;
    const unsigned s = lane + delta;
    if ((s & ~(unsigned)(width - 1)) != (lane & ~(unsigned)(width - 1))) return v;
    return gpunvme_host::from_bits<T>(gpunvme_host::shuffled(mask, vals, s));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, gpunvme_host::to_bits(v), vals);
    const unsigned lane = gpunvme_host::current->lane;
    if ((lane & (unsigned)(width - 1)) < delta) return v;
    return gpunvme_host::from_bits<T>(gpunvme_host::shuffled(mask, vals, lane - delta));
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, pred ? 1 : 0, vals);
    unsigned r = 0;
    for (unsigned l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && vals[l]) r |= 1u << l;
    return r;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }

template <class T>
unsigned __match_any_sync(unsigned mask, T value) {
    uint64_t vals[32];
    const uint64_t mine = gpunvme_host::to_bits(value);
    gpunvme_host::warp_exchange(mask, mine, vals);
    unsigned r = 0;
    for (unsigned l = 0; l < 32; ++l)
        if ((mask >> l & 1u) && vals[l] == mine) r |= 1u << l;
    return r;
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned value) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, value, vals);
    unsigned r = 0;
    for (unsigned l = 0; l < 32; ++l)
        if (mask >> l & 1u) r += (unsigned)vals[l];
    return r;
}
inline unsigned __reduce_min_sync(unsigned mask, unsigned value) {
    uint64_t vals[32];
    gpunvme_host::warp_exchange(mask, value, vals);
    unsigned r = 0xffffffffu;
    for (unsigned l = 0; l < 32; ++l)
        if (mask >> l & 1u) r = std::min(r, (unsigned)vals[l]);
    return r;
}

// --- block ----------------------------------------------------------------------------------------

inline void __syncthreads() { gpunvme_host::block_barrier(false); }
inline int __syncthreads_or(int pred) { return gpunvme_host::block_barrier(pred != 0); }

// --- memory ---------------------------------------------------------------------------------------

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned ns) { gpunvme_host::nanosleep_ns(ns); }

// Cache-hinted loads and stores: plain accesses of memory other threads write, so volatile
// (the compiler must not cache or elide them).
template <class T>
T __ldcg(const T* p) {
    T v;
    const volatile unsigned char* s = reinterpret_cast<const volatile unsigned char*>(p);
    unsigned char* d = reinterpret_cast<unsigned char*>(&v);
    for (size_t i = 0; i < sizeof(T); ++i) d[i] = s[i];
    return v;
}
template <class T>
void __stcg(T* p, T v) {
    volatile unsigned char* d = reinterpret_cast<volatile unsigned char*>(p);
    const unsigned char* s = reinterpret_cast<const unsigned char*>(&v);
    for (size_t i = 0; i < sizeof(T); ++i) d[i] = s[i];
}

template <class T>
T atomicAdd(T* p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
T atomicExch(T* p, T v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <class T>
T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v &&
           !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}

// --- bits -----------------------------------------------------------------------------------------

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __clzll(unsigned long long x) { return x ? __builtin_clzll(x) : 64; }
inline int __clzll(unsigned long x) { return __clzll((unsigned long long)x); }
inline int __clzll(long x) { return __clzll((long long)x); }

// --- libcu++'s <cuda/atomic>, as much as the headers use ------------------------------------------

namespace cuda {
enum thread_scope { thread_scope_system, thread_scope_device, thread_scope_block };
using memory_order = std::memory_order;
constexpr std::memory_order memory_order_relaxed = std::memory_order_relaxed;
constexpr std::memory_order memory_order_acquire = std::memory_order_acquire;
constexpr std::memory_order memory_order_release = std::memory_order_release;
constexpr std::memory_order memory_order_acq_rel = std::memory_order_acq_rel;
constexpr std::memory_order memory_order_seq_cst = std::memory_order_seq_cst;

template <class T, thread_scope S = thread_scope_system>
struct atomic_ref : std::atomic_ref<T> {
    explicit atomic_ref(T& obj) : std::atomic_ref<T>(obj) {}
    using std::atomic_ref<T>::operator=;
};

inline void atomic_thread_fence(std::memory_order order, thread_scope = thread_scope_system) {
    std::atomic_thread_fence(order);
}
}  // namespace cuda

// --- shared memory ------------------------------------------------------------------------------
// `GPUNVME_SHARED(type, name)` and `GPUNVME_SHARED_ARRAY(type, name, n)` declare a per-block
// shared variable (gpunvme_kernels.cu defines them as __shared__ declarations for nvcc).
#define GPUNVME_SHARED(type, name) type& name = gpunvme_host::block_shared<type>(__LINE__)
#define GPUNVME_SHARED_ARRAY(type, name, n) \
    auto& name = gpunvme_host::block_shared<type[n]>(__LINE__)
