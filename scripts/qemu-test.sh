#!/usr/bin/env bash
#
# qemu-test.sh: the QEMU integration suite. For each QEMU configuration below, boots a TCG
# guest whose NVMe controllers (QEMU's `nvme` device) sit behind an emulated Intel IOMMU, and
# runs scripts/guest/suite.sh there: identify through VFIO against nvme-cli, perf --verify for
# read/write/randread/randwrite, bytes written by our driver read back through the Linux nvme
# driver and the reverse, bad --device arguments refused without side effects, and (in the
# default configuration) scripts/setup.sh's bind, unbind, status and hugepages, and its refusal
# of a controller whose namespace is mounted or used as swap, and (in the default and lba4k
# configurations) `gpunvme fs` through VFIO: mkfs, put, ls, get, stat, mv, rm, df, fsck, with
# the file's bytes read back through the Linux driver at the LBAs blockfs reports. The nskinds
# configuration runs scripts/guest/nskinds.sh instead: namespaces with protection information
# (driven with PRACT), separate metadata and zones (refused by name), with QEMU's
# pci_nvme_ub_* trace events counted (none allowed; in the default configuration too, which
# also runs `gpunvme serve` through VFIO with clients killed mid-I/O).
#
# Usage:
#   scripts/qemu-test.sh [--only NAME[,NAME...]] [--no-noiommu] [--perf-ios N]
#                        [--timeout SECS] [--no-build] [--logs DIR] [--list]
#
#   --only        run only these configurations (see --list)
#   --no-noiommu  skip the no-IOMMU configuration, which needs a vfio.ko rebuilt with
#                 CONFIG_VFIO_NOIOMMU (scripts/qemu-noiommu.sh: built once and cached; the
#                 first build downloads ~150 MB of kernel packages and took under a minute)
#   --perf-ios    I/Os per perf run in the guest (default 4096; TCG is slow)
#   --timeout     seconds before a guest counts as hung (default 900)
#   --no-build    use target/release as it is instead of `cargo build --release -p gpunvme-cli`
#   --logs DIR    keep every guest's console log there (default: a temporary folder, whose
#                 failing logs are printed)
#
# Prints `PASS`/`FAIL` per check, then `N passed, M failed`; exits 1 on any failure (a guest
# that hangs or crashes counts as one), 2 on a harness error.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=qemu-lib.sh
. "$(dirname "$0")/qemu-lib.sh"

# name | controllers | namespaces | LBA size | extra -device nvme properties | MDTS bytes |
# I/O queue pairs | mode | 2 MiB hugepages in the guest (0: the driver's 4 KiB-page fallback)
# QEMU 7.2's defaults: mdts=7 (512 KiB with 4 KiB pages), max_ioqpairs=64.
CONFIGS=(
    "default|1|1|512||524288|64|iommu|64"
    "mdts1|1|1|512|mdts=1|8192|64|iommu|64"
    "lba4k|1|1|4096||524288|64|iommu|0"
    "ioqpairs1|1|1|512|max_ioqpairs=1|524288|1|iommu|0"
    "twons|1|2|512||524288|64|iommu|64"
    "twoctrl|2|1|512||524288|64|iommu|64"
    "fourctrl|4|1|512||524288|64|iommu|64"
    "nskinds|1|4|512||524288|64|iommu|64"
    "noiommu|1|1|512||524288|64|noiommu|64"
)

usage() {
    sed -n '3,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

only="" noiommu=yes perf_ios=4096 timeout_s=900 logs=""
while [ $# -gt 0 ]; do
    case "$1" in
        --only) only=$2; shift 2 ;;
        --no-noiommu) noiommu=no; shift ;;
        --perf-ios) perf_ios=$2; shift 2 ;;
        --timeout) timeout_s=$2; shift 2 ;;
        --no-build) export GPUNVME_QEMU_NO_BUILD=1; shift ;;
        --logs) logs=$2; shift 2 ;;
        --list)
            printf '%s\n' "${CONFIGS[@]}" | cut -d'|' -f1
            exit 0
            ;;
        -h | --help) usage 0 ;;
        *) log "unknown argument $1"; usage 2 ;;
    esac
