#include "kv/model_layout.h"

#include "common/check.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::kv {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

ModelLayout Preset(const char* name) {
  absl::StatusOr<ModelConfig> config = LoadPreset(name);
  KV_CHECK(config.ok());
  return config->layout;
}

TEST(ModelLayout, SeedBytesPerToken) {
  EXPECT_EQ(Preset("gpt2-xl").BytesPerToken(), 307200);     // 300 KiB
  EXPECT_EQ(Preset("llama3-8b").BytesPerToken(), 131072);   // 128 KiB
  EXPECT_EQ(Preset("llama3-70b").BytesPerToken(), 327680);  // 320 KiB
  EXPECT_EQ(Preset("deepseek-v3").BytesPerToken(), 70272);  // 68.6 KiB
  // Gemma 3 27B: 62 layers x 2 x 16 heads x 128 x 2 bytes before any window fills.
  EXPECT_EQ(Preset("gemma3-27b").BytesPerToken(), 62 * 2 * 16 * 128 * 2);
  EXPECT_EQ(Preset("mamba-2.8b").BytesPerToken(), 0);
}

ModelLayout Fp8Preset(const char* name) {
  absl::StatusOr<ModelLayout> fp8 = Preset(name).WithDType(DType::kFp8);
  KV_CHECK(fp8.ok());
  return *fp8;
}

