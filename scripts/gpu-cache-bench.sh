#!/usr/bin/env bash
# The page cache's benchmarks (issue 21) in one run on the GPU machine, one JSON table on
# stdout (rows as they come on stderr):
#   hit   4- and 8-byte elements, random and sequential per lane, and warp-wide read_range of
#         4 KiB runs, cache warm (the timed passes must miss nothing), beside the same kernel over
#         a plain GPU buffer of the same bytes: "ratio" = cache / plain elements per second;
#   miss  random 4 KiB pages through the cache on the GPU-resident controller (hbm media) with
#         --ssd-model drives=1, 4, 16: "ratio" = fills per second / the model's cap.
# Not yet here (issue 21's later slices): BFS and embedding against all-in-GPU-memory and
# unified memory.
#
#   scripts/gpu-cache-bench.sh            binaries from scripts/gpu-build.sh (.gpu-bin/)
#   BIN=target/release/examples scripts/gpu-cache-bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu-bin}
B=$BIN/gpu_cache_bench
[ -x "$B" ] || { echo "gpu-cache-bench: $B missing (scripts/gpu-build.sh)" >&2; exit 2; }
ROWS=$(mktemp)
trap 'rm -f "$ROWS"' EXIT
fail=0
run() {  # run ARGS...: one invocation, its JSON rows kept, its command recorded in each
    local out
    if ! out=$(timeout 300 "$B" "$@" 2>&1); then
        echo "gpu-cache-bench: FAIL $B $*" >&2
        echo "$out" | tail -5 >&2
        fail=1
        return
    fi
    echo "$out" | grep '^{' | while read -r row; do
        echo "${row%\}},\"command\":\"gpu_cache_bench $*\"}" | tee -a "$ROWS" >&2
    done
}
run --part hit
for d in 1 4 16; do
    run --part miss --controller gpu --ssd-model drives=$d
done
python3 - "$ROWS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(json.dumps({"benchmark": "gpu-cache", "rows": rows}, indent=1))
PY
exit $fail
