#!/usr/bin/env bash
# nvmf-bench.sh: gpunvme's NVMe/TCP path against SPDK's own initiator (spdk_nvme_perf) on the
# same target, the same loopback and the same run: SPDK's NVMe-oF target (scripts/spdk-target.sh,
# reactor on core 0) serving a malloc bdev of 4096-byte blocks over TCP on a free port; each
# shape measured with `spdk_nvme_perf -c 0x2` and with `gpunvme perf --device nvme-tcp://...`,
# alternating, --reps times. Shapes: 4 KiB random reads at QD 1 and QD 32, 128 KiB sequential
# reads at QD 32. Prints one JSON object (the commands, every figure, medians, ratios); rows on
# stderr as they go. A benchmark, not a test: nothing is asserted.
#
# Usage: scripts/nvmf-bench.sh [--bin GPUNVME] [--runtime SECS] [--reps N] [--controller-threads N]
#   --bin       the gpunvme binary (default target/release/gpunvme, built if missing)
#   --runtime   seconds per measurement (default 5)
#   --reps      measurements per shape and initiator (default 3)
# Needs root (nvmf_tgt) and the SPDK bundle ($GPUNVME_SPDK_DIR, default ../shared/tools/spdk).
set -euo pipefail
cd "$(dirname "$0")/.."
G=target/release/gpunvme runtime=5 reps=3 threads=0
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) G=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        --controller-threads) threads=$2; shift 2 ;;
        *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
SPDK=${GPUNVME_SPDK_DIR:-$PWD/../shared/tools/spdk}
[ -x "$SPDK/bin/spdk_nvme_perf" ] || { echo "nvmf-bench: no SPDK bundle at $SPDK" >&2; exit 2; }
[ -x "$G" ] || cargo build --release -q -p gpunvme-cli
state=$(mktemp -d /dev/shm/gpunvme-nvmf-bench.XXXXXX)
cleanup() { scripts/spdk-target.sh stop "$state" >/dev/null 2>&1 || true; rm -rf "$state"; }
trap cleanup EXIT
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
scripts/spdk-target.sh start "$state" --malloc-mib 256 --aio-mib 64 --aio-image "$state/aio.img" \
    --tcp "$port" > /dev/null
nqn=nqn.2019-07.io.spdk:gpunvme-malloc4096
trid="trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$nqn"
dev="nvme-tcp://127.0.0.1:$port/$nqn"
# Fill the namespace once so reads move real bytes (a malloc bdev reads zeroes otherwise too,
# but the same for both initiators).
"$G" perf --device "$dev" --rw write --bs 128k --qd 16 --ios 2048 > /dev/null 2>&1 || true

rows=()
spdk_run() { # WORKLOAD BS QD -> IOPS
    env LD_LIBRARY_PATH="$SPDK/lib" timeout $((runtime + 60)) "$SPDK/bin/spdk_nvme_perf" -r "$trid" \
        -q "$3" -o "$2" -w "$1" -t "$runtime" --no-huge -s 1024 -c 0x2 2>&1 |
        awk '/^Total/ {print $3}'
}
ours_run() { # RW BS QD -> IOPS
    "$G" --controller-threads "$threads" perf --device "$dev" --rw "$1" --bs "$2" --qd "$3" \
        --runtime "${runtime}s" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["iops"])'
}
for shape in "randread 4096 1" "randread 4096 32" "read 131072 32"; do
    read -r rw bs qd <<<"$shape"
    for rep in $(seq "$reps"); do
        s=$(spdk_run "$rw" "$bs" "$qd")
        o=$(ours_run "$rw" "$bs" "$qd")
        echo "nvmf-bench: $rw bs=$bs qd=$qd rep $rep: spdk_nvme_perf $s IOPS, gpunvme $o IOPS" >&2
        rows+=("{\"rw\":\"$rw\",\"bs\":$bs,\"qd\":$qd,\"rep\":$rep,\"spdk_nvme_perf_iops\":$s,\"gpunvme_iops\":$o}")
    done
done
python3 - "$G" "$trid" "$dev" "$runtime" "$threads" "${rows[@]}" <<'EOF'
import json, statistics, sys
g, trid, dev, runtime, threads, *rows = sys.argv[1:]
rows = [json.loads(r) for r in rows]
summary = {}
for key in sorted({(r["rw"], r["bs"], r["qd"]) for r in rows}, key=lambda k: (k[1], k[2])):
    sel = [r for r in rows if (r["rw"], r["bs"], r["qd"]) == key]
    s = statistics.median(r["spdk_nvme_perf_iops"] for r in sel)
    o = statistics.median(r["gpunvme_iops"] for r in sel)
    summary["%s/%d/qd%d" % key] = {"spdk_nvme_perf_iops": s, "gpunvme_iops": round(o),
                                   "gpunvme_over_spdk": round(o / s, 3) if s else None}
print(json.dumps({
    "target": "SPDK v24.01 nvmf_tgt, malloc bdev of 4096-byte blocks, TCP on loopback, reactor on core 0",
    "commands": {
        "spdk": "spdk_nvme_perf -r '%s' -q QD -o BS -w RW -t %s --no-huge -s 1024 -c 0x2" % (trid, runtime),
        "gpunvme": "%s --controller-threads %s perf --device %s --rw RW --bs BS --qd QD --runtime %ss --json" % (g, threads, dev, runtime),
    },
    "rows": rows, "summary": summary,
}, indent=1))
EOF
