# shellcheck shell=dash
#
# The integration suite, run inside the QEMU guest by scripts/qemu-test.sh (busybox ash). The
# guest boots with every NVMe controller on the kernel nvme driver; the suite then
#   1. records what the Linux driver and nvme-cli see (identify, queue count, transfer limit)
#      and checks that QEMU's configuration took effect (controllers, namespaces, LBA size...);
#   2. writes random bytes through the Linux driver;
#   3. moves every controller to vfio-pci and, through our driver (`gpunvme`): compares
#      identify with nvme-cli's fields, reads step 2's bytes back, runs perf --verify for
#      read, write, randread and randwrite, runs protocol-check (the GPU queue protocol of
#      ptx/include/gpunvme.cuh driven by CPU threads on rings gpunvme allocated itself, every byte
#      read back checked), and writes new random bytes;
#   4. moves the controllers back to the kernel driver and reads step 3's bytes through
#      /dev/nvmeXnY;
#   5. checks that bad --device arguments fail with one line and leave everything as it was;
#   6. runs scripts/setup.sh (under bash) on the first controller: bind to vfio-pci (then
#      identify and read through our driver), status, unbind back to nvme (then read through
#      /dev/nvmeXnY), hugepages, and bind refused while a namespace is mounted or is swap;
#   7. runs `gpunvme fs` (blockfs) on namespace 1 of the first controller through VFIO: mkfs,
#      put of a few MiB of random bytes under a path-like name, ls (with and without a
#      prefix), get and compare, stat, then reads the file's bytes through /dev/nvmeXnY at
#      the LBAs of stat's extent list (controller moved to the kernel driver and back), then
#      mv, rm, df and fsck;
#   8. makes a striped volume over the first two controllers (`--device B0,B1 fs mkfs`), puts
#      and gets a file, and reads its bytes through the kernel driver at the member LBAs the
#      stripe layout gives.
#
# Input (environment, set by the host in run.sh):
#   GN_TOKEN        token that marks result lines (the host ignores lines without it)
#   EXPECT_CTRLS    NVMe controllers QEMU was given
#   EXPECT_NS       namespaces per controller
#   EXPECT_LBA      LBA size in bytes
#   EXPECT_MDTS     max data transfer in bytes (0: no limit)
#   EXPECT_QPAIRS   I/O queue pairs the controller grants
#   PERF_IOS        I/Os per perf run
#   PROTO_IOS       commands of each protocol-check run (default 3000)
#   NEGATIVE        1: run step 5 (needs a non-NVMe PCI device, e.g. QEMU's edu)
#   SETUP_SH        1: run step 6 (needs /opt/gpunvme/scripts/setup.sh and bash; 2 MiB
#                   hugepages; it reformats namespace 1 of the first controller)
#   BLOCKFS         1: run step 7 (makes a blockfs on namespace 1 of the first controller)
#   VOLUME          1: run step 8 (a striped volume over namespace 1 of the first two
#                   controllers: makes it, puts a file, reads its bytes through the kernel
#                   driver at the stripe layout's LBAs)
#   SERVE           1: run step 9 (`gpunvme serve` owning the first controller through VFIO:
#                   client processes, clients killed mid-I/O, DMAR faults counted)
#
# Output: one line per check, `GN-RESULT <token> PASS|FAIL <check> [detail]`, and exit status
# 1 if any check failed.

# shellcheck source-path=SCRIPTDIR source=lib.sh
. /usr/share/gpunvme/lib.sh

# shellcheck source-path=SCRIPTDIR source=checks.sh
. /usr/share/gpunvme/checks.sh

T=/tmp/suite
mkdir -p "$T"
# Bytes per cross-check pattern: many PRP list entries, and 32 commands when MDTS is 8 KiB.
PAT_BYTES=262144
# Where the patterns go, in LBAs: odd numbers, so that 512-byte LBAs are not 4 KiB aligned.
LBA_KERNEL=1001
LBA_OURS=3003
PROTO_IOS=${PROTO_IOS:-3000}

ctrl_char_dev() {
    local d
    for d in /sys/bus/pci/devices/"$1"/nvme/nvme*; do
        [ -e "$d" ] && echo "/dev/${d##*/}" && return 0
    done
    return 1
}

# ---- step 1: the Linux driver's view ----------------------------------------------------

BDFS=$(gn_nvme_bdfs)
check_eq "config: NVMe controllers" "$EXPECT_CTRLS" "$(echo "$BDFS" | grep -c .)"

