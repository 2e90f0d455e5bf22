#include "kv/hf_config.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "kv/digest.h"

namespace kvrelay::kv {
namespace {

using Json = nlohmann::json;

// Field access that never throws and names the field in every error.
class ConfigReader {
 public:
  explicit ConfigReader(const Json& object) : object_(object) {}

  bool Has(const char* field) const {
    auto it = object_.find(field);
    return it != object_.end() && !it->is_null();
  }

  absl::StatusOr<int32_t> PositiveInt(const char* field) const {
    auto it = object_.find(field);
    if (it == object_.end() || it->is_null()) {
      return absl::InvalidArgumentError(absl::StrCat("config: ", field, " is missing"));
    }
    return ToPositive(field, *it);
  }

  absl::StatusOr<int32_t> PositiveIntOr(const char* field, int32_t fallback) const {
    if (!Has(field)) return fallback;
    return PositiveInt(field);
  }

  // Non-negative, for fields where 0 means "off".
  absl::StatusOr<int32_t> NonNegativeIntOr(const char* field, int32_t fallback) const {
    if (!Has(field)) return fallback;
    const Json& v = object_.at(field);
    if (!v.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be an integer, got ", v.dump()));
    }
    const int64_t value = v.get<int64_t>();
    if (value < 0 || value > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be >= 0, got ", value));
    }
    return static_cast<int32_t>(value);
  }

