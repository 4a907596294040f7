#!/usr/bin/env bash
# The driver's instructions per command (issue 12): runs nvme's `driver_cost` example under
# callgrind, collecting only inside its measured loop, and prints one JSON line:
#   {"ios":..,"qd":..,"bs":..,"flags":..,"instructions":..,"per_command":..,"null_device_per_command":..,
#    "driver_per_command":..}
# `null_device_per_command` is the inline null device's own share (everything under its
# register-write handler); `driver_per_command` is the rest (driver + the example's loop).
#
# Usage: scripts/driver-cost.sh [IOS] [QD] [BS] [FLAGS]   (defaults 100000 32 4k; FLAGS: one
# string of driver_cost's own, e.g. "--owned --vec")
# Needs valgrind (apt-get install valgrind). BIN=path skips the build (to measure another build).
set -euo pipefail
IOS=${1:-100000}
QD=${2:-32}
BS=${3:-4k}
EXTRA=${4:-}
cd "$(dirname "$0")/.."
if [[ -z "${BIN:-}" ]]; then
    cargo build --release -q -p nvme --example driver_cost
    BIN=target/release/examples/driver_cost
fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
valgrind --tool=callgrind --toggle-collect='*run_ios*' --callgrind-out-file="$OUT/cg.out" \
    "$BIN" --ios "$IOS" --qd "$QD" --bs "$BS" $EXTRA >"$OUT/stdout" 2>"$OUT/stderr"
total=$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$OUT/stderr")
# The null device's share: the inclusive cost of its register-write handler. callgrind_annotate
# lists a function once per source file its inlined code came from, plus one line with the whole
# function's inclusive cost (the largest); take that one.
null=$(callgrind_annotate --inclusive=yes "$OUT/cg.out" 2>/dev/null |
    awk '/^ *[0-9,]+ .*NullRegisters as nvme::device::RegisterIo>::write_u32/ {
        gsub(",", "", $1); if ($1 + 0 > max) max = $1 + 0 } END { print max + 0 }')
null=${null:-0}
awk -v ios="$IOS" -v qd="$QD" -v bs="$BS" -v flags="$EXTRA" -v total="$total" -v null="$null" 'BEGIN {
    printf "{\"ios\":%d,\"qd\":%d,\"bs\":\"%s\",\"flags\":\"%s\",\"instructions\":%d,\"per_command\":%.1f,", ios, qd, bs, flags, total, total / ios
    printf "\"null_device_per_command\":%.1f,\"driver_per_command\":%.1f}\n", null / ios, (total - null) / ios
}'
