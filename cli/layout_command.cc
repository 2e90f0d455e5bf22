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
      return absl::StrCat(g.state_bytes, " B state per layer");
  }
  return "";
}

nlohmann::json LayoutJson(const kv::ModelLayout& layout, int64_t tokens) {
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
    if (g.kind == kv::LayerKind::kSsmState) j["state_bytes"] = g.state_bytes;
    groups.push_back(std::move(j));
  }
  return {{"model", layout.model_id()},
          {"dtype", std::string(kv::DTypeName(layout.dtype()))},
          {"block_tokens", layout.block_tokens()},
          {"layers", layout.num_layers()},
          {"tokens", tokens},
          {"bytes_per_token", layout.BytesPerToken()},
          {"bytes_for_tokens", layout.BytesForTokens(tokens)},
          {"fingerprint", layout.fingerprint().ToHex()},
          {"groups", std::move(groups)}};
}

void PrintLayoutTable(const kv::ModelLayout& layout, int64_t tokens) {
  std::printf("model %s  dtype %s  block %d tokens  %d layers\n", layout.model_id().c_str(),
              std::string(kv::DTypeName(layout.dtype())).c_str(), layout.block_tokens(),
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
}

// The seed's comparison: bytes per token of the attention families, sliding-window capping and
// the constant SSM state, all computed from the presets.
int PrintSeedTable() {
  std::printf("KV-cache bytes per token (bf16), from each model's config:\n\n");
  std::printf("%-12s %-44s %7s %12s %10s\n", "model", "attention", "layers", "bytes/token",
              "KiB/token");
  struct Row {
    const char* preset;
    const char* kind;
  };
  for (const Row& row : {Row{"gpt2-xl", "MHA"}, Row{"llama3-8b", "GQA"}, Row{"llama3-70b", "GQA"},
                         Row{"deepseek-v3", "MLA"}}) {
    absl::StatusOr<kv::ModelConfig> c = kv::LoadPreset(row.preset);
    if (!c.ok()) {
      std::fprintf(stderr, "kvrelay layout: %s\n", std::string(c.status().message()).c_str());
      return 1;
    }
    const kv::ModelLayout& l = c->layout;
    std::printf("%-12s %-44s %7d %12s %10.1f\n", row.preset,
                absl::StrCat(row.kind, ", ", GroupShape(l.groups()[0])).c_str(), l.num_layers(),
                WithCommas(l.BytesPerToken()).c_str(), l.BytesPerToken() / 1024.0);
  }

  absl::StatusOr<kv::ModelConfig> gemma = kv::LoadPreset("gemma3-27b");
  absl::StatusOr<kv::ModelConfig> mamba = kv::LoadPreset("mamba-2.8b");
  if (!gemma.ok() || !mamba.ok()) {
    std::fprintf(stderr, "kvrelay layout: preset failed to load\n");
    return 1;
  }
  // The same model with every layer global: one full-attention group over all layers.
  const kv::ModelLayout& swa = gemma->layout;
  kv::LayerGroup all_global = swa.groups()[0];
  all_global.kind = kv::LayerKind::kFullAttention;
  all_global.window_tokens = 0;
  all_global.layer_ids.clear();
  for (int32_t i = 0; i < swa.num_layers(); ++i) all_global.layer_ids.push_back(i);
  absl::StatusOr<kv::ModelLayout> global = kv::ModelLayout::Create(
      "gemma3-27b-all-global", swa.dtype(), swa.block_tokens(), {all_global});
  if (!global.ok()) return 1;

  int local_layers = 0;
  for (const kv::LayerGroup& g : swa.groups()) {
    if (g.kind == kv::LayerKind::kSlidingWindow) local_layers += g.num_layers();
  }
  std::printf("\nGemma 3 27B: %d of %d layers keep a %d-token window (bytes per sequence)\n",
              local_layers, swa.num_layers(), swa.groups().back().window_tokens);
  std::printf("%8s %18s %18s %8s\n", "tokens", "sliding+global", "all global", "saving");
  for (int64_t tokens : {1024, 8192, 32768}) {
    const int64_t a = swa.BytesForTokens(tokens);
    const int64_t b = global->BytesForTokens(tokens);
    std::printf("%8s %18s %18s %7.2fx\n", WithCommas(tokens).c_str(),
                HumanBytes(static_cast<double>(a)).c_str(),
                HumanBytes(static_cast<double>(b)).c_str(),
                static_cast<double>(b) / static_cast<double>(a));
  }

  const kv::ModelLayout& m = mamba->layout;
  std::printf("\nMamba 2.8B: no KV cache; %d layers x %s state = %s per sequence at any length\n",
              m.num_layers(), WithCommas(m.groups()[0].state_bytes).c_str(),
              HumanBytes(static_cast<double>(m.BytesForTokens(1))).c_str());
  std::printf("%8s %18s\n", "tokens", "bytes/sequence");
  for (int64_t tokens : {1024, 8192, 32768}) {
    std::printf("%8s %18s\n", WithCommas(tokens).c_str(),
                WithCommas(m.BytesForTokens(tokens)).c_str());
  }
  return 0;
}

}  // namespace

int RunLayoutCommand(const std::vector<std::string>& args) {
  std::string preset, config_path, dtype_name;
  int64_t tokens = 1024;
  int32_t block_tokens = 16;
  bool json = false, seed_table = false;
  FlagSet flags("layout", "KV-cache bytes of a model: per token, per block, per sequence.");
  flags.AddString("preset", &preset,
                  absl::StrCat("built-in model (", absl::StrJoin(kv::PresetNames(), ", "), ")"));
  flags.AddString("config", &config_path, "path to a Hugging Face config.json");
  flags.AddInt64("tokens", &tokens, "sequence length for the per-sequence figures");
  flags.AddString("dtype", &dtype_name, "override the config's dtype: bf16, fp16, fp8, fp32");
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
  absl::StatusOr<kv::ModelConfig> config =
      preset.empty() ? kv::LoadHfConfig(config_path, options) : kv::LoadPreset(preset, options);
  if (!config.ok()) {
    std::fprintf(stderr, "kvrelay layout: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  if (json) {
    std::cout << LayoutJson(config->layout, tokens).dump() << "\n";
  } else {
    PrintLayoutTable(config->layout, tokens);
  }
  return 0;
}

}  // namespace kvrelay::cli
