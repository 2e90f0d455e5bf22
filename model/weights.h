#pragma once

// The weights of one decoder-only model, upcast to fp32, and the Hugging Face tensor names and
// shapes they are read from. Supported families:
//   kLlama   model_type llama / mistral: GQA, RMSNorm, RoPE (rotate-half), SwiGLU MLP
//   kMla     model_type deepseek_v2 / deepseek_v3: multi-head latent attention, dense SwiGLU MLP
//            (mixture-of-experts layers are out of scope), interleaved RoPE as DeepSeek does it
//   kGemma3  model_type gemma3_text / gemma3: GQA with per-head q/k RMSNorm, (1 + w) norms,
//            four norms per layer, GeGLU (tanh) MLP, embeddings scaled by sqrt(hidden)
//   kGpt2    model_type gpt2: MHA, LayerNorm with bias, learned positions, fused c_attn,
//            GELU MLP (not gated), Conv1D weights ([in, out] in the checkpoint, transposed here)
//   kMamba   model_type mamba (Mamba-1, state-spaces/mamba-*-hf): RMSNorm, in_proj, causal
//            depthwise conv1d, x_proj, dt_proj, selective scan (A_log, D), out_proj; run by
//            MambaRunner (model/mamba_runner.h), not ModelRunner
//
// Linear weights keep the Hugging Face [out_features, in_features] row-major layout.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kv/hf_config.h"
#include "model/safetensors.h"

namespace kvrelay::model {

enum class Arch { kLlama, kMla, kGemma3, kGpt2, kMamba };

// kLlama, kMla or kGemma3 from config.model_type; Unimplemented for the other types the config
// parser knows (qwen2), naming the type. Also checks the fields the forward pass needs
// (vocab_size, intermediate_size, ...) are set: InvalidArgument naming the field; and refuses
// (InvalidArgument naming field and value) a config with a field whose effect on the
// computation the runner does not implement (config.unsupported: MoE layers, unknown
// rope_scaling types, activations, ...).
absl::StatusOr<Arch> ArchFor(const kv::ModelConfig& config);

struct LayerWeights {
  std::vector<float> input_norm;           // [hidden]
  std::vector<float> post_attention_norm;  // [hidden]
  std::vector<float> pre_ffn_norm;         // gemma3: [hidden]
  std::vector<float> post_ffn_norm;        // gemma3: [hidden]
  // GQA
  std::vector<float> q_proj;  // [heads * head_dim, hidden]   (MLA without q_lora: see below)
  std::vector<float> k_proj;  // [kv_heads * head_dim, hidden]
  std::vector<float> v_proj;  // [kv_heads * head_dim, hidden]
  std::vector<float> q_norm;  // gemma3: [head_dim]
  std::vector<float> k_norm;  // gemma3: [head_dim]
  // MLA. q_proj [heads * (nope + rope), hidden] when q_lora_rank == 0, else:
  std::vector<float> q_a_proj;   // [q_lora_rank, hidden]
  std::vector<float> q_a_norm;   // [q_lora_rank]
  std::vector<float> q_b_proj;   // [heads * (nope + rope), q_lora_rank]
  std::vector<float> kv_a_proj;  // [kv_lora_rank + rope, hidden]
  std::vector<float> kv_a_norm;  // [kv_lora_rank]
  std::vector<float> kv_b_proj;  // [heads * (nope + v_head_dim), kv_lora_rank]
  // both
  std::vector<float> o_proj;     // [hidden, heads * head_dim] (MLA: heads * v_head_dim)
  std::vector<float> gate_proj;  // [intermediate, hidden]
  std::vector<float> up_proj;    // [intermediate, hidden]
  std::vector<float> down_proj;  // [hidden, intermediate]
  // Biases (empty when the config has none): attention_bias -> q/k/v/o, mlp_bias -> gate/up/down.
  std::vector<float> q_bias, k_bias, v_bias, o_bias, gate_bias, up_bias, down_bias;
  // gpt2: LayerNorm biases (ln_1, ln_2) and the fused c_attn ([3 * hidden, hidden] after the
  // Conv1D transpose; split into q/k/v_proj and their biases after loading, then cleared).
  std::vector<float> input_norm_bias, post_attention_norm_bias, qkv_proj, qkv_bias;
  // mamba mixer (input_norm is the block's norm, o_proj its out_proj [hidden, intermediate]).
  std::vector<float> in_proj;       // [2 * intermediate, hidden]
  std::vector<float> in_proj_bias;  // use_bias
  std::vector<float> conv_weight;   // [intermediate, 1, conv_kernel]
  std::vector<float> conv_bias;     // use_conv_bias: [intermediate]
  std::vector<float> x_proj;        // [time_step_rank + 2 * state_size, intermediate]
  std::vector<float> dt_proj;       // [intermediate, time_step_rank]
  std::vector<float> dt_bias;       // [intermediate]
  std::vector<float> a_log;         // [intermediate, state_size]; A = -exp(A_log)
  std::vector<float> d_skip;        // [intermediate] (the checkpoint's "D")
};

struct ModelWeights {
  std::vector<float> embed_tokens;     // [vocab, hidden]
  std::vector<float> final_norm;       // [hidden]
  std::vector<float> lm_head;          // [vocab, hidden]; empty when tie_word_embeddings
  std::vector<float> pos_embed;        // gpt2: [n_positions, hidden]
  std::vector<float> final_norm_bias;  // gpt2
  std::vector<LayerWeights> layers;

  const std::vector<float>& output_weights() const {
    return lm_head.empty() ? embed_tokens : lm_head;
  }
};

// How make-test-model initialises a tensor.
enum class TensorInit { kLinear, kEmbedding, kNorm, kBias, kALog, kOnes, kDtBias };

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorInit init = TensorInit::kLinear;
  std::vector<float>* target = nullptr;  // where Load puts it (into the weights passed in)
  bool gemma_norm = false;               // stored as w, used as (1 + w)
  // GPT-2 Conv1D: stored [in, out] (shape), loaded transposed to [out, in].
  bool conv1d = false;
  // Older checkpoints name the tensor without this prefix (e.g. openai-community/gpt2's
  // "h.0.attn.c_attn.weight" for "transformer.h.0.attn.c_attn.weight"); also accepted.
  std::string optional_prefix;
  int64_t fan_in() const {
    if (conv1d) return shape[0];
    if (shape.size() == 3) return shape[1] * shape[2];  // torch Conv1d [out, in / groups, k]
    return shape.size() > 1 ? shape[1] : shape[0];
  }
};

// Every tensor the model needs, with its checkpoint name and shape, pointing into `weights`
// (whose layers vector is resized to num_hidden_layers).
absl::StatusOr<std::vector<TensorSpec>> TensorSpecs(const kv::ModelConfig& config,
                                                    ModelWeights* weights);

// Reads and upcasts every tensor. InvalidArgument naming the tensor when one is missing or its
// shape differs from the config's.
absl::StatusOr<ModelWeights> LoadWeights(const SafetensorsModel& files,
                                         const kv::ModelConfig& config);

}  // namespace kvrelay::model
