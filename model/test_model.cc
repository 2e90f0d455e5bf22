#include "model/test_model.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "kv/presets.h"
#include "model/weights.h"

namespace kvrelay::model {
namespace {

using Json = nlohmann::json;

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

// Uniform values with the given standard deviation (half-width sqrt(3) * std).
void FillUniform(std::vector<float>& out, uint64_t seed, const std::string& name, float mean,
                 float stddev) {
  uint64_t state = seed ^ Fnv1a(name);
  const float half_width = std::sqrt(3.0f) * stddev;
  for (float& v : out) {
    const double u = static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-53;  // [0, 1)
    v = mean + static_cast<float>((2.0 * u - 1.0)) * half_width;
  }
}

std::string TorchDType(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::kBf16:
      return "bfloat16";
    case TensorDType::kFp16:
      return "float16";
    case TensorDType::kFp32:
      return "float32";
  }
  return "bfloat16";
}

}  // namespace

absl::StatusOr<std::string> TestModelPreset(const std::string& arch) {
  if (arch == "llama") return std::string("tiny-llama");
  if (arch == "deepseek_v3") return std::string("tiny-deepseek-v3");
  if (arch == "gemma3") return std::string("tiny-gemma3");
  if (arch == "gpt2") return std::string("tiny-gpt2");
  if (arch == "mamba") return std::string("tiny-mamba");
  return absl::InvalidArgumentError(
      absl::StrCat("--arch must be llama, deepseek_v3, gemma3, gpt2 or mamba, got '", arch, "'"));
}

absl::StatusOr<std::string> TestModelConfigJson(const TestModelOptions& o) {
  KV_ASSIGN_OR_RETURN(std::string preset, TestModelPreset(o.arch));
  KV_ASSIGN_OR_RETURN(std::string text, kv::PresetConfigJson(preset));
  const bool overridden = o.layers || o.hidden || o.intermediate || o.heads || o.kv_heads ||
                          o.vocab || o.sliding_window || o.dtype != TensorDType::kBf16 ||
                          !o.config_patch.empty();
  if (!overridden) return text;
  Json config = Json::parse(text, nullptr, false);
  if (config.is_discarded()) return absl::InternalError("preset is not JSON");
  for (int32_t v :
       {o.layers, o.hidden, o.intermediate, o.heads, o.kv_heads, o.vocab, o.sliding_window}) {
    if (v < 0) return absl::InvalidArgumentError("model sizes must be positive");
  }
  const bool gpt2 = o.arch == "gpt2";
  if (o.arch == "mamba" && (o.heads || o.kv_heads || o.sliding_window)) {
    return absl::InvalidArgumentError(
        "--heads/--kv-heads/--sliding-window: mamba has no attention");
  }
  if (o.layers) config[gpt2 ? "n_layer" : "num_hidden_layers"] = o.layers;
  if (o.hidden) config[gpt2 ? "n_embd" : "hidden_size"] = o.hidden;
  if (o.intermediate) config[gpt2 ? "n_inner" : "intermediate_size"] = o.intermediate;
  if (o.heads) config[gpt2 ? "n_head" : "num_attention_heads"] = o.heads;
  if (o.vocab) config["vocab_size"] = o.vocab;
  if (gpt2) {
    if (o.kv_heads) return absl::InvalidArgumentError("--kv-heads: gpt2 is multi-head attention");
    const int32_t hidden = config["n_embd"].get<int32_t>();
    const int32_t heads = config["n_head"].get<int32_t>();
    if (hidden % heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--hidden ", hidden, " is not divisible by --heads ", heads));
    }
  } else if (o.arch == "mamba") {
    // sizes set above
  } else if (o.arch != "deepseek_v3") {
    if (o.kv_heads) config["num_key_value_heads"] = o.kv_heads;
    if (o.hidden || o.heads) {
      const int32_t hidden = config["hidden_size"].get<int32_t>();
      const int32_t heads = config["num_attention_heads"].get<int32_t>();
      if (hidden % heads != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--hidden ", hidden, " is not divisible by --heads ", heads));
      }
      config["head_dim"] = hidden / heads;
      // Keep query_pre_attn_scalar != head_dim (as Gemma 3 27B: 168 vs 128), so a runner
      // that scales by head_dim gives other tokens.
      if (o.arch == "gemma3") config["query_pre_attn_scalar"] = hidden / heads * 3 / 4;
    }
  } else {
    if (o.heads) config["num_key_value_heads"] = o.heads;
    // Every layer dense, as the preset: MoE layers are not implemented.
    if (o.layers) config["first_k_dense_replace"] = o.layers;
  }
  if (o.sliding_window) {
    if (o.arch != "gemma3") {
      return absl::InvalidArgumentError("--sliding-window applies to --arch gemma3 only");
    }
    config["sliding_window"] = o.sliding_window;
  }
  config["torch_dtype"] = TorchDType(o.dtype);
  if (!o.config_patch.empty()) {
    Json patch = Json::parse(o.config_patch, nullptr, false);
    if (patch.is_discarded() || !patch.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config patch must be a JSON object, got: ", o.config_patch));
    }
    config.merge_patch(patch);
  }
  return config.dump(2);
}

