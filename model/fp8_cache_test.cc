// FP8 KV on the CPU runner (kv/fp8.h numerics, kv/model_layout.h byte layout): a token's cache
// bytes and the logits do not depend on how the writes were batched (one prefill, chunks,
// decode, several sequences per step), the scales sit where the layout says with the values
// the rules give, and fp8 KV stays close to bf16 KV.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/fp8.h"
#include "kv/presets.h"
#include "model/kv_cache.h"
#include "model/mamba_runner.h"
#include "model/model_runner.h"
#include "model/numeric.h"
#include "model/test_model.h"
#include "tests/testing/float_compare.h"
#include "tests/testing/random_floats.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<int32_t> Tokens(int n, int32_t vocab, uint32_t seed) {
  return kvrelay::testing::RandomTokens(n, vocab, seed);
}

float ReadFloat(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof(f));
  return f;
}

double RelErr(const float* a, const float* b, int64_t n) {
  return kvrelay::testing::MaxRelativeError(absl::MakeConstSpan(a, n), absl::MakeConstSpan(b, n));
}

int32_t Argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i) best = x[i] > x[best] ? i : best;
  return best;
}

// Bytes of one token's entry of `layer` at EntryAddress (one of K/V for attention).
int64_t EntryBytes(const KvCache& cache, int32_t layer) {
  const int g = cache.group_of_layer(layer);
  const kv::LayerGroup& group = cache.layout().groups()[g];
  if (group.kind == kv::LayerKind::kMlaLatent) return cache.layout().MlaEntryBytes(g);
  return int64_t{group.num_kv_heads} * group.head_dim * kv::DTypeBytes(cache.layout().dtype());
}

