#!/usr/bin/env bash
# perf-matrix.sh: runs `gpunvme perf` over a matrix of patterns, queue depths and queue counts
# and prints one JSON array of the reports (fio's key names), for comparing machines and
# changes. Every run verifies its data; a run with errors fails the script.
#
# Usage: scripts/perf-matrix.sh [--bin PATH] [--device SPEC] [--ios N] [--bs SIZE]
#   --bin     the gpunvme binary (default: target/release/gpunvme, built if missing)
#   --device  as for gpunvme (default: a fresh 1 GiB image in a temporary folder)
#   --ios     I/Os per run (default 200000)
#   --bs      block size (default 4k)
set -euo pipefail
cd "$(dirname "$0")/.."

bin=target/release/gpunvme device="" ios=200000 bs=4k
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin=$2; shift 2 ;;
        --device) device=$2; shift 2 ;;
        --ios) ios=$2; shift 2 ;;
        --bs) bs=$2; shift 2 ;;
        *) echo "perf-matrix.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -x "$bin" ] || cargo build --release -p gpunvme-cli >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -z "$device" ]; then
    device=$tmp/perf.img
    truncate -s 1G "$device"
fi

first=1
echo "["
for rw in read write randread randwrite; do
    for qd in 1 32; do
        for queues in 1 4; do
            [ "$qd" = 1 ] && [ "$queues" != 1 ] && continue
            out=$("$bin" --device "$device" perf --rw "$rw" --bs "$bs" --qd "$qd" \
                --queues "$queues" --ios "$ios" --verify --json)
            [ $first = 1 ] || echo ","
            first=0
            printf '%s' "$out"
        done
    done
done
echo
echo "]"
