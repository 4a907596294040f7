#!/usr/bin/env bash
#
# qemu-bench.sh: in one QEMU guest, on the same controller (QEMU's `nvme` device behind an
# emulated Intel IOMMU), 4 KiB random reads at QD1 and QD32 through our driver (gpunvme perf,
# VFIO) and through the Linux nvme driver with fio (io_uring and libaio, O_DIRECT). Prints
# JSON with each IOPS and the ratio ours/kernel.
#
# Usage:
#   scripts/qemu-bench.sh [--runtime SECS] [--qd "1 32"] [--span BYTES] [--disk-size SIZE]
#                         [--hugepages N] [--noiommu] [--no-build] [--timeout SECS]
#
#   --runtime    seconds per measurement (default 10)
#   --qd         queue depths (default "1 32")
#   --span       bytes of the namespace the reads touch (default 256M)
#   --disk-size  namespace size (default 1G; sparse)
#   --hugepages  2 MiB hugepages the guest reserves for DMA memory (default 64)
#   --noiommu    VFIO in no-IOMMU mode (see scripts/qemu-noiommu.sh), no emulated IOMMU
#
# The guest runs under TCG (this machine's KVM cannot run it), so the absolute numbers measure
# QEMU's emulation more than either driver; the ratio compares the two drivers' overheads on
# the same emulated controller; on a busy 2-core host they vary by 2x from run to run. The
# guest's console goes to stderr; the JSON to stdout.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=qemu-lib.sh
. "$(dirname "$0")/qemu-lib.sh"

usage() {
    sed -n '3,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

runtime=10 qds="1 32" span=256M disk=1G mode=iommu timeout_s=1200
while [ $# -gt 0 ]; do
    case "$1" in
        --runtime) runtime=$2; shift 2 ;;
        --qd) qds=$2; shift 2 ;;
        --span) span=$2; shift 2 ;;
        --disk-size) disk=$2; shift 2 ;;
        --hugepages) export GPUNVME_QEMU_HUGEPAGES=$2; shift 2 ;;
        --noiommu) mode=noiommu; shift ;;
        --no-build) export GPUNVME_QEMU_NO_BUILD=1; shift ;;
        --timeout) timeout_s=$2; shift 2 ;;
        -h | --help) usage 0 ;;
        *) log "unknown argument $1"; usage 2 ;;
    esac
done
[[ $runtime =~ ^[0-9]+$ ]] || die "--runtime takes whole seconds"
[[ $qds =~ ^[0-9\ ]+$ ]] || die "--qd takes numbers"

ensure_host_tools fio
ensure_release_build
[ -x "$RELEASE_DIR/gpunvme" ] || die "$RELEASE_DIR/gpunvme is missing"
mkdir -p "$CACHE_DIR"
fetch_kernel
vfio_ko=""
if [ "$mode" = noiommu ]; then
    vfio_ko=$("$QEMU_LIB_DIR/qemu-noiommu.sh" "$KVER")
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpunvme-qemu-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT
token=$(od -An -tx8 -N8 /dev/urandom | tr -d ' ')
cat >"$work/run.sh" <<EOF
export GN_TOKEN=$token RUNTIME=$runtime SPAN=$span QDS="$qds"
. /usr/share/gpunvme/bench.sh
EOF
build_initramfs "$work/initrd.cpio" "$mode" bench "$work/run.sh" "$vfio_ko"
devs=()
nvme_qemu_args devs "$work" 1 1 512 "$disk" ""
log "booting the benchmark guest (${runtime}s per measurement)"
rc=0
GPUNVME_QEMU_CONSOLE=1 boot_guest "$work/console.log" "$timeout_s" "$mode" vfio \
    "$work/initrd.cpio" "${devs[@]}" || rc=$?
case "$rc" in
    0) ;;
    124) die "the guest did not finish within ${timeout_s}s" ;;
    125) die "the guest ended without an exit status" ;;
    *) log "some measurements failed (guest status $rc)" ;;
esac

# Result lines -> {"gpunvme": {"1": iops, ...}, "io_uring": {...}, "libaio": {...}}
tr -d '\r' <"$work/console.log" | awk -v t="$token" '$1 == "GN-BENCH" && $2 == t { print $3, $4, $5 }' |
    jq -Rn --arg mode "$mode" --argjson runtime "$runtime" --arg span "$span" '
    [inputs | split(" ") | {engine: .[0], qd: (.[1] | tonumber), iops: (.[2] | tonumber | round)}] as $r
    | def iops($e; $q): ([$r[] | select(.engine == $e and .qd == $q) | .iops] | first);
      def ratio($a; $b): if $a == null or $b == null or $b == 0 then null
                         else ($a / $b * 1000 | round / 1000) end;
    {
      device: "QEMU nvme (1b36:0010), TCG guest",
      iommu: $mode, bs: 4096, rw: "randread", runtime_s: $runtime, span: $span,
      results: [$r | map(.qd) | unique | .[] as $q | {
        qd: $q,
        gpunvme_iops: iops("gpunvme"; $q),
        fio_io_uring_iops: iops("io_uring"; $q),
        fio_libaio_iops: iops("libaio"; $q),
        ratio_vs_io_uring: ratio(iops("gpunvme"; $q); iops("io_uring"; $q)),
        ratio_vs_libaio: ratio(iops("gpunvme"; $q); iops("libaio"; $q))
      }]
    }'
exit "$rc"