// Per layer and token: one byte per K and V value, plus per 16-token block one float32 scale
// per (K or V, kv head), i.e. 2 * heads * 4 / 16 bytes; MLA: 512 fp8 + 4 scales + 64 bf16.
TEST(ModelLayout, SeedBytesPerTokenFp8) {
  EXPECT_EQ(Fp8Preset("gpt2-xl").BytesPerToken(), 48 * (2 * 25 * 64) + 48 * 2 * 25 * 4 / 16);
  EXPECT_EQ(Fp8Preset("gpt2-xl").BytesPerToken(), 154200);
  EXPECT_EQ(Fp8Preset("llama3-8b").BytesPerToken(), 32 * (2 * 8 * 128 + 2 * 8 * 4 / 16));
  EXPECT_EQ(Fp8Preset("llama3-8b").BytesPerToken(), 65664);
  EXPECT_EQ(Fp8Preset("llama3-70b").BytesPerToken(), 80 * (2 * 8 * 128 + 2 * 8 * 4 / 16));
  EXPECT_EQ(Fp8Preset("deepseek-v3").BytesPerToken(), 61 * (512 + 4 * 4 + 64 * 2));
  EXPECT_EQ(Fp8Preset("deepseek-v3").BytesPerToken(), 40016);
  EXPECT_EQ(Fp8Preset("gemma3-27b").BytesPerToken(), 62 * (2 * 16 * 128 + 2 * 16 * 4 / 16));
  EXPECT_EQ(Fp8Preset("gemma3-27b").BytesPerToken(), 254448);
  // A recurrent state is not a KV cache: no fp8 for it, and the refusal says why.
  EXPECT_THAT(Preset("mamba-2.8b").WithDType(DType::kFp8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ssm_state")));
}

TEST(ModelLayout, Fp8BlockBytesHoldValuesThenScalesPerLayer) {
  ModelLayout l = Fp8Preset("llama3-8b");
  EXPECT_EQ(l.LayerStripBytes(0), 2 * 16 * 8 * 128 + 2 * 8 * 4);
  EXPECT_EQ(l.BlockBytes(0), 32 * l.LayerStripBytes(0));
  EXPECT_EQ(l.BlockBytes(0), 16 * l.BytesPerToken());
  // Scales follow the 32768 value bytes: K heads 0..7, then V heads 0..7.
  EXPECT_EQ(l.Fp8ScaleOffset(0, 0, 0), 32768);
  EXPECT_EQ(l.Fp8ScaleOffset(0, 0, 7), 32768 + 7 * 4);
  EXPECT_EQ(l.Fp8ScaleOffset(0, 1, 0), 32768 + 8 * 4);
  EXPECT_EQ(l.Fp8ScaleOffset(0, 1, 7), l.LayerStripBytes(0) - 4);
  const BlockStrides s = l.Strides(0);
  EXPECT_EQ(s.layer, l.LayerStripBytes(0));
  EXPECT_EQ(s.kv, 16 * 8 * 128);
  EXPECT_EQ(s.token, 8 * 128);
  EXPECT_EQ(s.head, 128);
  // Gemma's window keeps 1024 tokens (64 blocks of scales) on the 52 local layers.
  ModelLayout gemma = Fp8Preset("gemma3-27b");
  EXPECT_EQ(gemma.GroupBytesForTokens(1, 32768), 52 * (1024 * 2 * 16 * 128 + 64 * 2 * 16 * 4));
  EXPECT_EQ(gemma.GroupBytesForTokens(0, 17), 10 * (17 * 2 * 16 * 128 + 2 * 2 * 16 * 4));
}

// DeepSeek V3.2 / FlashMLA's FP8 cache entry, per token and layer: 512 E4M3 latent values,
// 4 float32 scales (one per 128 values), 64 bf16 rope values: 656 bytes.
TEST(ModelLayout, FlashMlaFp8EntryOffsets) {
  ModelLayout l = Fp8Preset("deepseek-v3");
  EXPECT_EQ(l.MlaEntryBytes(0), 656);
  EXPECT_EQ(l.MlaScaleOffset(0), 512);
  EXPECT_EQ(l.MlaRopeOffset(0), 528);
  EXPECT_EQ(l.BlockBytes(0), 16 * 656 * 61);
  ModelLayout bf16 = Preset("deepseek-v3");
  EXPECT_EQ(bf16.MlaEntryBytes(0), 1152);
  EXPECT_EQ(bf16.MlaRopeOffset(0), 1024);
  // A latent that is not a multiple of 128 still gets a scale for its last partial tile.
  LayerGroup g{LayerKind::kMlaLatent, {0}};
  g.latent_dim = 200;
  g.rope_dim = 8;
  absl::StatusOr<ModelLayout> odd = ModelLayout::Create("odd", DType::kFp8, 4, {g});
  ASSERT_TRUE(odd.ok()) << odd.status();
  EXPECT_EQ(odd->MlaEntryBytes(0), 200 + 2 * 4 + 8 * 2);
}

TEST(ModelLayout, Fp8FingerprintDiffersFromEveryOtherDtype) {
  ModelLayout bf16 = Preset("llama3-8b");
  ModelLayout fp8 = Fp8Preset("llama3-8b");
  for (DType other : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    absl::StatusOr<ModelLayout> l = bf16.WithDType(other);
    ASSERT_TRUE(l.ok());
    EXPECT_NE(l->fingerprint(), fp8.fingerprint()) << DTypeName(other);
  }
  EXPECT_EQ(DTypeName(fp8.dtype()), "fp8_e4m3");
  EXPECT_THAT(fp8.Describe(), HasSubstr("KV fp8_e4m3, 16-token blocks"));
  EXPECT_THAT(bf16.Describe(), HasSubstr("KV bf16"));
  EXPECT_EQ(fp8.fingerprint(), Fp8Preset("llama3-8b").fingerprint());
}

TEST(ModelLayout, BytesForTokensIsLinearForFullAttentionAndMla) {
  for (const char* name : {"gpt2-xl", "llama3-8b", "deepseek-v3"}) {
    ModelLayout l = Preset(name);
    EXPECT_EQ(l.BytesForTokens(0), 0) << name;
    EXPECT_EQ(l.BytesForTokens(1), l.BytesPerToken()) << name;
    EXPECT_EQ(l.BytesForTokens(32768), 32768 * l.BytesPerToken()) << name;
  }
}

TEST(ModelLayout, GemmaWindowCapsLocalLayers) {
  ModelLayout l = Preset("gemma3-27b");
  ASSERT_EQ(l.groups().size(), 2u);
  const LayerGroup& global = l.groups()[0];
  const LayerGroup& local = l.groups()[1];
  EXPECT_EQ(global.kind, LayerKind::kFullAttention);
  EXPECT_EQ(local.kind, LayerKind::kSlidingWindow);
  EXPECT_EQ(global.num_layers(), 10);  // layers 5, 11, ..., 59
  EXPECT_EQ(local.num_layers(), 52);
  EXPECT_EQ(global.layer_ids[0], 5);
  EXPECT_EQ(local.window_tokens, 1024);
  const int64_t per_layer_token = 2 * 16 * 128 * 2;
  // Below the window every layer grows; above it only the 10 global layers do.
  EXPECT_EQ(l.BytesForTokens(1000), 1000 * 62 * per_layer_token);
  EXPECT_EQ(l.BytesForTokens(1024), 1024 * 62 * per_layer_token);
  EXPECT_EQ(l.BytesForTokens(32768), 32768 * 10 * per_layer_token + 1024 * 52 * per_layer_token);
  EXPECT_EQ(l.GroupBytesForTokens(1, 32768), l.GroupBytesForTokens(1, 1024));
}

TEST(ModelLayout, MambaStateIsConstant) {
  ModelLayout l = Preset("mamba-2.8b");
  // 64 layers x 5120 x (4 conv + 16 state) x 2 bytes.
  const int64_t expected = int64_t{64} * 5120 * (4 + 16) * 2;
  EXPECT_EQ(l.BytesForTokens(1), expected);
  EXPECT_EQ(l.BytesForTokens(1024), expected);
  EXPECT_EQ(l.BytesForTokens(1 << 20), expected);
  EXPECT_EQ(l.BytesForTokens(0), 0);
  EXPECT_EQ(l.BlockBytes(0), expected);
  EXPECT_EQ(l.BlocksNeeded(0, 100000), 1);
}

TEST(ModelLayout, BlockBytesAndBlocksNeeded) {
  ModelLayout l = Preset("llama3-8b");
  EXPECT_EQ(l.block_tokens(), 16);
  EXPECT_EQ(l.BlockBytes(0), 16 * 131072);
  EXPECT_EQ(l.BlocksNeeded(0, 1), 1);
  EXPECT_EQ(l.BlocksNeeded(0, 16), 1);
  EXPECT_EQ(l.BlocksNeeded(0, 17), 2);

  ModelLayout g = Preset("gemma3-27b");
  // Window 1024 / block 16: 64 blocks cover the window when aligned, 65 when not, +1 spare.
  EXPECT_EQ(g.BlocksNeeded(1, 100000), 66);
  EXPECT_EQ(g.BlocksNeeded(1, 100), 7);  // never more than the sequence has
  EXPECT_EQ(g.BlocksNeeded(0, 100000), 6250);

  ModelLayout d = Preset("deepseek-v3");
  EXPECT_EQ(d.BlockBytes(0), 16 * 70272);
}

TEST(ModelLayout, StridesCoverTheBlockExactly) {
  ModelLayout l = Preset("llama3-8b");
  const LayerGroup& g = l.groups()[0];
  const int64_t elements = l.BlockBytes(0) / DTypeBytes(l.dtype());
  for (BlockOrder order : {BlockOrder::kNHD, BlockOrder::kHND}) {
    BlockStrides s = l.Strides(0, order);
    const int64_t last = (g.num_layers() - 1) * s.layer + 1 * s.kv +
                         (l.block_tokens() - 1) * s.token + (g.num_kv_heads - 1) * s.head +
                         (g.head_dim - 1);
    EXPECT_EQ(last, elements - 1);
  }
}

TEST(ModelLayout, DTypeOverrideAndFingerprint) {
  ModelLayout bf16 = Preset("llama3-8b");
  absl::StatusOr<ModelLayout> fp8 = bf16.WithDType(DType::kFp8);
  ASSERT_TRUE(fp8.ok());
  // 32 layers x (2 x 8 heads x 128 values + 2 x 8 float32 scales per 16-token block).
  EXPECT_EQ(fp8->BytesPerToken(), 32 * (2 * 8 * 128 + 2 * 8 * 4 / 16));
  EXPECT_NE(fp8->fingerprint(), bf16.fingerprint());
  absl::StatusOr<ModelLayout> fp32 = bf16.WithDType(DType::kFp32);
  ASSERT_TRUE(fp32.ok());
  EXPECT_EQ(fp32->BytesPerToken(), 262144);
  absl::StatusOr<ModelLayout> again = bf16.WithDType(DType::kBf16);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->fingerprint(), bf16.fingerprint());
  absl::StatusOr<ModelLayout> bigger_blocks = bf16.WithBlockTokens(32);
  ASSERT_TRUE(bigger_blocks.ok());
  EXPECT_NE(bigger_blocks->fingerprint(), bf16.fingerprint());
  EXPECT_EQ(bigger_blocks->BlockBytes(0), 32 * 131072);
}

TEST(ModelLayout, FingerprintDependsOnModelIdentity) {
  LayerGroup g{LayerKind::kFullAttention, {0, 1}, 2, 32};
  auto a = ModelLayout::Create("model-a", DType::kBf16, 16, {g});
  auto b = ModelLayout::Create("model-b", DType::kBf16, 16, {g});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->fingerprint(), b->fingerprint());
  // Golden value: the fingerprint must not change across builds or machines.
  EXPECT_EQ(a->fingerprint().ToHex(), "0f9581d72501be38fedda71da1b37a42");
}

