#pragma once

// Sends a workload through a gateway and measures every request from the client's side.
//
// Open loop (default): request i is sent at its arrival time, by one of `concurrency` client
// threads; when all are busy it goes late (counted as a late send, so a saturated client is never
// mistaken for a slow service). Closed loop: arrival times are ignored and `concurrency` requests
// are kept in flight. Always bounded: at most max_requests are sent, none after max_duration, and
// every request's deadline is capped at the end of the run.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "cli/bench_serve/stats.h"
#include "cli/bench_serve/workload.h"
#include "gateway/client/gateway_client.h"

namespace kvrelay::cli::bench_serve {

struct RunOptions {
  int32_t concurrency = 32;
  bool closed_loop = false;
  int64_t max_requests = 1000;
  absl::Duration max_duration = absl::Minutes(10);
  absl::Duration timeout = absl::Seconds(60);  // per request
  std::string model;                           // "" = the gateway's one model
  std::string tenant = "bench";
  float temperature = 0.0f;  // seeds are the request index
  std::string label;         // progress line prefix, e.g. "rate 2/s"
  bool progress = true;      // live line on stderr
};

struct RunResult {
  absl::Time start;                    // wall clock when the run began
  std::vector<RequestRecord> records;  // the requests sent, in workload order
  int64_t not_sent = 0;                // workload requests left when a bound stopped the run
  bool stopped_by_duration = false;
};

// Request i goes to gateways[i % size]. A gateway that refuses it before any token (see
// RetryOnNextGateway) sends it to the next gateway, round the list, while its deadline allows
// (RequestRecord::gateway_retries counts these; the request's deadline runs from its first
// send). REQUIRES: workload sorted by arrival_s; gateways non-empty, each outliving the call.
RunResult RunLoad(const std::vector<const gateway::client::GatewayClient*>& gateways,
                  const std::vector<WorkloadRequest>& workload, const RunOptions& options);

// Whether a request that ended with `status` after `tokens_received` tokens goes again to the
// next gateway: only when the gateway refused it before any token, as a terminating gateway does
// — UNAVAILABLE or CANCELLED with no ErrorInfo (what gRPC itself answers: connection refused; a
// call that reaches a server after its Shutdown began is cancelled, and bench-serve never
// cancels a call itself; the gateway's own refusals carry ErrorInfo naming who failed) or
// UNAVAILABLE with ErrorInfo{ROLE_GATEWAY, FAILURE_DRAINING}. A failure the gateway decided (no
// healthy worker, a worker's error, a deadline) is the service's answer and stays a failure.
// Decided from the status code and the structured ErrorInfo only, never from the message. (The
// harness's stand-in for a load balancer: a client behind a Kubernetes Service never reaches a
// terminating pod.)
bool RetryOnNextGateway(const absl::Status& status, int64_t tokens_received);

// The generation request bench-serve sends for `w` (also what --verify replays co-located).
gateway::client::GenerationRequest MakeGenerationRequest(const WorkloadRequest& w,
                                                         float temperature);

}  // namespace kvrelay::cli::bench_serve
