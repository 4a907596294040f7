// Error checks shared by the probes in this folder (standalone programs built by nvcc alone):
// a failed CUDA driver (CK) or runtime (CR) call prints where and why, and exits with 2.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                     \
    do {                                                                          \
        CUresult r_ = (x);                                                        \
        if (r_ != CUDA_SUCCESS) {                                                 \
            const char* s_ = nullptr;                                             \
            cuGetErrorString(r_, &s_);                                            \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);        \
            exit(2);                                                              \
        }                                                                         \
    } while (0)
#define CR(x)                                                                     \
    do {                                                                          \
        cudaError_t r_ = (x);                                                     \
        if (r_ != cudaSuccess) {                                                  \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,             \
                    cudaGetErrorString(r_));                                      \
            exit(2);                                                              \
        }                                                                         \
    } while (0)
