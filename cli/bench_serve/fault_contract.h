#pragma once

// The fault contract a cluster must keep (issue 10), checked from the request records of one run
// and the cluster scripts' events file:
//   - no wrong token (checked by --verify, reported beside this);
//   - the requests a fault may fail are at most those in flight on the faulted node when it
//     struck (every request touches the store, so for the store, or a replica 'store-i' of an
//     HA set, that is all in flight); a planned restart or scale-in ('drain NODE', 'rollout
//     ROLE', 'retire NODE': SIGTERM drain) fails none;
//   - a node that comes back (SIGCONT, link up, restart, drain, or a node added) serves a
//     request again within `serve_again` (a gateway: one it answered, RequestRecord::gateway);
//     after the store comes back, a request is served with prefix hits within `hits_again`;
//     (judged only over requests sent before the next fault struck, and for hits only when a
//     request that could hit was sent);
//   - latency: the p99 TTFT of the requests sent while a fault is active (from its start until
//     `serve_again` after it is back), none of them in flight when it struck, stays within
//     `ttft_factor` x the p99 TTFT of the requests no fault touched plus `ttft_floor`;
//   - a worker that comes back gets its fair share again: of the requests its role served in
//     the `serve_again` window after its own serve-again limit, it serves at least
//     `fair_share` x 1 / (the role's serving nodes);
//   - no request outlives its deadline (--timeout) by more than `deadline_slack`;
//   - no request fails while no fault is active;
//   - a duplicate node id is refused.
// A verdict is data; the caller decides what to do with violations (bench-serve exits 4).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/bench_serve/stats.h"

namespace kvrelay::cli::bench_serve {

// `--fault-contract serve-again=5s,hits-again=5s,deadline-slack=1s,ttft-factor=2,
// ttft-floor=750ms,fair-share=0.5` (any subset; defaults below). InvalidArgument naming the key
// otherwise.
struct FaultContract {
  double serve_again_s = 5;
  double hits_again_s = 5;
  double deadline_slack_s = 1;
  // One bounded wait on a dependency per process (a 500 ms store call, then its probe) fits;
  // the same wait on every request does not.
  double ttft_factor = 2;
  double ttft_floor_s = 0.75;
  double fair_share = 0.5;
};
absl::StatusOr<FaultContract> ParseFaultContract(const std::string& text);

// `@node NAME ADDRESS[,ADDRESS...]` lines of the events file: the addresses a gateway may name a
// node by (its gRPC and data-plane addresses). Other lines are ignored.
std::map<std::string, std::vector<std::string>> ParseNodeAddresses(const std::string& text);

struct FaultVerdict {
  FaultEvent fault;
  std::string action, target;  // the label's first two words: "stop", "decode-0"
  double recovered_s = -1;     // when the node was back (-1: it does not come back)
  int64_t in_flight = 0;       // requests in flight when the fault struck
  int64_t in_flight_on_target = 0;
  int64_t failed = 0;          // failed requests attributed to this fault
  double served_again_s = -1;  // recovery -> first OK request sent after it served by the node
  double hits_again_s = -1;    // store: recovery -> first OK request sent after it with hits
  // Latency while the fault is active: requests sent in the window, not in flight at its start.
  int64_t window_requests = 0;
  double window_ttft_p99_ms = -1;
  // Share of its role's requests the node served after it was back (-1: not judged).
  double share = -1;
  double fair_share = -1;  // 1 / the role's serving nodes
  std::vector<std::string> violations;
  std::vector<std::string> not_judged;  // clauses the run gave no evidence for, and why
};

struct ContractReport {
  std::vector<FaultVerdict> verdicts;
  int64_t failed_without_fault = 0;  // failed before any fault struck
  int64_t over_deadline = 0;         // requests that ended later than --timeout + slack
  double max_e2e_ms = 0;
  int64_t steady_requests = 0;  // OK requests no fault touched (the latency baseline)
  double steady_ttft_p99_ms = -1;
  std::vector<std::string> violations;  // all of them, the verdicts' included
  bool kept() const { return violations.empty(); }
};

// `timeout_s` is the per-request deadline the run used.
ContractReport CheckFaultContract(const std::vector<RequestRecord>& records,
                                  const std::vector<FaultEvent>& faults,
                                  const std::map<std::string, std::vector<std::string>>& nodes,
                                  const FaultContract& contract, double timeout_s);

}  // namespace kvrelay::cli::bench_serve
