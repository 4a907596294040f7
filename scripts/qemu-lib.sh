# shellcheck shell=bash
#
# Shared host-side pieces of the QEMU harness, sourced by scripts/qemu-run.sh,
# scripts/qemu-test.sh and scripts/qemu-bench.sh. Not meant to be run on its own.
#
# What it does:
#   - installs the host tools it needs (apt; only what `command -v` cannot find);
#   - fetches Debian's guest kernel (`apt-get download` + `dpkg-deb -x`, never installed),
#     resolving the version from linux-image-amd64's dependency, and caches it under
#     .cache/qemu/kernel/<version>/ with modules.dep (depmod) and an uncompressed vmlinux
#     (booted through PVH: faster under TCG than the bzImage);
#   - builds an uncompressed initramfs: busybox, the kernel modules that VFIO and the nvme
#     driver need, nvme-cli, jq and bash (fio too for benchmarks) with their shared libraries
#     (ldd), our release binaries and examples, scripts/setup.sh (as
#     /opt/gpunvme/scripts/setup.sh) and the guest scripts of scripts/guest/;
#   - boots it under TCG (this machine's /dev/kvm cannot run stock guests) with QEMU's nvme
#     device behind an emulated Intel IOMMU, under a timeout, and reads back the exit status
#     of the guest command from a marker line on the serial console.
#
# Environment:
#   GPUNVME_QEMU_CACHE   cache folder (default: <repo>/.cache/qemu)
#   GPUNVME_QEMU_SMP     guest CPUs (default 2)
#   GPUNVME_QEMU_MEM     guest memory (default 1024M)
#   GPUNVME_QEMU_HUGEPAGES  2 MiB hugepages the guest reserves (default 64; 0 leaves the
#                        driver to fall back to 4 KiB pages)
#   QEMU                 the QEMU binary (default qemu-system-x86_64)
#   CARGO_TARGET_DIR     where the release binaries are (default <repo>/target)

QEMU_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$QEMU_LIB_DIR/.." && pwd)
GUEST_DIR="$QEMU_LIB_DIR/guest"
CACHE_DIR=${GPUNVME_QEMU_CACHE:-$REPO_ROOT/.cache/qemu}
QEMU=${QEMU:-qemu-system-x86_64}
# Where cargo put the release binaries that go into the guest.
RELEASE_DIR="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release"
# depmod and friends live in sbin, which a non-root PATH may lack.
PATH="$PATH:/usr/sbin:/sbin"

log() { printf '%s\n' "$*" >&2; }
# With `set -e`, say where a script stopped instead of exiting silently.
set -E
trap 'printf "%s: error: line %s: %s failed\n" "${0##*/}" "$LINENO" "$BASH_COMMAND" >&2' ERR
die() {
    printf '%s: error: %s\n' "${0##*/}" "$*" >&2
    exit 2
}

# Run a command as root: directly when we are root (CI), through sudo otherwise.
as_root() {
    if [ "$(id -u)" = 0 ]; then
        "$@"
    else
        sudo "$@"
    fi
}