// Every byte positions [0, n) of `a` and `b` wrote (values and, for attention, the scales of
// the blocks those positions start) is equal; blocks freed in either are skipped.
::testing::AssertionResult SameCacheBytes(const Sequence& a, const Sequence& b, int64_t n) {
  const KvCache& ca = a.cache();
  const KvCache& cb = b.cache();
  const kv::ModelLayout& layout = ca.layout();
  const int64_t bt = layout.block_tokens();
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    const int g = ca.group_of_layer(layer);
    const kv::LayerGroup& group = layout.groups()[g];
    const int kvs = group.IsAttention() ? 2 : 1;
    for (int64_t p = 0; p < n; ++p) {
      const kv::SlotId sa = a.blocks(g)[p / bt], sb = b.blocks(g)[p / bt];
      if (sa < 0 || sb < 0) continue;
      const int32_t t = static_cast<int32_t>(p % bt);
      for (int kv = 0; kv < kvs; ++kv) {
        if (std::memcmp(ca.EntryAddress(layer, sa, t, kv), cb.EntryAddress(layer, sb, t, kv),
                        EntryBytes(ca, layer)) != 0) {
          return ::testing::AssertionFailure()
                 << "layer " << layer << " position " << p << " kv " << kv << " differs";
        }
        if (!group.IsAttention() || t != 0) continue;
        for (int32_t h = 0; h < group.num_kv_heads; ++h) {
          if (std::memcmp(ca.Fp8ScaleAddress(layer, sa, kv, h),
                          cb.Fp8ScaleAddress(layer, sb, kv, h), kv::kFp8ScaleBytes) != 0) {
            return ::testing::AssertionFailure() << "layer " << layer << " block " << p / bt
                                                 << " kv " << kv << " head " << h << " scale";
          }
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// One model directory per architecture. gemma3 gets a 16-token window (one block), so decode
// frees blocks; deepseek_v3 a 192-value latent, so an MLA entry has a full and a partial tile.
class Fp8CacheTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    for (const char* arch : {"llama", "deepseek_v3", "gemma3", "gpt2"}) {
      TestModelOptions o;
      o.arch = arch;
      o.seed = 7;
      if (o.arch == "gemma3") o.sliding_window = 16;
      if (o.arch == "deepseek_v3") o.config_patch = R"({"kv_lora_rank": 192})";
      ASSERT_TRUE(WriteTestModel(dir_->File(arch), o).ok());
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  std::unique_ptr<ModelRunner> Load(std::optional<kv::DType> kv_dtype = kv::DType::kFp8) {
    RunnerOptions options;
    options.threads = 2;
    options.kv_cache_dtype = kv_dtype;
    absl::StatusOr<std::unique_ptr<ModelRunner>> runner =
        ModelRunner::Load(dir_->File(GetParam()), options);
    EXPECT_TRUE(runner.ok()) << runner.status();
    return runner.ok() ? *std::move(runner) : nullptr;
  }

  static testing::TempDir* dir_;
};
testing::TempDir* Fp8CacheTest::dir_ = nullptr;

INSTANTIATE_TEST_SUITE_P(Archs, Fp8CacheTest,
                         ::testing::Values("llama", "deepseek_v3", "gemma3", "gpt2"));

TEST_P(Fp8CacheTest, LayoutIsFp8AndModelDtypeUnchanged) {
  auto runner = Load();
  ASSERT_NE(runner, nullptr);
  EXPECT_EQ(runner->layout().dtype(), kv::DType::kFp8);
  EXPECT_EQ(runner->config().dtype, kv::DType::kBf16);
}

// One prefill, a chunked prefill (chunks ending inside blocks and on their edges) and a prefill
// followed by token-by-token decode (which writes the first token of later blocks) give the
// same logits and the same cache bytes, scales included.
TEST_P(Fp8CacheTest, OnePassChunkedAndDecodedAgreeBitForBit) {
  auto runner = Load();
  ASSERT_NE(runner, nullptr);
  const int32_t vocab = runner->config().vocab_size;
  const int n = 40, prompt = 14;
  const std::vector<int32_t> tokens = Tokens(n, vocab, 3);
  KV_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(runner->layout(), 24));
  PrefillOptions all;
  all.all_logits = true;

  Sequence full(cache.get());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> want, runner->Prefill(full, tokens, all));

  Sequence chunked(cache.get());
  std::vector<float> got;
  int64_t done = 0;
  for (int64_t chunk : {5, 1, 10, 13, 11}) {
    KV_ASSERT_OK_AND_ASSIGN(
        std::vector<float> part,
        runner->Prefill(chunked, absl::MakeConstSpan(tokens).subspan(done, chunk), all));
    got.insert(got.end(), part.begin(), part.end());
    done += chunk;
  }
  ASSERT_EQ(done, n);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  EXPECT_TRUE(SameCacheBytes(chunked, full, n));

  // Decode from a one-pass prefill and (across a block's start) from a chunked one: equal
  // logits at every step. A
  // decode step's logits come from the batch-invariant logits GEMM, not the prefill's per-row
  // one, so against the prefill's logits they agree within fp32 rounding only (as for bf16
  // KV); the KV bytes they write are the prefill's exactly.
  Sequence decoded(cache.get()), decoded_chunked(cache.get());
  KV_ASSERT_OK_AND_ASSIGN(got, runner->Prefill(decoded, absl::MakeConstSpan(tokens).first(prompt)));
  EXPECT_EQ(std::memcmp(got.data(), want.data() + (prompt - 1) * vocab, vocab * sizeof(float)), 0);
  KV_ASSERT_OK(runner->Prefill(decoded_chunked, absl::MakeConstSpan(tokens).first(7)).status());
  KV_ASSERT_OK(runner->Prefill(decoded_chunked, absl::MakeConstSpan(tokens).subspan(7, prompt - 7))
                   .status());
  const int chunked_end = 20;  // past the block starting at 16
  int64_t freed = 0;
  double worst = 0;
  for (int i = prompt; i < n; ++i) {
    freed += decoded.FreeBlocksOutsideWindow();
    Sequence* one[] = {&decoded};
    KV_ASSERT_OK_AND_ASSIGN(got, runner->DecodeStep(one, {tokens[i]}));
    if (i < chunked_end) {
      Sequence* other[] = {&decoded_chunked};
      KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got_chunked,
                              runner->DecodeStep(other, {tokens[i]}));
      ASSERT_EQ(got, got_chunked) << "decode of position " << i;
    }
    worst = std::max(worst, RelErr(got.data(), want.data() + i * vocab, vocab));
  }
  EXPECT_LE(worst, 1e-5);
  EXPECT_TRUE(SameCacheBytes(decoded, full, n));
  EXPECT_TRUE(SameCacheBytes(decoded_chunked, full, chunked_end));
  if (GetParam() == "gemma3") {
    EXPECT_GT(freed, 0);
  }
}

// A sequence's logits and cache bytes are the same whether it decodes alone or batched with
// others (lengths chosen so that steps write first tokens of blocks).
TEST_P(Fp8CacheTest, BatchedDecodeEqualsEachAlone) {
  auto runner = Load();
  ASSERT_NE(runner, nullptr);
  const int32_t vocab = runner->config().vocab_size;
  const std::vector<int> lengths = {15, 16, 30};
  const int steps = 4;
  KV_ASSERT_OK_AND_ASSIGN(auto alone_cache, KvCache::Create(runner->layout(), 24));
  KV_ASSERT_OK_AND_ASSIGN(auto batch_cache, KvCache::Create(runner->layout(), 24));
  std::vector<std::unique_ptr<Sequence>> alone, batched;
  std::vector<std::vector<float>> want(lengths.size());
  for (size_t s = 0; s < lengths.size(); ++s) {
    const std::vector<int32_t> prompt = Tokens(lengths[s], vocab, 20 + s);
    alone.push_back(std::make_unique<Sequence>(alone_cache.get()));
    batched.push_back(std::make_unique<Sequence>(batch_cache.get()));
    KV_ASSERT_OK(runner->Prefill(*alone.back(), prompt).status());
    KV_ASSERT_OK(runner->Prefill(*batched.back(), prompt).status());
    for (int step = 0; step < steps; ++step) {
      Sequence* one[] = {alone.back().get()};
      KV_ASSERT_OK_AND_ASSIGN(
          std::vector<float> l,
          runner->DecodeStep(one, {(7 * step + 3 * static_cast<int>(s)) % vocab}));
      want[s].insert(want[s].end(), l.begin(), l.end());
    }
  }
  for (int step = 0; step < steps; ++step) {
    std::vector<Sequence*> batch;
    std::vector<int32_t> next;
    for (size_t s = 0; s < lengths.size(); ++s) {
      batch.push_back(batched[s].get());
      next.push_back((7 * step + 3 * static_cast<int>(s)) % vocab);
    }
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, runner->DecodeStep(batch, next));
    for (size_t s = 0; s < lengths.size(); ++s) {
      EXPECT_EQ(
          std::memcmp(got.data() + s * vocab, want[s].data() + step * vocab, vocab * sizeof(float)),
          0)
          << "sequence " << s << " step " << step;
    }
  }
  for (size_t s = 0; s < lengths.size(); ++s) {
    EXPECT_TRUE(SameCacheBytes(*batched[s], *alone[s], lengths[s] + steps)) << "sequence " << s;
  }
}

