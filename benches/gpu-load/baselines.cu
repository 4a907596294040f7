// The baselines of scripts/gpu-load-bench.sh: loading a file into GPU memory the ways users do
// without gpunvme, each load timed and then verified against the file's bytes.
//
//   baselines --file PATH --method pageable|pinned|cufile [--chunk BYTES]
//
//   pageable  pread into one pageable buffer, cudaMemcpy each chunk (synchronous)
//   pinned    pread into two pinned buffers in turn, cudaMemcpyAsync each on its own stream:
//             the next pread overlaps the previous copy (double buffering)
//   cufile    cuFileRead of each chunk straight into the GPU buffer (built with -DHAVE_CUFILE;
//             without nvidia-fs, cuFile runs in compatibility mode: its own reads and copies)
//
// Prints one JSON line: {"method", "bytes", "seconds", "gbytes_per_s", "verified", "error"}.
// Verification (not timed): a checksum of the GPU buffer computed on the GPU equals the same
// checksum of the file computed on the host. Exit status 0 only if the load ran and verified.
// Built by scripts/gpu-load-bench.sh with the GPU machine's nvcc.
#include <cuda_runtime.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <string>
#include <vector>
#if defined(HAVE_CUFILE)
#include <cufile.h>
#endif

static double now_s() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void emit(const char* method, uint64_t bytes, double secs, bool verified, const char* error) {
    printf("{\"method\": \"%s\", \"bytes\": %llu, \"seconds\": %.6f, \"gbytes_per_s\": %.3f, "
           "\"verified\": %s, \"error\": %s%s%s}\n",
           method, (unsigned long long)bytes, secs, secs > 0 ? bytes / secs / 1e9 : 0.0,
           verified ? "true" : "false", error ? "\"" : "", error ? error : "null",
           error ? "\"" : "");
}

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e_ = (x);                                                        \
        if (e_ != cudaSuccess) {                                                     \
            emit(method, size, 0, false, cudaGetErrorString(e_));                   \
            return 1;                                                                \
        }                                                                            \
    } while (0)

// Checksum of n bytes (zero-padded to whole 8-byte words): sum over words of
// w_i * (2i + 1), mod 2^64 — order-sensitive, cheap on both sides.
__host__ __device__ inline uint64_t mix(uint64_t w, uint64_t i) { return w * (2 * i + 1); }

__global__ void gpu_checksum(const uint8_t* p, uint64_t n, unsigned long long* out) {
    uint64_t words = n / 8, acc = 0;
    const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < words;
         i += (uint64_t)gridDim.x * blockDim.x)
        acc += mix(w[i], i);
    if (blockIdx.x == 0 && threadIdx.x == 0 && n % 8) {
        uint64_t last = 0;
        memcpy(&last, p + words * 8, n % 8);
        acc += mix(last, words);
    }
    atomicAdd(out, (unsigned long long)acc);
}

static bool host_checksum(const char* path, uint64_t size, uint64_t* sum) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return false;
    std::vector<uint8_t> buf(64 << 20);
    uint64_t off = 0, acc = 0;
    while (off < size) {
        size_t want = size - off < buf.size() ? size - off : buf.size();
        ssize_t got = pread(fd, buf.data(), want, off);
        if (got <= 0) { close(fd); return false; }
        size_t whole = (size_t)got / 8 * 8;
        for (size_t k = 0; k < whole; k += 8) {
            uint64_t w;
            memcpy(&w, buf.data() + k, 8);
            acc += mix(w, (off + k) / 8);
        }
        if ((size_t)got != whole) {  // only at the end of the file
            uint64_t w = 0;
            memcpy(&w, buf.data() + whole, got - whole);
            acc += mix(w, (off + whole) / 8);
        }
        off += got;
    }
    close(fd);
    *sum = acc;
    return true;
}

static bool read_full(int fd, uint8_t* dst, size_t len, uint64_t off) {
    while (len) {
        ssize_t got = pread(fd, dst, len, off);
        if (got <= 0) return false;
        dst += got;
        len -= got;
        off += got;
    }
    return true;
}

