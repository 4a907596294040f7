#!/usr/bin/env bash
# blockfs throughput next to raw sequential I/O on the same controller (issue #4, item 8).
#
# Runs `gpunvme perf` sequential write and read over the first SIZE bytes of the namespace, then
# `gpunvme fs mkfs`, `fs put` of a SIZE-byte random file (from /dev/shm), `fs get` of it to
# /dev/null (timed: perf does not write its data anywhere either) and `fs get` to a file
# (timed too, and checked with cmp), and prints one JSON object with the throughputs and ratios. perf runs first: it
# overwrites the start of the namespace, and the file system is made afterwards.
#
# Usage: blockfs/benches/fs_vs_raw.sh [SIZE_MIB] [-- extra gpunvme global args, e.g. --device 0000:01:00.0]
# Each measurement is repeated REPEAT times (default 5), alternating raw and blockfs runs, and
# the medians are compared.
# Environment: GPUNVME (binary, default target/release/gpunvme), BS (perf I/O size, default
# 128k = the software controller's maximum transfer, which is what blockfs issues), QD (default
# 32 per queue, as many as blockfs keeps in flight per lane: its 4 MiB bounce buffer in 128 KiB
# slots), QUEUES (default 4, blockfs's lanes), WORK (scratch
# directory, default under /dev/shm so host-file I/O stays out of the way), CHUNK (bytes per
# file-system call in put and get, default the whole file: the device batch reads the source, or
# writes the destination, as it goes, so one call keeps every queue busy to the end).
set -euo pipefail

SIZE_MIB=${1:-1024}
shift || true
[[ ${1:-} == "--" ]] && shift
BIN=${GPUNVME:-target/release/gpunvme}
BS=${BS:-128k}
QD=${QD:-32}
QUEUES=${QUEUES:-4}
REPEAT=${REPEAT:-5}
chunk=()
[[ -n ${CHUNK:-} ]] && chunk=(--chunk "$CHUNK")
WORK=${WORK:-$(mktemp -d /dev/shm/blockfs-bench.XXXXXX 2>/dev/null || mktemp -d)}
trap 'rm -rf "$WORK"' EXIT

args=("$@")
if [[ ${#args[@]} -eq 0 ]]; then
    # The software controller over a sparse image with room for the file system's metadata.
    truncate -s $(( (SIZE_MIB + 256) << 20 )) "$WORK/bench.img"
    args=(--device "$WORK/bench.img")
fi
g() { "$BIN" "${args[@]}" "$@"; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }

head -c $(( SIZE_MIB << 20 )) /dev/urandom > "$WORK/src.bin"
ios=$(( (SIZE_MIB << 20) / $(numfmt --from=iec "${BS^^}") ))

raw_w=(); raw_r=(); fs_w=(); fs_r=()
for _ in $(seq "$REPEAT"); do
    # perf overwrites the LBAs the file will occupy (the same LBAs keep the comparison fair),
    # so the file system is made again after it (both need --force from the second round on).
    raw_w+=("$(g --json perf --force --rw write --bs "$BS" --qd "$QD" --queues "$QUEUES" --size "${SIZE_MIB}m" --ios "$ios" | field bw_bytes)")
    raw_r+=("$(g --json perf --rw read --bs "$BS" --qd "$QD" --queues "$QUEUES" --size "${SIZE_MIB}m" --ios "$ios" | field bw_bytes)")
    g fs mkfs --force > /dev/null
    put=$(g --json fs put --force "${chunk[@]}" "$WORK/src.bin" bench/file.bin)
    fs_w+=("$(field bytes_per_sec <<< "$put")")
    fs_r+=("$(g --json fs get "${chunk[@]}" bench/file.bin /dev/null | field bytes_per_sec)")
done
get_file=$(g --json fs get bench/file.bin "$WORK/dst.bin")
cmp "$WORK/src.bin" "$WORK/dst.bin"
fs_rf=$(field bytes_per_sec <<< "$get_file")
path=$(field data_path <<< "$put")
python3 - "$SIZE_MIB" "$BS" "$QD" "$QUEUES" "$path" "$fs_rf" "${raw_w[*]}" "${raw_r[*]}" "${fs_w[*]}" "${fs_r[*]}" <<'PY'
import json, statistics, sys
size, bs, qd, queues, path, fs_rf = sys.argv[1:7]
raw_w, raw_r, fs_w, fs_r = ([float(x) for x in a.split()] for a in sys.argv[7:11])
mib = 1 << 20
med = lambda v: statistics.median(v)
r = lambda v: [round(x / mib, 1) for x in v]
print(json.dumps({
    "bytes": int(size) * mib,
    "data_path": path,
    "perf": {"bs": bs, "qd": int(qd), "queues": int(queues)},
    "repeats": len(raw_w),
    "write_mib_s": {"raw_median": round(med(raw_w) / mib, 1), "blockfs_put_median": round(med(fs_w) / mib, 1),
                    "ratio": round(med(fs_w) / med(raw_w), 4), "raw": r(raw_w), "blockfs_put": r(fs_w)},
    "read_mib_s": {"raw_median": round(med(raw_r) / mib, 1), "blockfs_get_median": round(med(fs_r) / mib, 1),
                   "ratio": round(med(fs_r) / med(raw_r), 4), "raw": r(raw_r), "blockfs_get": r(fs_r),
                   "blockfs_get_to_shm_file": round(float(fs_rf) / mib, 1)},
    "byte_identical": True,
}, indent=2))
PY
