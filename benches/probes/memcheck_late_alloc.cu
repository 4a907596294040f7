// Probe: does compute-sanitizer memcheck accept a running kernel's access to memory allocated
// after its launch? (The GPU-resident controller is launched before the queues' rings exist.)
// On the GPU machine:
//   nvcc -arch=sm_90 memcheck_late_alloc.cu -o late && compute-sanitizer --tool memcheck ./late
//   EARLY=1 compute-sanitizer --tool memcheck ./late      # the control: allocated before launch
// H100, CUDA 13.0, driver 580, 2026-11-23: the late allocation is reported "Invalid __global__
// read ... out of bounds" (and the kernel is killed); the early one: 0 errors.
#include <cstdio>
#include <unistd.h>
__global__ void k(volatile unsigned long long* slot, int* out) {
    unsigned long long p = 0;
    for (int i = 0; i < 4000000 && !(p = *slot); ++i) __nanosleep(1000);
    out[0] = p ? *(volatile int*)p : -1;
}
int main() {
    unsigned long long* slot; int* out; int host = 0;
    cudaHostAlloc(&slot, 8, cudaHostAllocMapped); *slot = 0;
    int* early; cudaMalloc(&early, 4096); cudaMemset(early, 0, 4096);
    cudaMalloc(&out, 4);
    cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    bool late = getenv("EARLY") == nullptr;
    k<<<1, 1, 0, s>>>(slot, out);
    usleep(200000);
    int* target = early;
    if (late) { cudaMalloc(&target, 4096); cudaMemset(target, 0, 4096); }
    *(volatile unsigned long long*)slot = (unsigned long long)target;
    cudaError_t e = cudaStreamSynchronize(s);
    cudaMemcpy(&host, out, 4, cudaMemcpyDeviceToHost);
    printf("%s allocation: kernel read %d, %s\n", late ? "late" : "early", host, cudaGetErrorString(e));
    return e != cudaSuccess;
}