i=0
for bdf in $BDFS; do
    i=$((i + 1))
    tag="ctrl$i"
    if ! cdev=$(ctrl_char_dev "$bdf"); then
        fail "$tag: kernel driver created no controller device for $bdf"
        continue
    fi
    nvme id-ctrl "$cdev" -o json >"$T/$tag.kid.json" 2>"$T/$tag.kid.err" ||
        fail "$tag: nvme id-ctrl" "$(cat "$T/$tag.kid.err")"
    # Number of Queues (feature 7): the I/O SQs and CQs the controller grants, decoded by -H.
    nvme get-feature "$cdev" -f 7 -H >"$T/$tag.kfeat7" 2>&1
    nsqa=$(sed -n 's/.*(NSQA): *\([0-9]*\).*/\1/p' "$T/$tag.kfeat7")
    ncqa=$(sed -n 's/.*(NCQA): *\([0-9]*\).*/\1/p' "$T/$tag.kfeat7")
    if [ -n "$nsqa" ] && [ -n "$ncqa" ]; then
        echo $((nsqa < ncqa ? nsqa : ncqa)) >"$T/$tag.kqpairs"
        check_eq "config: $tag I/O queue pairs (nvme-cli)" "$EXPECT_QPAIRS" "$(cat "$T/$tag.kqpairs")"
    else
        fail "$tag: nvme get-feature -f 7 -H gave no NSQA/NCQA" "$(head -c 300 "$T/$tag.kfeat7")"
    fi
    mdts=$(jqf .mdts "$T/$tag.kid.json")
    # MDTS is a power of two in units of CAP.MPSMIN, which is 4 KiB on QEMU's controller; the
    # Linux driver's max_hw_sectors_kb confirms the product independently below.
    if [ "$mdts" = 0 ]; then kmdts=0; else kmdts=$((4096 << mdts)); fi
    echo "$kmdts" >"$T/$tag.kmdts"
    check_eq "config: $tag max data transfer (nvme-cli)" "$EXPECT_MDTS" "$kmdts"
    check_eq "config: $tag namespaces (nvme-cli)" "$EXPECT_NS" \
        "$(nvme list-ns "$cdev" 2>/dev/null | grep -c '^\[')"

    for nsid in $(seq 1 "$EXPECT_NS"); do
        ntag="$tag.ns$nsid"
        if ! blk=$(gn_blockdev "$bdf" "$nsid"); then
            fail "$ntag: no block device through the kernel driver"
            continue
        fi
        nvme id-ns "$cdev" -n "$nsid" -o json >"$T/$ntag.kns.json" 2>/dev/null ||
            fail "$ntag: nvme id-ns"
        flbas=$(jqf .flbas "$T/$ntag.kns.json")
        ds=$(jq -r ".lbafs[$((flbas & 15))].ds" "$T/$ntag.kns.json" 2>/dev/null)
        echo $((1 << ds)) >"$T/$ntag.klba"
        check_eq "config: $ntag LBA size (nvme-cli)" "$EXPECT_LBA" "$(cat "$T/$ntag.klba")"
        if [ "$nsid" = 1 ] && [ "$EXPECT_MDTS" != 0 ] && [ "$EXPECT_MDTS" -le 1048576 ]; then
            kb=$(cat "/sys/block/${blk#/dev/}/queue/max_hw_sectors_kb")
            check_eq "config: $tag max transfer (Linux max_hw_sectors_kb)" "$EXPECT_MDTS" $((kb * 1024))
        fi
        # ---- step 2: bytes through the Linux driver, for ours to read in step 3 ----
        head -c "$PAT_BYTES" /dev/urandom >"$T/$ntag.kpat"
        if timeout "$CMD_TIMEOUT" dd if="$T/$ntag.kpat" of="$blk" bs="$EXPECT_LBA" \
            seek="$LBA_KERNEL" oflag=direct conv=fsync,notrunc 2>"$T/$ntag.kdd.err"; then
            pass "$ntag: wrote $PAT_BYTES random bytes at LBA $LBA_KERNEL through $blk"
        else
            fail "$ntag: kernel write" "$(cat "$T/$ntag.kdd.err")"
        fi
    done
done

# ---- step 3: our driver through VFIO -------------------------------------------------------

i=0
for bdf in $BDFS; do
    i=$((i + 1))
    tag="ctrl$i"
    if ! gn_bind "$bdf" vfio-pci; then
        fail "$tag: bind $bdf to vfio-pci"
        continue
    fi
    if [ "$GPUNVME_GUEST_MODE" = noiommu ]; then
        if [ -e "/dev/vfio/noiommu-$(gn_iommu_group "$bdf")" ]; then
            pass "$tag: /dev/vfio/noiommu-$(gn_iommu_group "$bdf") exists"
        else
            fail "$tag: no /dev/vfio/noiommu-N for $bdf"
        fi
    fi

    # identify: every field against nvme-cli's view of the same controller.
    if ours "$T/$tag.id" --device "$bdf" identify --json; then
        pass "$tag: gpunvme identify"
        id="$T/$tag.id.out"
        kid="$T/$tag.kid.json"
        check_eq "$tag: identify vid" "$(num "$(jqf .vid "$kid")")" "$(num "$(jqf .vid "$id")")"
        check_eq "$tag: identify ssvid" "$(num "$(jqf .ssvid "$kid")")" "$(num "$(jqf .ssvid "$id")")"
        for f in sn mn fr; do
            check_eq "$tag: identify $f" "$(rtrim "$(jqf ".$f" "$kid")")" "$(rtrim "$(jqf ".$f" "$id")")"
        done
        # null means no limit, as MDTS 0 does.
        check_eq "$tag: identify mdts_bytes" "$(cat "$T/$tag.kmdts")" \
            "$(num "$(jq -r 'if has("mdts_bytes") then .mdts_bytes // 0 else "absent" end' "$id")")"
        check_eq "$tag: identify max_io_queue_pairs" "$(cat "$T/$tag.kqpairs" 2>/dev/null)" \
            "$(num "$(jqf .max_io_queue_pairs "$id")")"
        check_eq "$tag: identify namespace count" "$EXPECT_NS" "$(jq '.namespaces | length' "$id")"
        for nsid in $(seq 1 "$EXPECT_NS"); do
            ntag="$tag.ns$nsid"
            sel=".namespaces[] | select(.nsid == $nsid)"
            check_eq "$ntag: identify lba_size" "$(cat "$T/$ntag.klba" 2>/dev/null)" \
                "$(jq -r "$sel | .lba_size" "$id")"
            check_eq "$ntag: identify blocks" "$(jqf .nsze "$T/$ntag.kns.json")" \
                "$(jq -r "$sel | .blocks" "$id")"
        done
    else
        fail "$tag: gpunvme identify" "$(tail -n 3 "$T/$tag.id.err")"
    fi

    # Bytes the Linux driver wrote in step 2, read back by ours.
    for nsid in $(seq 1 "$EXPECT_NS"); do
        ntag="$tag.ns$nsid"
        if ours "$T/$ntag.read" --device "$bdf" read --nsid "$nsid" --lba "$LBA_KERNEL" \
            --bytes "$PAT_BYTES" --output "$T/$ntag.ours-read"; then
            if cmp -s "$T/$ntag.kpat" "$T/$ntag.ours-read"; then
                pass "$ntag: bytes written by Linux read back by gpunvme ($PAT_BYTES bytes)"
            else
                fail "$ntag: bytes written by Linux read back by gpunvme" \
                    "$(cmp "$T/$ntag.kpat" "$T/$ntag.ours-read" 2>&1 | head -n 1)"
            fi
        else
            fail "$ntag: gpunvme read" "$(tail -n 3 "$T/$ntag.read.err")"
        fi
    done

    # perf --verify. Writes go first so that reads find known patterns (perf writes them
    # itself when verifying, but this order also reads what a previous run wrote).
    queues=2
    [ "$EXPECT_QPAIRS" -lt 2 ] && queues=1
    for rw in write read randwrite randread; do
        p="$T/$tag.perf-$rw"
        if ours "$p" --device "$bdf" perf --rw "$rw" --bs 4k --qd 8 --queues "$queues" \
            --ios "$PERF_IOS" --verify --json; then
            ios=$(jqf .ios "$p.out")
            errs=$(jqf .errors "$p.out")
            verrs=$(jqf .verify_errors "$p.out")
            iops=$(jqf .iops "$p.out")
            vbytes=$(jqf .verified_bytes "$p.out")
            # With --verify every byte a read brought in is checked.
            vmin=0
            case "$rw" in *read) vmin=$((PERF_IOS * 4096)) ;; esac
            if [ "$ios" = "$PERF_IOS" ] && [ "$errs" = 0 ] && [ "$verrs" = 0 ] &&
                [ "${vbytes:-0}" -ge "$vmin" ] &&
                [ -n "$iops" ] && [ "$(echo "$iops" | sed 's/\..*//')" -gt 0 ]; then
                pass "$tag: perf --rw $rw --verify ($ios I/Os, ${iops%%.*} IOPS, $vbytes bytes verified)"
            else
                fail "$tag: perf --rw $rw --verify" \
                    "ios=$ios errors=$errs verify_errors=$verrs verified_bytes=$vbytes iops=$iops"
                show "$p.out"
            fi
        else
            fail "$tag: perf --rw $rw --verify" "$(tail -n 3 "$p.err")"
        fi
    done

    # protocol-check: the device header's queue protocol (ticketed slots, coalesced tail
    # doorbells, completions matched by command id and phase tag) run by 4 CPU threads per
    # queue on rings that gpunvme allocated and created with Create I/O SQ/CQ itself, against
    # QEMU's controller; every byte read back is checked. Slot buffers of 16 KiB (PRP1, PRP2
    # and PRP-list commands) unless MDTS is smaller. It writes from LBA 0, so it runs after
    # step 2's bytes were read back and before step 3's own are written.
    slot=16384
    [ "$EXPECT_MDTS" != 0 ] && [ "$EXPECT_MDTS" -lt "$slot" ] && slot=$EXPECT_MDTS
    p="$T/$tag.protocol"
    if ours "$p" --device "$bdf" protocol-check --queues "$queues" --depth 32 --threads 4 \
        --ios "$PROTO_IOS" --slot-buffer "$slot" --json; then
        ios=$(jqf .ios "$p.out")
        errs=$(jqf .errors "$p.out")
        mism=$(jqf .mismatches "$p.out")
        vbytes=$(jqf .verified_bytes "$p.out")
        sqdb=$(jqf .sq_doorbells "$p.out")
        cqdb=$(jqf .cq_doorbells "$p.out")
        ooo=$(jqf .out_of_order "$p.out")
        passed=$(jq -r .passed "$p.out" 2>/dev/null)
        if [ "$passed" = true ] && [ "$ios" = "$PROTO_IOS" ] && [ "$errs" = 0 ] &&
            [ "$mism" = 0 ] && [ "${vbytes:-0}" -gt 0 ] && [ "${sqdb:-0}" -gt 0 ] &&
            [ "$sqdb" -le "$ios" ]; then
            pass "$tag: protocol-check ($ios commands on $queues x 32-entry queues, 4 threads each, $vbytes bytes verified, SQ/CQ doorbells $sqdb/$cqdb, $ooo completions out of order)"
        else
            fail "$tag: protocol-check" \
                "passed=$passed ios=$ios errors=$errs mismatches=$mism verified_bytes=$vbytes sq_doorbells=$sqdb"
            show "$p.out"
        fi
    else
        fail "$tag: protocol-check" "$(tail -n 3 "$p.err")"
        show "$p.out"
    fi

    # Bytes for the Linux driver to read in step 4; a distinct pattern per namespace and
    # controller, so that mixing them up shows.
    for nsid in $(seq 1 "$EXPECT_NS"); do
        ntag="$tag.ns$nsid"
        head -c "$PAT_BYTES" /dev/urandom >"$T/$ntag.opat"
        if ours "$T/$ntag.write" --device "$bdf" write --nsid "$nsid" --lba "$LBA_OURS" \
            --input "$T/$ntag.opat"; then
            pass "$ntag: wrote $PAT_BYTES random bytes at LBA $LBA_OURS through gpunvme"
        else
            fail "$ntag: gpunvme write" "$(tail -n 3 "$T/$ntag.write.err")"
        fi
    done