// Layer 0's K/V do not depend on the cache (nothing before them reads it), so a run with an
// fp32 KV cache shows the exact values the fp8 run quantised: the scale bytes found at the
// layout's offsets are the rule's powers of two and every value byte is QuantizeE4M3 with them.
TEST_P(Fp8CacheTest, ScalesSitWhereTheLayoutSays) {
  auto fp8 = Load();
  auto fp32 = Load(kv::DType::kFp32);
  ASSERT_NE(fp8, nullptr);
  ASSERT_NE(fp32, nullptr);
  const kv::ModelLayout& layout = fp8->layout();
  const int64_t bt = layout.block_tokens();
  const std::vector<int32_t> tokens = Tokens(static_cast<int>(bt) + 5, fp8->config().vocab_size, 9);
  KV_ASSERT_OK_AND_ASSIGN(auto c8, KvCache::Create(layout, 4));
  KV_ASSERT_OK_AND_ASSIGN(auto c32, KvCache::Create(fp32->layout(), 4));
  Sequence s8(c8.get()), s32(c32.get());
  KV_ASSERT_OK(fp8->Prefill(s8, tokens).status());
  KV_ASSERT_OK(fp32->Prefill(s32, tokens).status());
  const int g = c8->group_of_layer(0);
  ASSERT_EQ(c8->index_in_group(0), 0);
  const kv::LayerGroup& group = layout.groups()[g];
  // Block 1: tokens bt .. bt + 4.
  const kv::SlotId slot = s8.blocks(g)[1];
  const uint8_t* unit = static_cast<const uint8_t*>(c8->pool(g).SlotAddress(slot));
  auto exact = [&](int32_t t, int kv) {
    return reinterpret_cast<const float*>(c32->EntryAddress(0, s32.blocks(g)[1], t, kv));
  };
  if (group.kind == kv::LayerKind::kMlaLatent) {
    const int32_t tiles = (group.latent_dim + kv::kFp8MlaTile - 1) / kv::kFp8MlaTile;
    ASSERT_EQ(tiles, 2);
    for (int32_t t = 0; t < 5; ++t) {
      const float* x = exact(t, 0);
      const uint8_t* entry = unit + t * layout.MlaEntryBytes(g);
      ASSERT_EQ(entry, c8->EntryAddress(0, slot, t, 0));
      for (int32_t tile = 0; tile < tiles; ++tile) {
        const int32_t first = tile * kv::kFp8MlaTile;
        const int32_t count = std::min(kv::kFp8MlaTile, group.latent_dim - first);
        const int32_t k = kv::Fp8TileScaleExp(kv::Fp8FiniteAmax(x + first, count));
        EXPECT_EQ(ReadFloat(entry + layout.MlaScaleOffset(g) + tile * kv::kFp8ScaleBytes),
                  kv::Fp8ScaleFromExp(k))
            << "token " << t << " tile " << tile;
        for (int32_t i = first; i < first + count; ++i) {
          ASSERT_EQ(entry[i], kv::QuantizeE4M3(x[i], k)) << "token " << t << " latent " << i;
        }
      }
      for (int32_t i = 0; i < group.rope_dim; ++i) {
        uint16_t bf16;
        std::memcpy(&bf16, entry + layout.MlaRopeOffset(g) + 2 * i, 2);
        ASSERT_EQ(bf16, FloatToBf16(x[group.latent_dim + i])) << "token " << t << " rope " << i;
      }
    }
    return;
  }
  for (int kv = 0; kv < 2; ++kv) {
    for (int32_t h = 0; h < group.num_kv_heads; ++h) {
      const float* first_token = exact(0, kv) + int64_t{h} * group.head_dim;
      const int32_t k = kv::Fp8BlockScaleExp(kv::Fp8FiniteAmax(first_token, group.head_dim));
      const uint8_t* scale = unit + layout.Fp8ScaleOffset(g, kv, h);  // layer 0: strip 0
      ASSERT_EQ(scale, c8->Fp8ScaleAddress(0, slot, kv, h));
      EXPECT_EQ(ReadFloat(scale), kv::Fp8ScaleFromExp(k)) << "kv " << kv << " head " << h;
      for (int32_t t = 0; t < 5; ++t) {
        const float* x = exact(t, kv) + int64_t{h} * group.head_dim;
        const uint8_t* q = c8->EntryAddress(0, slot, t, kv) + int64_t{h} * group.head_dim;
        for (int32_t d = 0; d < group.head_dim; ++d) {
          ASSERT_EQ(q[d], kv::QuantizeE4M3(x[d], k))
              << "kv " << kv << " head " << h << " token " << t << " dim " << d;
        }
      }
    }
  }
}

