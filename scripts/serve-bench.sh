#!/usr/bin/env bash
# serve-bench.sh: does a controller served by `gpunvme serve` share its throughput among client
# processes? In one run, on one image and the same controller settings: one process owning the
# controller (`perf --rw randread`, N queues), one served client with N queues, and N served
# client processes at once with one queue each (`serve check --read-only`: 4 KiB random reads,
# QD 32 per queue). Prints one JSON object; the rows on stderr as they go.
#
# Usage: scripts/serve-bench.sh [--bin GPUNVME] [--clients N] [--runtime 5s] [--dir DIR]
#                               [--controller-threads T]
#   --bin   the gpunvme binary (default target/release/gpunvme, built if missing)
#   --dir   where the 1 GiB image goes (default /dev/shm: the controller, not a disk, is measured)
set -euo pipefail
cd "$(dirname "$0")/.."
G=target/release/gpunvme clients=4 runtime=5s dir=/dev/shm threads=0
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) G=$2; shift 2 ;;
        --clients) clients=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        --controller-threads) threads=$2; shift 2 ;;
        *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
[ -x "$G" ] || cargo build --release -q -p gpunvme-cli
work=$(mktemp -d "$dir/gpunvme-serve-bench.XXXXXX")
img=$work/bench.img sock=$work/serve.sock
serve_pid=""
cleanup() { [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
common=(--device "$img" --controller-threads "$threads" --controller-queue-pairs $((clients * 2 + 2)))
"$G" image create "$img" --size 1G > /dev/null
# Data in every block (reads of holes would measure nothing).
"$G" "${common[@]}" perf --rw write --bs 128k --qd 16 --ios 8192 > /dev/null
field() { python3 -c 'import json,sys; print(json.loads(sys.stdin.read())[sys.argv[1]])' "$1"; }

owned=$("$G" "${common[@]}" --json perf --rw randread --bs 4k --qd 32 --queues "$clients" \
    --runtime "$runtime" | field iops)
echo "serve-bench: owned, one process, $clients queues: $owned IOPS" >&2

"$G" "${common[@]}" serve --socket "$sock" > "$work/serve.out" 2>&1 &
serve_pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
check=(serve --socket "$sock" check --json --read-only --qd 32 --depth 64 --blocks-per-io 8
    --runtime "$runtime")
one=$("$G" "${check[@]}" --queues "$clients" | field iops)
echo "serve-bench: served, one client, $clients queues: $one IOPS" >&2

# A fresh client process's set-up: connect (Hello/Welcome), then arena, queues and an Identify
# until its queues are ready; five one-shot clients, each its own process.
setups=$(for i in 1 2 3 4 5; do
    "$G" serve --socket "$sock" check --json --read-only --ios 16 --queues 1 |
        python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["connect_us"], j["setup_us"])'
done)
echo "serve-bench: fresh clients' connect and set-up (us): $(echo $setups)" >&2

pids=()
for i in $(seq 0 $((clients - 1))); do
    "$G" "${check[@]}" --queues 1 --seed "$i" > "$work/client-$i.json" &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
per=$(for i in $(seq 0 $((clients - 1))); do field iops < "$work/client-$i.json"; done)
sum=$(python3 -c 'import sys; print(round(sum(float(x) for x in sys.argv[1:])))' $per)
echo "serve-bench: served, $clients clients at once, one queue each: $sum IOPS in all" >&2
status=$("$G" serve --socket "$sock" status --json)
kill "$serve_pid"; wait "$serve_pid" || true; serve_pid=""

python3 - "$owned" "$one" "$sum" "$clients" "$runtime" "$threads" "$status" "$setups" $per <<'EOF'
import json, os, statistics, sys
owned, one, total, n, runtime, threads, status, setups = sys.argv[1:9]
per = [round(float(x)) for x in sys.argv[9:]]
pairs = [tuple(map(int, l.split())) for l in setups.splitlines() if l.strip()]
s = json.loads(status)
print(json.dumps({
    "bench": "serve",
    "machine": os.uname().nodename,
    "cpus": os.cpu_count(),
    "clients": int(n),
    "runtime": runtime,
    "controller_threads": int(threads),
    "pattern": "randread 4 KiB, QD 32 per queue",
    "owned_one_process_iops": round(float(owned)),
    "served_one_client_iops": round(float(one)),
    "served_clients_iops": round(float(total)),
    "served_per_client_iops": per,
    "served_clients_over_owned": round(float(total) / float(owned), 3),
    "served_clients_over_one_client": round(float(total) / float(one), 3),
    "fresh_client_connect_us_median": statistics.median(p[0] for p in pairs),
    "fresh_client_queues_ready_us_median": statistics.median(p[1] for p in pairs),
    "doorbells_refused": s["controllers"][0]["invalid_doorbell_writes"],
    "late_controller_writes": s["late_controller_writes"],
}))
EOF
