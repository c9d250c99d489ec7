#!/usr/bin/env bash
# Regenerates include/dpsync.h from src/ffi with the pinned cbindgen (see cbindgen.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
DPSYNC_BLESS=1 cargo test --release --quiet --test header
echo "wrote include/dpsync.h"
