#pragma once

// Mooncake-format request traces (FAST'25 release; see ../shared/data/traces/README.md): one JSON
// object per line with `timestamp` (ms from the trace's start), `input_length` and
// `output_length` (tokens) and `hash_ids` (chained prefix-block ids, one per trace block of 512
// tokens: two requests share a prefix exactly as far as their leading ids agree).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvrelay::cli::bench_serve {

struct TraceEntry {
  int64_t line = 0;  // 1-based line of the trace file, for messages
  double timestamp_ms = 0;
  int64_t input_length = 0;       // >= 1
  int64_t output_length = 0;      // >= 1
  std::vector<int64_t> hash_ids;  // non-empty, each >= 0
};

// Parses JSON lines (blank lines skipped) and returns the entries sorted by timestamp (stable).
// InvalidArgument naming `source` and the line for the first bad line: not a JSON object, a
// missing field, a field of the wrong type, a negative or zero length, a negative timestamp or
// hash id, an empty hash_ids; also for a trace without any request.
absl::StatusOr<std::vector<TraceEntry>> ParseMooncakeTrace(absl::string_view text,
                                                           absl::string_view source);

// Reads and parses a file; NotFound naming the path when it cannot be read.
absl::StatusOr<std::vector<TraceEntry>> LoadMooncakeTrace(const std::string& path);

}  // namespace kvrelay::cli::bench_serve