// Sanity, not the accuracy figure (bench/fp8_kv_accuracy_bench.cc): teacher-forced greedy
// tokens of fp8 and bf16 KV agree on most steps of a short prompt.
TEST_P(Fp8CacheTest, GreedyTokensMostlyAgreeWithBf16) {
  auto fp8 = Load();
  auto bf16 = Load(std::nullopt);
  ASSERT_NE(fp8, nullptr);
  ASSERT_NE(bf16, nullptr);
  ASSERT_EQ(bf16->layout().dtype(), kv::DType::kBf16);
  const int32_t vocab = fp8->config().vocab_size;
  const std::vector<int32_t> prompt = Tokens(24, vocab, 5);
  KV_ASSERT_OK_AND_ASSIGN(auto c8, KvCache::Create(fp8->layout(), 8));
  KV_ASSERT_OK_AND_ASSIGN(auto c16, KvCache::Create(bf16->layout(), 8));
  Sequence s8(c8.get()), s16(c16.get());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> l8, fp8->Prefill(s8, prompt));
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> l16, bf16->Prefill(s16, prompt));
  const int steps = 16;
  int agree = 0;
  for (int step = 0; step < steps; ++step) {
    const int32_t want = Argmax(l16.data(), vocab);
    agree += Argmax(l8.data(), vocab) == want ? 1 : 0;
    Sequence* b8[] = {&s8};
    Sequence* b16[] = {&s16};
    KV_ASSERT_OK_AND_ASSIGN(l8, fp8->DecodeStep(b8, {want}));
    KV_ASSERT_OK_AND_ASSIGN(l16, bf16->DecodeStep(b16, {want}));
  }
  std::printf("[ %s ] fp8 vs bf16 KV: %d of %d greedy tokens agree\n", GetParam().c_str(), agree,
              steps);
  EXPECT_GE(agree, steps * 3 / 4);
}

