#!/usr/bin/env bash
# GPU threads against a controller we did not write, ON THE GPU MACHINE: SPDK's NVMe-oF target
# over the vfio-user transport (docs/spdk.md), with binaries and the SPDK bundle built and
# packed on the CPU machine by scripts/gpu-build.sh and carried in .gpu-bin/:
#
#   scripts/spdk-gpu-test.sh [--bin DIR] [--no-sanitizer | --sanitizer-only | --tcp-only]
#                            [--file-mib N] [--secs S]
#
# 1. `perf --gpu --verify` in four patterns on SPDK's 512- and 4096-byte malloc namespaces;
#    the GPU suite's transfer shapes and wrap-around there (plain, racecheck, synccheck);
# 2. `fs get --gpu` of a file of --file-mib MiB (default 1100: over 1 GiB) on the AIO namespace,
#    the GPU's CRC-32C compared with the host's and the recorded one; `fs put --gpu` read back;
#    the GPU file and page cache examples there;
# 3. compute-sanitizer racecheck and synccheck on short verified perf runs (client kernels);
# 4. one JSON line per figure: 4 KiB random reads at QD 1 (one thread) and QD 32 (one queue),
#    GPU queues beside CPU queues and spdk_nvme_perf on the same target (--secs each);
# 5. over NVMe/TCP (the same target's TCP listener; --device nvme-tcp://, the software
#    controller in front serving the GPU queues): `perf --gpu --verify` in four patterns,
#    `fs get --gpu` with the CRCs compared, and 4 KiB random read figures for GPU and CPU
#    queues and spdk_nvme_perf over TCP. --tcp-only runs only this part.
# Prints PASS/FAIL per check and `N passed, M failed`; exits 1 on any failure. Needs root.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin SAN=1 FILE_MIB=1100 SECS=5
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --no-sanitizer) SAN=0; shift ;;
        --sanitizer-only) SAN=2; shift ;;
        --tcp-only) SAN=3; shift ;;
        --file-mib) FILE_MIB=$2; shift 2 ;;
        --secs) SECS=$2; shift 2 ;;
        *) sed -n '2,15p' "$0" >&2; exit 2 ;;
    esac
done
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export PATH=/usr/local/cuda/bin:$PATH
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
G=$(realpath "$BIN/gpunvme")
export GPUNVME_SPDK_DIR=${GPUNVME_SPDK_DIR:-$(realpath "$BIN/spdk")}
SPDK=$GPUNVME_SPDK_DIR
# The target's state (sockets, and the doorbell pages nvmf_tgt keeps in files beside them) on
# tmpfs: CUDA cannot pin a shared mapping of a disk file. The AIO image needs O_DIRECT: on disk.
STATE=$(mktemp -d /dev/shm/gpunvme-spdk-gpu.XXXXXX)
DISK=$(mktemp -d /var/tmp/gpunvme-spdk-gpu.XXXXXX)
# shellcheck source=checks-lib.sh
. scripts/checks-lib.sh
trap 'scripts/spdk-target.sh stop "$STATE" >/dev/null 2>&1; rm -rf "$STATE" "$DISK"' EXIT

TCP_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mapfile -t CTRLS < <(scripts/spdk-target.sh start "$STATE" --malloc-mib 1024 \
    --aio-mib $((FILE_MIB * 2 + 256)) --aio-image "$DISK/aio.img" --tcp "$TCP_PORT")