TEST(ModelLayout, NumericsIdSeparatesBackendsAndSurvivesDerivedLayouts) {
  LayerGroup g{LayerKind::kFullAttention, {0, 1}, 2, 32};
  auto cpu = ModelLayout::Create("model-a", DType::kBf16, 16, {g});
  ASSERT_TRUE(cpu.ok());
  // Empty numerics is the reference: the fingerprint Create gives (the golden value above).
  EXPECT_EQ(cpu->WithNumerics("").fingerprint(), cpu->fingerprint());
  const ModelLayout gpu = cpu->WithNumerics("cuda-bf16-sm90");
  EXPECT_EQ(gpu.numerics_id(), "cuda-bf16-sm90");
  EXPECT_NE(gpu.fingerprint(), cpu->fingerprint());
  EXPECT_NE(gpu.fingerprint(), cpu->WithNumerics("cuda-bf16-sm80").fingerprint());
  EXPECT_EQ(gpu.fingerprint(), cpu->WithNumerics("cuda-bf16-sm90").fingerprint());
  // Derived layouts keep the backend: a block-size change never drops back to CPU identity.
  auto bigger = gpu.WithBlockTokens(32);
  ASSERT_TRUE(bigger.ok());
  EXPECT_EQ(bigger->numerics_id(), "cuda-bf16-sm90");
  EXPECT_NE(bigger->fingerprint(), cpu->WithBlockTokens(32)->fingerprint());
}

