#pragma once

// The one prompt validator: gateway, prefill and decode check a request's prompt the same way
// against the same limits (proto/limits.h) and the model's config, and say what is wrong.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kv/hf_config.h"

namespace kvrelay::kv {

// InvalidArgument naming the field when `tokens` is empty, longer than the limit or the model's
// max_position_embeddings, holds an id outside [0, vocab_size), or when max_tokens is outside
// [1, kMaxGenerateTokens] or prompt + max_tokens exceeds max_position_embeddings.
// max_tokens < 0 skips the max_tokens checks (callers that generate nothing).
absl::Status ValidatePrompt(absl::Span<const int32_t> tokens, int32_t max_tokens,
                            const ModelConfig& config);

}  // namespace kvrelay::kv
