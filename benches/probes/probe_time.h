// Timing shared by the host-path probes in this folder (standalone programs built by nvcc):
// seconds since a time point, a bounded wait for a stream (60 s, then exit 3), and the pinned
// host->GPU ceiling (one 256 MiB pinned buffer copied over `size` bytes of `dbuf` on two
// streams, `reps` times, one JSON row each).
#pragma once
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "probe_check.h"

using Clock = std::chrono::steady_clock;

static double secs_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

static void wait_bounded(CUstream s) {
    auto t0 = Clock::now();
    for (;;) {
        CUresult r = cuStreamQuery(s);
        if (r == CUDA_SUCCESS) return;
        if (r != CUDA_ERROR_NOT_READY) CK(r);
        if (secs_since(t0) > 60) {
            fprintf(stderr, "GPU wait over 60 s\n");
            exit(3);
        }
        std::this_thread::yield();
    }
}

// `h` is a pinned buffer of `pin` bytes, `s` two streams.
static void pinned_ceiling(CUdeviceptr dbuf, size_t size, void* h, size_t pin, CUstream* s,
                           int reps) {
    for (int rep = 0; rep < reps; rep++) {
        auto t0 = Clock::now();
        for (size_t off = 0; off < size; off += pin)
            CK(cuMemcpyHtoDAsync(dbuf + off, h, std::min(pin, size - off), s[(off / pin) & 1]));
        for (int i = 0; i < 2; i++) wait_bounded(s[i]);
        printf("{\"case\": \"pinned_ceiling\", \"gb_per_s\": %.2f}\n", size / secs_since(t0) / 1e9);
    }
}
