#include "cli/bench_serve/workload.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace kvrelay::cli::bench_serve {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A small deterministic generator (std:: distributions differ between standard libraries).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return SplitMix64(state_++ * 0x2545f4914f6cdd1dull + 1); }
  double Uniform01() { return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  uint64_t state_;
};

absl::Status CheckPromptOptions(const PromptOptions& o) {
  if (o.tokens_per_hash_id < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens-per-hash-id must be >= 1, got ", o.tokens_per_hash_id));
  }
  if (o.trace_block_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--trace-block-tokens must be >= 1, got ", o.trace_block_tokens));
  }
  if (o.vocab_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("vocab size must be >= 1, got ", o.vocab_size));
  }
  if (o.max_prompt_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-prompt-tokens must be >= 1, got ", o.max_prompt_tokens));
  }
  if (o.max_output_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-output-tokens must be >= 1, got ", o.max_output_tokens));
  }
  if (o.cache_block_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--block-tokens must be >= 1, got ", o.cache_block_tokens));
  }
  return absl::OkStatus();
}

}  // namespace

int32_t BlockToken(uint64_t seed, int64_t hash_id, int32_t offset, int32_t vocab_size) {
  const uint64_t h = SplitMix64(SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(hash_id))) +
                                static_cast<uint64_t>(offset));
  return static_cast<int32_t>(h % static_cast<uint64_t>(vocab_size));
}

std::vector<int32_t> DerivePrompt(const std::vector<int64_t>& ids, int64_t input_length,
                                  const PromptOptions& o, bool* truncated, int32_t* blocks) {
  std::vector<int32_t> prompt;
  *truncated = false;
  *blocks = 0;
  const int64_t n = static_cast<int64_t>(ids.size());
  for (int64_t k = 0; k < n; ++k) {
    int64_t len = o.tokens_per_hash_id;
    if (k == n - 1) {
      // The last id covers what is left of the input (1 .. trace_block_tokens trace tokens),
      // scaled to prompt tokens and rounded up so it is never empty.
      const int64_t rest = std::clamp<int64_t>(input_length - o.trace_block_tokens * (n - 1), 1,
                                               o.trace_block_tokens);
      len = std::max<int64_t>(
          1, (rest * o.tokens_per_hash_id + o.trace_block_tokens - 1) / o.trace_block_tokens);
    }
    if (static_cast<int64_t>(prompt.size()) + len > o.max_prompt_tokens) {
      *truncated = true;
      if (prompt.empty()) {  // even the first id is too long: keep what fits of it
        for (int32_t j = 0; j < o.max_prompt_tokens; ++j) {
          prompt.push_back(BlockToken(o.seed, ids[k], j, o.vocab_size));
        }
        *blocks = 1;
      }
      break;
    }
    for (int32_t j = 0; j < len; ++j) prompt.push_back(BlockToken(o.seed, ids[k], j, o.vocab_size));
    ++*blocks;
  }
  return prompt;
}

void ComputeIdealHits(const std::vector<std::vector<int64_t>>& ids_per_request,
                      int32_t tokens_per_hash_id, int32_t cache_block_tokens,
                      std::vector<WorkloadRequest>* requests) {
  std::unordered_set<int64_t> seen;
  for (size_t i = 0; i < requests->size() && i < ids_per_request.size(); ++i) {
    WorkloadRequest& r = (*requests)[i];
    const std::vector<int64_t>& ids = ids_per_request[i];
    int32_t hit = 0;
    while (hit < r.blocks && seen.count(ids[hit]) > 0) ++hit;
    r.ideal_hit_blocks = hit;
    const int64_t prompt_tokens = static_cast<int64_t>(r.prompt.size());
    const int64_t hit_tokens =
        std::min<int64_t>(static_cast<int64_t>(hit) * tokens_per_hash_id, prompt_tokens);
    // The gateway caches whole KV blocks and always computes the last prompt token.
    const int64_t cacheable = (prompt_tokens - 1) / cache_block_tokens * cache_block_tokens;
    r.ideal_cached_tokens =
        std::min(hit_tokens / cache_block_tokens * cache_block_tokens, cacheable);
    for (int32_t k = 0; k < r.blocks; ++k) seen.insert(ids[k]);
  }
}

