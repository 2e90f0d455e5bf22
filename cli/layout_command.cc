// `kvrelay layout`: the exact KV-cache bytes of a model.

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/command.h"
#include "common/flags.h"
#include "kv/fp8.h"
#include "kv/hf_config.h"
#include "kv/presets.h"

namespace kvrelay::cli {
namespace {

std::string WithCommas(int64_t n) {
  std::string digits = absl::StrCat(n < 0 ? -n : n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return n < 0 ? "-" + out : out;
}

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrFormat("%.0f B", bytes)
                   : absl::StrFormat("%.1f %s", bytes, units[unit]);
}

std::string GroupShape(const kv::LayerGroup& g) {
  switch (g.kind) {
    case kv::LayerKind::kFullAttention:
      return absl::StrCat(g.num_kv_heads, " KV heads x ", g.head_dim);
    case kv::LayerKind::kSlidingWindow:
      return absl::StrCat(g.num_kv_heads, " KV heads x ", g.head_dim, ", window ", g.window_tokens);
    case kv::LayerKind::kMlaLatent:
      return absl::StrCat("latent ", g.latent_dim, " + rope ", g.rope_dim);
    case kv::LayerKind::kSsmState:
      return absl::StrCat(WithCommas(g.state_bytes), " B state per layer");
  }
  return "";
}

// Where an fp8_e4m3 layout keeps its scales (kv/model_layout.h, kv/fp8.h), one phrase per cache
// kind the model has; empty for the other dtypes.
std::string Fp8ScaleLayout(const kv::ModelLayout& layout) {
  if (!layout.IsFp8()) return "";
  bool attention = false, mla = false;
  for (const kv::LayerGroup& g : layout.groups()) {
    attention = attention || g.IsAttention();
    mla = mla || g.kind == kv::LayerKind::kMlaLatent;
  }
  std::vector<std::string> parts;
  if (attention) {
    parts.push_back(
        "float32 power of two per block, layer, K/V and KV head, set by the block's first "
        "token, after the block's E4M3 values in each layer strip");
  }
  if (mla) {
    parts.push_back(absl::StrCat("float32 power of two per token, layer and ", kv::kFp8MlaTile,
                                 " latent values, after the E4M3 latent; rope key bf16"));
  }
  return absl::StrJoin(parts, "; ");
}

nlohmann::json LayoutJson(const kv::ModelConfig& config, int64_t tokens) {
  const kv::ModelLayout& layout = config.layout;
  nlohmann::json groups = nlohmann::json::array();
  for (size_t i = 0; i < layout.groups().size(); ++i) {
    const kv::LayerGroup& g = layout.groups()[i];
    const int gi = static_cast<int>(i);
    nlohmann::json j = {{"kind", std::string(kv::LayerKindName(g.kind))},
                        {"layers", g.num_layers()},
                        {"layer_ids", g.layer_ids},
                        {"bytes_per_token", layout.GroupBytesPerToken(gi)},
                        {"block_bytes", layout.BlockBytes(gi)},
                        {"bytes_for_tokens", layout.GroupBytesForTokens(gi, tokens)},
                        {"blocks_needed", layout.BlocksNeeded(gi, tokens)}};
    if (g.IsAttention()) {
      j["num_kv_heads"] = g.num_kv_heads;
      j["head_dim"] = g.head_dim;
    }
    if (g.kind == kv::LayerKind::kSlidingWindow) j["window_tokens"] = g.window_tokens;
    if (g.kind == kv::LayerKind::kMlaLatent) {
      j["latent_dim"] = g.latent_dim;
      j["rope_dim"] = g.rope_dim;
    }
    if (g.kind == kv::LayerKind::kMlaLatent) j["entry_bytes"] = layout.MlaEntryBytes(gi);
    if (g.kind == kv::LayerKind::kSsmState) j["state_bytes"] = g.state_bytes;
    groups.push_back(std::move(j));
  }
  nlohmann::json out = {
      {"model", layout.model_id()},
      // "dtype" is the KV dtype too (what it always was: the layout's), kept for older readers.
      {"dtype", std::string(kv::DTypeName(layout.dtype()))},
      {"kv_dtype", std::string(kv::DTypeName(layout.dtype()))},
      {"model_dtype", std::string(kv::DTypeName(config.dtype))},
      {"block_tokens", layout.block_tokens()},
      {"layers", layout.num_layers()},
      {"tokens", tokens},
      {"bytes_per_token", layout.BytesPerToken()},
      {"bytes_for_tokens", layout.BytesForTokens(tokens)},
      {"fingerprint", layout.fingerprint().ToHex()},
      {"groups", std::move(groups)}};
  if (layout.IsFp8()) out["kv_scales"] = Fp8ScaleLayout(layout);
  return out;
}

void PrintLayoutTable(const kv::ModelConfig& config, int64_t tokens) {
  const kv::ModelLayout& layout = config.layout;
  std::printf("model %s  KV dtype %s (model %s)  block %d tokens  %d layers\n",
              layout.model_id().c_str(), std::string(kv::DTypeName(layout.dtype())).c_str(),
              std::string(kv::DTypeName(config.dtype)).c_str(), layout.block_tokens(),
              layout.num_layers());
  std::printf("%-16s %6s  %-34s %14s %14s %16s\n", "group", "layers", "shape", "bytes/token",
              "bytes/block", absl::StrCat("bytes@", tokens).c_str());
  for (size_t i = 0; i < layout.groups().size(); ++i) {
    const kv::LayerGroup& g = layout.groups()[i];
    const int gi = static_cast<int>(i);
    std::printf("%-16s %6d  %-34s %14s %14s %16s\n", std::string(kv::LayerKindName(g.kind)).c_str(),
                g.num_layers(), GroupShape(g).c_str(),
                WithCommas(layout.GroupBytesPerToken(gi)).c_str(),
                WithCommas(layout.BlockBytes(gi)).c_str(),
                WithCommas(layout.GroupBytesForTokens(gi, tokens)).c_str());
  }
  std::printf("%-16s %6d  %-34s %14s %14s %16s\n", "total", layout.num_layers(), "",
              WithCommas(layout.BytesPerToken()).c_str(), "",
              WithCommas(layout.BytesForTokens(tokens)).c_str());
  std::printf("per token: %s; one sequence of %s tokens: %s\n",
              HumanBytes(static_cast<double>(layout.BytesPerToken())).c_str(),
              WithCommas(tokens).c_str(),
              HumanBytes(static_cast<double>(layout.BytesForTokens(tokens))).c_str());
  if (layout.IsFp8()) std::printf("fp8 scales: %s\n", Fp8ScaleLayout(layout).c_str());
}

// A preset with the given KV dtype (nullopt: the config's own), or a one-line error on stderr.
std::optional<kv::ModelConfig> SeedPreset(const char* name, std::optional<kv::DType> kv_dtype) {
  kv::ConfigOptions options;
  options.kv_dtype = kv_dtype;
  absl::StatusOr<kv::ModelConfig> c = kv::LoadPreset(name, options);
  if (!c.ok()) {
    std::fprintf(stderr, "kvrelay layout: %s\n", std::string(c.status().message()).c_str());
    return std::nullopt;
  }
  return *std::move(c);
}

// Gemma 3 27B with every layer global: one full-attention group over all layers.
absl::StatusOr<kv::ModelLayout> AllGlobal(const kv::ModelLayout& swa) {
  kv::LayerGroup all_global = swa.groups()[0];
  all_global.kind = kv::LayerKind::kFullAttention;
  all_global.window_tokens = 0;
  all_global.layer_ids.clear();
  for (int32_t i = 0; i < swa.num_layers(); ++i) all_global.layer_ids.push_back(i);
  return kv::ModelLayout::Create("gemma3-27b-all-global", swa.dtype(), swa.block_tokens(),
                                 {all_global});
}

// Bytes per token of every seed model in bf16 and fp8_e4m3 (scales included), and the ratio.
bool PrintBytesPerTokenTable() {
  std::printf(
      "KV-cache bytes per token, from each model's config (%d-token blocks; fp8_e4m3 counts its "
      "scales):\n\n",
      kv::kDefaultBlockTokens);
  std::printf("%-12s %-40s %6s %12s %8s %16s %8s %9s\n", "model", "attention", "layers",
              "bf16 B/token", "KiB", "fp8_e4m3 B/token", "KiB", "fp8/bf16");
  struct Row {
    const char* preset;
    const char* kind;
  };
  for (const Row& row :
       {Row{"gpt2-xl", "MHA"}, Row{"llama3-8b", "GQA"}, Row{"llama3-70b", "GQA"},
        Row{"deepseek-v3", "MLA"}, Row{"gemma3-27b", "GQA+SWA"}, Row{"mamba-2.8b", "SSM"}}) {
    std::optional<kv::ModelConfig> bf16 = SeedPreset(row.preset, kv::DType::kBf16);
    if (!bf16.has_value()) return false;
    const kv::ModelLayout& l = bf16->layout;
    const std::string shape = absl::StrCat(row.kind, ", ", GroupShape(l.groups()[0]));
    if (l.BytesPerToken() == 0) {
      // A recurrent state has no per-token bytes and stays in the model's dtype (no fp8).
      std::printf("%-12s %-40s %6d %12s %8s %16s %8s %9s\n", row.preset, shape.c_str(),
                  l.num_layers(), "0 (state)", "-", "n/a (state)", "-", "-");
      continue;
    }
    std::optional<kv::ModelConfig> fp8 = SeedPreset(row.preset, kv::DType::kFp8);
    if (!fp8.has_value()) return false;
    const int64_t a = l.BytesPerToken(), b = fp8->layout.BytesPerToken();
    std::printf("%-12s %-40s %6d %12s %8.1f %16s %8.1f %9.3f\n", row.preset, shape.c_str(),
                l.num_layers(), WithCommas(a).c_str(), a / 1024.0, WithCommas(b).c_str(),
                b / 1024.0, static_cast<double>(b) / static_cast<double>(a));
  }
  std::printf(
      "(gemma3-27b: before its 1024-token windows fill; mamba-2.8b: state per "
      "sequence, below)\n");
  return true;
}

// Sliding-window capping: Gemma 3 27B as it is against the same model all-global, per sequence.
bool PrintWindowTable() {
  std::optional<kv::ModelConfig> gemma = SeedPreset("gemma3-27b", kv::DType::kBf16);
  std::optional<kv::ModelConfig> gemma_fp8 = SeedPreset("gemma3-27b", kv::DType::kFp8);
  if (!gemma.has_value() || !gemma_fp8.has_value()) return false;
  const kv::ModelLayout& swa = gemma->layout;
  absl::StatusOr<kv::ModelLayout> global = AllGlobal(swa);
  if (!global.ok()) return false;
  int local_layers = 0;
  for (const kv::LayerGroup& g : swa.groups()) {
    if (g.kind == kv::LayerKind::kSlidingWindow) local_layers += g.num_layers();
  }
  std::printf("\nGemma 3 27B: %d of %d layers keep a %d-token window (bytes per sequence)\n",
              local_layers, swa.num_layers(), swa.groups().back().window_tokens);
  std::printf("%8s %18s %18s %8s %18s %9s\n", "tokens", "sliding+global", "all global", "saving",
              "fp8_e4m3 sl+gl", "fp8/bf16");
  for (int64_t tokens : {1024, 8192, 32768}) {
    const int64_t a = swa.BytesForTokens(tokens);
    const int64_t b = global->BytesForTokens(tokens);
    const int64_t c = gemma_fp8->layout.BytesForTokens(tokens);
    std::printf(
        "%8s %18s %18s %7.2fx %18s %9.3f\n", WithCommas(tokens).c_str(),
        HumanBytes(static_cast<double>(a)).c_str(), HumanBytes(static_cast<double>(b)).c_str(),
        static_cast<double>(b) / static_cast<double>(a), HumanBytes(static_cast<double>(c)).c_str(),
        static_cast<double>(c) / static_cast<double>(a));
  }
  return true;
}

// The constant SSM state: the same at any length, and in the model's dtype whatever the KV's.
bool PrintStateTable() {
  std::optional<kv::ModelConfig> mamba = SeedPreset("mamba-2.8b", std::nullopt);
  if (!mamba.has_value()) return false;
  const kv::ModelLayout& m = mamba->layout;
  std::printf("\nMamba 2.8B: no KV cache; %d layers x %s state = %s per sequence at any length\n",
              m.num_layers(), WithCommas(m.groups()[0].state_bytes).c_str(),
              HumanBytes(static_cast<double>(m.BytesForTokens(1))).c_str());
  std::printf("(fp8_e4m3 does not apply: the recurrent state stays in the model's dtype)\n");
  std::printf("%8s %18s\n", "tokens", "bytes/sequence");
  for (int64_t tokens : {1024, 8192, 32768}) {
    std::printf("%8s %18s\n", WithCommas(tokens).c_str(),
                WithCommas(m.BytesForTokens(tokens)).c_str());
  }
  return true;
}

// The seed's comparison: bytes per token of the attention families in bf16 and fp8_e4m3,
// sliding-window capping and the constant SSM state, all computed from the presets.
int PrintSeedTable() {
  return PrintBytesPerTokenTable() && PrintWindowTable() && PrintStateTable() ? 0 : 1;
}

}  // namespace

int RunLayoutCommand(const std::vector<std::string>& args) {
  std::string preset, config_path, dtype_name, kv_dtype_name = "auto";
  int64_t tokens = 1024;
  int32_t block_tokens = 16;
  bool json = false, seed_table = false;
  FlagSet flags("layout", "KV-cache bytes of a model: per token, per block, per sequence.");
  flags.AddString("preset", &preset,
                  absl::StrCat("built-in model (", absl::StrJoin(kv::PresetNames(), ", "), ")"));
  flags.AddString("config", &config_path, "path to a Hugging Face config.json");
  flags.AddInt64("tokens", &tokens, "sequence length for the per-sequence figures");
  flags.AddString("dtype", &dtype_name,
                  "override the model's dtype (config torch_dtype; the KV's too unless --kv-dtype "
                  "says otherwise): bf16, fp16, fp8, fp32");
  flags.AddString("kv-dtype", &kv_dtype_name,
                  "the KV cache's dtype: auto (the model's), bf16, fp16, fp32 or fp8_e4m3 (E4M3 "
                  "values with float32 scales inside each block)");
  flags.AddInt32("block-tokens", &block_tokens, "tokens per cache block");
  flags.AddBool("json", &json, "print one JSON object");
  flags.AddBool("seed-table", &seed_table, "print the comparison of the seed models");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (seed_table) return PrintSeedTable();
  if (preset.empty() == config_path.empty()) {
    std::fprintf(stderr, "kvrelay layout: give exactly one of --preset or --config\n");
    return 2;
  }
  if (tokens < 0) {
    std::fprintf(stderr, "kvrelay layout: --tokens must be >= 0, got %lld\n",
                 static_cast<long long>(tokens));
    return 2;
  }
  kv::ConfigOptions options;
  options.block_tokens = block_tokens;
  if (!dtype_name.empty()) {
    absl::StatusOr<kv::DType> dtype = kv::ParseDType(dtype_name);
    if (!dtype.ok()) {
      std::fprintf(stderr, "kvrelay layout: --dtype: %s\n",
                   std::string(dtype.status().message()).c_str());
      return 2;
    }
    options.dtype = *dtype;
  }
  absl::StatusOr<std::optional<kv::DType>> kv_dtype =
      kv::ParseKvDTypeFlag("--kv-dtype", kv_dtype_name);
  if (!kv_dtype.ok()) {
    std::fprintf(stderr, "kvrelay layout: %s\n", std::string(kv_dtype.status().message()).c_str());
    return 2;
  }
  options.kv_dtype = *kv_dtype;
  absl::StatusOr<kv::ModelConfig> config =
      preset.empty() ? kv::LoadHfConfig(config_path, options) : kv::LoadPreset(preset, options);
  if (!config.ok()) {
    std::fprintf(stderr, "kvrelay layout: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  if (json) {
    std::cout << LayoutJson(*config, tokens).dump() << "\n";
  } else {
    PrintLayoutTable(*config, tokens);
  }
  return 0;
}

}  // namespace kvrelay::cli
