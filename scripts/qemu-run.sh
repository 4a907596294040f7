#!/usr/bin/env bash
#
# qemu-run.sh: run one shell command inside a QEMU guest whose NVMe controllers (QEMU's `nvme`
# device) sit behind an emulated Intel IOMMU and are bound to vfio-pci; print the guest's
# console and exit with the command's exit status.
#
# Usage:
#   scripts/qemu-run.sh [options] [--] <guest shell command...>
#
# Options:
#   --controllers N      NVMe controllers (default 1)
#   --namespaces N       namespaces per controller (default 1)
#   --lba-size B         logical block size, 512 or 4096 (default 512)
#   --disk-size S        bytes per namespace, as truncate(1) takes it (default 64M)
#   --nvme-opts OPTS     extra properties for every `-device nvme`, e.g. 'mdts=1,max_ioqpairs=1'
#   --qemu-args ARGS     extra QEMU arguments (word-split)
#   --bind vfio|nvme     driver for the controllers when the command starts (default vfio)
#   --noiommu            no emulated IOMMU; vfio in no-IOMMU mode (rebuilds vfio.ko once,
#                        see scripts/qemu-noiommu.sh)
#   --hugepages N        2 MiB hugepages the guest reserves (default 64; 0: none)
#   --fio                also pack fio into the guest
#   --timeout SECS       kill the guest after this long (default 600)
#   --no-build           do not run `cargo build --release -p gpunvme-cli` first
#   --quiet              print the console only when the command fails
#
# In the guest: our release binaries are on PATH (target/release/* as /opt/gpunvme/bin/*,
# target/release/examples/* as /opt/gpunvme/examples/*), with nvme-cli, jq, bash and busybox,
# and scripts/setup.sh is /opt/gpunvme/scripts/setup.sh. The command runs under busybox sh in
# /root; `. /usr/share/gpunvme/lib.sh` gives helpers
# (gn_nvme_bdfs, gn_bind BDF vfio-pci|nvme, gn_blockdev BDF NSID, ...; see scripts/guest/lib.sh).
# Build other binaries you need (e.g. `cargo build --release -p vfio --examples`) before the run.
#
# Examples:
#   scripts/qemu-run.sh -- 'gpunvme --device $(. /usr/share/gpunvme/lib.sh; gn_nvme_bdfs) identify'
#   scripts/qemu-run.sh --nvme-opts mdts=1 -- 'ls -l /dev/vfio; my-example 0000:00:03.0'
#
# Exit status: the command's; 124 when the guest hung past --timeout; 125 when the guest ended
# without reporting a status (kernel panic, crash); 2 for a harness error.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=qemu-lib.sh
. "$(dirname "$0")/qemu-lib.sh"

usage() {
    sed -n '3,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

ctrls=1 nss=1 lba=512 size=64M nvme_opts="" qemu_extra="" bind=vfio mode=iommu flavor=test
timeout_s=600 quiet=0
while [ $# -gt 0 ]; do
    case "$1" in
        --controllers) ctrls=$2; shift 2 ;;
        --namespaces) nss=$2; shift 2 ;;
        --lba-size) lba=$2; shift 2 ;;
        --disk-size) size=$2; shift 2 ;;
        --nvme-opts) nvme_opts=$2; shift 2 ;;
        --qemu-args) qemu_extra=$2; shift 2 ;;
        --bind) bind=$2; shift 2 ;;
        --noiommu) mode=noiommu; shift ;;
        --fio) flavor=bench; shift ;;
        --hugepages) export GPUNVME_QEMU_HUGEPAGES=$2; shift 2 ;;
        --timeout) timeout_s=$2; shift 2 ;;
        --no-build) export GPUNVME_QEMU_NO_BUILD=1; shift ;;
        --quiet) quiet=1; shift ;;
        -h | --help) usage 0 ;;
        --) shift; break ;;
        -*) log "unknown option $1"; usage 2 ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || usage 2
case "$bind" in vfio | nvme) ;; *) die "--bind takes vfio or nvme" ;; esac

ensure_host_tools "$([ "$flavor" = bench ] && echo fio)"
ensure_release_build
mkdir -p "$CACHE_DIR"
fetch_kernel
vfio_ko=""
if [ "$mode" = noiommu ]; then
    vfio_ko=$("$QEMU_LIB_DIR/qemu-noiommu.sh" "$KVER")
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpunvme-qemu.XXXXXX")
trap 'rm -rf "$work"' EXIT
printf '%s\n' "$*" >"$work/run.sh"
build_initramfs "$work/initrd.cpio" "$mode" "$flavor" "$work/run.sh" "$vfio_ko"
devs=()
nvme_qemu_args devs "$work" "$ctrls" "$nss" "$lba" "$size" "$nvme_opts"
# shellcheck disable=SC2206 # --qemu-args is documented as word-split
extra=($qemu_extra)

[ "$quiet" = 1 ] || export GPUNVME_QEMU_CONSOLE=1
rc=0
boot_guest "$work/console.log" "$timeout_s" "$mode" "$bind" "$work/initrd.cpio" \
    "${devs[@]}" "${extra[@]}" || rc=$?
if [ "$quiet" = 1 ] && [ "$rc" -ne 0 ]; then
    cat "$work/console.log" >&2
fi
case "$rc" in
    124) log "qemu-run: the guest did not finish within ${timeout_s}s" ;;
    125) log "qemu-run: the guest ended without reporting a status (see the console above)" ;;
esac
exit "$rc"
