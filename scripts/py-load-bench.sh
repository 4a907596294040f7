#!/usr/bin/env bash
# Model loads into CUDA tensors (issue 22), ON THE GPU MACHINE: gpunvme (software controller;
# the GPU-resident model with 1 and 4 modelled Gen5 drives) against safetensors,
# fastsafetensors and InstantTensor, and the pinned host->GPU ceiling, warm and cold, every
# load verified (benches/py-load/bench.py says how). Uses what scripts/gpu-build.sh carried in
# .gpu-bin: the CLI (in bins.tgz), the gpunvme wheel (wheels/) and the baselines' wheels
# (bench-wheels/), installed into a folder on PYTHONPATH beside the machine's torch and
# safetensors (no network there). Prints one JSON object on stdout; rows on stderr as they go.
#
#   scripts/py-load-bench.sh [--bin DIR] [bench.py ARGS...]     e.g. --models 0.6b --caches warm
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin
if [ "${1:-}" = --bin ]; then BIN=$2; shift 2; fi
WORK=${TMPDIR:-/tmp}/gpunvme-pyload
mkdir -p "$WORK/bin"
tar -xzf "$BIN/bins.tgz" -C "$WORK/bin" gpunvme
SITE=$WORK/site
rm -rf "$SITE"
# Compiled to bytecode at install, as a user's `pip install` does: a fresh process then loads
# each package's .pyc instead of compiling its sources (gpunvme's __init__.py alone took 3-8 ms
# to compile per process; the environment may forbid writing .pyc at import).
python3 -m pip install -q --no-index --no-deps --disable-pip-version-check \
    --target "$SITE" "$BIN"/wheels/gpunvme-*.whl "$BIN"/bench-wheels/*.whl
export PYTHONPATH=$SITE
exec python3 benches/py-load/bench.py --dir "$WORK" --gpunvme "$WORK/bin/gpunvme" "$@"