done
[[ $perf_ios =~ ^[0-9]+$ ]] || die "--perf-ios takes a number"
for want in ${only//,/ }; do
    printf '%s\n' "${CONFIGS[@]}" | cut -d'|' -f1 | grep -qx "$want" ||
        die "no configuration named $want (see --list)"
done

ensure_host_tools ""
ensure_release_build
[ -x "$RELEASE_DIR/gpunvme" ] || die "$RELEASE_DIR/gpunvme is missing"
mkdir -p "$CACHE_DIR"
fetch_kernel

work=$(mktemp -d "${TMPDIR:-/tmp}/gpunvme-qemu-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
[ -n "$logs" ] || logs="$work/logs"
mkdir -p "$logs"

passed=0 failed=0
declare -a failures=()

record() { # record PASS|FAIL TEXT
    printf '%s %s\n' "$1" "$2"
    if [ "$1" = PASS ]; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        failures+=("$2")
    fi
}

# run_config LINE: boot one configuration's guest and turn its result lines into ours.
run_config() {
    local name ctrls nss lba opts mdts qpairs mode hugepages token vfio_ko="" rc=0 cdir line any=0 fails=0
    IFS='|' read -r name ctrls nss lba opts mdts qpairs mode hugepages <<<"$1"
    cdir="$work/$name"
    mkdir -p "$cdir"
    if [ "$mode" = noiommu ]; then
        if ! vfio_ko=$("$QEMU_LIB_DIR/qemu-noiommu.sh" "$KVER"); then
            record FAIL "[$name] building vfio.ko with CONFIG_VFIO_NOIOMMU"
            return
        fi
    fi
    token=$(od -An -tx8 -N8 /dev/urandom | tr -d ' ')
    cat >"$cdir/run.sh" <<EOF
export GN_TOKEN=$token EXPECT_CTRLS=$ctrls EXPECT_NS=$nss EXPECT_LBA=$lba
export EXPECT_MDTS=$mdts EXPECT_QPAIRS=$qpairs PERF_IOS=$perf_ios
export NEGATIVE=$([ "$name" = default ] && echo 1 || echo 0)
export SETUP_SH=$([ "$name" = default ] && echo 1 || echo 0)
export BLOCKFS=$([ "$name" = default ] || [ "$name" = lba4k ] && echo 1 || echo 0)
export VOLUME=$([ "$name" = twoctrl ] || [ "$name" = fourctrl ] && echo 1 || echo 0)
export SERVE=$([ "$name" = default ] && echo 1 || echo 0)
. /usr/share/gpunvme/$([ "$name" = nskinds ] && echo nskinds.sh || echo suite.sh)
EOF
    build_initramfs "$cdir/initrd.cpio" "$mode" test "$cdir/run.sh" "$vfio_ko"
    local devs=()
    devs=()
    local kinds=""
    # nskinds: 512+8 with PI type 1, 4096+8 with PI type 3 in the first 8 bytes, 4096+64
    # separate metadata, zoned (4 MiB zones);
    # QEMU reports host misuse of its NVMe model as pci_nvme_ub_* trace events, counted below.
    [ "$name" = nskinds ] &&
        kinds="512:ms=8,pi=1 4096:ms=8,pi=3,pil=1 4096:ms=64 4096:zoned=true,zoned.zone_size=4M,zoned.zone_capacity=4M"
    nvme_qemu_args devs "$cdir" "$ctrls" "$nss" "$lba" 64M "$opts" "$kinds"
    # The default configuration too: its serve step (a daemon owning the controller, clients
    # killed mid-I/O) must not make QEMU see host misuse either.
    { [ "$name" = nskinds ] || [ "$name" = default ]; } && devs+=(-trace "pci_nvme_ub_*")
    # A PCI device that is not an NVMe controller, for the suite's refusal checks.
    [ "$name" = default ] && devs+=(-device edu)
    log "==== $name: booting (controllers=$ctrls namespaces=$nss lba=$lba ${opts:+$opts }mode=$mode hugepages=$hugepages)"
    local start=$SECONDS
    GPUNVME_QEMU_HUGEPAGES=$hugepages boot_guest "$logs/$name.log" "$timeout_s" "$mode" nvme \
        "$cdir/initrd.cpio" "${devs[@]}" || rc=$?
    while IFS= read -r line; do
        line=${line%$'\r'}
        case "$line" in
            "GN-RESULT $token PASS "*) record PASS "[$name] ${line#"GN-RESULT $token PASS "}"; any=1 ;;
            "GN-RESULT $token FAIL "*)
                record FAIL "[$name] ${line#"GN-RESULT $token FAIL "}"
                any=1 fails=$((fails + 1))
                ;;
        esac
    done <"$logs/$name.log"
    if [ "$name" = nskinds ] || [ "$name" = default ]; then
        local ub
        ub=$(grep -c 'pci_nvme_ub_' "$logs/$name.log" || true)
        if [ "$ub" = 0 ]; then
            record PASS "[$name] QEMU reported no pci_nvme_ub_* (host misuse) events"
        else
            record FAIL "[$name] QEMU reported $ub pci_nvme_ub_* events: $(grep -m 3 'pci_nvme_ub_' \
                "$logs/$name.log" | tr -d '\r' | tr '\n' ' ')"
        fi
    fi
    case "$rc" in
        0) ;;
        124) record FAIL "[$name] guest did not finish within ${timeout_s}s" ;;
        125) record FAIL "[$name] guest ended without an exit status (panic or crash)" ;;
        1)
            # The suite exits 1 only after a FAIL line; if none arrived, say so.
            [ "$fails" -gt 0 ] || record FAIL "[$name] suite failed (no FAIL line seen; any=$any)"
            ;;
        *) record FAIL "[$name] guest setup failed (status $rc)" ;;
    esac
    if [ "$rc" -ne 0 ]; then
        log "---- $name: last lines of the guest console ($logs/$name.log)"
        tr -d '\r' <"$logs/$name.log" | grep -v '^GN-RESULT ' | tail -n 40 >&2
    fi
    log "==== $name: $((SECONDS - start))s"
}

for cfg in "${CONFIGS[@]}"; do
    name=${cfg%%|*}
    if [ -n "$only" ]; then
        [[ ",$only," == *",$name,"* ]] || continue
    elif [ "$name" = noiommu ] && [ "$noiommu" != yes ]; then
        log "==== noiommu: skipped (--no-noiommu)"
        continue
    fi
    run_config "$cfg"
done

echo
if [ "$failed" -gt 0 ]; then
    echo "Failures:"
    printf '  %s\n' "${failures[@]}"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$passed" -gt 0 ]
