#!/usr/bin/env bash
#
# spdk-target.sh: run SPDK's NVMe-oF target (nvmf_tgt, v24.01) with the VFIOUSER transport as a
# third-party NVMe controller that gpunvme connects to over vfio-user sockets.
#
# Usage:
#   scripts/spdk-target.sh start STATE_DIR [--malloc-mib N] [--aio-mib N] [--aio-image PATH]
#                                [--cpumask MASK] [--tcp PORT [--tcp-strict]]
#   scripts/spdk-target.sh stop|kill|status STATE_DIR
#
# start   launches nvmf_tgt (RPC socket STATE_DIR/spdk.sock, log STATE_DIR/nvmf_tgt.log, pid in
#         STATE_DIR/nvmf_tgt.pid), creates one VFIOUSER transport and three controllers (one
#         subsystem + one namespace each) and prints one line per controller, `NAME SOCKET BLOCKSIZE`:
#           malloc512   malloc bdev, 512-byte blocks, serial SPDK512, --malloc-mib MiB (default 256)
#           malloc4096  malloc bdev, 4096-byte blocks, serial SPDK4096, --malloc-mib MiB
#           aio         AIO bdev (O_DIRECT), 4096-byte blocks, serial SPDKAIO, over --aio-image
#                       (default STATE_DIR/aio.img) of --aio-mib MiB (default 512); an image of
#                       that size is kept across starts
#         Subsystems are nqn.2019-07.io.spdk:gpunvme-NAME; sockets are STATE_DIR/NAME/cntrl.
#         nvmf_tgt keeps each controller's doorbell page in a file beside its socket: for GPU
#         threads (which ring it through a CUDA registration of that file's mapping) STATE_DIR
#         must be on tmpfs, e.g. /dev/shm (Linux refuses long-term pins of writable shared
#         mappings of disk files), and then --aio-image on a disk filesystem (O_DIRECT).
#         --cpumask: nvmf_tgt's core mask (default 0x1). Core lock files are off, so targets of
#         other STATE_DIRs may share a core, but two polling reactors on one core answer in ms.
#         --tcp PORT: also a TCP transport, every subsystem listening on 127.0.0.1:PORT as
#         well (NVMe/TCP beside vfio-user: the same namespaces over both).
#         --tcp-strict: that transport without the shortcuts a careless initiator leans on: no
#         SUCCESS flag on C2HData (a CapsuleResp for every read), no in-capsule data (every
#         write waits for an R2T), 8 KiB I/O units (large transfers in several PDUs).
# stop    SIGTERM, then SIGKILL after 10 s; exit 0 also when nothing runs.
# kill    SIGKILL at once (tests of a controller that dies mid-run).
# status  prints "running (pid N)" / "not running"; exit 0 / 1.
# Only a process whose command line is nvmf_tgt with this STATE_DIR's RPC socket is signalled.
#
# nvmf_tgt comes from the prebuilt bundle $GPUNVME_SPDK_DIR (default <repo>/../shared/tools/spdk:
# bin/nvmf_tgt, bin/rpc.py, python/, lib/), else from an SPDK v24.01 build tree $SPDK_SRC
# built by the recipe in ../shared/design/spdk-vfio-user.md (copy in docs/). Needs root.
set -euo pipefail

usage() { sed -n '7,9p' "$0" | sed 's/^#  */usage: /' >&2; exit 2; }
die() { echo "spdk-target: $*" >&2; exit 1; }
[[ $# -ge 2 ]] || usage
CMD=$1 STATE_ARG=$2; shift 2
MALLOC_MIB=256 AIO_MIB=512 CPUMASK=0x1 AIO_IMAGE= TCP_PORT= TCP_STRICT=
while [[ $# -gt 0 ]]; do
  if [[ $CMD == start && $1 == --tcp-strict ]]; then TCP_STRICT=yes; shift; continue; fi
  [[ $CMD == start && $# -ge 2 ]] || usage
  case $1 in
    --malloc-mib) MALLOC_MIB=$2 ;; --aio-mib) AIO_MIB=$2 ;; --cpumask) CPUMASK=$2 ;;
    --aio-image) AIO_IMAGE=$2 ;; --tcp) TCP_PORT=$2 ;; *) usage ;;
  esac
  shift 2
done
[[ $MALLOC_MIB =~ ^[1-9][0-9]*$ && $AIO_MIB =~ ^[1-9][0-9]*$ ]] || usage
[[ -z $TCP_PORT || $TCP_PORT =~ ^[1-9][0-9]*$ ]] || usage
# An nvmf_tgt failing in DPDK's init unlinks /var/tmp/spdk_cpu_lock_000 (even with core locks off),
# which may be another SPDK app's: check the core mask here.
NCPU=$(getconf _NPROCESSORS_ONLN)
[[ $CPUMASK =~ ^0x[0-9a-fA-F]{1,15}$ ]] && ((CPUMASK > 0 && CPUMASK >> NCPU == 0)) ||
  { echo "spdk-target: --cpumask $CPUMASK: want a hex mask of CPUs 0-$((NCPU - 1))" >&2; usage; }

