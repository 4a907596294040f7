#!/usr/bin/env bash
# serve-gpu-bench.sh, ON THE GPU MACHINE: GPU clients of `gpunvme serve` (the served transport:
# rings and data in memory the daemon shares, registered with CUDA by each client). In one run,
# on one image in /dev/shm and the same controller settings:
#   1. owned: one process owning the controller, `perf --gpu --rw randread` on N queues;
#   2. served, one GPU client process with N queues (`serve check --gpu --read-only`, every
#      byte checked against the pattern on the GPU);
#   3. served, N GPU client processes at once with one queue each;
#   4. kills: GPU client processes (writers of the same pattern and readers) killed with
#      SIGKILL at random points while one GPU client verifies throughout; each dead client
#      reclaimed, the verifier exact, no late controller access.
# Prints one JSON object on stdout (rows on stderr as they go); exits 1 if any check failed.
#
# Usage: scripts/serve-gpu-bench.sh [--bin DIR] [--clients N] [--runtime 5s] [--bs-blocks 256]
#                                   [--qd 32] [--kills 10] [--controller-threads T] [--lbas N]
#                                   [--mps]
#   --bin        the directory holding the gpunvme binary (default .gpu-bin; bins.tgz unpacked)
#   --bs-blocks  512-byte blocks per I/O (256: 128 KiB)
#   --lbas       the range read, in 512-byte blocks (default 2 GiB of them)
#   --mps        run every GPU process under an MPS control daemon of this script's own (pipe
#                and log directories in its scratch directory; stopped at the end): without
#                MPS a GPU runs one process's kernels at a time, time-sliced
set -uo pipefail
cd "$(dirname "$0")/.."
MPS=0 BIN=.gpu-bin clients=4 runtime=5s blocks=256 qd=32 kills=10 threads=16 lbas=$((2 * 1024 * 1024 * 2))
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) BIN=$2; shift 2 ;;
        --clients) clients=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --bs-blocks) blocks=$2; shift 2 ;;
        --qd) qd=$2; shift 2 ;;
        --kills) kills=$2; shift 2 ;;
        --controller-threads) threads=$2; shift 2 ;;
        --lbas) lbas=$2; shift 2 ;;
        --mps) MPS=1; shift ;;
        *) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
