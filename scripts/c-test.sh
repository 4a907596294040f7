#!/usr/bin/env bash
# The C ABI's example: builds libgpunvme (cargo, debug unless --release), writes a pkg-config
# file for the build beside it (target/<profile>/gpunvme.pc, from capi/gpunvme.pc.in), compiles
# examples/c/fs_demo.c with `pkg-config --cflags --libs gpunvme` and -Werror, and runs it on a
# fresh 64 MiB image; then the same for capi/tests/abi.c (misuse: error codes out of range,
# double closes, junk handles, a read-only handle, destructive calls without force). CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=debug
if [ "${1:-}" = --release ]; then PROFILE=release; cargo build -q --release -p gpunvme_capi; else cargo build -q -p gpunvme_capi; fi
LIB=$PWD/target/$PROFILE
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
sed -e "s|@PREFIX@|$PWD|" -e "s|@LIBDIR@|$LIB|" -e "s|@INCLUDEDIR@|$PWD/include|" \
    -e "s|@VERSION@|$VERSION|" capi/gpunvme.pc.in > "$LIB/gpunvme.pc"
export PKG_CONFIG_PATH=$LIB
cc -std=c11 -D_DEFAULT_SOURCE -Wall -Wextra -Werror examples/c/fs_demo.c \
    $(pkg-config --cflags --libs gpunvme) -Wl,-rpath,"$LIB" -o "$LIB/c_fs_demo"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
truncate -s 64M "$WORK/c.img"
"$LIB/c_fs_demo" "$WORK/c.img"
cc -std=c11 -D_DEFAULT_SOURCE -Wall -Wextra -Werror capi/tests/abi.c \
    $(pkg-config --cflags --libs gpunvme) -Wl,-rpath,"$LIB" -o "$LIB/c_abi"
truncate -s 64M "$WORK/abi.img"
"$LIB/c_abi" "$WORK/abi.img"
