#pragma once

// GenerateCall: one Generate request after admission, from its first attempt to its summary.
// Each attempt picks a decode and a prefill worker from the WorkerSet and drives Reserve
// (decode) -> Prefill -> Generate (decode stream), forwarding tokens to the sink as they come.
// Every step has its own timeout below the request's deadline. A failed step is blamed on the
// node its ErrorInfo names (the node called when it names none); that node's breaker opens and
// the next attempt, on another pair, continues from the tokens already streamed. The caller's
// own deadline or cancellation and invalid input are never counted against a worker: they end
// the call at once. Overload is not a failure: a worker that refuses for capacity
// (RESOURCE_EXHAUSTED, FAILURE_OVERLOADED) is marked busy, never blamed, and not asked again
// by this request; the next attempt tries another worker while the deadline allows. Nor is a
// drain (FAILURE_DRAINING: the worker got SIGTERM): that worker is skipped, no attempt is spent
// and the request goes on with another. When every
// usable decode (or prefill) worker is busy the call ends at once with RESOURCE_EXHAUSTED
// (ROLE_GATEWAY, FAILURE_OVERLOADED, naming what is full and the predicted wait); one that runs
// out of attempts, workers or time ends with the last failure (a status naming the node or
// step that failed).
//
// Made and run by Gateway::Generate, one per request; tests drive it over fake endpoints.
//
// One thread at a time (Run once). Everything in GenerateCallDeps, the request, the sink and
// the cancel callback must outlive the call.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "gateway/gateway_metrics.h"
#include "gateway/quota.h"
#include "gateway/worker_set.h"
#include "kv/block_hash.h"
#include "kv/model_layout.h"
#include "kvrelay/v1/gateway.pb.h"

namespace kvrelay::gateway {

// Receives the response stream (tokens as they come, then one message with the summary).
// Returning false stops generation early (the caller has what it wants, e.g. a stop string);
// the request still ends OK with its summary. A client that went away is reported through
// the `cancelled` callback instead.
using GenerateSink = std::function<bool(const kvrelay::v1::GenerateResponse&)>;

struct GenerateCallOptions {
  std::string model_name;    // sent to the workers
  int32_t max_attempts = 3;  // attempts blamed on a worker before the request fails
  // Per-step bounds, each below the request's deadline (Reserve's is the WorkerSet's adaptive
  // one: WorkerSet::ReserveTimeout).
  absl::Duration prefill_timeout = absl::Seconds(30);
  absl::Duration chunk_timeout = absl::Seconds(5);  // first token and every gap after it
  // Each Promote to a worker holding the prompt's blocks on disk (WorkerSet::Promotions): a
  // local disk read of a prefix answers in milliseconds.
  absl::Duration promote_timeout = absl::Milliseconds(250);
};

// What a call borrows from its gateway. None owned; all must outlive the call.
struct GenerateCallDeps {
  WorkerSet* workers;
  const GatewayMetrics* metrics;
  QuotaTable* tenant_reservations;  // decode KV reserved, in tokens
  QuotaTable* client_reservations;
  const kv::ModelLayout* layout;  // hashes the prompt's blocks; its fingerprint goes to workers
  // The request's time: its deadline, the step timeouts and the latency figures. Deadlines
  // of RPCs are wall-clock time, so the gateway passes the real clock; tests a simulated one.
  Clock* clock;
};

// One request's identity after admission.
struct GenerateCallRequest {
  const kvrelay::v1::GenerateRequest* request;  // validated
  std::string tenant_salt;                      // DeriveTenantSalt of its tenant
  std::string client;                           // for the per-client quotas ("" none)
  std::string request_id_prefix;                // attempt i's id is <prefix>-<i>
  absl::Time start;                             // when the gateway admitted it
  absl::Time deadline;                          // absolute, on deps.clock
};

class GenerateCall {
 public:
  GenerateCall(const GenerateCallOptions& options, const GenerateCallDeps& deps,
               GenerateCallRequest request, const GenerateSink& sink,
               const std::function<bool()>& cancelled);
  GenerateCall(const GenerateCall&) = delete;
  GenerateCall& operator=(const GenerateCall&) = delete;

