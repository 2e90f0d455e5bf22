// Mamba-1: the state a sequence carries is constant in size; prefill(n) + decode(k) equals
// prefill(n + k); a prefill resumed from a block-boundary checkpoint is bit-identical to the
// full prefill; decode is batch-invariant; and the runner matches a double-precision
// from-the-definition forward pass of transformers' MambaMixer (slow path).

#include "model/mamba_runner.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "model/test_model.h"
#include "model/weights.h"
#include "tests/testing/float_compare.h"
#include "tests/testing/random_floats.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  return kvrelay::testing::RandomTokens(n, 512, seed);
}

double RelErr(const float* a, const float* b, int64_t n) {
  return kvrelay::testing::MaxRelativeError(absl::MakeConstSpan(a, n), absl::MakeConstSpan(b, n));
}

class MambaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    TestModelOptions o;
    o.arch = "mamba";
    o.seed = 9;
    ASSERT_TRUE(WriteTestModel(dir_->path(), o).ok());
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  std::unique_ptr<MambaRunner> Load(RunnerOptions options = {}) {
    absl::StatusOr<std::unique_ptr<MambaRunner>> r = MambaRunner::Load(dir_->path(), options);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }
  static testing::TempDir* dir_;
};
testing::TempDir* MambaTest::dir_ = nullptr;

TEST_F(MambaTest, StateBytesAreConstantAndEqualTheLayout) {
  auto runner = Load();
  ASSERT_NE(runner, nullptr);
  const kv::ModelConfig& c = runner->config();
  const kv::ModelLayout& layout = runner->layout();
  // tiny-mamba: 4 layers x 256 channels x (conv 4 + state 16) x bf16.
  const int64_t want =
      int64_t{c.num_hidden_layers} * c.intermediate_size * (c.conv_kernel + c.ssm_state_size) * 2;
  EXPECT_EQ(want, 4 * 256 * 20 * 2);
  EXPECT_EQ(layout.BlockBytes(0), want);
  for (int64_t n : {1, 16, 100, 100000}) EXPECT_EQ(layout.BytesForTokens(n), want) << n;
  MambaSequence seq(layout);
  KV_ASSERT_OK(runner->Prefill(seq, Tokens(40, 1)).status());
  EXPECT_EQ(static_cast<int64_t>(seq.SerializeState().size()), want);
}

TEST_F(MambaTest, DecodeMatchesLongerPrefill) {
  for (const auto& [dtype, bound] :
       {std::pair{kv::DType::kFp32, 1e-5}, std::pair{kv::DType::kBf16, 2e-2}}) {
    SCOPED_TRACE(std::string(kv::DTypeName(dtype)));
    RunnerOptions options;
    options.cache_dtype = dtype;
    auto runner = Load(options);
    ASSERT_NE(runner, nullptr);
    const int32_t vocab = runner->config().vocab_size;
    const int n = 37, k = 12;
    const std::vector<int32_t> tokens = Tokens(n + k, 3);
    MambaSequence full(runner->layout());
    MambaPrefillOptions all;
    all.all_logits = true;
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, runner->Prefill(full, tokens, all));
    MambaSequence seq(runner->layout());
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got,
                            runner->Prefill(seq, absl::MakeConstSpan(tokens).first(n)));
    double worst = RelErr(got.data(), want.data() + (n - 1) * vocab, vocab);
    for (int i = 0; i < k; ++i) {
      MambaSequence* batch[] = {&seq};
      KV_ASSERT_OK_AND_ASSIGN(got, runner->DecodeStep(batch, {tokens[n + i]}));
      worst = std::max(worst, RelErr(got.data(), want.data() + (n + i) * vocab, vocab));
    }
    std::printf(
        "[ mamba, %s state ] max relative logits error, prefill+decode vs prefill: "
        "%.3g\n",
        std::string(kv::DTypeName(dtype)).c_str(), worst);
    EXPECT_LE(worst, bound);
    EXPECT_EQ(seq.num_tokens(), n + k);
  }
}