  absl::StatusOr<double> PositiveDoubleOr(const char* field, double fallback) const {
    if (!Has(field)) return fallback;
    const Json& v = object_.at(field);
    if (!v.is_number()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be a number, got ", v.dump()));
    }
    const double value = v.get<double>();
    if (!(value > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be positive, got ", v.dump()));
    }
    return value;
  }

  absl::StatusOr<bool> BoolOr(const char* field, bool fallback) const {
    if (!Has(field)) return fallback;
    const Json& v = object_.at(field);
    if (!v.is_boolean()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be true or false, got ", v.dump()));
    }
    return v.get<bool>();
  }

  absl::StatusOr<std::string> StringOr(const char* field, std::string fallback) const {
    if (!Has(field)) return fallback;
    const Json& v = object_.at(field);
    if (!v.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be a string, got ", v.dump()));
    }
    return v.get<std::string>();
  }

  const Json& object() const { return object_; }

 private:
  static absl::StatusOr<int32_t> ToPositive(const char* field, const Json& v) {
    if (!v.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be an integer, got ", v.dump()));
    }
    const int64_t value = v.get<int64_t>();
    if (value <= 0 || value > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: ", field, " must be positive, got ", value));
    }
    return static_cast<int32_t>(value);
  }

  const Json& object_;
};

// Records a field whose value changes the computation in a way the runner does not implement.
void Unsupported(ModelConfig& c, const std::string& field, const Json& value) {
  c.unsupported.push_back(absl::StrCat(field, " = ", value.dump()));
}

// Any non-negative number (factors may be written as ints).
absl::StatusOr<double> NumberField(const Json& object, const char* owner, const char* field,
                                   double fallback) {
  auto it = object.find(field);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", owner, ".", field, " must be a number, got ", it->dump()));
  }
  const double v = it->get<double>();
  if (!(v >= 0) || !std::isfinite(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: ", owner, ".", field, " must be >= 0, got ", it->dump()));
  }
  return v;
}

// rope_scaling as transformers reads it (rope_type, or the older "type"). Types the runner does
// not implement are recorded in c.unsupported; malformed values are errors.
absl::Status ReadRopeScaling(const ConfigReader& r, ModelConfig& c) {
  if (r.Has("rope_parameters")) {
    // transformers v5 spelling (may be per layer type); not read here.
    Unsupported(c, "rope_parameters", r.object().at("rope_parameters"));
  }
  if (!r.Has("rope_scaling")) return absl::OkStatus();
  const Json& rs = r.object().at("rope_scaling");
  if (!rs.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: rope_scaling must be an object or null, got ", rs.dump()));
  }
  RopeScaling& s = c.rope_scaling;
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    auto it = rs.find(key);
    if (type.empty() && it != rs.end() && !it->is_null()) {
      if (!it->is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: rope_scaling.", key, " must be a string, got ", it->dump()));
      }
      type = it->get<std::string>();
    }
  }
  if (type.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: rope_scaling has no rope_type: ", rs.dump()));
  }
  s.type = type;
  if (type == "default") return absl::OkStatus();
  if (type != "linear" && type != "dynamic" && type != "llama3" && type != "yarn") {
    Unsupported(c, "rope_scaling.rope_type", Json(type));
    return absl::OkStatus();
  }
  if (!rs.contains("factor") || rs.at("factor").is_null()) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: rope_scaling (", type, ") needs factor"));
  }
  KV_ASSIGN_OR_RETURN(s.factor, NumberField(rs, "rope_scaling", "factor", 1.0));
  if (!(s.factor > 0)) {
    return absl::InvalidArgumentError("config: rope_scaling.factor must be positive");
  }
  KV_ASSIGN_OR_RETURN(double original,
                      NumberField(rs, "rope_scaling", "original_max_position_embeddings", 0));
  s.original_max_position_embeddings = static_cast<int32_t>(original);
  if (type == "llama3") {
    for (const char* key :
         {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
      if (!rs.contains(key) || rs.at(key).is_null()) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: rope_scaling (llama3) needs ", key));
      }
    }
    KV_ASSIGN_OR_RETURN(s.low_freq_factor, NumberField(rs, "rope_scaling", "low_freq_factor", 0));
    KV_ASSIGN_OR_RETURN(s.high_freq_factor, NumberField(rs, "rope_scaling", "high_freq_factor", 0));
    if (!(s.high_freq_factor > s.low_freq_factor) || !(s.low_freq_factor > 0) ||
        s.original_max_position_embeddings <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: rope_scaling (llama3) needs 0 < low_freq_factor < high_freq_factor and "
          "original_max_position_embeddings > 0, got ",
          rs.dump()));
    }
  }
  if (type == "dynamic" && s.original_max_position_embeddings > 0) {
    // transformers versions disagree on whether this moves the NTK threshold.
    Unsupported(c, "rope_scaling.original_max_position_embeddings (dynamic)",
                rs.at("original_max_position_embeddings"));
  }
  if (type == "yarn") {
    auto it = rs.find("attention_factor");
    if (it != rs.end() && !it->is_null()) {
      KV_ASSIGN_OR_RETURN(double af, NumberField(rs, "rope_scaling", "attention_factor", 0));
      s.attention_factor = af;
    }
    // transformers: `get("beta_fast") or 32` - a 0 also means the default.
    KV_ASSIGN_OR_RETURN(s.beta_fast, NumberField(rs, "rope_scaling", "beta_fast", 32.0));
    KV_ASSIGN_OR_RETURN(s.beta_slow, NumberField(rs, "rope_scaling", "beta_slow", 1.0));
    if (s.beta_fast == 0) s.beta_fast = 32.0;
    if (s.beta_slow == 0) s.beta_slow = 1.0;
    KV_ASSIGN_OR_RETURN(s.mscale, NumberField(rs, "rope_scaling", "mscale", 0.0));
    KV_ASSIGN_OR_RETURN(s.mscale_all_dim, NumberField(rs, "rope_scaling", "mscale_all_dim", 0.0));
    auto t = rs.find("truncate");
    if (t != rs.end() && !t->is_null()) {
      if (!t->is_boolean()) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: rope_scaling.truncate must be true or false, got ", t->dump()));
      }
      s.truncate = t->get<bool>();
    }
  }
  return absl::OkStatus();
}

// hidden_act (or gemma's hidden_activation): the activations the runner implements.
absl::Status ReadActivation(const ConfigReader& r, const char* field, const char* fallback,
                            ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(c.hidden_act, r.StringOr(field, fallback));
  if (c.hidden_act != "silu" && c.hidden_act != "swish" && c.hidden_act != "gelu_pytorch_tanh" &&
      c.hidden_act != "gelu_new" && c.hidden_act != "gelu" && c.hidden_act != "gelu_fast") {
    Unsupported(c, field, Json(c.hidden_act));
  }
  return absl::OkStatus();
}

// Boolean fields whose non-default value the runner does not implement for this family.
absl::Status RefuseIfSet(const ConfigReader& r, const char* field, bool default_value,
                         ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(bool v, r.BoolOr(field, default_value));
  if (v != default_value) Unsupported(c, field, Json(v));
  return absl::OkStatus();
}

