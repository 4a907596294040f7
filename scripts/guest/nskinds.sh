# shellcheck shell=dash
#
# Namespace kinds, run inside the QEMU guest by scripts/qemu-test.sh (the `nskinds`
# configuration: one controller whose namespaces are 1: 512+8 with protection information
# type 1; 2: 4096+8 with PI type 3 in the first 8 bytes; 3: 4096+64, metadata in a separate
# buffer, no PI; 4: zoned, 4096-byte blocks). Checks that QEMU's formats took effect (nvme-cli),
# writes bytes to namespace 1 through the Linux driver, then through our driver (VFIO):
# identify names every kind (and refuses 3 and 4 with the reason), the kernel's bytes read
# back, perf --verify in four patterns on both PI namespaces (PRACT) and a blockfs round trip on
# namespace 1, perf on 3 and 4 refused by name before any command is sent; back on the Linux
# driver, our bytes read through /dev/nvmeXn1.
#
# Input: GN_TOKEN and PERF_IOS, as for suite.sh. Output: GN-RESULT lines; exit status 1 on any
# failure.

# shellcheck source-path=SCRIPTDIR source=lib.sh
. /usr/share/gpunvme/lib.sh
# shellcheck source-path=SCRIPTDIR source=checks.sh
. /usr/share/gpunvme/checks.sh

T=/tmp/nskinds
mkdir -p "$T"
PAT_BYTES=262144
LBA_KERNEL=1001
LBA_OURS=3003

bdf=$(gn_nvme_bdfs | head -n 1)
cdev=""
for d in /sys/bus/pci/devices/"$bdf"/nvme/nvme*; do
    [ -e "$d" ] && cdev="/dev/${d##*/}"
done

# ---- QEMU's formats, as the Linux driver's nvme-cli reads them -------------------------------
for nsid in 1 2 3 4; do
    nvme id-ns "$cdev" -n "$nsid" -o json >"$T/ns$nsid.kns.json" 2>"$T/ns$nsid.kns.err" ||
        fail "nskinds: nvme id-ns -n $nsid" "$(cat "$T/ns$nsid.kns.err")"
done
ms_of() { # nsid -> metadata size of the format in use
    local f
    f=$(jqf .flbas "$T/ns$1.kns.json")
    jq -r ".lbafs[$((f & 15))].ms" "$T/ns$1.kns.json" 2>/dev/null
}
check_eq "config: ns1 metadata bytes (nvme-cli)" 8 "$(ms_of 1)"
check_eq "config: ns1 protection type (nvme-cli dps)" 1 "$(($(num "$(jqf .dps "$T/ns1.kns.json")") & 7))"
check_eq "config: ns2 protection type, first bytes (nvme-cli dps)" 11 "$(num "$(jqf .dps "$T/ns2.kns.json")")"
check_eq "config: ns3 metadata bytes (nvme-cli)" 64 "$(ms_of 3)"
check_eq "config: ns3 protection type (nvme-cli dps)" 0 "$(($(num "$(jqf .dps "$T/ns3.kns.json")") & 7))"

# ---- bytes through the Linux driver on the PI namespace --------------------------------------
head -c "$PAT_BYTES" /dev/urandom >"$T/kpat"
if blk=$(gn_blockdev "$bdf" 1) &&
    timeout "$CMD_TIMEOUT" dd if="$T/kpat" of="$blk" bs=512 seek="$LBA_KERNEL" oflag=direct \
        conv=fsync,notrunc 2>"$T/kdd.err"; then
    pass "nskinds: wrote $PAT_BYTES random bytes at LBA $LBA_KERNEL of the PI namespace through $blk"
else
    fail "nskinds: kernel write to the PI namespace" "$(cat "$T/kdd.err" 2>/dev/null)"
fi

# ---- our driver through VFIO -----------------------------------------------------------------
if ! gn_bind "$bdf" vfio-pci; then
    fail "nskinds: bind $bdf to vfio-pci"
    exit 1
fi
if ours "$T/id" --device "$bdf" identify --json; then
    id="$T/id.out"
    check_eq "nskinds: identify namespaces listed" 4 "$(jq '.namespaces | length' "$id")"
    nsf() { jq -r ".namespaces[] | select(.nsid == $1) | $2" "$id"; }
    check_eq "nskinds: ns1 usable, 512+8 PI type 1" "true 512 8 1" \
        "$(nsf 1 '"\(.usable) \(.lba_size) \(.metadata_bytes) \(.pi_type)"')"
    check_eq "nskinds: ns2 usable, 4096+8 PI type 3 first" "true 4096 8 3 true" \
        "$(nsf 2 '"\(.usable) \(.lba_size) \(.metadata_bytes) \(.pi_type) \(.pi_first_bytes)"')"
    check_eq "nskinds: ns3 refused, 64 bytes separate" "false 64 separate" \
        "$(nsf 3 '"\(.usable) \(.metadata_bytes) \(.metadata_placement)"')"
    check_eq "nskinds: ns4 refused, zoned" "false Zoned Namespace" "$(nsf 4 '"\(.usable) \(.command_set)"')"
    case "$(nsf 3 .refused)" in
        *"64 bytes of metadata per block (separate buffer)"*) pass "nskinds: ns3 refusal names the format" ;;
        *) fail "nskinds: ns3 refusal" "$(nsf 3 .refused)" ;;
    esac
else
    fail "nskinds: gpunvme identify" "$(cat "$T/id.err")"
fi
ours "$T/idtext" --device "$bdf" identify && show "$T/idtext.out"

