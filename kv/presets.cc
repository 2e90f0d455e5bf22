#include "kv/presets.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace kvrelay::kv {
namespace {

// Published shapes (Hugging Face config.json of each model; dtype as served). The tiny-*
// entries are the models `kvrelay make-test-model` generates for tests and the demo.
const std::map<std::string, std::string, std::less<>>& Presets() {
  static const auto* presets = new std::map<std::string, std::string, std::less<>>{
      {"gpt2-xl", R"({"model_type": "gpt2", "n_embd": 1600, "n_head": 25, "n_layer": 48,
          "n_positions": 1024, "vocab_size": 50257, "torch_dtype": "bfloat16"})"},
      {"llama3-8b", R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
          "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
          "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
          "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      {"llama3-70b", R"({"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64,
          "num_key_value_heads": 8, "num_hidden_layers": 80, "intermediate_size": 28672,
          "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
          "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      {"deepseek-v3", R"({"model_type": "deepseek_v3", "hidden_size": 7168,
          "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
          "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
          "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
          "rope_theta": 10000, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      {"gemma3-27b", R"({"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": {
          "model_type": "gemma3_text", "hidden_size": 5376, "num_attention_heads": 32,
          "num_key_value_heads": 16, "head_dim": 128, "num_hidden_layers": 62,
          "intermediate_size": 21504, "vocab_size": 262208, "max_position_embeddings": 131072,
          "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 168,
          "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-06}})"},
      {"mamba-2.8b", R"({"model_type": "mamba", "hidden_size": 2560, "intermediate_size": 5120,
          "state_size": 16, "conv_kernel": 4, "num_hidden_layers": 64, "vocab_size": 50280,
          "torch_dtype": "bfloat16"})"},
      // The tiny models carry every field their family's real configs set: Llama 3.1's llama3
      // RoPE scaling, DeepSeek V3's YaRN with mscale and its MoE fields (first_k_dense_replace
      // covering every layer: dense), Gemma 3's linear RoPE scaling on global layers,
      // query_pre_attn_scalar != head_dim and a window shorter than test prompts.
      {"tiny-llama", R"({"model_type": "llama", "hidden_size": 256, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 4,
          "intermediate_size": 512, "vocab_size": 512, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false,
          "hidden_act": "silu", "attention_bias": false, "mlp_bias": false,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
          "torch_dtype": "bfloat16"})"},
      {"tiny-deepseek-v3", R"({"model_type": "deepseek_v3", "hidden_size": 256,
          "num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 4,
          "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
          "v_head_dim": 32, "intermediate_size": 512, "vocab_size": 512,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
          "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
          "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 256},
          "rope_interleave": true, "hidden_act": "silu", "attention_bias": false,
          "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
          "moe_intermediate_size": 128, "first_k_dense_replace": 4, "moe_layer_freq": 1,
          "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
          "scoring_func": "sigmoid", "topk_method": "noaux_tc",
          "tie_word_embeddings": false, "torch_dtype": "bfloat16"})"},
      {"tiny-gemma3", R"({"model_type": "gemma3_text", "hidden_size": 256,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "num_hidden_layers": 6, "intermediate_size": 512, "vocab_size": 512,
          "max_position_embeddings": 4096, "sliding_window": 32, "sliding_window_pattern": 6,
          "query_pre_attn_scalar": 48, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0},
          "attn_logit_softcapping": null, "final_logit_softcapping": null,
          "hidden_activation": "gelu_pytorch_tanh", "attention_bias": false,
          "rms_norm_eps": 1e-06, "tie_word_embeddings": true, "torch_dtype": "bfloat16"})"},
      {"tiny-mamba", R"({"model_type": "mamba", "hidden_size": 128, "intermediate_size": 256,
          "state_size": 16, "conv_kernel": 4, "num_hidden_layers": 4, "vocab_size": 512,
          "time_step_rank": "auto", "use_conv_bias": true, "use_bias": false,
          "hidden_act": "silu", "layer_norm_epsilon": 1e-05, "tie_word_embeddings": true,
          "residual_in_fp32": true, "torch_dtype": "bfloat16"})"},
      {"tiny-gpt2", R"({"model_type": "gpt2", "n_embd": 256, "n_head": 8, "n_layer": 4,
          "n_positions": 1024, "n_inner": null, "vocab_size": 512,
          "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05,
          "scale_attn_weights": true, "scale_attn_by_inverse_layer_idx": false,
          "tie_word_embeddings": true, "torch_dtype": "bfloat16"})"},
  };
  return *presets;
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const auto& [name, json] : Presets()) names.push_back(name);
  return names;
}

absl::StatusOr<std::string> PresetConfigJson(std::string_view name) {
  auto it = Presets().find(name);
  if (it == Presets().end()) {
    return absl::NotFoundError(absl::StrCat("unknown preset '", std::string(name),
                                            "' (known: ", absl::StrJoin(PresetNames(), ", "), ")"));
  }
  return it->second;
}

absl::StatusOr<ModelConfig> LoadPreset(std::string_view name, ConfigOptions options) {
  KV_ASSIGN_OR_RETURN(std::string json, PresetConfigJson(name));
  if (options.model_id.empty()) options.model_id = std::string(name);
  return ParseHfConfig(json, options);
}

}  // namespace kvrelay::kv
