#include "model/select/model_select.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "model/weights.h"
#include "platform/device_platform.h"

#ifdef KVRELAY_HAVE_CUDA
#include "model/cuda/cuda_runner.h"
#endif

namespace kvrelay::model {
namespace {

constexpr int kMaxCudaIndex = 1023;
constexpr char kAcceptedForms[] = "auto, cpu, cuda or cuda:N";

// `config`: config.json already parsed (empty: the loader reads it).
using ParsedConfig = std::optional<kv::ModelConfig>;

absl::StatusOr<std::unique_ptr<AttentionModel>> LoadCuda(const std::string& model_dir,
                                                         const ParsedConfig& config,
                                                         const RunnerOptions& options, int device) {
#ifdef KVRELAY_HAVE_CUDA
  cuda::CudaRunnerOptions cuda_options;
  cuda_options.device = device;
  cuda_options.block_tokens =
      config.has_value() ? config->layout.block_tokens() : options.block_tokens;
  if (config.has_value()) return cuda::LoadCudaRunner(model_dir, *config, cuda_options);
  return cuda::LoadCudaRunner(model_dir, cuda_options);
#else
  (void)model_dir;
  (void)config;
  (void)options;
  (void)device;
  return absl::UnimplementedError("built without CUDA");
#endif
}

std::string Describe(const platform::DeviceInfo& device) {
  return absl::StrCat("CUDA device ", device.index, " (", device.name, ")");
}

// The platform's device `index`, or FailedPrecondition starting with `flag` saying why there
// is none: no CUDA in this build, no usable device at all, or not that one.
absl::StatusOr<platform::DeviceInfo> FindCudaDevice(int index, absl::string_view flag) {
  absl::StatusOr<std::unique_ptr<platform::DevicePlatform>> platform =
      platform::MakeDevicePlatform();
  if (!platform.ok()) {
    if (platform.status().code() == absl::StatusCode::kUnimplemented) {
      return absl::FailedPreconditionError(
          absl::StrCat(flag, ": no CUDA in this kvrelay (", platform.status().message(), ")"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": no usable CUDA device (", platform.status().message(), ")"));
  }
  const std::vector<platform::DeviceInfo> devices = (*platform)->devices();
  std::vector<std::string> present;
  for (const platform::DeviceInfo& device : devices) {
    if (device.index == index) return device;
    present.push_back(absl::StrCat("cuda:", device.index, " ", device.name));
  }
  return absl::FailedPreconditionError(absl::StrCat(flag, ": no usable CUDA device ", index,
                                                    " (this machine has ", devices.size(), ": ",
                                                    absl::StrJoin(present, ", "), ")"));
}

std::string FlagOf(const DeviceChoice& choice) {
  return absl::StrCat("--device ", choice.ToString());
}

absl::StatusOr<LoadedModel> LoadCpu(const std::string& model_dir, const ParsedConfig& config,
                                    const RunnerOptions& options, std::string reason) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                      config.has_value() ? ModelRunner::Load(model_dir, *config, options)
                                         : ModelRunner::Load(model_dir, options));
  return LoadedModel{std::move(runner), std::move(reason)};
}

absl::StatusOr<LoadedModel> Load(const std::string& model_dir, const ParsedConfig& config,
                                 const RunnerOptions& options, const DeviceChoice& choice) {
  switch (choice.kind) {
    case DeviceChoice::Kind::kCpu:
      return LoadCpu(model_dir, config, options, FlagOf(choice));
    case DeviceChoice::Kind::kCuda: {
      const std::string flag = FlagOf(choice);
      KV_ASSIGN_OR_RETURN(platform::DeviceInfo device, FindCudaDevice(choice.cuda_index, flag));
      absl::StatusOr<std::unique_ptr<AttentionModel>> model =
          LoadCuda(model_dir, config, options, choice.cuda_index);
      if (!model.ok()) {
        return absl::Status(model.status().code(),
                            absl::StrCat(flag, ": ", model.status().message()));
      }
      return LoadedModel{*std::move(model), absl::StrCat(flag, ": ", Describe(device))};
    }
    case DeviceChoice::Kind::kAuto:
      break;
  }
  absl::StatusOr<platform::DeviceInfo> device = FindCudaDevice(0, "auto");
  if (!device.ok()) {
    return LoadCpu(model_dir, config, options, std::string(device.status().message()));
  }
  absl::StatusOr<std::unique_ptr<AttentionModel>> model = LoadCuda(model_dir, config, options, 0);
  if (model.ok()) return LoadedModel{*std::move(model), absl::StrCat("auto: ", Describe(*device))};
  // Any failure of the CUDA runner leaves the CPU, which says whether the model loads at all.
  std::string why = model.status().code() == absl::StatusCode::kUnimplemented
                        ? absl::StrCat("auto: ", Describe(*device), " does not run this model (",
                                       model.status().message(), ")")
                        : absl::StrCat("auto: ", Describe(*device), " could not load this model (",
                                       model.status().ToString(), ")");
  return LoadCpu(model_dir, config, options, std::move(why));
}

}  // namespace

