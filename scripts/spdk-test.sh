#!/usr/bin/env bash
#
# spdk-test.sh: the CPU stack against a third-party NVMe controller, SPDK's NVMe-oF target
# (v24.01, vfio-user transport; scripts/spdk-target.sh), reached through gpunvme's vfio-user
# client (`--device vfio-user:SOCKET`). For each of SPDK's three controllers (malloc bdevs of
# 512- and 4096-byte blocks, an AIO bdev over a file): identify compared field by field with
# SPDK's own client (spdk_nvme_identify), perf --verify in four patterns (4 KiB at QD 32; 512 B
# on the 512-byte namespace; 1 MiB at QD 16, which the driver splits at SPDK's 128 KiB MDTS),
# protocol-check (the GPU header's queue protocol from CPU threads), blockfs mkfs/put/get/fsck
# with the bytes compared; perf on two of the controllers at once; `gpunvme serve` in front of
# two of them (four client processes at once, 20 clients killed mid-I/O beside an honest one,
# everything reclaimed). Then: the target killed in the middle of a perf run (a typed error
# within seconds, no hang), and a missing socket, a plain file and a socket nobody serves
# refused by name.
#
# With --host-gpu, also GPU queues on SPDK's controller (the vfio-user transport) with the
# CUDA sources running on CPU threads (the `host-gpu` build; no GPU): `perf --gpu --verify` in
# four patterns on the 512- and the 4096-byte namespace, `fs get --gpu` (CRCs compared) and
# `fs put --gpu` (read back through CPU queues) of a 100 MB file on the AIO controller, and the
# GPU suite's transfer shapes and wrap-around on SPDK (tests/gpu/spdk.rs `spdk::`).
#
# Usage: scripts/spdk-test.sh [--no-build] [--keep DIR] [--host-gpu]
#   --no-build  use target/release/gpunvme, target/release/examples/tcp_* (and
#               target/debug/gpunvme for --host-gpu) as they are
#   --keep DIR  state directory to use and keep (default: a temporary one, removed)
#   --host-gpu  the GPU checks above (builds `cargo build -p gpunvme-cli --features host-gpu`, the
#               debug profile scripts/host-gpu-test.sh also uses; needs g++)
#
# Needs root (nvmf_tgt; hugepages for spdk_nvme_identify, which are restored afterwards) and the
# SPDK bundle (see scripts/spdk-target.sh). Prints PASS/FAIL per check, then `N passed, M
# failed` and one JSON line with the suite's timing; exits 1 on any failure, 2 on a harness
# error.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

build=yes keep="" host_gpu=no
while [ $# -gt 0 ]; do
    case "$1" in
        --no-build) build=no; shift ;;
        --keep) keep=$2; shift 2 ;;
        --host-gpu) host_gpu=yes; shift ;;
        *) sed -n '3,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done

SPDK=${GPUNVME_SPDK_DIR:-$ROOT/../shared/tools/spdk}
[ -x "$SPDK/bin/spdk_nvme_identify" ] || { echo "spdk-test: no SPDK bundle at $SPDK" >&2; exit 2; }
if [ "$build" = yes ]; then
    cargo build --release -q -p gpunvme-cli && cargo build --release -q -p nvmf --examples
fi
G=$ROOT/target/release/gpunvme
TCP_RW=$ROOT/target/release/examples/tcp_rw TCP_IO=$ROOT/target/release/examples/tcp_io
TCP_DISCOVER=$ROOT/target/release/examples/tcp_discover
[ -x "$G" ] || { echo "spdk-test: $G missing (build it, or drop --no-build)" >&2; exit 2; }
HG=$ROOT/target/debug/gpunvme
if [ "$host_gpu" = yes ]; then
    if [ "$build" = yes ]; then cargo build -q -p gpunvme-cli --features host-gpu; fi
    "$HG" perf --help | grep -q -- '--gpu' || { echo "spdk-test: $HG is not a host-gpu build" >&2; exit 2; }
fi

STATE=${keep:-$(mktemp -d /tmp/gpunvme-spdk-test.XXXXXX)}
mkdir -p "$STATE"
WORK=$STATE/work
mkdir -p "$WORK"
t_start=$(date +%s.%N)
# shellcheck source=checks-lib.sh
. scripts/checks-lib.sh

hp_before=$(cat /proc/sys/vm/nr_hugepages)
hp_mounted=no
cleanup() {
    # A failure against the target: its own account of the run, before the state goes.
    if [ "$fail" -gt 0 ] && [ -f "$STATE/nvmf_tgt.log" ]; then
        echo "---- the last 40 lines of nvmf_tgt's log ($fail failed) ----"
        tail -40 "$STATE/nvmf_tgt.log"
    fi
    scripts/spdk-target.sh stop "$STATE" >/dev/null 2>&1 || true
    [ -d "$STATE/strict" ] && scripts/spdk-target.sh stop "$STATE/strict" >/dev/null 2>&1 || true
    [ "$hp_mounted" = yes ] && umount /dev/hugepages 2>/dev/null || true
    echo "$hp_before" > /proc/sys/vm/nr_hugepages 2>/dev/null || true
    rm -f /dev/hugepages/spdk_pid* 2>/dev/null || true
    [ -n "$keep" ] || rm -rf "$STATE"
}
trap cleanup EXIT

