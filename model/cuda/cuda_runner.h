#pragma once

// The CUDA implementation of AttentionModel (model/attention_model.h): CudaModel's forward pass
// over a device mirror of the caller's host KvCache pools. The host pools stay where KV lives
// for the transport: adopted prefix blocks are uploaded before they are read, and every KV
// byte the GPU writes is staged back to the host pools layer by layer on a copy stream
// (on_layer_done(L) fires once layer L's copy completed), overlapped with the next layer.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/attention_model.h"
#include "model/cuda/cuda_model.h"
#include "model/model_runner.h"

namespace kvrelay::model::cuda {

struct CudaRunnerOptions {
  int device = 0;
  WeightDType weight_dtype = WeightDType::kBf16;
  int32_t block_tokens = kv::kDefaultBlockTokens;  // as RunnerOptions::block_tokens
  int64_t max_rows = 2048;  // tokens per forward call (prefill chunk or decode batch)
  int64_t max_context = 32768;
};

// Loads <model_dir> (config.json + safetensors) onto device `options.device`.
// FailedPrecondition naming CUDA's reason when that device is not usable; Unimplemented for
// architectures the CUDA model does not run (Gemma 3, Mamba), naming them.
absl::StatusOr<std::unique_ptr<AttentionModel>> LoadCudaRunner(const std::string& model_dir,
                                                               const CudaRunnerOptions& options);
// As above, with <dir>/config.json already parsed into `config` (its layout's block_tokens
// must equal options.block_tokens: InvalidArgument naming both otherwise).
absl::StatusOr<std::unique_ptr<AttentionModel>> LoadCudaRunner(const std::string& model_dir,
                                                               kv::ModelConfig config,
                                                               const CudaRunnerOptions& options);

// For benchmarks of real-size shapes: a runner over random weights drawn on the device
// (CudaModel::CreateRandom) for `config` (e.g. a preset's, with options.block_tokens-token
// blocks). Same refusals as LoadCudaRunner.
absl::StatusOr<std::unique_ptr<AttentionModel>> CreateRandomCudaRunner(
    const kv::ModelConfig& config, uint64_t seed, const CudaRunnerOptions& options);

// For tests: the device mirror's copy of one (group, slot) unit of `cache`, BlockBytes(group)
// bytes. InvalidArgument when `model` is not a CUDA runner, NotFound when it mirrors no such
// cache.
absl::StatusOr<std::vector<uint8_t>> ReadDeviceUnitForTest(const AttentionModel& model,
                                                           const KvCache& cache, int group,
                                                           kv::SlotId slot);

}  // namespace kvrelay::model::cuda
