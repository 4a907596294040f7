#!/usr/bin/env bash
#
# qemu-noiommu.sh: build (once, cached) a vfio.ko for the guest kernel with
# CONFIG_VFIO_NOIOMMU, which Debian's kernel leaves off, and print its path. With it, the QEMU
# guest can run vfio-pci without an IOMMU (`/dev/vfio/noiommu-N`): the mode of machines whose
# SSD has no IOMMU in front of it. Used by `qemu-run.sh --noiommu` and `qemu-test.sh --noiommu`.
#
# Usage:
#   scripts/qemu-noiommu.sh KERNEL_VERSION           build if needed, print the vfio.ko path
#   scripts/qemu-noiommu.sh --cached KERNEL_VERSION  exit 0 when it is already built
#
# How: `apt-get download` the kernel's source (linux-source-X.Y) and headers (-amd64 and -common)
# at exactly the guest kernel's package version, and the kbuild tools at that version or, where
# the archive dropped it, the newest of the same upstream release; unpack them under
# .cache/qemu/noiommu/<version>/ (nothing is installed), and build only vfio.ko out of tree
# from drivers/vfio/ with -DCONFIG_VFIO_NOIOMMU=1. The stock vfio-pci-core, vfio-pci and
# vfio_iommu_type1 load on top of it. The source package is about 140 MB; unpacking
# drivers/vfio from it and compiling takes about a minute on a 2-core machine (the download's
# time depends on the mirror).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=qemu-lib.sh
. "$(dirname "$0")/qemu-lib.sh"

cached_only=0
if [ "${1:-}" = --cached ]; then
    cached_only=1
    shift
fi
[ $# -eq 1 ] || die "usage: $0 [--cached] KERNEL_VERSION"
kver=$1
dir="$CACHE_DIR/noiommu/$kver"
out="$dir/vfio.ko"
if [ -f "$out" ]; then
    [ "$cached_only" = 1 ] || echo "$out"
    exit 0
fi
[ "$cached_only" = 0 ] || exit 1
# One build at a time: several harness runs may share the cache.
mkdir -p "$CACHE_DIR/noiommu"
exec 9>"$CACHE_DIR/noiommu/.lock"
flock 9
if [ -f "$out" ]; then
    echo "$out"
    exit 0
fi

# Build tools: the kernel was built with gcc-12 (linux-compiler-gcc-12-x86).
missing=()
for entry in gcc-12:gcc-12 make:make ld:binutils xz:xz-utils; do
    command -v "${entry%%:*}" >/dev/null 2>&1 || missing+=("${entry#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing build tools: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >&2 || die "apt-get install ${missing[*]} failed"
fi

# Every package at the image's exact version, so that vermagic and symbol CRCs match.
# (The version of the image the guest boots, as fetch_kernel recorded it; else apt's candidate.)
version=$(cat "$CACHE_DIR/kernel/$kver/deb-version" 2>/dev/null ||
    apt-cache policy "linux-image-$kver" 2>/dev/null | awk '/Candidate:/ { print $2; exit }')
if [ -z "$version" ] || [ "$version" = "(none)" ]; then
    die "apt knows no linux-image-$kver"
fi
series=$(echo "$kver" | cut -d. -f1-2)         # 6.1
abi=${kver%-amd64}                               # 6.1.0-56
# linux-kbuild-X.Y holds build tools (modpost, fixdep), not the kernel's ABI: where the archive
# has dropped the image's exact revision (superseded by a later Debian revision of the same
# upstream release, as 6.1.192-2 by 6.1.192-3 in 2026-11), the newest revision of the same
# upstream version builds the same module. Source and headers stay at the exact version.
kbuild=$version
known=$(apt-cache madison "linux-kbuild-$series" 2>/dev/null | awk -F'|' '{ gsub(/ /, "", $2); print $2 }')
if ! grep -qxF "$version" <<<"$known"; then
    kbuild=$(awk -v up="${version%-*}-" 'index($0, up) == 1 { print; exit }' <<<"$known")
    kbuild=${kbuild:-$version}
fi
pkgs=("linux-source-$series=$version" "linux-kbuild-$series=$kbuild"
    "linux-headers-$kver=$version" "linux-headers-$abi-common=$version")

log "building vfio.ko with CONFIG_VFIO_NOIOMMU for $kver (packages at $version, kbuild $kbuild)"
start=$SECONDS
rm -rf "$dir"
mkdir -p "$dir/debs" "$dir/root" "$dir/build"
(cd "$dir/debs" && apt-get download "${pkgs[@]}" 2>&1 |
    grep -v '^W: Download is performed unsandboxed' >&2) || true
for p in "${pkgs[@]}"; do
    name=${p%%=*}
    deb=$(find "$dir/debs" -name "${name}_*.deb" | head -n 1)
    [ -n "$deb" ] || die "apt-get download $p failed"
    dpkg-deb -x "$deb" "$dir/root"
done

# Only drivers/vfio of the source tree is needed; xz still has to read the whole stream.
tarball=$(find "$dir/root/usr/src" -maxdepth 1 -name "linux-source-$series.tar.xz" | head -n 1)
[ -n "$tarball" ] || die "linux-source-$series has no tarball"
tar -xJf "$tarball" -C "$dir/build" --wildcards "linux-source-$series/drivers/vfio/*" ||
    die "unpacking drivers/vfio failed"
src="$dir/build/linux-source-$series/drivers/vfio"

# The -amd64 headers' Makefile includes the -common one by an absolute /usr/src path: point it
# at the unpacked copy instead.
hdr="$dir/root/usr/src/linux-headers-$kver"
sed -i "s|/usr/src/linux-headers-$abi-common|$dir/root/usr/src/linux-headers-$abi-common|g" \
    "$hdr/Makefile"

# vfio.ko's objects as the tree's own Makefile lists them (its `vfio-...` lines, which use the
# kernel's configuration), and nothing else of drivers/vfio.
kb="$dir/build/vfio"
mkdir -p "$kb"
cp "$src"/*.c "$src"/*.h "$kb/"
{
    echo "obj-m := vfio.o"
    awk '/^vfio-/ { on = 1 } on { print; on = /\\$/ }' "$src/Makefile"
    echo "ccflags-y += -DCONFIG_VFIO_NOIOMMU=1"
} >"$kb/Kbuild"
make -s -C "$hdr" M="$kb" CC=gcc-12 modules >&2 || die "building vfio.ko failed"
modinfo -F parm "$kb/vfio.ko" | grep -q enable_unsafe_noiommu_mode ||
    die "the rebuilt vfio.ko has no enable_unsafe_noiommu_mode parameter"
cp "$kb/vfio.ko" "$out.tmp"
# Keep the result only: the unpacked packages are about 1.5 GB.
rm -rf "$dir/debs" "$dir/root" "$dir/build"
mv "$out.tmp" "$out"
log "vfio.ko built in $((SECONDS - start))s: $out"
echo "$out"
