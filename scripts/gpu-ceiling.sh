#!/usr/bin/env bash
# The GPU-resident controller model's ceilings (issue 9), run ON THE GPU MACHINE with the CLI
# carried in .gpu-bin/ (scripts/gpu-build.sh): `perf --gpu --controller gpu` swept over client
# style (warp-cooperative, per-thread), queues, depth per queue and controller SMs, plus the
# QD1 latency of one command. Prints one JSON object on stdout:
#   {"config": {...}, "table": [one row per run], "summary": {best per client and SM count,
#    the warp/thread ratio per SM count}}
# and a line per run on stderr as it goes. A run that fails or passes LIMIT seconds is a row
# with "error" (every run is bounded: `timeout`, and the CLI's own queue timeouts).
#
#   scripts/gpu-ceiling.sh
#   SMS="8 16 24" MEDIA=hbm BS=4k CLIENTS=warp scripts/gpu-ceiling.sh
#   MEDIA=host BS=128k QUEUES="32 64" QDS="32" scripts/gpu-ceiling.sh
#
# Environment (defaults): G (.gpu-bin/gpunvme or target/release/gpunvme), MEDIA (null), BS (4k),
# RW (randread), SMS ("8 16"), CLIENTS ("warp thread"), QUEUES ("32 128"), QDS ("64 256"),
# IOS_WARP (20000000), IOS_THREAD (2000000), QD1 (1: add the QD1 rows; 0: skip), IMG_SIZE (4G;
# the namespace image, in /dev/shm so that `host` media may be registered read-write),
# LIMIT (seconds per run, 120).
set -uo pipefail
cd "$(dirname "$0")/.."
G=${G:-$( [ -x .gpu-bin/gpunvme ] && echo .gpu-bin/gpunvme || echo target/release/gpunvme )}
MEDIA=${MEDIA:-null} BS=${BS:-4k} RW=${RW:-randread}
SMS=${SMS:-"8 16"} CLIENTS=${CLIENTS:-"warp thread"}
QUEUES=${QUEUES:-"32 128"} QDS=${QDS:-"64 256"}
IOS_WARP=${IOS_WARP:-20000000} IOS_THREAD=${IOS_THREAD:-2000000}
QD1=${QD1:-1} IMG_SIZE=${IMG_SIZE:-4G} LIMIT=${LIMIT:-120}
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
max_q=1
for q in $QUEUES; do [ "$q" -gt "$max_q" ] && max_q=$q; done
IMG=$(mktemp /dev/shm/gpunvme-ceiling.XXXXXX 2>/dev/null || mktemp)
ROWS=$(mktemp)
trap 'rm -f "$IMG" "$ROWS"' EXIT
truncate -s "$IMG_SIZE" "$IMG"

row() {  # row CLIENT QUEUES QD SMS IOS: one run, one JSON row appended to $ROWS
    local client=$1 queues=$2 qd=$3 sms=$4 ios=$5 out rc
    out=$(timeout "$LIMIT" "$G" --device "$IMG" --controller-queue-pairs "$max_q" --json \
        perf --gpu --controller gpu --media "$MEDIA" --controller-sms "$sms" --client "$client" \
        --rw "$RW" --bs "$BS" --queues "$queues" --qd "$qd" --ios "$ios" 2>&1)
    rc=$?
    python3 - "$client" "$queues" "$qd" "$sms" "$ios" "$rc" "$out" >>"$ROWS" <<'EOF'
import json, sys
client, queues, qd, sms, ios, rc, out = sys.argv[1:]
row = {"client": client, "queues": int(queues), "qd": int(qd), "controller_sms": int(sms)}
try:
    r = json.loads(out[out.index("{"):])
    lat = r["lat_ns"]
    row.update({
        "ios": r["ios"],
        "mcmds_per_s": round(r["iops"] / 1e6, 2),
        # null media moves no data: its byte rate would be nominal (block size x rate).
        "gbytes_per_s": None if r["gpu"]["model"]["media"] == "null" else round(r["bw_bytes"] / 1e9, 2),
        "errors": r["errors"],
        "lat_us": {k: round(lat[k] / 1e3, 1) for k in ("mean", "p50", "p99", "p999", "max")},
        "threads": r["gpu"]["threads"],
        "depth": r["gpu"]["depth"],
        "model": {k: r["gpu"]["model"][k] for k in
                  ("media", "blocks", "sms", "commands", "errors", "passes", "idle_passes")},
    })
    if int(rc) != 0:
        row["error"] = "exit %s" % rc
except Exception:
    row["error"] = ("timed out (LIMIT)" if rc == "124" else "exit %s" % rc) + ": " + out[-400:]
print(json.dumps(row))
EOF
    tail -1 "$ROWS" | python3 -c 'import json,sys
r=json.loads(sys.stdin.read())
print("gpu-ceiling: %s q=%d qd=%d sms=%d: %s" % (r["client"], r["queues"], r["qd"], r["controller_sms"],
      r.get("error") or "%.2f M cmds/s, %s GB/s, p50 %.1f us" % (r["mcmds_per_s"], r["gbytes_per_s"], r["lat_us"]["p50"])))' >&2
}

for sms in $SMS; do
    if [ "$QD1" = 1 ]; then
        for client in $CLIENTS; do row "$client" 1 1 "$sms" 20000; done
    fi
    for client in $CLIENTS; do
        ios=$IOS_WARP; [ "$client" = thread ] && ios=$IOS_THREAD
        for q in $QUEUES; do
            for qd in $QDS; do row "$client" "$q" "$qd" "$sms" "$ios"; done
        done
    done
done

python3 - "$ROWS" "$MEDIA" "$BS" "$RW" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
best = {}
for r in rows:
    if "error" in r or r["errors"]:
        continue
    k = "%s@%dsm" % (r["client"], r["controller_sms"])
    best[k] = max(best.get(k, 0), r["mcmds_per_s"])
ratio = {}
for k, v in best.items():
    if k.startswith("warp@"):
        t = best.get("thread@" + k[5:])
        if t:
            ratio["warp_over_thread@" + k[5:]] = round(v / t, 2)
best_gb = {}
for r in rows:
    if "error" not in r and not r["errors"] and r["gbytes_per_s"] is not None:
        k = "%s@%dsm" % (r["client"], r["controller_sms"])
        best_gb[k] = max(best_gb.get(k, 0), r["gbytes_per_s"])
print(json.dumps({"config": {"media": sys.argv[2], "bs": sys.argv[3], "rw": sys.argv[4]},
                  "table": rows,
                  "summary": {"best_mcmds_per_s": best, "best_gbytes_per_s": best_gb, **ratio,
                              "failed_runs": sum(1 for r in rows if "error" in r or r["errors"])}},
                 indent=1))
EOF
