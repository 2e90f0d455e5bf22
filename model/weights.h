#pragma once

// The weights of one decoder-only model, upcast to fp32, and the Hugging Face tensor names and
// shapes they are read from. Supported families:
//   kLlama   model_type llama / mistral: GQA, RMSNorm, RoPE (rotate-half), SwiGLU MLP
//   kMla     model_type deepseek_v2 / deepseek_v3: multi-head latent attention, dense SwiGLU MLP
//            (mixture-of-experts layers are out of scope), interleaved RoPE as DeepSeek does it
//   kGemma3  model_type gemma3_text / gemma3: GQA with per-head q/k RMSNorm, (1 + w) norms,
//            four norms per layer, GeGLU (tanh) MLP, embeddings scaled by sqrt(hidden)
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

enum class Arch { kLlama, kMla, kGemma3 };

// kLlama, kMla or kGemma3 from config.model_type; Unimplemented for the other types the config
// parser knows (gpt2, qwen2, mamba), naming the type. Also checks the fields the forward pass
// needs (vocab_size, intermediate_size, ...) are set: InvalidArgument naming the field.
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
};

struct ModelWeights {
  std::vector<float> embed_tokens;  // [vocab, hidden]
  std::vector<float> final_norm;    // [hidden]
  std::vector<float> lm_head;       // [vocab, hidden]; empty when tie_word_embeddings
  std::vector<LayerWeights> layers;

  const std::vector<float>& output_weights() const {
    return lm_head.empty() ? embed_tokens : lm_head;
  }
};

// How make-test-model initialises a tensor.
enum class TensorInit { kLinear, kEmbedding, kNorm };

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  TensorInit init = TensorInit::kLinear;
  std::vector<float>* target = nullptr;  // where Load puts it (into the weights passed in)
  bool gemma_norm = false;               // stored as w, used as (1 + w)
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
