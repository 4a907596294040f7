#!/usr/bin/env bash
# Performance of GPU queues next to CPU queues on the same software controller, run ON THE GPU
# MACHINE with binaries carried in .gpu-bin/ (scripts/gpu-build.sh). Prints one JSON object per
# run (pattern, block size, queues, depth, controller threads, side, IOPS, GB/s, latency) and
# nothing else on stdout; a run that fails prints {"error": ...} for that line.
#
#   scripts/gpu-bench.sh [--bin DIR] [--threads "4 8 12 16"] [--queues 16] [--qd 256] [--ios N]
#
# Runs, for each controller-thread count, on a controller granting --queues queue pairs: 4 KiB
# random reads at --qd per queue and 128 KiB sequential reads at QD32 per queue, on GPU queues
# and on CPU queues (one host thread per queue); then QD1 4 KiB random-read latency, GPU and
# CPU. Without --verify: the acceptance runs of scripts/gpu-test.sh check the bytes.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin THREADS="4 8 12 16" QUEUES=16 QD=256 IOS=3000000
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --ios) IOS=$2; shift 2 ;;
        --queues) QUEUES=$2; shift 2 ;;
        --qd) QD=$2; shift 2 ;;
        *) echo "usage: $0 [--bin DIR] [--threads LIST] [--queues N] [--qd N] [--ios N]" >&2; exit 2 ;;
    esac
done
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
G=$BIN/gpunvme
IMG=$(mktemp /dev/shm/gpunvme-bench.XXXXXX)
trap 'rm -f "$IMG"' EXIT
truncate -s 4G "$IMG"
# Fill the image once so reads touch real pages (sequential 1 MiB writes from the CPU).
"$G" --device "$IMG" perf --rw write --bs 1m --qd 8 --ios 4096 >/dev/null 2>&1
one() {  # one SIDE THREADS ARGS...: a perf run, summarised as one JSON line
    local side=$1 threads=$2; shift 2
    local gpu=(); [ "$side" = gpu ] && gpu=(--gpu)
    local out
    if ! out=$("$G" --device "$IMG" --controller-threads "$threads" --controller-queue-pairs "$QUEUES" \
        --json perf "${gpu[@]}" "$@" 2>&1); then
        python3 -c 'import json,sys; print(json.dumps({"side":sys.argv[1],"controller_threads":int(sys.argv[2]),"args":sys.argv[3],"error":sys.argv[4][-400:]}))' \
            "$side" "$threads" "$*" "$out"
        return
    fi
    echo "$out" | python3 -c 'import json,sys
r=json.load(sys.stdin); side,threads,args=sys.argv[1],int(sys.argv[2]),sys.argv[3]
g=r.get("gpu") or {}; c=g.get("controller") or {}
print(json.dumps({"side":side,"controller_threads":threads,"args":args,
  "iops":round(r["iops"]),"gb_s":round(r["bw_bytes"]/1e9,2),
  "lat_us":{k:round(v/1000,1) for k,v in r["lat_ns"].items()},"errors":r["errors"],
  "gpu_threads":g.get("threads"),"style":g.get("style"),"queues":g.get("queues"),
  "controller":c or None}))' "$side" "$threads" "$*"
}
for t in $THREADS; do
    for side in gpu cpu; do
        one $side "$t" --rw randread --bs 4k --qd "$QD" --queues "$QUEUES" --ios "$IOS"
        one $side "$t" --rw read --bs 128k --qd 32 --queues "$QUEUES" --ios $((IOS / 10))
    done
done
for side in gpu cpu; do
    one $side 1 --rw randread --bs 4k --qd 1 --queues 1 --ios 20000
done