# ensure_host_tools fio|"": install what is missing (fio too when asked). Each entry is
# command:package.
ensure_host_tools() {
    local wanted=(qemu-system-x86_64:qemu-system-x86 nvme:nvme-cli jq:jq cpio:cpio
        depmod:kmod xz:xz-utils dpkg-deb:dpkg apt-get:apt)
    local entry cmd pkg missing=()
    if [ "$1" = fio ]; then
        wanted+=(fio:fio)
    fi
    for entry in "${wanted[@]}"; do
        cmd=${entry%%:*}
        pkg=${entry#*:}
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
    done
    # The guest needs the static busybox (the dynamic one would need its libraries).
    [ -x /bin/busybox ] && dpkg -s busybox-static >/dev/null 2>&1 || missing+=(busybox-static)
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing host packages: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 ||
        die "apt-get update failed"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >&2 || die "apt-get install ${missing[*]} failed"
}

# The kernel package that linux-image-amd64 currently depends on, e.g. linux-image-6.1.0-56-amd64.
# Falls back to the newest cached kernel when apt knows nothing (offline, no lists).
resolve_kernel_package() {
    local pkg
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
        awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    if [ -z "$pkg" ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || true
        pkg=$(apt-cache depends linux-image-amd64 2>/dev/null |
            awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    fi
    if [ -z "$pkg" ]; then
        local cached
        cached=$(find "$CACHE_DIR/kernel" -mindepth 2 -maxdepth 2 -name ready 2>/dev/null |
            sort -V | tail -n 1)
        [ -n "$cached" ] || die "cannot resolve linux-image-amd64's kernel package"
        cached=${cached%/ready}
        pkg="linux-image-${cached##*/}"
    fi
    echo "$pkg"
}

# fetch_kernel: sets KVER and KERNEL_DIR (holding vmlinux and root/lib/modules/$KVER).
fetch_kernel() {
    local pkg tmp deb off
    pkg=$(resolve_kernel_package)
    KVER=${pkg#linux-image-}
    KERNEL_DIR="$CACHE_DIR/kernel/$KVER"
    [ -f "$KERNEL_DIR/ready" ] && return 0
    # One download at a time: several harness runs may share the cache. The lock is released
    # when this shell exits.
    mkdir -p "$CACHE_DIR/kernel"
    exec 8>"$CACHE_DIR/kernel/.lock"
    flock 8
    [ -f "$KERNEL_DIR/ready" ] && return 0
    log "fetching guest kernel $pkg"
    rm -rf "$KERNEL_DIR"
    mkdir -p "$KERNEL_DIR"
    tmp=$(mktemp -d "$CACHE_DIR/dl.XXXXXX")
    # apt's sandbox user may not write into our folder; downloading as root then only warns.
    (cd "$tmp" && apt-get download "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2) ||
        true
    deb=$(find "$tmp" -maxdepth 1 -name "${pkg}_*.deb" | head -n 1)
    [ -n "$deb" ] || die "apt-get download $pkg failed"
    dpkg-deb -x "$deb" "$KERNEL_DIR/root" || die "dpkg-deb -x $deb failed"
    # The package version, for the no-IOMMU build's source and headers (qemu-noiommu.sh).
    dpkg-deb -f "$deb" Version >"$KERNEL_DIR/deb-version"
    rm -rf "$tmp"
    # The .deb ships no modules.dep: it is generated at install time.
    depmod -b "$KERNEL_DIR/root" "$KVER" || die "depmod failed"
    cp "$KERNEL_DIR/root/boot/vmlinuz-$KVER" "$KERNEL_DIR/vmlinuz"
    # The bzImage carries the kernel as an xz stream; unpacked, the ELF vmlinux boots through
    # its PVH entry point and skips the decompressor, which is slow under TCG.
    off=$(LC_ALL=C grep -obaP '\xfd7zXZ\x00' "$KERNEL_DIR/vmlinuz" | head -n 1 | cut -d: -f1)
    if [ -n "$off" ]; then
        # xz complains about the bytes after the stream; the stream itself is complete.
        tail -c +$((off + 1)) "$KERNEL_DIR/vmlinuz" | xz -dc >"$KERNEL_DIR/vmlinux" 2>/dev/null || true
    fi
    if [ "$(head -c 4 "$KERNEL_DIR/vmlinux" 2>/dev/null | od -An -c | tr -d ' ')" != 177ELF ]; then
        log "could not unpack vmlinux; booting the bzImage"
        rm -f "$KERNEL_DIR/vmlinux"
    fi
    touch "$KERNEL_DIR/ready"
}

# The kernel image QEMU boots.
kernel_image() {
    if [ -f "$KERNEL_DIR/vmlinux" ]; then
        echo "$KERNEL_DIR/vmlinux"
    else
        echo "$KERNEL_DIR/vmlinuz"
    fi
}

# copy_libs ROOT FILE...: copy every shared library that ldd lists for FILEs (the dynamic
# loader included) to the same path under ROOT. Static binaries and scripts have none.
copy_libs() {
    local root=$1 f lib
    shift
    for f in "$@"; do
        for lib in $(ldd "$f" 2>/dev/null | grep -oE '/[^ ]+' || true); do
            [ -e "$root$lib" ] && continue
            mkdir -p "$root$(dirname "$lib")"
            cp -L "$lib" "$root$lib"
        done
    done
}

# copy_with_libs ROOT FILE...: FILEs at the same paths under ROOT, with their libraries.
copy_with_libs() {
    local root=$1 f
    shift
    for f in "$@"; do
        mkdir -p "$root$(dirname "$f")"
        cp -L "$f" "$root$f"
    done
    copy_libs "$root" "$@"
}

# stage_base ROOT MODE FLAVOR [VFIO_KO]: the parts of the guest that do not change between
# runs. MODE iommu|noiommu, FLAVOR test|bench (bench adds fio). VFIO_KO replaces the stock
# vfio.ko (the no-IOMMU rebuild).
stage_base() {
    local root=$1 mode=$2 flavor=$3 vfio_ko=${4:-} applet mods=() m kroot
    mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib,usr/lib64,etc/gpunvme,usr/share/gpunvme}
    mkdir -p "$root"/{proc,sys,dev,tmp,run,root,opt/gpunvme/bin,opt/gpunvme/examples}
    # Debian's merged /usr layout, so that ldd's paths work unchanged.
    ln -s usr/bin "$root/bin"
    ln -s usr/sbin "$root/sbin"
    ln -s usr/lib "$root/lib"
    ln -s usr/lib64 "$root/lib64"
    cp /bin/busybox "$root/usr/bin/busybox"
    for applet in $(/bin/busybox --list); do
        [ "$applet" = busybox ] || ln -sf busybox "$root/usr/bin/$applet"
    done
    copy_with_libs "$root" "$(command -v nvme)" "$(command -v jq)"
    # scripts/setup.sh, with the bash it is written for (busybox has none); every other
    # command it calls (awk, sed, readlink, timeout, modprobe...) is a busybox applet.
    copy_with_libs "$root" "$(command -v bash)"
    install -D -m 755 "$REPO_ROOT/scripts/setup.sh" "$root/opt/gpunvme/scripts/setup.sh"
    if [ "$flavor" = bench ]; then
        copy_with_libs "$root" "$(command -v fio)"
    fi
    # Kernel modules: the closure of what VFIO and the nvme driver need, from modules.dep.
    kroot="$KERNEL_DIR/root/lib/modules/$KVER"
    # msdos and nls_cp437: a FAT file system to mount, for the suite's check that setup.sh
    # refuses a controller with a mounted namespace.
    mods=(vfio vfio_iommu_type1 vfio_pci nvme crc64_rocksoft_generic crct10dif_generic
        msdos nls_cp437)
    for m in "${mods[@]}"; do
        modinfo -b "$KERNEL_DIR/root" -k "$KVER" -F filename "$m" 2>/dev/null || true
    done | while read -r m; do
        [ -n "$m" ] || continue
        m=${m#"$KERNEL_DIR/root"}
        awk -v k="${m#/lib/modules/"$KVER"/}" -F': *' \
            '$1 == k { print $1; n = split($2, d, " "); for (i = 1; i <= n; i++) print d[i] }' \
            "$kroot/modules.dep"
    done | sort -u | while read -r m; do
        mkdir -p "$root/lib/modules/$KVER/$(dirname "$m")"
        cp "$kroot/$m" "$root/lib/modules/$KVER/$m"
    done
    if [ "$mode" = noiommu ]; then
        [ -f "$vfio_ko" ] || die "no-IOMMU mode needs the rebuilt vfio.ko"
        cp "$vfio_ko" "$root/lib/modules/$KVER/kernel/drivers/vfio/vfio.ko"
    fi
    cp "$kroot"/modules.{order,builtin,builtin.modinfo} "$root/lib/modules/$KVER/"
    depmod -b "$root" "$KVER" || die "depmod for the initramfs failed"
    cp "$GUEST_DIR/init" "$root/init"
    chmod 755 "$root/init"
    cp "$GUEST_DIR"/*.sh "$root/usr/share/gpunvme/"
}

# stage_binaries ROOT: our release binaries and examples (whatever `cargo build --release`
# left in target/release), with their shared libraries.
stage_binaries() {
    local root=$1 f name dir
    for dir in "$RELEASE_DIR" "$RELEASE_DIR/examples"; do
        [ -d "$dir" ] || continue
        for f in "$dir"/*; do
            name=${f##*/}
            if [ ! -f "$f" ] || [ ! -x "$f" ]; then
                continue
            fi
            # cargo keeps hash-suffixed copies of examples next to the plain names.
            [[ $name =~ -[0-9a-f]{16}$ ]] && continue
            [[ $name == *.so || $name == *.d ]] && continue
            if [ "$dir" = "$RELEASE_DIR" ]; then
                install -D "$f" "$root/opt/gpunvme/bin/$name"
            else
                install -D "$f" "$root/opt/gpunvme/examples/$name"
            fi
            copy_libs "$root" "$f"
        done
    done
}

# make_cpio DIR OUT: an uncompressed newc archive (faster to boot under TCG than gzip), with
# every file owned by root.
make_cpio() {
    (cd "$1" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$2" ||
        die "cpio of $1 failed"
}

# build_initramfs OUT MODE FLAVOR RUN_SCRIPT [VFIO_KO]: the whole initramfs for one boot.
# RUN_SCRIPT becomes /etc/gpunvme/run.sh, which /init runs.
build_initramfs() {
    local out=$1 mode=$2 flavor=$3 run_script=$4 vfio_ko=${5:-} stage
    stage=$(mktemp -d "${out%/*}/stage.XXXXXX")
    stage_base "$stage" "$mode" "$flavor" "$vfio_ko"
    stage_binaries "$stage"
    cp "$run_script" "$stage/etc/gpunvme/run.sh"
    make_cpio "$stage" "$out"
    rm -rf "$stage"
}

# nvme_qemu_args OUTVAR WORKDIR CTRLS NAMESPACES LBA_SIZE DISK_SIZE EXTRA_CTRL_OPTS [NS_KINDS]
# Fills the array OUTVAR with -drive/-device arguments for CTRLS controllers, each with
# NAMESPACES namespaces of DISK_SIZE bytes (sparse files in WORKDIR) and LBA_SIZE-byte blocks.
# One namespace uses the plain `-device nvme,drive=` form; more use nvme-ns devices. NS_KINDS,
# if given, is one word per namespace, `LBA:NVME_NS_PROPS` (e.g. `512:ms=8,pi=1`), giving that
# namespace its own block size and nvme-ns properties.
nvme_qemu_args() {
    local -n _out=$1
    local work=$2 ctrls=$3 nss=$4 lba=$5 size=$6 extra=$7 kinds=${8:-} c n img blk kind
    _out=()
    blk="logical_block_size=$lba,physical_block_size=$lba"
    for ((c = 0; c < ctrls; c++)); do
        for ((n = 1; n <= nss; n++)); do
            img="$work/nvme$c-ns$n.img"
            truncate -s "$size" "$img"
            _out+=(-drive "file=$img,if=none,id=nvm$c-$n,format=raw,cache=unsafe")
        done
        if [ "$nss" -eq 1 ]; then
            _out+=(-device "nvme,id=nvme$c,serial=gpunvme-$c,drive=nvm$c-1,$blk${extra:+,$extra}")
        else
            _out+=(-device "nvme,id=nvme$c,serial=gpunvme-$c${extra:+,$extra}")
            for ((n = 1; n <= nss; n++)); do
                kind=$(echo "$kinds" | awk -v n="$n" '{print $n}')
                if [ -n "$kind" ]; then
                    blk="logical_block_size=${kind%%:*},physical_block_size=${kind%%:*}"
                    [ -n "${kind#*:}" ] && blk+=",${kind#*:}"
                fi
                _out+=(-device "nvme-ns,drive=nvm$c-$n,bus=nvme$c,nsid=$n,$blk")
            done
        fi
    done
}

# boot_guest LOG TIMEOUT MODE BIND INITRD [QEMU ARGS...]
# Boots one guest and returns the guest command's exit status as read from its marker line;
# 124 when the guest hung past TIMEOUT seconds, 125 when it ended without a marker (crash,
# panic). Serial output goes to LOG; with GPUNVME_QEMU_CONSOLE=1 also to stderr, live.
# A guest whose kernel stops before our init runs (under TCG on a loaded host the kernel's
# early timer check can panic) is booted once more, and says so; any later failure counts.
boot_guest() {
    local logf=$1 timeout_s=$2 mode=$3 bind=$4 initrd=$5 runid append rc r status attempt
    shift 5
    runid=$(od -An -tx8 -N8 /dev/urandom | tr -d ' ')
    # no_timer_check: skip the IO-APIC timer test, which TCG on a busy host can fail (a panic
    # with interrupt remapping on: "timer doesn't work through Interrupt-remapped IO-APIC").
    append="console=ttyS0 panic=-1 quiet init_on_alloc=0 mitigations=off no_timer_check rdinit=/init"
    append+=" gpunvme.runid=$runid gpunvme.mode=$mode gpunvme.bind=$bind"
    append+=" gpunvme.hugepages=${GPUNVME_QEMU_HUGEPAGES:-64}"
    # shellcheck disable=SC2054 # the commas belong to QEMU's option syntax
    local machine=(-machine q35,kernel-irqchip=split)
    if [ "$mode" = iommu ]; then
        append+=" intel_iommu=on iommu=on"
        # The IOMMU must be created before the devices it translates for.
        # shellcheck disable=SC2054
        machine+=(-device intel-iommu,intremap=on,caching-mode=on)
    fi
    local cmd=("$QEMU" "${machine[@]}" -accel tcg -cpu max
        -smp "${GPUNVME_QEMU_SMP:-2}" -m "${GPUNVME_QEMU_MEM:-1024M}"
        -nodefaults -display none -no-reboot -serial stdio
        -kernel "$(kernel_image)" -initrd "$initrd" -append "$append" "$@")
    for attempt in 1 2; do
        rc=0
        if [ "${GPUNVME_QEMU_CONSOLE:-0}" = 1 ]; then
            # QEMU's status travels through a file: a pipeline's status is tee's, or pipefail's.
            {
                r=0
                timeout --kill-after=10 "$timeout_s" "${cmd[@]}" </dev/null 2>&1 || r=$?
                echo "$r" >"$logf.rc"
            } | tee "$logf" >&2
            rc=$(cat "$logf.rc")
            rm -f "$logf.rc"
        else
            timeout --kill-after=10 "$timeout_s" "${cmd[@]}" </dev/null >"$logf" 2>&1 || rc=$?
        fi
        # A hang (timeout) is never retried: it already took the whole time limit.
        if [ "$attempt" = 1 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] &&
            ! grep -q "GPUNVME-INIT $runid" "$logf"; then
            log "guest kernel stopped before init ($(grep -m 1 -o 'Kernel panic.*' "$logf" ||
                echo "exit status $rc")); booting it once more"
            cp "$logf" "$logf.boot1"
            continue
        fi
        break
    done
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        return 124
    fi
    status=$(tr -d '\r' <"$logf" | sed -n "s/^GPUNVME-EXIT $runid \([0-9]*\)\$/\1/p" | tail -n 1)
    [ -n "$status" ] || return 125
    return "$status"
}

# ensure_release_build: build the release binaries unless told not to (GPUNVME_QEMU_NO_BUILD=1).
ensure_release_build() {
    [ "${GPUNVME_QEMU_NO_BUILD:-0}" = 1 ] && return 0
    log "building release binaries (cargo build --release -p gpunvme-cli)"
    (cd "$REPO_ROOT" && cargo build --release -p gpunvme-cli >&2) || die "cargo build --release failed"
}
