#include "model/weights.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace kvrelay::model {
namespace {

absl::Status Need(int64_t value, const char* field) {
  if (value <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", field, " must be positive for the model runner, got ", value));
  }
  return absl::OkStatus();
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<Arch> ArchFor(const kv::ModelConfig& c) {
  Arch arch;
  if (c.model_type == "llama" || c.model_type == "mistral") {
    arch = Arch::kLlama;
  } else if (c.model_type == "deepseek_v2" || c.model_type == "deepseek_v3") {
    arch = Arch::kMla;
  } else if (c.model_type == "gemma3" || c.model_type == "gemma3_text") {
    arch = Arch::kGemma3;
  } else if (c.model_type == "gpt2") {
    arch = Arch::kGpt2;
  } else if (c.model_type == "mamba") {
    arch = Arch::kMamba;
  } else {
    return absl::UnimplementedError(absl::StrCat(
        "model runner: model_type '", c.model_type,
        "' is not supported (supported: llama, mistral, deepseek_v2, deepseek_v3, gemma3, "
        "gemma3_text, gpt2, mamba)"));
  }
  if (!c.unsupported.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("config: the model runner does not implement ",
                                                   absl::StrJoin(c.unsupported, "; ")));
  }
  KV_RETURN_IF_ERROR(Need(c.vocab_size, "vocab_size"));
  KV_RETURN_IF_ERROR(Need(c.hidden_size, "hidden_size"));
  KV_RETURN_IF_ERROR(Need(c.intermediate_size, "intermediate_size"));
  KV_RETURN_IF_ERROR(Need(c.num_hidden_layers, "num_hidden_layers"));
  if (arch != Arch::kMamba) {
    KV_RETURN_IF_ERROR(Need(c.num_attention_heads, "num_attention_heads"));
  }
  if (arch == Arch::kGpt2) {
    KV_RETURN_IF_ERROR(Need(c.max_position_embeddings, "n_positions"));
    return arch;
  }
  if (arch == Arch::kMamba) {
    KV_RETURN_IF_ERROR(Need(c.ssm_state_size, "state_size"));
    KV_RETURN_IF_ERROR(Need(c.conv_kernel, "conv_kernel"));
    KV_RETURN_IF_ERROR(Need(c.time_step_rank, "time_step_rank"));
    return arch;
  }
  if (arch == Arch::kMla) {
    KV_RETURN_IF_ERROR(Need(c.kv_lora_rank, "kv_lora_rank"));
    KV_RETURN_IF_ERROR(Need(c.qk_nope_head_dim, "qk_nope_head_dim"));
    KV_RETURN_IF_ERROR(Need(c.qk_rope_head_dim, "qk_rope_head_dim"));
    KV_RETURN_IF_ERROR(Need(c.v_head_dim, "v_head_dim"));
    if (c.qk_rope_head_dim % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: qk_rope_head_dim must be even, got ", c.qk_rope_head_dim));
    }
  } else {
    KV_RETURN_IF_ERROR(Need(c.num_key_value_heads, "num_key_value_heads"));
    KV_RETURN_IF_ERROR(Need(c.head_dim, "head_dim"));
    if (c.head_dim % 2 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: head_dim must be even for RoPE, got ", c.head_dim));
    }
  }
  return arch;
}

absl::StatusOr<std::vector<TensorSpec>> TensorSpecs(const kv::ModelConfig& c, ModelWeights* w) {
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(c));
  const int64_t hidden = c.hidden_size;
  const int64_t heads = c.num_attention_heads;
  std::vector<TensorSpec> specs;
  auto add = [&](std::string name, std::vector<int64_t> shape, TensorInit init,
                 std::vector<float>* target) {
    TensorSpec s;
    s.name = std::move(name);
    s.shape = std::move(shape);
    s.init = init;
    s.target = target;
    s.gemma_norm = arch == Arch::kGemma3 && init == TensorInit::kNorm;
    specs.push_back(std::move(s));
  };
  w->layers.assign(c.num_hidden_layers, LayerWeights{});
  if (arch == Arch::kMamba) {
    // MambaForCausalLM's names (state-spaces/mamba-*-hf).
    const int64_t inter = c.intermediate_size, n = c.ssm_state_size, rank = c.time_step_rank;
    add("backbone.embeddings.weight", {c.vocab_size, hidden}, TensorInit::kEmbedding,
        &w->embed_tokens);
    for (int32_t i = 0; i < c.num_hidden_layers; ++i) {
      LayerWeights& l = w->layers[i];
      const std::string p = absl::StrCat("backbone.layers.", i, ".");
      add(p + "norm.weight", {hidden}, TensorInit::kNorm, &l.input_norm);
      add(p + "mixer.in_proj.weight", {2 * inter, hidden}, TensorInit::kLinear, &l.in_proj);
      if (c.use_bias)
        add(p + "mixer.in_proj.bias", {2 * inter}, TensorInit::kBias, &l.in_proj_bias);
      add(p + "mixer.conv1d.weight", {inter, 1, c.conv_kernel}, TensorInit::kLinear,
          &l.conv_weight);
      if (c.use_conv_bias) {
        add(p + "mixer.conv1d.bias", {inter}, TensorInit::kBias, &l.conv_bias);
      }
      add(p + "mixer.x_proj.weight", {rank + 2 * n, inter}, TensorInit::kLinear, &l.x_proj);
      add(p + "mixer.dt_proj.weight", {inter, rank}, TensorInit::kLinear, &l.dt_proj);
      add(p + "mixer.dt_proj.bias", {inter}, TensorInit::kDtBias, &l.dt_bias);
      add(p + "mixer.A_log", {inter, n}, TensorInit::kALog, &l.a_log);
      add(p + "mixer.D", {inter}, TensorInit::kOnes, &l.d_skip);
      add(p + "mixer.out_proj.weight", {hidden, inter}, TensorInit::kLinear, &l.o_proj);
      if (c.use_bias) add(p + "mixer.out_proj.bias", {hidden}, TensorInit::kBias, &l.o_bias);
    }
    add("backbone.norm_f.weight", {hidden}, TensorInit::kNorm, &w->final_norm);
    if (!c.tie_word_embeddings) {
      add("lm_head.weight", {c.vocab_size, hidden}, TensorInit::kLinear, &w->lm_head);
    }
    return specs;
  }
  if (arch == Arch::kGpt2) {
    // GPT2LMHeadModel's names; lm_head is always tied to wte.
    const std::string t = "transformer.";
    auto conv = [&](std::string name, int64_t in, int64_t out, std::vector<float>* target) {
      add(t + name, {in, out}, TensorInit::kLinear, target);
      specs.back().conv1d = true;
    };
    add(t + "wte.weight", {c.vocab_size, hidden}, TensorInit::kEmbedding, &w->embed_tokens);
    add(t + "wpe.weight", {c.max_position_embeddings, hidden}, TensorInit::kEmbedding,
        &w->pos_embed);
    const int64_t inner = c.intermediate_size;
    for (int32_t i = 0; i < c.num_hidden_layers; ++i) {
      LayerWeights& l = w->layers[i];
      const std::string p = absl::StrCat("h.", i, ".");
      add(t + p + "ln_1.weight", {hidden}, TensorInit::kNorm, &l.input_norm);
      add(t + p + "ln_1.bias", {hidden}, TensorInit::kBias, &l.input_norm_bias);
      conv(p + "attn.c_attn.weight", hidden, 3 * hidden, &l.qkv_proj);
      add(t + p + "attn.c_attn.bias", {3 * hidden}, TensorInit::kBias, &l.qkv_bias);
      conv(p + "attn.c_proj.weight", hidden, hidden, &l.o_proj);
      add(t + p + "attn.c_proj.bias", {hidden}, TensorInit::kBias, &l.o_bias);
      add(t + p + "ln_2.weight", {hidden}, TensorInit::kNorm, &l.post_attention_norm);
      add(t + p + "ln_2.bias", {hidden}, TensorInit::kBias, &l.post_attention_norm_bias);
      conv(p + "mlp.c_fc.weight", hidden, inner, &l.up_proj);
      add(t + p + "mlp.c_fc.bias", {inner}, TensorInit::kBias, &l.up_bias);
      conv(p + "mlp.c_proj.weight", inner, hidden, &l.down_proj);
      add(t + p + "mlp.c_proj.bias", {hidden}, TensorInit::kBias, &l.down_bias);
    }
    add(t + "ln_f.weight", {hidden}, TensorInit::kNorm, &w->final_norm);
    add(t + "ln_f.bias", {hidden}, TensorInit::kBias, &w->final_norm_bias);
    for (TensorSpec& spec : specs) spec.optional_prefix = t;
    return specs;
  }
  add("model.embed_tokens.weight", {c.vocab_size, hidden}, TensorInit::kEmbedding,
      &w->embed_tokens);
  for (int32_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights& l = w->layers[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {hidden}, TensorInit::kNorm, &l.input_norm);
    add(p + "post_attention_layernorm.weight", {hidden}, TensorInit::kNorm, &l.post_attention_norm);
    if (arch == Arch::kMla) {
      const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (c.q_lora_rank > 0) {
        add(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, hidden}, TensorInit::kLinear,
            &l.q_a_proj);
        add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank}, TensorInit::kNorm, &l.q_a_norm);
        add(p + "self_attn.q_b_proj.weight", {heads * qk, c.q_lora_rank}, TensorInit::kLinear,
            &l.q_b_proj);
      } else {
        add(p + "self_attn.q_proj.weight", {heads * qk, hidden}, TensorInit::kLinear, &l.q_proj);
      }
      add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, hidden},
          TensorInit::kLinear, &l.kv_a_proj);
      add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, TensorInit::kNorm, &l.kv_a_norm);
      add(p + "self_attn.kv_b_proj.weight",
          {heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, TensorInit::kLinear,
          &l.kv_b_proj);
      add(p + "self_attn.o_proj.weight", {hidden, heads * c.v_head_dim}, TensorInit::kLinear,
          &l.o_proj);
    } else {
      const int64_t kv = c.num_key_value_heads;
      const int64_t hd = c.head_dim;
      add(p + "self_attn.q_proj.weight", {heads * hd, hidden}, TensorInit::kLinear, &l.q_proj);
      add(p + "self_attn.k_proj.weight", {kv * hd, hidden}, TensorInit::kLinear, &l.k_proj);
      add(p + "self_attn.v_proj.weight", {kv * hd, hidden}, TensorInit::kLinear, &l.v_proj);
      add(p + "self_attn.o_proj.weight", {hidden, heads * hd}, TensorInit::kLinear, &l.o_proj);
      if (c.attention_bias) {
        add(p + "self_attn.q_proj.bias", {heads * hd}, TensorInit::kBias, &l.q_bias);
        add(p + "self_attn.k_proj.bias", {kv * hd}, TensorInit::kBias, &l.k_bias);
        add(p + "self_attn.v_proj.bias", {kv * hd}, TensorInit::kBias, &l.v_bias);
        add(p + "self_attn.o_proj.bias", {hidden}, TensorInit::kBias, &l.o_bias);
      }
      if (arch == Arch::kGemma3) {
        add(p + "self_attn.q_norm.weight", {hd}, TensorInit::kNorm, &l.q_norm);
        add(p + "self_attn.k_norm.weight", {hd}, TensorInit::kNorm, &l.k_norm);
        add(p + "pre_feedforward_layernorm.weight", {hidden}, TensorInit::kNorm, &l.pre_ffn_norm);
        add(p + "post_feedforward_layernorm.weight", {hidden}, TensorInit::kNorm, &l.post_ffn_norm);
      }
    }
    add(p + "mlp.gate_proj.weight", {c.intermediate_size, hidden}, TensorInit::kLinear,
        &l.gate_proj);
    add(p + "mlp.up_proj.weight", {c.intermediate_size, hidden}, TensorInit::kLinear, &l.up_proj);
    add(p + "mlp.down_proj.weight", {hidden, c.intermediate_size}, TensorInit::kLinear,
        &l.down_proj);
    if (c.mlp_bias) {
      add(p + "mlp.gate_proj.bias", {c.intermediate_size}, TensorInit::kBias, &l.gate_bias);
      add(p + "mlp.up_proj.bias", {c.intermediate_size}, TensorInit::kBias, &l.up_bias);
      add(p + "mlp.down_proj.bias", {hidden}, TensorInit::kBias, &l.down_bias);
    }
  }
  add("model.norm.weight", {hidden}, TensorInit::kNorm, &w->final_norm);
  if (!c.tie_word_embeddings) {
    add("lm_head.weight", {c.vocab_size, hidden}, TensorInit::kLinear, &w->lm_head);
  }
  return specs;
}

