#!/usr/bin/env bash
# The page cache's benchmarks (issue 21) in one run on the GPU machine, one JSON table on
# stdout (rows as they come on stderr):
#   hit   4- and 8-byte elements, random and sequential per lane, and warp-wide read_range of
#         4 KiB runs, cache warm (the timed passes must miss nothing), beside the same kernel over
#         a plain GPU buffer of the same bytes: "ratio" = cache / plain elements per second;
#   miss  random 4 KiB pages through the cache on the GPU-resident controller (hbm media) with
#         --ssd-model drives=1, 4, 16: "ratio" = fills per second / the model's cap.
#   bfs, embedding  the two examples (gpu_bfs, gpu_embedding) on the GPU-resident controller
#         with --ssd-model drives=4, the cache at 25, 10 and 50 % of the data (cold at the start
#         of each run), beside the same kernel over the data wholly in GPU memory (the upper
#         bound), in unified memory written by the CPU, and in unified memory with free GPU
#         memory limited to 25 % of the data (a balloon allocation; BaM's comparison); BFS
#         again with 64 and 16 KiB pages on 4 drives (16 KiB also top-down only), 64 KiB on 16,
#         and on 4 Gen5-class drives (16 and 64 KiB).
#
#   scripts/gpu-cache-bench.sh            binaries from scripts/gpu-build.sh (.gpu-bin/)
#   BIN=target/release/examples scripts/gpu-cache-bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu-bin}
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
for b in gpu_cache_bench gpu_bfs gpu_embedding; do
    [ -x "$BIN/$b" ] || { echo "gpu-cache-bench: $BIN/$b missing (scripts/gpu-build.sh)" >&2; exit 2; }
done
BFS_SCALE=${BFS_SCALE:-21} EMB_ROWS=${EMB_ROWS:-2M}
ROWS=$(mktemp)
trap 'rm -f "$ROWS"' EXIT
fail=0
run() {  # run NAME ARGS...: one invocation, its JSON rows kept, its command recorded in each
    local name=$1 out; shift
    if ! out=$(timeout 600 "$BIN/$name" "$@" 2>&1); then
        echo "gpu-cache-bench: FAIL $name $*" >&2
        echo "$out" | tail -5 >&2
        fail=1
        return
    fi
    echo "$out" | grep '^{' | while read -r row; do
        echo "${row%\}},\"command\":\"$name $*\"}" | tee -a "$ROWS" >&2
    done
}
run gpu_cache_bench --part hit
for d in 1 4 16; do
    run gpu_cache_bench --part miss --controller gpu --ssd-model drives=$d
done
MODEL="--controller gpu --ssd-model drives=4 --cache 25%,10%,50% --baselines --json"
run gpu_bfs --scale "$BFS_SCALE" $MODEL
# Larger pages: fewer, larger reads (the 4 drives' bandwidth, not their IOPS, bounds them);
# 16 KiB pages (the fewest bytes read at 25 %), with the baselines again (unified memory's
# time varies from process to process); every level top-down for comparison; and 16 drives.
run gpu_bfs --scale "$BFS_SCALE" --controller gpu --ssd-model drives=4 --cache 25%,10%,50% --page-size 64K --json
run gpu_bfs --scale "$BFS_SCALE" --controller gpu --ssd-model drives=4 --cache 25%,10% --page-size 16K --baselines --json
run gpu_bfs --scale "$BFS_SCALE" --controller gpu --ssd-model drives=4 --cache 25% --page-size 16K --direction top-down --json
run gpu_bfs --scale "$BFS_SCALE" --controller gpu --ssd-model drives=16 --cache 25% --page-size 64K --json
# 4 Gen5-class drives (14 GB/s, 2.5 M IOPS each; the default model is Gen4-class: 7 GB/s, 1 M).
GEN5="drives=4,iops=2500000,bw=14GB/s"
for ps in 16K 64K; do
    run gpu_bfs --scale "$BFS_SCALE" --controller gpu --ssd-model "$GEN5" --cache 25% --page-size $ps --json
done
run gpu_embedding --rows "$EMB_ROWS" $MODEL
python3 - "$ROWS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(json.dumps({"benchmark": "gpu-cache", "rows": rows}, indent=1))
PY
exit $fail
