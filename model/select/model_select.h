#pragma once

// Which AttentionModel implementation a worker computes with (`--device auto|cpu|cuda[:N]`),
// and loading it. The CPU ModelRunner and the CUDA runner (model/cuda/cuda_runner.h) sit behind
// model::AttentionModel; this is the one place that picks between them, and the one file that
// reads KVRELAY_HAVE_CUDA for the model (as platform/device_platform.cc does for the platform).
//
//   KV_ASSIGN_OR_RETURN(DeviceChoice choice, ParseDeviceFlag("auto"));
//   KV_ASSIGN_OR_RETURN(LoadedModel loaded, LoadAttentionModel(dir, {.threads = 2}, choice));
//   // loaded.model->device().Label() is "cpu" or "cuda:0"; loaded.reason says why.
//
// An explicit choice never falls back: `cuda[:N]` without a usable device N is an error, never
// a silent CPU. `auto` takes CUDA device 0 when the platform reports one and the CUDA runner
// loads the model, else the CPU, and says why in the reason. KV never crosses backends: a CUDA
// model whose bits differ from the CPU's announces another layout fingerprint (numerics_id()).
//
// Thread-safe (no state).

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kv/hf_config.h"
#include "model/attention_model.h"
#include "model/mamba_runner.h"
#include "model/model_runner.h"

namespace kvrelay::model {

// A parsed --device value.
struct DeviceChoice {
  enum class Kind { kAuto, kCpu, kCuda };
  Kind kind = Kind::kAuto;
  int cuda_index = 0;  // kCuda: the device ordinal ("cuda" is cuda:0)
  // "auto", "cpu" or "cuda:N".
  std::string ToString() const;
};

// "auto", "cpu", "cuda" (device 0) or "cuda:N" (N a decimal ordinal in [0, 1023]);
// InvalidArgument naming the value and the accepted forms otherwise.
absl::StatusOr<DeviceChoice> ParseDeviceFlag(absl::string_view value);

struct LoadedModel {
  std::unique_ptr<AttentionModel> model;
  // One line: why this device, e.g. "--device cpu", "auto: CUDA device 0 (NVIDIA H200)",
  // "auto: no usable CUDA device (no CUDA device: insufficient driver)".
  std::string reason;
};

// Loads <model_dir> on the device `choice` names: cpu -> ModelRunner::Load(options);
// cuda[:N] -> the CUDA runner on device N (block_tokens from `options`); auto -> as above.
// FailedPrecondition for cuda[:N] in a build without CUDA or without a usable device N, naming
// the flag and why; the CUDA runner's own status (prefixed with the flag) when it refuses the
// model; the CPU runner's status otherwise.
absl::StatusOr<LoadedModel> LoadAttentionModel(const std::string& model_dir,
                                               const RunnerOptions& options,
                                               const DeviceChoice& choice);
// As above, with <model_dir>/config.json already parsed into `config` (a worker parses it once;
// its layout's block_tokens is the one used).
absl::StatusOr<LoadedModel> LoadAttentionModel(const std::string& model_dir,
                                               const kv::ModelConfig& config,
                                               const RunnerOptions& options,
                                               const DeviceChoice& choice);

// A model loaded to serve with, of either family: an attention model (paged KV cache) on the
// device the choice names, or a Mamba model (recurrent state), which runs on the CPU only.
// Exactly one of `attention` and `mamba` is set.
struct ServingModel {
  std::unique_ptr<AttentionModel> attention;
  std::unique_ptr<MambaRunner> mamba;
  ComputeDevice device;  // where it computes: attention->device(), or the CPU
  std::string reason;    // why there, as LoadedModel::reason
};

// Loads <model_dir>, whose config.json the caller parsed as `config` (its model_type picks the
// family): attention models as LoadAttentionModel does; Mamba with MambaRunner::Load on the CPU.
// ArchFor's status for a model_type no runner knows; FailedPrecondition for Mamba under
// cuda[:N] (CpuOnlyModelReason), before any weight is read; the loader's status otherwise.
absl::StatusOr<ServingModel> LoadServingModel(const std::string& model_dir,
                                              const kv::ModelConfig& config,
                                              const RunnerOptions& options,
                                              const DeviceChoice& choice);

// Whether `choice` can be honoured on this machine for a model of `config`, without loading
// weights, so a command can refuse a bad --device as a usage error at once. OK for auto and
// cpu. For cuda[:N]: FailedPrecondition, naming the flag and why, when the build has no CUDA,
// no usable device N answers, or the model runs on the CPU only (Mamba: MambaRunner).
absl::Status CheckDeviceChoice(const DeviceChoice& choice, const kv::ModelConfig& config);

// The reason a model that runs on the CPU only (Mamba) gets for `choice`: "--device cpu" or
// "auto: <why> runs on the CPU only". FailedPrecondition for cuda[:N].
absl::StatusOr<std::string> CpuOnlyModelReason(const DeviceChoice& choice,
                                               absl::string_view model_kind);

}  // namespace kvrelay::model
