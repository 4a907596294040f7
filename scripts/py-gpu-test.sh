#!/usr/bin/env bash
# The Python package's tests ON THE GPU MACHINE, with the wheel scripts/gpu-build.sh built
# here and carried in .gpu-bin/wheels: the gpunvme and pytest wheels installed from the carried
# folder (no network there) into a folder on PYTHONPATH, beside the machine's torch and
# safetensors, then pytest over python/tests. Extra arguments go to pytest.
#
#   scripts/py-gpu-test.sh [--bin DIR] [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.gpu-bin
if [ "${1:-}" = --bin ]; then BIN=$2; shift 2; fi
# The machine's python3 is itself a venv holding torch: install beside it with --target.
SITE=${TMPDIR:-/tmp}/gpunvme-py-site
rm -rf "$SITE"
# fastsafetensors too where the benchmark's wheels were carried (tests/test_fastsafetensors.py
# is skipped without it).
python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$SITE" "$BIN"/wheels/*.whl $(ls "$BIN"/bench-wheels/fastsafetensors-*.whl 2>/dev/null)
export PYTHONPATH=$SITE
# From outside the checkout, so `import gpunvme` is the installed wheel, not python/gpunvme.
cd "${TMPDIR:-/tmp}"
python3 -m pytest -q -rs -p no:cacheprovider "$OLDPWD/python/tests" "$@"
