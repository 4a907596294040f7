#!/usr/bin/env bash
# Files on a striped volume read by GPU threads (issue 23), ON THE GPU MACHINE with binaries
# carried in .gpu-bin/ (scripts/gpu-build.sh):
#
#   scripts/volume-gpu-test.sh [--bin DIR] [--counts "2 4"] [--mib M] [--reps R]
#                              [--threads T] [--pairs P] [--controllers "emu gpu"]
#
# For each member count N: N images on /dev/shm, `fs mkfs --stripe 1m` over them, a file of M
# MiB + 1234 bytes of random data (an unaligned tail) put through the CPU, then R runs of
# `fs get --gpu` (every member's batch in flight at once, each on that member's GPU queues; T
# controller threads and P queue pairs per controller), each ending with the GPU's CRC-32C
# equal to the host's and to the one recorded; then two `fs put --gpu --force` of the same
# data (written on every member's queues, read back and checked by the CPU) and a CPU `fs get`
# of the result compared with the source. Each of that for every kind of controller: `emu`, the
# software controllers; `gpu`, a GPU-resident model per member (hbm media, each on SMs of its
# own). One JSON line per run, then {"summary": ...} (keys kind-N); exits 1 if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin COUNTS="2 4" MIB=2048 REPS=5 THREADS=4 PAIRS=16 KINDS="emu gpu"
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --counts) COUNTS=$2; shift 2 ;;
        --mib) MIB=$2; shift 2 ;;
        --reps) REPS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --pairs) PAIRS=$2; shift 2 ;;
        --controllers) KINDS=$2; shift 2 ;;
        *) sed -n '2,16p' "$0" >&2; exit 2 ;;
    esac
done
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
G=$(realpath "$BIN/gpunvme")
DIR=$(mktemp -d /dev/shm/gpunvme-volume.XXXXXX)
trap 'rm -rf "$DIR"' EXIT
head -c $((MIB * 1048576 + 1234)) /dev/urandom >"$DIR/data"
failed=0 runs=0
SUMMARY=()
for n in $COUNTS; do
    rm -f "$DIR"/m*.img
    # Each member holds 1/N of three copies (d/x, d/y, and the temporary file a forced put
    # writes before it replaces d/y), plus room for the file system's own blocks.
    per=$(( 3 * MIB / n + 256 ))
    for i in $(seq 1 "$n"); do truncate -s "${per}M" "$DIR/m$i.img"; done
    devs=$(seq 1 "$n" | sed "s|^|$DIR/m|; s|$|.img|" | paste -sd,)
    if ! "$G" --device "$devs" fs mkfs --stripe 1m >/dev/null 2>"$DIR/err" ||
        ! "$G" --device "$devs" fs put "$DIR/data" d/x >/dev/null 2>>"$DIR/err"; then
        echo "{\"error\": \"members=$n: mkfs or put failed: $(tr -d '"\n' <"$DIR/err" | head -c 300)\"}"
        failed=$((failed + 1))
        continue
    fi
    for ctl in $KINDS; do
    case "$ctl" in
        emu) CTL_ARGS=() ;;
        gpu) CTL_ARGS=(--controller gpu --media hbm) ;;
        *) echo "{\"error\": \"unknown controller kind $ctl (emu or gpu)\"}"; exit 2 ;;
    esac
    export CTL=$ctl
    speeds=()
    for r in $(seq 1 "$REPS"); do
        runs=$((runs + 1))
        out=$(timeout 300 "$G" --device "$devs" --controller-threads "$THREADS" \
            --controller-queue-pairs "$PAIRS" --json fs get --gpu "${CTL_ARGS[@]}" d/x 2>"$DIR/err")
        rc=$?
        line=$(python3 -c '
import json, os, sys
n, r, rc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
err = open(sys.argv[4]).read().strip().replace("\n", " ")[-400:]
try:
    d = json.loads(sys.stdin.read())
except Exception:
    d = {}
if "bytes" not in d:
    print(json.dumps({"controller": os.environ["CTL"], "members": n, "run": r, "ok": False, "rc": rc, "error": err})); sys.exit(1)
rec = d.get("recorded_crc32c")
ok = (rc == 0 and d["gpu_crc32c"] == d["host_crc32c"] and rec in (None, d["host_crc32c"])
      and d.get("members") == n)
print(json.dumps({"controller": os.environ["CTL"], "members": n, "run": r, "ok": ok, "bytes": d["bytes"],
    "gb_per_s": round(d["bytes_per_sec"] / 1e9, 2), "gpu_crc32c": d["gpu_crc32c"],
    "host_crc32c": d["host_crc32c"], "recorded": rec}))
sys.exit(0 if ok else 1)' "$n" "$r" "$rc" "$DIR/err" <<<"$out")
        ok=$?
        echo "$line"
        if [ $ok -ne 0 ]; then
            failed=$((failed + 1))
        else
            speeds+=("$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["gb_per_s"])' "$line")")
        fi
    done
    puts=()
    for r in 1 2; do
        runs=$((runs + 1))
        out=$(timeout 300 "$G" --device "$devs" --controller-threads "$THREADS" \
            --controller-queue-pairs "$PAIRS" --json fs put --gpu "${CTL_ARGS[@]}" --force "$DIR/data" d/y \
            2>"$DIR/err")
        rc=$?
        rm -f "$DIR/back"
        "$G" --device "$devs" fs get d/y "$DIR/back" >/dev/null 2>>"$DIR/err" &&
            cmp -s "$DIR/data" "$DIR/back"
        same=$?
        line=$(python3 -c '
import json, os, sys
n, r, rc, same = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) == 0
err = open(sys.argv[5]).read().strip().replace("\n", " ")[-400:]
try:
    d = json.loads(sys.stdin.read())
except Exception:
    d = {}
if "bytes" not in d:
    print(json.dumps({"controller": os.environ["CTL"], "members": n, "put": r, "ok": False, "rc": rc, "error": err})); sys.exit(1)
ok = rc == 0 and d["verified"] and d["gpu_crc32c"] == d["host_crc32c"] and same
print(json.dumps({"controller": os.environ["CTL"], "members": n, "put": r, "ok": ok, "bytes": d["bytes"],
    "gb_per_s": round(d["bytes_per_sec"] / 1e9, 2), "crc32c": d["gpu_crc32c"],
    "cpu_get_matches": same}))
sys.exit(0 if ok else 1)' "$n" "$r" "$rc" "$same" "$DIR/err" <<<"$out")
        ok=$?
        echo "$line"
        if [ $ok -ne 0 ]; then
            failed=$((failed + 1))
        else
            puts+=("$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["gb_per_s"])' "$line")")
        fi
    done
    SUMMARY+=("\"$ctl-$n\": {\"passed\": ${#speeds[@]}, \"of\": $REPS, \"gb_per_s\": [$(IFS=,; echo "${speeds[*]}")], \"puts_passed\": ${#puts[@]}, \"put_gb_per_s\": [$(IFS=,; echo "${puts[*]}")]}")
    done
done
echo "{\"summary\": {$(IFS=,; echo "${SUMMARY[*]}")}, \"failed\": $failed, \"runs\": $runs}"
[ $failed -eq 0 ]