absl::Status RefusePartialRotary(const ConfigReader& r, ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(double f, r.PositiveDoubleOr("partial_rotary_factor", 1.0));
  if (f != 1.0) Unsupported(c, "partial_rotary_factor", Json(f));
  return absl::OkStatus();
}

std::vector<int32_t> Range(int32_t n) {
  std::vector<int32_t> ids(n);
  for (int32_t i = 0; i < n; ++i) ids[i] = i;
  return ids;
}

// Attention fields shared by the llama family. tie_default: transformers' default for
// tie_word_embeddings in this family.
absl::Status ReadLlamaLike(const ConfigReader& r, ModelConfig& c, bool tie_default = false) {
  KV_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("hidden_size"));
  KV_ASSIGN_OR_RETURN(c.num_hidden_layers, r.PositiveInt("num_hidden_layers"));
  KV_ASSIGN_OR_RETURN(c.num_attention_heads, r.PositiveInt("num_attention_heads"));
  KV_ASSIGN_OR_RETURN(c.num_key_value_heads,
                      r.PositiveIntOr("num_key_value_heads", c.num_attention_heads));
  if (r.Has("head_dim")) {
    KV_ASSIGN_OR_RETURN(c.head_dim, r.PositiveInt("head_dim"));
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: head_dim is missing and hidden_size ", c.hidden_size,
                       " is not divisible by num_attention_heads ", c.num_attention_heads));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config: num_attention_heads ", c.num_attention_heads,
                     " is not a multiple of num_key_value_heads ", c.num_key_value_heads));
  }
  KV_ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveIntOr("intermediate_size", 0));
  KV_ASSIGN_OR_RETURN(c.vocab_size, r.PositiveIntOr("vocab_size", 0));
  KV_ASSIGN_OR_RETURN(c.max_position_embeddings, r.PositiveIntOr("max_position_embeddings", 0));
  KV_ASSIGN_OR_RETURN(c.rms_norm_eps, r.PositiveDoubleOr("rms_norm_eps", 1e-6));
  KV_ASSIGN_OR_RETURN(c.rope_theta, r.PositiveDoubleOr("rope_theta", 10000.0));
  KV_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", tie_default));
  KV_ASSIGN_OR_RETURN(c.attention_bias, r.BoolOr("attention_bias", false));
  KV_RETURN_IF_ERROR(ReadRopeScaling(r, c));
  KV_RETURN_IF_ERROR(RefusePartialRotary(r, c));
  return absl::OkStatus();
}

LayerGroup AttentionGroup(LayerKind kind, std::vector<int32_t> ids, const ModelConfig& c,
                          int32_t window) {
  LayerGroup g;
  g.kind = kind;
  g.layer_ids = std::move(ids);
  g.num_kv_heads = c.num_key_value_heads;
  g.head_dim = c.head_dim;
  g.window_tokens = kind == LayerKind::kSlidingWindow ? window : 0;
  return g;
}

// Splits layers into a full-attention group and a sliding-window group (either may be empty).
std::vector<LayerGroup> SplitByWindow(const ModelConfig& c, const std::vector<bool>& is_sliding) {
  std::vector<int32_t> full, local;
  for (int32_t i = 0; i < c.num_hidden_layers; ++i) (is_sliding[i] ? local : full).push_back(i);
  std::vector<LayerGroup> groups;
  if (!full.empty()) groups.push_back(AttentionGroup(LayerKind::kFullAttention, full, c, 0));
  if (!local.empty()) {
    groups.push_back(AttentionGroup(LayerKind::kSlidingWindow, local, c, c.sliding_window));
  }
  return groups;
}

// Reads an explicit layer_types list ("sliding_attention" / "full_attention").
absl::StatusOr<std::vector<bool>> ReadLayerTypes(const ConfigReader& r, int32_t num_layers) {
  const Json& types = r.object().at("layer_types");
  if (!types.is_array() || static_cast<int64_t>(types.size()) != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: layer_types must be a list of num_hidden_layers (", num_layers, ") strings"));
  }
  std::vector<bool> sliding(num_layers);
  for (int32_t i = 0; i < num_layers; ++i) {
    const Json& t = types[i];
    if (t.is_string() && t.get<std::string>() == "sliding_attention") {
      sliding[i] = true;
    } else if (t.is_string() && t.get<std::string>() == "full_attention") {
      sliding[i] = false;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("config: layer_types[", i,
                       "] must be sliding_attention or full_attention, got ", t.dump()));
    }
  }
  return sliding;
}

