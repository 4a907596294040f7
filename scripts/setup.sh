#!/usr/bin/env bash
#
# setup.sh: prepare a machine for gpunvme's VFIO driver, and undo it.
#
# Usage:
#   scripts/setup.sh bind ADDR      give NVMe controller ADDR to vfio-pci (from nvme or no driver)
#   scripts/setup.sh unbind ADDR    give it back to the kernel's nvme driver
#   scripts/setup.sh status         NVMe controllers, their drivers, IOMMU groups, hugepages
#   scripts/setup.sh hugepages N    reserve N 2 MiB hugepages for DMA memory
#
# ADDR is a PCI address, DDDD:BB:DD.F or BB:DD.F (see `lspci -D -d ::0108`).
#
# `bind` checks before it touches anything: the address is well formed and exists, the
# function is an NVMe controller (class 0x010802), an IOMMU is on (or vfio's unsafe no-IOMMU
# mode is enabled), every other device in its IOMMU group is unbound or bound to a driver VFIO
# accepts, and none of the controller's namespaces (or their partitions) is mounted, used as
# swap, or held by device-mapper/md. Binding uses driver_override, so the choice survives a
# re-probe and nothing else is bound to vfio-pci by accident.
#
# Every wait is bounded. bind, unbind and hugepages need root. For tests, GPUNVME_SYSFS and
# GPUNVME_PROCFS point the script at another sysfs and procfs.
set -euo pipefail

SYS=${GPUNVME_SYSFS:-/sys}
PROC=${GPUNVME_PROCFS:-/proc}
NVME_CLASS=0x010802
HUGEPAGES_DIR="$SYS/kernel/mm/hugepages/hugepages-2048kB"
# Drivers VFIO accepts on the other devices of a group.
GROUP_OK_DRIVERS=" vfio-pci pci-stub pcieport "
# How long to wait for a driver to bind, in tenths of a second.
BIND_WAIT_TENTHS=${GPUNVME_BIND_WAIT_TENTHS:-100}

die() {
    echo "setup.sh: error: $*" >&2
    exit 1
}

say() {
    echo "setup.sh: $*"
}

