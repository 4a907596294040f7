// gpunvme from CUDA C++: a kernel of your own drives gpunvme's GPU queues (ptx/include/
// gpunvme.cuh) on memory you allocated with cudaMalloc, and blockfs files are read into and
// written from that memory by GPU-issued commands through the C ABI (include/gpunvme.h).
//
//   gpu_queues_demo RAW.img FS.img
//
// RAW.img: each of 256 threads writes 16 KiB of a pattern at its own LBAs with rw_thread, then
// reads it back into a second buffer; the host compares both buffers. FS.img: a blockfs file
// written from GPU memory (gpunvme_gpu_write), read back at an odd offset into GPU memory
// (gpunvme_gpu_read) and by the CPU (gpunvme_read), and by a kernel of its own through the
// file's extent table (gpunvme_file.cuh), each compared. Prints "OK" and exits 0 only
// if every check passed. Build (scripts/cuda-example.sh does this on the GPU machine):
//
//   nvcc -std=c++17 -arch=sm_90 -I include -I ptx/include examples/cuda/gpu_queues_demo.cu \
//        -L target/release -lgpunvme -o gpu_queues_demo
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "gpunvme.cuh"
#include "gpunvme.h"
#include "gpunvme_file.cuh"

static int failures = 0;
// The GPU every call runs on: a CUDA device ordinal (argv[3], default 0), made current for the
// demo's own allocations and kernels too.
static int gpu = 0;

static void expect(const char* what, gpunvme_error got, gpunvme_error want) {
    if (got != want) {
        fprintf(stderr, "FAIL %s: %s (%s), wanted %s\n", what, gpunvme_error_name(got),
                gpunvme_last_error_message(), gpunvme_error_name(want));
        failures++;
    } else {
        printf("ok   %s: %s%s%s\n", what, gpunvme_error_name(got), got ? " - " : "",
               got ? gpunvme_last_error_message() : "");
    }
}

static void check(const char* what, bool ok) {
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) failures++;
}

