#!/usr/bin/env bash
# GPU queues on the software controller at low depth, beside CPU queues of the same
# controller, ON THE GPU MACHINE with binaries carried in .gpu-bin/ (scripts/gpu-build.sh):
#
#   scripts/emu-gpu-latency.sh [--bin DIR] [--secs S] [--rings "host gpu"] [--load-mib N]
#
# For each ring placement (GPUNVME_EMU_RINGS: `host` = rings, PRP lists and slot buffers in
# pinned host memory the controller reads directly, the default; `gpu` = all of it in GPU
# memory behind the controller's copy engines), 4 KiB random reads on one queue at QD 1 (one GPU
# thread) and QD 32 (32 commands: thread client, then lone, warp (two warps of 16 lanes) and
# warp32 (one warp) clients), and on 8 queues at QD 256, --secs each; then the same on CPU
# queues.
# Then `fs get --gpu` of a --load-mib MiB file into GPU memory with each placement (the data
# path: copies into GPU memory, completions in the rings' memory), GPU and host CRC-32C compared.
# The image is on /dev/shm. Prints one JSON line per run and a summary line
# {"summary": ...}; a failed run prints {"error": ...} and the script exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin SECS=5 RINGS="host gpu" LOAD_MIB=1024
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --secs) SECS=$2; shift 2 ;;
        --rings) RINGS=$2; shift 2 ;;
        --load-mib) LOAD_MIB=$2; shift 2 ;;
        *) sed -n '2,14p' "$0" >&2; exit 2 ;;
    esac
done
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
G=$(realpath "$BIN/gpunvme")
DIR=$(mktemp -d /dev/shm/gpunvme-emu-lat.XXXXXX)
trap 'rm -rf "$DIR"' EXIT
IMG=$DIR/perf.img FS=$DIR/fs.img
truncate -s 1G "$IMG"
# Real pages behind every block read (sequential 1 MiB writes from the CPU).
"$G" --device "$IMG" perf --force --rw write --bs 1m --qd 8 --ios 1024 >/dev/null 2>&1 ||
    { echo '{"error":"filling the image failed"}'; exit 1; }
failed=0
RESULTS=$DIR/results.jsonl
: >"$RESULTS"

run() { # label rings args... : one perf run as a JSON line (errors fail it)
    local label=$1 rings=$2; shift 2
    local out
    if ! out=$(GPUNVME_EMU_RINGS=$rings timeout 120 "$G" --device "$IMG" --json perf --force "$@" 2>"$DIR/err"); then
        python3 -c 'import json,sys; print(json.dumps({"run":sys.argv[1],"rings":sys.argv[2],"error":sys.argv[3][-400:]}))' \
            "$label" "$rings" "$(tail -5 "$DIR/err")"
        failed=1
        return
    fi
    python3 - "$label" "$rings" "$out" <<'EOF' | tee -a "$RESULTS"
import json, sys
label, rings, j = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
row = {"run": label, "rings": rings if label.startswith("gpu") else None,
       "qd": j["qd"], "queues": j["queues"], "ios": j["ios"], "iops": round(j["iops"]),
       "lat_p50_us": j["lat_ns"]["p50"] / 1e3, "lat_mean_us": round(j["lat_ns"]["mean"] / 1e3, 2),
       "lat_p99_us": j["lat_ns"]["p99"] / 1e3, "errors": j["errors"]}
ctrl = (j.get("gpu") or {}).get("controller")
if ctrl:
    row["controller"] = {k: ctrl.get(k) for k in ("scatters", "gathers", "sync_reads", "gpu_wait_ms")}
print(json.dumps(row))
EOF
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
}

for rings in $RINGS; do
    for qd in 1 32; do
        run "gpu-qd$qd" "$rings" --gpu --rw randread --bs 4k --queues 1 --qd $qd --gpu-threads $qd \
            --client thread --runtime "${SECS}s"
    done
    # The same 32 commands from 32 threads of different warps (`lone`), from two warps of 16
    # lanes together (`warp`, its default at QD 32: one warp submits while the other waits),
    # and from one warp of 32 (`warp32`): thread clients in one warp diverge while they wait.
    for c in lone warp; do
        run "gpu-qd32-$c" "$rings" --gpu --rw randread --bs 4k --queues 1 --qd 32 --gpu-threads 32 \
            --client $c --runtime "${SECS}s"
    done
    run "gpu-qd32-warp32" "$rings" --gpu --rw randread --bs 4k --queues 1 --qd 32 --gpu-threads 32 \
        --client warp --warp-lanes 32 --runtime "${SECS}s"
    # Many queues, deep: what host rings cost when thousands of GPU threads poll over PCIe.
    run "gpu-8x256" "$rings" --gpu --rw randread --bs 4k --queues 8 --qd 256 --runtime "${SECS}s"
done
for qd in 1 32; do
    run "cpu-qd$qd" - --rw randread --bs 4k --queues 1 --qd $qd --runtime "${SECS}s"
done
run "cpu-8x256" - --rw randread --bs 4k --queues 8 --qd 256 --runtime "${SECS}s"

# The data path into GPU memory with each placement.
head -c $((LOAD_MIB << 20)) /dev/urandom >"$DIR/data.bin"
truncate -s $(((LOAD_MIB + 256) << 20)) "$FS"
"$G" --device "$FS" fs mkfs >/dev/null 2>&1 &&
    "$G" --device "$FS" fs put "$DIR/data.bin" data.bin >/dev/null 2>&1 ||
    { echo '{"error":"making the file system failed"}'; exit 1; }
rm -f "$DIR/data.bin"
for rings in $RINGS; do
    if out=$(GPUNVME_EMU_RINGS=$rings timeout 300 "$G" --device "$FS" --json fs get --gpu data.bin 2>"$DIR/err"); then
        python3 - "$rings" "$out" <<'EOF' | tee -a "$RESULTS"
import json, sys
rings, j = sys.argv[1], json.loads(sys.argv[2])
ok = j["gpu_crc32c"] == j["host_crc32c"]
print(json.dumps({"run": "fs-get-gpu", "rings": rings, "bytes": j["bytes"],
                  "gb_per_s": round(j["bytes_per_sec"] / 1e9, 2), "crc_match": ok,
                  "data_path": j["data_path"], "controller_copies": j.get("controller_copies")}))
sys.exit(0 if ok else 1)
EOF
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    else
        python3 -c 'import json,sys; print(json.dumps({"run":"fs-get-gpu","rings":sys.argv[1],"error":sys.argv[2][-400:]}))' \
            "$rings" "$(tail -5 "$DIR/err")"
        failed=1
    fi
done
python3 - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
s = {}
for r in rows:
    key = r["run"] + (f"-{r['rings']}" if r.get("rings") else "")
    if r["run"] == "fs-get-gpu":
        s[key] = {"gb_per_s": r["gb_per_s"], "crc_match": r["crc_match"]}
    else:
        s[key] = {"iops": r["iops"], "p50_us": r["lat_p50_us"]}
print(json.dumps({"summary": s}))
EOF
exit $failed
