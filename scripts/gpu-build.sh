#!/usr/bin/env bash
# Builds, on this CPU machine, the release binaries the GPU suite runs on the GPU machine, and
# packs them under stable names into .gpu-bin/bins.tgz (ignored by git: add `/.gpu-bin/` to
# .git/info/exclude), to be carried there (the scripts unpack it):
#   .gpu-bin/gpunvme        the CLI
#   .gpu-bin/gpu-tests      tests/gpu/ (the GPU suite; its tests are #[ignore]d
#                           here and run with --include-ignored there)
#   .gpu-bin/cpu-client     gpu-queues/tests/cpu_client.rs (the protocol from CPU threads), if built
#   .gpu-bin/gpu_read, gpu_random, gpu_write, load_safetensors   the GPU file examples
#   .gpu-bin/gpu_cache_bench                                      the page cache microbenchmarks
#   .gpu-bin/gpu_bfs, gpu_embedding                               the page cache examples
#   .gpu-bin/libgpunvme.so  the C ABI, for scripts/cuda-example.sh
#   .gpu-bin/spdk/          SPDK's nvmf_tgt bundle, for scripts/spdk-gpu-test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu-bin}
mkdir -p "$OUT"
cargo build --release -p gpunvme-cli
cp target/release/gpunvme "$OUT/gpunvme"
EXAMPLES="gpu_read gpu_random gpu_write load_safetensors gpu_cache_bench gpu_bfs gpu_embedding"
for ex in $EXAMPLES; do
    cargo build --release -p gpunvme-cli --example "$ex"
    cp "target/release/examples/$ex" "$OUT/$ex"
done
bin_of() {  # the test executable cargo built for --test $1 of crate $2
    cargo test --release -p "$2" --test "$1" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except Exception: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]:
        print(m["executable"])' "$1" | tail -1
}
cp "$(bin_of gpu gpunvme-cli)" "$OUT/gpu-tests"
if [ -f gpu-queues/tests/cpu_client.rs ]; then
    cp "$(bin_of cpu_client gpu_queues)" "$OUT/cpu-client"
fi
cp scripts/gpu-test.sh "$OUT/"
# The C ABI, for scripts/cuda-example.sh (which builds the CUDA C++ example there).
cargo build --release -p gpunvme_capi
cp target/release/libgpunvme.so "$OUT/libgpunvme.so"
# SPDK's NVMe-oF target for scripts/spdk-gpu-test.sh (16 MB; GPUNVME_SPDK_DIR or the bundle
# beside this repository).
SPDK_BUNDLE=${GPUNVME_SPDK_DIR:-../shared/tools/spdk}
if [ -x "$SPDK_BUNDLE/bin/nvmf_tgt" ]; then
    rm -rf "$OUT/spdk" && cp -r "$SPDK_BUNDLE" "$OUT/spdk" && chmod -R u+w "$OUT/spdk"
else
    echo "gpu-build: no SPDK bundle at $SPDK_BUNDLE: spdk-gpu-test.sh will not run there" >&2
fi
# Stripped: the carried tree must stay under 64 MiB.
strip "$OUT"/gpunvme "$OUT"/gpu-tests "$OUT"/cpu-client "$OUT"/libgpunvme.so 2>/dev/null || true
for ex in $EXAMPLES; do strip "$OUT/$ex"; done
# Packed: the binaries embed the same PTX, so they compress well (about 4:1) and the carried
# tree stays under its 64 MiB. gpu-test.sh and gpu-cache-bench.sh unpack
# bins.tgz by themselves; elsewhere `tar xzf .gpu-bin/bins.tgz -C .gpu-bin` first.
# Only the plain files just built: folders (wheels, anything carried beside) stay as they are.
BINS=$(cd "$OUT" && find . -maxdepth 1 -type f ! -name '*.sh' ! -name bins.tgz -printf '%f\n')
tar czf "$OUT/bins.tgz" -C "$OUT" $BINS
(cd "$OUT" && rm -f $BINS)
ls -la "$OUT"
# The Python package as an abi3 wheel (plain linux tag: it runs where these binaries run), with
# pytest's wheels: scripts/py-gpu-test.sh installs them there (no network on the GPU machine).
rm -rf "$OUT/wheels"
VENV=target/py-venv
if [ ! -x "$VENV/bin/maturin" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2" "pytest>=7"
fi
(cd python && "../$VENV/bin/maturin" build -q --release --compatibility linux -o "../$OUT/wheels")
"$VENV/bin/pip" download -q --disable-pip-version-check pytest --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 -d "$OUT/wheels"
cp scripts/py-gpu-test.sh "$OUT/"
# The loaders scripts/py-load-bench.sh compares with (their wheels; no network there).
rm -rf "$OUT/bench-wheels"
"$VENV/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$OUT/bench-wheels" \
    instanttensor==0.2.2 fastsafetensors==0.5.0
ls -la "$OUT/wheels"
