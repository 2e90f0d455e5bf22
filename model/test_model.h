#pragma once

// Small random-weight models in Hugging Face format (config.json + safetensors), so tests and
// the demo need no download. `kvrelay make-test-model` (model/tools) is the command-line front
// end.
//
// The config is the tiny-* preset of the architecture (kv/presets.h) verbatim unless a size
// is overridden; weights are drawn from a SplitMix64 stream seeded by (seed, tensor name), so
// the same options always give the same bytes, whatever the tensor order.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/safetensors.h"

namespace kvrelay::model {

struct TestModelOptions {
  std::string arch = "llama";  // llama | deepseek_v3 | gemma3 | gpt2 | mamba
  // 0 keeps the preset's value.
  int32_t layers = 0;
  int32_t hidden = 0;  // llama/gemma3: head_dim becomes hidden / heads
  int32_t intermediate = 0;
  int32_t heads = 0;
  int32_t kv_heads = 0;  // llama/gemma3
  int32_t vocab = 0;
  int32_t sliding_window = 0;  // gemma3
  uint64_t seed = 0;
  TensorDType dtype = TensorDType::kBf16;
  int shards = 1;  // >1: sharded files + model.safetensors.index.json
  // JSON object merged into the config last (RFC 7386 merge patch), e.g.
  // {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}. Empty: none.
  std::string config_patch;
};

// The preset name for an arch ("tiny-llama", ...); InvalidArgument for an unknown arch.
absl::StatusOr<std::string> TestModelPreset(const std::string& arch);
// config.json text for the options.
absl::StatusOr<std::string> TestModelConfigJson(const TestModelOptions& options);
// The tensors (names, shapes, values) for the options.
absl::StatusOr<std::vector<TensorToWrite>> TestModelTensors(const TestModelOptions& options);
// Writes <dir>/config.json and the safetensors file(s), creating dir.
absl::Status WriteTestModel(const std::string& dir, const TestModelOptions& options);

}  // namespace kvrelay::model
