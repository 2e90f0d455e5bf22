#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds the CUDA model targets, checks every kernel and the
# CUDA forward pass against the CPU reference (model_cuda_test must run, not skip), then times
# prefill and decode tokens/s for a Llama-3-8B-shaped layer stack and a DeepSeek-V3-shaped MLA
# layer with random weights and prints the table.
#
#   bench/gpu_check.sh            (BUILD=build-gpu, LAYERS=32, PROMPT=1024, BATCH=32 to override)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)

echo "== configure + build (${BUILD})"
cmake -S . -B "${BUILD}" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DKVRELAY_CUDA=ON \
  -DKVRELAY_BUILD_TESTS=ON -DKVRELAY_BUILD_BENCH=ON >"${BUILD}.configure.log" 2>&1 ||
  { tail -30 "${BUILD}.configure.log"; exit 1; }
cmake --build "${BUILD}" -j"$(nproc)" --target model_cuda_test gpu_model_bench model_runner_test

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== CUDA vs CPU reference"
out=$("${BUILD}/bin/tests/model_cuda_test" 2>&1) || { echo "${out}"; echo "FAIL: model_cuda_test"; exit 1; }
echo "${out}" | grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED) ' || true
if echo "${out}" | grep -q '^\[  SKIPPED \]'; then
  echo "FAIL: GPU tests were skipped: no usable device?"
  exit 1
fi
echo "== CPU runner tests (the reference itself)"
"${BUILD}/bin/tests/model_runner_test" --gtest_brief=1 | tail -3

echo "== timing"
"${BUILD}/bin/gpu_model_bench" --layers "${LAYERS:-32}" --prompt "${PROMPT:-1024}" \
  --batch "${BATCH:-32}"
