#include "kv/hf_config.h"

#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::kv {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(HfConfig, EveryPresetParses) {
  for (const std::string& name : PresetNames()) {
    absl::StatusOr<ModelConfig> c = LoadPreset(name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status();
    EXPECT_EQ(c->layout.model_id(), name);
    EXPECT_GT(c->layout.num_layers(), 0) << name;
  }
}

TEST(HfConfig, Gpt2) {
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, LoadPreset("gpt2-xl"));
  EXPECT_EQ(c.model_type, "gpt2");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_key_value_heads, 25);
  EXPECT_EQ(c.layout.BytesPerToken(), 307200);
}

TEST(HfConfig, LlamaGqaAndHeadDimDefault) {
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, LoadPreset("llama3-8b"));
  EXPECT_EQ(c.head_dim, 128);  // hidden_size / num_attention_heads
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.layout.groups().size(), 1u);
  EXPECT_EQ(c.layout.BytesPerToken(), 131072);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
}

TEST(HfConfig, MissingKvHeadsMeansMha) {
  KV_ASSERT_OK_AND_ASSIGN(
      ModelConfig c,
      ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
                       "num_hidden_layers":2})"));
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.layout.BytesPerToken(), 2 * 2 * 4 * 16 * 2);
}

TEST(HfConfig, MistralWindowAppliesToEveryLayer) {
  const char* json = R"({"model_type":"mistral","hidden_size":4096,"num_attention_heads":32,
      "num_key_value_heads":8,"num_hidden_layers":32,"sliding_window":4096,
      "torch_dtype":"bfloat16"})";
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseHfConfig(json));
  ASSERT_EQ(c.layout.groups().size(), 1u);
  EXPECT_EQ(c.layout.groups()[0].kind, LayerKind::kSlidingWindow);
  EXPECT_EQ(c.layout.groups()[0].window_tokens, 4096);
  EXPECT_EQ(c.layout.BytesForTokens(100000), 4096 * 131072);
  // sliding_window null: plain full attention (Mistral v0.2+).
  KV_ASSERT_OK_AND_ASSIGN(
      ModelConfig full,
      ParseHfConfig(R"({"model_type":"mistral","hidden_size":4096,"num_attention_heads":32,
          "num_key_value_heads":8,"num_hidden_layers":32,"sliding_window":null})"));
  EXPECT_EQ(full.layout.groups()[0].kind, LayerKind::kFullAttention);
}

TEST(HfConfig, Qwen2WindowOnlyWhenEnabled) {
  const std::string base = R"("model_type":"qwen2","hidden_size":1024,"num_attention_heads":16,
      "num_key_value_heads":2,"num_hidden_layers":24,"sliding_window":2048,
      "max_window_layers":20)";
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig off,
                          ParseHfConfig("{" + base + R"(,"use_sliding_window":false})"));
  ASSERT_EQ(off.layout.groups().size(), 1u);
  EXPECT_EQ(off.layout.groups()[0].kind, LayerKind::kFullAttention);
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig on,
                          ParseHfConfig("{" + base + R"(,"use_sliding_window":true})"));
  ASSERT_EQ(on.layout.groups().size(), 2u);
  EXPECT_EQ(on.layout.groups()[0].num_layers(), 20);  // below max_window_layers: full
  EXPECT_EQ(on.layout.groups()[1].kind, LayerKind::kSlidingWindow);
  EXPECT_EQ(on.layout.groups()[1].layer_ids.front(), 20);
}

TEST(HfConfig, DeepSeekMlaIgnoresKvHeads) {
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, LoadPreset("deepseek-v3"));
  ASSERT_EQ(c.layout.groups().size(), 1u);
  const LayerGroup& g = c.layout.groups()[0];
  EXPECT_EQ(g.kind, LayerKind::kMlaLatent);
  EXPECT_EQ(g.latent_dim, 512);
  EXPECT_EQ(g.rope_dim, 64);
  EXPECT_EQ(g.num_kv_heads, 0);
  EXPECT_EQ(c.layout.BytesPerToken(), 70272);
  // deepseek_v2 reads the same fields.
  KV_ASSERT_OK_AND_ASSIGN(
      ModelConfig v2,
      ParseHfConfig(R"({"model_type":"deepseek_v2","hidden_size":5120,"num_attention_heads":128,
          "num_key_value_heads":128,"num_hidden_layers":60,"kv_lora_rank":512,
          "qk_rope_head_dim":64,"qk_nope_head_dim":128,"v_head_dim":128,"q_lora_rank":1536})"));
  EXPECT_EQ(v2.layout.BytesPerToken(), 60 * 576 * 2);
}

TEST(HfConfig, DeepSeekNeedsKvLoraRank) {
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"deepseek_v3","hidden_size":64,
                  "num_attention_heads":4,"num_hidden_layers":2,"qk_rope_head_dim":8,
                  "qk_nope_head_dim":8,"v_head_dim":8})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("kv_lora_rank")));
}

