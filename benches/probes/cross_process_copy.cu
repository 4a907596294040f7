// Probe P-3 of ../shared/design/multi-process.md: may a daemon move bytes into a client's GPU
// memory while the client's kernel spins, without MPS?
//
// Two processes on GPU 0, forked before either touches CUDA:
//   client   allocates SIZE bytes with cuMemCreate (POSIX file-descriptor handle), exports the
//            handle, passes the descriptor over a socketpair (SCM_RIGHTS), then on command
//            launches a kernel of BLOCKS blocks that spins for SPIN_MS milliseconds (bounded by
//            %globaltimer) and, after it, checks the bytes the daemon wrote;
//   daemon   imports the descriptor (cuMemImportFromShareableHandle, cuMemMap, cuMemSetAccess)
//            and times, alone and then while the client's kernel spins:
//              copy_gbps     cuMemcpyHtoDAsync from pinned memory into the imported memory
//                            (the copy engine; 64 MiB copies on 2 streams)
//              launch_ms     an empty kernel of its own, launch to completion
// Prints one JSON object. Exit 0 when every step ran and the client saw the daemon's bytes.
// Under MPS (nvidia-cuda-mps-control -d first) the same figures say what MPS changes.
//
// On the GPU machine:
//   nvcc -O2 -arch=sm_90 cross_process_copy.cu -o xpc -lcuda && ./xpc
//   SPIN_MS=3000 BLOCKS=132 SIZE_MIB=1024 ./xpc
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "probe_check.h"

using Clock = std::chrono::steady_clock;
static double since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
}
static long env(const char* k, long d) {
    const char* v = getenv(k);
    return v ? atol(v) : d;
}

__global__ void spin(unsigned long long ns, unsigned* done) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
    if (threadIdx.x == 0) atomicAdd(done, 1);
}
__global__ void empty() {}
__global__ void count_bytes(const unsigned char* p, size_t n, unsigned char want,
                            unsigned long long* bad) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        if (p[i] != want) atomicAdd(bad, 1ull);
}

// One byte with room for one descriptor (SCM_RIGHTS), for sendmsg and recvmsg alike.
struct FdMsg {
    char byte = 0;
    iovec io{&byte, 1};
    char ctl[CMSG_SPACE(sizeof(int))] = {};
    msghdr m{};
    FdMsg() {
        m.msg_iov = &io;
        m.msg_iovlen = 1;
        m.msg_control = ctl;
        m.msg_controllen = sizeof ctl;
    }
};
static void send_fd(int sock, int fd) {
    FdMsg f;
    cmsghdr* c = CMSG_FIRSTHDR(&f.m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(sock, &f.m, 0) != 1) { perror("sendmsg"); exit(2); }
}
static int recv_fd(int sock) {
    FdMsg f;
    if (recvmsg(sock, &f.m, 0) != 1) { perror("recvmsg"); exit(2); }
    cmsghdr* c = CMSG_FIRSTHDR(&f.m);
    if (!c || c->cmsg_type != SCM_RIGHTS) { fprintf(stderr, "no descriptor\n"); exit(2); }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}
static void say(int sock, char c) {
    if (write(sock, &c, 1) != 1) { perror("write"); exit(2); }
}
static char hear(int sock) {
    char c = 0;
    if (read(sock, &c, 1) != 1) { perror("read"); exit(2); }
    return c;
}

static CUmemAllocationProp prop() {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return p;
}
static CUdeviceptr map(CUmemGenericAllocationHandle h, size_t size) {
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, size, 0, 0, 0));
    CK(cuMemMap(va, size, 0, h, 0));
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CK(cuMemSetAccess(va, size, &a, 1));
    return va;
}
static size_t rounded(size_t size) {
    CUmemAllocationProp p = prop();
    size_t g = 0;
    CK(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    return (size + g - 1) / g * g;
}

static int client(int sock, size_t size, long spin_ms, int blocks) {
    CR(cudaFree(0));
    size = rounded(size);
    CUmemAllocationProp p = prop();
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, size, &p, 0));
    CUdeviceptr va = map(h, size);
    CK(cuMemsetD8(va, 0, size));
    int fd = -1;
    CK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    send_fd(sock, fd);
    close(fd);
    unsigned* done;
    CR(cudaMalloc(&done, 4));
    CR(cudaMemset(done, 0, 4));
    cudaStream_t s;
    CR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (hear(sock) != 'S') return 2;
    spin<<<blocks, 32, 0, s>>>((unsigned long long)spin_ms * 1000000ull, done);
    CR(cudaGetLastError());
    say(sock, 's');
    CR(cudaStreamSynchronize(s));
    unsigned got = 0;
    CR(cudaMemcpy(&got, done, 4, cudaMemcpyDeviceToHost));
    say(sock, 'e');
    if (hear(sock) != 'C') return 2;  // the daemon's last copy is complete
    unsigned long long* bad;
    CR(cudaMalloc(&bad, 8));
    CR(cudaMemset(bad, 0, 8));
    count_bytes<<<264, 256, 0, s>>>((const unsigned char*)va, size, 0x5a, bad);
    unsigned long long nbad = ~0ull;
    CR(cudaMemcpyAsync(&nbad, bad, 8, cudaMemcpyDeviceToHost, s));
    CR(cudaStreamSynchronize(s));
    printf("{\"client_blocks_done\": %u, \"client_bad_bytes\": %llu}\n", got, nbad);
    fflush(stdout);
    return (got == (unsigned)blocks && nbad == 0) ? 0 : 1;
}

