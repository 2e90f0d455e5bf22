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
# ASan + UBSan (-O1) over the libraries and unit tests of common/, kv/, proto/, cachestore/ and
# transfer/, the CI subset that fits its 2-core budget (~5-6 min); `scripts/sanitize.sh --all`
# is the whole suite under the same sanitizers. SANITIZE=0 skips this step.
if [[ ${SANITIZE:-1} != 0 ]]; then
  scripts/sanitize.sh
fi
