#!/usr/bin/env bash
# The one script to run on a machine with an NVIDIA GPU (issue #18). Bounded in time: every step
# runs under `timeout`, and the whole run stops at BUDGET_S seconds. In one run it
#   1. configures and builds with CUDA (CMakeLists.txt fixes the architectures at sm_80 and
#      sm_90, never "native"): the kvrelay binary, gpu_model_bench and every test labelled "gpu";
#   2. runs the CUDA tests with KVRELAY_REQUIRE_GPU=1, so a test that finds no device fails
#      instead of skipping (the CUDA runner against the CPU runner on every test architecture:
#      greedy tokens equal, logits close; staging, on_layer_done order, adopted prefixes,
#      device argmax), each architecture also with an FP8 E4M3 KV cache, and the FP8 kernels'
#      cache bytes against kv/fp8.h on the host (its own line in the summary);
#   3. starts a disaggregated cluster (`kvrelay up`, prefill and decode workers with
#      --device cuda) per test architecture and checks its tokens equal co-located generation,
#      again with --kv-cache-dtype fp8_e4m3 when `up` and `generate` take that flag;
#   4. times prefill tokens/s against cuBLAS alone at the same GEMM shapes (Llama-3-8B-shaped
#      stack), decode tokens/s, and the staging copies' bandwidth against cudaMemcpy into pinned
#      memory, printing the ratios (gpu_model_bench);
# and ends with a PASS/FAIL table. Exit 0 only when every step passed.
#
#   bench/gpu_check.sh
#   BUILD=build-gpu BUDGET_S=900 LAYERS=32 PROMPT=1024 BATCH=32 STEPS=32 SKIP_BUILD=0 \
#     bench/gpu_check.sh
# A disaggregated run is compared with `generate --colocated` on the same device when that
# command takes --device; against the CPU reference a difference is reported as WARN, not FAIL
# (the backends' bits differ, so a near tie may break the other way).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
BUILD=${BUILD:-build-gpu}
BUDGET_S=${BUDGET_S:-900}
LAYERS=${LAYERS:-32}
PROMPT=${PROMPT:-1024}
BATCH=${BATCH:-32}
STEPS=${STEPS:-32}
JOBS=${JOBS:-$(nproc)}
# The workers' --device; "none" passes no flag (a dry run of the cluster step on a CPU machine).
DEVICE=${DEVICE:-cuda}
PY=${PY:-$(command -v python3 || echo /usr/bin/python3)}
START=${SECONDS}
LOGS="${BUILD}/gpu-check"  # every step's log
mkdir -p "${LOGS}"
declare -a SUMMARY=()
FAILED=0

left() { echo $((BUDGET_S - (SECONDS - START))); }
record() {  # record NAME PASS|WARN|FAIL DETAIL
  SUMMARY+=("$(printf '%-46s %-5s %s' "$1" "$2" "$3")")
  [[ "$2" != FAIL ]] || FAILED=1
}
# bounded CMD...: runs CMD under timeout, at most the budget left (and at most $LIMIT seconds).
bounded() {
  local limit=${LIMIT:-600} budget
  budget=$(left)
  ((budget < limit)) && limit=${budget}
  if ((limit <= 5)); then
    echo "gpu_check: out of time budget (${BUDGET_S} s)"
    return 124
  fi
  timeout --kill-after=10 "${limit}" "$@"
}
finish() {
  echo
  echo "== summary ($(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - START)) s)"
  printf '%s\n' "${SUMMARY[@]}"
  exit "${FAILED}"
}

echo "== device"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader; then
  record "nvidia-smi" FAIL "no NVIDIA driver or GPU visible"
fi
command -v ucx_info >/dev/null && { ucx_info -v | head -2; ucx_info -d | grep -m3 -i cuda || echo "UCX: no CUDA transports (staged path)"; }

echo "== configure + build (${BUILD})"
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  if ! LIMIT=300 bounded cmake -S . -B "${BUILD}" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DKVRELAY_CUDA=ON -DKVRELAY_BUILD_TESTS=ON \
      -DKVRELAY_BUILD_BENCH=ON >"${LOGS}/configure.log" 2>&1; then
    tail -30 "${LOGS}/configure.log"
    record "configure (KVRELAY_CUDA=ON)" FAIL "see ${LOGS}/configure.log"
    finish
  fi
  # Every gpu-labelled test is a target of the same name.
  mapfile -t GPU_TESTS < <(ctest --test-dir "${BUILD}" -N -L gpu | sed -n 's/^ *Test *#[0-9]*: //p')
  echo "gpu tests: ${GPU_TESTS[*]}"
  if ! bounded cmake --build "${BUILD}" -j"${JOBS}" --target kvrelay gpu_model_bench \
      "${GPU_TESTS[@]}" >"${LOGS}/build.log" 2>&1; then
    grep -E 'error|Error' "${LOGS}/build.log" | head -30
    record "build" FAIL "see ${LOGS}/build.log"
    finish
  fi
  record "build (kvrelay, gpu_model_bench, gpu tests)" PASS "sm_80 + sm_90"