// Checkpoints at block boundaries: a sequence restored from the checkpoint after block b
// computes only the remaining tokens and ends bit-identical (logits and state) to the full run.
TEST_F(MambaTest, ResumeFromCheckpointIsBitExact) {
  auto runner = Load({.threads = 2});
  ASSERT_NE(runner, nullptr);
  const int32_t vocab = runner->config().vocab_size;
  const int64_t bt = runner->layout().block_tokens();
  const std::vector<int32_t> tokens = Tokens(75, 4);  // 4 full blocks + 11 tokens
  std::map<int64_t, std::vector<uint8_t>> checkpoints;
  MambaPrefillOptions options;
  options.on_checkpoint = [&](int64_t block, absl::Span<const uint8_t> state) {
    checkpoints[block].assign(state.begin(), state.end());
  };
  options.all_logits = true;
  MambaSequence full(runner->layout());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, runner->Prefill(full, tokens, options));
  ASSERT_EQ(checkpoints.size(), 4u);
  for (const auto& [block, state] : checkpoints) {
    SCOPED_TRACE(block);
    EXPECT_EQ(static_cast<int64_t>(state.size()), runner->layout().BlockBytes(0));
    const int64_t done = (block + 1) * bt;
    MambaSequence resumed(runner->layout());
    KV_ASSERT_OK(resumed.Restore(state, done));
    // The resumed run checkpoints the later boundaries identically too.
    std::map<int64_t, std::vector<uint8_t>> later;
    MambaPrefillOptions o2;
    o2.all_logits = true;
    o2.on_checkpoint = [&](int64_t b, absl::Span<const uint8_t> s) {
      later[b].assign(s.begin(), s.end());
    };
    KV_ASSERT_OK_AND_ASSIGN(
        std::vector<float> got,
        runner->Prefill(resumed, absl::MakeConstSpan(tokens).subspan(done), o2));
    ASSERT_EQ(got.size(), (tokens.size() - done) * vocab);
    EXPECT_EQ(std::memcmp(got.data(), want.data() + done * vocab, sizeof(float) * got.size()), 0);
    EXPECT_EQ(resumed.SerializeState(), full.SerializeState());
    for (const auto& [b, s] : later) EXPECT_EQ(s, checkpoints[b]) << "checkpoint " << b;
    EXPECT_EQ(resumed.num_tokens(), full.num_tokens());
  }
}

TEST_F(MambaTest, DecodeIsBatchInvariant) {
  auto runner = Load({.threads = 2});
  ASSERT_NE(runner, nullptr);
  const int32_t vocab = runner->config().vocab_size;
  const std::vector<int32_t> prompt = Tokens(21, 11);
  MambaSequence alone(runner->layout());
  KV_ASSERT_OK(runner->Prefill(alone, prompt).status());
  MambaSequence* one[] = {&alone};
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, runner->DecodeStep(one, {5}));
  for (int batch_size : {2, 5}) {
    std::vector<std::unique_ptr<MambaSequence>> seqs;
    std::vector<MambaSequence*> batch;
    std::vector<int32_t> next;
    for (int i = 0; i < batch_size; ++i) {
      seqs.push_back(std::make_unique<MambaSequence>(runner->layout()));
      KV_ASSERT_OK(
          runner->Prefill(*seqs.back(), i == 1 ? prompt : Tokens(5 + 9 * i, 50 + i)).status());
      batch.push_back(seqs.back().get());
      next.push_back(i == 1 ? 5 : 7 * i);
    }
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, runner->DecodeStep(batch, next));
    EXPECT_EQ(std::memcmp(got.data() + vocab, want.data(), sizeof(float) * vocab), 0) << batch_size;
  }
}

