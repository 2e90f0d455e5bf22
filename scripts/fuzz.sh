#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ (clang, -fsanitize=fuzzer,address,undefined) in the
# ASan + UBSan tree that scripts/sanitize.sh configures (${FUZZ_BUILD_DIR:-build-asan}: the
# libraries are compiled once for the sanitized test suite and the fuzzers), and runs each for
# FUZZ_SECONDS (default 10) from its committed seed corpus fuzz/corpus/<target>/ (read only:
# new inputs go to a scratch copy). Exits non-zero on any crash, leak, sanitizer report or
# timeout; the input that did it is saved as ${FUZZ_BUILD_DIR}/artifacts/<target>-crash-...
# (add it to the corpus once fixed).
#   FUZZ_TARGETS="wal_fuzzer ..."  runs only those;  FUZZ_SECONDS=0 builds and replays the
#   corpora only (no new inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FUZZ_BUILD_DIR:-build-asan}
SECONDS_PER_TARGET=${FUZZ_SECONDS:-10}
JOBS=${JOBS:-$(nproc)}
ALL_TARGETS="hf_config_fuzzer safetensors_fuzzer wal_fuzzer control_frame_fuzzer
  generate_request_fuzzer reserve_request_fuzzer cachestore_rpc_fuzzer"
TARGETS=${FUZZ_TARGETS:-$ALL_TARGETS}

start=$(date +%s)
SANITIZE_BUILD_DIR="$BUILD_DIR" scripts/sanitize.sh --configure "$@"
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j "$JOBS" --target $TARGETS
built=$(date +%s)
echo "fuzz.sh: built in $((built - start)) s"

mkdir -p "$BUILD_DIR/artifacts"
failed=()
for t in $TARGETS; do
  corpus="fuzz/corpus/$t"
  scratch="$BUILD_DIR/corpus/$t"
  rm -rf "$scratch"
  mkdir -p "$scratch"
  args=(-max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -max_len=65536
        -print_final_stats=1 -artifact_prefix="$BUILD_DIR/artifacts/$t-")
  if [[ -f fuzz/$t.dict ]]; then args+=(-dict="fuzz/$t.dict"); fi
  if [[ $SECONDS_PER_TARGET == 0 ]]; then
    # Replay the committed corpus once (every seed must pass).
    run=("$BUILD_DIR/bin/fuzz/$t" -runs=0 "${args[@]:1}" "$corpus")
  else
    run=("$BUILD_DIR/bin/fuzz/$t" "${args[@]}" "$scratch" "$corpus")
  fi
  log="$BUILD_DIR/$t.log"
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
     "${run[@]}" >"$log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
    echo "fuzz.sh: $t ok ($(find "$corpus" -type f | wc -l) seeds, ${execs:-?} runs)"
  else
    echo "fuzz.sh: $t FAILED; last lines of $log:" >&2
    tail -40 "$log" >&2
    failed+=("$t")
  fi
done
echo "fuzz.sh: $(( $(date +%s) - start )) s in all"
if ((${#failed[@]} > 0)); then
  echo "fuzz.sh: failed: ${failed[*]} (inputs in $BUILD_DIR/artifacts/)" >&2
  exit 1
fi
