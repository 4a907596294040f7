// Probe: how fast can a warm file's bytes reach GPU memory on this host, and by which path?
//
// Issue 22's bar is InstantTensor's mmap backend (43 GB/s for a warm 7B-shaped model on the
// lent H100) against the software controller's staged path (`pread` into pinned staging, then
// scatter kernels: ~30 GB/s). This probe times each candidate path alone, on one warm file:
//
//   pinned_ceiling    one pinned buffer copied to the GPU by the copy engine
//   pread             T threads `pread` 4 MiB chunks into pinned buffers (no GPU), PIECE bytes
//                     per call (environment; default the whole chunk: the software controller
//                     reads one command's transfer, 128 KiB, per call)
//   pread_copy        the same, each chunk then copied to the GPU on the thread's stream
//                     (double-buffered): what a staged loader does
//   mmap_copy         the file mmap'd (MAP_POPULATE), T threads memcpy chunks into pinned
//                     buffers, then copy to the GPU
//   register          the whole mmap registered with CUDA (cuMemHostRegister), timed; then
//   reg_ce            copy engines from the registered pages (64 MiB copies on 4 streams)
//   reg_sm            a kernel reading the registered pages (zero-copy) into GPU memory
//   reg_windows       64 MiB windows registered by T threads at once (is registration serial?)
//   pinned_sm         the same kernel reading ordinary pinned memory
//   hybrid            (HYBRID=1; then nothing else) T threads stage chunks (pread_copy) from the
//                     front of the file while one more thread registers WIN-byte windows of a
//                     read-only mapping (CU_MEMHOSTREGISTER_READ_ONLY, which ext4 page-cache
//                     pages accept) from the back and copies each by copy engine; they meet
//                     where their rates put them. Beside pread_copy with T threads alone.
//
// On the GPU machine:
//   nvcc -O2 -arch=sm_90 host_read_paths.cu -o hrp -lcuda -lpthread
//   ./hrp FILE [GiB to create if FILE is missing, default 4]
//   HYBRID=1 THREADS=16 ./hrp FILE                    (pread_copy against hybrid, windows
//                                                     of 8, 32 and 64 MiB)
//   PIECE=131072 THREADS=16 PREAD_ONLY=1 ./hrp FILE   (pread calls of 128 KiB, 16 threads, the
//                                                     pread cases only)
// Prints one JSON object per line; every GPU wait is bounded (60 s).
#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "probe_time.h"

static const size_t CHUNK = 4 << 20;
// Bytes per pread call (PIECE; a divisor of CHUNK).
static size_t g_piece = CHUNK;

// Chunk c of the file into buf, g_piece bytes per pread.
static void pread_chunk(int fd, void* buf, size_t c) {
    for (size_t at = 0; at < CHUNK; at += g_piece)
        if (pread(fd, (char*)buf + at, g_piece, c * CHUNK + at) != (ssize_t)g_piece) exit(2);
}

// Grid-stride copy, 16 bytes per load (src and dst 16-byte aligned, n a multiple of 16).
__global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n16) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    size_t step = (size_t)gridDim.x * blockDim.x;
    for (; i < n16; i += step) dst[i] = src[i];
}

static CUcontext g_ctx;

// T threads each take chunks i, i+T, ...; `work(thread, chunk_index, stream, bufs)`.
template <class F>
static double threaded(int T, size_t size, F work) {
    std::vector<std::thread> ts;
    auto t0 = Clock::now();
    for (int t = 0; t < T; t++)
        ts.emplace_back([&, t] {
            CK(cuCtxSetCurrent(g_ctx));
            work(t);
        });
    for (auto& th : ts) th.join();
    return size / secs_since(t0) / 1e9;
}

// Thread t of T: chunks t, t + T, ... each filled into one of the thread's two pinned buffers
// `bufs` by `fill(buf, chunk)`, then copied to the GPU at `dbuf` on the thread's own stream
// (double-buffered: a buffer is refilled once its last copy has run).
template <class Fill>
static void staged_copies(int t, int T, size_t chunks, void* const* bufs, CUdeviceptr dbuf,
                          Fill fill) {
    CUstream s;
    CUevent ev[2];
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    for (auto& e : ev) CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    bool used[2] = {false, false};
    int k = 0;
    for (size_t c = t; c < chunks; c += T, k ^= 1) {
        if (used[k]) CK(cuEventSynchronize(ev[k]));
        fill(bufs[k], c);
        CK(cuMemcpyHtoDAsync(dbuf + c * CHUNK, bufs[k], CHUNK, s));
        CK(cuEventRecord(ev[k], s));
        used[k] = true;
    }
    wait_bounded(s);
    for (auto& e : ev) CK(cuEventDestroy(e));
    CK(cuStreamDestroy(s));
}

