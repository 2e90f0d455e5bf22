// The AttentionModel contract (model/attention_model.h), checked for every implementation this
// machine can run, loaded the way workers load them (LoadAttentionModel), on each test
// architecture (GQA llama, mistral with a sliding window on every layer, DeepSeek MLA, GPT-2),
// with the CPU ModelRunner as the reference:
//   - on_layer_done fires once per layer, in order, with that layer's bytes already final in
//     the host pool;
//   - an adopted prefix (blocks copied into fresh host slots) plus a prefill of the rest
//     computes what one full prefill computes;
//   - a batched decode step equals each sequence stepped alone, and DecodeStepGreedy equals
//     Greedy over DecodeStep;
//   - freeing sliding-window blocks changes no result;
//   - the layout fingerprint carries numerics_id() (KV never crosses backends).
//
// The CPU is bit-exact everywhere (its prefill and decode are row- and batch-invariant). The
// CUDA runner is checked to tolerances (kCudaVsCpu, kCudaSelf, justified below) plus equal
// greedy tokens. Without a usable CUDA device the CUDA cases skip naming why, unless
// KVRELAY_REQUIRE_GPU=1 (bench/gpu_check.sh), which makes a missing device a failure.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model_runner.h"
#include "model/sampler.h"
#include "model/select/model_select.h"
#include "model/test_model.h"
#include "platform/device_platform.h"
#include "tests/testing/random_floats.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model {
namespace {

// CUDA against the CPU: the CUDA runner may hold weights and activations in bf16 (unit
// roundoff 2^-9 = 0.2%) where the CPU computes in fp32 from the same bf16-exact weights; over
// the tiny models' 2-4 layers those roundings add up to a few tenths of a percent of the
// logits' range (cuda_model_test sees 1e-4 with fp32 weights). 5% of the largest |logit| stays
// far below what a wrong kernel gives (a wrong position, head or block: errors of the order of
// the logits themselves).
constexpr double kCudaVsCpu = 5e-2;
// CUDA against itself with the rows cut differently (adopted prefix, batch of one vs many,
// freed window blocks): the same kernels on the same bf16 data; only GEMM blocking and the
// reduction order may change, which moves fp32 sums by ~1e-6 relative and can flip a bf16
// rounding here and there: 1% of the largest |logit|.
constexpr double kCudaSelf = 1e-2;

constexpr int32_t kBlockTokens = 4;  // many blocks, partial last blocks, windows that bite
constexpr int32_t kWindowTokens = 8;

std::vector<int32_t> Tokens(int n, int32_t vocab, uint32_t seed) {
  return kvrelay::testing::RandomTokens(n, vocab, seed);
}

double RelativeError(absl::Span<const float> got, absl::Span<const float> want) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return diff / scale;
}

struct Arch {
  std::string name;
  std::string arch;          // TestModelOptions::arch
  std::string config_patch;  // merged into the test model's config
  bool windowed = false;
};

const Arch kArchs[] = {
    {"llama", "llama", "", false},
    {"mistral", "llama",
     absl::StrCat(R"({"model_type": "mistral", "sliding_window": )", kWindowTokens, "}"), true},
    {"deepseek_v3", "deepseek_v3", "", false},
    {"gpt2", "gpt2", "", false},
};

// Which implementation a test case runs: the CPU runner or the CUDA runner on device 0.
enum class Impl { kCpu, kCuda };

// Readable parameters in failure messages.
void PrintTo(const Arch& arch, std::ostream* os) { *os << arch.name; }
void PrintTo(Impl impl, std::ostream* os) { *os << (impl == Impl::kCpu ? "cpu" : "cuda"); }