TEST(HfConfig, Gemma3NestedTextConfigAndPattern) {
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, LoadPreset("gemma3-27b"));
  EXPECT_EQ(c.model_type, "gemma3");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.sliding_window, 1024);
  EXPECT_DOUBLE_EQ(c.query_pre_attn_scalar, 168);
  ASSERT_EQ(c.layout.groups().size(), 2u);
  for (int32_t id : c.layout.groups()[0].layer_ids) EXPECT_EQ((id + 1) % 6, 0) << id;
}

TEST(HfConfig, Gemma3ExplicitLayerTypes) {
  KV_ASSERT_OK_AND_ASSIGN(
      ModelConfig c,
      ParseHfConfig(R"({"model_type":"gemma3_text","hidden_size":64,"num_attention_heads":2,
          "num_key_value_heads":1,"head_dim":32,"num_hidden_layers":3,"sliding_window":8,
          "layer_types":["full_attention","sliding_attention","sliding_attention"]})"));
  ASSERT_EQ(c.layout.groups().size(), 2u);
  EXPECT_EQ(c.layout.groups()[0].layer_ids, std::vector<int32_t>({0}));
  EXPECT_EQ(c.layout.groups()[1].layer_ids, std::vector<int32_t>({1, 2}));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"gemma3_text","hidden_size":64,"num_attention_heads":2,
          "num_key_value_heads":1,"head_dim":32,"num_hidden_layers":2,"sliding_window":8,
          "layer_types":["full_attention","banana"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer_types[1]")));
}

TEST(HfConfig, MambaState) {
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, LoadPreset("mamba-2.8b"));
  ASSERT_EQ(c.layout.groups().size(), 1u);
  EXPECT_EQ(c.layout.groups()[0].kind, LayerKind::kSsmState);
  EXPECT_EQ(c.layout.groups()[0].state_bytes, 5120 * (4 + 16) * 2);
}

TEST(HfConfig, DTypeFromConfigAndOverride) {
  const char* json = R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
      "num_hidden_layers":2,"torch_dtype":"float32"})";
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseHfConfig(json));
  EXPECT_EQ(c.dtype, DType::kFp32);
  ConfigOptions options;
  options.dtype = DType::kFp8;
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig o, ParseHfConfig(json, options));
  EXPECT_EQ(o.layout.dtype(), DType::kFp8);
  // kv_dtype changes only the cache: the model keeps computing in its own dtype.
  ConfigOptions kv_only;
  kv_only.kv_dtype = DType::kFp8;
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig k, ParseHfConfig(json, kv_only));
  EXPECT_EQ(k.dtype, DType::kFp32);
  EXPECT_EQ(k.layout.dtype(), DType::kFp8);
  EXPECT_NE(k.layout.fingerprint(), c.layout.fingerprint());
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"mamba","hidden_size":64,"intermediate_size":128,
                  "state_size":16,"conv_kernel":4,"num_hidden_layers":2,"vocab_size":64})",
                            kv_only),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("kv_cache_dtype fp8_e4m3 for model_type 'mamba'")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
                  "num_hidden_layers":2,"torch_dtype":"int3"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("int3")));
}

TEST(HfConfig, BadInputNamesTheProblem) {
  EXPECT_THAT(ParseHfConfig("{not json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid JSON")));
  EXPECT_THAT(ParseHfConfig("[1,2]"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseHfConfig(R"({"hidden_size":4})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model_type")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"bert"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bert")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_hidden_layers")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
                  "num_hidden_layers":-3})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_hidden_layers")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
                  "num_hidden_layers":2,"num_key_value_heads":0})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_key_value_heads")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"llama","hidden_size":"64","num_attention_heads":4,
                  "num_hidden_layers":2})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hidden_size")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"llama","hidden_size":65,"num_attention_heads":4,
                  "num_hidden_layers":2})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("head_dim")));
  EXPECT_THAT(ParseHfConfig(R"({"model_type":"mamba","hidden_size":64,"num_hidden_layers":2,
                  "intermediate_size":128,"conv_kernel":4})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("state_size")));
}

TEST(HfConfig, RopeScalingIsRead) {
  KV_ASSERT_OK_AND_ASSIGN(
      ModelConfig c,
      ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
          "num_hidden_layers":2,"rope_scaling":{"rope_type":"llama3","factor":8.0,
          "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}})"));
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c.unsupported.empty());
  // The older "type" key; null means no scaling.
  KV_ASSERT_OK_AND_ASSIGN(
      c, ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
          "num_hidden_layers":2,"rope_scaling":{"type":"linear","factor":4}})"));
  EXPECT_EQ(c.rope_scaling.type, "linear");
  KV_ASSERT_OK_AND_ASSIGN(
      c, ParseHfConfig(R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
          "num_hidden_layers":2,"rope_scaling":null})"));
  EXPECT_EQ(c.rope_scaling.type, "default");
}

