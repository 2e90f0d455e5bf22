#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang (-fsanitize=fuzzer,address,undefined) into
# ${FUZZ_BUILD_DIR:-build-fuzz} and runs each for FUZZ_SECONDS (default 20) from its committed
# seed corpus fuzz/corpus/<target>/ (read only: new inputs go to a scratch copy). Exits non-zero
# on any crash, leak, sanitizer report or timeout; the input that did it is saved as
# ${FUZZ_BUILD_DIR}/artifacts/<target>-crash-... (add it to the corpus once fixed).
#   FUZZ_TARGETS="wal_fuzzer ..."  runs only those;  FUZZ_SECONDS=0 builds and replays the
#   corpora only (no new inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
SECONDS_PER_TARGET=${FUZZ_SECONDS:-20}
JOBS=${JOBS:-$(nproc)}
ALL_TARGETS="hf_config_fuzzer safetensors_fuzzer wal_fuzzer control_frame_fuzzer
  generate_request_fuzzer reserve_request_fuzzer cachestore_rpc_fuzzer"
TARGETS=${FUZZ_TARGETS:-$ALL_TARGETS}

start=$(date +%s)
# shellcheck disable=SC2086
# -O1 with line tables only: ASan stack traces keep file:line, the build stays short on 2 cores.
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O1 -gline-tables-only" -DCMAKE_C_FLAGS_RELEASE="-O1" \
  -DKVRELAY_FUZZ=ON -DKVRELAY_BUILD_TESTS=OFF -DKVRELAY_BUILD_BENCH=OFF -DKVRELAY_CUDA=OFF \
  "$@" >/dev/null
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