absl::StatusOr<std::vector<LayerGroup>> ParseGpt2(const ConfigReader& r, ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("n_embd"));
  KV_ASSIGN_OR_RETURN(c.num_hidden_layers, r.PositiveInt("n_layer"));
  KV_ASSIGN_OR_RETURN(c.num_attention_heads, r.PositiveInt("n_head"));
  if (c.hidden_size % c.num_attention_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: n_embd ", c.hidden_size, " is not divisible by n_head ", c.num_attention_heads));
  }
  c.num_key_value_heads = c.num_attention_heads;
  c.head_dim = c.hidden_size / c.num_attention_heads;
  KV_ASSIGN_OR_RETURN(c.vocab_size, r.PositiveIntOr("vocab_size", 0));
  KV_ASSIGN_OR_RETURN(c.max_position_embeddings, r.PositiveIntOr("n_positions", 0));
  KV_ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveIntOr("n_inner", 4 * c.hidden_size));
  KV_ASSIGN_OR_RETURN(c.layer_norm_epsilon, r.PositiveDoubleOr("layer_norm_epsilon", 1e-5));
  KV_ASSIGN_OR_RETURN(c.scale_attn_weights, r.BoolOr("scale_attn_weights", true));
  KV_ASSIGN_OR_RETURN(c.scale_attn_by_inverse_layer_idx,
                      r.BoolOr("scale_attn_by_inverse_layer_idx", false));
  // GPT2LMHeadModel always ties lm_head to wte.
  c.tie_word_embeddings = true;
  KV_RETURN_IF_ERROR(ReadActivation(r, "activation_function", "gelu_new", c));
  KV_RETURN_IF_ERROR(RefuseIfSet(r, "add_cross_attention", false, c));
  return std::vector<LayerGroup>{
      AttentionGroup(LayerKind::kFullAttention, Range(c.num_hidden_layers), c, 0)};
}

absl::StatusOr<std::vector<LayerGroup>> ParseLlama(const ConfigReader& r, ModelConfig& c) {
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c));
  KV_RETURN_IF_ERROR(ReadActivation(r, "hidden_act", "silu", c));
  KV_ASSIGN_OR_RETURN(c.mlp_bias, r.BoolOr("mlp_bias", false));
  return std::vector<LayerGroup>{
      AttentionGroup(LayerKind::kFullAttention, Range(c.num_hidden_layers), c, 0)};
}

absl::StatusOr<std::vector<LayerGroup>> ParseMistral(const ConfigReader& r, ModelConfig& c) {
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c));
  c.attention_bias = false;  // MistralAttention has no biases whatever the config says
  KV_RETURN_IF_ERROR(ReadActivation(r, "hidden_act", "silu", c));
  KV_ASSIGN_OR_RETURN(c.sliding_window, r.PositiveIntOr("sliding_window", 0));
  return SplitByWindow(c, std::vector<bool>(c.num_hidden_layers, c.sliding_window > 0));
}

absl::StatusOr<std::vector<LayerGroup>> ParseQwen2(const ConfigReader& r, ModelConfig& c) {
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c));
  KV_RETURN_IF_ERROR(ReadActivation(r, "hidden_act", "silu", c));
  KV_ASSIGN_OR_RETURN(bool use_window, r.BoolOr("use_sliding_window", false));
  std::vector<bool> sliding(c.num_hidden_layers, false);
  if (use_window) {
    KV_ASSIGN_OR_RETURN(c.sliding_window, r.PositiveInt("sliding_window"));
    if (r.Has("layer_types")) {
      KV_ASSIGN_OR_RETURN(sliding, ReadLayerTypes(r, c.num_hidden_layers));
    } else {
      // Layers below max_window_layers keep full attention (transformers' Qwen2Config).
      KV_ASSIGN_OR_RETURN(int32_t max_window_layers, r.NonNegativeIntOr("max_window_layers", 0));
      for (int32_t i = max_window_layers; i < c.num_hidden_layers; ++i) sliding[i] = true;
    }
  }
  return SplitByWindow(c, sliding);
}

