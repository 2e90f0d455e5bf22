#include "model/cuda/cuda_runner.h"

#include "absl/status/status.h"

namespace kvrelay::model::cuda {

// Placeholder until the device-mirror runner lands (issue #18); callers fall back to the CPU.
absl::StatusOr<std::unique_ptr<AttentionModel>> LoadCudaRunner(
    const std::string& /*model_dir*/, const CudaRunnerOptions& /*options*/) {
  return absl::UnimplementedError("the CUDA runner is not built yet");
}

}  // namespace kvrelay::model::cuda