else
  record "build" WARN "skipped (SKIP_BUILD=1): ${BUILD} as it is"
fi

echo "== CUDA tests (KVRELAY_REQUIRE_GPU=1: a test without a device fails, none may skip)"
if KVRELAY_REQUIRE_GPU=1 LIMIT=600 bounded ctest --test-dir "${BUILD}" -L gpu --output-on-failure \
    >"${LOGS}/gpu-tests.log" 2>&1; then
  record "ctest -L gpu" PASS "$(grep -E 'tests passed' "${LOGS}/gpu-tests.log" | tail -1)"
else
  tail -60 "${LOGS}/gpu-tests.log"
  record "ctest -L gpu" FAIL "see ${LOGS}/gpu-tests.log"
fi
# model_cuda_test cases matching a filter, printed and recorded on a line of their own; a case
# that skips (no device after all) fails the line.
cuda_cases() {  # LABEL FILTER
  local out rc
  out=$(KVRELAY_REQUIRE_GPU=1 LIMIT=300 bounded "${BUILD}/bin/tests/model_cuda_test" \
        --gtest_filter="$2" 2>&1)
  rc=$?
  echo "${out}" | grep -E '^\[ +(OK|FAILED|SKIPPED) ' || true
  if ((rc == 0)) && ! echo "${out}" | grep -q '^\[  SKIPPED \]'; then
    record "$1" PASS "$(echo "${out}" | grep -c '^\[       OK \]') cases"
  else
    record "$1" FAIL "model_cuda_test --gtest_filter='$2'"
  fi
}
# The CUDA runner against the CPU runner, per test architecture.
cuda_cases "CUDA runner == CPU runner (greedy, per arch)" '*MatchCpu*:*MatchCpuRunner*'
# The FP8 E4M3 KV cache: the kernels' cache bytes and gathers equal kv/fp8.h on the host, paged
# attention over fp8 equals host dequantisation, and the runner checks above with an fp8 cache
# on both sides (the *_fp8 cases).
cuda_cases "CUDA fp8 KV == kv/fp8.h (bytes, runner)" '*Fp8*:*_fp8'

echo "== disaggregated (kvrelay up, --device ${DEVICE}) == co-located"
KVRELAY="${BUILD}/bin/kvrelay"
WORKER_ARGS="--device ${DEVICE}"
[[ "${DEVICE}" == none ]] && WORKER_ARGS=""
CO_DEVICE=()
# The co-located reference computes on the same backend when `generate` can be told to.
if [[ "${DEVICE}" != none ]] && "${KVRELAY}" generate --help 2>&1 | grep -q -- '--device'; then
  CO_DEVICE=(--device "${DEVICE}")
fi
# Each architecture with the model's KV dtype and, when `up` (which hands the flag to every
# worker and the gateway) and `generate` take --kv-cache-dtype, with an FP8 E4M3 cache on both
# sides of the comparison.
KV_DTYPES=(model)
if "${KVRELAY}" up --help 2>&1 | grep -q -- '--kv-cache-dtype' &&
   "${KVRELAY}" generate --help 2>&1 | grep -q -- '--kv-cache-dtype'; then
  KV_DTYPES+=(fp8_e4m3)
else
  record "disaggregated == co-located (fp8 KV)" WARN "no --kv-cache-dtype flag: not run"
