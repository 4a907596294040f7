#!/usr/bin/env bash
# Regenerates the committed PTX of the three kernel modules with nvcc 13.0 (PyPI wheels):
#   ptx/kernels/gpunvme_kernels.ptx       the runtime's kernels (embedded by gpu_queues, loaded
#                                         by every embedder)
#   ptx/kernels/gpunvme_tool_kernels.ptx  the tests', benchmarks', examples' and perf's kernels
#                                         (embedded by gpu_queues, loaded by those who use them)
#   ptx/emu/gpunvme_emu_kernels.ptx       the emulated controllers' kernels (embedded by gpu_emu)
# and, with --check, fails if a committed PTX differs or if ptxas cannot assemble it for
# sm_80 and sm_90. The compiler is pinned: the GPU machine's driver (580, CUDA 13.0) cannot load
# PTX from newer compilers.
#
#   scripts/build-ptx.sh            regenerate (installs the compiler on first use)
#   scripts/build-ptx.sh --check    CI: regenerate into a temp file, compare, assemble
#
# NVCC_DIR overrides where the wheels go (default: .cache/cuda13 in the repository).
set -euo pipefail
cd "$(dirname "$0")/.."
CHECK=0
[ "${1:-}" = --check ] && CHECK=1
DIR=${NVCC_DIR:-$PWD/.cache/cuda13}
NVCC=$DIR/nvidia/cu13/bin/nvcc
PTXAS=$DIR/nvidia/cu13/bin/ptxas
if [ ! -x "$NVCC" ] || ! "$NVCC" --version | grep -q 'release 13.0, V13.0.88'; then
    echo "installing nvcc 13.0.88 into $DIR" >&2
    if ! python3 -m pip --version >/dev/null 2>&1; then
        echo "pip is missing: installing python3-pip" >&2
        (apt-get update -q && apt-get install -y -q python3-pip) >&2 \
            || { echo "error: cannot install pip; install python3-pip and retry" >&2; exit 1; }
    fi
    python3 -m pip install -q --no-deps --target "$DIR" \
        nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
export PATH=$DIR/nvidia/cu13/bin:$PATH
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
status=0
build() {  # build SRC OUT: one module
    local src=$1 out=$2 name; name=$(basename "$out" .ptx)
    # compute_80: the PTX runs on Ampere and newer (the driver JIT-compiles it); st.mmio needs
    # PTX ISA 8.2+, which nvcc 13.0 emits (.version 9.0).
    # PTX_DEFINES (e.g. "-DNAME"): experiments only; the committed PTX is built without.
    # shellcheck disable=SC2086
    "$NVCC" -ptx -arch=compute_80 -O3 -std=c++17 -Xptxas -Werror ${PTX_DEFINES:-} \
        -I"$DIR/nvidia/cu13/include/cccl" -Iptx/include -Iptx/emu -o "$TMP/$name.raw" "$src"
    # Drop the compiler's build-identifying comment lines so the output depends on the source only.
    grep -v '^// Cuda compilation tools\|^// Based on\|^// Compiler Build ID' "$TMP/$name.raw" > "$TMP/$name.ptx"
    for arch in sm_80 sm_90; do
        "$PTXAS" -arch=$arch -O3 -o "$TMP/${name}_$arch.cubin" "$TMP/$name.ptx"
    done
    echo "ptxas: $out assembled for sm_80 and sm_90" >&2
    if [ $CHECK = 1 ]; then
        if ! cmp -s "$TMP/$name.ptx" "$out"; then
            echo "error: $out is stale: run scripts/build-ptx.sh and commit the result" >&2
            diff "$out" "$TMP/$name.ptx" | head -20 >&2 || true
            status=1
            return
        fi
        echo "ptx: $out matches its source" >&2
    else
        cp "$TMP/$name.ptx" "$out"
        echo "wrote $out ($(wc -l < "$out") lines)" >&2
    fi
}
build ptx/kernels/gpunvme_kernels.cu ptx/kernels/gpunvme_kernels.ptx
build ptx/kernels/gpunvme_tool_kernels.cu ptx/kernels/gpunvme_tool_kernels.ptx
build ptx/emu/gpunvme_emu_kernels.cu ptx/emu/gpunvme_emu_kernels.ptx
exit $status
