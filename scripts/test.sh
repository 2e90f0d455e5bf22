#!/usr/bin/env bash
# The README's test command: installs what is missing, builds into build/, runs every test.
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Formatting drift fails the run (scripts/check_format.sh --fix repairs it).
scripts/check_format.sh
BUILD_DIR=${BUILD_DIR:-build}
BUILD_DIR="$BUILD_DIR" scripts/build.sh -DKVRELAY_BUILD_TESTS=ON -DKVRELAY_BUILD_BENCH=ON "$@"
(cd "$BUILD_DIR" && ctest --output-on-failure -j "${TEST_JOBS:-$(nproc)}" --timeout 600)
# Every parser and decoder under libFuzzer + ASan + UBSan, FUZZ_SECONDS (default 20) each, from
# the committed corpora (fuzz/corpus/); any crash fails the run. FUZZ_SECONDS=0 only replays.
scripts/fuzz.sh
