# shellcheck shell=dash
#
# Result lines and small helpers for the guest's test scripts (suite.sh, nskinds.sh), sourced
# after lib.sh. Needs GN_TOKEN (set by the host in run.sh) and T (a scratch folder).

FAILED=0
# Every command that talks to a device is bounded: a hang fails its check instead of the boot.
CMD_TIMEOUT=300

pass() { echo "GN-RESULT $GN_TOKEN PASS $1"; }
fail() {
    echo "GN-RESULT $GN_TOKEN FAIL $1${2:+ ($2)}"
    FAILED=1
}
# check NAME EXPECTED ACTUAL
check_eq() {
    if [ "$2" = "$3" ]; then
        pass "$1 = $2"
    else
        fail "$1" "expected '$2', got '$3'"
    fi
}
# Print a file's contents into the log (for a failing check's context).
show() {
    echo "---- $1"
    head -c 4000 "$1" 2>/dev/null
    echo
}

# gpunvme with a time limit; stdout and stderr to files named by $1.
ours() {
    local out=$1
    shift
    timeout "$CMD_TIMEOUT" gpunvme "$@" >"$out.out" 2>"$out.err"
}

# A JSON field with jq; empty when absent or null.
jqf() { jq -r "$1 // empty" "$2" 2>/dev/null; }
# A number that may be given as decimal or "0x..." text, in decimal.
num() {
    [ -n "$1" ] || return 0
    printf '%d' "$1" 2>/dev/null || echo "$1"
}
# Trailing spaces removed (identify strings are space-padded).
rtrim() { printf '%s' "$1" | sed 's/ *$//'; }