if ours "$T/read" --device "$bdf" read --nsid 1 --lba "$LBA_KERNEL" --bytes "$PAT_BYTES" \
    --output "$T/ours.read" && cmp -s "$T/kpat" "$T/ours.read"; then
    pass "nskinds: the kernel's bytes on the PI namespace read back by gpunvme (PRACT)"
else
    fail "nskinds: read of the kernel's bytes on the PI namespace" "$(cat "$T/read.err")"
fi

for nsid in 1 2; do
    for rw in write read randwrite randread; do
        p="$T/perf.$nsid.$rw"
        if ours "$p" --device "$bdf" --json perf --nsid "$nsid" --rw "$rw" --bs 4k --qd 16 \
            --ios "$PERF_IOS" --size 16m --verify --force &&
            [ "$(jqf .errors "$p.out")" = 0 ] && [ "$(jqf .verify_errors "$p.out")" = 0 ]; then
            pass "nskinds: perf --rw $rw --verify on PI namespace $nsid ($(jqf .iops "$p.out" | cut -d. -f1) IOPS)"
        else
            fail "nskinds: perf --rw $rw on PI namespace $nsid" "$(tail -c 300 "$p.err")"
        fi
    done
done

for nsid in 3 4; do
    if ours "$T/refuse$nsid" --device "$bdf" perf --nsid "$nsid" --rw randread --bs 4k --ios 100; then
        fail "nskinds: perf on namespace $nsid was not refused"
    elif grep -q "namespace $nsid \(is formatted with 64 bytes\|uses the Zoned Namespace\)" "$T/refuse$nsid.err"; then
        pass "nskinds: perf on namespace $nsid refused: $(tail -n 1 "$T/refuse$nsid.err")"
    else
        fail "nskinds: perf on namespace $nsid" "$(cat "$T/refuse$nsid.err")"
    fi
done

head -c 3000000 /dev/urandom >"$T/fs.src"
if ours "$T/mkfs" --device "$bdf" fs mkfs --force &&
    ours "$T/put" --device "$bdf" fs put "$T/fs.src" pi/file.bin &&
    ours "$T/get" --device "$bdf" fs get pi/file.bin "$T/fs.back" &&
    cmp -s "$T/fs.src" "$T/fs.back" && ours "$T/fsck" --device "$bdf" fs fsck; then
    pass "nskinds: blockfs on the PI namespace: mkfs, put, get (same bytes), fsck"
else
    fail "nskinds: blockfs on the PI namespace" "$(cat "$T/mkfs.err" "$T/put.err" "$T/get.err" "$T/fsck.err" 2>/dev/null | tail -n 3)"
fi

# The controller's own record: nothing above failed on it (refusals never reach it), and its
# SMART counters saw the writes.
if ours "$T/log" --device "$bdf" --json log && [ "$(jq '.entries | length' "$T/log.out")" = 0 ]; then
    pass "nskinds: gpunvme log: QEMU's Error Information log holds no errors"
else
    fail "nskinds: gpunvme log" "$(cat "$T/log.out" "$T/log.err" 2>/dev/null | head -c 400)"
fi
if ours "$T/smart" --device "$bdf" --json log --smart &&
    [ "$(jqf .host_write_commands "$T/smart.out")" -gt 0 ] &&
    [ "$(jqf .media_errors "$T/smart.out")" = 0 ]; then
    pass "nskinds: gpunvme log --smart: $(jqf .host_write_commands "$T/smart.out") writes, 0 media errors"
else
    fail "nskinds: gpunvme log --smart" "$(head -c 400 "$T/smart.out" "$T/smart.err" 2>/dev/null)"
fi

head -c "$PAT_BYTES" /dev/urandom >"$T/opat"
# Namespace 1 holds the blockfs made above: a raw write is refused without --force (and the
# file system still checks clean), then done with --force, which this test means.
if ours "$T/nowrite" --device "$bdf" write --nsid 1 --lba "$LBA_OURS" --input "$T/opat"; then
    fail "nskinds: raw write over the blockfs on the PI namespace was not refused"
elif grep -q "namespace 1 holds a blockfs.*--force" "$T/nowrite.err" &&
    ours "$T/fsck2" --device "$bdf" fs fsck; then
    pass "nskinds: raw write over the blockfs refused without --force; fsck clean after"
else
    fail "nskinds: raw write refusal" "$(tail -n 2 "$T/nowrite.err" "$T/fsck2.err" 2>/dev/null)"
fi
if ours "$T/write" --device "$bdf" write --force --nsid 1 --lba "$LBA_OURS" --input "$T/opat"; then
    pass "nskinds: wrote $PAT_BYTES random bytes at LBA $LBA_OURS of the PI namespace through gpunvme"
else
    fail "nskinds: gpunvme write to the PI namespace" "$(cat "$T/write.err")"
fi

# ---- back to the Linux driver: our bytes through /dev/nvmeXn2 --------------------------------
if gn_bind "$bdf" nvme && blk=$(gn_blockdev "$bdf" 1) &&
    timeout "$CMD_TIMEOUT" dd if="$blk" of="$T/kread" bs=512 skip="$LBA_OURS" \
        count=$((PAT_BYTES / 512)) iflag=direct 2>/dev/null && cmp -s "$T/opat" "$T/kread"; then
    pass "nskinds: gpunvme's bytes on the PI namespace read back through $blk (PI valid)"
else
    fail "nskinds: kernel read of gpunvme's bytes on the PI namespace"
fi

exit "$FAILED"
