#!/usr/bin/env bash
# The Python package's tests: a venv in target/py-venv (made once; maturin and pytest from
# PyPI), `maturin develop` of python/ into it (the debug build, sharing target/ with cargo),
# then pytest over python/tests (GPUNVME_BIN: the gpunvme binary the served tests start as the
# daemon, built here). Extra arguments go to pytest.
#
#   scripts/py-test.sh            every test
#   scripts/py-test.sh -k busy    pytest's selection
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=target/py-venv
if [ ! -x "$VENV/bin/maturin" ] || [ ! -x "$VENV/bin/pytest" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "maturin>=1.9,<2" "pytest>=7"
fi
export VIRTUAL_ENV=$PWD/$VENV PATH=$PWD/$VENV/bin:$PATH
(cd python && maturin develop -q)
# The daemon the served tests start (test_served.py).
cargo build -q -p gpunvme-cli
export GPUNVME_BIN=${GPUNVME_BIN:-$PWD/target/debug/gpunvme}
python -m pytest -q python/tests "$@"
