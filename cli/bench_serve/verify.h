#pragma once

// --verify: regenerates requests with prefill and decode co-located in this process (the
// reference disaggregated serving must match token for token, cli/colocated.h) and counts
// the streamed tokens that differ.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cli/bench_serve/stats.h"
#include "cli/bench_serve/workload.h"

namespace kvrelay::cli::bench_serve {

// Tokens of `streamed` that are wrong against `reference`: positions that differ, tokens past the
// reference's end, and, for a request reported complete (`complete`), tokens missing at the end.
int64_t CountWrongTokens(const std::vector<int32_t>& streamed,
                         const std::vector<int32_t>& reference, bool complete);

// Sets wrong_tokens on up to `sample` records (spread evenly; all when sample <= 0 or >= size)
// that streamed at least one token. `workload` is indexed by RequestRecord::index. Errors from
// loading the model or from the reference itself are returned (the run's figures stay valid).
absl::Status VerifyRecords(const std::string& model_dir, int32_t threads, float temperature,
                           const std::vector<WorkloadRequest>& workload, int64_t sample,
                           std::vector<RequestRecord>* records);

}  // namespace kvrelay::cli::bench_serve
