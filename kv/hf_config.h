#pragma once

// Reads a Hugging Face config.json into a ModelLayout and the architecture facts the model
// runner needs. Supported model_type: gpt2, llama, mistral, qwen2, deepseek_v2, deepseek_v3,
// gemma3, gemma3_text, mamba. Unknown model_type, malformed JSON, a missing or non-positive
// field -> InvalidArgument naming the field.

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kv/model_layout.h"

namespace kvrelay::kv {

struct ConfigOptions {
  std::optional<DType> dtype;          // overrides torch_dtype
  int32_t block_tokens = 16;
  std::string model_id;                // empty: "<model_type>" + "-" + short config digest
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
  // mamba
  int32_t ssm_state_size = 0;
  int32_t conv_kernel = 0;
  DType dtype = DType::kBf16;  // torch_dtype, or the override
  ModelLayout layout;
};

absl::StatusOr<ModelConfig> ParseHfConfig(std::string_view json_text,
                                          const ConfigOptions& options = {});
absl::StatusOr<ModelConfig> LoadHfConfig(const std::string& path,
                                         const ConfigOptions& options = {});

}  // namespace kvrelay::kv