bool RequireGpu() {
  const char* v = std::getenv("KVRELAY_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

class ModelInterfaceTest : public ::testing::TestWithParam<std::tuple<Impl, Arch>> {
 protected:
  void SetUp() override {
    const auto& [impl, arch] = GetParam();
    TestModelOptions o;
    o.arch = arch.arch;
    o.config_patch = arch.config_patch;
    o.seed = 7;
    KV_ASSERT_OK(WriteTestModel(dir_.path(), o));
    RunnerOptions options;
    options.block_tokens = kBlockTokens;
    KV_ASSERT_OK_AND_ASSIGN(reference_, ModelRunner::Load(dir_.path(), options));
    if (impl == Impl::kCpu) {
      KV_ASSERT_OK_AND_ASSIGN(LoadedModel loaded,
                              LoadAttentionModel(dir_.path(), options, *ParseDeviceFlag("cpu")));
      model_ = std::move(loaded.model);
      exact_ = true;
      return;
    }
    // Any CUDA error counts as "no GPU" (no driver, insufficient driver, no device).
    absl::StatusOr<std::unique_ptr<platform::DevicePlatform>> platform =
        platform::MakeDevicePlatform();
    if (!platform.ok()) {
      NoGpu(absl::StrCat(platform.status().code() == absl::StatusCode::kUnimplemented
                             ? "no CUDA in this build: "
                             : "no usable CUDA device: ",
                         platform.status().ToString()));
      return;
    }
    absl::StatusOr<LoadedModel> loaded =
        LoadAttentionModel(dir_.path(), options, *ParseDeviceFlag("cuda:0"));
    if (!loaded.ok() && loaded.status().code() == absl::StatusCode::kUnimplemented) {
      NoGpu(absl::StrCat("the CUDA runner does not run ", arch.name, ": ",
                         loaded.status().ToString()));
      return;
    }
    KV_ASSERT_OK(loaded.status());
    model_ = std::move(loaded->model);
    exact_ = false;
  }

  void NoGpu(const std::string& why) {
    if (RequireGpu()) {
      FAIL() << why << " (KVRELAY_REQUIRE_GPU=1 demands the CUDA runner)";
    }
    GTEST_SKIP() << why;
  }

  const Arch& arch() const { return std::get<1>(GetParam()); }
  int32_t vocab() const { return model_->config().vocab_size; }

  absl::StatusOr<std::unique_ptr<KvCache>> NewCache(int64_t blocks = 64) const {
    return KvCache::Create(model_->layout(), blocks);
  }

  // Same logits: bit for bit on the CPU, within `tolerance` of the largest |want| otherwise.
  void ExpectSame(absl::Span<const float> got, absl::Span<const float> want, double tolerance,
                  const std::string& what) const {
    ASSERT_EQ(got.size(), want.size()) << what;
    if (exact_) {
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()))
          << what << ": not bit-identical (relative error " << RelativeError(got, want) << ")";
    } else {
      EXPECT_LE(RelativeError(got, want), tolerance) << what;
    }
  }

  testing::TempDir dir_;
  std::unique_ptr<ModelRunner> reference_;
  std::unique_ptr<AttentionModel> model_;
  bool exact_ = true;
};

TEST_P(ModelInterfaceTest, ReportsItsDeviceAndCarriesItsNumericsInTheFingerprint) {
  const ComputeDevice device = model_->device();
  const std::string id = model_->numerics_id();
  if (std::get<0>(GetParam()) == Impl::kCpu) {
    EXPECT_EQ(device.kind, DeviceKind::kCpu);
    EXPECT_EQ(device.Label(), "cpu");
    EXPECT_EQ(id, "");
  } else {
    EXPECT_EQ(device.kind, DeviceKind::kCuda);
    EXPECT_EQ(device.Label(), "cuda:0");
    EXPECT_FALSE(device.name.empty());
  }
  const kv::ModelLayout& cpu = reference_->layout();
  if (id.empty()) {
    // Bits equal to the CPU's: the very same layout, so blocks are shared with CPU workers.
    EXPECT_EQ(model_->layout().fingerprint(), cpu.fingerprint());
  } else {
    EXPECT_EQ(model_->layout().numerics_id(), id);
    EXPECT_NE(model_->layout().fingerprint(), cpu.fingerprint())
        << "numerics '" << id << "' would share blocks with the CPU";
    EXPECT_EQ(model_->layout().fingerprint(), cpu.WithNumerics(id).fingerprint());
  }
  // Whatever this machine runs: another backend's id always gives another fingerprint.
  EXPECT_NE(cpu.WithNumerics("cuda-bf16").fingerprint(), cpu.fingerprint());
}

