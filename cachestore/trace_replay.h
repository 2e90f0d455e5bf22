#pragma once

// Trace replay: runs a Mooncake-format request trace (one JSON object per line with `hash_ids`,
// chained 512-token block ids; see ../shared/data/traces/README.md) through the same BlockIndex
// and EvictionPolicy code the cache store serves with, at a fixed capacity in blocks.
//
// Per request: its hits are the longest run of leading blocks that are committed; then every
// block is accessed in order (inserted if missing, evicting when the index is full). The
// request's blocks are leased while it is replayed, as a real request pins what it reads, so a
// request never evicts its own prefix.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvrelay::cachestore {

struct TraceRequest {
  std::vector<uint64_t> hash_ids;
};

// Parses JSON lines; blank lines are skipped. InvalidArgument naming the line otherwise.
absl::StatusOr<std::vector<TraceRequest>> ParseTrace(std::string_view text);
absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path);

struct ReplayResult {
  std::string policy;
  int64_t capacity_blocks = 0;
  int64_t requests = 0;
  int64_t blocks = 0;      // all blocks of all requests
  int64_t hit_blocks = 0;  // leading cached blocks
  int64_t evictions = 0;
  double hit_rate() const { return blocks == 0 ? 0.0 : static_cast<double>(hit_blocks) / blocks; }
};

// InvalidArgument for a non-positive capacity or an unknown policy.
absl::StatusOr<ReplayResult> ReplayTrace(const std::vector<TraceRequest>& trace,
                                         int64_t capacity_blocks, std::string_view policy);

}  // namespace kvrelay::cachestore
