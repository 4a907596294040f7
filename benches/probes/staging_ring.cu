// Probe: what limits a warm file's staged path (host copy into pinned staging, then a copy
// engine): the staging ring's size per thread, `pread` against copies out of a mapping of the
// file, non-temporal stores, and the page cache's state (folio sizes; a page's second access)?
//
// Issue 22: the software controller's loader ran at 0.60-0.66 of the pinned host->GPU copy on
// H100 hosts, its first load of a model slower than the next. Cases, T threads (THREADS,
// default 16), each with a ring of NBUF pinned buffers of CHUNK bytes; chunk c of the file goes
// to ring slot c/T mod NBUF, refilled once that slot's last copy has run:
//
//   pread      `pread` 128 KiB per call (one NVMe command's transfer) into the slot
//   map        the file mapped shared read-only; each chunk `madvise(MADV_POPULATE_READ)`
//              (a failed page read is an error there, not a SIGBUS), then `memcpy`
//   map_nt     the same with non-temporal 32-byte stores (AVX), no read-for-ownership
//   map_fault  `memcpy` from the mapping with no populate: pages come in by page faults
//
// Default run: every mode for CHUNK in 128 KiB .. 4 MiB and NBUF in 2, 4, 8, the file read
// twice before timing. FIRST_PASS=1: each of pread, map and map_fault on a file of its own,
// read once before (as a loader's "warm" finds it), 4 MiB x 2 per thread, timed on the pages'
// second access and again on the third; WRITE_KIB sets the bytes per write() that create the
// files (default 4 MiB; the software controller writes an image a command, at most 128 KiB, at
// a time, and the page cache's folios follow the writes). Every case checks a chunk per thread.
// One JSON object per line; GPU waits bounded (60 s).
//
// On the GPU machine:
//   nvcc -O2 -arch=sm_90 -Xcompiler -mavx2 staging_ring.cu -o sr -lcuda -lpthread
//   ./sr FILE [GiB to create if FILE is missing, default 8]
//   FIRST_PASS=1 WRITE_KIB=4 ./sr FILE 4
// Results: benches/results/staging-ring-2026-11-28-h200.jsonl.
#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "probe_time.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

static const size_t PIECE = 128 << 10;
static CUcontext g_ctx;

// Non-temporal copy: dst 32-byte aligned, n a multiple of 128 (chunks are).
static void copy_nt(char* dst, const char* src, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i*)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i*)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i*)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i*)(src + i + 96));
        _mm256_stream_si256((__m256i*)(dst + i), a);
        _mm256_stream_si256((__m256i*)(dst + i + 32), b);
        _mm256_stream_si256((__m256i*)(dst + i + 64), c);
        _mm256_stream_si256((__m256i*)(dst + i + 96), d);
    }
    _mm_sfence();
}

// Opens `path` (created with `gib` GiB of patterned bytes if missing) and reads it `passes`
// times (4 MiB preads) so that its pages are in the page cache.
static int create_and_open(const char* path, size_t gib, int passes) {
    struct stat stt;
    if (stat(path, &stt) != 0) {
        int fd = open(path, O_CREAT | O_WRONLY, 0644);
        // WRITE_KIB: bytes per write (default 4 MiB; the software controller writes an
        // image one command, 128 KiB at most, at a time, which sets the page cache's folios).
        size_t wb = 4 << 20;
        if (const char* e = getenv("WRITE_KIB")) wb = strtoul(e, nullptr, 10) << 10;
        std::vector<char> b(wb);
        for (size_t i = 0; i < (gib << 30) / wb; i++) {
            for (size_t j = 0; j < b.size(); j += 8) {
                uint64_t v = (i * b.size() + j) * 0x9E3779B97F4A7C15ull;
                memcpy(&b[j], &v, 8);
            }
            if (write(fd, b.data(), b.size()) != (ssize_t)b.size()) exit(2);
        }
        close(fd);
    }
    int fd = open(path, O_RDONLY);
    if (fd < 0 || fstat(fd, &stt) != 0) exit(2);
    std::vector<char> b(4 << 20);
    for (int pass = 0; pass < passes; pass++)
        for (size_t at = 0; at + b.size() <= (size_t)stt.st_size; at += b.size())
            if (pread(fd, b.data(), b.size(), at) != (ssize_t)b.size()) exit(2);
    return fd;
}

