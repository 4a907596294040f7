# shellcheck shell=bash
# Sourced, from the repository root, by the scripts that run on the GPU machine: the driver's
# libraries on the library path, and the binaries scripts/gpu-build.sh packed into
# $1/bins.tgz unpacked (once per new pack).
use_gpu_bins() {
    export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
    if [ -f "$1/bins.tgz" ] && [ "$1/bins.tgz" -nt "$1/.unpacked" ]; then
        tar xzf "$1/bins.tgz" -C "$1" && touch "$1/.unpacked"
    fi
}