done

# ---- step 4: back to the Linux driver --------------------------------------------------------

i=0
for bdf in $BDFS; do
    i=$((i + 1))
    tag="ctrl$i"
    if ! gn_bind "$bdf" nvme; then
        fail "$tag: bind $bdf back to nvme"
        continue
    fi
    for nsid in $(seq 1 "$EXPECT_NS"); do
        ntag="$tag.ns$nsid"
        if ! blk=$(gn_blockdev "$bdf" "$nsid"); then
            fail "$ntag: no block device after rebinding to nvme"
            continue
        fi
        if timeout "$CMD_TIMEOUT" dd if="$blk" of="$T/$ntag.kread" bs="$EXPECT_LBA" \
            skip="$LBA_OURS" count=$((PAT_BYTES / EXPECT_LBA)) iflag=direct 2>/dev/null &&
            cmp -s "$T/$ntag.opat" "$T/$ntag.kread"; then
            pass "$ntag: bytes written by gpunvme read back through $blk"
        else
            fail "$ntag: bytes written by gpunvme read back through $blk" \
                "$(cmp "$T/$ntag.opat" "$T/$ntag.kread" 2>&1 | head -n 1)"
        fi
    done
done

# ---- step 5: bad --device arguments fail cleanly and touch nothing -----------------------------

# expect_refusal NAME ARGS...: gpunvme must exit non-zero with exactly one line on stderr.
expect_refusal() {
    local name=$1 rc=0
    shift
    ours "$T/neg" "$@" identify || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$(grep -c . "$T/neg.err")" = 1 ]; then
        pass "$name: refused: $(cat "$T/neg.err")"
    else
        fail "$name" "exit status $rc, stderr: $(head -c 300 "$T/neg.err")"
        show "$T/neg.err"
    fi
}