// EntryAddress and Fp8ScaleAddress against hand-computed offsets (tiny-llama: 2 KV heads of
// 32, tiny-deepseek-v3: latent 64 + rope 16; 16-token blocks).
TEST(Fp8CacheAddressTest, OffsetsMatchAHandCalculation) {
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelConfig llama, kv::LoadPreset("tiny-llama"));
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelLayout gqa, llama.layout.WithDType(kv::DType::kFp8));
  KV_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(gqa, 2));
  const uint8_t* base = static_cast<uint8_t*>(cache->pool(0).SlotAddress(1));
  // Strip: 2 * 16 * 2 * 32 = 2,048 value bytes + 2 * 2 float32 scales = 2,064 bytes.
  EXPECT_EQ(cache->EntryAddress(2, 1, 3, 1) - base, 2 * 2064 + (16 + 3) * 64);
  EXPECT_EQ(cache->Fp8ScaleAddress(2, 1, 1, 1) - base, 2 * 2064 + 2048 + 3 * 4);
  EXPECT_EQ(cache->Fp8ScaleAddress(0, 1, 0, 0) - base, 2048);

  KV_ASSERT_OK_AND_ASSIGN(kv::ModelConfig ds, kv::LoadPreset("tiny-deepseek-v3"));
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelLayout mla, ds.layout.WithDType(kv::DType::kFp8));
  KV_ASSERT_OK_AND_ASSIGN(auto mla_cache, KvCache::Create(mla, 2));
  const uint8_t* mla_base = static_cast<uint8_t*>(mla_cache->pool(0).SlotAddress(1));
  // Entry: 64 E4M3 + one float32 scale + 16 bf16 = 100 bytes.
  EXPECT_EQ(mla.MlaEntryBytes(0), 100);
  EXPECT_EQ(mla_cache->EntryAddress(1, 1, 5, 0) - mla_base, (16 + 5) * 100);
}

TEST(Fp8CacheMambaTest, MambaRefusesFp8NamingTheSetting) {
  testing::TempDir dir;
  TestModelOptions o;
  o.arch = "mamba";
  KV_ASSERT_OK(WriteTestModel(dir.path(), o));
  RunnerOptions options;
  options.kv_cache_dtype = kv::DType::kFp8;
  EXPECT_THAT(MambaRunner::Load(dir.path(), options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_cache_dtype")));
}

}  // namespace
}  // namespace kvrelay::model
