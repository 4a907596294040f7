# shellcheck shell=bash
# PASS/FAIL lines with their counters, and checks both SPDK scripts make (spdk-test.sh on the CPU
# machine, spdk-gpu-test.sh on the GPU machine); sourced, from the repository root.
pass=0 fail=0
ok() { pass=$((pass + 1)); echo "PASS $*"; }
bad() { fail=$((fail + 1)); echo "FAIL $*"; }
# "crc32c: GPU 99ad9e03 = host 99ad9e03 = recorded 99ad9e03": three checksums, all equal.
crcs_agree() {
    local crcs
    crcs=$(grep -o '[0-9a-f]\{8\}' <<<"$1")
    [ "$(wc -l <<<"$crcs")" -eq 3 ] && [ "$(sort -u <<<"$crcs" | wc -l)" -eq 1 ]
}