if [ "${NEGATIVE:-0}" = 1 ]; then
    bdf=$(echo "$BDFS" | head -n 1)
    for bad in 0000:0g:03.0 0000:00:03.9 0000:00:20.0 00:03; do
        expect_refusal "malformed PCI address $bad" --device "$bad"
        [ -e "/root/$bad" ] && fail "malformed PCI address $bad: created a file /root/$bad"
    done
    # Well-formed, but no such device.
    expect_refusal "absent PCI device 0000:00:1e.7" --device 0000:00:1e.7

    # An NVMe controller on the kernel driver: refused, still bound, its data unchanged.
    blk=$(gn_blockdev "$bdf" 1)
    snap() {
        timeout "$CMD_TIMEOUT" dd if="$blk" of="$1" bs="$EXPECT_LBA" skip="$LBA_OURS" \
            count=$((PAT_BYTES / EXPECT_LBA)) iflag=direct 2>/dev/null
    }
    snap "$T/neg.before" || fail "controller bound to nvme: reading $blk before"
    expect_refusal "controller bound to nvme, not vfio-pci" --device "$bdf"
    check_eq "controller bound to nvme: still bound to" nvme "$(gn_driver "$bdf")"
    if snap "$T/neg.after" && cmp -s "$T/neg.before" "$T/neg.after"; then
        pass "controller bound to nvme: $blk still reads the same bytes"
    else
        fail "controller bound to nvme: $blk still reads the same bytes"
    fi

    # Devices that are not NVMe controllers: one bound to vfio-pci, one on no driver at all.
    other=""
    for dev in /sys/bus/pci/devices/*; do
        case "$(cat "$dev/class")" in
            0x00ff00) other=${dev##*/} ;; # QEMU's edu device
        esac
    done
    if [ -n "$other" ] && gn_bind "$other" vfio-pci; then
        expect_refusal "non-NVMe device $other on vfio-pci" --device "$other"
        check_eq "non-NVMe device $other: still bound to" vfio-pci "$(gn_driver "$other")"
    else
        fail "non-NVMe device" "no edu device bound to vfio-pci to try"
    fi
    host=0000:00:00.0
    before=$(gn_driver "$host")
    expect_refusal "non-NVMe device $host (host bridge)" --device "$host"
    check_eq "non-NVMe device $host: driver unchanged" "$before" "$(gn_driver "$host")"
fi

# ---- step 6: scripts/setup.sh ----------------------------------------------------------------

SETUP=/opt/gpunvme/scripts/setup.sh
# setup OUT ARGS...: setup.sh with a time limit; stdout and stderr to files named by OUT.
setup() {
    local out=$1
    shift
    timeout "$CMD_TIMEOUT" "$SETUP" "$@" >"$out.out" 2>"$out.err"
}

# setup_status NAME REGEX: `setup.sh status` succeeds and prints a line that REGEX (grep's
# basic syntax) matches.
setup_status() {
    local line
    if setup "$T/setup-status" status; then
        if line=$(grep -- "$2" "$T/setup-status.out"); then
            pass "$1: $(echo "$line" | head -n 1)"
        else
            fail "$1" "no line with '$2'"
            show "$T/setup-status.out"
        fi
    else
        fail "$1" "setup.sh status failed: $(tail -n 3 "$T/setup-status.err")"
    fi
}

# setup_refusal NAME BDF WHAT: `setup.sh bind BDF` must fail with one line on stderr that
# names WHAT, print nothing else, and leave BDF on nvme with its driver_override unchanged.
setup_refusal() {
    local name=$1 bdf=$2 what=$3 rc=0 override
    override=$(cat "/sys/bus/pci/devices/$bdf/driver_override")
    setup "$T/setup-refuse" bind "$bdf" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$(grep -c . "$T/setup-refuse.err")" = 1 ] &&
        [ ! -s "$T/setup-refuse.out" ] && grep -qF -- "$what" "$T/setup-refuse.err"; then
        pass "$name: refused: $(cat "$T/setup-refuse.err")"
    else
        fail "$name" "exit status $rc, stderr: $(head -c 300 "$T/setup-refuse.err")"
        show "$T/setup-refuse.out"
    fi
    check_eq "$name: still bound to" nvme "$(gn_driver "$bdf")"
    check_eq "$name: driver_override unchanged" "$override" \
        "$(cat "/sys/bus/pci/devices/$bdf/driver_override")"
}

