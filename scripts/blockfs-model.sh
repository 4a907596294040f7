#!/usr/bin/env bash
# blockfs's randomized tests at length, by hand (CI runs them with a fixed budget): the
# model-based test (blockfs/tests/model.rs: mkfs/put/put --force/rm/mv/remount/fsck over random
# names, sizes and depths against an in-memory model, with power cuts injected between device
# writes) for SECS seconds over fresh seeds, then the mutation suite (blockfs/tests/mutations.rs)
# with every record's fields and RANDOM random-damage images. Release build.
#
#   scripts/blockfs-model.sh [SECS [RANDOM]]     default: 3600 s, 5000 images
#
# Prints each test's summary line (operations, crashes, files; images, mounted, repaired).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-3600}
random=${2:-5000}
BLOCKFS_MODEL_SECS=$secs BLOCKFS_MODEL_OPS=${BLOCKFS_MODEL_OPS:-5000} \
    cargo test --release -p blockfs --test model -- random_operations --nocapture
BLOCKFS_MUTATIONS_RECORDS=100000 BLOCKFS_MUTATIONS_RANDOM=$random \
    cargo test --release -p blockfs --test mutations -- --nocapture
