#!/usr/bin/env bash
# GPU I/O over several controllers at once (issue 23), ON THE GPU MACHINE with binaries carried
# in .gpu-bin/ (scripts/gpu-build.sh):
#
#   scripts/gpu-scale-bench.sh [--bin DIR] [--counts "1 2 4 8"] [--secs S] [--threads T]
#                              [--controllers "emu gpu"] [--ssd-model SPEC]
#
# N controllers, each over its own 1 GiB image on /dev/shm (filled with real pages by the CPU
# first), run `perf --gpu` at once (`--device a,b,...`: each controller its own GPU queues and
# perf kernel): 4 KiB random reads (4 queues x QD 128 per controller) and 128 KiB sequential
# reads (4 queues x QD 16), --secs each. Two kinds of controller:
#   emu  the software controller with T controller threads each (default 2: 8 controllers use
#        16 cores); the host's CPUs bound it, N x T threads copy every byte (a real SSD's DMA
#        does not);
#   gpu  the GPU-resident model, one per controller on SMs of its own (8 each on Hopper), hbm
#        media, each namespace one modelled drive (--ssd-model, default a Gen4 drive:
#        read_us=80,iops=1M,bw=7GB/s); the rows say the fraction of the drives' cap reached.
# Prints one JSON line per run and a summary {"summary": ...} with the scaling efficiency,
# throughput at N / (N x throughput at 1), per kind. A failed run prints {"error": ...} and the
# script exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin COUNTS="1 2 4 8" SECS=3 THREADS=2 KINDS="emu gpu"
MODEL="read_us=80,iops=1M,bw=7GB/s"
while [ $# -gt 0 ]; do
    case "$1" in
        --controllers) KINDS=$2; shift 2 ;;
        --ssd-model) MODEL=$2; shift 2 ;;
        --bin) BIN=$2; shift 2 ;;
        --counts) COUNTS=$2; shift 2 ;;
        --secs) SECS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        *) sed -n '2,23p' "$0" >&2; exit 2 ;;
    esac
done
. scripts/gpu-bin-lib.sh && use_gpu_bins "$BIN"
G=$(realpath "$BIN/gpunvme")
DIR=$(mktemp -d /dev/shm/gpunvme-scale.XXXXXX)
trap 'rm -rf "$DIR"' EXIT
MAX=0
for n in $COUNTS; do [ "$n" -gt "$MAX" ] && MAX=$n; done
for i in $(seq 1 "$MAX"); do
    truncate -s 1G "$DIR/c$i.img"
    "$G" --device "$DIR/c$i.img" perf --force --rw write --bs 1m --qd 8 --ios 1024 >/dev/null 2>&1 ||
        { echo '{"error":"filling an image failed"}'; exit 1; }
done
failed=0
declare -A RESULT
for ctl in $KINDS; do
  case "$ctl" in
      emu) CTL_ARGS=() ;;
      gpu) CTL_ARGS=(--controller gpu --media hbm --ssd-model "$MODEL") ;;
      *) echo "{\"error\": \"unknown controller kind $ctl (emu or gpu)\"}"; exit 2 ;;
  esac
  for n in $COUNTS; do
    devs=$(seq 1 "$n" | sed "s|^|$DIR/c|; s|$|.img|" | paste -sd,)
    for job in "iops 4k randread 128" "bw 128k read 16"; do
        set -- $job
        kind=$1 bs=$2 rw=$3 qd=$4
        out=$("$G" --device "$devs" --controller-threads "$THREADS" --controller-queue-pairs 4 \
            --json perf --gpu "${CTL_ARGS[@]}" --rw "$rw" --bs "$bs" --qd "$qd" --queues 4 \
            --runtime "${SECS}s" 2>"$DIR/err")
        line=$(python3 -c '
import json, re, sys
n, kind, ctl, model = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
try:
    d = json.loads(sys.stdin.read())
except Exception as e:
    print(json.dumps({"error": f"{ctl} controllers={n} {kind}: not JSON: {e}"})); sys.exit(1)
if "controllers" not in d and "iops" not in d:
    print(json.dumps({"error": f"{ctl} controllers={n} {kind}: {d.get('"'"'error'"'"', d)}"}))
    sys.exit(1)
if "controllers" in d:
    t, per = d["total"], d["controllers"]
else:  # one device: perf --gpu'"'"'s own report
    t, per = {"iops": d["iops"], "bw_bytes": d["bw_bytes"], "errors": d["errors"],
              "lat_mean_ns": d["lat_ns"]["mean"]}, [d]
row = {"controller": ctl, "controllers": n, "job": kind, "iops": round(t["iops"]),
       "gbytes_per_s": round(t["bw_bytes"] / 1e9, 3), "errors": t["errors"],
       "lat_mean_us": round(t["lat_mean_ns"] / 1e3, 1),
       "per_controller_iops": [round(c["iops"]) for c in per]}
if ctl == "gpu":
    # The drives'"'"' cap: n drives of the model, IOPS for 4 KiB, bytes/s for 128 KiB.
    kv = dict(p.split("=") for p in model.split(","))
    def num(v):
        m = re.fullmatch(r"([0-9.]+)\s*([kKmMgG]?)(B/s)?", v.strip())
        return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]
    drives = int(kv.get("drives", 1))
    if kind == "iops" and "iops" in kv:
        row["fraction_of_cap"] = round(t["iops"] / (n * drives * num(kv["iops"])), 3)
    if kind == "bw" and "bw" in kv and num(kv["bw"]) > 0:
        row["fraction_of_cap"] = round(t["bw_bytes"] / (n * drives * num(kv["bw"])), 3)
print(json.dumps(row))
sys.exit(1 if t["errors"] else 0)
' "$n" "$kind" "$ctl" "$MODEL" <<<"$out") || { failed=1; [ -n "$line" ] || line="{\"error\":\"$ctl controllers=$n $kind: $(tail -1 "$DIR/err" | tr -d '"\\')\"}"; }
        echo "$line"
        RESULT[$ctl,$n,$kind]=$line
    done
  done
done
python3 - "$COUNTS" "$THREADS" "$(nproc)" "$(for k in "${!RESULT[@]}"; do echo "${RESULT[$k]}"; done)" <<'EOF'
import json, sys
counts = [int(c) for c in sys.argv[1].split()]
rows = [json.loads(l) for l in sys.argv[4].splitlines() if l.startswith("{")]
by = {(r.get("controller"), r.get("controllers"), r.get("job")): r for r in rows if "job" in r}
summary = {"threads_per_emu_controller": int(sys.argv[2]), "host_cpus": int(sys.argv[3])}
for ctl in sorted({r.get("controller") for r in rows if "job" in r}):
    for job, key in (("iops", "iops"), ("bw", "gbytes_per_s")):
        one = by.get((ctl, 1, job), {}).get(key)
        for n in counts:
            r = by.get((ctl, n, job))
            if r and one:
                summary[f"{ctl}_{job}_{n}"] = r[key]
                summary[f"{ctl}_{job}_efficiency_{n}"] = round(r[key] / (n * one), 3)
            if r and "fraction_of_cap" in r:
                summary[f"{ctl}_{job}_fraction_of_cap_{n}"] = r["fraction_of_cap"]
print(json.dumps({"summary": summary}))
EOF
exit $failed