if [ "${SETUP_SH:-0}" = 1 ]; then
    bdf=$(echo "$BDFS" | head -n 1)
    setup_status "setup.sh status: $bdf on nvme" "$bdf driver=nvme "

    # bind: nvme -> vfio-pci, then our driver works through it.
    rc=0
    setup "$T/setup-bind" bind "$bdf" || rc=$?
    if [ "$rc" = 0 ] && [ "$(gn_driver "$bdf")" = vfio-pci ]; then
        pass "setup.sh bind $bdf: $(grep 'bound .* to vfio-pci' "$T/setup-bind.out")"
        group=$(gn_iommu_group "$bdf")
        if [ -n "$group" ] && [ -c "/dev/vfio/$group" ]; then
            pass "setup.sh bind $bdf: /dev/vfio/$group exists"
        else
            fail "setup.sh bind $bdf: no /dev/vfio/N" "IOMMU group '$group'"
        fi
        if ours "$T/setup.id" --device "$bdf" identify --json; then
            check_eq "setup.sh bind $bdf: gpunvme identify sn" \
                "$(rtrim "$(jqf .sn "$T/ctrl1.kid.json")")" "$(rtrim "$(jqf .sn "$T/setup.id.out")")"
        else
            fail "setup.sh bind $bdf: gpunvme identify" "$(tail -n 3 "$T/setup.id.err")"
        fi
        if ours "$T/setup.read" --device "$bdf" read --nsid 1 --lba "$LBA_OURS" \
            --bytes "$PAT_BYTES" --output "$T/setup.ours-read" &&
            cmp -s "$T/ctrl1.ns1.opat" "$T/setup.ours-read"; then
            pass "setup.sh bind $bdf: gpunvme reads back the bytes it wrote in step 3"
        else
            fail "setup.sh bind $bdf: gpunvme read" "$(tail -n 3 "$T/setup.read.err")"
        fi
        setup_status "setup.sh status: $bdf on vfio-pci" \
            "$bdf driver=vfio-pci iommu_group=$group /dev/vfio/$group"
    else
        fail "setup.sh bind $bdf" "exit status $rc, driver $(gn_driver "$bdf"), stderr: $(head -c 300 "$T/setup-bind.err")"
        show "$T/setup-bind.out"
    fi

    # unbind: vfio-pci -> nvme, and the kernel's block device is back with the same bytes.
    rc=0
    setup "$T/setup-unbind" unbind "$bdf" || rc=$?
    if [ "$rc" = 0 ] && [ "$(gn_driver "$bdf")" = nvme ]; then
        pass "setup.sh unbind $bdf: $(grep 'bound .* to nvme' "$T/setup-unbind.out")"
    else
        fail "setup.sh unbind $bdf" "exit status $rc, driver $(gn_driver "$bdf"), stderr: $(head -c 300 "$T/setup-unbind.err")"
        show "$T/setup-unbind.out"
        # Leave the controller on nvme for the refusal checks below.
        gn_bind "$bdf" nvme || fail "setup.sh: rebinding $bdf to nvme with gn_bind"
    fi
    if blk=$(gn_blockdev "$bdf" 1); then
        if timeout "$CMD_TIMEOUT" dd if="$blk" of="$T/setup.kread" bs="$EXPECT_LBA" \
            skip="$LBA_OURS" count=$((PAT_BYTES / EXPECT_LBA)) iflag=direct 2>/dev/null &&
            cmp -s "$T/ctrl1.ns1.opat" "$T/setup.kread"; then
            pass "setup.sh unbind $bdf: $blk is back and reads the same bytes"
        else
            fail "setup.sh unbind $bdf: $blk reads the same bytes"
        fi
        setup_status "setup.sh status: $bdf back on nvme" \
            "$bdf driver=nvme iommu_group=$(gn_iommu_group "$bdf")\( .*\)\{0,1\} namespaces: ${blk#/dev/}\$"
    else
        fail "setup.sh unbind $bdf: no block device for namespace 1"
    fi

    # hugepages: the kernel's count follows, and goes back.
    hp_before=$(cat /proc/sys/vm/nr_hugepages)
    for n in $((hp_before + 8)) "$hp_before"; do
        if setup "$T/setup-hp" hugepages "$n"; then
            check_eq "setup.sh hugepages $n: /proc/sys/vm/nr_hugepages" "$n" \
                "$(cat /proc/sys/vm/nr_hugepages)"
        else
            fail "setup.sh hugepages $n" "$(head -c 300 "$T/setup-hp.err") $(head -c 300 "$T/setup-hp.out")"
        fi
    done

    # Refusals: a namespace that is mounted, or is swap, keeps its controller on nvme. This
    # formats the namespace, so it comes last.
    if [ -n "$blk" ] && [ "$(gn_driver "$bdf")" = nvme ]; then
        mnt="$T/mnt"
        mkdir -p "$mnt"
        if modprobe msdos && modprobe nls_cp437 && mkdosfs "$blk" >"$T/mkdosfs.log" 2>&1 &&
            mount -t msdos "$blk" "$mnt" 2>"$T/mount.err"; then
            setup_refusal "setup.sh bind $bdf with $blk mounted" "$bdf" "$blk (mounted on $mnt)"
            grep -q "^$blk $mnt " /proc/mounts ||
                fail "setup.sh bind $bdf with $blk mounted: still mounted"
            umount "$mnt" || fail "setup.sh: umount $mnt"
        else
            fail "setup.sh bind $bdf with $blk mounted" \
                "could not mount a FAT file system on $blk: $(cat "$T/mkdosfs.log" "$T/mount.err" 2>/dev/null | head -c 300)"
        fi
        if mkswap "$blk" >"$T/mkswap.log" 2>&1 && swapon "$blk" 2>"$T/swapon.err"; then
            setup_refusal "setup.sh bind $bdf with $blk as swap" "$bdf" "$blk (swap)"
            swapoff "$blk" || fail "setup.sh: swapoff $blk"
        else
            fail "setup.sh bind $bdf with $blk as swap" \
                "could not swapon $blk: $(cat "$T/mkswap.log" "$T/swapon.err" 2>/dev/null | head -c 300)"
        fi
    else
        fail "setup.sh refusals" "no block device on nvme for $bdf to mount"
    fi
fi

# ---- step 7: gpunvme fs (blockfs) through VFIO, cross-checked through the kernel driver ------

# File names are `/`-separated paths; the file's size is not a whole number of LBAs, so its
# last LBA is partly past end of file.
FS_NAME=datasets/run-1/shard-000.bin
FS_NEW=datasets/run-2/shard-000.bin
FS_BYTES=$((3 * 1048576 + 1234))

# ours_fs OUT ARGS...: `gpunvme --device $bdf fs ARGS` (see ours).
ours_fs() {
    local out=$1
    shift
    ours "$out" --device "$bdf" fs "$@"
}

# fs_fail NAME OUT: a failed fs command, with its last lines of stderr.
fs_fail() { fail "$1" "$(tail -n 3 "$2.err" 2>/dev/null)"; }

# fs_ls_is NAME PREFIX EXPECTED: `fs ls [PREFIX] --json` lists exactly the files EXPECTED, a
# space-separated list of NAME:SIZE in ls's order ("" for none).
fs_ls_is() {
    local name=$1 prefix=$2 want=$3 got
    if ours_fs "$T/fs-ls" ls ${prefix:+"$prefix"} --json; then
        got=$(jq -r '[.[] | "\(.name):\(.size)"] | join(" ")' "$T/fs-ls.out" 2>&1)
        check_eq "$name" "${want:-(none)}" "${got:-(none)}"
    else
        fs_fail "$name" "$T/fs-ls"
    fi
}

# fs_stat_missing NAME FILE: `fs stat FILE` fails with one error line saying there is no such
# file (other stderr lines are logs, e.g. the warning about no 2 MiB hugepages) and prints
# nothing on stdout.
fs_stat_missing() {
    local rc=0 e="$T/fs-stat-missing"
    ours_fs "$e" stat "$2" --json || rc=$?
    # With --json the error is also a JSON object on stdout ({"error": {"kind", "message"}}).
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] &&
        { [ ! -s "$e.out" ] || jq -e --arg n "no such file: $2" \
            '.error.message | contains($n)' "$e.out" >/dev/null 2>&1; } &&
        [ "$(grep -c '^gpunvme: error: ' "$e.err")" = 1 ] &&
        grep '^gpunvme: error: ' "$e.err" | grep -qF "no such file: $2"; then
        pass "$1: $(grep '^gpunvme: error: ' "$e.err")"
    else
        fail "$1" "exit status $rc, stderr: $(head -c 300 "$e.err")"
        show "$e.out"
    fi
}

# fs_get_cmp NAME FILE: `fs get FILE` gives back exactly the bytes put.
fs_get_cmp() {
    rm -f "$T/fs.got"
    if ours_fs "$T/fs-get" get "$2" "$T/fs.got" --json; then
        if cmp -s "$T/fs.src" "$T/fs.got"; then
            pass "$1 ($(jqf .bytes "$T/fs-get.out") bytes, $(jqf .extents "$T/fs-get.out") extent(s))"
        else
            fail "$1" "$(cmp "$T/fs.src" "$T/fs.got" 2>&1 | head -n 1), sizes $FS_BYTES and $(wc -c <"$T/fs.got")"
        fi
    else
        fs_fail "$1" "$T/fs-get"
    fi
}

