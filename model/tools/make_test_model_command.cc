#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "model/test_model.h"
#include "model/tools/command.h"

namespace kvrelay::model::tools {

int RunMakeTestModelCommand(const std::vector<std::string>& args) {
  model::TestModelOptions o;
  std::string out;
  std::string dtype = "bf16";
  int64_t seed = 0;
  int32_t shards = 1;
  FlagSet flags("make-test-model",
                "Writes a small random-weight model (config.json + safetensors) for tests.");
  flags.AddString("arch", &o.arch, "llama | deepseek_v3 | gemma3 | gpt2 | mamba");
  flags.AddString("out", &out, "output directory (created)");
  flags.AddInt64("seed", &seed, "random seed (same seed, same bytes)");
  flags.AddInt32("layers", &o.layers, "num_hidden_layers (0: preset)");
  flags.AddInt32("hidden", &o.hidden, "hidden_size (0: preset)");
  flags.AddInt32("intermediate", &o.intermediate, "intermediate_size (0: preset)");
  flags.AddInt32("heads", &o.heads, "num_attention_heads (0: preset)");
  flags.AddInt32("kv-heads", &o.kv_heads, "num_key_value_heads, llama/gemma3 (0: preset)");
  flags.AddInt32("vocab", &o.vocab, "vocab_size (0: preset)");
  flags.AddInt32("sliding-window", &o.sliding_window, "gemma3 sliding_window (0: preset)");
  flags.AddString("dtype", &dtype, "weight dtype: bf16 | fp16 | fp32");
  flags.AddInt32("shards", &shards, "number of safetensors files (>1 writes an index)");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (out.empty()) return UsageError(flags.command(), "--out is required");
  if (dtype == "bf16") {
    o.dtype = model::TensorDType::kBf16;
  } else if (dtype == "fp16") {
    o.dtype = model::TensorDType::kFp16;
  } else if (dtype == "fp32") {
    o.dtype = model::TensorDType::kFp32;
  } else {
    return UsageError(flags.command(),
                      absl::StrCat("--dtype must be bf16, fp16 or fp32, got '", dtype, "'"));
  }
  if (shards < 1 || shards > 64) {
    return UsageError(flags.command(), absl::StrCat("--shards must be in [1, 64], got ", shards));
  }
  o.shards = shards;
  o.seed = static_cast<uint64_t>(seed);
  if (absl::StatusOr<std::string> preset = model::TestModelPreset(o.arch); !preset.ok()) {
    return UsageError(flags.command(), preset.status().message());
  }
  absl::Status status = model::WriteTestModel(out, o);
  if (!status.ok()) {
    return UsageError(flags.command(), status.ToString(), absl::IsInvalidArgument(status) ? 2 : 1);
  }
  std::printf("wrote %s model to %s\n", o.arch.c_str(), out.c_str());
  return 0;
}

}  // namespace kvrelay::model::tools