TEST_P(ModelInterfaceTest, PrefillAndDecodeMatchTheCpuReference) {
  const std::vector<int32_t> prompt = Tokens(19, vocab(), 1);
  const std::vector<int32_t> next = Tokens(4, vocab(), 2);
  KV_ASSERT_OK_AND_ASSIGN(auto cache, NewCache());
  KV_ASSERT_OK_AND_ASSIGN(auto ref_cache, KvCache::Create(reference_->layout(), 64));
  Sequence seq(cache.get()), ref(ref_cache.get());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, model_->Prefill(seq, prompt));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, reference_->Prefill(ref, prompt));
  ExpectSame(got, want, kCudaVsCpu, "prefill logits");
  EXPECT_EQ(seq.num_tokens(), 19);
  for (size_t step = 0; step < next.size(); ++step) {
    Sequence* a[] = {&seq};
    Sequence* b[] = {&ref};
    KV_ASSERT_OK_AND_ASSIGN(got, model_->DecodeStep(a, {next[step]}));
    KV_ASSERT_OK_AND_ASSIGN(want, reference_->DecodeStep(b, {next[step]}));
    ExpectSame(got, want, kCudaVsCpu, absl::StrCat("decode step ", step));
  }
}

TEST_P(ModelInterfaceTest, LayerDoneFiresInOrderWithThatLayerFinalInTheHostPool) {
  const std::vector<int32_t> prompt = Tokens(23, vocab(), 3);  // 5 full blocks and 3 tokens
  KV_ASSERT_OK_AND_ASSIGN(auto cache, NewCache());
  Sequence seq(cache.get());
  const kv::ModelLayout& layout = model_->layout();
  // (layer, slot) -> that layer's bytes of the unit, as seen when on_layer_done(layer) ran.
  struct Snapshot {
    int32_t layer;
    int group;
    kv::SlotId slot;
    std::vector<uint8_t> bytes;
  };
  std::vector<Snapshot> snapshots;
  std::vector<int32_t> fired;
  auto layer_span = [&](int32_t layer, kv::SlotId slot) {
    const int g = cache->group_of_layer(layer);
    const int64_t layer_bytes = layout.BlockBytes(g) / layout.groups()[g].num_layers();
    const uint8_t* unit = static_cast<const uint8_t*>(cache->pool(g).SlotAddress(slot));
    return absl::MakeConstSpan(unit + cache->index_in_group(layer) * layer_bytes,
                               static_cast<size_t>(layer_bytes));
  };
  PrefillOptions options;
  options.on_layer_done = [&](int32_t layer) {
    fired.push_back(layer);
    const int g = cache->group_of_layer(layer);
    for (kv::SlotId slot : seq.blocks(g)) {
      if (slot < 0) continue;
      absl::Span<const uint8_t> bytes = layer_span(layer, slot);
      snapshots.push_back({layer, g, slot, std::vector<uint8_t>(bytes.begin(), bytes.end())});
    }
  };
  KV_ASSERT_OK(model_->Prefill(seq, prompt, options).status());
  std::vector<int32_t> in_order(model_->config().num_hidden_layers);
  for (size_t i = 0; i < in_order.size(); ++i) in_order[i] = static_cast<int32_t>(i);
  EXPECT_EQ(fired, in_order);
  // Every block of the prompt was seen at every layer, with its final bytes.
  EXPECT_EQ(snapshots.size(), in_order.size() * 6);
  for (const Snapshot& s : snapshots) {
    absl::Span<const uint8_t> now = layer_span(s.layer, s.slot);
    EXPECT_TRUE(std::equal(now.begin(), now.end(), s.bytes.begin()))
        << "layer " << s.layer << " slot " << s.slot << " changed after on_layer_done";
  }
  // The bytes are really the KV: not all zero in the first block of every layer.
  for (int32_t layer = 0; layer < model_->config().num_hidden_layers; ++layer) {
    absl::Span<const uint8_t> b = layer_span(layer, seq.blocks(cache->group_of_layer(layer))[0]);
    EXPECT_TRUE(std::any_of(b.begin(), b.end(), [](uint8_t x) { return x != 0; }))
        << "layer " << layer;
  }
}

