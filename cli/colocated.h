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
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/mamba_runner.h"
#include "model/model_runner.h"
#include "model/select/model_select.h"

namespace kvrelay::cli {

struct GenerationRequest {
  std::vector<int32_t> tokens;  // the prompt, 1 .. max_position_embeddings - max_tokens
  int32_t max_tokens = 16;      // [1, 4096]
  float temperature = 0.0f;     // 0 = greedy
  float top_p = 1.0f;           // (0, 1]: nucleus sampling
  uint64_t seed = 0;
  int32_t eos_token = -1;  // stop after producing this token; -1 = none
};

// What `kvrelay generate --json` prints; the gateway fills the same fields from its
// GenerateSummary. A co-located run has no prefix hits and moves no bytes.
struct GenerationResult {
  std::vector<int32_t> tokens;
  double ttft_ms = 0;
  double total_ms = 0;
  int32_t prefix_hit_tokens = 0;
  int32_t computed_prompt_tokens = 0;
  int64_t transferred_bytes = 0;
  int64_t fetched_bytes = 0;
  int32_t prompt_tokens = 0;
  int32_t generated_tokens = 0;
  std::string prefill_worker;
  std::string decode_worker;
  int32_t attempts = 0;
  // Where the reused prefix came from (GenerateSummary.prefix_source; "local" co-located) and
  // leading blocks the decode worker already held.
  std::string prefix_source;
  int32_t decode_held_blocks = 0;
};

class ColocatedGenerator {
 public:
  // Loads <model_dir>/config.json + safetensors. `threads` as RunnerOptions::threads; `device`
  // as a worker's --device (the CPU by default: the reference; a CUDA reference for a cluster
  // of CUDA workers, whose bits are not the CPU's). Mamba runs on the CPU only.
  static absl::StatusOr<std::unique_ptr<ColocatedGenerator>> Load(
      const std::string& model_dir, int32_t threads = 1,
      const model::DeviceChoice& device = {.kind = model::DeviceChoice::Kind::kCpu});

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