# STATE / SOCK / PIDF / LOG name this STATE_DIR's files by its canonical path.
set_state() { STATE=$1 SOCK=$1/spdk.sock PIDF=$1/nvmf_tgt.pid LOG=$1/nvmf_tgt.log; }
alive() {   # PID exists and is not a zombie
  local s; s=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1) || return 1
  [[ -n $s && $s != Z ]]
}
our_pid() { # prints the pid-file PID if it is a live nvmf_tgt serving this STATE_DIR
  local pid cmd; [[ -f $PIDF ]] || return 1
  pid=$(<"$PIDF"); [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" || return 1
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmd == *nvmf_tgt* && $cmd == *" -r $SOCK "* ]] || return 1
  echo "$pid"
}
wait_gone() { # PID SECONDS: true once PID has exited within SECONDS (a zombie gets 3 s to be reaped)
  local end=$((SECONDS + $2)) z=0
  while [[ -e /proc/$1 ]]; do
    if alive "$1"; then ((SECONDS < end)) || return 1
    else wait "$1" 2>/dev/null || true; ((z++ < 60)) || return 0; fi  # reaps it if our child
    sleep 0.05
  done
}
terminate() { # PID SIGNAL: signal, wait up to 10 s, SIGKILL if still there
  kill -"$2" "$1" 2>/dev/null || true
  wait_gone "$1" 10 || { kill -KILL "$1" 2>/dev/null || true; wait_gone "$1" 5 || die "pid $1 survives SIGKILL"; }
}

if [[ $CMD != start ]]; then
  [[ $CMD == stop || $CMD == kill || $CMD == status ]] || usage
  if [[ -d $STATE_ARG ]]; then set_state "$(cd "$STATE_ARG" && pwd -P)"; else set_state "$STATE_ARG"; fi
  pid=$(our_pid) || pid=
  case $CMD in
    status) [[ -n $pid ]] && { echo "running (pid $pid)"; exit 0; }; echo "not running"; exit 1 ;;
    stop) [[ -z $pid ]] || terminate "$pid" TERM ;;
    kill) [[ -z $pid ]] || terminate "$pid" KILL ;;
  esac
  rm -f "$PIDF"; exit 0
fi

# --- start ---
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BUNDLE=${GPUNVME_SPDK_DIR:-$(dirname "$SCRIPT_DIR")/../shared/tools/spdk}
if [[ -x $BUNDLE/bin/nvmf_tgt ]]; then
  TGT=$BUNDLE/bin/nvmf_tgt RPCPY=$BUNDLE/bin/rpc.py PYP=$BUNDLE/python
  export LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
elif [[ -n ${SPDK_SRC:-} && -x $SPDK_SRC/build/bin/nvmf_tgt ]]; then
  TGT=$SPDK_SRC/build/bin/nvmf_tgt RPCPY=$SPDK_SRC/scripts/rpc.py PYP=$SPDK_SRC/python
else
  die "no $BUNDLE/bin/nvmf_tgt nor \$SPDK_SRC/build/bin/nvmf_tgt: set GPUNVME_SPDK_DIR to the prebuilt" \
      "bundle (default <repo>/../shared/tools/spdk) or SPDK_SRC to an SPDK v24.01 build tree made by the" \
      "recipe in ../shared/design/spdk-vfio-user.md (copy in docs/)"
fi
export PYTHONPATH=$PYP${PYTHONPATH:+:$PYTHONPATH}
[[ $(id -u) == 0 ]] || die "must run as root (vfio-user target, memory locking)"

