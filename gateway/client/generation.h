#pragma once

// One generation as a client sees it: what it asks (GenerationRequest) and what comes back
// (GenerationResult: the tokens and the gateway's GenerateSummary figures). Shared by the
// typed Gateway client (gateway_client.h) and the co-located reference generator in cli/, so
// that a disaggregated result and its reference compare field for field.
//
// Plain data; no thread-safety concerns.

#include <cstdint>
#include <string>
#include <vector>

namespace kvrelay::gateway::client {

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

}  // namespace kvrelay::gateway::client
