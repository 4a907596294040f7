#!/usr/bin/env bash
# The CUDA C++ example ON THE GPU MACHINE: builds examples/cuda/gpu_queues_demo.cu with that
# machine's nvcc against the libgpunvme.so scripts/gpu-build.sh carried in .gpu-bin, and runs it
# on two fresh 256 MiB images in /dev/shm (one driven with raw LBAs by the example's own kernel,
# one holding blockfs). Exit status: the example's (0 only if every check passed).
#
#   scripts/cuda-example.sh [--bin DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin
if [ "${1:-}" = --bin ]; then BIN=$2; shift 2; fi
[ -f "$BIN/libgpunvme.so" ] || tar xzf "$BIN/bins.tgz" -C "$BIN" libgpunvme.so
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
ARCH=${ARCH:-sm_90}
WORK=$(mktemp -d /dev/shm/gpunvme-cuda-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
LIB=$(cd "$BIN" && pwd)
"$NVCC" -std=c++17 -arch="$ARCH" -I include -I ptx/include examples/cuda/gpu_queues_demo.cu \
    -L "$LIB" -lgpunvme -Xlinker -rpath -Xlinker "$LIB" -o "$WORK/gpu_queues_demo"
truncate -s 256M "$WORK/raw.img" "$WORK/fs.img"
timeout 300 "$WORK/gpu_queues_demo" "$WORK/raw.img" "$WORK/fs.img"