# --- sockets that are not a running controller: refused by name, quickly ---------------------
refused() { # what, device spec, expected text in the error
    local out rc=0 t0 dt
    t0=$(date +%s)
    out=$(timeout 60 "$G" identify --device "$2" 2>&1) || rc=$?
    dt=$(( $(date +%s) - t0 ))
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q -- "$3" <<<"$out" && [ $dt -lt 30 ]; then
        ok "$1: refused in ${dt}s: $(tail -1 <<<"$out")"
    else
        bad "$1: rc=$rc after ${dt}s, wanted an error with \`$3\`: $out"
    fi
}
refused "missing socket" "vfio-user:$WORK/nope/cntrl" "cannot connect to the vfio-user socket"
: > "$WORK/plain"
refused "plain file as socket" "vfio-user:$WORK/plain" "is not a Unix socket"
python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.close()' "$WORK/stale"
refused "socket nobody serves" "vfio-user:$WORK/stale" "Connection refused"
refused "empty vfio-user spec" "vfio-user:" "give the server's socket"

# --- the target -----------------------------------------------------------------------------
t0=$(date +%s.%N)
# NVMe/TCP beside vfio-user: the same subsystems on a free loopback port.
TCP_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mapfile -t CTRLS < <(scripts/spdk-target.sh start "$STATE" --malloc-mib 128 --aio-mib 256 \
    --tcp "$TCP_PORT")
