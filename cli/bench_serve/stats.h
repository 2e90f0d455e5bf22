#pragma once

// Per-request measurements and their aggregates: percentiles, throughput, goodput against SLOs,
// prefix hit rate against the ideal, errors by status code, and what each fault cost.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvrelay::cli::bench_serve {

struct RequestRecord {
  int64_t index = 0;
  int64_t trace_line = 0;
  double scheduled_s = 0;  // arrival time in the workload
  double send_s = 0;       // when it was sent, from the start of the run
  double end_s = 0;        // when the stream ended
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string error;  // the status message when not OK
  // Who failed, from the status's structured ErrorInfo (empty when it names nobody).
  std::string error_node_id, error_address;
  bool cut = false;     // ended by --max-duration, not by the service
  double ttft_ms = -1;  // client-side: send to first streamed token; -1 = none came
  double e2e_ms = 0;
  double tpot_ms = -1;         // (e2e - ttft) / (tokens - 1); -1 with fewer than 2 tokens
  std::vector<double> itl_ms;  // gap before each streamed token after the first
  int32_t prompt_tokens = 0;
  int32_t max_tokens = 0;
  int32_t output_tokens = 0;
  int32_t cached_tokens = 0;  // from the gateway's summary (prefix hits)
  int32_t computed_tokens = 0;
  int64_t ideal_cached_tokens = 0;
  int64_t transferred_bytes = 0;  // KV pushed prefill -> decode
  int64_t fetched_bytes = 0;      // KV fetched for prefix reuse
  std::string prefix_source;      // GenerateSummary.prefix_source
  int32_t attempts = 0;
  std::string prefill_worker, decode_worker;
  std::string gateway;          // the address of the gateway that answered (the last one tried)
  int32_t gateway_retries = 0;  // times sent again to the next gateway (see RetryOnNextGateway)
  std::vector<int32_t> tokens;  // streamed tokens (kept for --verify)
  int64_t wrong_tokens = -1;    // -1 = not verified
  bool ok() const { return code == absl::StatusCode::kOk; }
};

// Linear interpolation between closest ranks (numpy's default); NaN for no values. p in [0, 100].
double Percentile(std::vector<double> values, double p);

struct Distribution {
  int64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;  // NaN when count == 0
};
Distribution Distribute(const std::vector<double>& values);

// --slo ttft=500ms,tpot=50ms,e2e=10s (units ms or s; a bare number is ms). A request is good when
// it succeeded and meets every given bound (TPOT only when it has one).
struct Slo {
  std::optional<double> ttft_ms, tpot_ms, e2e_ms;
  bool empty() const { return !ttft_ms && !tpot_ms && !e2e_ms; }
};
absl::StatusOr<Slo> ParseSlo(const std::string& text);
bool MeetsSlo(const RequestRecord& r, const Slo& slo);

// One fault from the cluster scripts' events file.
struct FaultEvent {
  double start_s = 0;  // from the start of the run
  double end_s = 0;    // == start_s for an instant fault; the run's end for a lasting one
  std::string label;   // "stop decode-0 for 6s"
};

// Events file lines: `<start unix s> <end unix s | -> <label...>`; '#' lines, '@' lines (see
// ParseNodeAddresses) and blank lines skipped. `run_start_unix` maps them to run time.
// InvalidArgument naming the line otherwise.
absl::StatusOr<std::vector<FaultEvent>> ParseFaultEvents(const std::string& text,
                                                         double run_start_unix, double run_end_s);

struct FaultCost {
  FaultEvent fault;
  double window_end_s = 0;   // the next fault's start, or the end of the run
  int64_t requests = 0;      // requests that ended in [start, window_end)
  int64_t failed = 0;        // of those, failed (not counting --max-duration cuts)
  int64_t slo_missed = 0;    // of those, succeeded but missed the SLO
  int64_t wrong_tokens = 0;  // of those, verified tokens that differ from the reference
  double ttft_p99_ms = 0;
  // A lasting fault (a rollout): OK requests sent while it lasted, [start, end], and their p99
  // TTFT, beside the p99 of those sent and ended before it (steady state). NaN when none.
  int64_t requests_during = 0;
  double ttft_p99_during_ms = 0;
  double ttft_p99_before_ms = 0;
  // From the fault's start until a request completes well after the last bad (failed or
  // SLO-missing) one in the window: 0 when none was bad, -1 when none completed well after.
  double recovery_s = 0;
};
std::vector<FaultCost> CostOfFaults(const std::vector<RequestRecord>& records,
                                    const std::vector<FaultEvent>& faults, const Slo& slo,
                                    double run_end_s);

struct Summary {
  double duration_s = 0;  // first send to last end
  int64_t requests = 0;   // sent
  int64_t ok = 0, failed = 0, cut = 0;
  double request_rate = 0;       // completed OK per second
  double output_token_rate = 0;  // output tokens (OK requests) per second
  double goodput = 0;            // good requests per second (== request_rate without an SLO)
  int64_t good = 0;
  Distribution ttft_ms, tpot_ms, itl_ms, e2e_ms;
  int64_t prompt_tokens = 0, cached_tokens = 0, computed_tokens = 0, ideal_cached_tokens = 0;
  int64_t output_tokens = 0;
  double hit_rate = 0;        // cached / prompt tokens over OK requests
  double ideal_hit_rate = 0;  // the same with an infinite cache and one request at a time
  int64_t transferred_bytes = 0, fetched_bytes = 0;
  std::map<std::string, int64_t> errors;             // status code name -> count
  std::map<std::string, std::string> error_example;  // status code name -> first message
  int64_t verified = 0;                              // requests compared with the reference
  int64_t wrong_tokens = 0;                          // over the verified ones
  int64_t late_sends = 0;  // sent > 100 ms after their arrival time (client saturated)
  // Sends again to the next gateway after one refused before any token (it drained or
  // restarted), over all requests; and how many requests needed at least one.
  int64_t gateway_retries = 0, retried_requests = 0;
};
Summary Summarize(const std::vector<RequestRecord>& records, const Slo& slo);

// "OK", "UNAVAILABLE", ... as gRPC spells them.
std::string CodeName(absl::StatusCode code);

}  // namespace kvrelay::cli::bench_serve
