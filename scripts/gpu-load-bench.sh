#!/usr/bin/env bash
# The comparison users ask for (issue 10, P5): a file loaded into GPU memory by
#   (i)   gpunvme, GPU-issued reads on the host-side software controller (`fs get --gpu`),
#   (ii)  gpunvme on the GPU-resident controller model with host media (the image's page-cache
#         pages read over PCIe by the controller kernel: `--controller gpu --media host`),
#   (iii) pread into a pageable buffer + cudaMemcpy,
#   (iv)  pread into two pinned buffers + cudaMemcpyAsync (double buffering),
#   (v)   cuFile cuFileRead (compatibility mode where nvidia-fs is absent),
# warm (file in the page cache) and cold (evicted first), each verified, in one run on the GPU
# machine. The baselines read a plain copy of the bytes gpunvme's image holds, in the same
# folder (the same kind of storage). Prints a JSON line per run as it goes (stderr) and one
# JSON table with the ratios at the end (stdout).
#
#   scripts/gpu-load-bench.sh                       1 GiB and 4 GiB in /tmp/gpunvme-load
#   SIZES="1G" DIR=/dev/shm/load scripts/gpu-load-bench.sh
#
# Environment: G (gpunvme binary; default .gpu-bin/gpunvme or target/release/gpunvme), DIR
# (work folder; on the lent VM /tmp is ext4 on a virtio disk, /dev/shm is tmpfs where cuFile
# fails and "cold" means nothing), SIZES, NVCC (default nvcc), LIMIT (seconds per run, 300).
# cuFile needs udev data for the block device under DIR (no udev runs on the lent VM): as root
# this script writes /run/udev/data/b<major>:<minor> when it is missing (and says so).
set -uo pipefail
cd "$(dirname "$0")/.."
G=${G:-$( [ -x .gpu-bin/gpunvme ] && echo .gpu-bin/gpunvme || echo target/release/gpunvme )}
G=$(realpath "$G")
DIR=${DIR:-/tmp/gpunvme-load}
SIZES=${SIZES:-"1G 4G"}
NVCC=${NVCC:-nvcc}
LIMIT=${LIMIT:-300}
mkdir -p "$DIR"
ROWS=$DIR/rows.jsonl
: > "$ROWS"
say() { echo "gpu-load-bench: $*" >&2; }

# The baselines' program, with cuFile when its header and library are there.
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC")")")}
CUFILE_FLAGS=()
for inc in "$CUDA_HOME/include" /usr/local/cuda/include /usr/include; do
    if [ -f "$inc/cufile.h" ]; then
        for lib in "$CUDA_HOME/lib64" /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
            if ls "$lib"/libcufile.so* >/dev/null 2>&1; then
                CUFILE_FLAGS=(-DHAVE_CUFILE -I"$inc" -L"$lib" -lcufile)
                break 2
            fi
        done
    fi
