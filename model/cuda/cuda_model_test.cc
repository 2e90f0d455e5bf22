// The CUDA forward pass against the CPU ModelRunner on the tiny test models: same weights
// (fp32 on both sides), fp32 cache, prefill then decode. Tolerance 1e-4 relative on logits
// (cuBLAS and OpenBLAS sum in different orders). Also checks the device cache units equal the
// CPU's to within that tolerance. Skips without a GPU.

#include "model/cuda/cuda_model.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "model/cuda/cuda_ops.h"
#include "model/cuda/skip_without_gpu.h"
#include "model/model_runner.h"
#include "model/numeric.h"
#include "model/safetensors.h"
#include "model/test_model.h"
#include "tests/testing/float_compare.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model::cuda {
namespace {

double RelErr(const float* a, const float* b, int64_t n) {
  return kvrelay::testing::MaxRelativeError(absl::MakeConstSpan(a, n), absl::MakeConstSpan(b, n));
}

class CudaModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { KV_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaModelTest, PrefillAndDecodeMatchCpuRunner) {
  testing::TempDir dir;
  TestModelOptions o;
  o.arch = GetParam();
  o.seed = 4;
  // Plain RoPE here (cuda_runner_test covers the presets' rope_scaling).
  o.config_patch = R"({"rope_scaling": null})";
  KV_ASSERT_OK(WriteTestModel(dir.path(), o));
  RunnerOptions ro;
  ro.cache_dtype = kv::DType::kFp32;
  KV_ASSERT_OK_AND_ASSIGN(auto cpu, ModelRunner::Load(dir.path(), ro));
  const kv::ModelConfig& config = cpu->config();
  KV_ASSERT_OK_AND_ASSIGN(auto files, SafetensorsModel::Open(dir.path()));
  KV_ASSERT_OK_AND_ASSIGN(ModelWeights weights, LoadWeights(*files, config));
  CudaModelOptions options;
  options.weight_dtype = WeightDType::kFp32;
  options.num_blocks = 16;
  options.max_rows = 64;
  options.max_context = 128;
  KV_ASSERT_OK_AND_ASSIGN(auto gpu, CudaModel::Create(config, weights, options));

  KV_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(cpu->layout(), 16));
  Sequence seq(cache.get());
  std::vector<int32_t> tokens;
  for (int i = 0; i < 40; ++i) tokens.push_back((i * 31 + 7) % config.vocab_size);
  const int n = 35;
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want,
                          cpu->Prefill(seq, absl::MakeConstSpan(tokens).first(n)));
  // GPU: one sequence in slots 3, 4, 5 (16-token blocks).
  CudaBatch batch;
  batch.max_blocks = 3;
  for (int i = 0; i < n; ++i) {
    batch.tokens.push_back(tokens[i]);
    batch.positions.push_back(i);
    batch.block_tables.insert(batch.block_tables.end(), {3, 4, 5});
  }
  batch.logit_rows = {n - 1};
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, gpu->Forward(batch));
  EXPECT_LE(RelErr(got.data(), want.data(), config.vocab_size), 1e-4);
  for (int i = n; i < 40; ++i) {
    Sequence* b[] = {&seq};
    KV_ASSERT_OK_AND_ASSIGN(want, cpu->DecodeStep(b, {tokens[i]}));
    CudaBatch step;
    step.max_blocks = 3;
    step.tokens = {tokens[i]};
    step.positions = {i};
    step.block_tables = {3, 4, 5};
    step.logit_rows = {0};
    KV_ASSERT_OK_AND_ASSIGN(got, gpu->Forward(step));
    EXPECT_LE(RelErr(got.data(), want.data(), config.vocab_size), 1e-4) << "decode " << i;
  }
  // The device cache units hold what the CPU cache holds (fp32 entries, within tolerance).
  for (int b = 0; b < 3; ++b) {
    KV_ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> unit, gpu->ReadBlock(0, 3 + b));
    const float* g = reinterpret_cast<const float*>(unit.data());
    const float* c = static_cast<const float*>(cache->pool(0).SlotAddress(seq.blocks(0)[b]));
    const int64_t n_floats = cpu->layout().BlockBytes(0) / 4;
    EXPECT_LE(RelErr(g, c, n_floats), 1e-4) << "block " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, CudaModelTest, ::testing::Values("llama", "deepseek_v3"));

}  // namespace
}  // namespace kvrelay::model::cuda
