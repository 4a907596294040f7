// Probe: can a kernel spinning on one stream stop work on another stream from starting?
//
// The software controller serves GPU queues with copies and kernels on streams of its own
// green context while client kernels, in the clients' green context, spin waiting for it. The
// known stall (docs/testing.md) looks like controller work that never starts. Two suspects:
//
//  1. hardware connections: streams share CUDA_DEVICE_MAX_CONNECTIONS work queues, and an op
//     queued behind a waiting op of another stream in the same work queue waits too (the
//     green-context section of cuda.h warns that disjoint SM partitions do not guarantee
//     forward progress for this reason);
//  2. host calls that synchronise the device (cuMemFree and friends) holding up other host
//     threads' launches while a client kernel spins.
//
// Part 1 launches a spinner (bounded by globaltimer, 50 ms) on each client-side stream and
// then the op that releases it on each controller-side stream, for every pair; a pair whose
// spinner times out is blocked. Part 2 spins a client kernel (2 s bound), calls one host
// function on the main thread 5 ms in, and releases the spinner from another thread's launch
// at 20 ms: a spinner that waited ~2 s means that call blocked the release (frees,
// unregistrations, module loads and unloads, green-context destruction are tried).
//
// On the GPU machine:
//   nvcc -O2 -arch=sm_90 stream_progress.cu -o sp -lcuda && ./sp
//   CUDA_DEVICE_MAX_CONNECTIONS=32 ./sp ; CUDA_DEVICE_MAX_CONNECTIONS=1 ./sp   # the control
//   PART2_ONLY=1 ./sp                                                           # host calls only
// Prints one JSON object per line.
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "probe_check.h"

__device__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Waits until *flag == want (at most bound_ns); out[0] = 1 if seen, out[1] = ns waited.
__global__ void spinner(volatile unsigned* flag, unsigned want, unsigned long long bound_ns,
                        unsigned long long* out) {
    unsigned long long t0 = now_ns(), t = t0;
    bool seen = false;
    while (t - t0 < bound_ns) {
        if (*flag == want) { seen = true; break; }
        __nanosleep(200);
        t = now_ns();
    }
    out[0] = seen;
    out[1] = now_ns() - t0;
}

__global__ void setter(volatile unsigned* flag, unsigned v) {
    __threadfence_system();
    *flag = v;
    __threadfence_system();
}

__global__ void nop() {}

static CUfunction fn(const void* sym) {
    cudaFunction_t f;
    CR(cudaGetFuncBySymbol(&f, sym));
    return (CUfunction)f;
}

struct Partition {
    CUgreenCtx ctl, cli;
};

static Partition split(CUdevice dev, unsigned ctl_sms) {
    CUdevResource all, group, rest;
    memset(&all, 0, sizeof all);
    memset(&group, 0, sizeof group);
    memset(&rest, 0, sizeof rest);
    CK(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
    unsigned groups = 1;
    CK(cuDevSmResourceSplitByCount(&group, &groups, &all, &rest, 0, ctl_sms));
    Partition p;
    CUdevResourceDesc d;
    CK(cuDevResourceGenerateDesc(&d, &group, 1));
    CK(cuGreenCtxCreate(&p.ctl, d, dev, CU_GREEN_CTX_DEFAULT_STREAM));
    CK(cuDevResourceGenerateDesc(&d, &rest, 1));
    CK(cuGreenCtxCreate(&p.cli, d, dev, CU_GREEN_CTX_DEFAULT_STREAM));
    return p;
}

static CUstream green_stream(CUgreenCtx g) {
    CUstream s;
    CK(cuGreenCtxStreamCreate(&s, g, CU_STREAM_NON_BLOCKING, 0));
    return s;
}

static bool wait_idle(CUstream s, double secs) {
    auto t0 = std::chrono::steady_clock::now();
    for (;;) {
        CUresult r = cuStreamQuery(s);
        if (r == CUDA_SUCCESS) return true;
        if (r != CUDA_ERROR_NOT_READY) CK(r);
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > secs)
            return false;
        std::this_thread::yield();
    }
}

