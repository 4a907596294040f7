# shellcheck shell=dash
#
# The benchmark, run inside the QEMU guest by scripts/qemu-bench.sh (busybox ash): 4 KiB random
# reads on one controller at each queue depth, first through our driver (gpunvme perf, the
# controller on vfio-pci), then through the Linux nvme driver with fio (io_uring and libaio,
# O_DIRECT on /dev/nvmeXnY). Same controller, same namespace, same span of LBAs, same time.
#
# Input (environment, set by the host in run.sh):
#   GN_TOKEN   token that marks result lines
#   RUNTIME    seconds per measurement
#   SPAN       bytes of the namespace (from LBA 0) that the reads touch
#   QDS        queue depths, e.g. "1 32"
#
# Output: one line per measurement, `GN-BENCH <token> <engine> <qd> <iops>`, where engine is
# gpunvme, io_uring or libaio; exit status 1 if a measurement failed.

# shellcheck source-path=SCRIPTDIR source=lib.sh
. /usr/share/gpunvme/lib.sh

FAILED=0
bdf=$(gn_nvme_bdfs | head -n 1)
[ -n "$bdf" ] || {
    echo "bench: no NVMe controller"
    exit 1
}
report() { echo "GN-BENCH $GN_TOKEN $1 $2 $3"; }
# Generous bound: a measurement takes RUNTIME plus start-up.
limit=$((RUNTIME * 4 + 120))

if gn_bind "$bdf" vfio-pci; then
    for qd in $QDS; do
        if timeout "$limit" gpunvme --device "$bdf" perf --rw randread --bs 4k --qd "$qd" \
            --queues 1 --runtime "${RUNTIME}s" --size "$SPAN" --json >/tmp/ours.json; then
            report gpunvme "$qd" "$(jq -r .iops /tmp/ours.json)"
        else
            echo "bench: gpunvme perf at qd $qd failed"
            FAILED=1
        fi
    done
else
    FAILED=1
fi

if gn_bind "$bdf" nvme && blk=$(gn_blockdev "$bdf" 1); then
    for engine in io_uring libaio; do
        for qd in $QDS; do
            if timeout "$limit" fio --name=randread --filename="$blk" --rw=randread --bs=4k \
                --iodepth="$qd" --ioengine="$engine" --direct=1 --size="$SPAN" \
                --time_based --runtime="$RUNTIME" --output-format=json >/tmp/fio.json; then
                report "$engine" "$qd" "$(jq -r '.jobs[0].read.iops' /tmp/fio.json)"
            else
                echo "bench: fio $engine at qd $qd failed"
                FAILED=1
            fi
        done
    done
else
    FAILED=1
fi
exit "$FAILED"
