#include "kv/hf_config.h"

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

std::vector<int32_t> Range(int32_t n) {
  std::vector<int32_t> ids(n);
  for (int32_t i = 0; i < n; ++i) ids[i] = i;
  return ids;
}

// Attention fields shared by the llama family.
absl::Status ReadLlamaLike(const ConfigReader& r, ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("hidden_size"));
  KV_ASSIGN_OR_RETURN(c.num_hidden_layers, r.PositiveInt("num_hidden_layers"));
  KV_ASSIGN_OR_RETURN(c.num_attention_heads, r.PositiveInt("num_attention_heads"));
  KV_ASSIGN_OR_RETURN(c.num_key_value_heads,
                      r.PositiveIntOr("num_key_value_heads", c.num_attention_heads));
  if (r.Has("head_dim")) {
    KV_ASSIGN_OR_RETURN(c.head_dim, r.PositiveInt("head_dim"));
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: head_dim is missing and hidden_size ", c.hidden_size,
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
  KV_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.BoolOr("tie_word_embeddings", false));
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
      return absl::InvalidArgumentError(absl::StrCat(
          "config: layer_types[", i, "] must be sliding_attention or full_attention, got ",
          t.dump()));
    }
  }
  return sliding;
}

absl::StatusOr<std::vector<LayerGroup>> ParseGpt2(const ConfigReader& r, ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(c.hidden_size, r.PositiveInt("n_embd"));
  KV_ASSIGN_OR_RETURN(c.num_hidden_layers, r.PositiveInt("n_layer"));
  KV_ASSIGN_OR_RETURN(c.num_attention_heads, r.PositiveInt("n_head"));
  if (c.hidden_size % c.num_attention_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config: n_embd ", c.hidden_size,
                                                   " is not divisible by n_head ",
                                                   c.num_attention_heads));
  }
  c.num_key_value_heads = c.num_attention_heads;
  c.head_dim = c.hidden_size / c.num_attention_heads;
  KV_ASSIGN_OR_RETURN(c.vocab_size, r.PositiveIntOr("vocab_size", 0));
  KV_ASSIGN_OR_RETURN(c.max_position_embeddings, r.PositiveIntOr("n_positions", 0));
  KV_ASSIGN_OR_RETURN(c.intermediate_size, r.PositiveIntOr("n_inner", 4 * c.hidden_size));
  return std::vector<LayerGroup>{
      AttentionGroup(LayerKind::kFullAttention, Range(c.num_hidden_layers), c, 0)};
}

absl::StatusOr<std::vector<LayerGroup>> ParseLlama(const ConfigReader& r, ModelConfig& c) {
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c));
  return std::vector<LayerGroup>{
      AttentionGroup(LayerKind::kFullAttention, Range(c.num_hidden_layers), c, 0)};
}

absl::StatusOr<std::vector<LayerGroup>> ParseMistral(const ConfigReader& r, ModelConfig& c) {
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c));
  KV_ASSIGN_OR_RETURN(c.sliding_window, r.PositiveIntOr("sliding_window", 0));
  return SplitByWindow(c, std::vector<bool>(c.num_hidden_layers, c.sliding_window > 0));
}

absl::StatusOr<std::vector<LayerGroup>> ParseQwen2(const ConfigReader& r, ModelConfig& c) {
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c));
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
  c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  LayerGroup g;
  g.kind = LayerKind::kMlaLatent;
  g.layer_ids = Range(c.num_hidden_layers);
  g.latent_dim = c.kv_lora_rank;
  g.rope_dim = c.qk_rope_head_dim;
  return std::vector<LayerGroup>{g};
}

absl::StatusOr<std::vector<LayerGroup>> ParseGemma3(const ConfigReader& r, ModelConfig& c) {
  KV_RETURN_IF_ERROR(ReadLlamaLike(r, c));
  KV_ASSIGN_OR_RETURN(c.sliding_window, r.PositiveInt("sliding_window"));
  KV_ASSIGN_OR_RETURN(c.rope_local_theta, r.PositiveDoubleOr("rope_local_base_freq", 10000.0));
  KV_ASSIGN_OR_RETURN(c.query_pre_attn_scalar,
                      r.PositiveDoubleOr("query_pre_attn_scalar", c.head_dim));
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
  LayerGroup g;
  g.kind = LayerKind::kSsmState;
  g.layer_ids = Range(c.num_hidden_layers);
  // Per layer: the convolution window [intermediate, conv_kernel] and the SSM state
  // [intermediate, state_size], as transformers' MambaCache holds them.
  g.state_bytes = int64_t{c.intermediate_size} * (c.conv_kernel + c.ssm_state_size) *
                  DTypeBytes(c.dtype);
  return std::vector<LayerGroup>{g};
}

}  // namespace

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
      return absl::InvalidArgumentError(absl::StrCat("config: torch_dtype: ", dtype.status().message()));
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
    return absl::InvalidArgumentError(absl::StrCat(
        "config: unsupported model_type '", t,
        "' (supported: gpt2, llama, mistral, qwen2, deepseek_v2, deepseek_v3, gemma3, "
        "gemma3_text, mamba)"));
  }
  if (!groups.ok()) return groups.status();

  std::string model_id = options.model_id;
  if (model_id.empty()) {
    std::array<uint8_t, 32> digest = internal::Sha256(json_text);
    model_id = absl::StrCat(
        t, "-", absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(digest.data()), 4)));
  }
  KV_ASSIGN_OR_RETURN(c.layout, ModelLayout::Create(std::move(model_id), c.dtype,
                                                    options.block_tokens, *std::move(groups)));
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