TEST(ModelLayout, RejectsBadGroups) {
  EXPECT_THAT(ModelLayout::Create("", DType::kBf16, 16, {{LayerKind::kFullAttention, {0}, 1, 8}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model_id")));
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 0, {{LayerKind::kFullAttention, {0}, 1, 8}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("block_tokens")));
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("groups")));
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {{LayerKind::kFullAttention, {0}, -2, 8}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_kv_heads")));
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {{LayerKind::kFullAttention, {0}, 2, 0}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim")));
  LayerGroup window{LayerKind::kSlidingWindow, {0}, 2, 8};
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {window}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("window_tokens")));
  LayerGroup mla{LayerKind::kMlaLatent, {0}};
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {mla}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("latent_dim")));
  LayerGroup ssm{LayerKind::kSsmState, {0}};
  ssm.state_bytes = -5;
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {ssm}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("state_bytes")));
  LayerGroup a{LayerKind::kFullAttention, {0, 1}, 2, 8};
  LayerGroup b{LayerKind::kFullAttention, {1}, 2, 8};
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {a, b}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("two groups")));
  LayerGroup gap{LayerKind::kFullAttention, {0, 2}, 2, 8};
  EXPECT_THAT(ModelLayout::Create("m", DType::kBf16, 16, {gap}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("without gaps")));
}

TEST(DType, ParsesNamesAndRejectsUnknown) {
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBf16);
  EXPECT_EQ(*ParseDType("float16"), DType::kFp16);
  EXPECT_EQ(*ParseDType("FP8"), DType::kFp8);
  EXPECT_EQ(*ParseDType("fp8_e4m3"), DType::kFp8);
  EXPECT_EQ(*ParseDType("float32"), DType::kFp32);
  EXPECT_THAT(ParseDType("int4"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int4")));
}

}  // namespace
}  // namespace kvrelay::kv