struct Figures {
    double copy_gbps, launch_ms_max, launch_ms_first;
};
static Figures measure(CUdeviceptr dst, size_t size, void* pinned, size_t chunk, double window_s,
                       cudaStream_t* st) {
    Figures f{0, 0, 0};
    auto t0 = Clock::now();
    size_t moved = 0;
    size_t off = 0;
    int i = 0;
    while (since(t0) < window_s) {
        size_t n = chunk < size - off ? chunk : size - off;
        CK(cuMemcpyHtoDAsync(dst + off, pinned, n, (CUstream)st[i & 1]));
        moved += n;
        off = (off + n) % size;
        if (++i % 8 == 0) {
            CR(cudaStreamSynchronize(st[0]));
            CR(cudaStreamSynchronize(st[1]));
        }
    }
    CR(cudaStreamSynchronize(st[0]));
    CR(cudaStreamSynchronize(st[1]));
    f.copy_gbps = moved / since(t0) / 1e9;
    for (int k = 0; k < 5; ++k) {
        auto t = Clock::now();
        empty<<<1, 1, 0, st[0]>>>();
        CR(cudaStreamSynchronize(st[0]));
        double ms = since(t) * 1e3;
        if (k == 0) f.launch_ms_first = ms;
        if (ms > f.launch_ms_max) f.launch_ms_max = ms;
    }
    return f;
}

static int daemon(int sock, size_t size, long spin_ms) {
    CR(cudaFree(0));
    size = rounded(size);
    int fd = recv_fd(sock);
    CUmemGenericAllocationHandle h;
    CK(cuMemImportFromShareableHandle(&h, (void*)(uintptr_t)fd,
                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd);
    CUdeviceptr va = map(h, size);
    const size_t chunk = 64ull << 20;
    void* pinned;
    CR(cudaHostAlloc(&pinned, chunk, cudaHostAllocDefault));
    memset(pinned, 0x5a, chunk);
    cudaStream_t st[2];
    CR(cudaStreamCreateWithFlags(&st[0], cudaStreamNonBlocking));
    CR(cudaStreamCreateWithFlags(&st[1], cudaStreamNonBlocking));
    double window = spin_ms / 1000.0 / 3;
    Figures alone = measure(va, size, pinned, chunk, window, st);
    say(sock, 'S');
    if (hear(sock) != 's') return 2;
    auto t = Clock::now();
    while (since(t) < 0.05) {}  // the spinning kernel is resident by now
    Figures during = measure(va, size, pinned, chunk, window, st);
    bool overlapped = since(t) < spin_ms / 1000.0;
    if (hear(sock) != 'e') return 2;
    Figures after = measure(va, size, pinned, chunk, 0.2, st);
    say(sock, 'C');
    printf("{\"probe\": \"cross_process_copy\", \"mps\": %s, \"size_bytes\": %zu, \"spin_ms\": %ld, "
           "\"during_inside_spin\": %s, "
           "\"alone\": {\"copy_gbps\": %.2f, \"launch_ms_first\": %.3f, \"launch_ms_max\": %.3f}, "
           "\"during_client_spin\": {\"copy_gbps\": %.2f, \"launch_ms_first\": %.3f, "
           "\"launch_ms_max\": %.3f}, \"after\": {\"copy_gbps\": %.2f}}\n",
           getenv("CUDA_MPS_PIPE_DIRECTORY") ? "true" : "false", size, spin_ms,
           overlapped ? "true" : "false", alone.copy_gbps, alone.launch_ms_first,
           alone.launch_ms_max, during.copy_gbps, during.launch_ms_first, during.launch_ms_max,
           after.copy_gbps);
    fflush(stdout);
    return 0;
}

int main() {
    size_t size = (size_t)env("SIZE_MIB", 1024) << 20;
    long spin_ms = env("SPIN_MS", 3000);
    int blocks = (int)env("BLOCKS", 4);
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 2; }
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        alarm(60);  // bounded: a wedged probe dies
        return client(sv[1], size, spin_ms, blocks);
    }
    close(sv[1]);
    alarm(60);
    int rc = daemon(sv[0], size, spin_ms);
    int status = 0;
    waitpid(pid, &status, 0);
    int crc = WIFEXITED(status) ? WEXITSTATUS(status) : 3;
    return rc ? rc : crc;
}