[ ${#CTRLS[@]} -eq 3 ] || { echo "spdk-gpu-test: the target did not start" >&2; exit 2; }
# compute-sanitizer's summary says nothing was found (racecheck words it as hazards).
san_clean() { grep -Eq 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)' <<<"$1"; }
sock() { for l in "${CTRLS[@]}"; do read -r n s _ <<<"$l"; [ "$n" = "$1" ] && echo "$s"; done; }

perf_json() { # device, args... -> JSON summary on stdout, non-zero unless 0 errors, 0 mismatches
    local out; out=$(timeout 300 "$G" perf --device "$1" --json "${@:2}" 2>"$STATE/err") || {
        tail -3 "$STATE/err" >&2; return 1; }
    python3 -c '
import json, sys
j = json.loads(sys.argv[1])
assert j["errors"] == 0 and j["verify_errors"] == 0, j
print(json.dumps({k: j.get(k) for k in ("rw", "bs", "qd", "queues", "ios", "iops", "bw_bytes", "lat_ns", "verified_bytes", "data_path")}))
' "$(sed -n '/^{/,$p' <<<"$out")"
}

# 1. perf --gpu --verify, four patterns, on both namespaces (512- and 4096-byte blocks), 4 KiB
#    I/O; and 512-byte I/O on the 512-byte namespace.
[ "$SAN" = 2 ] || [ "$SAN" = 3 ] || for run in "malloc512 4k" "malloc4096 4k" "malloc512 512"; do
    read -r name bs <<<"$run"
    dev="vfio-user:$(sock $name)"
    for rw in write read randwrite randread; do
        if r=$(perf_json "$dev" --gpu --verify --force --rw $rw --bs "$bs" --qd 32 --ios 200000); then
            ok "$name perf --gpu --verify $rw --bs $bs: $r"
        else
            bad "$name perf --gpu --verify $rw --bs $bs"
        fi
    done
done

# 1b. The GPU suite's transfer shapes (512/4096) and wrap-around (8 queues of 16 and 32
#     entries, both client styles) on SPDK's controllers (tests/gpu/spdk.rs `spdk::`), plain and
#     under racecheck and synccheck.
for tool in none racecheck synccheck; do
    [ "$SAN" != 3 ] || continue
    if [ "$tool" = none ]; then [ "$SAN" != 2 ] || continue; else [ "$SAN" != 0 ] || continue; fi
    pre=(); [ "$tool" = none ] || pre=(compute-sanitizer --tool "$tool" --error-exitcode 3)
    if out=$(GPUNVME_TEST_SPDK_DIR=$STATE timeout 300 "${pre[@]}" "$BIN/gpu-tests" --include-ignored \
        --test-threads=1 spdk:: 2>&1) && grep -q '^test result: ok. 2 passed' <<<"$out" &&
        { [ "$tool" = none ] || san_clean "$out"; }; then
        ok "GPU suite spdk:: (transfer shapes, wrap-around) sanitizer=$tool"
    else
        bad "GPU suite spdk:: sanitizer=$tool: $(grep -E 'panicked|FAILED|test result|SUMMARY' <<<"$out" | head -5)"
    fi
done

# 2. files over vfio-user: fs get --gpu of more than 1 GiB, CRCs compared; fs put --gpu read back.
if [ "$SAN" = 0 ] || [ "$SAN" = 1 ]; then
    dev="vfio-user:$(sock aio)"
    head -c $((FILE_MIB << 20)) /dev/urandom > "$STATE/in.bin"
    if "$G" fs mkfs --force --device "$dev" >/dev/null && "$G" fs put "$STATE/in.bin" in.bin --device "$dev" >/dev/null &&
        out=$(timeout 600 "$G" fs get in.bin --gpu --device "$dev" 2>&1) &&
        line=$(grep -m1 '^crc32c: GPU' <<<"$out") && crcs_agree "$line"; then
        ok "fs get --gpu of $FILE_MIB MiB over vfio-user: $line; $(grep -m1 'GB/s' <<<"$out")"
    else
        bad "fs get --gpu: $(tail -4 <<<"${out:-}")"
    fi
    if out=$(timeout 600 "$G" fs put "$STATE/in.bin" out.bin --gpu --device "$dev" 2>&1) &&
        "$G" fs get out.bin "$STATE/out.bin" --device "$dev" >/dev/null && cmp -s "$STATE/in.bin" "$STATE/out.bin"; then
        ok "fs put --gpu of $FILE_MIB MiB, read back through CPU queues: $(grep -m1 'GB/s' <<<"$out")"
    else
        bad "fs put --gpu: $(tail -4 <<<"${out:-}")"
    fi
    rm -f "$STATE/in.bin" "$STATE/out.bin"
    # The GPU file and page cache examples on the same controller (each verifies its data and
    # prints "NAME: OK"), on a fresh file system.
    "$G" fs mkfs --force --device "$dev" >/dev/null || bad "mkfs before the examples"
    for ex in "gpu_read --size 256M" "gpu_random --size 256M --reads 1M" "gpu_write --size 256M" \
        load_safetensors "gpu_bfs --scale 20 --cache 10%,25%" "gpu_embedding --rows 1M --cache 25%"; do
        set -- $ex
        if out=$(timeout 300 "$BIN/$1" --device "$dev" "${@:2}" 2>&1) && grep -q "^$1: OK" <<<"$out"; then
            ok "example $ex over vfio-user"
        else
            bad "example $ex: $(tail -3 <<<"$out")"
        fi
    done
fi

# 3. compute-sanitizer on the client kernels.
if [ "$SAN" = 1 ] || [ "$SAN" = 2 ]; then
    dev="vfio-user:$(sock malloc512)"
    for tool in racecheck synccheck; do
        for rw in randwrite randread; do
            if out=$(timeout 600 compute-sanitizer --tool $tool --error-exitcode 3 "$G" perf --device "$dev" \
                --gpu --verify --force --rw $rw --bs 4k --qd 32 --queues 2 --ios 4000 2>&1) &&
                san_clean "$out"; then
                ok "sanitizer $tool perf --gpu $rw over vfio-user"
            else
                bad "sanitizer $tool perf --gpu $rw: $(grep -m3 -i 'error' <<<"$out")"
            fi
        done
    done
fi

# 4. Figures: GPU queues, CPU queues and SPDK's own client on one target.
if [ "$SAN" = 0 ] || [ "$SAN" = 1 ]; then
    dev="vfio-user:$(sock malloc512)"
    for qd in 1 32; do
        r=$(perf_json "$dev" --gpu --force --rw randread --bs 4k --queues 1 --qd $qd --gpu-threads $qd \
            --runtime ${SECS}s --client thread) && echo "{\"figure\":\"gpu-queues\",\"qd\":$qd,\"run\":$r}"
        r=$(perf_json "$dev" --force --rw randread --bs 4k --queues 1 --qd $qd --runtime ${SECS}s) &&
            echo "{\"figure\":\"cpu-queues\",\"qd\":$qd,\"run\":$r}"
    done
    if [ "$(cat /proc/sys/vm/nr_hugepages)" -lt 512 ]; then echo 512 > /proc/sys/vm/nr_hugepages; fi
    mountpoint -q /dev/hugepages || { mkdir -p /dev/hugepages && mount -t hugetlbfs nodev /dev/hugepages; }
    for qd in 1 32; do
        out=$(LD_LIBRARY_PATH="$SPDK/lib" timeout 60 "$SPDK/bin/spdk_nvme_perf" -c 0x2 -q $qd -o 4096 \
            -w randread -t "$SECS" -r "trtype:VFIOUSER traddr:$(dirname "$(sock malloc512)") subnqn:nqn.2019-07.io.spdk:gpunvme-malloc512" 2>&1)
        line=$(grep -m1 'from core' <<<"$out")
        echo "{\"figure\":\"spdk_nvme_perf\",\"qd\":$qd,\"line\":\"$(tr -s ' ' <<<"$line")\"}"
    done
fi

# 5. NVMe/TCP: GPU queues in pinned host memory, served by the software controller in front of
#    the TCP listener (docs/nvme-tcp.md).
if [ "$SAN" != 2 ]; then
    tcp() { echo "nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-$1"; }
    for name in malloc512 malloc4096; do
        for rw in write read randwrite randread; do
            if r=$(perf_json "$(tcp $name)" --gpu --verify --force --rw $rw --bs 4k --qd 32 --ios 50000); then
                ok "$name perf --gpu --verify $rw over nvme-tcp: $r"
            else
                bad "$name perf --gpu --verify $rw over nvme-tcp"
            fi
        done
    done
    dev=$(tcp aio) mib=$((FILE_MIB < 256 ? FILE_MIB : 256))
    head -c $((mib << 20)) /dev/urandom > "$STATE/in.bin"
    if "$G" fs mkfs --force --device "$dev" >/dev/null && "$G" fs put "$STATE/in.bin" in.bin --device "$dev" >/dev/null &&
        out=$(timeout 600 "$G" fs get in.bin --gpu --device "$dev" 2>&1) &&
        line=$(grep -m1 '^crc32c: GPU' <<<"$out") && crcs_agree "$line"; then
        ok "fs get --gpu of $mib MiB over nvme-tcp: $line; $(grep -m1 'GB/s' <<<"$out")"
    else
        bad "fs get --gpu over nvme-tcp: $(tail -4 <<<"${out:-}")"
    fi
    rm -f "$STATE/in.bin"
    dev=$(tcp malloc4096)
    for qd in 1 32; do
        r=$(perf_json "$dev" --gpu --force --rw randread --bs 4k --queues 1 --qd $qd --gpu-threads $qd \
            --runtime ${SECS}s --client thread) && echo "{\"figure\":\"gpu-queues-tcp\",\"qd\":$qd,\"run\":$r}"
        r=$(perf_json "$dev" --force --rw randread --bs 4k --queues 1 --qd $qd --runtime ${SECS}s) &&
            echo "{\"figure\":\"cpu-queues-tcp\",\"qd\":$qd,\"run\":$r}"
        out=$(LD_LIBRARY_PATH="$SPDK/lib" timeout 60 "$SPDK/bin/spdk_nvme_perf" -c 0x2 -q $qd -o 4096 \
            -w randread -t "$SECS" --no-huge -s 1024 \
            -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$TCP_PORT subnqn:nqn.2019-07.io.spdk:gpunvme-malloc4096" 2>&1)
        echo "{\"figure\":\"spdk_nvme_perf-tcp\",\"qd\":$qd,\"line\":\"$(grep -m1 '^Total' <<<"$out" | tr -s ' ')\"}"
    done
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