  // Runs the attempts; OK once the summary went to the sink. Failures: the caller's own
  // (Cancelled with ROLE_CLIENT when it went away, its deadline, invalid input a worker
  // reported, a reserved-KV quota: returned as they came); RESOURCE_EXHAUSTED when every usable
  // decode or prefill worker is full (ErrorInfo: ROLE_GATEWAY, FAILURE_OVERLOADED, what is full
  // and retry_after_ms); UNAVAILABLE naming the role when no healthy worker is left; else the
  // last attempt's failure.
  absl::Status Run();

  // A link canary (the gateway's, for a decode node whose pushes were slow): Reserve on
  // `decode`, Prefill on `prefill` (whose push into `decode` is measured as a request's is:
  // its transfer_seconds_per_mib), then Release. Nothing is generated; no breaker, pick or
  // failure is counted, and nothing goes to the sink. The request should be synthetic (unique
  // tokens, so the whole prompt is pushed). Returns the first failed step's status.
  absl::Status Canary(WorkerSet::Node* prefill, WorkerSet::Node* decode);

 private:
  enum class Blame { kNone, kPrefill, kDecode };
  using Node = WorkerSet::Node;
  // What one attempt works on: the prompt so far and who holds its leading blocks.
  struct Plan {
    std::vector<int32_t> tokens;  // prompt + tokens generated by earlier attempts
    int32_t remaining = 0;        // tokens still to generate
    int64_t full_blocks = 0;
    std::vector<kv::BlockHash> chain;
    absl::flat_hash_map<std::string, int32_t> held;
    absl::flat_hash_map<std::string, int32_t> disk;  // of `held`, only on a node's disk tier
    bool store_unreachable = false;                  // see WorkerSet::PrefixHoldings
    bool canary = false;  // a link canary's: no store lookup, nothing committed (Canary)
  };
  struct Pair {
    Node* prefill = nullptr;
    Node* decode = nullptr;
    bool routed = false;                           // the prefill node was picked for its prefix
    std::vector<WorkerSet::Promotion> promotions;  // sent before the Reserve
  };

