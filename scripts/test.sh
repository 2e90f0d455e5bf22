#!/usr/bin/env bash
# The README's test command (CI runs it, .ci/run): installs what is missing, then
#   1. the ASan + UBSan tree (scripts/sanitize.sh: clang, every library, test and fuzzer
#      compiled once into build-asan/) and every test under it, except those labelled
#      `timing`: they assert speed (measured rates that route a request, latencies, CPU use,
#      benchmark ratios), which ASan's 2-5x slowdown changes without any memory error;
#   2. every fuzzer from that tree (scripts/fuzz.sh, FUZZ_SECONDS each);
#   3. the plain build into build/ (gcc, RelWithDebInfo: the reference compiler and flags) of
#      every binary (kvrelay, the benchmarks; CMake target plain_ci) and the tests labelled
#      `timing`, and the `timing` and `bench` tests on it.
#      PLAIN=all runs every test there as well (the old CI; it no longer fits 2 cores in 30 min
#      next to the sanitized suite, and repeats what step 1 ran, sanitized).
# Exits non-zero on any failure. SANITIZE=0 skips 1 and 2 (then step 3 runs every test).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Formatting drift fails the run (scripts/check_format.sh --fix repairs it).
scripts/check_format.sh
step() { echo "test.sh: $1 took $(($(date +%s) - $2)) s"; }
plain=${PLAIN:-timing}
if [[ ${SANITIZE:-1} != 0 ]]; then
  t=$(date +%s)
  SANITIZE_CTEST_ARGS="-LE timing" scripts/sanitize.sh
  step "the ASan+UBSan suite (build + tests)" "$t"
  t=$(date +%s)
  scripts/fuzz.sh
  step "the fuzzers" "$t"
else
  plain=all
fi
t=$(date +%s)
BUILD_DIR=${BUILD_DIR:-build}
if [[ $plain == all ]]; then
  BUILD_DIR="$BUILD_DIR" scripts/build.sh -DKVRELAY_BUILD_TESTS=ON -DKVRELAY_BUILD_BENCH=ON "$@"
else
  # Every binary (kvrelay, the benchmarks) and the tests labelled timing (CMake target plain_ci).
  BUILD_DIR="$BUILD_DIR" TARGETS=plain_ci scripts/build.sh -DKVRELAY_BUILD_TESTS=ON \
    -DKVRELAY_BUILD_BENCH=ON "$@"
fi
step "the plain build" "$t"
t=$(date +%s)
if [[ $plain == all ]]; then
  (cd "$BUILD_DIR" && ctest --output-on-failure -j "${TEST_JOBS:-$(nproc)}" --timeout 600)
else
  (cd "$BUILD_DIR" && ctest --output-on-failure -j "${TEST_JOBS:-$(nproc)}" --timeout 600 \
    -L 'timing|bench')
fi
step "the plain tests ($plain)" "$t"