fi
for case in llama:model deepseek_v3:model llama:fp8_e4m3 deepseek_v3:fp8_e4m3; do
  arch=${case%%:*}
  kv=${case#*:}
  [[ " ${KV_DTYPES[*]} " == *" ${kv} "* ]] || continue
  KV_ARGS=()
  [[ "${kv}" != model ]] && KV_ARGS=(--kv-cache-dtype "${kv}")
  label="${arch}"
  [[ "${kv}" != model ]] && label="${arch}, ${kv} KV"
  work=$(mktemp -d /tmp/kvrelay-gpu-check-XXXXXX)
  model="${work}/model"
  "${KVRELAY}" make-test-model --arch "${arch}" --seed 5 --out "${model}" >/dev/null
  # timeout itself in the background, so that TERM to it reaches `up`, which stops its children.
  timeout --kill-after=10 180 "${KVRELAY}" up --model "${model}" --prefill 1 --decode 1 \
    --insecure --gateway-address 127.0.0.1:0 --http-address 127.0.0.1:0 \
    --data-dir "${work}/data" --prefill-args "${WORKER_ARGS}" --decode-args "${WORKER_ARGS}" \
    "${KV_ARGS[@]}" \
    >"${work}/up.log" 2>&1 &
  up_pid=$!
  gateway=""
  for _ in $(seq 1 600); do
    gateway=$(sed -n 's/^kvrelay up: ready; gateway \([^ ]*\).*/\1/p' "${work}/up.log" | head -1)
    [[ -n "${gateway}" ]] && break
    kill -0 "${up_pid}" 2>/dev/null || break
    sleep 0.2
  done
  if [[ -z "${gateway}" ]]; then
    tail -30 "${work}/up.log"
    record "disaggregated == co-located (${label})" FAIL "the cluster did not start; ${work}/up.log"
    kill -TERM "${up_pid}" 2>/dev/null; wait "${up_pid}" 2>/dev/null
    continue
  fi
  grep -E 'listening|device' "${work}/up.log" | grep -i -E 'cuda|device' | head -4
  tokens="3,14,15,92,65,35,89,79,32,38,46,26,43,38,32,79,50,28,84,19,71,69,39,99,37,51,5,8,20,97,49,44,59,23"
  dis=$(LIMIT=120 bounded "${KVRELAY}" generate --gateway "${gateway}" --insecure \
        --tokens "${tokens}" --max-tokens 24 --json 2>"${work}/dis.err")
  co=$(LIMIT=120 bounded "${KVRELAY}" generate --colocated --model "${model}" "${CO_DEVICE[@]}" \
       "${KV_ARGS[@]}" --tokens "${tokens}" --max-tokens 24 --json 2>"${work}/co.err")
  kill -TERM "${up_pid}" 2>/dev/null
  wait "${up_pid}" 2>/dev/null
  dis_tokens=$(echo "${dis}" | "${PY}" -c 'import json,sys; print(json.load(sys.stdin)["tokens"])' 2>/dev/null)
  co_tokens=$(echo "${co}" | "${PY}" -c 'import json,sys; print(json.load(sys.stdin)["tokens"])' 2>/dev/null)
  echo "  ${label}: disaggregated ${dis_tokens:-<none>}"
  echo "  ${label}: co-located    ${co_tokens:-<none>} (${CO_DEVICE[*]:-cpu})"
  if [[ -z "${dis_tokens}" || -z "${co_tokens}" ]]; then
    cat "${work}/dis.err" "${work}/co.err" | tail -10
    record "disaggregated == co-located (${label})" FAIL "a generate call failed; ${work}"
  elif [[ "${dis_tokens}" == "${co_tokens}" ]]; then
    record "disaggregated == co-located (${label})" PASS "24 tokens, reference ${CO_DEVICE[*]:-cpu}"
  elif ((${#CO_DEVICE[@]} == 0)); then
    record "disaggregated == co-located (${label})" WARN "differs from the CPU reference (no --device on generate)"
  else
    record "disaggregated == co-located (${label})" FAIL "tokens differ (reference ${CO_DEVICE[*]})"
  fi
done

echo "== timing (gpu_model_bench --layers ${LAYERS} --prompt ${PROMPT} --batch ${BATCH} --steps ${STEPS})"
if LIMIT=400 bounded "${BUILD}/bin/gpu_model_bench" --layers "${LAYERS}" --prompt "${PROMPT}" \
    --batch "${BATCH}" --steps "${STEPS}" | tee "${LOGS}/bench.log"; then
  prefill_ratio=$(sed -n 's/.*prefill, staging included.*ratio \([0-9.]*\).*/\1/p' "${LOGS}/bench.log")
  staging_ratio=$(sed -n 's/.*staging pattern.*ratio \([0-9.]*\).*/\1/p' "${LOGS}/bench.log")
  ok() { "${PY}" -c "import sys; sys.exit(0 if float('$1' or 0) >= $2 else 1)"; }
  if ok "${prefill_ratio}" 0.5; then s=PASS; else s=FAIL; fi
  record "prefill / cuBLAS at the same shapes >= 0.50" "${s}" "${prefill_ratio:-n/a}"
  if ok "${staging_ratio}" 0.8; then s=PASS; else s=FAIL; fi
  record "staging / cudaMemcpy pinned >= 0.80" "${s}" "${staging_ratio:-n/a}"
else
  record "gpu_model_bench" FAIL "see ${LOGS}/bench.log"
fi
finish