absl::StatusOr<std::vector<LayerGroup>> ParseDeepSeek(const ConfigReader& r, ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("hidden_size"));
  KV_ASSIGN_OR_RETURN(c.num_hidden_layers, r.PositiveInt("num_hidden_layers"));
  KV_ASSIGN_OR_RETURN(c.num_attention_heads, r.PositiveInt("num_attention_heads"));
  // MLA caches a latent, not per-head K/V: num_key_value_heads does not size the cache.
  c.num_key_value_heads = 0;
  KV_ASSIGN_OR_RETURN(c.kv_lora_rank, r.PositiveInt("kv_lora_rank"));
  KV_ASSIGN_OR_RETURN(c.qk_rope_head_dim, r.PositiveInt("qk_rope_head_dim"));
  KV_ASSIGN_OR_RETURN(c.qk_nope_head_dim, r.PositiveInt("qk_nope_head_dim"));
  KV_ASSIGN_OR_RETURN(c.v_head_dim, r.PositiveInt("v_head_dim"));
  KV_ASSIGN_OR_RETURN(c.q_lora_rank, r.NonNegativeIntOr("q_lora_rank", 0));
  KV_ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveIntOr("intermediate_size", 0));
  KV_ASSIGN_OR_RETURN(c.vocab_size, r.PositiveIntOr("vocab_size", 0));
  KV_ASSIGN_OR_RETURN(c.max_position_embeddings, r.PositiveIntOr("max_position_embeddings", 0));
  KV_ASSIGN_OR_RETURN(c.rms_norm_eps, r.PositiveDoubleOr("rms_norm_eps", 1e-6));
  KV_ASSIGN_OR_RETURN(c.rope_theta, r.PositiveDoubleOr("rope_theta", 10000.0));
  KV_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", false));
  KV_RETURN_IF_ERROR(ReadRopeScaling(r, c));
  KV_RETURN_IF_ERROR(ReadActivation(r, "hidden_act", "silu", c));
  // deepseek_v2 always pairs RoPE dimensions DeepSeek's way; v3 makes it a field (default on).
  KV_ASSIGN_OR_RETURN(c.rope_interleave, r.BoolOr("rope_interleave", true));
  if (c.model_type == "deepseek_v2") c.rope_interleave = true;
  KV_RETURN_IF_ERROR(RefuseIfSet(r, "attention_bias", false, c));
  KV_RETURN_IF_ERROR(RefuseIfSet(r, "mlp_bias", false, c));
  // Mixture of experts, with transformers' defaults (v2: 64 experts from layer 0; v3: 256
  // experts from layer 3). n_routed_experts null means a dense model.
  const bool v3 = c.model_type == "deepseek_v3";
  KV_ASSIGN_OR_RETURN(c.n_routed_experts, r.NonNegativeIntOr("n_routed_experts", v3 ? 256 : 64));
  if (r.object().contains("n_routed_experts") && r.object().at("n_routed_experts").is_null()) {
    c.n_routed_experts = 0;
  }
  KV_ASSIGN_OR_RETURN(c.first_k_dense_replace,
                      r.NonNegativeIntOr("first_k_dense_replace", v3 ? 3 : 0));
  KV_ASSIGN_OR_RETURN(c.moe_layer_freq, r.PositiveIntOr("moe_layer_freq", 1));
  if (c.n_routed_experts > 0 && c.first_k_dense_replace < c.num_hidden_layers) {
    c.unsupported.push_back(absl::StrCat(
        "n_routed_experts = ", c.n_routed_experts, " with first_k_dense_replace = ",
        c.first_k_dense_replace, " (layers ", c.first_k_dense_replace, "..",
        c.num_hidden_layers - 1, " are mixture-of-experts layers, which are not implemented)"));
  }
  c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  LayerGroup g;
  g.kind = LayerKind::kMlaLatent;
  g.layer_ids = Range(c.num_hidden_layers);
  g.latent_dim = c.kv_lora_rank;
  g.rope_dim = c.qk_rope_head_dim;
  return std::vector<LayerGroup>{g};
}

