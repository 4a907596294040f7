# shellcheck shell=dash
#
# Helpers for scripts that run inside the QEMU test guest (busybox ash); sourced by /init, by
# the integration suite and by commands given to scripts/qemu-run.sh
# (`. /usr/share/gpunvme/lib.sh`). Every wait is bounded.
#
#   gn_nvme_bdfs                 PCI addresses of the NVMe controllers (class 0x010802), sorted
#   gn_driver BDF                the driver bound to BDF, or "none"
#   gn_bind BDF vfio-pci|nvme    move BDF to that driver (driver_override + drivers_probe)
#   gn_blockdev BDF NSID [SECS]  /dev path of namespace NSID through the kernel driver, waiting
#                                (bounded) for the kernel to find it after a bind
#   gn_iommu_group BDF           the IOMMU group number ("" in no-IOMMU mode before binding)
#   gn_load_vfio iommu|noiommu   load the VFIO stack
#   gn_drain_console             wait until the serial port has sent everything written so far

# PCI addresses of all NVMe controllers: class 01 (storage), subclass 08 (NVM), interface 02
# (NVMe). Found by class, never by a fixed address: it depends on the QEMU command line.
gn_nvme_bdfs() {
    local dev
    for dev in /sys/bus/pci/devices/*; do
        [ "$(cat "$dev/class" 2>/dev/null)" = 0x010802 ] && echo "${dev##*/}"
    done | sort
}

gn_driver() {
    local link
    link=$(readlink "/sys/bus/pci/devices/$1/driver" 2>/dev/null) || {
        echo none
        return 0
    }
    echo "${link##*/}"
}

# gn_bind BDF DRIVER: unbind BDF from its driver (which waits until no process holds it open,
# hence the timeout) and probe it again with DRIVER forced through driver_override.
gn_bind() {
    local bdf=$1 drv=$2 dev="/sys/bus/pci/devices/$1" i=0
    [ -d "$dev" ] || {
        echo "gn_bind: no PCI device $bdf" >&2
        return 1
    }
    [ "$(gn_driver "$bdf")" = "$drv" ] && return 0
    echo "$drv" >"$dev/driver_override" || return 1
    if [ "$(gn_driver "$bdf")" != none ]; then
        if ! timeout 60 sh -c "echo $bdf > $dev/driver/unbind"; then
            echo "gn_bind: unbinding $bdf from $(gn_driver "$bdf") failed or hung" >&2
            return 1
        fi
    fi
    echo "$bdf" >/sys/bus/pci/drivers_probe 2>/dev/null
    while [ "$(gn_driver "$bdf")" != "$drv" ]; do
        i=$((i + 1))
        if [ $i -gt 100 ]; then
            echo "gn_bind: $bdf did not bind to $drv (driver: $(gn_driver "$bdf"))" >&2
            return 1
        fi
        sleep 0.1
    done
}

# gn_blockdev BDF NSID [SECS]: the block device of namespace NSID on controller BDF, once the
# kernel has created it. The kernel finds namespaces asynchronously after a bind, and names
# the disk after the subsystem and an instance number, not after the NSID; with multipath the
# per-controller path node (nvmeScCnN) is hidden and the usable disk is nvmeSnN.
gn_blockdev() {
    local bdf=$1 nsid=$2 secs=${3:-30} i=0 path name
    while [ $i -lt $((secs * 10)) ]; do
        for path in /sys/bus/pci/devices/"$bdf"/nvme/nvme*/nvme*n*; do
            [ -e "$path/nsid" ] || continue
            [ "$(cat "$path/nsid")" = "$nsid" ] || continue
            name=$(echo "${path##*/}" | sed 's/c[0-9]*n/n/')
            if [ -b "/dev/$name" ] && [ "$(cat "/sys/block/$name/size" 2>/dev/null)" != 0 ]; then
                echo "/dev/$name"
                return 0
            fi
        done
        i=$((i + 1))
        sleep 0.1
    done
    echo "gn_blockdev: namespace $nsid of $bdf has no block device after ${secs}s" >&2
    return 1
}

gn_iommu_group() {
    local link
    link=$(readlink "/sys/bus/pci/devices/$1/iommu_group" 2>/dev/null) || return 0
    echo "${link##*/}"
}

# Module order comes from the modules.dep that the host generated for this initramfs. busybox
# modprobe does not read options from the kernel command line, so vfio's no-IOMMU switch is
# passed here (it needs the vfio.ko the host rebuilt with CONFIG_VFIO_NOIOMMU).
gn_load_vfio() {
    if [ "$1" = noiommu ]; then
        modprobe vfio enable_unsafe_noiommu_mode=1 || return 1
    else
        modprobe vfio || return 1
        modprobe vfio_iommu_type1 || return 1
    fi
    modprobe vfio-pci
}

# The serial driver sends what the tty layer holds at its own pace, and `poweroff -f` does not
# wait for it. Wait until the port's transmit counter stops moving (bounded: 5 s).
gn_drain_console() {
    local last=-1 now stable=0 i=0
    while [ $i -lt 50 ] && [ $stable -lt 3 ]; do
        now=$(sed -n 's/^0:.* tx:\([0-9]*\).*/\1/p' /proc/tty/driver/serial 2>/dev/null)
        if [ "$now" = "$last" ]; then
            stable=$((stable + 1))
        else
            stable=0
        fi
        last=$now
        i=$((i + 1))
        sleep 0.1
    done
}
