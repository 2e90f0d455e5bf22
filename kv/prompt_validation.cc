#include "kv/prompt_validation.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/limits.h"

namespace kvrelay::kv {

absl::Status ValidatePrompt(absl::Span<const int32_t> tokens, int32_t max_tokens,
                            const ModelConfig& config) {
  if (tokens.empty()) return absl::InvalidArgumentError("tokens: the prompt is empty");
  const int64_t n = static_cast<int64_t>(tokens.size());
  int64_t limit = limits::kMaxPromptTokens;
  if (config.max_position_embeddings > 0) {
    limit = std::min<int64_t>(limit, config.max_position_embeddings);
  }
  if (n > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: prompt of ", n, " tokens exceeds the maximum ", limit));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("tokens[", i, "] = ", tokens[i],
                                                     " is outside the vocabulary [0, ",
                                                     config.vocab_size, ")"));
    }
  }
  if (max_tokens < 0) return absl::OkStatus();
  if (max_tokens < 1 || max_tokens > limits::kMaxGenerateTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens must be in [1, ", limits::kMaxGenerateTokens, "], got ", max_tokens));
  }
  if (config.max_position_embeddings > 0 && n + max_tokens > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("prompt (", n, ") + max_tokens (", max_tokens,
                                                   ") exceeds the model's max_position_embeddings ",
                                                   config.max_position_embeddings));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::kv