absl::StatusOr<ModelWeights> LoadWeights(const SafetensorsModel& files,
                                         const kv::ModelConfig& config) {
  ModelWeights w;
  KV_ASSIGN_OR_RETURN(std::vector<TensorSpec> specs, TensorSpecs(config, &w));
  for (const TensorSpec& spec : specs) {
    const TensorView* view = files.Find(spec.name);
    if (view == nullptr && !spec.optional_prefix.empty() &&
        spec.name.compare(0, spec.optional_prefix.size(), spec.optional_prefix) == 0) {
      view = files.Find(spec.name.substr(spec.optional_prefix.size()));
    }
    if (view == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("weights: tensor ", spec.name,
                                                     " is missing (expected shape ",
                                                     ShapeText(spec.shape), ")"));
    }
    if (view->shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat("weights: tensor ", spec.name, " has shape ",
                                                     ShapeText(view->shape), ", config needs ",
                                                     ShapeText(spec.shape)));
    }
    *spec.target = view->ToFloat();
    if (spec.gemma_norm) {
      for (float& v : *spec.target) v += 1.0f;  // Gemma3RMSNorm scales by (1 + w)
    }
    if (spec.conv1d) {
      // Conv1D keeps [in, out]; our Linear wants [out, in].
      const int64_t in = spec.shape[0], out = spec.shape[1];
      std::vector<float> t(static_cast<size_t>(in * out));
      const std::vector<float>& src = *spec.target;
      for (int64_t i = 0; i < in; ++i) {
        for (int64_t o = 0; o < out; ++o) t[o * in + i] = src[i * out + o];
      }
      *spec.target = std::move(t);
    }
  }
  if (config.model_type == "gpt2") {
    // Split c_attn's rows [q; k; v] into the per-projection weights the attention uses.
    const int64_t h = config.hidden_size;
    for (LayerWeights& l : w.layers) {
      l.q_proj.assign(l.qkv_proj.begin(), l.qkv_proj.begin() + h * h);
      l.k_proj.assign(l.qkv_proj.begin() + h * h, l.qkv_proj.begin() + 2 * h * h);
      l.v_proj.assign(l.qkv_proj.begin() + 2 * h * h, l.qkv_proj.end());
      l.q_bias.assign(l.qkv_bias.begin(), l.qkv_bias.begin() + h);
      l.k_bias.assign(l.qkv_bias.begin() + h, l.qkv_bias.begin() + 2 * h);
      l.v_bias.assign(l.qkv_bias.begin() + 2 * h, l.qkv_bias.end());
      l.qkv_proj.clear();
      l.qkv_bias.clear();
    }
  }
  return w;
}

}  // namespace kvrelay::model
