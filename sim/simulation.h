#pragma once

// Simulate: one run of `kvrelay simulate`. Each trace request becomes a GenerateRequest whose
// prompt tokens derive from its block ids (requests that share leading ids share leading
// tokens, so their KV chains share a prefix as the trace says), arriving at its timestamp
// times the time scale (as bench-serve's); the gateway's own GenerateCall runs it on the
// SimCluster. The report gives latency percentiles, goodput under an SLO, the prefix hit rate,
// bytes moved, store calls, queueing and utilisation per role, and the first bottleneck (the
// resource busiest over the run).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cachestore/sim/trace_replay.h"
#include "kv/model_layout.h"
#include "sim/cluster.h"
#include "sim/profile.h"

namespace kvrelay::sim {

struct TrafficSpec {
  double time_scale = 1.0;   // timestamps times this, as bench-serve's: 0.5 sends twice as fast
  int32_t populations = 1;   // independent copies of the trace's users (distinct block ids)
  int64_t max_requests = 0;  // 0: the whole trace (times populations)
  int32_t max_output_tokens = 4096;
  int64_t trace_offset = 0;          // skip the trace's first requests (bench-serve's too)
  int32_t tokens_per_hash_id = 512;  // prompt tokens per trace block id (bench-serve's flag)
  absl::Duration timeout = absl::Seconds(60);  // each request's deadline
  absl::Duration slo_ttft = absl::Seconds(2);
  absl::Duration slo_tpot = absl::Milliseconds(250);
};

struct RequestRecord {
  double arrival_s = 0;
  bool ok = false;
  std::string code;  // absl status code name
  double ttft_ms = -1;
  double tpot_ms = -1;
  double e2e_ms = -1;
  int32_t prompt_tokens = 0;
  int32_t hit_tokens = 0;
  int32_t generated = 0;
  int32_t attempts = 0;
  int64_t pushed_bytes = 0;
  int64_t fetched_bytes = 0;
  std::string prefill;
  std::string decode;
  std::string prefix_source;
};

struct Percentiles {
  double p50 = 0, p90 = 0, p99 = 0, mean = 0;
};

struct SimReport {
  int64_t requests = 0;
  int64_t ok = 0;
  int64_t refused = 0;    // RESOURCE_EXHAUSTED
  int64_t failed = 0;     // any other failure
  double duration_s = 0;  // first arrival to last completion, simulated
  double offered_rps = 0;
  double goodput_rps = 0;  // ok and within both SLOs, per simulated second
  Percentiles ttft_ms, tpot_ms, e2e_ms;
  double hit_rate = 0;  // prompt tokens found cached / prompt tokens, over ok requests
  // Of those prompt tokens, the share prefill nodes read back from their own disk tier, and the
  // blocks Promote read from a node's disk into its DRAM for another node or a decode node.
  double disk_hit_rate = 0;
  int64_t promoted_blocks = 0;
  uint64_t pushed_bytes = 0;
  uint64_t fetched_bytes = 0;
  double store_calls_per_s = 0;
  double store_blocks_per_s = 0;  // blocks those calls carried (the store's work scales with it)
  std::vector<NodeUsage> nodes;
  std::string bottleneck;  // the resource with the highest utilisation
  double bottleneck_utilisation = 0;
  // The simulation's own cost.
  int64_t events = 0;
  int64_t peak_processes = 0;
  double wall_s = 0;
  std::vector<RequestRecord> records;

  std::string ToJson() const;  // everything but the per-request records
  std::string RecordsCsv() const;
  std::string Summary() const;  // a few lines for people
};

absl::StatusOr<SimReport> Simulate(const std::vector<cachestore::sim::TraceRequest>& trace,
                                   const ClusterSpec& cluster, const TrafficSpec& traffic,
                                   const HardwareProfile& profile, const kv::ModelLayout& layout);

// The prompt tokens of a trace request (population `population`): block id b's i-th token is
// a fixed function of (b, population, i), `tokens_per_id` of them per id (the trace's 512, or
// fewer to shrink prompts as bench-serve --tokens-per-hash-id does), the last block cut to the
// input length scaled the same way.
std::vector<int32_t> TracePromptTokens(const cachestore::sim::TraceRequest& request,
                                       int32_t population, int32_t tokens_per_id = 512);

}  // namespace kvrelay::sim
