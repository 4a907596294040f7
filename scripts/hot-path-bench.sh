#!/usr/bin/env bash
# Issue 12, the controller's side: `gpunvme perf --rw randread --bs 4k --qd 32` on the software
# controller over an image in /dev/shm (memory-backed: a 1 GiB image written in full first, so
# reads hit real pages, not holes), one queue, one controller thread, before and after, in one
# run of this script on one machine. "Before" is gpunvme built from BEFORE (default 6d3c4af,
# the commit issue 12 started from) in target/hot-path-before/ (built once, then reused);
# "after" is the working tree.
#
# Prints one JSON line per run, then one summary line with the medians:
#   {"which":"before","run":1,"iops":...,"p50_ns":...,"p99_ns":...}
#   {"summary":true,"ios":...,"repeat":...,"before":{"iops":...,"p50_ns":...,"p99_ns":...},
#    "after":{...},"iops_ratio":...}
#
# Usage: scripts/hot-path-bench.sh [BEFORE]   Environment: IOS (default 2000000), REPEAT (3);
# BEFORE_BIN and AFTER_BIN: prebuilt binaries to use instead of building (a machine without
# cargo).
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${1:-6d3c4af}
IOS=${IOS:-2000000}
REPEAT=${REPEAT:-3}
before_bin=${BEFORE_BIN:-"target/hot-path-before/$BEFORE/gpunvme"}
if [[ ! -x "$before_bin" ]]; then
    src=$(mktemp -d)
    git archive "$BEFORE" | tar -x -C "$src"
    echo "building gpunvme at $BEFORE (once) ..." >&2
    CARGO_TARGET_DIR="$PWD/target/hot-path-before/target" \
        cargo build --release -q --manifest-path "$src/Cargo.toml" --bin gpunvme >&2
    mkdir -p "$(dirname "$before_bin")"
    cp "target/hot-path-before/target/release/gpunvme" "$before_bin"
    rm -rf "$src"
fi
after_bin=${AFTER_BIN:-target/release/gpunvme}
if [[ -z "${AFTER_BIN:-}" ]]; then
    cargo build --release -q --bin gpunvme >&2
fi

img=$(mktemp /dev/shm/gpunvme-hot-path.XXXXXX)
trap 'rm -f "$img"' EXIT
dd if=/dev/zero of="$img" bs=1M count=1024 status=none

run() { # which binary run
    "$2" perf --device "$img" --rw randread --bs 4k --qd 32 --ios "$IOS" --queues 1 \
        --controller-threads 1 --seed 1 --json |
        python3 -c '
import json, sys
r = json.load(sys.stdin)
assert r["errors"] == 0, r
print(json.dumps({"which": sys.argv[1], "run": int(sys.argv[2]), "iops": round(r["iops"]),
                  "p50_ns": r["lat_ns"]["p50"], "p99_ns": r["lat_ns"]["p99"]}))
' "$1" "$3"
}

lines=()
for i in $(seq 1 "$REPEAT"); do
    # Alternate the order, so that neither side always runs on a warmer machine.
    if (( i % 2 )); then order="before after"; else order="after before"; fi
    for which in $order; do
        bin=$before_bin
        [[ $which == after ]] && bin=$after_bin
        line=$(run "$which" "$bin" "$i")
        echo "$line"
        lines+=("$line")
    done
done
printf '%s\n' "${lines[@]}" | python3 -c '
import json, statistics, sys
runs = [json.loads(l) for l in sys.stdin]
def med(which, key):
    return statistics.median(r[key] for r in runs if r["which"] == which)
out = {"summary": True, "ios": int(sys.argv[1]), "repeat": int(sys.argv[2]),
       "before_commit": sys.argv[3]}
for w in ("before", "after"):
    out[w] = {k: med(w, k) for k in ("iops", "p50_ns", "p99_ns")}
out["iops_ratio"] = round(out["after"]["iops"] / out["before"]["iops"], 3)
print(json.dumps(out))
' "$IOS" "$REPEAT" "$BEFORE"