#define CUDA(call)                                                                      \
    do {                                                                                \
        cudaError_t e_ = (call);                                                        \
        if (e_ != cudaSuccess) {                                                        \
            fprintf(stderr, "FAIL %s: %s\n", #call, cudaGetErrorString(e_));            \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

// Each thread writes `blocks` blocks at its own LBAs from `out`, then reads them into `in`,
// on queue (thread % count). Every wait inside rw_thread is bounded by the queue's timeout.
__global__ void write_then_read(const gpunvme::queue_desc* queues, uint32_t count, uint32_t nsid,
                                uint32_t lba_shift, uint32_t blocks, uint64_t out_bus,
                                uint64_t in_bus, int32_t* status, uint32_t* nvme_status) {
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    const gpunvme::queue_desc& q = queues[t % count];
    const uint64_t slba = (uint64_t)t * blocks;
    const uint64_t at = slba << lba_shift;
    uint32_t sf = 0;
    gpunvme::status s = gpunvme::rw_thread(q, gpunvme::OPC_WRITE, nsid, lba_shift, slba, blocks,
                                           out_bus + at, &sf);
    if (s == GPUNVME_OK)
        s = gpunvme::rw_thread(q, gpunvme::OPC_READ, nsid, lba_shift, slba, blocks, in_bus + at,
                               &sf);
    status[t] = s;
    nvme_status[t] = sf;
}

// Each thread reads its slice of bytes [t * slice, (t + 1) * slice) of file `index` of the
// extent table at `table_ptr` (clipped to `size`) into `dst` (GPU pointer and bus address of byte
// 0), on queue (thread % count), through gpunvme_file.cuh: the file offset is translated to
// LBAs by the table, unaligned heads and tails go through slot buffers.
__global__ void read_file_slices(const gpunvme::queue_desc* queues, uint32_t count,
                                 const void* table_ptr, uint32_t index, uint64_t size,
                                 uint64_t slice, uint8_t* dst, uint64_t dst_bus, int32_t* status) {
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    const uint64_t start = (uint64_t)t * slice;
    uint64_t end = start + slice;
    if (end > size) end = size;
    gpunvme::fs::table tab;
    const gpunvme::fs::table_file* f = nullptr;
    gpunvme::status s = gpunvme::fs::table_open(table_ptr, &tab);
    if (s == GPUNVME_OK) s = gpunvme::fs::table_file_at(tab, index, &f);
    uint32_t sf = 0;
    if (s == GPUNVME_OK && start < end)
        s = gpunvme::fs::rw_file_thread(queues[t % count], tab, *f, false, start, end,
                                        (uint64_t)(dst + start), dst_bus + start, nullptr, &sf);
    status[t] = s;
}

static uint8_t pattern(size_t i) { return (uint8_t)((i * 2654435761u) >> 13); }

static void raw_queues(const char* path) {
    gpunvme_open_options o = gpunvme_open_options_default();
    o.device = path;
    o.lba_size = 4096;
    gpunvme_device* dev = nullptr;
    expect("open raw image", gpunvme_open(&o, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return;
    gpunvme_gpu_queues_info q;
    expect("gpu_queues", gpunvme_gpu_queues(dev, gpu, &q), GPUNVME_ERROR_NONE);
    printf("     %u queues of %u entries, namespace %u, %u-byte LBAs\n", q.count, q.depth, q.nsid,
           q.lba_size);
    const uint32_t threads = 256, blocks = 4, lba_shift = 12;
    const size_t bytes = (size_t)threads * blocks << lba_shift;
    std::vector<uint8_t> host(bytes), back(bytes);
    for (size_t i = 0; i < bytes; i++) host[i] = pattern(i);
    uint8_t *out = nullptr, *in = nullptr;
    int32_t* status = nullptr;
    uint32_t* nvme_status = nullptr;
    CUDA(cudaMalloc(&out, bytes));
    CUDA(cudaMalloc(&in, bytes));
    CUDA(cudaMalloc(&status, threads * sizeof(int32_t)));
    CUDA(cudaMalloc(&nvme_status, threads * sizeof(uint32_t)));
    CUDA(cudaMemcpy(out, host.data(), bytes, cudaMemcpyHostToDevice));
    CUDA(cudaMemset(in, 0, bytes));
    uint64_t out_bus = 0, in_bus = 0;
    gpunvme_gpu_queues_info none;
    int count = 0;
    CUDA(cudaGetDeviceCount(&count));
    expect("gpu_queues on a GPU this machine does not have",
           gpunvme_gpu_queues(dev, count, &none), GPUNVME_ERROR_INVALID_ARGUMENT);
    gpunvme_gpu_mapping *mo = nullptr, *mi = nullptr;
    expect("map out", gpunvme_gpu_map(dev, gpu, out, bytes, &out_bus, &mo), GPUNVME_ERROR_NONE);
    expect("map in", gpunvme_gpu_map(dev, gpu, in, bytes, &in_bus, &mi), GPUNVME_ERROR_NONE);
    // Host memory is not GPU memory: refused by name, nothing mapped.
    gpunvme_gpu_mapping* bad = nullptr;
    uint64_t bad_bus = 0;
    expect("map host memory", gpunvme_gpu_map(dev, gpu, host.data(), 4096, &bad_bus, &bad),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    if (mo && mi) {
        write_then_read<<<threads / 64, 64>>>((const gpunvme::queue_desc*)q.descriptors, q.count,
                                              q.nsid, lba_shift, blocks, out_bus, in_bus, status,
                                              nvme_status);
        CUDA(cudaGetLastError());
        CUDA(cudaDeviceSynchronize());
        std::vector<int32_t> st(threads);
        std::vector<uint32_t> sf(threads);
        CUDA(cudaMemcpy(st.data(), status, threads * sizeof(int32_t), cudaMemcpyDeviceToHost));
        CUDA(cudaMemcpy(sf.data(), nvme_status, threads * sizeof(uint32_t),
                        cudaMemcpyDeviceToHost));
        uint32_t bad_threads = 0;
        for (uint32_t t = 0; t < threads; t++)
            if (st[t] != GPUNVME_OK || sf[t] != 0) {
                if (!bad_threads)
                    fprintf(stderr, "thread %u: status %d, NVMe status %#x\n", t, st[t], sf[t]);
                bad_threads++;
            }
        check("every thread's write and read completed", bad_threads == 0);
        CUDA(cudaMemcpy(back.data(), in, bytes, cudaMemcpyDeviceToHost));
        check("bytes read back by the GPU equal those it wrote", back == host);
    }
    gpunvme_gpu_unmap(mo);
    gpunvme_gpu_unmap(mi);
    expect("release_gpu", gpunvme_release_gpu(dev), GPUNVME_ERROR_NONE);
    gpunvme_close(dev);
    CUDA(cudaFree(out));
    CUDA(cudaFree(in));
    CUDA(cudaFree(status));
    CUDA(cudaFree(nvme_status));
}

static void files(const char* path) {
    gpunvme_open_options o = gpunvme_open_options_default();
    o.device = path;
    o.lba_size = 4096;
    gpunvme_device* dev = nullptr;
    expect("open fs image", gpunvme_open(&o, &dev), GPUNVME_ERROR_NONE);
    if (!dev) return;
    expect("mkfs", gpunvme_mkfs(dev, 4096, true), GPUNVME_ERROR_NONE);
    const size_t n = (5u << 20) + 333;
    std::vector<uint8_t> host(n), back(n);
    for (size_t i = 0; i < n; i++) host[i] = pattern(i * 7 + 1);
    uint8_t *src = nullptr, *dst = nullptr;
    CUDA(cudaMalloc(&src, n));
    CUDA(cudaMalloc(&dst, n));
    cudaStream_t s;
    CUDA(cudaStreamCreate(&s));
    // Queued on the caller's stream: gpunvme waits for it before reading `src`.
    CUDA(cudaMemcpyAsync(src, host.data(), n, cudaMemcpyHostToDevice, s));
    expect("gpu_write", gpunvme_gpu_write(dev, gpu, "demo/data.bin", src, n, s, false),
           GPUNVME_ERROR_NONE);
    expect("gpu_write over the file", gpunvme_gpu_write(dev, gpu, "demo/data.bin", src, n, s, false),
           GPUNVME_ERROR_EXISTS);
    uint64_t size = 0;
    expect("file_size", gpunvme_file_size(dev, "demo/data.bin", &size), GPUNVME_ERROR_NONE);
    check("the file has every byte", size == n);
    size_t got = 0;
    const size_t off = 12345;
    CUDA(cudaMemset(dst, 0, n));
    expect("gpu_read at an odd offset", gpunvme_gpu_read(dev, gpu, "demo/data.bin", off, dst, n, s, &got),
           GPUNVME_ERROR_NONE);
    check("read stops at the end of the file", got == n - off);
    CUDA(cudaMemcpy(back.data(), dst, got, cudaMemcpyDeviceToHost));
    check("GPU read equals the bytes written", memcmp(back.data(), host.data() + off, got) == 0);
    size_t cpu = 0;
    expect("CPU read", gpunvme_read(dev, "demo/data.bin", 0, back.data(), n, &cpu),
           GPUNVME_ERROR_NONE);
    check("CPU read equals the bytes written", cpu == n && back == host);
    expect("gpu_read of a missing file", gpunvme_gpu_read(dev, gpu, "nope", 0, dst, n, s, &got),
           GPUNVME_ERROR_NOT_FOUND);

    // The file read by a kernel of our own through its extent table (gpunvme_file.cuh).
    gpunvme_gpu_queues_info q;
    gpunvme_gpu_file* gf = nullptr;
    uint64_t table = 0, fsize = 0, dst_bus = 0;
    uint32_t index = 0;
    gpunvme_gpu_mapping* md = nullptr;
    expect("gpu_queues (fs image)", gpunvme_gpu_queues(dev, gpu, &q), GPUNVME_ERROR_NONE);
    expect("gpu_file_open", gpunvme_gpu_file_open(dev, gpu, "demo/data.bin", &gf, &table, &index,
                                                  &fsize),
           GPUNVME_ERROR_NONE);
    expect("gpu_file_open of a missing file",
           gpunvme_gpu_file_open(dev, gpu, "nope", &gf, &table, &index, &fsize),
           GPUNVME_ERROR_NOT_FOUND);
    expect("map dst", gpunvme_gpu_map(dev, gpu, dst, n, &dst_bus, &md), GPUNVME_ERROR_NONE);
    if (gf && md && fsize == n) {
        const uint32_t threads = 128;
        const uint64_t slice = (n + threads - 1) / threads;  // not LBA aligned: heads and tails
        int32_t* st = nullptr;
        CUDA(cudaMalloc(&st, threads * sizeof(int32_t)));
        CUDA(cudaMemset(dst, 0, n));
        read_file_slices<<<threads / 32, 32>>>((const gpunvme::queue_desc*)q.descriptors, q.count,
                                               (const void*)table, index, fsize, slice, dst,
                                               dst_bus, st);
        CUDA(cudaGetLastError());
        CUDA(cudaDeviceSynchronize());
        std::vector<int32_t> hs(threads);
        CUDA(cudaMemcpy(hs.data(), st, threads * sizeof(int32_t), cudaMemcpyDeviceToHost));
        bool all_ok = true;
        for (uint32_t t = 0; t < threads; t++) all_ok = all_ok && hs[t] == GPUNVME_OK;
        check("every thread's slice of the file read through the extent table", all_ok);
        CUDA(cudaMemcpy(back.data(), dst, n, cudaMemcpyDeviceToHost));
        check("the kernel's file bytes equal those written", back == host);
        CUDA(cudaFree(st));
    }
    gpunvme_gpu_unmap(md);
    gpunvme_gpu_file_close(gf);
    expect("gpu_read into host memory", gpunvme_gpu_read(dev, gpu, "demo/data.bin", 0, back.data(), n,
                                                         s, &got),
           GPUNVME_ERROR_INVALID_ARGUMENT);
    CUDA(cudaStreamDestroy(s));
    gpunvme_close(dev);
    CUDA(cudaFree(src));
    CUDA(cudaFree(dst));
}

int main(int argc, char** argv) {
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: %s RAW.img FS.img [GPU]\n", argv[0]);
        return 2;
    }
    if (argc == 4) gpu = atoi(argv[3]);
    printf("libgpunvme %s, GPU %d\n", gpunvme_version(), gpu);
    CUDA(cudaSetDevice(gpu));
    raw_queues(argv[1]);
    files(argv[2]);
    if (failures) {
        fprintf(stderr, "cuda gpu_queues_demo: %d checks failed\n", failures);
        return 1;
    }
    printf("cuda gpu_queues_demo: OK\n");
    return 0;
}
