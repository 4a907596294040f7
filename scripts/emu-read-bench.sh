#!/usr/bin/env bash
# ON THE GPU MACHINE: how fast the software controller moves a warm file into GPU memory
# (`fs get --gpu`), and where its threads' time goes, per image location and per controller
# setting (issue 22: the loader's reads). Uses the CLI scripts/gpu-build.sh packed into
# .gpu-bin. One JSON object per run on stdout; a summary object last.
#
#   scripts/emu-read-bench.sh [--bin DIR] [--gib N] [--dirs "/tmp /dev/shm"] [--reps N]
#                             [--threads N] [--pairs N] [--cases "default ordered"]
#
# --pairs: the I/O queue pairs the controller grants (64, as the Python package asks; the
# CLI's default of 8 leaves 7 for the GPU). Cases: `default`; `ordered` (GPUNVME_EMU_FETCH=ordered: every read of GPU memory waits for
# the controller's earlier writes, as before reads of unwritten memory got a stream of their
# own); `threads8` (8 controller threads); `host-rings` (GPUNVME_EMU_RINGS=host); `depthN`
# (`--gpu-depth N`: N entries per GPU ring instead of the default 256).
# Every get is checked: the GPU's CRC-32C of the bytes equals the host's.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin GIB=4 DIRS="/tmp /dev/shm" REPS=2 THREADS=16 PAIRS=64 CASES="default ordered"
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --gib) GIB=$2; shift 2 ;;
        --dirs) DIRS=$2; shift 2 ;;
        --reps) REPS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --pairs) PAIRS=$2; shift 2 ;;
        --cases) CASES=$2; shift 2 ;;
        *) sed -n '2,15p' "$0" >&2; exit 2 ;;
    esac
done
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
G=$(realpath "$BIN/gpunvme")
DATA=$(mktemp /dev/shm/gpunvme-read-data.XXXXXX)
IMGS=()
trap 'rm -f "$DATA" "${IMGS[@]}"' EXIT
head -c $((GIB << 30)) /dev/urandom >"$DATA"
failed=0
for dir in $DIRS; do
    img=$(mktemp "$dir/gpunvme-read.XXXXXX.img")
    IMGS+=("$img")
    truncate -s $(((GIB + 1) << 30)) "$img"
    if ! "$G" --device "$img" --lba-size 4096 fs mkfs >/dev/null; then
        echo "{\"error\": \"mkfs on $img failed\"}"; failed=1; continue
    fi
    "$G" --device "$img" --lba-size 4096 fs put "$DATA" big >/dev/null || { echo "{\"error\": \"put failed\"}"; failed=1; continue; }
    # Warm: the file's pages in the page cache.
    cat "$img" >/dev/null
    for case in $CASES; do
        envs=() threads=$THREADS extra=()
        case "$case" in
            depth[0-9]*) extra=(--gpu-depth "${case#depth}") ;;
            default) ;;
            ordered) envs=(GPUNVME_EMU_FETCH=ordered) ;;
            threads8) threads=8 ;;
            host-rings) envs=(GPUNVME_EMU_RINGS=host) ;;
            *) echo "{\"error\": \"unknown case $case\"}"; exit 2 ;;
        esac
        for r in $(seq 1 "$REPS"); do
            out=$(env "${envs[@]}" timeout 300 "$G" --device "$img" --lba-size 4096 --controller-threads "$threads" \
                --controller-queue-pairs "$PAIRS" \
                --json fs get --gpu "${extra[@]}" big 2>/dev/null)
            rc=$?
            CASE=$case DIR=$dir RUN=$r RC=$rc python3 -c '
import json, os, sys
try:
    d = json.loads(sys.stdin.read())
except Exception:
    d = {}
e = os.environ
if "bytes" not in d:
    print(json.dumps({"dir": e["DIR"], "case": e["CASE"], "run": int(e["RUN"]), "ok": False, "rc": int(e["RC"])}))
    sys.exit(1)
ok = e["RC"] == "0" and d["gpu_crc32c"] == d["host_crc32c"]
print(json.dumps({"dir": e["DIR"], "case": e["CASE"], "run": int(e["RUN"]), "ok": ok,
    "bytes": d["bytes"], "gb_per_s": round(d["bytes_per_sec"] / 1e9, 2),
    "setup_seconds": round(d.get("setup_seconds", 0), 3),
    "controller": d.get("controller_copies")}))
sys.exit(0 if ok else 1)' <<<"$out" || failed=1
        done
    done
    rm -f "$img"
done
exit $failed
