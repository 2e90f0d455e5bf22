#pragma once

// What bench-serve sends: a list of requests with arrival times and prompt token ids, built from a
// Mooncake trace or generated (synthetic), always deterministically from the options and a seed.
//
// Prompts come from prefix-block ids: a block id always expands to the same tokens, so requests
// whose leading ids agree share a prompt prefix exactly that far, as in the trace. A synthetic
// workload is expressed the same way (shared-prefix groups = shared leading ids), so one
// derivation, and one ideal hit-rate computation, covers both.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/bench_serve/trace.h"

namespace kvrelay::cli::bench_serve {

struct PromptOptions {
  int32_t tokens_per_hash_id = 512;  // prompt tokens per block id (the trace's is 512)
  int32_t trace_block_tokens = 512;  // trace tokens per block id (Mooncake: 512)
  int32_t vocab_size = 0;            // token ids are drawn from [0, vocab_size)
  int64_t max_prompt_tokens = 0;     // > 0; longer prompts are cut at a block-id boundary
  int32_t max_output_tokens = 0;     // > 0; the trace's output_length is capped to it
  int32_t cache_block_tokens = 16;   // the served model's KV block (for the ideal hit rate)
  uint64_t seed = 0;
};

struct WorkloadRequest {
  int64_t index = 0;       // position in the workload
  int64_t trace_line = 0;  // 0 for synthetic requests
  double arrival_s = 0;    // send time, from the start of the run
  std::vector<int32_t> prompt;
  int32_t max_tokens = 1;
  bool truncated = false;           // the prompt was cut to max_prompt_tokens
  int32_t blocks = 0;               // block ids in the (possibly cut) prompt
  int32_t ideal_hit_blocks = 0;     // leading ids seen in an earlier request of the workload
  int64_t ideal_cached_tokens = 0;  // what an infinite cache could serve of this prompt
};

// The token at position `offset` of the block with id `hash_id`. Pure: the same arguments always
// give the same token, in [0, vocab_size).
int32_t BlockToken(uint64_t seed, int64_t hash_id, int32_t offset, int32_t vocab_size);

// The prompt of `ids` for an input of `input_length` trace tokens: every id but the last
// expands to tokens_per_hash_id tokens, the last to its share of the remainder (at least one).
// Cut (whole ids) to max_prompt_tokens; `truncated`/`blocks` report what was kept.
std::vector<int32_t> DerivePrompt(const std::vector<int64_t>& ids, int64_t input_length,
                                  const PromptOptions& options, bool* truncated, int32_t* blocks);

// InvalidArgument for options out of range. Arrival times: the trace's timestamps (relative to
// its first request) times `time_scale` (0.1 replays ten times faster). Only the first
// `max_requests` entries are used. Ideal hits are computed over the requests used, in order.
absl::StatusOr<std::vector<WorkloadRequest>> BuildTraceWorkload(
    const std::vector<TraceEntry>& trace, const PromptOptions& options, double time_scale,
    int64_t max_requests);

struct SyntheticOptions {
  int64_t num_requests = 100;
  int32_t input_tokens = 256;
  int32_t output_tokens = 16;
  // Fraction of each prompt that is a prefix shared with the other requests of its group.
  double shared_prefix_ratio = 0.0;
  int32_t prefix_groups = 4;
  double rate = 0;      // requests per second; 0 = all at once (closed loop by concurrency)
  bool poisson = true;  // exponential gaps (else fixed 1/rate)
};

// Prompts use PromptOptions::tokens_per_hash_id as their block (so the input length is exact).
absl::StatusOr<std::vector<WorkloadRequest>> BuildSyntheticWorkload(
    const SyntheticOptions& synthetic, const PromptOptions& options);

// Fills ideal_hit_blocks / ideal_cached_tokens from the block ids of each request in order.
// Cached tokens count whole KV blocks of cache_block_tokens and leave the last prompt token
// to compute, as the gateway does.
void ComputeIdealHits(const std::vector<std::vector<int64_t>>& ids_per_request,
                      int32_t tokens_per_hash_id, int32_t cache_block_tokens,
                      std::vector<WorkloadRequest>* requests);

// Arrival times rescaled so that the mean request rate is `rate` (> 0), keeping the pattern.
void ScaleToRate(double rate, std::vector<WorkloadRequest>* requests);

}  // namespace kvrelay::cli::bench_serve
