#pragma once

// Built-in model presets. Each preset is a Hugging Face config.json text (embedded), parsed by
// the same ParseHfConfig as a user's file, so the presets also exercise the parser.
//
//   gpt2-xl, llama3-8b, llama3-70b, deepseek-v3, gemma3-27b, mamba-2.8b: real published shapes.
//   tiny-llama, tiny-deepseek-v3, tiny-gemma3: the small models tests and the demo generate
//   (make-test-model writes exactly these configs).

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kv/hf_config.h"

namespace kvrelay::kv {

std::vector<std::string> PresetNames();
// The preset's config.json text; NotFound naming the preset and listing the known ones.
absl::StatusOr<std::string> PresetConfigJson(std::string_view name);
// ParseHfConfig(PresetConfigJson(name)) with model_id = name unless options set one.
absl::StatusOr<ModelConfig> LoadPreset(std::string_view name, ConfigOptions options = {});

}  // namespace kvrelay::kv
