#include "cli/colocated.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kv/prompt_validation.h"
#include "model/kv_cache.h"
#include "model/sampler.h"

namespace kvrelay::cli {
namespace {

double MillisSince(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

}  // namespace

absl::StatusOr<std::unique_ptr<ColocatedGenerator>> ColocatedGenerator::Load(
    const std::string& model_dir, int32_t threads, const model::DeviceChoice& device,
    std::optional<kv::DType> kv_dtype) {
  model::RunnerOptions options;
  options.threads = threads;
  KV_ASSIGN_OR_RETURN(kv::ModelConfig config,
                      kv::LoadHfConfig(model_dir + "/config.json", {.kv_dtype = kv_dtype}));
  KV_ASSIGN_OR_RETURN(model::ServingModel loaded,
                      model::LoadServingModel(model_dir, config, options, device));
  return std::unique_ptr<ColocatedGenerator>(
      new ColocatedGenerator(std::move(loaded.attention), std::move(loaded.mamba)));
}

absl::StatusOr<GenerationResult> ColocatedGenerator::GenerateMamba(
    const GenerationRequest& request) const {
  model::MambaSequence seq(mamba_->layout());
  model::Sampler sampler(request.seed);
  GenerationResult result;
  result.prompt_tokens = static_cast<int32_t>(request.tokens.size());
  result.computed_prompt_tokens = result.prompt_tokens;
  result.prefill_worker = "colocated";
  result.decode_worker = "colocated";
  result.attempts = 1;
  const absl::Time start = absl::Now();
  KV_ASSIGN_OR_RETURN(std::vector<float> logits, mamba_->Prefill(seq, request.tokens));
  int32_t next = sampler.Sample(logits, request.temperature, request.top_p);
  result.ttft_ms = MillisSince(start);
  result.tokens.push_back(next);
  while (static_cast<int32_t>(result.tokens.size()) < request.max_tokens &&
         next != request.eos_token) {
    model::MambaSequence* seqs[] = {&seq};
    KV_ASSIGN_OR_RETURN(logits, mamba_->DecodeStep(seqs, {next}));
    next = sampler.Sample(logits, request.temperature, request.top_p);
    result.tokens.push_back(next);
  }
  result.total_ms = MillisSince(start);
  result.generated_tokens = static_cast<int32_t>(result.tokens.size());
  return result;
}

absl::StatusOr<GenerationResult> ColocatedGenerator::Generate(
    const GenerationRequest& request) const {
  KV_RETURN_IF_ERROR(kv::ValidatePrompt(request.tokens, request.max_tokens, config()));
  if (!(request.top_p > 0.0f && request.top_p <= 1.0f)) {
    return absl::InvalidArgumentError("top_p must be in (0, 1]");
  }
  if (mamba_ != nullptr) return GenerateMamba(request);
  const int64_t prompt = static_cast<int64_t>(request.tokens.size());

  // Every block the sequence can touch, plus one spare (sliding-window bookkeeping).
  const int64_t block_tokens = runner_->layout().block_tokens();
  const int64_t blocks = (prompt + request.max_tokens + block_tokens - 1) / block_tokens + 1;
  KV_ASSIGN_OR_RETURN(std::unique_ptr<model::KvCache> cache,
                      model::KvCache::Create(runner_->layout(), blocks));
  model::Sequence seq(cache.get());
  model::Sampler sampler(request.seed);

  GenerationResult result;
  result.prompt_tokens = static_cast<int32_t>(prompt);
  result.computed_prompt_tokens = static_cast<int32_t>(prompt);
  result.prefill_worker = "colocated";
  result.decode_worker = "colocated";
  result.attempts = 1;

  const absl::Time start = absl::Now();
  KV_ASSIGN_OR_RETURN(std::vector<float> logits, runner_->Prefill(seq, request.tokens));
  int32_t next = sampler.Sample(logits, request.temperature, request.top_p);
  result.ttft_ms = MillisSince(start);
  result.tokens.push_back(next);
  while (static_cast<int32_t>(result.tokens.size()) < request.max_tokens &&
         next != request.eos_token) {
    model::Sequence* seqs[] = {&seq};
    if (!(request.temperature > 0.0f)) {
      // As a decode worker's all-greedy step does (the device may take the argmax itself).
      KV_ASSIGN_OR_RETURN(std::vector<int32_t> ids, runner_->DecodeStepGreedy(seqs, {next}));
      next = ids.at(0);
    } else {
      KV_ASSIGN_OR_RETURN(logits, runner_->DecodeStep(seqs, {next}));
      next = sampler.Sample(logits, request.temperature, request.top_p);
    }
    result.tokens.push_back(next);
  }
  result.total_ms = MillisSince(start);
  result.generated_tokens = static_cast<int32_t>(result.tokens.size());
  return result;
}

}  // namespace kvrelay::cli