# fs_extents_ok NAME STAT_JSON: stat's extent list covers the file's LBAs in order, with no
# gap, and its length is stat's extent count. It lists the file's whole allocation (blockfs
# allocates whole blocks, and preallocated space is listed too), so it may run past the last
# LBA of the file's data, by less than one file-system block here (no preallocation). Leaves
# "FILE_LBA LBA NLB" lines in $T/fs.extents.
fs_extents_ok() {
    local name=$1 st=$2 lbas next=0 flba lba nlb n=0 bad=""
    lbas=$(((FS_BYTES + EXPECT_LBA - 1) / EXPECT_LBA))
    if ! jq -r '.extent_list[] | "\(.file_lba) \(.lba) \(.nlb)"' "$st" >"$T/fs.extents" 2>&1 ||
        [ ! -s "$T/fs.extents" ]; then
        fail "$name" "no extent_list in stat --json"
        show "$st"
        return 1
    fi
    while read -r flba lba nlb; do
        n=$((n + 1))
        [ "$flba" = "$next" ] || bad="extent $n starts at file LBA $flba, not $next"
        [ "$nlb" -gt 0 ] || bad="extent $n is empty"
        next=$((flba + nlb))
    done <"$T/fs.extents"
    # 4 KiB: the file-system block size mkfs uses here by default.
    { [ "$next" -ge "$lbas" ] && [ $(((next - lbas) * EXPECT_LBA)) -lt 4096 ]; } ||
        bad="${bad:+$bad; }extents cover $next LBAs for a file of $lbas"
    [ "$(jqf .extents "$st")" = "$n" ] || bad="${bad:+$bad; }extents=$(jqf .extents "$st") but $n listed"
    if [ -z "$bad" ]; then
        pass "$name: $n extent(s) covering file LBAs 0..$((lbas - 1)): $(tr '\n' ';' <"$T/fs.extents")"
    else
        fail "$name" "$bad"
        show "$st"
        return 1
    fi
}

# fs_kernel_read BLK: the file's bytes read through BLK at the LBAs of $T/fs.extents, into
# $T/fs.kread (cut to the file's size). Each extent is read with the largest block size up to
# 1 MiB that divides its byte offset and length.
fs_kernel_read() {
    local blk=$1 flba lba nlb bs
    : >"$T/fs.kread.all"
    while read -r flba lba nlb; do
        bs=$EXPECT_LBA
        while [ "$bs" -lt 1048576 ] && [ $((lba * EXPECT_LBA % (bs * 2))) = 0 ] &&
            [ $((nlb * EXPECT_LBA % (bs * 2))) = 0 ]; do
            bs=$((bs * 2))
        done
        timeout "$CMD_TIMEOUT" dd if="$blk" bs="$bs" skip=$((lba * EXPECT_LBA / bs)) \
            count=$((nlb * EXPECT_LBA / bs)) iflag=direct 2>"$T/fs.kdd.err" >>"$T/fs.kread.all" ||
            return 1
    done <"$T/fs.extents"
    head -c "$FS_BYTES" "$T/fs.kread.all" >"$T/fs.kread"
}

fs_step() {
    local blk uuid blocks bs ns_bytes ext=""
    if ! gn_bind "$bdf" vfio-pci; then
        fail "fs: bind $bdf to vfio-pci"
        return
    fi

    if ! ours_fs "$T/fs-mkfs" mkfs --json; then
        fs_fail "fs mkfs" "$T/fs-mkfs"
        return
    fi
    uuid=$(jqf .uuid "$T/fs-mkfs.out")
    blocks=$(jqf .blocks "$T/fs-mkfs.out")
    bs=$(jqf .block_size "$T/fs-mkfs.out")
    ns_bytes=$(($(jqf .nsze "$T/ctrl1.ns1.kns.json") * EXPECT_LBA))
    if [ -n "$uuid" ] && [ "${blocks:-0}" -gt 0 ] && [ "${bs:-0}" -gt 0 ] &&
        [ $((blocks * bs)) -le "$ns_bytes" ]; then
        pass "fs mkfs on $bdf: $blocks blocks of $bs bytes on a $ns_bytes-byte namespace, uuid $uuid"
    else
        fail "fs mkfs on $bdf" "uuid '$uuid', $blocks blocks of $bs bytes on a $ns_bytes-byte namespace"
        show "$T/fs-mkfs.out"
    fi
    fs_ls_is "fs ls after mkfs" "" ""

    head -c "$FS_BYTES" /dev/urandom >"$T/fs.src"
    if ours_fs "$T/fs-put" put "$T/fs.src" "$FS_NAME" --json; then
        check_eq "fs put $FS_NAME: bytes" "$FS_BYTES" "$(jqf .bytes "$T/fs-put.out")"
    else
        fs_fail "fs put $FS_NAME" "$T/fs-put"
        return
    fi
    fs_ls_is "fs ls --json" "" "$FS_NAME:$FS_BYTES"
    fs_ls_is "fs ls ${FS_NAME%/*}/ --json" "${FS_NAME%/*}/" "$FS_NAME:$FS_BYTES"
    fs_ls_is "fs ls ${FS_NEW%/*}/ --json" "${FS_NEW%/*}/" ""
    fs_get_cmp "fs get $FS_NAME: same bytes as put" "$FS_NAME"

    if ours_fs "$T/fs-stat" stat "$FS_NAME" --json; then
        check_eq "fs stat $FS_NAME: size" "$FS_BYTES" "$(jqf .size "$T/fs-stat.out")"
        check_eq "fs stat $FS_NAME: name" "$FS_NAME" "$(jqf .name "$T/fs-stat.out")"
        fs_extents_ok "fs stat $FS_NAME: extent list" "$T/fs-stat.out" || ext=bad
    else
        fs_fail "fs stat $FS_NAME" "$T/fs-stat"
        ext=bad
    fi

    # The file's bytes where blockfs says they are, read by the Linux driver.
    if [ "$ext" = bad ]; then
        fail "fs: $FS_NAME read through the kernel driver" "no usable extent list"
    elif ! gn_bind "$bdf" nvme; then
        fail "fs: bind $bdf to nvme for the kernel-side read"
    elif ! blk=$(gn_blockdev "$bdf" 1); then
        fail "fs: no block device for namespace 1 after rebinding to nvme"
    elif ! fs_kernel_read "$blk"; then
        fail "fs: $FS_NAME read through $blk at blockfs's LBAs" "$(head -c 300 "$T/fs.kdd.err")"
    elif cmp -s "$T/fs.src" "$T/fs.kread"; then
        pass "fs: $FS_NAME read through $blk at blockfs's LBAs: same bytes as put"
    else
        fail "fs: $FS_NAME read through $blk at blockfs's LBAs" \
            "$(cmp "$T/fs.src" "$T/fs.kread" 2>&1 | head -n 1)"
    fi
    if ! gn_bind "$bdf" vfio-pci; then
        fail "fs: bind $bdf back to vfio-pci"
        return
    fi

    if ours_fs "$T/fs-mv" mv "$FS_NAME" "$FS_NEW" --json; then
        pass "fs mv $FS_NAME $FS_NEW"
    else
        fs_fail "fs mv $FS_NAME $FS_NEW" "$T/fs-mv"
    fi
    fs_ls_is "fs ls --json after mv" "" "$FS_NEW:$FS_BYTES"
    fs_stat_missing "fs stat $FS_NAME after mv" "$FS_NAME"
    if ours_fs "$T/fs-stat2" stat "$FS_NEW" --json; then
        check_eq "fs stat $FS_NEW: size" "$FS_BYTES" "$(jqf .size "$T/fs-stat2.out")"
        [ "$ext" = bad ] ||
            check_eq "fs stat $FS_NEW: extent list unchanged by mv" \
                "$(jq -c .extent_list "$T/fs-stat.out")" "$(jq -c .extent_list "$T/fs-stat2.out")"
    else
        fs_fail "fs stat $FS_NEW" "$T/fs-stat2"
    fi
    fs_get_cmp "fs get $FS_NEW after mv: same bytes as put" "$FS_NEW"

    if ours_fs "$T/fs-rm" rm "$FS_NEW" --json; then
        pass "fs rm $FS_NEW"
    else
        fs_fail "fs rm $FS_NEW" "$T/fs-rm"
    fi
    fs_ls_is "fs ls --json after rm" "" ""
    fs_stat_missing "fs stat $FS_NEW after rm" "$FS_NEW"

    if ours_fs "$T/fs-df" df --json; then
        local d="$T/fs-df.out" sum
        check_eq "fs df: uuid (as mkfs made)" "$uuid" "$(jqf .uuid "$d")"
        check_eq "fs df: total_blocks (as mkfs made)" "$blocks" "$(jqf .total_blocks "$d")"
        check_eq "fs df: files" 0 "$(jqf .files "$d")"
        check_eq "fs df: data_blocks" 0 "$(jqf .data_blocks "$d")"
        sum=$(jq '.data_blocks + .metadata_blocks + .free_blocks + .pending_blocks' "$d" 2>&1)
        check_eq "fs df: data + metadata + free + pending blocks" "$blocks" "$sum"
    else
        fs_fail "fs df" "$T/fs-df"
    fi

    if ours_fs "$T/fs-fsck" fsck --json; then
        local f="$T/fs-fsck.out"
        check_eq "fs fsck: clean, consistent, no problems, 0 files, $blocks blocks" \
            "true true 0 0 $blocks" \
            "$(jq -r '"\(.clean) \(.consistent) \(.problems | length) \(.files) \(.total_blocks)"' "$f" 2>&1)"
    else
        fs_fail "fs fsck" "$T/fs-fsck"
        show "$T/fs-fsck.out"
    fi
}