usage() {
    sed -n '3,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

# normalize_addr ADDR: print the canonical DDDD:BB:DD.F form, or fail with a one-line error.
normalize_addr() {
    local a=$1 lower
    lower=$(printf '%s' "$a" | tr 'A-F' 'a-f')
    if [[ $lower =~ ^([0-9a-f]{1,4}:)?[0-9a-f]{1,2}:[0-1]?[0-9a-f]\.[0-7]$ ]]; then
        local dom bus dev fn rest
        if [[ $lower == *:*:* ]]; then
            dom=${lower%%:*}
            rest=${lower#*:}
        else
            dom=0
            rest=$lower
        fi
        bus=${rest%%:*}
        rest=${rest#*:}
        dev=${rest%%.*}
        fn=${rest#*.}
        if ((16#$dev > 31)); then
            die "\`$a\` is not a PCI address (device must be 00-1f): expected DDDD:BB:DD.F or BB:DD.F in hex, e.g. 0000:01:00.0"
        fi
        printf '%04x:%02x:%02x.%x\n' "$((16#$dom))" "$((16#$bus))" "$((16#$dev))" "$fn"
    else
        die "\`$a\` is not a PCI address: expected DDDD:BB:DD.F or BB:DD.F in hex, e.g. 0000:01:00.0"
    fi
}

dev_dir() {
    echo "$SYS/bus/pci/devices/$1"
}

# driver_of ADDR: the bound driver's name, or "none".
driver_of() {
    local link
    link=$(readlink "$(dev_dir "$1")/driver" 2>/dev/null) || {
        echo none
        return 0
    }
    echo "${link##*/}"
}

# group_of ADDR: the IOMMU group number, or "" when there is none.
group_of() {
    local link
    link=$(readlink "$(dev_dir "$1")/iommu_group" 2>/dev/null) || return 0
    echo "${link##*/}"
}

noiommu_enabled() {
    [ "$(cat "$SYS/module/vfio/parameters/enable_unsafe_noiommu_mode" 2>/dev/null)" = Y ]
}

iommu_present() {
    [ -n "$(names_in "$SYS/kernel/iommu_groups")" ]
}

require_root() {
    [ "${GPUNVME_SYSFS:-}" ] && return 0 # test trees are writable by their owner
    [ "$(id -u)" = 0 ] || die "$1 needs root: run it with sudo"
}

# check_nvme ADDR: the function exists and is an NVMe controller.
check_nvme() {
    local addr=$1 class
    [ -d "$(dev_dir "$addr")" ] ||
        die "no PCI device at $addr: list NVMe controllers with \`lspci -D -d ::0108\` or \`$0 status\`"
    class=$(cat "$(dev_dir "$addr")/class")
    [ "$class" = "$NVME_CLASS" ] || die "$addr is not an NVMe controller (class $class)"
}

# names_in DIR: the entries of DIR on one line, space-separated ("" if none or no DIR).
names_in() {
    local e out=""
    for e in "$1"/*; do
        [ -e "$e" ] || [ -L "$e" ] || continue
        out="$out${out:+ }${e##*/}"
    done
    echo "$out"
}

# names_on_one_line TEXT: the words of TEXT separated by single spaces.
names_on_one_line() {
    # shellcheck disable=SC2086 # word splitting is the point
    set -- $1
    echo "$*"
}

# namespace_disks ADDR: block device names (nvme0n1, ...) of the controller's namespaces. With
# native multipath the per-path node is nvme0c0n1 (hidden); the disk is named nvme0n1.
namespace_disks() {
    local path name
    for path in "$(dev_dir "$1")"/nvme/nvme*/nvme*n*; do
        [ -e "$path" ] || continue
        name=${path##*/}
        if [[ $name =~ ^(nvme[0-9]+)c[0-9]+(n[0-9]+)$ ]]; then
            name=${BASH_REMATCH[1]}${BASH_REMATCH[2]}
        fi
        echo "$name"
    done | sort -u
}

# check_not_in_use ADDR: refuse if any namespace or partition is mounted, swap or held.
check_not_in_use() {
    local addr=$1 disk part parts busy=""
    for disk in $(namespace_disks "$addr"); do
        parts="$disk"
        for part in "$SYS/block/$disk"/"$disk"p*; do
            [ -e "$part" ] && parts="$parts ${part##*/}"
        done
        for part in $parts; do
            if awk -v d="/dev/$part" '$1 == d { found = 1 } END { exit !found }' "$PROC/mounts" 2>/dev/null; then
                busy="$busy /dev/$part (mounted on $(awk -v d="/dev/$part" '$1 == d { print $2; exit }' "$PROC/mounts"))"
            fi
            if awk -v d="/dev/$part" '$1 == d { found = 1 } END { exit !found }' "$PROC/swaps" 2>/dev/null; then
                busy="$busy /dev/$part (swap)"
            fi
            if [ "$part" = "$disk" ] && [ -n "$(names_in "$SYS/block/$disk/holders")" ]; then
                busy="$busy /dev/$part (held by $(names_in "$SYS/block/$disk/holders"))"
            fi
            if [ "$part" != "$disk" ] && [ -n "$(names_in "$SYS/block/$disk/$part/holders")" ]; then
                busy="$busy /dev/$part (held by $(names_in "$SYS/block/$disk/$part/holders"))"
            fi
        done
    done
    [ -z "$busy" ] || die "refusing to take $addr: in use:$busy; unmount it (or swapoff) first"
}

# check_group_viable ADDR: every other member of the group is unbound or on an accepted driver.
check_group_viable() {
    local addr=$1 group member name drv blockers=""
    group=$(group_of "$addr")
    [ -n "$group" ] || return 0
    for member in "$SYS/kernel/iommu_groups/$group/devices"/*; do
        [ -e "$member" ] || continue
        name=${member##*/}
        [ "$name" = "$addr" ] && continue
        drv=$(driver_of "$name")
        case "$GROUP_OK_DRIVERS" in *" $drv "*) continue ;; esac
        [ "$drv" = none ] && continue
        blockers="$blockers $name ($drv)"
    done
    [ -z "$blockers" ] ||
        die "IOMMU group $group of $addr is not viable: also holds$blockers; bind those to vfio-pci too (or unbind them) first"
}

# check_iommu: an IOMMU is on, or vfio's no-IOMMU mode is enabled.
check_iommu() {
    iommu_present || noiommu_enabled ||
        die "no IOMMU: enable it (intel_iommu=on or amd_iommu=on on the kernel command line, and VT-d/AMD-Vi in the firmware), or for no-IOMMU mode (unsafe): modprobe vfio enable_unsafe_noiommu_mode=1"
}

# wait_driver ADDR DRIVER: bounded wait until ADDR is bound to DRIVER.
wait_driver() {
    local addr=$1 want=$2 i=0
    while [ "$(driver_of "$addr")" != "$want" ]; do
        i=$((i + 1))
        [ $i -le "$BIND_WAIT_TENTHS" ] ||
            die "$addr did not bind to $want within $((BIND_WAIT_TENTHS / 10)) s (driver: $(driver_of "$addr"))"
        sleep 0.1
    done
}

# load_driver NAME MODULE: make sure the driver is registered.
load_driver() {
    [ -d "$SYS/bus/pci/drivers/$1" ] && return 0
    command -v modprobe >/dev/null || die "driver $1 is not loaded and there is no modprobe"
    modprobe "$2" || die "cannot load module $2"
    [ -d "$SYS/bus/pci/drivers/$1" ] || die "module $2 loaded but driver $1 did not appear"
    say "loaded module $2"
}

# holders_of_group GROUP: PIDs with /dev/vfio/GROUP (or noiommu-GROUP) open, other than this
# script (which may have inherited such a descriptor) and its subshells.
holders_of_group() {
    local group=$1 fd pid pids=""
    for fd in "$PROC"/[0-9]*/fd/*; do
        case "$(readlink "$fd" 2>/dev/null)" in
            /dev/vfio/"$group" | /dev/vfio/noiommu-"$group")
                pid=${fd#"$PROC"/}
                pid=${pid%%/*}
                [ "$pid" = $$ ] || [ "$pid" = "$BASHPID" ] || pids="$pids $pid"
                ;;
        esac
    done
    echo "$pids" | tr ' ' '\n' | sort -un | tr '\n' ' ' | sed 's/^ *//; s/ *$//'
}

# unbind_current ADDR: detach ADDR from its driver (bounded: an unbind from vfio-pci blocks while
# a process holds the device).
unbind_current() {
    local addr=$1 drv
    drv=$(driver_of "$addr")
    [ "$drv" = none ] && return 0
    if ! timeout 30 sh -c "echo '$addr' > '$(dev_dir "$addr")/driver/unbind'"; then
        die "unbinding $addr from $drv failed or did not finish in 30 s"
    fi
    say "unbound $addr from $drv"
}

cmd_bind() {
    local addr group drv
    addr=$(normalize_addr "$1")
    check_nvme "$addr"
    drv=$(driver_of "$addr")
    if [ "$drv" = vfio-pci ]; then
        group=$(group_of "$addr")
        say "$addr is already bound to vfio-pci (IOMMU group ${group:-?}); nothing to do"
        return 0
    fi
    check_iommu
    check_group_viable "$addr"
    check_not_in_use "$addr"
    require_root "bind"

    load_driver vfio-pci vfio-pci
    echo vfio-pci >"$(dev_dir "$addr")/driver_override"
    say "set driver_override of $addr to vfio-pci"
    unbind_current "$addr"
    # A failed probe shows up in wait_driver, with the driver the device ended up on.
    echo "$addr" >"$SYS/bus/pci/drivers_probe" 2>/dev/null || true
    wait_driver "$addr" vfio-pci
    group=$(group_of "$addr")
    if [ -z "$group" ]; then
        say "bound $addr to vfio-pci, but it has no IOMMU group: VFIO cannot use it (see \`$0 status\`)"
        exit 1
    fi
    local file="/dev/vfio/$group"
    [ -e "$file" ] || [ ! -e "/dev/vfio/noiommu-$group" ] || file="/dev/vfio/noiommu-$group"
    say "bound $addr to vfio-pci: IOMMU group $group, $file"
    if [ "$file" = "/dev/vfio/noiommu-$group" ]; then
        say "no-IOMMU mode: the device can DMA anywhere; gpunvme must run as root"
    fi
    say "to use it without root: chown \$USER $file and raise the memlock limit (ulimit -l)"
}

cmd_unbind() {
    local addr group drv pids
    addr=$(normalize_addr "$1")
    check_nvme "$addr"
    drv=$(driver_of "$addr")
    [ "$drv" = vfio-pci ] || die "$addr is bound to ${drv/#none/no driver}, not vfio-pci: nothing to unbind"
    group=$(group_of "$addr")
    if [ -n "$group" ]; then
        pids=$(holders_of_group "$group")
        [ -z "$pids" ] || die "$addr is in use: /dev/vfio/$group is open in process(es) $pids; stop them first"
    fi
    require_root "unbind"

    load_driver nvme nvme
    echo >"$(dev_dir "$addr")/driver_override"
    say "cleared driver_override of $addr"
    unbind_current "$addr"
    # A failed probe shows up in wait_driver, with the driver the device ended up on.
    echo "$addr" >"$SYS/bus/pci/drivers_probe" 2>/dev/null || true
    wait_driver "$addr" nvme
    say "bound $addr to nvme"
    # Namespaces appear asynchronously; list what is there after a short bounded wait.
    local i=0 disks=""
    while [ $i -lt 50 ]; do
        disks=$(names_on_one_line "$(namespace_disks "$addr")")
        [ -n "$disks" ] && break
        i=$((i + 1))
        sleep 0.1
    done
    say "namespaces: ${disks:-none yet}"
}

cmd_status() {
    local any=0 dev addr drv group file disks
    if iommu_present; then
        say "IOMMU: on ($(names_in "$SYS/kernel/iommu_groups" | wc -w) groups)"
    elif noiommu_enabled; then
        say "IOMMU: none; vfio no-IOMMU mode enabled (unsafe)"
    else
        say "IOMMU: none (enable intel_iommu=on / amd_iommu=on, or vfio enable_unsafe_noiommu_mode=1)"
    fi
    if [ -d "$SYS/bus/pci/drivers/vfio-pci" ]; then
        say "vfio-pci: loaded"
    else
        say "vfio-pci: not loaded (bind loads it)"
    fi
    if [ -d "$HUGEPAGES_DIR" ]; then
        say "hugepages (2 MiB): $(cat "$HUGEPAGES_DIR/free_hugepages") free of $(cat "$HUGEPAGES_DIR/nr_hugepages")"
    else
        say "hugepages (2 MiB): not supported by this kernel"
    fi
    say "memlock limit: $(ulimit -l) KiB"
    for dev in "$SYS"/bus/pci/devices/*; do
        [ "$(cat "$dev/class" 2>/dev/null)" = "$NVME_CLASS" ] || continue
        any=1
        addr=${dev##*/}
        drv=$(driver_of "$addr")
        group=$(group_of "$addr")
        file=""
        if [ -n "$group" ]; then
            if [ -e "/dev/vfio/$group" ]; then
                file=" /dev/vfio/$group"
            elif [ -e "/dev/vfio/noiommu-$group" ]; then
                file=" /dev/vfio/noiommu-$group"
            fi
        fi
        disks=$(names_on_one_line "$(namespace_disks "$addr")")
        say "$addr driver=$drv iommu_group=${group:-none}$file${disks:+ namespaces: $disks}"
    done
    [ "$any" = 1 ] || say "no NVMe controllers found"
}

cmd_hugepages() {
    local n=$1 got
    [[ $n =~ ^[0-9]+$ ]] || die "\`$n\` is not a number of hugepages"
    [ -d "$HUGEPAGES_DIR" ] || die "this kernel has no 2 MiB hugepages ($HUGEPAGES_DIR missing)"
    require_root "hugepages"
    echo "$n" >"$HUGEPAGES_DIR/nr_hugepages"
    got=$(cat "$HUGEPAGES_DIR/nr_hugepages")
    if [ "$got" -lt "$n" ]; then
        say "reserved only $got of $n 2 MiB hugepages (memory is fragmented; retry early after boot, or add hugepages=$n to the kernel command line)"
        exit 1
    fi
    say "reserved $got 2 MiB hugepages ($((got * 2)) MiB), $(cat "$HUGEPAGES_DIR/free_hugepages") free"
}

[ $# -gt 0 ] || usage 2
case "$1" in
    bind | unbind)
        [ $# -eq 2 ] || die "usage: $0 $1 ADDR"
        "cmd_$1" "$2"
        ;;
    status)
        [ $# -eq 1 ] || die "usage: $0 status"
        cmd_status
        ;;
    hugepages)
        [ $# -eq 2 ] || die "usage: $0 hugepages N"
        cmd_hugepages "$2"
        ;;
    -h | --help | help) usage 0 ;;
    *)
        echo "setup.sh: unknown command \`$1\`" >&2
        usage 2
        ;;
esac