TEST_P(ModelInterfaceTest, AdoptedPrefixThenRestEqualsOneFullPrefill) {
  const std::vector<int32_t> prompt = Tokens(22, vocab(), 4);
  constexpr int kPrefixBlocks = 3;
  const int prefix_tokens = kPrefixBlocks * kBlockTokens;
  KV_ASSERT_OK_AND_ASSIGN(auto cache, NewCache());
  Sequence full(cache.get());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> full_logits, model_->Prefill(full, prompt));

  // The prefix blocks copied into fresh slots of another cache, as a decode worker receives
  // them from the wire.
  KV_ASSERT_OK_AND_ASSIGN(auto other, NewCache());
  std::vector<std::vector<kv::SlotId>> blocks(other->num_groups());
  for (int g = 0; g < other->num_groups(); ++g) {
    for (int b = 0; b < kPrefixBlocks; ++b) {
      const kv::SlotId from = full.blocks(g)[b];
      ASSERT_GE(from, 0);
      KV_ASSERT_OK_AND_ASSIGN(kv::SlotId to, other->pool(g).Allocate());
      std::memcpy(other->pool(g).SlotAddress(to), cache->pool(g).SlotAddress(from),
                  other->pool(g).slot_bytes());
      blocks[g].push_back(to);
    }
  }
  Sequence adopted(other.get());
  KV_ASSERT_OK(adopted.AdoptPrefix(absl::MakeConstSpan(prompt).first(prefix_tokens), blocks));
  KV_ASSERT_OK_AND_ASSIGN(
      std::vector<float> adopted_logits,
      model_->Prefill(adopted, absl::MakeConstSpan(prompt).subspan(prefix_tokens)));
  ExpectSame(adopted_logits, full_logits, kCudaSelf, "logits after the adopted prefix");

  // A short greedy decode: the same tokens, the same logits.
  int32_t a = Greedy(full_logits), b = Greedy(adopted_logits);
  for (int step = 0; step < 4; ++step) {
    ASSERT_EQ(a, b) << "greedy token " << step;
    Sequence* fs[] = {&full};
    Sequence* as[] = {&adopted};
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> fl, model_->DecodeStep(fs, {a}));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> al, model_->DecodeStep(as, {b}));
    ExpectSame(al, fl, kCudaSelf, absl::StrCat("decode step ", step));
    a = Greedy(fl);
    b = Greedy(al);
  }
  EXPECT_EQ(a, b);
}

TEST_P(ModelInterfaceTest, BatchedDecodeEqualsEachSequenceAlone) {
  const std::vector<int> lengths = {5, 11, 18};  // continuous batching: each at its own length
  KV_ASSERT_OK_AND_ASSIGN(auto cache, NewCache(128));
  std::vector<std::unique_ptr<Sequence>> batched, alone;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const std::vector<int32_t> prompt = Tokens(lengths[i], vocab(), 10 + i);
    for (auto* set : {&batched, &alone}) {
      set->push_back(std::make_unique<Sequence>(cache.get()));
      KV_ASSERT_OK(model_->Prefill(*set->back(), prompt).status());
    }
  }
  const int64_t v = vocab();
  for (int step = 0; step < 3; ++step) {
    const std::vector<int32_t> next = Tokens(static_cast<int>(lengths.size()), vocab(), 20 + step);
    std::vector<Sequence*> seqs;
    for (auto& s : batched) seqs.push_back(s.get());
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> together, model_->DecodeStep(seqs, next));
    ASSERT_EQ(together.size(), lengths.size() * v);
    for (size_t i = 0; i < lengths.size(); ++i) {
      Sequence* one[] = {alone[i].get()};
      KV_ASSERT_OK_AND_ASSIGN(std::vector<float> by_itself, model_->DecodeStep(one, {next[i]}));
      ExpectSame(absl::MakeConstSpan(together).subspan(i * v, v), by_itself, kCudaSelf,
                 absl::StrCat("step ", step, ", sequence of ", lengths[i], " tokens"));
    }
  }
}

