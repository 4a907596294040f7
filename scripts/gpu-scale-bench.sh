#!/usr/bin/env bash
# GPU I/O over several controllers at once (issue 23), ON THE GPU MACHINE with binaries carried
# in .gpu-bin/ (scripts/gpu-build.sh):
#
#   scripts/gpu-scale-bench.sh [--bin DIR] [--counts "1 2 4 8"] [--secs S] [--threads T]
#
# N software controllers, each over its own 1 GiB image on /dev/shm (filled with real pages by
# the CPU first) with T controller threads (default 2: 8 controllers use 16 cores), run
# `perf --gpu` at once (`--device a,b,...`: each controller its own GPU queues and perf kernel):
# 4 KiB random reads (4 queues x QD 128 per controller) and 128 KiB sequential reads (4 queues
# x QD 16), --secs each. Prints one JSON line per run and a summary {"summary": ...} with the
# scaling efficiency, throughput at N / (N x throughput at 1). The host's CPUs bound the
# software controller: N x T threads copy every byte (a real SSD's DMA does not). A failed run
# prints {"error": ...} and the script exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin COUNTS="1 2 4 8" SECS=3 THREADS=2
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --counts) COUNTS=$2; shift 2 ;;
        --secs) SECS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        *) sed -n '2,14p' "$0" >&2; exit 2 ;;
    esac
done
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
G=$(realpath "$BIN/gpunvme")
DIR=$(mktemp -d /dev/shm/gpunvme-scale.XXXXXX)
trap 'rm -rf "$DIR"' EXIT
MAX=0
for n in $COUNTS; do [ "$n" -gt "$MAX" ] && MAX=$n; done
for i in $(seq 1 "$MAX"); do
    truncate -s 1G "$DIR/c$i.img"
    "$G" --device "$DIR/c$i.img" perf --force --rw write --bs 1m --qd 8 --ios 1024 >/dev/null 2>&1 ||
        { echo '{"error":"filling an image failed"}'; exit 1; }
done
failed=0
declare -A RESULT
for n in $COUNTS; do
    devs=$(seq 1 "$n" | sed "s|^|$DIR/c|; s|$|.img|" | paste -sd,)
    for job in "iops 4k randread 128" "bw 128k read 16"; do
        set -- $job
        kind=$1 bs=$2 rw=$3 qd=$4
        out=$("$G" --device "$devs" --controller-threads "$THREADS" --controller-queue-pairs 4 \
            --json perf --gpu --rw "$rw" --bs "$bs" --qd "$qd" --queues 4 --runtime "${SECS}s" \
            2>"$DIR/err")
        line=$(python3 -c '
import json, sys
n, kind = int(sys.argv[1]), sys.argv[2]
try:
    d = json.loads(sys.stdin.read())
except Exception as e:
    print(json.dumps({"error": f"controllers={n} {kind}: not JSON: {e}"})); sys.exit(1)
if "controllers" in d:
    t, per = d["total"], d["controllers"]
else:  # one device: perf --gpu'"'"'s own report
    t, per = {"iops": d["iops"], "bw_bytes": d["bw_bytes"], "errors": d["errors"],
              "lat_mean_ns": d["lat_ns"]["mean"]}, [d]
row = {"controllers": n, "job": kind, "iops": round(t["iops"]), "gbytes_per_s":
       round(t["bw_bytes"] / 1e9, 3), "errors": t["errors"], "lat_mean_us":
       round(t["lat_mean_ns"] / 1e3, 1), "per_controller_iops": [round(c["iops"]) for c in per]}
print(json.dumps(row))
sys.exit(1 if t["errors"] else 0)
' "$n" "$kind" <<<"$out") || { failed=1; [ -n "$line" ] || line="{\"error\":\"controllers=$n $kind: $(tail -1 "$DIR/err" | tr -d '"\\')\"}"; }
        echo "$line"
        RESULT[$n,$kind]=$line
    done
done
python3 - "$COUNTS" "$THREADS" "$(nproc)" "$(for k in "${!RESULT[@]}"; do echo "${RESULT[$k]}"; done)" <<'EOF'
import json, sys
counts = [int(c) for c in sys.argv[1].split()]
rows = [json.loads(l) for l in sys.argv[4].splitlines() if l.startswith("{")]
by = {(r.get("controllers"), r.get("job")): r for r in rows if "job" in r}
summary = {"threads_per_controller": int(sys.argv[2]), "host_cpus": int(sys.argv[3])}
for job, key in (("iops", "iops"), ("bw", "gbytes_per_s")):
    one = by.get((1, job), {}).get(key)
    for n in counts:
        r = by.get((n, job))
        if r and one:
            summary[f"{job}_{n}"] = r[key]
            summary[f"{job}_efficiency_{n}"] = round(r[key] / (n * one), 3)
print(json.dumps({"summary": summary}))
EOF
exit $failed