absl::StatusOr<std::vector<LayerGroup>> ParseGemma3(const ConfigReader& r, ModelConfig& c) {
  // Gemma3TextConfig: tied embeddings unless told otherwise, head_dim 256 when missing.
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c, /*tie_default=*/true));
  KV_ASSIGN_OR_RETURN(c.head_dim, r.PositiveIntOr("head_dim", 256));
  KV_ASSIGN_OR_RETURN(c.sliding_window, r.PositiveIntOr("sliding_window", 4096));
  KV_ASSIGN_OR_RETURN(c.rope_local_theta, r.PositiveDoubleOr("rope_local_base_freq", 10000.0));
  // transformers' default is 256, not head_dim.
  KV_ASSIGN_OR_RETURN(c.query_pre_attn_scalar, r.PositiveDoubleOr("query_pre_attn_scalar", 256));
  KV_ASSIGN_OR_RETURN(c.attn_logit_softcapping, r.PositiveDoubleOr("attn_logit_softcapping", 0));
  KV_ASSIGN_OR_RETURN(c.final_logit_softcapping, r.PositiveDoubleOr("final_logit_softcapping", 0));
  KV_RETURN_IF_ERROR(ReadActivation(r, "hidden_activation", "gelu_pytorch_tanh", c));
  KV_RETURN_IF_ERROR(RefuseIfSet(r, "use_bidirectional_attention", false, c));
  std::vector<bool> sliding(c.num_hidden_layers);
  if (r.Has("layer_types")) {
    KV_ASSIGN_OR_RETURN(sliding, ReadLayerTypes(r, c.num_hidden_layers));
  } else {
    // Every Nth layer (1-based) is global; transformers' default N is 6.
    KV_ASSIGN_OR_RETURN(int32_t pattern, r.PositiveIntOr("sliding_window_pattern", 6));
    for (int32_t i = 0; i < c.num_hidden_layers; ++i) sliding[i] = (i + 1) % pattern != 0;
  }
  return SplitByWindow(c, sliding);
}

absl::StatusOr<std::vector<LayerGroup>> ParseMamba(const ConfigReader& r, ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("hidden_size"));
  KV_ASSIGN_OR_RETURN(c.num_hidden_layers, r.PositiveInt("num_hidden_layers"));
  KV_ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveInt("intermediate_size"));
  KV_ASSIGN_OR_RETURN(c.ssm_state_size, r.PositiveInt("state_size"));
  KV_ASSIGN_OR_RETURN(c.conv_kernel, r.PositiveInt("conv_kernel"));
  KV_ASSIGN_OR_RETURN(c.vocab_size, r.PositiveIntOr("vocab_size", 0));
  KV_ASSIGN_OR_RETURN(c.layer_norm_epsilon, r.PositiveDoubleOr("layer_norm_epsilon", 1e-5));
  KV_ASSIGN_OR_RETURN(c.use_conv_bias, r.BoolOr("use_conv_bias", true));
  KV_ASSIGN_OR_RETURN(c.use_bias, r.BoolOr("use_bias", false));
  KV_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", true));
  // time_step_rank: "auto" (transformers' default) = ceil(hidden_size / 16).
  c.time_step_rank = (c.hidden_size + 15) / 16;
  if (r.Has("time_step_rank") && !r.object().at("time_step_rank").is_string()) {
    KV_ASSIGN_OR_RETURN(c.time_step_rank, r.PositiveInt("time_step_rank"));
  } else if (r.Has("time_step_rank") &&
             r.object().at("time_step_rank").get<std::string>() != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("config: time_step_rank must be an integer or "
                     "\"auto\", got ",
                     r.object().at("time_step_rank").dump()));
  }
  KV_ASSIGN_OR_RETURN(c.hidden_act, r.StringOr("hidden_act", "silu"));
  if (c.hidden_act != "silu") Unsupported(c, "hidden_act", Json(c.hidden_act));
  LayerGroup g;
  g.kind = LayerKind::kSsmState;
  g.layer_ids = Range(c.num_hidden_layers);
  // Per layer: the convolution window [intermediate, conv_kernel] and the SSM state
  // [intermediate, state_size], as transformers' MambaCache holds them.
  g.state_bytes =
      int64_t{c.intermediate_size} * (c.conv_kernel + c.ssm_state_size) * DTypeBytes(c.dtype);
  return std::vector<LayerGroup>{g};
}

}  // namespace

