#!/usr/bin/env bash
# The README's main command: installs what is missing, builds, and runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build} TARGETS=kvrelay scripts/build.sh
BIN=${BUILD_DIR:-build}/bin
echo "== KV-cache bytes per model (kvrelay layout --seed-table)"
"$BIN/kvrelay" layout --seed-table
