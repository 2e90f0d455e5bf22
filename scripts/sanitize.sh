#!/usr/bin/env bash
# The ASan + UBSan tree: clang, -O1 with line tables, CUDA off, every library, every test and
# the libFuzzer targets (KVRELAY_FUZZ=ON instruments the libraries for coverage as well, so the
# sources are compiled once for both and scripts/fuzz.sh runs its fuzzers from this tree), into
# ${SANITIZE_BUILD_DIR:-build-asan}; then every ctest test in it. Any sanitizer report fails the
# test that made it (ASan aborts, UBSan halts on error, LSan with tests/sanitizer/lsan.supp).
#
#   scripts/sanitize.sh              configure, build everything, run every test
#   scripts/sanitize.sh --configure  configure only (scripts/fuzz.sh uses the same tree)
#   scripts/sanitize.sh --build      configure and build only
# Environment: JOBS (build), TEST_JOBS (ctest -j), SANITIZE_CTEST_ARGS (extra ctest arguments,
# e.g. "-R e2e_" or "-LE timing"). Extra arguments after the mode go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${SANITIZE_BUILD_DIR:-build-asan}
JOBS=${JOBS:-$(nproc)}
MODE=run
case ${1:-} in
  --configure) MODE=configure; shift ;;
  --build) MODE=build; shift ;;
  --all) shift ;;  # the old name of the default (the whole suite)
esac

start=$(date +%s)
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only" -DCMAKE_C_FLAGS_RELEASE="-O1" \
  -DKVRELAY_FUZZ=ON -DKVRELAY_SANITIZE=address,undefined -DKVRELAY_CUDA=OFF \
  -DKVRELAY_BUILD_TESTS=ON -DKVRELAY_BUILD_BENCH=OFF "$@" >/dev/null
[[ $MODE == configure ]] && exit 0
cmake --build "$BUILD_DIR" -j "$JOBS"
built=$(date +%s)
echo "sanitize.sh: built in $((built - start)) s"
[[ $MODE == build ]] && exit 0
# shellcheck disable=SC2086  # SANITIZE_CTEST_ARGS is a list of arguments
(cd "$BUILD_DIR" && ctest --output-on-failure -j "${TEST_JOBS:-$(nproc)}" --timeout 900 \
  ${SANITIZE_CTEST_ARGS:-})
echo "sanitize.sh: tests passed in $(($(date +%s) - built)) s"