absl::Status CheckBlockTokensFlag(int32_t block_tokens) {
  if (block_tokens < 1 || block_tokens > kMaxBlockTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("--block-tokens must be in [1, ", kMaxBlockTokens, "], got ", block_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<DType>> ParseKvDTypeFlag(std::string_view flag,
                                                      std::string_view value) {
  if (value == "auto") return std::nullopt;
  absl::StatusOr<DType> dtype = ParseDType(value);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(flag), ": ", dtype.status().message(), " (or auto)"));
  }
  return *dtype;
}

absl::StatusOr<ModelConfig> ParseHfConfig(std::string_view json_text,
                                          const ConfigOptions& options) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("config: not valid JSON");
  if (!root.is_object()) return absl::InvalidArgumentError("config: top level must be an object");

  ModelConfig c;
  {
    ConfigReader top(root);
    KV_ASSIGN_OR_RETURN(c.model_type, top.StringOr("model_type", ""));
  }
  if (c.model_type.empty()) return absl::InvalidArgumentError("config: model_type is missing");

  // Multimodal gemma3 keeps the language model's fields under text_config.
  const Json* fields = &root;
  if (c.model_type == "gemma3") {
    auto it = root.find("text_config");
    if (it != root.end() && it->is_object()) fields = &*it;
  }
  ConfigReader r(*fields);

  // torch_dtype (or transformers >= 4.56's "dtype"), at the top level or in text_config.
  std::string dtype_name;
  for (const Json* source : std::initializer_list<const Json*>{fields, &root}) {
    ConfigReader s(*source);
    for (const char* key : {"torch_dtype", "dtype"}) {
      if (dtype_name.empty() && s.Has(key)) {
        KV_ASSIGN_OR_RETURN(dtype_name, s.StringOr(key, ""));
      }
    }
  }
  if (options.dtype.has_value()) {
    c.dtype = *options.dtype;
  } else if (!dtype_name.empty()) {
    absl::StatusOr<DType> dtype = ParseDType(dtype_name);
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config: torch_dtype: ", dtype.status().message()));
    }
    c.dtype = *dtype;
  } else {
    c.dtype = DType::kBf16;  // serving default when a config names none
  }

  absl::StatusOr<std::vector<LayerGroup>> groups;
  const std::string& t = c.model_type;
  if (t == "gpt2") {
    groups = ParseGpt2(r, c);
  } else if (t == "llama") {
    groups = ParseLlama(r, c);
  } else if (t == "mistral") {
    groups = ParseMistral(r, c);
  } else if (t == "qwen2") {
    groups = ParseQwen2(r, c);
  } else if (t == "deepseek_v2" || t == "deepseek_v3") {
    groups = ParseDeepSeek(r, c);
  } else if (t == "gemma3" || t == "gemma3_text") {
    groups = ParseGemma3(r, c);
  } else if (t == "mamba") {
    groups = ParseMamba(r, c);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("config: unsupported model_type '", t,
                     "' (supported: gpt2, llama, mistral, qwen2, deepseek_v2, deepseek_v3, gemma3, "
                     "gemma3_text, mamba)"));
  }
  if (!groups.ok()) return groups.status();

  std::string model_id = options.model_id;
  if (model_id.empty()) {
    std::array<uint8_t, 32> digest = internal::Sha256(json_text);
    model_id = absl::StrCat(
        t, "-",
        absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(digest.data()), 4)));
  }
  absl::StatusOr<ModelLayout> layout =
      ModelLayout::Create(std::move(model_id), options.kv_dtype.value_or(c.dtype),
                          options.block_tokens, *std::move(groups));
  if (!layout.ok() && options.kv_dtype.has_value()) {
    return absl::Status(
        layout.status().code(),
        absl::StrCat("config: kv_cache_dtype ", std::string(DTypeName(*options.kv_dtype)),
                     " for model_type '", t, "': ", layout.status().message()));
  }
  KV_RETURN_IF_ERROR(layout.status());
  c.layout = *std::move(layout);
  return c;
}

absl::StatusOr<ModelConfig> LoadHfConfig(const std::string& path, const ConfigOptions& options) {
  KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  absl::StatusOr<ModelConfig> config = ParseHfConfig(text, options);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

}  // namespace kvrelay::kv