std::string DeviceChoice::ToString() const {
  switch (kind) {
    case Kind::kAuto:
      return "auto";
    case Kind::kCpu:
      return "cpu";
    case Kind::kCuda:
      return absl::StrCat("cuda:", cuda_index);
  }
  return "?";
}

absl::StatusOr<DeviceChoice> ParseDeviceFlag(absl::string_view value) {
  if (value == "auto") return DeviceChoice{.kind = DeviceChoice::Kind::kAuto};
  if (value == "cpu") return DeviceChoice{.kind = DeviceChoice::Kind::kCpu};
  if (value == "cuda") return DeviceChoice{.kind = DeviceChoice::Kind::kCuda, .cuda_index = 0};
  absl::string_view index_text = value;
  int index = -1;
  // Digits only: SimpleAtoi alone would take "+1" or " 1".
  if (absl::ConsumePrefix(&index_text, "cuda:") && !index_text.empty() &&
      index_text.find_first_not_of("0123456789") == absl::string_view::npos &&
      index_text.size() <= 4 && absl::SimpleAtoi(index_text, &index) && index <= kMaxCudaIndex) {
    return DeviceChoice{.kind = DeviceChoice::Kind::kCuda, .cuda_index = index};
  }
  return absl::InvalidArgumentError(absl::StrCat("--device must be ", kAcceptedForms,
                                                 " (N a device ordinal in [0, ", kMaxCudaIndex,
                                                 "]), got '", value, "'"));
}

absl::StatusOr<LoadedModel> LoadAttentionModel(const std::string& model_dir,
                                               const RunnerOptions& options,
                                               const DeviceChoice& choice) {
  return Load(model_dir, std::nullopt, options, choice);
}

absl::StatusOr<LoadedModel> LoadAttentionModel(const std::string& model_dir,
                                               const kv::ModelConfig& config,
                                               const RunnerOptions& options,
                                               const DeviceChoice& choice) {
  return Load(model_dir, config, options, choice);
}

absl::StatusOr<ServingModel> LoadServingModel(const std::string& model_dir,
                                              const kv::ModelConfig& config,
                                              const RunnerOptions& options,
                                              const DeviceChoice& choice) {
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(config));
  ServingModel out;
  if (arch == Arch::kMamba) {
    // MambaRunner is CPU-only: auto says so, an explicit cuda is refused.
    KV_ASSIGN_OR_RETURN(out.reason, CpuOnlyModelReason(choice, "mamba"));
    KV_ASSIGN_OR_RETURN(out.mamba, MambaRunner::Load(model_dir, options));
    out.device = {.kind = DeviceKind::kCpu, .index = 0, .name = "cpu"};
    return out;
  }
  // The parsed config, not config.json again: it carries the caller's block size and KV dtype.
  KV_ASSIGN_OR_RETURN(LoadedModel loaded, LoadAttentionModel(model_dir, config, options, choice));
  out.attention = std::move(loaded.model);
  out.device = out.attention->device();
  out.reason = std::move(loaded.reason);
  return out;
}

absl::Status CheckDeviceChoice(const DeviceChoice& choice, const kv::ModelConfig& config) {
  if (choice.kind != DeviceChoice::Kind::kCuda) return absl::OkStatus();
  if (absl::StatusOr<Arch> arch = ArchFor(config); arch.ok() && *arch == Arch::kMamba) {
    return CpuOnlyModelReason(choice, "mamba").status();
  }
  return FindCudaDevice(choice.cuda_index, FlagOf(choice)).status();
}

absl::StatusOr<std::string> CpuOnlyModelReason(const DeviceChoice& choice,
                                               absl::string_view model_kind) {
  switch (choice.kind) {
    case DeviceChoice::Kind::kCpu:
      return FlagOf(choice);
    case DeviceChoice::Kind::kAuto:
      return absl::StrCat("auto: ", model_kind, " models run on the CPU only");
    case DeviceChoice::Kind::kCuda:
      break;
  }
  return absl::FailedPreconditionError(absl::StrCat(FlagOf(choice), ": ", model_kind,
                                                    " models run on the CPU only; use --device "
                                                    "cpu or auto"));
}

}  // namespace kvrelay::model