if [ "${BLOCKFS:-0}" = 1 ]; then
    bdf=$(echo "$BDFS" | head -n 1)
    fs_step
fi

# ---- step 8: a striped volume over the first two controllers ------------------------------

# volume_step: every controller on vfio-pci, `gpunvme --device B0,B1,... fs mkfs --stripe 64k`,
# a put, a get compared, the first two members given in the wrong order refused; then, on the
# kernel driver, each member's label (magic, member index) and the file's bytes read from the
# members' /dev/nvmeXn1 at the LBAs the stripe layout gives for stat's volume LBAs, compared
# with put's.
# nth N WORD...: the Nth word (1-based).
nth() {
    local i=$1
    shift
    shift $((i - 1))
    echo "$1"
}

volume_step() {
    local b all rev k b0 b1 rest blks="" sl=$((65536 / EXPECT_LBA)) hl flba lba nlb at n unit m mlba dev
    local vsrc="$T/vol.src"
    k=$(echo "$BDFS" | grep -c .)
    [ "$k" -ge 2 ] || {
        fail "volume: $k controllers, a volume needs 2"
        return
    }
    all=$(echo "$BDFS" | grep . | tr '\n' ',' | sed 's/,$//')
    b0=$(echo "$BDFS" | sed -n 1p)
    b1=$(echo "$BDFS" | sed -n 2p)
    rest=$(echo "$BDFS" | sed -n '3,$p' | grep . | tr '\n' ',' | sed 's/,$//')
    rev="$b1,$b0${rest:+,$rest}"
    hl=$((4096 / EXPECT_LBA))
    [ "$hl" -ge 1 ] || hl=1
    for b in $(echo "$BDFS" | grep .); do
        gn_bind "$b" vfio-pci || {
            fail "volume: bind $b to vfio-pci"
            return
        }
    done
    if ours "$T/vol-mkfs" --device "$all" fs mkfs --stripe 64k --force --json; then
        pass "volume: fs mkfs --stripe 64k over $k members ($all)"
    else
        fs_fail "volume: fs mkfs over $all" "$T/vol-mkfs"
        return
    fi
    head -c "$FS_BYTES" /dev/urandom >"$vsrc"
    if ! ours "$T/vol-put" --device "$all" fs put "$vsrc" vol/data --json; then
        fs_fail "volume: fs put" "$T/vol-put"
        return
    fi
    rm -f "$T/vol.got"
    if ours "$T/vol-get" --device "$all" fs get vol/data "$T/vol.got" --json &&
        cmp -s "$vsrc" "$T/vol.got"; then
        pass "volume: fs get: same bytes as put ($FS_BYTES)"
    else
        fail "volume: fs get" "$(tail -n 2 "$T/vol-get.err" 2>/dev/null)"
    fi
    if ours "$T/vol-rev" --device "$rev" fs ls; then
        fail "volume: members in the wrong order were accepted"
    elif grep -q "device 0 is member 1" "$T/vol-rev.err"; then
        pass "volume: members in the wrong order refused ($(grep -m1 error "$T/vol-rev.err"))"
    else
        fail "volume: wrong-order refusal" "$(tail -n 1 "$T/vol-rev.err")"
    fi
    if ! ours "$T/vol-stat" --device "$all" fs stat vol/data --json ||
        ! jq -r '.extent_list[] | "\(.file_lba) \(.lba) \(.nlb)"' "$T/vol-stat.out" >"$T/vol.extents"; then
        fs_fail "volume: fs stat" "$T/vol-stat"
        return
    fi
    for b in $(echo "$BDFS" | grep .); do
        gn_bind "$b" nvme || {
            fail "volume: bind $b to nvme"
            return
        }
    done
    for b in $(echo "$BDFS" | grep .); do
        if ! dev=$(gn_blockdev "$b" 1); then
            fail "volume: no block device for $b after rebinding to nvme"
            return
        fi
        blks="$blks $dev"
    done
    m=0
    for dev in $blks; do
        dd if="$dev" bs=4096 count=1 iflag=direct 2>/dev/null >"$T/vol.label$m"
        check_eq "volume: $dev label magic" GPNVVOL1 "$(head -c 8 "$T/vol.label$m")"
        check_eq "volume: $dev member index" "$m" "$(od -An -tu4 -j32 -N4 "$T/vol.label$m" | tr -d ' ')"
        m=$((m + 1))
    done
    : >"$T/vol.kread.all"
    while read -r flba lba nlb; do
        at=0
        while [ "$at" -lt "$nlb" ]; do
            unit=$(((lba + at) / sl))
            n=$((sl - (lba + at) % sl))
            [ "$n" -le $((nlb - at)) ] || n=$((nlb - at))
            m=$((unit % k))
            mlba=$((hl + (unit / k) * sl + (lba + at) % sl))
            # shellcheck disable=SC2086 # the member list splits into words on purpose
            dev=$(nth $((m + 1)) $blks)
            timeout "$CMD_TIMEOUT" dd if="$dev" bs="$EXPECT_LBA" skip="$mlba" count="$n" \
                iflag=direct 2>>"$T/vol.kdd.err" >>"$T/vol.kread.all" || {
                fail "volume: dd from $dev" "$(tail -n 1 "$T/vol.kdd.err")"
                return
            }
            at=$((at + n))
        done
    done <"$T/vol.extents"
    head -c "$FS_BYTES" "$T/vol.kread.all" >"$T/vol.kread"
    if cmp -s "$vsrc" "$T/vol.kread"; then
        pass "volume: the file read through$blks at the stripe layout's LBAs: same bytes as put"
    else
        fail "volume: the file through the kernel at the layout's LBAs" \
            "$(cmp "$vsrc" "$T/vol.kread" 2>&1 | head -n 1)"
    fi
}

