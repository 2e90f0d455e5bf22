#pragma once

// Deterministic generators of Mooncake-format request traces with shapes the shared trace does
// not have, so eviction policies are developed and tested on more than one workload. Same seed,
// same shape, same request count -> the same trace on every platform (own integer arithmetic, no
// <random> distributions).
//
// Token model (as a serving stack sees it): a prompt of n tokens is ceil(n / 512) blocks; full
// blocks are chained ids shared by every request with the same leading tokens; a trailing partial
// block gets a fresh id (the next turn appends tokens to it, so its hash changes).
//
// Shapes:
//   multiturn  chat: 24 system prompts (Zipf popularity), conversations whose context grows turn
//              by turn (assistant answer + next user message), ~40 interleaved at a time
//   agent      tool/agent loops: 4 agents with long system prompts + tool schemas (8k-24k
//              tokens), episodes of 5-40 steps each appending a tool call and its output
//   scan       a hot set of 64 short prompts (Zipf) interleaved with one-off long documents
//              (10k-60k tokens) on half the requests
//   shift      first half agent loops, second half multi-turn chat on new prefixes

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/sim/trace_replay.h"

namespace kvrelay::cachestore::sim {

inline constexpr int64_t kTraceBlockTokens = 512;

std::vector<std::string> TraceShapeNames();
// InvalidArgument naming the shape / the count (1..10,000,000) otherwise.
absl::StatusOr<std::vector<TraceRequest>> GenerateTrace(std::string_view shape, uint64_t seed,
                                                        int64_t requests);
// One JSON object per line: timestamp (ms), input_length, output_length, hash_ids.
std::string TraceToJsonLines(const std::vector<TraceRequest>& trace);

}  // namespace kvrelay::cachestore::sim