G=$(realpath "$BIN/gpunvme")
work=$(mktemp -d /dev/shm/gpunvme-serve-gpu.XXXXXX)
img=$work/bench.img sock=$work/serve.sock
serve_pid=""
cleanup() {
    [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null
    pkill -9 -f "$sock" 2>/dev/null
    [ "$MPS" = 1 ] && echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    rm -rf "$work"
}
trap cleanup EXIT
if [ "$MPS" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=$work/mps-pipe CUDA_MPS_LOG_DIRECTORY=$work/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "serve-gpu-bench: no MPS control daemon" >&2; exit 2; }
fi
fail=0

common=(--device "$img" --controller-threads "$threads" --controller-queue-pairs $((clients * 4 + 8)))
"$G" image create "$img" --size 3G > /dev/null
"$G" "${common[@]}" serve --socket "$sock" > "$work/serve.out" 2>&1 &
serve_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
client=("$G" serve --socket "$sock" check --gpu --json --lbas "$lbas" --blocks-per-io "$blocks"
    --depth 256 --qd "$qd" --seed 77)
gcheck=(timeout 300 "${client[@]}")
# The pattern over the range, by GPU threads (a write pass and a checked read pass).
fill=$("${gcheck[@]}" --queues 4 --ios 2048) || { echo "serve-gpu-bench: fill failed: $fill" >&2; fail=1; }
echo "serve-gpu-bench: fill: $fill" >&2
# One client with N queues, then N clients with one queue each, reads checked on the GPU
# ("") and not ("-nv": --no-verify, GPU threads never read the data).
for v in "" -nv; do
    flags=(--read-only --runtime "$runtime")
    [ "$v" = -nv ] && flags+=(--no-verify)
    "${gcheck[@]}" "${flags[@]}" --queues "$clients" > "$work/one$v.json" || fail=1
    echo "serve-gpu-bench: served, one GPU client, $clients queues$v: $(cat "$work/one$v.json")" >&2
    pids=()
    for i in $(seq 0 $((clients - 1))); do
        "${gcheck[@]}" "${flags[@]}" --queues 1 > "$work/client$v-$i.json" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || fail=1; done
    for i in $(seq 0 $((clients - 1))); do
        echo "serve-gpu-bench: client $i$v: $(cat "$work/client$v-$i.json")" >&2
    done
done
status=$("$G" serve --socket "$sock" status --json)
kill "$serve_pid"; wait "$serve_pid" 2>/dev/null; serve_pid=""

owned=$(timeout 300 "$G" "${common[@]}" --json perf --gpu --rw randread --bs $((blocks * 512)) \
    --qd "$qd" --queues "$clients" --gpu-depth 256 --runtime "$runtime" 2> "$work/owned.err") || {
    tail -3 "$work/owned.err" >&2; fail=1; }
echo "serve-gpu-bench: owned, one process, $clients GPU queues: $(head -c 400 <<<"$owned")" >&2

# Kills, on a fresh daemon over the same image.
"$G" "${common[@]}" serve --socket "$sock" > "$work/serve2.out" 2>&1 &
serve_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
"${gcheck[@]}" --read-only --runtime $((3 + kills))s --queues 1 > "$work/verifier.json" &
verifier=$!
killed=0
for i in $(seq 1 "$kills"); do
    if [ $((i % 2)) = 0 ]; then extra=(--queues 2 --ios 100000); else extra=(--queues 2 --read-only --runtime 30s); fi
    # Not under timeout(1): the kill must reach the client itself.
    "${client[@]}" "${extra[@]}" > /dev/null 2>&1 &
    victim=$!
    sleep "0.$(( RANDOM % 9 + 1 ))"
    kill -9 "$victim" 2>/dev/null && killed=$((killed + 1))
    wait "$victim" 2>/dev/null
done
wait "$verifier" || { echo "serve-gpu-bench: the verifier failed: $(cat "$work/verifier.json")" >&2; fail=1; }
echo "serve-gpu-bench: verifier beside $killed kills: $(cat "$work/verifier.json")" >&2
# Every dead client reclaimed: only the status request itself is a client.
for _ in $(seq 100); do
    status2=$("$G" serve --socket "$sock" status --json)
    python3 -c 'import json,sys; sys.exit(0 if len(json.loads(sys.argv[1])["clients"]) <= 1 else 1)' "$status2" && break
    sleep 0.1
done
kill "$serve_pid"; wait "$serve_pid" 2>/dev/null; serve_pid=""

python3 - "$owned" "$clients" "$runtime" "$threads" "$blocks" "$qd" "$status2" "$killed" \
    "$(cat "$work/verifier.json")" "$fill" "$work" "${MPS:-0}" <<'PY' || fail=1
import json, os, sys
owned, n, runtime, threads, blocks, qd, st2, killed, ver, fill, work, mps = sys.argv[1:13]
n = int(n)
def j(s):
    try: return json.loads(s)
    except Exception: return None
def f(name):
    try: return j(open(f"{work}/{name}.json").read())
    except OSError: return None
owned, st2, ver, fill = map(j, (owned, st2, ver, fill))
def rate(c): return (c or {}).get("read", {}).get("bytes_per_sec", 0.0)
def clean(c): return bool(c) and "read" in c and c["read"]["errors"] == 0 and c["read"]["mismatches"] == 0
def owned_rate(o): return (o or {}).get("bw_bytes", 0.0)
rows, ok = {}, clean(ver)
for v, label in (("", "verified"), ("-nv", "unverified")):
    one = f("one" + v)
    clients = [f(f"client{v}-{i}") for i in range(n)]
    agg = sum(rate(c) for c in clients)
    ok = ok and all(clean(c) for c in clients + [one])
    rows[label] = {
        "one_client_bytes_per_s": rate(one),
        "clients_bytes_per_s": agg,
        "per_client_bytes_per_s": [rate(c) for c in clients],
        "clients_over_one_client": round(agg / rate(one), 3) if rate(one) else None,
        "one_client_over_owned": round(rate(one) / owned_rate(owned), 3) if owned_rate(owned) else None,
        "gpu_queue_setup_us": [(c or {}).get("setup_us") for c in clients],
        "connect_us": [(c or {}).get("connect_us") for c in clients],
    }
s2 = st2 or {}
ctl = (s2.get("controllers") or [{}])[0]
print(json.dumps({
    "bench": "serve-gpu",
    "machine": os.uname().nodename,
    "gpu": (fill or {}).get("gpu"),
    "cpus": os.cpu_count(),
    "mps": mps == "1",
    "clients": n,
    "runtime": runtime,
    "controller_threads": int(threads),
    "pattern": f"randread {int(blocks) * 512 // 1024} KiB, QD {qd} per queue (served: the client's GPU threads; owned: perf --gpu, one process)",
    "owned_perf_gpu_bytes_per_s": owned_rate(owned),
    "served": rows,
    "fill": fill,
    "kills": int(killed),
    "verifier_beside_kills": ver,
    "after_kills_clients": len(s2.get("clients", [])),
    "after_kills_lent_queue_pairs": ctl.get("lent_queue_pairs"),
    "late_controller_writes": s2.get("late_controller_writes"),
    "late_controller_reads": s2.get("late_controller_reads"),
    "reclaimed_clients": s2.get("reclaimed_clients"),
    "all_clean": ok,
}))
sys.exit(0 if ok and ctl.get("lent_queue_pairs") == 0 and s2.get("late_controller_writes") == 0 else 1)
PY
exit $fail