if [ "${VOLUME:-0}" = 1 ]; then
    volume_step
fi

# ---- step 9: gpunvme serve over VFIO -------------------------------------------------------

# serve_step BDF: `gpunvme serve` owns the controller through VFIO (arenas mapped through the
# emulated IOMMU, doorbells forwarded to BAR0); two client processes verify their ranges at
# once; clients killed mid-I/O beside an honest one; every killed client reclaimed; no DMAR
# fault in the guest's log afterwards (a queue deleted after its memory left the IOMMU would
# fault there).
dmar_faults() { dmesg | grep -c 'DMAR:.*fault\|DMAR: \[DMA' || true; }
serve_step() {
    local bdf=$1 sock="$T/serve.sock" spid i p rc faults0 faults1 honest victim
    gn_bind "$bdf" vfio-pci || {
        fail "serve: bind $bdf to vfio-pci"
        return
    }
    faults0=$(dmar_faults)
    gpunvme --device "$bdf" serve --socket "$sock" >"$T/serve.out" 2>&1 &
    spid=$!
    for i in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
    [ -S "$sock" ] || {
        fail "serve: the daemon never listened" "$(tail -n 3 "$T/serve.out")"
        kill "$spid" 2>/dev/null
        return
    }
    rc=0
    ours "$T/serve-c0" serve --socket "$sock" check --force --json --first-lba 16384 --lbas 4096 --qd 8 &
    p=$!
    ours "$T/serve-c1" serve --socket "$sock" check --force --json --first-lba 20480 --lbas 4096 --qd 8 ||
        rc=1
    wait "$p" || rc=1
    if [ $rc = 0 ] &&
        [ "$(jq -s 'map(.errors + .mismatched_bytes) | add' "$T/serve-c0.out" "$T/serve-c1.out")" = 0 ]; then
        pass "serve: two client processes through VFIO verified their ranges at once"
    else
        fail "serve: two clients through VFIO" "$(tail -n 2 "$T/serve-c0.err" "$T/serve-c1.err")"
    fi
    ours "$T/serve-honest" serve --socket "$sock" check --force --json --first-lba 28672 --lbas 2048 \
        --qd 4 --runtime 20s &
    honest=$!
    for i in $(seq 10); do
        gpunvme serve --socket "$sock" check --force --first-lba 32768 --lbas 8192 --qd 8 --runtime 60s \
            >/dev/null 2>&1 &
        victim=$!
        sleep "$((RANDOM % 2)).$((RANDOM % 10))"
        kill -9 "$victim" 2>/dev/null
        wait "$victim" 2>/dev/null
    done
    if wait "$honest" && [ "$(jq '.errors + .mismatched_bytes' "$T/serve-honest.out")" = 0 ]; then
        pass "serve: 10 clients killed through VFIO beside an honest one, which verified"
    else
        fail "serve: the honest client beside killed ones" "$(tail -n 2 "$T/serve-honest.err")"
    fi
    if ours "$T/serve-status" serve --socket "$sock" status --json &&
        [ "$(jq '[.controllers[0].lent_queue_pairs, (.clients | length), .controllers[0].degraded]' -c "$T/serve-status.out")" = '[0,1,null]' ]; then
        pass "serve: every client reclaimed ($(jq '.reclaimed_holding_queues' "$T/serve-status.out") with queues held, $(jq '.controllers[0].forwarded_doorbells' "$T/serve-status.out") doorbells forwarded)"
    else
        fail "serve: after the kills" "$(head -c 400 "$T/serve-status.out")"
    fi
    kill -TERM "$spid" 2>/dev/null
    if wait "$spid"; then pass "serve: the daemon stopped cleanly"
    else fail "serve: the daemon's exit" "$(tail -n 3 "$T/serve.out")"; fi
    faults1=$(dmar_faults)
    check_eq "serve: DMAR faults in the guest's log during the serve step" 0 $((faults1 - faults0))
}

if [ "${SERVE:-0}" = 1 ]; then
    serve_step "$(echo "$BDFS" | head -n 1)"
fi

exit "$FAILED"