mkdir -p "$STATE_ARG"; set_state "$(cd "$STATE_ARG" && pwd -P)"
pid=$(our_pid) && die "already running in $STATE (pid $pid); stop it first"
NAMES=(malloc512 malloc4096 aio) BS=(512 4096 4096) SERIALS=(SPDK512 SPDK4096 SPDKAIO)
(( ${#STATE} + 16 < 108 )) || die "STATE_DIR path too long for a unix socket: $STATE"
for n in "${NAMES[@]}"; do mkdir -p "$STATE/$n"; rm -f "$STATE/$n/cntrl"; done
rm -f "$PIDF" "$SOCK"

# AIO backing file, probed for O_DIRECT (SPDK silently falls back to blocking buffered I/O).
IMG=${AIO_IMAGE:-$STATE/aio.img}
[[ -f $IMG && $(stat -c %s "$IMG") == $((AIO_MIB << 20)) ]] ||
  { rm -f "$IMG"; fallocate -l "${AIO_MIB}M" "$IMG" 2>/dev/null || truncate -s "${AIO_MIB}M" "$IMG"; }
dd if="$IMG" of=/dev/null bs=4096 count=1 iflag=direct status=none 2>/dev/null ||
  die "bdev_aio needs O_DIRECT, which the filesystem of $IMG ($(stat -f -c %T "$IMG")) does" \
      "not support; put it on ext4 or xfs (--aio-image; tmpfs only from Linux 6.6)"

# DPDK memory (no hugepages): both malloc bdevs plus 512 MiB of headroom, at least 1 GiB.
MEM=$((2 * MALLOC_MIB + 512)); ((MEM >= 1024)) || MEM=1024
# No trace file in /dev/shm (SIGKILL would leave it behind).
"$TGT" --no-huge -s "$MEM" -m "$CPUMASK" --disable-cpumask-locks --num-trace-entries 0 -r "$SOCK" \
  </dev/null >"$LOG" 2>&1 &
PID=$!; echo "$PID" >"$PIDF"
fail() {
  set +e; trap - INT TERM ERR; echo "spdk-target: $*" >&2
  { echo "errors in $LOG:"; grep -E '\*ERROR\*|^EAL: ' "$LOG" | head -n 6
    echo "last lines of $LOG:"; tail -n 8 "$LOG"; } | sed 's/^/  /' >&2
  terminate "$PID" TERM; wait "$PID" 2>/dev/null || true; rm -f "$PIDF"; exit 1
}
trap 'fail "interrupted"' INT TERM
trap 'fail "unexpected error at line $LINENO"' ERR

T0=$SECONDS
until python3 "$RPCPY" -s "$SOCK" -t 2 spdk_get_version >/dev/null 2>&1; do
  alive "$PID" || fail "nvmf_tgt exited during startup"
  ((SECONDS - T0 < 30)) || fail "RPC socket $SOCK did not answer within 30 s"
  sleep 0.2
done
# RPCs are queued as lines and sent by one rpc.py (its script mode: stdin, stops at the first
# error), as each python start costs ~0.4 s on a busy 2-core machine.
RPCS=()
rpc() { RPCS+=("$(printf '%q ' "$@")"); }
rpc nvmf_create_transport -t VFIOUSER
if [[ -n $TCP_PORT && -n $TCP_STRICT ]]; then
  rpc nvmf_create_transport -t TCP --c2h-success --in-capsule-data-size 0 --io-unit-size 8192
elif [[ -n $TCP_PORT ]]; then
  rpc nvmf_create_transport -t TCP
fi
rpc bdev_malloc_create -b malloc512 "$MALLOC_MIB" 512
rpc bdev_malloc_create -b malloc4096 "$MALLOC_MIB" 4096
rpc bdev_aio_create "$IMG" aio 4096
for i in "${!NAMES[@]}"; do
  n=${NAMES[$i]} nqn=nqn.2019-07.io.spdk:gpunvme-${NAMES[$i]}
  rpc nvmf_create_subsystem "$nqn" -a -s "${SERIALS[$i]}"
  rpc nvmf_subsystem_add_ns "$nqn" "$n"
  rpc nvmf_subsystem_add_listener "$nqn" -t VFIOUSER -a "$STATE/$n" -s 0
  [[ -z $TCP_PORT ]] || rpc nvmf_subsystem_add_listener "$nqn" -t tcp -a 127.0.0.1 -s "$TCP_PORT" -f ipv4
done
out=$(printf '%s\n' "${RPCS[@]}" | python3 "$RPCPY" -s "$SOCK" -t 15 2>&1) ||
  fail "RPC failed: $(grep -m1 ' <<<$' <<<"$out" | sed 's/ *<<<$//'): $(grep -m1 '"message"' <<<"$out" |
       sed 's/.*"message": *//' || tail -n 1 <<<"$out")"
T0=$SECONDS
for n in "${NAMES[@]}"; do
  until [[ -S $STATE/$n/cntrl ]]; do
    alive "$PID" || fail "nvmf_tgt exited while creating listeners"
    ((SECONDS - T0 < 10)) || fail "socket $STATE/$n/cntrl did not appear within 10 s"
    sleep 0.1
  done
done
alive "$PID" || fail "nvmf_tgt exited after setup"
trap - INT TERM ERR
for i in "${!NAMES[@]}"; do echo "${NAMES[$i]} $STATE/${NAMES[$i]}/cntrl ${BS[$i]}"; done
