#pragma once

// Co-located generation: prefill and decode in one process with model::ModelRunner (or
// model::MambaRunner for model_type mamba). It is the
// reference that disaggregated serving must match token for token (see DESIGN.md, "One request,
// end to end"): Prefill over the whole prompt (bit-identical to the prefill worker's full blocks
// plus the decode worker's tail, because prefill GEMMs are tiled at block boundaries), the first
// token sampled from its logits, then one DecodeStep per further token with the same Sampler
// and seed the decode worker uses.
//
// Thread safety: a ColocatedGenerator runs one Generate at a time (ModelRunner's rule).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gateway/client/generation.h"
#include "model/mamba_runner.h"
#include "model/model_runner.h"
#include "model/select/model_select.h"

namespace kvrelay::cli {

// The request and result types are the gateway client's, so a reference result and a served
// one compare field for field.
using GenerationRequest = gateway::client::GenerationRequest;
using GenerationResult = gateway::client::GenerationResult;

class ColocatedGenerator {
 public:
  // Loads <model_dir>/config.json + safetensors. `threads` as RunnerOptions::threads; `device`
  // as a worker's --device (the CPU by default: the reference; a CUDA reference for a cluster
  // of CUDA workers, whose bits are not the CPU's). Mamba runs on the CPU only. `kv_dtype` as a
  // worker's --kv-cache-dtype (empty: the model's dtype).
  static absl::StatusOr<std::unique_ptr<ColocatedGenerator>> Load(
      const std::string& model_dir, int32_t threads = 1,
      const model::DeviceChoice& device = {.kind = model::DeviceChoice::Kind::kCpu},
      std::optional<kv::DType> kv_dtype = std::nullopt);

  // InvalidArgument for an empty prompt, a token id outside [0, vocab), max_tokens outside
  // [1, 4096] or a prompt + max_tokens longer than the model's max_position_embeddings.
  absl::StatusOr<GenerationResult> Generate(const GenerationRequest& request) const;

  // The model's config and layout, whichever runner computes it.
  const kv::ModelConfig& config() const {
    return runner_ != nullptr ? runner_->config() : mamba_->config();
  }

 private:
  ColocatedGenerator(std::unique_ptr<model::AttentionModel> runner,
                     std::unique_ptr<model::MambaRunner> mamba)
      : runner_(std::move(runner)), mamba_(std::move(mamba)) {}
  // Mamba: one Prefill over the prompt, then DecodeSteps, on its recurrent state.
  absl::StatusOr<GenerationResult> GenerateMamba(const GenerationRequest& request) const;

  std::unique_ptr<model::AttentionModel> runner_;  // attention models
  std::unique_ptr<model::MambaRunner> mamba_;      // model_type mamba
};

}  // namespace kvrelay::cli