absl::StatusOr<std::vector<WorkloadRequest>> BuildTraceWorkload(
    const std::vector<TraceEntry>& trace, const PromptOptions& options, double time_scale,
    int64_t max_requests) {
  if (absl::Status s = CheckPromptOptions(options); !s.ok()) return s;
  if (!(time_scale >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--time-scale must be >= 0, got ", time_scale));
  }
  const size_t n =
      std::min<size_t>(trace.size(), static_cast<size_t>(std::max<int64_t>(0, max_requests)));
  std::vector<WorkloadRequest> requests(n);
  std::vector<std::vector<int64_t>> ids(n);
  const double t0 = trace.empty() ? 0 : trace[0].timestamp_ms;
  for (size_t i = 0; i < n; ++i) {
    const TraceEntry& e = trace[i];
    WorkloadRequest& r = requests[i];
    r.index = static_cast<int64_t>(i);
    r.trace_line = e.line;
    r.arrival_s = (e.timestamp_ms - t0) / 1000.0 * time_scale;
    r.prompt = DerivePrompt(e.hash_ids, e.input_length, options, &r.truncated, &r.blocks);
    r.max_tokens =
        static_cast<int32_t>(std::min<int64_t>(e.output_length, options.max_output_tokens));
    ids[i] = e.hash_ids;
  }
  ComputeIdealHits(ids, options.tokens_per_hash_id, options.cache_block_tokens, &requests);
  return requests;
}

absl::StatusOr<std::vector<WorkloadRequest>> BuildSyntheticWorkload(const SyntheticOptions& s,
                                                                    const PromptOptions& o) {
  if (absl::Status st = CheckPromptOptions(o); !st.ok()) return st;
  if (s.num_requests < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num-requests must be >= 1, got ", s.num_requests));
  }
  if (s.input_tokens < 1 || s.input_tokens > o.max_prompt_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("--input-tokens must be in [1, ",
                                                   o.max_prompt_tokens, "], got ", s.input_tokens));
  }
  if (s.output_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--output-tokens must be >= 1, got ", s.output_tokens));
  }
  if (!(s.shared_prefix_ratio >= 0 && s.shared_prefix_ratio <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared-prefix-ratio must be in [0, 1], got ", s.shared_prefix_ratio));
  }
  if (s.prefix_groups < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefix-groups must be >= 1, got ", s.prefix_groups));
  }
  if (!(s.rate >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--rate must be >= 0, got ", s.rate));
  }
  PromptOptions prompt = o;
  prompt.trace_block_tokens = o.tokens_per_hash_id;  // synthetic ids are prompt blocks
  const int64_t tpb = o.tokens_per_hash_id;
  const int64_t blocks = (s.input_tokens + tpb - 1) / tpb;
  const int64_t shared_blocks =
      std::min<int64_t>(blocks, std::llround(s.shared_prefix_ratio * s.input_tokens / tpb));
  // Shared ids live far above the unique ones so the two ranges never meet.
  constexpr int64_t kSharedBase = int64_t{1} << 40;
  constexpr int64_t kGroupStride = int64_t{1} << 20;
  Rng rng(o.seed ^ 0x5eedull);
  int64_t next_unique = 0;
  double t = 0;
  std::vector<WorkloadRequest> requests(static_cast<size_t>(s.num_requests));
  std::vector<std::vector<int64_t>> ids(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const int64_t group = static_cast<int64_t>(rng.Next() % static_cast<uint64_t>(s.prefix_groups));
    for (int64_t k = 0; k < blocks; ++k) {
      ids[i].push_back(k < shared_blocks ? kSharedBase + group * kGroupStride + k : next_unique++);
    }
    WorkloadRequest& r = requests[i];
    r.index = static_cast<int64_t>(i);
    if (s.rate > 0 && i > 0) {
      t += s.poisson ? -std::log(1.0 - rng.Uniform01()) / s.rate : 1.0 / s.rate;
    }
    r.arrival_s = t;
    r.prompt = DerivePrompt(ids[i], s.input_tokens, prompt, &r.truncated, &r.blocks);
    r.max_tokens = std::min(s.output_tokens, o.max_output_tokens);
  }
  ComputeIdealHits(ids, o.tokens_per_hash_id, o.cache_block_tokens, &requests);
  return requests;
}

void ScaleToRate(double rate, std::vector<WorkloadRequest>* requests) {
  if (requests->empty() || !(rate > 0)) return;
  const double span = requests->back().arrival_s - requests->front().arrival_s;
  const double n = static_cast<double>(requests->size());
  if (span <= 0 || requests->size() < 2) {
    for (size_t i = 0; i < requests->size(); ++i) (*requests)[i].arrival_s = i / rate;
    return;
  }
  const double factor = ((n - 1) / span) / rate;  // current rate / wanted rate
  const double start = requests->front().arrival_s;
  for (WorkloadRequest& r : *requests) r.arrival_s = (r.arrival_s - start) * factor;
}

}  // namespace kvrelay::cli::bench_serve
