#pragma once

// Reads a Hugging Face config.json into a ModelLayout and the architecture facts the model
// runner needs. Supported model_type: gpt2, llama, mistral, qwen2, deepseek_v2, deepseek_v3,
// gemma3, gemma3_text, mamba. Unknown model_type, malformed JSON, a missing or non-positive
// field -> InvalidArgument naming the field.

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kv/model_layout.h"

namespace kvrelay::kv {

// Tokens per KV block unless --block-tokens says otherwise: the one default of the store, the
// workers, the gateway and the model runners (it is part of the layout fingerprint, so every
// process of a deployment must agree on it).
inline constexpr int32_t kDefaultBlockTokens = 16;

// OK for a --block-tokens value in [1, kMaxBlockTokens]; InvalidArgument naming the flag and
// the value otherwise.
absl::Status CheckBlockTokensFlag(int32_t block_tokens);

// A KV-dtype flag's value (`flag` as the user wrote it, e.g. "--kv-cache-dtype"): nullopt for
// "auto" (the model's own dtype), else a ParseDType name; InvalidArgument naming the flag.
absl::StatusOr<std::optional<DType>> ParseKvDTypeFlag(std::string_view flag,
                                                      std::string_view value);

struct ConfigOptions {
  std::optional<DType> dtype;  // overrides torch_dtype (the model's dtype, and the KV's)
  // The KV cache's dtype (kv_cache_dtype) when it differs from the model's: fp8_e4m3 halves a
  // bf16 cache (kv/fp8.h). Default: the model's dtype.
  std::optional<DType> kv_dtype;
  int32_t block_tokens = kDefaultBlockTokens;
  std::string model_id;  // empty: "<model_type>" + "-" + short config digest
};

// config.json "rope_scaling" (or "rope_parameters"), as transformers' modeling_rope_utils reads
// it. type: default | linear | dynamic | llama3 | yarn (others are kept and refused by the
// model runner). Fields a type does not use keep their defaults.
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0;
  // llama3
  double low_freq_factor = 0.0;
  double high_freq_factor = 0.0;
  // llama3 (required), yarn (optional; 0 = not given)
  int32_t original_max_position_embeddings = 0;
  // yarn
  std::optional<double> attention_factor;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;          // 0 = not given
  double mscale_all_dim = 0.0;  // 0 = not given
  bool truncate = true;
};

// Architecture facts beyond the cache shape, for the model runner. Fields that a family does
// not have stay 0.
struct ModelConfig {
  std::string model_type;
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_hidden_layers = 0;
  int32_t num_attention_heads = 0;
  int32_t num_key_value_heads = 0;
  int32_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double rope_local_theta = 0.0;  // gemma3 local layers (rope_local_base_freq); 0 = rope_theta
  int32_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  // MLA (deepseek_v2/v3)
  int32_t q_lora_rank = 0;  // 0: no query compression
  int32_t kv_lora_rank = 0;
  int32_t qk_nope_head_dim = 0;
  int32_t qk_rope_head_dim = 0;
  int32_t v_head_dim = 0;
  // sliding window
  int32_t sliding_window = 0;
  // gemma3: query_pre_attn_scalar (attention scale = 1/sqrt of it)
  double query_pre_attn_scalar = 0.0;
  RopeScaling rope_scaling;      // global layers (gemma3: local layers always use default RoPE)
  bool rope_interleave = false;  // MLA: DeepSeek's interleaved RoPE pairing (HF default true)
  // Activation of the MLP: silu, gelu_pytorch_tanh / gelu_new (tanh approximation), gelu (erf).
  std::string hidden_act = "silu";
  bool attention_bias = false;  // q/k/v/o projections carry biases
  bool mlp_bias = false;        // llama: gate/up/down carry biases
  // gemma3 soft-capping: x -> cap * tanh(x / cap); 0 = off.
  double attn_logit_softcapping = 0.0;
  double final_logit_softcapping = 0.0;
  // LayerNorm epsilon (gpt2, mamba's RMSNorm).
  double layer_norm_epsilon = 1e-5;
  // gpt2
  bool scale_attn_weights = true;
  bool scale_attn_by_inverse_layer_idx = false;
  // deepseek mixture of experts: layer i is an MoE layer when n_routed_experts > 0,
  // i >= first_k_dense_replace and i % moe_layer_freq == 0.
  int32_t n_routed_experts = 0;
  int32_t first_k_dense_replace = 0;
  int32_t moe_layer_freq = 1;
  // mamba
  int32_t ssm_state_size = 0;
  int32_t conv_kernel = 0;
  int32_t time_step_rank = 0;
  bool use_conv_bias = true;
  bool use_bias = false;
  // Fields that change the computation in a way the model runner does not implement, as
  // "field = value" (the layout is still exact; ModelRunner::Load refuses the config).
  std::vector<std::string> unsupported;
  DType dtype = DType::kBf16;  // torch_dtype, or the override
  ModelLayout layout;          // its dtype() is the KV cache's: kv_dtype, or dtype
};

absl::StatusOr<ModelConfig> ParseHfConfig(std::string_view json_text,
                                          const ConfigOptions& options = {});
absl::StatusOr<ModelConfig> LoadHfConfig(const std::string& path,
                                         const ConfigOptions& options = {});

}  // namespace kvrelay::kv