t_target=$(echo "$(date +%s.%N) - $t0" | bc)
[ ${#CTRLS[@]} -eq 3 ] || { echo "spdk-test: target did not start: ${CTRLS[*]}" >&2; exit 2; }
ok "spdk-target.sh start: ${#CTRLS[@]} controllers in ${t_target}s"

# SPDK's own client needs hugepages (it shares its memory as hugetlbfs files).
if [ "$(cat /proc/sys/vm/nr_hugepages)" -lt 300 ]; then echo 300 > /proc/sys/vm/nr_hugepages; fi
if ! mountpoint -q /dev/hugepages; then
    mkdir -p /dev/hugepages && mount -t hugetlbfs nodev /dev/hugepages && hp_mounted=yes
fi

spdk_field() { # file, label -> value after the colon, trimmed
    grep -m1 "^$2:" "$1" | sed 's/^[^:]*:[[:space:]]*//; s/[[:space:]]*$//'
}
# perf_verified OUTPUT IOS [DATA_PATH_WORD]: the JSON report in perf's OUTPUT (log lines before
# it are skipped) shows IOS I/Os, no errors, no mismatches, bytes verified (and DATA_PATH_WORD
# in its data path); prints a summary, or why not (non-zero status).
perf_verified() {
    python3 -c '
import json, sys
j = json.loads(sys.argv[1])
assert j["errors"] == 0 and j["verify_errors"] == 0, "errors %d, verify errors %d" % (j["errors"], j["verify_errors"])
assert j["ios"] == int(sys.argv[2]), "ios %d" % j["ios"]
assert j["verified_bytes"] > 0, "nothing verified"
assert sys.argv[3] in json.dumps(j.get("data_path", "")), "data path %s" % j.get("data_path")
print("%d IOPS, %.0f MB/s, %d bytes verified" % (j["iops"], j["bw_bytes"] / 1e6, j["verified_bytes"]))
' "$(sed -n '/^{/,$p' <<<"$1")" "$2" "${3:-}" 2>&1
}
json_field() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {"d": d}))' "$1" "$2"; }

# identify_matches NAME BS DEV TRID: `gpunvme identify` on DEV equals spdk_nvme_identify on TRID
# field by field.
identify_matches() {
    local name=$1 bs=$2 dev=$3 trid=$4 tag mism=""
    tag=$name-$(tr -c 'a-z0-9' _ <<<"${dev%%:*}")
    cmp_field() { # label, ours, theirs
        [ "$2" = "$3" ] || mism="$mism $1(ours=$2 spdk=$3)"
    }
    if timeout 60 env LD_LIBRARY_PATH="$SPDK/lib" "$SPDK/bin/spdk_nvme_identify" -g \
        -r "$trid" > "$WORK/$tag.spdk" 2>&1 &&
        timeout 60 "$G" identify --json --device "$dev" > "$WORK/$tag.json" 2> "$WORK/$tag.err"; then
        cmp_field sn "$(json_field "$WORK/$tag.json" 'd["sn"]')" "$(spdk_field "$WORK/$tag.spdk" "Serial Number")"
        cmp_field mn "$(json_field "$WORK/$tag.json" 'd["mn"]')" "$(spdk_field "$WORK/$tag.spdk" "Model Number")"
        cmp_field fr "$(json_field "$WORK/$tag.json" 'd["fr"]')" "$(spdk_field "$WORK/$tag.spdk" "Firmware Version")"
        cmp_field vid "$(json_field "$WORK/$tag.json" '"%x" % d["vid"]')" "$(spdk_field "$WORK/$tag.spdk" "Vendor ID")"
        cmp_field ssvid "$(json_field "$WORK/$tag.json" '"%x" % d["ssvid"]')" "$(spdk_field "$WORK/$tag.spdk" "Subsystem Vendor ID")"
        cmp_field mdts "$(json_field "$WORK/$tag.json" 'd["mdts_bytes"]')" "$(spdk_field "$WORK/$tag.spdk" "Max Data Transfer Size")"
        cmp_field lba_size "$(json_field "$WORK/$tag.json" 'd["namespaces"][0]["lba_size"]')" \
            "$(grep -m1 'LBA Format #00: Data Size:' "$WORK/$tag.spdk" | awk '{print $6}')"
        cmp_field blocks "$(json_field "$WORK/$tag.json" 'd["namespaces"][0]["blocks"]')" \
            "$(spdk_field "$WORK/$tag.spdk" "Size (in LBAs)" | awk '{print $1}')"
        cmp_field block_size_configured "$(json_field "$WORK/$tag.json" 'd["namespaces"][0]["lba_size"]')" "$bs"
        if [ -z "$mism" ]; then
            ok "$name: identify over ${dev%%:*} = spdk_nvme_identify -r '${trid%% *}' (sn, mn, fr, vid, ssvid, mdts, LBA size $bs, blocks)"
        else
            bad "$name: identify over ${dev%%:*} differs from spdk_nvme_identify:$mism"
        fi
    else
        bad "$name: identify over ${dev%%:*} failed: $(tail -3 "$WORK/$tag.spdk" "$WORK/$tag.err" 2>/dev/null)"
    fi
}

# perf_patterns NAME BS DEV: perf --verify in four patterns at 4 KiB (QD 32), 512 B on a
# 512-byte namespace, 1 MiB (QD 16).
perf_patterns() {
    local name=$1 bs=$2 dev=$3 shapes="4k:20000" size ios qd rw res out
    [ "$bs" = 512 ] && shapes="$shapes 512:20000"
    shapes="$shapes 1m:300"   # (QD 16 below: 8 commands per I/O in 256-entry queues)
    for shape in $shapes; do
        size=${shape%%:*} ios=${shape##*:} qd=32
        [ "$size" = 1m ] && qd=16
        for rw in write read randwrite randread; do
            res=""
            if out=$(timeout 120 "$G" perf --device "$dev" --rw "$rw" --bs "$size" --qd "$qd" --ios "$ios" \
                --verify --json 2>&1) &&
                res=$(perf_verified "$out" "$ios"); then
                ok "$name: perf over ${dev%%:*} --rw $rw --bs $size --qd $qd --verify: $res"
            else
                bad "$name: perf over ${dev%%:*} --rw $rw --bs $size --verify: ${res:-} $(tail -3 <<<"$out")"
            fi
        done
    done
}

for line in "${CTRLS[@]}"; do
    read -r name sock bs <<<"$line"
    dev="vfio-user:$sock"
    nqn="nqn.2019-07.io.spdk:gpunvme-$name"

    identify_matches "$name" "$bs" "$dev" "trtype:VFIOUSER traddr:$(dirname "$sock") subnqn:$nqn"

    perf_patterns "$name" "$bs" "$dev"

    if out=$(timeout 120 "$G" protocol-check --device "$dev" 2>&1) && grep -q '^PASS' <<<"$out"; then
        ok "$name: protocol-check: $(grep -m1 'ios=' <<<"$out" | sed 's/^ *//')"
    else
        bad "$name: protocol-check: $(tail -5 <<<"$out")"
    fi

    if [ "$name" != malloc4096 ]; then
        head -c 23456789 /dev/urandom > "$WORK/in.bin"
        if timeout 60 "$G" fs mkfs --device "$dev" > /dev/null 2>&1 &&
            timeout 60 "$G" fs put "$WORK/in.bin" data/in.bin --device "$dev" > /dev/null 2>&1 &&
            timeout 60 "$G" fs get data/in.bin "$WORK/out.bin" --device "$dev" > /dev/null 2>&1 &&
            cmp -s "$WORK/in.bin" "$WORK/out.bin" &&
            fsck=$(timeout 60 "$G" fs fsck --device "$dev" 2>&1) && grep -q '^clean' <<<"$fsck"; then
            ok "$name: blockfs mkfs, put 23456789 bytes, get (same bytes), fsck clean"
        else
            bad "$name: blockfs round trip failed"
        fi
        rm -f "$WORK/in.bin" "$WORK/out.bin"
    fi
done

# --- GPU queues on SPDK's controller, the CUDA sources on CPU threads (host-gpu) --------------
if [ "$host_gpu" = yes ]; then
    for line in "${CTRLS[@]:0:2}"; do
        read -r name sock bs <<<"$line"
        for rw in write read randwrite randread; do
            res=""
            # 512 emulated GPU threads (the harness's default is 4096): see the suite's step below.
            if out=$(GPUNVME_HOST_GPU_THREADS=512 timeout 300 "$HG" perf --gpu --device "vfio-user:$sock" \
                --rw "$rw" --bs 4k --qd 8 \
                --ios 4000 --verify --force --json 2>&1) &&
                res=$(perf_verified "$out" 4000 vfio-user); then
                ok "$name: host-gpu perf --gpu --rw $rw --bs 4k --verify over vfio-user: $res (CPU threads)"
            else
                bad "$name: host-gpu perf --gpu --rw $rw: ${res:-} $(tail -3 <<<"$out")"
            fi
        done
    done
fi

# --- GPU queues over NVMe/TCP (host-gpu): perf --gpu --verify through the software controller
# in front of SPDK's TCP listener.
if [ "$host_gpu" = yes ]; then
    read -r name _ _ <<<"${CTRLS[0]}"
    tdev="nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-$name"
    for rw in write randread; do
        res=""
        if out=$(GPUNVME_HOST_GPU_THREADS=512 timeout 300 "$HG" perf --gpu --device "$tdev" \
            --rw "$rw" --bs 4k --qd 8 --ios 4000 --verify --force --json 2>&1) &&
            res=$(perf_verified "$out" 4000 software-controller); then
            ok "$name: host-gpu perf --gpu --rw $rw --bs 4k --verify over nvme-tcp: $res (CPU threads)"
        else
            bad "$name: host-gpu perf --gpu --rw $rw over nvme-tcp: ${res:-} $(tail -3 <<<"$out")"
        fi
    done
fi

# --- the GPU suite's transfer shapes and wrap-around on SPDK's controllers (host-gpu) --------
# tests/gpu/spdk.rs `spdk::` (GPUNVME_TEST_SPDK_DIR names this target). 512 emulated GPU threads,
# not the harness's 4096: nvmf_tgt's reactor busy-polls one of this machine's cores, and 4096
# spinning CPU threads on the rest make a 20 000-command batch take minutes.
if [ "$host_gpu" = yes ]; then
    if out=$(GPUNVME_TEST_SPDK_DIR=$STATE GPUNVME_HOST_GPU_THREADS=512 GPUNVME_GPU_TIMEOUT_S=120 \
        timeout 900 cargo test -q -p gpunvme-cli --features host-gpu --test gpu -- --ignored \
        --test-threads=1 spdk:: 2>&1) && grep -q '^test result: ok. 2 passed' <<<"$out"; then
        ok "host-gpu GPU suite on SPDK: every transfer shape (512/4096) and wrap-around, 8 queues (CPU threads)"
    else
        bad "host-gpu GPU suite on SPDK: $(grep -E 'panicked|FAILED|test result' <<<"$out" | head -4)"
    fi
fi

# --- files on the GPU over vfio-user (host-gpu): fs get --gpu with CRCs, fs put --gpu read back --
if [ "$host_gpu" = yes ]; then
    read -r name sock _ <<<"${CTRLS[2]}"
    dev="vfio-user:$sock"
    head -c 100000000 /dev/urandom > "$WORK/in.bin"
    out=""
    # --force: the blockfs round trip above left a file system there.
    if timeout 120 "$G" fs mkfs --force --device "$dev" > /dev/null 2>&1 &&
        timeout 120 "$G" fs put "$WORK/in.bin" in.bin --device "$dev" > /dev/null 2>&1 &&
        out=$(timeout 300 "$HG" fs get in.bin --gpu --device "$dev" 2>&1) &&
        line=$(grep -m1 '^crc32c: GPU' <<<"$out") &&
        crcs_agree "$line"; then
        ok "$name: host-gpu fs get --gpu of 100000000 bytes over vfio-user: $line"
    else
        bad "$name: host-gpu fs get --gpu: $(tail -3 <<<"${out:-(mkfs or put failed)}")"
    fi
    # A file over NVMe/TCP: GPU queues in pinned host memory, served by the software controller
    # in front, forwarded to SPDK's TCP listener. 8 MB and 64 emulated GPU threads: the CPU
    # threads standing in for the GPU, SPDK's reactor and the controller thread that forwards
    # share 2 cores here (100 MB takes about a minute so; on the H200, 1.5 GB/s).
    tdev="nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-$name"
    head -c 8000000 /dev/urandom > "$WORK/small.bin"
    if timeout 120 "$G" fs put "$WORK/small.bin" small.bin --device "$dev" > /dev/null 2>&1 &&
        out=$(GPUNVME_HOST_GPU_THREADS=64 GPUNVME_GPU_TIMEOUT_S=120 timeout 300 "$HG" fs get small.bin \
            --gpu --device "$tdev" 2>&1) &&
        line=$(grep -m1 '^crc32c: GPU' <<<"$out") &&
        crcs_agree "$line"; then
        ok "$name: host-gpu fs get --gpu of 8000000 bytes over nvme-tcp: $line"
    else
        bad "$name: host-gpu fs get --gpu over nvme-tcp: $(tail -3 <<<"${out:-}")"
    fi
    rm -f "$WORK/small.bin"
    if out=$(timeout 300 "$HG" fs put "$WORK/in.bin" out.bin --gpu --device "$dev" 2>&1) &&
        timeout 120 "$G" fs get out.bin "$WORK/out.bin" --device "$dev" > /dev/null 2>&1 &&
        cmp -s "$WORK/in.bin" "$WORK/out.bin"; then
        ok "$name: host-gpu fs put --gpu of 100000000 bytes over vfio-user, read back by CPU queues"
    else
        bad "$name: host-gpu fs put --gpu: $(tail -3 <<<"${out:-}")"
    fi
    rm -f "$WORK/in.bin" "$WORK/out.bin"
fi

# --- several controllers at once (perf --device A,B: the same job on each, with totals) ------
read -r _ sock_a _ <<<"${CTRLS[0]}"
read -r _ sock_b _ <<<"${CTRLS[1]}"
for rw in randwrite randread; do
    if out=$(timeout 120 "$G" perf --device "vfio-user:$sock_a,vfio-user:$sock_b" --rw $rw --bs 4k \
        --qd 32 --ios 20000 --verify --force 2>&1) && grep -q '^total over 2 controllers:.*errors=0' <<<"$out" &&
        ! grep -q '[1-9][0-9]* mismatching' <<<"$out"; then
        ok "perf --rw $rw --verify on malloc512 and malloc4096 at once: $(grep '^total' <<<"$out")"
    else
        bad "perf --rw $rw over two SPDK controllers: $(tail -4 <<<"$out")"
    fi
done

# --- gpunvme serve in front of SPDK's controllers: client processes drive served queues -------
read -r _ s512 _ <<<"${CTRLS[0]}"
read -r _ saio _ <<<"${CTRLS[2]}"
SOCK=$WORK/serve.sock
"$G" --device "m512=vfio-user:$s512,aio=vfio-user:$saio" serve --socket "$SOCK" \
    > "$WORK/serve.out" 2>&1 &
serve_pid=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
served_check() { # NAME ARGS...: a `serve check` client that must pass
    local name=$1; shift
    local out
    if out=$(timeout 120 "$G" serve --socket "$SOCK" check --json "$@" 2>&1) &&
        python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["errors"]==0 and j["mismatched_bytes"]==0 and j["ios"]>0, j' "$out"; then
        echo "$out" > "$WORK/check-$name.json"
        return 0
    fi
    echo "$out" > "$WORK/check-$name.json"
    return 1
}
pids=()
for i in 0 1 2; do
    served_check "m512-$i" --controller m512 --first-lba $((i * 32768)) --lbas 32768 --queues 2 --qd 16 &
    pids+=($!)
done
# (--force: the aio namespace holds the file system of the fs checks above, scratch by now.)
served_check "aio" --controller aio --lbas 16384 --queues 2 --qd 16 --force &
pids+=($!)
rcs=0
for p in "${pids[@]}"; do wait "$p" || rcs=$((rcs + 1)); done
if [ $rcs -eq 0 ]; then
    ok "serve over SPDK: 4 client processes at once (3 on malloc512, 1 on aio), every byte checked"
else
    bad "serve over SPDK: $rcs of 4 clients failed: $(cat "$WORK"/check-*.json | tail -4)"
fi
# Clients killed mid-I/O while another verifies: the daemon lives and gives everything back.
served_check "honest" --controller m512 --first-lba 131072 --lbas 16384 --qd 8 --runtime 6s &
honest=$!
for _ in $(seq 20); do
    # The client itself, not a `timeout` around it, is what gets SIGKILL (its own --runtime
    # bounds it if the kill missed).
    "$G" serve --socket "$SOCK" check --controller m512 --first-lba 196608 \
        --lbas 32768 --queues 2 --qd 16 --runtime 30s > /dev/null 2>&1 &
    victim=$!
    sleep "0.$((RANDOM % 300 + 20))"
    kill -9 $victim 2>/dev/null || true
    wait $victim 2>/dev/null || true
done
if wait $honest; then ok "serve over SPDK: 20 clients killed mid-I/O, the honest one verified"
else bad "serve over SPDK: the honest client failed beside killed ones: $(cat "$WORK/check-honest.json")"; fi
if [ "$host_gpu" = yes ]; then
    # A GPU client of the daemon (its GPU threads on CPU threads here): the pattern written over
    # 8 MiB of malloc512 and read back at random, every byte checked; its doorbells reach SPDK
    # through the daemon's forwarding thread.
    if out=$(GPUNVME_HOST_GPU_THREADS=64 GPUNVME_GPU_TIMEOUT_S=120 timeout 300 "$HG" serve \
            --socket "$SOCK" check --gpu --json --controller m512 --lbas 16384 --queues 2 \
            --depth 64 --qd 8 --ios 2000 2>&1) &&
        python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["write"]["errors"]==0 and j["read"]["errors"]==0 and j["read"]["mismatches"]==0 and j["read"]["ios"]==2000, j' "$out"; then
        ok "serve over SPDK: a GPU client (host-gpu) writes and reads back through served queues"
    else
        bad "serve over SPDK: the GPU client: $(tail -c 600 <<<"$out")"
    fi
fi
# The daemon notices a killed client when its socket closes: look again for a few seconds
# until the last one killed is reclaimed too.
reclaimed_ok() {
    python3 -c '
import json, sys
s = json.loads(sys.argv[1])
for c in s["controllers"]:
    assert c["lent_queue_pairs"] == 0 and c["degraded"] is None and c["forwarded_doorbells"] > 0, c
assert len(s["clients"]) == 1 and s["reclaimed_holding_queues"] >= 10, s
' "$1" 2>/dev/null
}
for _ in $(seq 20); do
    st=$(timeout 20 "$G" serve --socket "$SOCK" status --json 2>&1 || true)
    reclaimed_ok "$st" && break
    sleep 0.5
done
if reclaimed_ok "$st"; then
    ok "serve over SPDK: every killed client reclaimed ($(python3 -c 'import json,sys; s=json.loads(sys.argv[1]); print(s["reclaimed_holding_queues"], "with queues held;", sum(c["forwarded_doorbells"] for c in s["controllers"]), "doorbells forwarded")' "$st"))"
else
    bad "serve over SPDK: after the kills: $st"
fi
kill -TERM $serve_pid 2>/dev/null || true
if wait $serve_pid; then ok "serve over SPDK: the daemon stopped cleanly"
else bad "serve over SPDK: the daemon's exit: $(tail -3 "$WORK/serve.out")"; fi

# --- NVMe/TCP: the nvmf host against the same subsystems over SPDK's TCP listener ------------
# Bring-up (Connect, CC.EN, Identify, Number of Queues), 512 B to 3 MiB written and read back
# without and with digests, bytes written over vfio-user read back over TCP and the reverse.
for entry in "${CTRLS[@]}"; do
    read -r name sock bs <<<"$entry"
    nqn=nqn.2019-07.io.spdk:gpunvme-$name
    for dg in "" "hdgst ddgst"; do
        # shellcheck disable=SC2086
        if out=$(timeout 60 "$TCP_RW" "127.0.0.1:$TCP_PORT" "$nqn" $dg 2>&1) &&
            grep -q '^shut down' <<<"$out"; then
            ok "nvme-tcp $name${dg:+ ($dg)}: $(head -1 <<<"$out" | cut -c1-90); 6 sizes round trip"
        else
            bad "nvme-tcp $name${dg:+ ($dg)}: $(tail -2 <<<"$out")"
        fi
    done
    # 32 MiB and 48 MiB in: past what tcp_rw wrote, inside the smallest (128 MiB) namespace.
    lba=$(((32 << 20) / bs)) lba2=$(((48 << 20) / bs))
    head -c $((1 << 20)) /dev/urandom > "$WORK/tcp-a.bin"
    head -c $((1 << 20)) /dev/urandom > "$WORK/tcp-b.bin"
    if timeout 60 "$G" --device "vfio-user:$sock" --lba-size "$bs" write --lba "$lba" \
            --input "$WORK/tcp-a.bin" --force > /dev/null 2>&1 &&
        timeout 60 "$TCP_IO" "127.0.0.1:$TCP_PORT" "$nqn" read "$lba" $((1 << 20)) \
            "$WORK/tcp-a.back" > /dev/null 2>&1 && cmp -s "$WORK/tcp-a.bin" "$WORK/tcp-a.back" &&
        timeout 60 "$TCP_IO" "127.0.0.1:$TCP_PORT" "$nqn" write "$lba2" "$WORK/tcp-b.bin" \
            > /dev/null 2>&1 &&
        timeout 60 "$G" --device "vfio-user:$sock" --lba-size "$bs" read --lba "$lba2" \
            --bytes 1m --output "$WORK/tcp-b.back" > /dev/null 2>&1 &&
        cmp -s "$WORK/tcp-b.bin" "$WORK/tcp-b.back"; then
        ok "nvme-tcp $name: 1 MiB written over vfio-user read back over TCP, and the reverse"
    else
        bad "nvme-tcp $name: bytes across the two transports differ (or a step failed)"
    fi
done
# Discovery: the TCP NVM subsystems are exactly the three (the vfio-user listeners appear with
# another transport type and no address, and are not among them).
if out=$(timeout 30 "$TCP_DISCOVER" "127.0.0.1:$TCP_PORT" 2>&1) &&
    [ "$(grep '^tcp-subsystem' <<<"$out" | awk '{print $2}' | sort | tr '\n' ' ')" = \
      "nqn.2019-07.io.spdk:gpunvme-aio nqn.2019-07.io.spdk:gpunvme-malloc4096 nqn.2019-07.io.spdk:gpunvme-malloc512 " ]; then
    ok "nvme-tcp discovery: the three TCP subsystems, $(grep -vc '^tcp-subsystem' <<<"$out") other entries"
else
    bad "nvme-tcp discovery: $out"
fi
if out=$(timeout 30 "$TCP_RW" "127.0.0.1:$TCP_PORT" nqn.2019-07.io.spdk:no-such 2>&1); then
    bad "nvme-tcp wrong NQN: accepted: $out"
elif grep -q 'ConnectRefused.*sc: 130' <<<"$out"; then
    ok "nvme-tcp wrong NQN: refused (Connect Invalid Parameters)"
else
    bad "nvme-tcp wrong NQN: $(tail -1 <<<"$out")"
fi

# --- --device nvme-tcp://: everything above the driver over TCP (the software controller in
# front, forwarding to SPDK's subsystems): identify against spdk_nvme_identify over TCP, perf
# --verify in every pattern, files written over one transport read back over the other.
for line in "${CTRLS[@]}"; do
    read -r name sock bs <<<"$line"
    nqn="nqn.2019-07.io.spdk:gpunvme-$name"
    tdev="nvme-tcp://127.0.0.1:$TCP_PORT/$nqn"
    identify_matches "$name" "$bs" "$tdev" \
        "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$TCP_PORT subnqn:$nqn"
    perf_patterns "$name" "$bs" "$tdev"
    [ "$name" = malloc4096 ] && continue
    head -c 23456789 /dev/urandom > "$WORK/in.bin"
    head -c 7654321 /dev/urandom > "$WORK/in2.bin"
    # --force: earlier steps left a file system (or scratch data) there.
    if timeout 60 "$G" fs mkfs --force --device "$tdev" > /dev/null 2>&1 &&
        timeout 60 "$G" fs put "$WORK/in.bin" tcp/in.bin --device "$tdev" > /dev/null 2>&1 &&
        timeout 60 "$G" fs get tcp/in.bin "$WORK/out.bin" --device "vfio-user:$sock" > /dev/null 2>&1 &&
        cmp -s "$WORK/in.bin" "$WORK/out.bin" &&
        timeout 60 "$G" fs put "$WORK/in2.bin" vu/in2.bin --device "vfio-user:$sock" > /dev/null 2>&1 &&
        timeout 60 "$G" fs get vu/in2.bin "$WORK/out2.bin" --device "$tdev" > /dev/null 2>&1 &&
        cmp -s "$WORK/in2.bin" "$WORK/out2.bin" &&
        fsck=$(timeout 60 "$G" fs fsck --device "$tdev" 2>&1) && grep -q '^clean' <<<"$fsck"; then
        ok "$name: blockfs over nvme-tcp: mkfs, put 23456789 bytes, read back over vfio-user; 7654321 put over vfio-user, read back over TCP; fsck clean"
    else
        bad "$name: blockfs across nvme-tcp and vfio-user failed"
    fi
    rm -f "$WORK/in.bin" "$WORK/out.bin" "$WORK/in2.bin" "$WORK/out2.bin"
done
# gpunvme discover: the three TCP subsystems, each with the --device spec that opens it.
if out=$(timeout 30 "$G" discover "nvme-tcp://127.0.0.1:$TCP_PORT" --json 2>&1) &&
    [ "$(python3 -c 'import json,sys; print(" ".join(sorted(e["device"] for e in json.loads(sys.argv[1]) if e["device"])))' "$out")" = \
      "nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-aio nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-malloc4096 nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-malloc512" ]; then
    ok "gpunvme discover: the three TCP subsystems as --device specs"
else
    bad "gpunvme discover: $out"
fi
# Python: gpunvme.open("nvme-tcp://...") (the venv scripts/py-test.sh made, if there is one).
PY=$ROOT/target/py-venv/bin/python
if [ -x "$PY" ] && "$PY" -c 'import gpunvme' 2>/dev/null; then
    tdev="nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-malloc512"
    if out=$(timeout 120 "$PY" - "$tdev" <<'PYEOF' 2>&1
import os, sys, tempfile
import gpunvme
data = os.urandom(5_000_000)
with tempfile.NamedTemporaryFile() as f:
    f.write(data); f.flush()
    with gpunvme.open(sys.argv[1]) as dev:
        assert "nvme-tcp://" in dev.describe(), dev.describe()
        dev.mkfs(force=True)
        dev.put(f.name, "py/data.bin")
        assert dev.read("py/data.bin") == data
        assert dev.read("py/data.bin", 4_000_001, 17) == data[4_000_001:4_000_018]
        dev.fsck()  # raises CorruptError unless clean
try:
    gpunvme.open(sys.argv[1].rsplit("/", 1)[0] + "/nqn.2019-07.io.spdk:no-such")
    raise SystemExit("a wrong NQN opened")
except gpunvme.DeviceError as e:
    print("wrong NQN:", type(e).__name__)
print("ok")
PYEOF
) && [ "$(tail -1 <<<"$out")" = ok ]; then
        ok "python over nvme-tcp: open, mkfs, put 5000000 bytes, read back (whole and a slice), fsck clean; a wrong NQN is $(grep -o 'wrong NQN: .*' <<<"$out" | cut -d' ' -f3)"
    else
        bad "python over nvme-tcp: $(tail -3 <<<"$out")"
    fi
else
    echo "SKIP python over nvme-tcp: no target/py-venv with gpunvme (scripts/py-test.sh makes it)"
fi
# A striped volume of a TCP member and a local image: files across both.
truncate -s 128M "$WORK/member.img"
vol="nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-malloc512,$WORK/member.img"
head -c 30000000 /dev/urandom > "$WORK/in.bin"
if timeout 60 "$G" --device "$vol" fs mkfs --force > /dev/null 2>&1 &&
    timeout 60 "$G" --device "$vol" fs put "$WORK/in.bin" v.bin > /dev/null 2>&1 &&
    timeout 60 "$G" --device "$vol" fs get v.bin "$WORK/out.bin" > /dev/null 2>&1 &&
    cmp -s "$WORK/in.bin" "$WORK/out.bin" &&
    fsck=$(timeout 60 "$G" --device "$vol" fs fsck 2>&1) && grep -q '^clean' <<<"$fsck"; then
    ok "striped volume of an nvme-tcp member and a local image: mkfs, put/get 30000000 bytes, fsck clean"
else
    bad "striped volume of nvme-tcp and an image: $(tail -2 <<<"${fsck:-}")"
fi
rm -f "$WORK/in.bin" "$WORK/out.bin" "$WORK/member.img"
# A subsystem that admits no host (no allow-any-host, no host added): Connect Invalid Host.
closed=nqn.2019-07.io.spdk:gpunvme-closed
if printf '%s\n' "bdev_malloc_create -b closed 16 512" "nvmf_create_subsystem $closed -s SPDKCLOSED" \
    "nvmf_subsystem_add_ns $closed closed" \
    "nvmf_subsystem_add_listener $closed -t tcp -a 127.0.0.1 -s $TCP_PORT -f ipv4" |
    PYTHONPATH=$SPDK/python timeout 60 python3 "$SPDK/bin/rpc.py" -s "$STATE/spdk.sock" > /dev/null 2>&1; then
    refused "nvme-tcp: host not allowed" "nvme-tcp://127.0.0.1:$TCP_PORT/$closed" "Connect Invalid Host"
else
    bad "nvme-tcp: could not make the closed subsystem"
fi
refused "nvme-tcp: no listener" "nvme-tcp://127.0.0.1:1/nqn.2019-07.io.spdk:gpunvme-aio" \
    "cannot connect to the NVMe/TCP target"
refused "nvme-tcp: wrong NQN" "nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:no-such" \
    "Connect of queue 0 refused"
refused "nvme-tcp: the discovery controller as a device" "nvme-tcp://127.0.0.1:$TCP_PORT" \
    "name the subsystem"

# --- a strict second target: no SUCCESS flag, no in-capsule data, 8 KiB I/O units ------------
# (a CapsuleResp for every read, an R2T for every write, large transfers in several PDUs):
# what SPDK's defaults let a careless initiator skip. Its own reactor on the second core, only
# for these checks.
STRICT=$STATE/strict
STRICT_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
if mapfile -t SCTRLS < <(scripts/spdk-target.sh start "$STRICT" --malloc-mib 64 --aio-mib 64 \
    --cpumask 0x2 --tcp "$STRICT_PORT" --tcp-strict) && [ ${#SCTRLS[@]} -eq 3 ]; then
    sdev="nvme-tcp://127.0.0.1:$STRICT_PORT/nqn.2019-07.io.spdk:gpunvme-malloc512"
    for bs in 512 4k 1m; do
        for rw in write randread; do
            res=""
            if out=$(timeout 120 "$G" perf --device "$sdev" --rw "$rw" --bs "$bs" --qd 16 --ios 1000 \
                --verify --json 2>&1) && res=$(perf_verified "$out" 1000); then
                ok "strict TCP target: perf --rw $rw --bs $bs --verify: $res"
            else
                bad "strict TCP target: perf --rw $rw --bs $bs: ${res:-} $(tail -3 <<<"$out")"
            fi
        done
    done
    if out=$(timeout 60 "$TCP_RW" "127.0.0.1:$STRICT_PORT" nqn.2019-07.io.spdk:gpunvme-malloc4096 \
        hdgst ddgst 2>&1); then
        ok "strict TCP target: nvmf round trips with digests: $(head -1 <<<"$out" | cut -c1-90)"
    else
        bad "strict TCP target: nvmf round trips with digests: $(tail -2 <<<"$out")"
    fi
else
    bad "strict TCP target did not start: ${SCTRLS[*]:-}"
fi
scripts/spdk-target.sh stop "$STRICT" > /dev/null 2>&1 || true

# --- the target dies in the middle of a run -------------------------------------------------
read -r _ sock _ <<<"${CTRLS[2]}"
timeout 120 "$G" perf --device "vfio-user:$sock" --rw randread --bs 4k --qd 32 --runtime 60s \
    > "$WORK/killed.out" 2>&1 &
perf_pid=$!
timeout 120 "$G" perf --device "nvme-tcp://127.0.0.1:$TCP_PORT/nqn.2019-07.io.spdk:gpunvme-aio" \
    --rw randread --bs 4k --qd 32 --runtime 60s > "$WORK/killed-tcp.out" 2>&1 &
tcp_perf_pid=$!
sleep 3
t0=$(date +%s.%N)
scripts/spdk-target.sh kill "$STATE" > /dev/null
rc=0
wait $perf_pid || rc=$?
dt=$(echo "$(date +%s.%N) - $t0" | bc)
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'gpunvme: error:.*\(gone\|vfio-user\)' "$WORK/killed.out"; then
    ok "target killed mid-run: perf exited $rc after ${dt}s: $(grep 'gpunvme: error' "$WORK/killed.out")"
else
    bad "target killed mid-run: rc=$rc after ${dt}s: $(tail -3 "$WORK/killed.out")"
fi
rc=0
wait $tcp_perf_pid || rc=$?
dt=$(echo "$(date +%s.%N) - $t0" | bc)
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'gpunvme: error:' "$WORK/killed-tcp.out"; then
    ok "target killed mid-run: perf over nvme-tcp exited $rc after ${dt}s: $(grep -m1 'gpunvme: error' "$WORK/killed-tcp.out" | cut -c1-200)"
else
    bad "target killed mid-run: perf over nvme-tcp: rc=$rc after ${dt}s: $(tail -3 "$WORK/killed-tcp.out")"
fi
refused "socket of a killed target" "vfio-user:$sock" "vfio-user"

t_all=$(echo "$(date +%s.%N) - $t_start" | bc)
echo "$pass passed, $fail failed"
printf '{"suite":"spdk","passed":%d,"failed":%d,"seconds":%.1f,"target_start_seconds":%.2f}\n' \
    "$pass" "$fail" "$t_all" "$t_target"
[ "$fail" -eq 0 ]