done
[ ${#CUFILE_FLAGS[@]} = 0 ] && say "cuFile not found: its rows will say so"
if ! "$NVCC" -O2 -std=c++17 -arch=native benches/gpu-load/baselines.cu "${CUFILE_FLAGS[@]}" \
    -o "$DIR/baselines" 2>"$DIR/nvcc.log"; then
    say "building the baselines failed:"; cat "$DIR/nvcc.log" >&2; exit 1
fi

# cuFile's udev lookup (../shared/design/gpu.md): data for the block device holding DIR.
src=$(findmnt -no SOURCE -T "$DIR" 2>/dev/null || true)
fstype=$(findmnt -no FSTYPE -T "$DIR" 2>/dev/null || true)
if [ -b "$src" ] && [ "$(id -u)" = 0 ]; then
    mm=$(printf '%d:%d' "0x$(stat -c %t "$src")" "0x$(stat -c %T "$src")")
    if [ ! -e "/run/udev/data/b$mm" ]; then
        mkdir -p /run/udev/data
        printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$fstype" > "/run/udev/data/b$mm"
        say "wrote /run/udev/data/b$mm for cuFile ($src, $fstype)"
    fi
fi

evict() {  # evict FILE...: out of the page cache (no effect on tmpfs)
    python3 - "$@" <<'EOF'
import os, sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
EOF
}
warm() { cat "$@" > /dev/null; }

row() {  # row SIZE CACHE METHOD JSON_OR_TEXT RC: one normalised JSON row
    SIZE=$1 CACHE=$2 METHOD=$3 RC=$5 python3 -c '
import json, os, sys
text = sys.stdin.read()
row = {"size": os.environ["SIZE"], "cache": os.environ["CACHE"], "method": os.environ["METHOD"]}
try:
    r = json.loads(text.strip().splitlines()[-1])
    if "gbytes_per_s" in r:  # a baseline
        row.update({"gbytes_per_s": r["gbytes_per_s"], "bytes": r["bytes"], "verified": r["verified"]})
        if r.get("error"): row["error"] = r["error"]
    else:  # gpunvme fs get --gpu
        ok = r["gpu_crc32c"] == r["host_crc32c"] and r.get("recorded_crc32c") in (None, r["gpu_crc32c"])
        row.update({"gbytes_per_s": round(r["bytes_per_sec"] / 1e9, 3), "bytes": r["bytes"],
                    "verified": ok, "data_path": r["data_path"],
                    "setup_s": round(r["setup_seconds"], 3),
                    "gbytes_per_s_with_setup": round(r["bytes"] / (r["bytes"] / r["bytes_per_sec"] + r["setup_seconds"]) / 1e9, 3)})
        if row["method"] == "gpunvme-gpu-host" and row["cache"] == "cold":
            row["note"] = ("the model registers the image with CUDA during setup, which faults "
                           "every page in: the cold read is in setup_s; gbytes_per_s_with_setup "
                           "is the cold figure")
    if os.environ["RC"] != "0": row.setdefault("error", "exit status " + os.environ["RC"])
except Exception:
    row["error"] = "exit %s: %s" % (os.environ["RC"], text.strip()[-300:])
    row["verified"] = False
print(json.dumps(row))' <<< "$4" | tee -a "$ROWS" >&2
}

for size in $SIZES; do
    data=$DIR/data-$size.bin img=$DIR/image-$size.img
    bytes=$(numfmt --from=iec "$size")
    say "$size: writing $bytes random bytes and a blockfs image holding them"
    head -c "$bytes" /dev/urandom > "$data" || exit 1
    rm -f "$img"; truncate -s $((bytes + bytes / 4 + (1 << 30))) "$img"
    "$G" --device "$img" --lba-size 4096 fs mkfs >/dev/null || exit 1
    "$G" --device "$img" --lba-size 4096 fs put "$data" model/data.bin >/dev/null || exit 1
    for cache in warm cold; do
        for method in gpunvme-emu gpunvme-gpu-host pageable pinned cufile; do
            case $method in
                gpunvme-*) files=("$img") ;;
                *) files=("$data") ;;
            esac
            if [ $cache = cold ]; then evict "${files[@]}"; else warm "${files[@]}"; fi
            case $method in
                gpunvme-emu) out=$(timeout "$LIMIT" "$G" --device "$img" --lba-size 4096 --json \
                    fs get --gpu model/data.bin 2>&1) ;;
                gpunvme-gpu-host) out=$(timeout "$LIMIT" "$G" --device "$img" --lba-size 4096 \
                    --json fs get --gpu model/data.bin --controller gpu --media host 2>&1) ;;
                *) out=$(timeout "$LIMIT" "$DIR/baselines" --file "$data" --method $method 2>&1) ;;
            esac
            row "$size" $cache $method "$out" $?
        done
    done
    rm -f "$data" "$img"
done

python3 - "$ROWS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def rate(r):  # the model's cold read happens in its setup (see the row's note)
    if r["method"] == "gpunvme-gpu-host" and r["cache"] == "cold":
        return r.get("gbytes_per_s_with_setup", r["gbytes_per_s"])
    return r["gbytes_per_s"]
good = {(r["size"], r["cache"], r["method"]): rate(r)
        for r in rows if r.get("verified") and "error" not in r}
summary = {}
for size in sorted({r["size"] for r in rows}):
    for cache in ("warm", "cold"):
        base = max((good.get((size, cache, m), 0) for m in ("pageable", "pinned")), default=0)
        s = {"best_cpu_baseline_gbytes_per_s": base}
        for m in ("gpunvme-emu", "gpunvme-gpu-host"):
            if base and (size, cache, m) in good:
                s[m + "_over_best_baseline"] = round(good[(size, cache, m)] / base, 2)
            if (size, cache, "cufile") in good and (size, cache, m) in good:
                s[m + "_over_cufile"] = round(good[(size, cache, m)] / good[(size, cache, "cufile")], 2)
        summary[f"{size} {cache}"] = s
print(json.dumps({"table": rows, "summary": summary}, indent=1))
EOF
