// The floor under any host-side controller serving GPU queues: what one GPU thread pays to talk
// to a CPU thread through pinned host memory, ON THE GPU MACHINE (nvcc there):
//
//   nvcc -O2 -arch=sm_90 -o pcie_floor benches/pcie_floor.cu && ./pcie_floor
//
// Prints one JSON object (nanoseconds, medians of ITERS):
//   read_rt            one ld.relaxed.sys of a pinned host word (a poll of a CQ in host memory)
//   read8_rt           eight independent such loads issued together (try_reap's read-ahead)
//   fence_after_writes fence.acq_rel.sys after four 16-byte stores to host memory (an SQE)
//   ping_pong          GPU stores a word to host memory, a CPU thread spinning on it answers
//                      in another word, the GPU polls that: the round trip any command to a
//                      host-side controller and its completion back must contain
//   command_shape      ping_pong plus what the queue protocol adds around it: SQE stores and a
//                      release fence before the doorbell, then after the answer an acquire
//                      fence and one more read (the CQE's dword 0)
// Every GPU wait is bounded (1 s of %globaltimer); a timeout is reported, not hung on.
#include <cstdio>
#include <cstdint>
#include <thread>
#include <atomic>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

constexpr int ITERS = 2000;
constexpr uint64_t BOUND_NS = 1000000000ull;

__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ uint32_t ld_sys(const uint32_t* p) {
    uint32_t v; asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// host: [0] GPU->CPU word, [16] CPU->GPU word, [64..] scratch lines (SQE, CQ entries).
__global__ void floor_kernel(uint32_t* host, uint64_t* out, uint32_t* timeouts) {
    uint64_t* rt = out;                 // ITERS
    uint64_t* rt8 = out + ITERS;        // ITERS
    uint64_t* fw = out + 2 * ITERS;     // ITERS
    uint64_t* pp = out + 3 * ITERS;     // ITERS
    uint64_t* cs = out + 4 * ITERS;     // ITERS
    uint32_t* ping = host, *pong = host + 16, *scratch = host + 64;
    uint32_t sink = 0;
    for (int i = 0; i < ITERS; ++i) {
        uint64_t t = now_ns();
        sink += ld_sys(scratch + (i % 8) * 4);
        rt[i] = now_ns() - t;
    }
    for (int i = 0; i < ITERS; ++i) {
        uint64_t t = now_ns();
        uint32_t v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = ld_sys(scratch + k * 4);
#pragma unroll
        for (int k = 0; k < 8; ++k) sink += v[k];
        rt8[i] = now_ns() - t;
    }
    uint4* sqe = reinterpret_cast<uint4*>(scratch + 256);
    for (int i = 0; i < ITERS; ++i) {
        uint64_t t = now_ns();
        for (int k = 0; k < 4; ++k) sqe[k] = make_uint4(i, k, i, k);
        fence_sys();
        fw[i] = now_ns() - t;
    }
    for (int pass = 0; pass < 2; ++pass) {
        uint64_t* dst = pass ? cs : pp;
        for (int i = 1; i <= ITERS; ++i) {
            uint32_t seq = pass * ITERS + i;
            uint64_t t = now_ns();
            if (pass) {
                for (int k = 0; k < 4; ++k) sqe[k] = make_uint4(seq, k, seq, k);
                fence_sys();
            }
            st_sys(ping, seq);
            while (ld_sys(pong) != seq) {
                if (now_ns() - t > BOUND_NS) { atomicAdd(timeouts, 1); return; }
            }
            if (pass) { fence_sys(); sink += ld_sys(scratch + 8); }
            dst[i - 1] = now_ns() - t;
        }
    }
    st_sys(ping, 0xffffffffu);
    if (sink == 0x12345678u) out[0] = 0;  // keep the loads
}

int main() {
    uint32_t* host;
    CHECK(cudaHostAlloc(&host, 1 << 16, cudaHostAllocMapped));
    for (int i = 0; i < (1 << 14); ++i) host[i] = 0;
    uint32_t* dhost;
    CHECK(cudaHostGetDevicePointer(&dhost, host, 0));
    uint64_t* out; uint32_t* timeouts;
    CHECK(cudaMalloc(&out, 5 * ITERS * sizeof(uint64_t)));
    CHECK(cudaMalloc(&timeouts, 4));
    CHECK(cudaMemset(timeouts, 0, 4));
    // The CPU side: answers every ping with the same number, until 0xffffffff or 30 s.
    std::atomic<bool> stop{false};
    std::thread cpu([&] {
        volatile uint32_t* ping = host;
        volatile uint32_t* pong = host + 16;
        auto start = std::chrono::steady_clock::now();
        uint32_t last = 0;
        while (!stop.load(std::memory_order_relaxed)) {
            uint32_t v = *ping;
            if (v == 0xffffffffu) break;
            if (v != last) { last = v; *pong = v; }
            if (std::chrono::steady_clock::now() - start > std::chrono::seconds(30)) break;
        }
    });
    floor_kernel<<<1, 1>>>(dhost, out, timeouts);
    cudaError_t e = cudaDeviceSynchronize();
    stop = true;
    cpu.join();
    if (e != cudaSuccess) { fprintf(stderr, "kernel: %s\n", cudaGetErrorString(e)); return 1; }
    std::vector<uint64_t> h(5 * ITERS);
    uint32_t to = 0;
    CHECK(cudaMemcpy(h.data(), out, h.size() * 8, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&to, timeouts, 4, cudaMemcpyDeviceToHost));
    const char* names[5] = {"read_rt", "read8_rt", "fence_after_writes", "ping_pong", "command_shape"};
    cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
    printf("{\"device\": \"%s\", \"iters\": %d, \"timeouts\": %u", prop.name, ITERS, to);
    for (int k = 0; k < 5; ++k) {
        std::vector<uint64_t> v(h.begin() + k * ITERS, h.begin() + (k + 1) * ITERS);
        std::sort(v.begin(), v.end());
        printf(", \"%s\": {\"p50\": %llu, \"p90\": %llu, \"min\": %llu}", names[k],
               (unsigned long long)v[ITERS / 2], (unsigned long long)v[ITERS * 9 / 10],
               (unsigned long long)v[0]);
    }
    printf("}\n");
    return to ? 1 : 0;
}