TEST(HfConfig, MalformedRopeScalingNamesTheField) {
  const std::string head = R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
      "num_hidden_layers":2,"rope_scaling":)";
  EXPECT_THAT(ParseHfConfig(head + R"({"rope_type":"linear"}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("factor")));
  EXPECT_THAT(ParseHfConfig(head + R"({"rope_type":"llama3","factor":8}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("low_freq_factor")));
  EXPECT_THAT(ParseHfConfig(head + R"({"factor":8}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope_type")));
  EXPECT_THAT(ParseHfConfig(head + R"({"rope_type":"linear","factor":"x"}})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope_scaling.factor")));
}

// Fields whose effect the runner does not implement are listed (the layout is still exact);
// the model runner refuses such a config naming them.
TEST(HfConfig, UnimplementedComputeFieldsAreListed) {
  const std::string head = R"({"model_type":"llama","hidden_size":64,"num_attention_heads":4,
      "num_hidden_layers":2,)";
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c,
                          ParseHfConfig(head + R"("rope_scaling":{"rope_type":"longrope",
                              "short_factor":[1],"long_factor":[1]}})"));
  EXPECT_THAT(c.unsupported, ::testing::ElementsAre(HasSubstr("rope_type = \"longrope\"")));
  KV_ASSERT_OK_AND_ASSIGN(c, ParseHfConfig(head + R"("hidden_act":"relu2"})"));
  EXPECT_THAT(c.unsupported, ::testing::ElementsAre(HasSubstr("hidden_act = \"relu2\"")));
  KV_ASSERT_OK_AND_ASSIGN(c, ParseHfConfig(head + R"("partial_rotary_factor":0.5})"));
  EXPECT_THAT(c.unsupported, ::testing::ElementsAre(HasSubstr("partial_rotary_factor = 0.5")));
  EXPECT_EQ(c.layout.BytesPerToken(), 2 * 2 * 4 * 16 * 2);
}

TEST(HfConfig, DeepSeekMoeDefaultsFollowTransformers) {
  // deepseek_v3 without MoE fields: transformers makes layers >= 3 MoE (256 experts).
  const std::string head = R"({"model_type":"deepseek_v3","hidden_size":64,
      "num_attention_heads":2,"num_hidden_layers":4,"kv_lora_rank":16,"qk_rope_head_dim":8,
      "qk_nope_head_dim":8,"v_head_dim":8,"q_lora_rank":16,)";
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, ParseHfConfig(head + R"("vocab_size":32})"));
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.first_k_dense_replace, 3);
  EXPECT_THAT(c.unsupported, ::testing::ElementsAre(HasSubstr("first_k_dense_replace = 3")));
  EXPECT_TRUE(c.rope_interleave);
  // Dense: first_k_dense_replace covers every layer, or n_routed_experts null.
  KV_ASSERT_OK_AND_ASSIGN(c, ParseHfConfig(head + R"("first_k_dense_replace":4})"));
  EXPECT_TRUE(c.unsupported.empty());
  KV_ASSERT_OK_AND_ASSIGN(c, ParseHfConfig(head + R"("n_routed_experts":null})"));
  EXPECT_TRUE(c.unsupported.empty());
  KV_ASSERT_OK_AND_ASSIGN(c, ParseHfConfig(head + R"("n_routed_experts":null,
      "rope_interleave":false,"attention_bias":true})"));
  EXPECT_FALSE(c.rope_interleave);
  EXPECT_THAT(c.unsupported, ::testing::ElementsAre(HasSubstr("attention_bias = true")));
}

TEST(HfConfig, Gemma3DefaultsFollowTransformers) {
  KV_ASSERT_OK_AND_ASSIGN(
      ModelConfig c,
      ParseHfConfig(R"({"model_type":"gemma3_text","hidden_size":64,"num_attention_heads":2,
          "num_key_value_heads":1,"head_dim":32,"num_hidden_layers":6,"sliding_window":16,
          "attn_logit_softcapping":50.0,"final_logit_softcapping":30.0})"));
  EXPECT_DOUBLE_EQ(c.query_pre_attn_scalar, 256);  // not head_dim
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_act, "gelu_pytorch_tanh");
  EXPECT_DOUBLE_EQ(c.attn_logit_softcapping, 50.0);
  EXPECT_DOUBLE_EQ(c.final_logit_softcapping, 30.0);
  EXPECT_TRUE(c.unsupported.empty());
}

TEST(HfConfig, LoadFromFileNamesThePath) {
  kvrelay::testing::TempDir dir;
  const std::string path = dir.File("config.json");
  KV_ASSERT_OK(WriteFileAtomically(path, R"({"model_type":"llama","hidden_size":64,
      "num_attention_heads":4,"num_hidden_layers":2})"));
  KV_ASSERT_OK_AND_ASSIGN(ModelConfig c, LoadHfConfig(path));
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_THAT(LoadHfConfig(dir.File("missing.json")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.json")));
}

TEST(Presets, UnknownPresetListsKnownOnes) {
  EXPECT_THAT(LoadPreset("gpt5"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("llama3-8b")));
}

}  // namespace
}  // namespace kvrelay::kv