TEST_F(MambaTest, BadInputIsRefused) {
  auto runner = Load();
  ASSERT_NE(runner, nullptr);
  MambaSequence seq(runner->layout());
  EXPECT_THAT(runner->Prefill(seq, {}), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(runner->Prefill(seq, {1, 512}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 1")));
  EXPECT_THAT(seq.Restore(std::vector<uint8_t>(10), 16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes")));
  EXPECT_EQ(seq.num_tokens(), 0);
  EXPECT_THAT(MambaRunner::Load("/nonexistent-dir").status(),
              ::testing::Not(::kvrelay::testing::IsOk()));
}

// transformers' MambaMixer slow path in double precision, state in fp32 everywhere (the
// runner with an fp32 state dtype rounds nothing).
std::vector<double> ReferenceLogits(const kv::ModelConfig& c, const ModelWeights& w,
                                    const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size()), d = c.hidden_size,
                inter = c.intermediate_size, kc = c.conv_kernel, ns = c.ssm_state_size,
                rank = c.time_step_rank;
  auto rms = [&](const std::vector<double>& x, const std::vector<float>& g) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / x.size() + c.layer_norm_epsilon);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * g[i];
    return y;
  };
  auto matvec = [](const std::vector<float>& m, int64_t rows, int64_t cols,
                   const std::vector<double>& x) {
    std::vector<double> y(rows, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols; ++k) y[r] += double{m[r * cols + k]} * x[k];
    }
    return y;
  };
  auto silu = [](double x) { return x / (1 + std::exp(-x)); };
  std::vector<std::vector<double>> h(n, std::vector<double>(d));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < d; ++i) h[t][i] = w.embed_tokens[tokens[t] * d + i];
  }
  for (const LayerWeights& l : w.layers) {
    std::vector<std::vector<double>> xs(n), zs(n);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<double> p = matvec(l.in_proj, 2 * inter, d, rms(h[t], l.input_norm));
      xs[t].assign(p.begin(), p.begin() + inter);
      zs[t].assign(p.begin() + inter, p.end());
    }
    std::vector<double> state(inter * ns, 0.0);
    for (int64_t t = 0; t < n; ++t) {
      std::vector<double> xc(inter);
      for (int64_t ch = 0; ch < inter; ++ch) {
        double acc = l.conv_bias.empty() ? 0.0 : l.conv_bias[ch];
        for (int64_t j = 0; j < kc; ++j) {
          const int64_t src = t - (kc - 1) + j;  // zero padding before the first token
          if (src >= 0) acc += l.conv_weight[ch * kc + j] * xs[src][ch];
        }
        xc[ch] = silu(acc);
      }
      std::vector<double> params = matvec(l.x_proj, rank + 2 * ns, inter, xc);
      std::vector<double> dt_in(params.begin(), params.begin() + rank);
      std::vector<double> dt = matvec(l.dt_proj, inter, rank, dt_in);
      std::vector<double> y(inter);
      for (int64_t ch = 0; ch < inter; ++ch) {
        const double delta = std::log1p(std::exp(dt[ch] + l.dt_bias[ch]));
        double acc = 0;
        for (int64_t s = 0; s < ns; ++s) {
          const double a = -std::exp(static_cast<double>(l.a_log[ch * ns + s]));
          double& st = state[ch * ns + s];
          st = std::exp(a * delta) * st + delta * params[rank + s] * xc[ch];
          acc += st * params[rank + ns + s];
        }
        y[ch] = (acc + xc[ch] * l.d_skip[ch]) * silu(zs[t][ch]);
      }
      std::vector<double> o = matvec(l.o_proj, d, inter, y);
      for (int64_t i = 0; i < d; ++i) h[t][i] += o[i];
    }
  }
  return matvec(w.output_weights(), c.vocab_size, d, rms(h[n - 1], w.final_norm));
}

TEST(MambaReference, RunnerMatchesDefinition) {
  testing::TempDir dir;
  TestModelOptions o;
  o.arch = "mamba";
  o.seed = 21;
  o.layers = 2;
  KV_ASSERT_OK(WriteTestModel(dir.path(), o));
  kv::ConfigOptions config_options;
  config_options.dtype = kv::DType::kFp32;
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelConfig config,
                          kv::LoadHfConfig(dir.File("config.json"), config_options));
  KV_ASSERT_OK_AND_ASSIGN(auto files, SafetensorsModel::Open(dir.path()));
  KV_ASSERT_OK_AND_ASSIGN(ModelWeights weights, LoadWeights(*files, config));
  std::vector<int32_t> tokens = Tokens(20, 7);
  const std::vector<double> want = ReferenceLogits(config, weights, tokens);
  KV_ASSERT_OK_AND_ASSIGN(auto runner, MambaRunner::Create(config, std::move(weights)));
  MambaSequence seq(runner->layout());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, runner->Prefill(seq, tokens));
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  EXPECT_GT(scale, 0.1);
  EXPECT_LE(diff / scale, 1e-4) << "max abs diff " << diff << " of " << scale;
}

}  // namespace
}  // namespace kvrelay::model
