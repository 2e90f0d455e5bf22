#include "cli/colocated.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "model/kv_cache.h"
#include "model/sampler.h"

namespace kvrelay::cli {
namespace {

constexpr int32_t kMaxGenerateTokens = 4096;

double MillisSince(absl::Time start) {
  return absl::ToDoubleMilliseconds(absl::Now() - start);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ColocatedGenerator>> ColocatedGenerator::Load(
    const std::string& model_dir, int32_t threads) {
  model::RunnerOptions options;
  options.threads = threads;
  KV_ASSIGN_OR_RETURN(std::unique_ptr<model::ModelRunner> runner,
                      model::ModelRunner::Load(model_dir, options));
  return std::unique_ptr<ColocatedGenerator>(new ColocatedGenerator(std::move(runner)));
}

absl::StatusOr<GenerationResult> ColocatedGenerator::Generate(
    const GenerationRequest& request) const {
  const kv::ModelConfig& config = runner_->config();
  const int64_t prompt = static_cast<int64_t>(request.tokens.size());
  if (prompt == 0) return absl::InvalidArgumentError("prompt is empty");
  for (size_t i = 0; i < request.tokens.size(); ++i) {
    const int32_t t = request.tokens[i];
    if (t < 0 || t >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " is ", t,
                                                     ", outside the vocabulary [0, ",
                                                     config.vocab_size, ")"));
    }
  }
  if (request.max_tokens < 1 || request.max_tokens > kMaxGenerateTokens) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be in [1, ",
                                                   kMaxGenerateTokens, "], got ",
                                                   request.max_tokens));
  }
  if (config.max_position_embeddings > 0 &&
      prompt + request.max_tokens > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt (", prompt, " tokens) + max_tokens (", request.max_tokens,
        ") exceeds the model's ", config.max_position_embeddings, " positions"));
  }

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
  int32_t next = sampler.Sample(logits, request.temperature);
  result.ttft_ms = MillisSince(start);
  result.tokens.push_back(next);
  while (static_cast<int32_t>(result.tokens.size()) < request.max_tokens &&
         next != request.eos_token) {
    model::Sequence* seqs[] = {&seq};
    KV_ASSIGN_OR_RETURN(logits, runner_->DecodeStep(seqs, {next}));
    next = sampler.Sample(logits, request.temperature);
    result.tokens.push_back(next);
  }
  result.total_ms = MillisSince(start);
  result.generated_tokens = static_cast<int32_t>(result.tokens.size());
  return result;
}

}  // namespace kvrelay::cli