// HYBRID: T staging threads claim chunks from the front, one registrar claims windows of `win`
// bytes from the back (registers a read-only mapping of it, copies it by copy engine); returns
// GB/s of the whole file and the bytes that went the registered way.
static double hybrid(int fd, int T, size_t size, size_t win, CUdeviceptr dbuf, double* reg_frac,
                     double* reg_secs) {
    size_t chunks = size / CHUNK, per_win = win / CHUNK;
    std::mutex m;
    size_t front = 0, back = chunks;  // staged: [0, front); registered: [back, chunks)
    std::vector<void*> bufs(T * 2);
    for (auto& b : bufs) CK(cuMemAllocHost(&b, CHUNK));
    char* map = (char*)mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) exit(2);
    std::vector<size_t> regd;
    double rs = 0;
    auto t0 = Clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < T; t++)
        ts.emplace_back([&, t] {
            CK(cuCtxSetCurrent(g_ctx));
            CUstream s;
            CUevent ev[2];
            CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
            for (auto& e : ev) CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
            bool used[2] = {false, false};
            for (int k = 0;; k ^= 1) {
                size_t c;
                {
                    std::lock_guard<std::mutex> g(m);
                    if (front >= back) break;
                    c = front++;
                }
                if (used[k]) CK(cuEventSynchronize(ev[k]));
                pread_chunk(fd, bufs[t * 2 + k], c);
                CK(cuMemcpyHtoDAsync(dbuf + c * CHUNK, bufs[t * 2 + k], CHUNK, s));
                CK(cuEventRecord(ev[k], s));
                used[k] = true;
            }
            wait_bounded(s);
            for (auto& e : ev) CK(cuEventDestroy(e));
            CK(cuStreamDestroy(s));
        });
    ts.emplace_back([&] {
        CK(cuCtxSetCurrent(g_ctx));
        CUstream s[4];
        for (auto& x : s) CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING));
        for (size_t i = 0;; i++) {
            size_t w;
            {
                std::lock_guard<std::mutex> g(m);
                if (back < front + per_win) break;
                back -= per_win;
                w = back;
            }
            auto r0 = Clock::now();
            CK(cuMemHostRegister(map + w * CHUNK, win,
                                 CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_READ_ONLY));
            rs += secs_since(r0);
            regd.push_back(w);
            CK(cuMemcpyHtoDAsync(dbuf + w * CHUNK, map + w * CHUNK, win, s[i & 3]));
        }
        for (auto& x : s) wait_bounded(x);
        for (auto& x : s) CK(cuStreamDestroy(x));
    });
    for (auto& th : ts) th.join();
    double g = size / secs_since(t0) / 1e9;
    *reg_frac = (double)regd.size() * win / size;
    *reg_secs = rs;
    // Check a chunk of each path.
    std::vector<char> a(CHUNK), b(CHUNK);
    size_t probe[2] = {0, regd.empty() ? chunks - 1 : regd.back()};
    for (size_t c : probe) {
        CK(cuMemcpyDtoH(a.data(), dbuf + c * CHUNK, CHUNK));
        if (pread(fd, b.data(), CHUNK, c * CHUNK) != (ssize_t)CHUNK) exit(2);
        if (memcmp(a.data(), b.data(), CHUNK) != 0) {
            fprintf(stderr, "hybrid: chunk %zu differs\n", c);
            exit(4);
        }
    }
    for (size_t w : regd) CK(cuMemHostUnregister(map + w * CHUNK));
    munmap(map, size);
    for (auto& b : bufs) CK(cuMemFreeHost(b));
    return g;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE [GiB]\n", argv[0]);
        return 1;
    }
    const char* path = argv[1];
    size_t gib = argc > 2 ? strtoul(argv[2], nullptr, 10) : 4;
    struct stat stt;
    if (stat(path, &stt) != 0) {
        int fd = open(path, O_CREAT | O_WRONLY, 0644);
        std::vector<char> b(CHUNK);
        for (size_t i = 0; i < b.size(); i++) b[i] = (char)(i * 131 + 7);
        for (size_t i = 0; i < gib * 256; i++)
            if (write(fd, b.data(), b.size()) != (ssize_t)b.size()) return 2;
        close(fd);
        stat(path, &stt);
    }
    size_t size = stt.st_size / CHUNK * CHUNK;
    size_t chunks = size / CHUNK;
    int fd = open(path, O_RDWR);
    if (fd < 0) return 2;

    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&g_ctx, dev));
    CK(cuCtxSetCurrent(g_ctx));
    CUdeviceptr dbuf;
    CK(cuMemAlloc(&dbuf, size));
    std::vector<int> threads_list = {4, 8, 16};
    if (const char* e = getenv("THREADS")) threads_list = {atoi(e)};
    if (const char* e = getenv("PIECE")) g_piece = strtoul(e, nullptr, 10);
    if (g_piece == 0 || CHUNK % g_piece != 0) {
        fprintf(stderr, "PIECE must divide %zu\n", CHUNK);
        return 1;
    }

    // Warm the page cache.
    {
        std::vector<char> b(CHUNK);
        for (size_t c = 0; c < chunks; c++)
            if (pread(fd, b.data(), CHUNK, c * CHUNK) != (ssize_t)CHUNK) return 2;
    }
    printf("{\"file\": \"%s\", \"bytes\": %zu}\n", path, size);

    // Pinned ceiling.
    {
        size_t pin = 256 << 20;
        void* h;
        CK(cuMemAllocHost(&h, pin));
        memset(h, 1, pin);
        CUstream s[2];
        for (auto& x : s) CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING));
        pinned_ceiling(dbuf, size, h, pin, s, 2);
        // The kernel reading pinned memory.
        for (int rep = 0; rep < 2; rep++) {
            auto t0 = Clock::now();
            for (size_t off = 0; off < size; off += pin) {
                size_t n16 = std::min(pin, size - off) / 16;
                CUdeviceptr dst = dbuf + off;
                copy16<<<264, 512, 0, (cudaStream_t)s[0]>>>((const uint4*)h, (uint4*)dst, n16);
            }
            wait_bounded(s[0]);
            printf("{\"case\": \"pinned_sm\", \"gb_per_s\": %.2f}\n", size / secs_since(t0) / 1e9);
        }
        CK(cuMemFreeHost(h));
        for (auto& x : s) CK(cuStreamDestroy(x));
    }

    if (getenv("HYBRID")) {
        for (int rep = 0; rep < 2; rep++)
            for (int T : threads_list) {
                std::vector<void*> bufs(T * 2);
                for (auto& b : bufs) CK(cuMemAllocHost(&b, CHUNK));
                double g = threaded(T, size, [&](int t) {
                    staged_copies(t, T, chunks, &bufs[t * 2], dbuf,
                                  [&](void* buf, size_t c) { pread_chunk(fd, buf, c); });
                });
                for (auto& b : bufs) CK(cuMemFreeHost(b));
                printf("{\"case\": \"pread_copy\", \"threads\": %d, \"gb_per_s\": %.2f}\n", T, g);
                for (size_t win : {8ul << 20, 32ul << 20, 64ul << 20}) {
                    double frac, rs;
                    g = hybrid(fd, T, size, win, dbuf, &frac, &rs);
                    printf("{\"case\": \"hybrid\", \"threads\": %d, \"win\": %zu, \"gb_per_s\": "
                           "%.2f, \"registered_fraction\": %.3f, \"register_secs\": %.4f}\n",
                           T, win, g, frac, rs);
                }
            }
        return 0;
    }
    for (int T : threads_list) {
        // pread only.
        std::vector<void*> bufs(T * 2);
        for (auto& b : bufs) CK(cuMemAllocHost(&b, CHUNK));
        double g = threaded(T, size, [&](int t) {
            for (size_t c = t; c < chunks; c += T) pread_chunk(fd, bufs[t * 2], c);
        });
        printf("{\"case\": \"pread\", \"threads\": %d, \"piece\": %zu, \"gb_per_s\": %.2f}\n", T,
               g_piece, g);
        // pread + copy, double-buffered.
        g = threaded(T, size, [&](int t) {
            staged_copies(t, T, chunks, &bufs[t * 2], dbuf,
                          [&](void* buf, size_t c) { pread_chunk(fd, buf, c); });
        });
        printf("{\"case\": \"pread_copy\", \"threads\": %d, \"piece\": %zu, \"gb_per_s\": %.2f}\n",
               T, g_piece, g);
        for (auto& b : bufs) CK(cuMemFreeHost(b));
    }
    if (getenv("PREAD_ONLY")) return 0;

    // mmap + memcpy into pinned + copy.
    auto t0 = Clock::now();
    char* map = (char*)mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (map == MAP_FAILED) return 2;
    printf("{\"case\": \"mmap_populate\", \"secs\": %.3f}\n", secs_since(t0));
    for (int T : threads_list) {
        std::vector<void*> bufs(T * 2);
        for (auto& b : bufs) CK(cuMemAllocHost(&b, CHUNK));
        double g = threaded(T, size, [&](int t) {
            staged_copies(t, T, chunks, &bufs[t * 2], dbuf, [&](void* buf, size_t c) {
                memcpy(buf, map + c * CHUNK, CHUNK);
            });
        });
        printf("{\"case\": \"mmap_copy\", \"threads\": %d, \"gb_per_s\": %.2f}\n", T, g);
        for (auto& b : bufs) CK(cuMemFreeHost(b));
    }

    // The whole mapping registered.
    t0 = Clock::now();
    CK(cuMemHostRegister(map, size, CU_MEMHOSTREGISTER_DEVICEMAP));
    double reg_s = secs_since(t0);
    printf("{\"case\": \"register\", \"secs\": %.3f, \"gb_per_s\": %.2f}\n", reg_s, size / reg_s / 1e9);
    CUdeviceptr dmap;
    CK(cuMemHostGetDevicePointer(&dmap, map, 0));
    {
        CUstream s[4];
        for (auto& x : s) CK(cuStreamCreate(&x, CU_STREAM_NON_BLOCKING));
        for (int rep = 0; rep < 2; rep++) {
            t0 = Clock::now();
            size_t big = 64 << 20;
            for (size_t off = 0, i = 0; off < size; off += big, i++)
                CK(cuMemcpyHtoDAsync(dbuf + off, map + off, std::min(big, size - off), s[i & 3]));
            for (auto& x : s) wait_bounded(x);
            printf("{\"case\": \"reg_ce\", \"gb_per_s\": %.2f}\n", size / secs_since(t0) / 1e9);
        }
        for (int rep = 0; rep < 2; rep++) {
            t0 = Clock::now();
            copy16<<<264, 512, 0, (cudaStream_t)s[0]>>>((const uint4*)dmap, (uint4*)dbuf, size / 16);
            wait_bounded(s[0]);
            printf("{\"case\": \"reg_sm\", \"gb_per_s\": %.2f}\n", size / secs_since(t0) / 1e9);
        }
        // Check one chunk's bytes.
        std::vector<char> chk(CHUNK);
        CK(cuMemcpyDtoH(chk.data(), dbuf + (chunks / 2) * CHUNK, CHUNK));
        printf("{\"case\": \"reg_check\", \"equal\": %s}\n",
               memcmp(chk.data(), map + (chunks / 2) * CHUNK, CHUNK) == 0 ? "true" : "false");
        for (auto& x : s) CK(cuStreamDestroy(x));
    }
    t0 = Clock::now();
    CK(cuMemHostUnregister(map));
    printf("{\"case\": \"unregister\", \"secs\": %.3f}\n", secs_since(t0));

    // 64 MiB windows registered by T threads at once.
    for (int T : threads_list) {
        size_t win = 64 << 20, wins = size / win;
        double g = threaded(T, size, [&](int t) {
            for (size_t w = t; w < wins; w += T)
                CK(cuMemHostRegister(map + w * win, win, CU_MEMHOSTREGISTER_DEVICEMAP));
        });
        printf("{\"case\": \"reg_windows\", \"threads\": %d, \"gb_per_s\": %.2f}\n", T, g);
        for (size_t w = 0; w < wins; w++) CK(cuMemHostUnregister(map + w * win));
    }
    munmap(map, size);
    close(fd);
    return 0;
}
