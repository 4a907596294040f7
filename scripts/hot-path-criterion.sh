#!/usr/bin/env bash
# Issue 12's criterion figures, robust to a noisy host: runs prebuilt `hot_path` bench binaries
# (nvme's criterion bench against the inline null device) in interleaved rounds, the order
# reversed every other round, and prints one JSON line per benchmark and run, then a summary
# per label and benchmark (the median over rounds of criterion's median), in ns per command:
#   {"label":..,"round":..,"bench":"qd1/prp1_4k","mean_ns":..,"median_ns":..}
#   {"summary":true,"label":..,"bench":..,"rounds":..,"median_ns":..,"min_ns":..,"max_ns":..}
# Batch groups (batch32, batch32_owned) are divided by 32: per command, like qd1.
#
# Usage: scripts/hot-path-criterion.sh LABEL=BIN [LABEL=BIN ...]
#   BIN: a `hot_path` bench executable, e.g. the newest target/release/deps/hot_path-* after
#   `cargo bench --no-run -p nvme --bench hot_path` (build one per commit to compare).
# Env: ROUNDS (3), FILTER (criterion filter, default "qd1"), WARMUP (1 s), MEASURE (4 s),
#      CPU (pin every run to this CPU with taskset; default: not pinned).
set -euo pipefail
ROUNDS=${ROUNDS:-3}
FILTER=${FILTER:-qd1}
WARMUP=${WARMUP:-1}
MEASURE=${MEASURE:-4}
[[ $# -ge 1 ]] || { echo "usage: $0 LABEL=BIN [LABEL=BIN ...]" >&2; exit 2; }
labels=()
bins=()
for arg in "$@"; do
    [[ $arg == *=* ]] || { echo "not LABEL=BIN: $arg" >&2; exit 2; }
    bin=$(realpath "${arg#*=}")
    [[ -x $bin ]] || { echo "not executable: $bin" >&2; exit 2; }
    labels+=("${arg%%=*}")
    bins+=("$bin")
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PIN=()
[[ -n ${CPU:-} ]] && PIN=(taskset -c "$CPU")
for ((round = 1; round <= ROUNDS; round++)); do
    order=("${!labels[@]}")
    if ((round % 2 == 0)); then
        order=($(printf '%s\n' "${order[@]}" | tac))
    fi
    for i in "${order[@]}"; do
        dir="$WORK/${labels[$i]}-$round"
        mkdir -p "$dir"
        # criterion writes target/criterion under the working directory: one per run.
        (cd "$dir" && "${PIN[@]}" "${bins[$i]}" --bench --warm-up-time "$WARMUP" \
            --measurement-time "$MEASURE" --noplot "$FILTER" >run.log 2>&1)
        python3 - "$dir" "${labels[$i]}" "$round" <<'EOF'
import json, os, sys
root, label, rnd = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = os.path.join(root, "target", "criterion")
for group in sorted(os.listdir(base)) if os.path.isdir(base) else []:
    for bench in sorted(os.listdir(os.path.join(base, group))):
        f = os.path.join(base, group, bench, "new", "estimates.json")
        if not os.path.isfile(f):
            continue
        est = json.load(open(f))
        per = 32 if group.startswith("batch32") else 1
        print(json.dumps({"label": label, "round": rnd, "bench": f"{group}/{bench}",
                          "mean_ns": round(est["mean"]["point_estimate"] / per, 2),
                          "median_ns": round(est["median"]["point_estimate"] / per, 2)}))
EOF
    done
done | tee "$WORK/lines.jsonl"
python3 - "$WORK/lines.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
keys = sorted({(r["label"], r["bench"]) for r in rows}, key=lambda k: (k[1], k[0]))
for label, bench in keys:
    v = [r["median_ns"] for r in rows if r["label"] == label and r["bench"] == bench]
    print(json.dumps({"summary": True, "label": label, "bench": bench, "rounds": len(v),
                      "median_ns": round(statistics.median(v), 2), "min_ns": min(v),
                      "max_ns": max(v)}))
EOF