  // One attempt. An error ends the call with it; true: try again; false: stop attempting.
  absl::StatusOr<bool> Attempt();
  Plan MakePlan() const;
  // MakePlan's tokens and chain, without asking the store who holds them.
  Plan PlanTokens() const;
  absl::StatusOr<bool> RunPair(const Plan& plan, const Pair& pair);
  absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(const Plan& plan, Node* decode,
                                                       const std::string& request_id);
  // Sends the pair's promotions in turn, each bounded by the request's deadline and
  // options.promote_timeout; a failed one costs only the reuse (and no Promote goes to that
  // node for a while: WorkerSet::PromoteFailed). Returns whether a node other than the
  // prefill's read blocks back (the prefill may pull them: prefix_source "remote_disk").
  bool Promote(const Plan& plan, const Pair& pair, const std::string& request_id);
  absl::StatusOr<kvrelay::v1::PrefillResponse> Prefill(const Plan& plan, Node* prefill,
                                                       const kvrelay::v1::ReserveResponse& target,
                                                       const std::string& request_id);
  void RecordPrefill(const Pair& pair, const kvrelay::v1::PrefillResponse& prefilled,
                     const kvrelay::v1::ReserveResponse& target);
  // The push's time per MiB into `decode` (a bound on its link: the Prefill call's time,
  // compute included, over the bytes it pushed), when it pushed enough to tell.
  void ObservePush(Node* decode, const kvrelay::v1::PrefillResponse& prefilled,
                   absl::Time prefill_start) const;
  // Streams the decode worker's tokens to the sink; the leases go back at the first chunk
  // (the worker has claimed the reservation). `*stream_done` when the closing chunk came.
  absl::Status Stream(const Plan& plan, Node* decode, const kvrelay::v1::PrefillResponse& prefilled,
                      const kvrelay::v1::ReserveResponse& target, const std::string& request_id,
                      QuotaTable::Lease* tenant_lease, QuotaTable::Lease* client_lease,
                      bool* stream_done);
  // Forwards one chunk; false stops the stream.
  bool OnChunk(const kvrelay::v1::DecodeChunk& chunk, int32_t* computed_here, bool* stream_done);
  absl::StatusOr<bool> AfterStream(absl::Status s, bool stream_done, const Pair& pair,
                                   const std::string& request_id);
  // A failed step: blames the node (its breaker, the exclusion list, the failure count) and
  // returns true, or returns the status itself when no worker is to blame. `failover_of`: the
  // attempt's request id, to log a failover mid-stream (null: no log).
  absl::StatusOr<bool> Failed(const absl::Status& status, Blame called, const Pair& pair,
                              const std::string* failover_of);
  // Which node a failed step is attributed to, from its ErrorInfo (the node called when the
  // failure carries none). kNone for the caller's own deadline, cancellation or bad input.
  Blame Attribute(const absl::Status& status, Blame called) const;
  // A refusal for capacity from `node` (of `role`): marks it busy (the breaker does not move),
  // keeps it out of this request's later attempts; always true (try another worker).
  bool Busy(const absl::Status& status, Node* node, Blame role);
  // `node` refused because it drains (FAILURE_DRAINING): skipped by this request and, for a
  // while, by every request (its breaker's RecordDraining); no attempt spent, no breaker
  // opened. Returns true (try another pair).
  bool Drained(Node* node, Blame role);
  // The call's end when the picker for `role` found no node and `wait` says some were busy:
  // RESOURCE_EXHAUSTED naming what the workers said is full and the predicted wait.
  absl::Status AtCapacity(Blame role, absl::Duration wait);
  // This request's exclusion list for a role: failed and busy nodes.
  std::vector<Node*> Excluded(Blame role) const;
  bool Cancelled() const { return cancelled_ && cancelled_(); }
  bool FinishedGenerating() const;
  absl::Status Finish();

  const GenerateCallOptions& options_;
  const GenerateCallDeps deps_;
  const GenerateCallRequest call_;
  const kvrelay::v1::GenerateRequest& request_;
  const GenerateSink& sink_;
  const std::function<bool()>& cancelled_;
  const std::string layout_fingerprint_;  // bytes, as the workers check it
  const std::vector<int32_t> prompt_;
  const int32_t eos_;  // -1: none

  std::vector<int32_t> generated_;  // streamed to the sink so far, across attempts
  kvrelay::v1::GenerateSummary summary_;
  absl::Time first_token_time_ = absl::InfiniteFuture();
  // The current attempt's start (before its Reserve), how long its Reserve took, and whether
  // its first token arrived: the decode node's service-time sample (WorkerSet::Node::service).
  absl::Time attempt_start_ = absl::InfinitePast();
  absl::Duration attempt_reserve_;
  bool attempt_streamed_ = false;
  bool attempt_promoted_elsewhere_ = false;  // Promote's answer for this attempt
  absl::Time last_token_time_ = absl::InfiniteFuture();
  std::vector<Node*> failed_prefill_;  // excluded from later attempts
  std::vector<Node*> failed_decode_;
  std::vector<Node*> busy_prefill_;  // refused for capacity: excluded too, never blamed
  std::vector<Node*> busy_decode_;
  std::vector<Node*> draining_prefill_;  // refused because they drain: excluded, never blamed
  std::vector<Node*> draining_decode_;
  std::string exhausted_;  // what the last refusal for capacity said is full ("" unknown)
  absl::Duration predicted_wait_ = absl::InfiniteDuration();  // shortest a refusal predicted
  // Nodes discovery may drop stay valid while this call names them.
  std::vector<std::shared_ptr<Node>> keep_alive_;
  absl::Status last_error_;
  int32_t failures_ = 0;  // attempts blamed on a worker
  int32_t attempts_ = 0;  // attempts that reached a pair
  bool done_ = false;
  bool client_gone_ = false;
  bool stop_requested_ = false;  // the sink has what it wants
};

}  // namespace kvrelay::gateway