static double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
    CR(cudaFree(0));
    CUcontext primary;
    CK(cuCtxGetCurrent(&primary));
    CUdevice dev;
    CK(cuCtxGetDevice(&dev));
    const char* conns = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    CUfunction f_spin = fn((const void*)spinner), f_set = fn((const void*)setter),
               f_nop = fn((const void*)nop);

    unsigned* flag;  // device memory the setter writes and the spinner reads
    CR(cudaMalloc(&flag, 4));
    CR(cudaMemset(flag, 0, 4));
    unsigned long long* out;  // mapped host memory: the spinner's result
    CR(cudaHostAlloc(&out, 16, cudaHostAllocMapped));
    unsigned long long* out_dev;
    CR(cudaHostGetDevicePointer(&out_dev, out, 0));
    unsigned* pinned_val;
    CR(cudaHostAlloc(&pinned_val, 4, cudaHostAllocMapped));

    auto launch = [&](CUfunction f, CUstream s, void** args) {
        CK(cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, nullptr));
    };
    unsigned seq = 0;
    // One pair: spinner on `cs` (then `trail` ops queued behind it on cs), release from `rs`
    // by a kernel or a copy. Returns whether the spinner saw the release.
    auto pair = [&](CUstream cs, CUstream rs, bool by_copy, int trail, double* waited_ms) {
        ++seq;
        unsigned want = seq;
        unsigned long long bound = 50ull * 1000 * 1000;
        out[0] = 2;
        void* sargs[] = {&flag, &want, &bound, &out_dev};
        launch(f_spin, cs, sargs);
        for (int i = 0; i < trail; ++i) launch(f_nop, cs, nullptr);
        if (by_copy) {
            *pinned_val = want;
            CK(cuMemcpyHtoDAsync((CUdeviceptr)flag, pinned_val, 4, rs));
        } else {
            void* a[] = {&flag, &want};
            launch(f_set, rs, a);
        }
        bool ok = wait_idle(cs, 5) && wait_idle(rs, 5);
        if (!ok) {
            fprintf(stderr, "a stream did not finish in 5 s\n");
            exit(3);
        }
        *waited_ms = out[1] / 1e6;
        return out[0] == 1;
    };

    // Part 1: stream layouts of the runtime. "one" = one controller's partition (client
    // stream created first, then T engine streams), "four" = four such controllers.
    for (int layout = getenv("PART2_ONLY") ? 2 : 0; layout < 2; ++layout) {
        int controllers = layout == 0 ? 1 : 4;
        for (int threads : {4, 16}) {
            std::vector<CUstream> cli, ctl;
            std::vector<Partition> parts;
            for (int c = 0; c < controllers; ++c) {
                Partition p = split(dev, 8);
                parts.push_back(p);
                cli.push_back(green_stream(p.cli));
                for (int t = 0; t < threads; ++t) ctl.push_back(green_stream(p.ctl));
            }
            // A primary-context stream too (the user's / torch's stream in Python and C).
            CUstream prim;
            CK(cuStreamCreate(&prim, CU_STREAM_NON_BLOCKING));
            cli.push_back(prim);
            for (int variant = 0; variant < 3; ++variant) {
                bool by_copy = variant == 1;
                int trail = variant == 2 ? 1 : 0;
                int blocked = 0, pairs = 0;
                std::string which;
                double worst = 0;
                for (size_t k = 0; k < cli.size(); ++k)
                    for (size_t c = 0; c < ctl.size(); ++c) {
                        double w;
                        bool seen = pair(cli[k], ctl[c], by_copy, trail, &w);
                        ++pairs;
                        if (!seen) {
                            ++blocked;
                            if (which.size() < 400)
                                which += (which.empty() ? "" : ",") + std::to_string(k) + ":" +
                                         std::to_string(c);
                        } else if (w > worst) {
                            worst = w;
                        }
                    }
                printf("{\"part\": 1, \"max_connections\": \"%s\", \"controllers\": %d, "
                       "\"engine_streams_each\": %d, \"release\": \"%s\", \"trailing_ops\": %d, "
                       "\"pairs\": %d, \"blocked\": %d, \"blocked_pairs(client:engine)\": \"%s\", "
                       "\"worst_ok_ms\": %.3f}\n",
                       conns ? conns : "default", controllers, threads,
                       by_copy ? "copy" : "kernel", trail, pairs, blocked, which.c_str(), worst);
                fflush(stdout);
            }
            for (auto s : cli) CK(cuStreamDestroy(s));
            for (auto s : ctl) CK(cuStreamDestroy(s));
            for (auto& p : parts) {
                CK(cuGreenCtxDestroy(p.ctl));
                CK(cuGreenCtxDestroy(p.cli));
            }
        }
    }

    // Part 2: host calls while a client kernel spins.
    Partition p = split(dev, 8);
    CUstream cs = green_stream(p.cli), rs = green_stream(p.ctl);
    std::vector<std::string> calls = {"none",          "cuMemAlloc",        "cuMemFree",
                                      "cuMemHostAlloc", "cuMemFreeHost",     "cuMemHostRegister",
                                      "cuMemHostUnregister", "cuStreamCreate", "cuStreamDestroy",
                                      "cuEventCreate",  "cuEventDestroy",    "cuMemcpyHtoD",
                                      "cuMemcpyDtoH",   "cuModuleLoadData",  "cuModuleUnload",
                                      "cuLibraryUnload", "cuGreenCtxDestroy", "cuCtxSynchronize"};
    static char ptx_nop[] =
        ".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry probe_nop() { ret; }\n";
    for (auto& call : calls) {
        // Resources the call works on, made before the spinner starts.
        CUdeviceptr dmem = 0;
        void* hmem = nullptr;
        void* reg = nullptr;
        CUstream extra = nullptr;
        CUevent ev = nullptr;
        if (call == "cuMemFree") CK(cuMemAlloc(&dmem, 1 << 20));
        if (call == "cuMemFreeHost") CK(cuMemHostAlloc(&hmem, 1 << 20, 0));
        if (call == "cuMemHostRegister" || call == "cuMemHostUnregister") {
            reg = aligned_alloc(4096, 1 << 20);
            memset(reg, 0, 1 << 20);
            if (call == "cuMemHostUnregister") CK(cuMemHostRegister(reg, 1 << 20, 0));
        }
        if (call == "cuStreamDestroy") CK(cuStreamCreate(&extra, CU_STREAM_NON_BLOCKING));
        if (call == "cuEventDestroy") CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
        if (call == "cuMemcpyHtoD" || call == "cuMemcpyDtoH") CK(cuMemAlloc(&dmem, 4096));
        static char host_buf[4096];
        CUmodule mod = nullptr;
        CUlibrary lib = nullptr;
        Partition extra_part{};
        if (call == "cuModuleUnload") CK(cuModuleLoadData(&mod, ptx_nop));
        if (call == "cuLibraryUnload")
            CK(cuLibraryLoadData(&lib, ptx_nop, nullptr, nullptr, 0, nullptr, nullptr, 0));
        if (call == "cuGreenCtxDestroy") extra_part = split(dev, 8);

        ++seq;
        unsigned want = seq;
        unsigned long long bound = 2ull * 1000 * 1000 * 1000;
        out[0] = 2;
        void* sargs[] = {&flag, &want, &bound, &out_dev};
        auto t0 = std::chrono::steady_clock::now();
        launch(f_spin, cs, sargs);
        std::atomic<double> launch_returned_ms{-1};
        std::thread releaser([&] {
            CK(cuCtxSetCurrent(primary));
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            void* a[] = {&flag, &want};
            launch(f_set, rs, a);
            launch_returned_ms = ms_since(t0);
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        auto c0 = std::chrono::steady_clock::now();
        CUresult r = CUDA_SUCCESS;
        if (call == "cuMemAlloc") {
            r = cuMemAlloc(&dmem, 1 << 20);
        } else if (call == "cuMemFree") {
            r = cuMemFree(dmem);
            dmem = 0;
        } else if (call == "cuMemHostAlloc") {
            r = cuMemHostAlloc(&hmem, 1 << 20, CU_MEMHOSTALLOC_DEVICEMAP);
        } else if (call == "cuMemFreeHost") {
            r = cuMemFreeHost(hmem);
            hmem = nullptr;
        } else if (call == "cuMemHostRegister") {
            r = cuMemHostRegister(reg, 1 << 20, CU_MEMHOSTREGISTER_DEVICEMAP);
        } else if (call == "cuMemHostUnregister") {
            r = cuMemHostUnregister(reg);
        } else if (call == "cuStreamCreate") {
            r = cuStreamCreate(&extra, CU_STREAM_NON_BLOCKING);
        } else if (call == "cuStreamDestroy") {
            r = cuStreamDestroy(extra);
            extra = nullptr;
        } else if (call == "cuEventCreate") {
            r = cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
        } else if (call == "cuEventDestroy") {
            r = cuEventDestroy(ev);
            ev = nullptr;
        } else if (call == "cuMemcpyHtoD") {
            r = cuMemcpyHtoD(dmem, host_buf, 4096);
        } else if (call == "cuMemcpyDtoH") {
            r = cuMemcpyDtoH(host_buf, dmem, 4096);
        } else if (call == "cuModuleLoadData") {
            CUmodule m;
            r = cuModuleLoadData(&m, ptx_nop);
        } else if (call == "cuModuleUnload") {
            r = cuModuleUnload(mod);
        } else if (call == "cuLibraryUnload") {
            r = cuLibraryUnload(lib);
        } else if (call == "cuGreenCtxDestroy") {
            r = cuGreenCtxDestroy(extra_part.ctl);
            if (r == CUDA_SUCCESS) r = cuGreenCtxDestroy(extra_part.cli);
        } else if (call == "cuCtxSynchronize") {
            r = cuCtxSynchronize();
        }
        double call_ms = ms_since(c0);
        releaser.join();
        bool ok = wait_idle(cs, 5) && wait_idle(rs, 5);
        if (!ok) {
            fprintf(stderr, "a stream did not finish in 5 s\n");
            exit(3);
        }
        const char* es = nullptr;
        cuGetErrorName(r, &es);
        printf("{\"part\": 2, \"max_connections\": \"%s\", \"call\": \"%s\", \"result\": \"%s\", "
               "\"call_ms\": %.3f, \"release_launch_returned_ms\": %.3f, \"spinner_saw_release\": "
               "%s, \"spinner_waited_ms\": %.3f}\n",
               conns ? conns : "default", call.c_str(), es ? es : "?", call_ms,
               launch_returned_ms.load(), out[0] == 1 ? "true" : "false", out[1] / 1e6);
        fflush(stdout);
        if (dmem) cuMemFree(dmem);
        if (hmem) cuMemFreeHost(hmem);
        if (extra) cuStreamDestroy(extra);
        if (ev) cuEventDestroy(ev);
        if (reg) {
            if (call == "cuMemHostRegister") cuMemHostUnregister(reg);
            free(reg);
        }
    }
    (void)argc;
    (void)argv;
    return 0;
}