enum Mode { PREAD, MAP, MAP_NT, MAP_FAULT };
static const char* mode_name[] = {"pread", "map", "map_nt", "map_fault"};

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [GiB]\n", argv[0]);
        return 1;
    }
    const char* path = argv[1];
    size_t gib = argc > 2 ? strtoul(argv[2], nullptr, 10) : 8;
    int fd = create_and_open(path, gib, 2);
    struct stat stt;
    fstat(fd, &stt);
    const size_t MAXCHUNK = 4 << 20;
    size_t size = stt.st_size / MAXCHUNK * MAXCHUNK;
    int T = 16;
    if (const char* e = getenv("THREADS")) T = atoi(e);

    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&g_ctx, dev));
    CK(cuCtxSetCurrent(g_ctx));
    CUdeviceptr dbuf;
    CK(cuMemAlloc(&dbuf, size));

    const char* map = (const char*)mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return 2;
    printf("{\"file\": \"%s\", \"bytes\": %zu, \"threads\": %d}\n", path, size, T);

    // Pinned ceiling, one 256 MiB buffer on two streams.
    {
        size_t pin = 256 << 20;
        void* h;
        CK(cuMemAllocHost(&h, pin));
        memset(h, 1, pin);
        CUstream s[2];
        for (auto& x : s) CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING));
        pinned_ceiling(dbuf, size, h, pin, s, 2);
        CK(cuMemFreeHost(h));
        for (auto& x : s) CK(cuStreamDestroy(x));
    }

    std::vector<char> chk(MAXCHUNK), want(MAXCHUNK);
    // One timed pass of `mode` over file `f` (mapped at `m`), CHUNK bytes per ring slot, NBUF
    // slots per thread; prints a row named `name` and checks a chunk per thread.
    auto run = [&](const char* name, int mode, int f, const char* m, size_t chunk, int nbuf) {
        size_t chunks = size / chunk;
        std::vector<void*> bufs(T * nbuf);
        for (auto& b : bufs) CK(cuMemAllocHost(&b, chunk));
        CK(cuMemsetD8(dbuf, 0, size));
        CK(cuCtxSynchronize());
        std::vector<std::thread> ts;
        std::vector<double> copy_s(T, 0);
        auto t0 = Clock::now();
        for (int t = 0; t < T; t++)
            ts.emplace_back([&, t] {
                CK(cuCtxSetCurrent(g_ctx));
                CUstream s;
                CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
                std::vector<CUevent> ev(nbuf);
                std::vector<bool> used(nbuf, false);
                for (auto& e : ev) CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
                size_t k = 0;
                for (size_t c = t; c < chunks; c += T, k = (k + 1) % nbuf) {
                    if (used[k]) CK(cuEventSynchronize(ev[k]));
                    char* dst = (char*)bufs[t * nbuf + k];
                    size_t at = c * chunk;
                    auto c0 = Clock::now();
                    if (mode == PREAD) {
                        for (size_t p = 0; p < chunk; p += PIECE) {
                            size_t n = std::min(PIECE, chunk - p);
                            if (pread(f, dst + p, n, at + p) != (ssize_t)n) exit(2);
                        }
                    } else {
                        if (mode != MAP_FAULT &&
                            madvise((void*)(m + at), chunk, MADV_POPULATE_READ) != 0) {
                            perror("madvise");
                            exit(2);
                        }
                        if (mode == MAP_NT)
                            copy_nt(dst, m + at, chunk);
                        else
                            memcpy(dst, m + at, chunk);
                    }
                    copy_s[t] += secs_since(c0);
                    CK(cuMemcpyHtoDAsync(dbuf + at, dst, chunk, s));
                    CK(cuEventRecord(ev[k], s));
                    used[k] = true;
                }
                wait_bounded(s);
                for (auto& e : ev) CK(cuEventDestroy(e));
                CK(cuStreamDestroy(s));
            });
        for (auto& th : ts) th.join();
        double g = size / secs_since(t0) / 1e9;
        double cs = 0;
        for (double x : copy_s) cs += x;
        bool ok = true;
        for (int t = 0; t < T; t++) {
            size_t c = (chunks / T) * t + t % 7;
            if (c >= chunks) continue;
            CK(cuMemcpyDtoH(chk.data(), dbuf + c * chunk, chunk));
            if (pread(f, want.data(), chunk, c * chunk) != (ssize_t)chunk) exit(2);
            ok = ok && memcmp(chk.data(), want.data(), chunk) == 0;
        }
        for (auto& b : bufs) CK(cuMemFreeHost(b));
        printf("{\"case\": \"%s\", \"mode\": \"%s\", \"chunk_kib\": %zu, \"nbuf\": %d, "
               "\"gb_per_s\": %.2f, \"host_copy_gb_per_s_per_thread\": %.2f, \"equal\": %s}\n",
               name, mode_name[mode], chunk >> 10, nbuf, g, size / cs / 1e9, ok ? "true" : "false");
        fflush(stdout);
        if (!ok) exit(4);
    };
    if (getenv("FIRST_PASS")) {
        // Each mode on a file of its own, read once before (as a loader's "warm" finds it):
        // the timed pass is the pages' second access, then a third.
        for (int mode : {PREAD, MAP, MAP_FAULT}) {
            std::string p2 = std::string(path) + "." + mode_name[mode];
            int f2 = create_and_open(p2.c_str(), size >> 30, 1);
            const char* m2 = (const char*)mmap(nullptr, size, PROT_READ, MAP_SHARED, f2, 0);
            if (m2 == MAP_FAILED) return 2;
            run("second_access", mode, f2, m2, 4 << 20, 2);
            run("third_access", mode, f2, m2, 4 << 20, 2);
            munmap((void*)m2, size);
            close(f2);
        }
        return 0;
    }
    std::vector<size_t> chunk_list = {128 << 10, 512 << 10, 1 << 20, 4 << 20};
    std::vector<int> nbuf_list = {2, 4, 8};
    if (const char* e = getenv("CHUNKS")) {
        chunk_list.clear();
        for (std::string s = e; !s.empty();) {
            size_t k = s.find(',');
            chunk_list.push_back(strtoul(s.substr(0, k).c_str(), nullptr, 10) << 10);
            s = k == std::string::npos ? "" : s.substr(k + 1);
        }
    }
    int reps = 2;
    if (const char* e = getenv("REPS")) reps = atoi(e);
    for (int rep = 0; rep < reps; rep++)
        for (int mode : {PREAD, MAP, MAP_NT})
            for (size_t chunk : chunk_list)
                for (int nbuf : nbuf_list)
                    if (chunk * nbuf <= (16u << 20)) run("ring", mode, fd, map, chunk, nbuf);
    munmap((void*)map, size);
    close(fd);
    return 0;
}