TEST_P(ModelInterfaceTest, DecodeStepGreedyEqualsGreedyOfDecodeStep) {
  const std::vector<int> lengths = {7, 13};
  KV_ASSERT_OK_AND_ASSIGN(auto cache, NewCache(128));
  std::vector<std::unique_ptr<Sequence>> by_logits, by_ids;
  for (size_t i = 0; i < lengths.size(); ++i) {
    const std::vector<int32_t> prompt = Tokens(lengths[i], vocab(), 30 + i);
    for (auto* set : {&by_logits, &by_ids}) {
      set->push_back(std::make_unique<Sequence>(cache.get()));
      KV_ASSERT_OK(model_->Prefill(*set->back(), prompt).status());
    }
  }
  std::vector<int32_t> next = Tokens(static_cast<int>(lengths.size()), vocab(), 40);
  const int64_t v = vocab();
  for (int step = 0; step < 4; ++step) {
    std::vector<Sequence*> a, b;
    for (auto& s : by_logits) a.push_back(s.get());
    for (auto& s : by_ids) b.push_back(s.get());
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> logits, model_->DecodeStep(a, next));
    KV_ASSERT_OK_AND_ASSIGN(std::vector<int32_t> ids, model_->DecodeStepGreedy(b, next));
    ASSERT_EQ(ids.size(), lengths.size());
    for (size_t i = 0; i < lengths.size(); ++i) {
      EXPECT_EQ(ids[i], Greedy(absl::MakeConstSpan(logits).subspan(i * v, v)))
          << "step " << step << ", row " << i;
    }
    next = ids;
  }
  // Both appended the same tokens.
  for (size_t i = 0; i < lengths.size(); ++i) {
    EXPECT_EQ(by_logits[i]->tokens(), by_ids[i]->tokens());
  }
}

TEST_P(ModelInterfaceTest, FreeingWindowBlocksChangesNoResult) {
  const std::vector<int32_t> prompt = Tokens(14, vocab(), 50);
  const std::vector<int32_t> next = Tokens(12, vocab(), 51);
  KV_ASSERT_OK_AND_ASSIGN(auto cache, NewCache(128));
  Sequence kept(cache.get()), freed(cache.get());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> a, model_->Prefill(kept, prompt));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> b, model_->Prefill(freed, prompt));
  ExpectSame(b, a, kCudaSelf, "prefill");
  int64_t freed_blocks = freed.FreeBlocksOutsideWindow();
  for (size_t step = 0; step < next.size(); ++step) {
    Sequence* k[] = {&kept};
    Sequence* f[] = {&freed};
    KV_ASSERT_OK_AND_ASSIGN(a, model_->DecodeStep(k, {next[step]}));
    KV_ASSERT_OK_AND_ASSIGN(b, model_->DecodeStep(f, {next[step]}));
    ExpectSame(b, a, kCudaSelf, absl::StrCat("decode step ", step));
    EXPECT_EQ(Greedy(b), Greedy(a)) << "decode step " << step;
    freed_blocks += freed.FreeBlocksOutsideWindow();
  }
  if (arch().windowed) {
    // 26 tokens under an 8-token window: blocks 0..3 (tokens 0..15) are out of reach.
    EXPECT_GE(freed_blocks, 4);
    EXPECT_EQ(freed.blocks(0)[0], -1);
  } else {
    EXPECT_EQ(freed_blocks, 0);
  }
}

std::string CaseName(const ::testing::TestParamInfo<std::tuple<Impl, Arch>>& info) {
  const auto& [impl, arch] = info.param;
  return absl::StrCat(impl == Impl::kCpu ? "cpu_" : "cuda_", arch.name);
}

INSTANTIATE_TEST_SUITE_P(Implementations, ModelInterfaceTest,
                         ::testing::Combine(::testing::Values(Impl::kCpu, Impl::kCuda),
                                            ::testing::ValuesIn(kArchs)),
                         CaseName);

}  // namespace
}  // namespace kvrelay::model