absl::StatusOr<std::vector<TensorToWrite>> TestModelTensors(const TestModelOptions& o) {
  KV_ASSIGN_OR_RETURN(std::string text, TestModelConfigJson(o));
  KV_ASSIGN_OR_RETURN(kv::ModelConfig config, kv::ParseHfConfig(text));
  ModelWeights scratch;
  KV_ASSIGN_OR_RETURN(std::vector<TensorSpec> specs, TensorSpecs(config, &scratch));
  std::vector<TensorToWrite> tensors;
  tensors.reserve(specs.size());
  // Tied embeddings: the residual stream starts at rms 0.02 (GPT-2's own init std; Gemma
  // multiplies by sqrt(hidden), undone here) so the layers, not the input token, decide the
  // logits; the final norm scales logits back to a std of about 3.
  float embed_std_tied = 0.02f;
  float final_norm_tied =
      3.0f / (embed_std_tied * std::sqrt(static_cast<float>(config.hidden_size)));
  if (config.model_type == "gemma3" || config.model_type == "gemma3_text") {
    embed_std_tied /= std::sqrt(static_cast<float>(config.hidden_size));
    final_norm_tied *= std::sqrt(static_cast<float>(config.hidden_size));
  }
  for (const TensorSpec& spec : specs) {
    TensorToWrite t;
    t.name = spec.name;
    t.dtype = o.dtype;
    t.shape = spec.shape;
    int64_t n = 1;
    for (int64_t d : spec.shape) n *= d;
    t.values.resize(static_cast<size_t>(n));
    switch (spec.init) {
      case TensorInit::kEmbedding:
        // Tied embeddings double as the LM head: at std 1 (Gemma: times sqrt(hidden)) the
        // residual stream stays the last token's embedding and every generation repeats that
        // token by a wide margin, whatever the layers compute. Small embeddings let the layers
        // decide, so logits compete and a wrong window, RoPE or scale changes tokens.
        FillUniform(t.values, o.seed, t.name, 0.0f,
                    config.tie_word_embeddings ? embed_std_tied : 1.0f);
        break;
      case TensorInit::kNorm: {
        // Gemma stores w and scales by (1 + w); the others scale by w. With tied embeddings
        // the final norm carries the logit scale the small embeddings lack.
        float mean = 1.0f;
        if (config.tie_word_embeddings &&
            (t.name == "model.norm.weight" || t.name == "transformer.ln_f.weight" ||
             t.name == "backbone.norm_f.weight")) {
          mean = final_norm_tied;
        }
        FillUniform(t.values, o.seed, t.name, spec.gemma_norm ? mean - 1.0f : mean, 0.05f * mean);
        break;
      }
      case TensorInit::kBias:
        FillUniform(t.values, o.seed, t.name, 0.0f, 0.05f);
        break;
      case TensorInit::kOnes:
        FillUniform(t.values, o.seed, t.name, 1.0f, 0.05f);
        break;
      case TensorInit::kALog: {
        // Mamba's S4D-real init: A[c, n] = n + 1, stored as log, jittered.
        FillUniform(t.values, o.seed, t.name, 0.0f, 0.05f);
        const int64_t n = spec.shape[1];
        for (int64_t i = 0; i < static_cast<int64_t>(t.values.size()); ++i) {
          t.values[i] += std::log(static_cast<float>(i % n + 1));
        }
        break;
      }
      case TensorInit::kDtBias: {
        // Mamba's dt init: softplus(bias) log-uniform in [0.001, 0.1].
        FillUniform(t.values, o.seed, t.name, 0.5f, 0.25f);
        for (float& v : t.values) {
          const double dt = std::exp(std::log(0.001) +
                                     std::clamp(v, 0.0f, 1.0f) * (std::log(0.1) - std::log(0.001)));
          v = static_cast<float>(dt + std::log(-std::expm1(-dt)));
        }
        break;
      }
      case TensorInit::kLinear:
        FillUniform(t.values, o.seed, t.name, 0.0f,
                    1.0f / std::sqrt(static_cast<float>(spec.fan_in())));
        break;
    }
    tensors.push_back(std::move(t));
  }
  return tensors;
}

absl::Status WriteTestModel(const std::string& dir, const TestModelOptions& options) {
  KV_ASSIGN_OR_RETURN(std::string config, TestModelConfigJson(options));
  KV_ASSIGN_OR_RETURN(std::vector<TensorToWrite> tensors, TestModelTensors(options));
  KV_RETURN_IF_ERROR(MakeDirectories(dir));
  KV_RETURN_IF_ERROR(WriteSafetensorsModel(dir, tensors, options.shards));
  return WriteFileAtomically(dir + "/config.json", config);
}

}  // namespace kvrelay::model