int main(int argc, char** argv) {
    const char* path = nullptr;
    const char* method = "pinned";
    size_t chunk = 8 << 20;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--file")) path = argv[i + 1];
        else if (!strcmp(argv[i], "--method")) method = argv[i + 1];
        else if (!strcmp(argv[i], "--chunk")) chunk = strtoull(argv[i + 1], nullptr, 0);
    }
    uint64_t size = 0;
    if (!path || chunk == 0) {
        emit(method, 0, 0, false, "usage: --file PATH --method pageable|pinned|cufile");
        return 2;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        emit(method, 0, 0, false, strerror(errno));
        return 1;
    }
    size = st.st_size;
    uint8_t* dev = nullptr;
    CK(cudaMalloc(&dev, size + 8));
    CK(cudaMemset(dev, 0, size + 8));
    unsigned long long* dsum = nullptr;
    CK(cudaMalloc(&dsum, 8));
    CK(cudaDeviceSynchronize());
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        emit(method, size, 0, false, strerror(errno));
        return 1;
    }
    const char* error = nullptr;
    double t0 = now_s(), t1 = t0;
    if (!strcmp(method, "pageable")) {
        std::vector<uint8_t> buf(chunk);
        for (uint64_t off = 0; off < size && !error; off += chunk) {
            size_t n = size - off < chunk ? size - off : chunk;
            if (!read_full(fd, buf.data(), n, off)) error = "pread failed";
            else if (cudaMemcpy(dev + off, buf.data(), n, cudaMemcpyHostToDevice) != cudaSuccess)
                error = "cudaMemcpy failed";
        }
        t1 = now_s();
    } else if (!strcmp(method, "pinned")) {
        uint8_t* host[2];
        cudaStream_t s[2];
        cudaEvent_t done[2];
        for (int k = 0; k < 2; ++k) {
            CK(cudaHostAlloc(&host[k], chunk, cudaHostAllocDefault));
            CK(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
            CK(cudaEventCreateWithFlags(&done[k], cudaEventDisableTiming));
        }
        t0 = now_s();
        bool used[2] = {false, false};
        int k = 0;
        for (uint64_t off = 0; off < size && !error; off += chunk, k ^= 1) {
            size_t n = size - off < chunk ? size - off : chunk;
            // The buffer's previous copy must be done before pread overwrites it.
            if (used[k] && cudaEventSynchronize(done[k]) != cudaSuccess) error = "copy failed";
            else if (!read_full(fd, host[k], n, off)) error = "pread failed";
            else if (cudaMemcpyAsync(dev + off, host[k], n, cudaMemcpyHostToDevice, s[k]) !=
                         cudaSuccess ||
                     cudaEventRecord(done[k], s[k]) != cudaSuccess)
                error = "cudaMemcpyAsync failed";
            used[k] = true;
        }
        if (cudaDeviceSynchronize() != cudaSuccess && !error) error = "copy failed";
        t1 = now_s();
    } else if (!strcmp(method, "cufile")) {
#if defined(HAVE_CUFILE)
        CUfileError_t e = cuFileDriverOpen();
        if (e.err != CU_FILE_SUCCESS) {
            static char msg[64];
            snprintf(msg, sizeof msg, "cuFileDriverOpen: error %d", (int)e.err);
            error = msg;
        } else {
            CUfileDescr_t d;
            memset(&d, 0, sizeof d);
            d.handle.fd = fd;
            d.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
            CUfileHandle_t h;
            e = cuFileHandleRegister(&h, &d);
            if (e.err != CU_FILE_SUCCESS) {
                static char msg[96];
                snprintf(msg, sizeof msg, "cuFileHandleRegister: error %d (udev data for the "
                         "block device? see ../shared/design/gpu.md)", (int)e.err);
                error = msg;
            } else {
                t0 = now_s();
                size_t step = chunk < (16 << 20) ? (16 << 20) : chunk;
                for (uint64_t off = 0; off < size && !error; off += step) {
                    size_t n = size - off < step ? size - off : step;
                    ssize_t got = cuFileRead(h, dev, n, off, off);
                    if (got != (ssize_t)n) error = "cuFileRead short or failed";
                }
                t1 = now_s();
                cuFileHandleDeregister(h);
            }
            cuFileDriverClose();
        }
#else
        error = "built without cuFile (cufile.h or libcufile not found)";
#endif
    } else {
        error = "unknown method";
    }
    close(fd);
    bool verified = false;
    if (!error) {
        uint64_t want = 0;
        unsigned long long got = 0;
        CK(cudaMemset(dsum, 0, 8));
        gpu_checksum<<<264, 512>>>(dev, size, dsum);
        CK(cudaGetLastError());
        CK(cudaMemcpy(&got, dsum, 8, cudaMemcpyDeviceToHost));
        if (!host_checksum(path, size, &want)) error = "host checksum: cannot read the file";
        else if (got != want) error = "GPU bytes differ from the file";
        else verified = true;
    }
    emit(method, size, t1 - t0, verified, error);
    return verified ? 0 : 1;
}
