#pragma once

// The push protocol: how a prefill worker writes one request's KV (or Mamba state) into the
// slots a decode worker reserved for it.
//
//   PushSession::Open     connect to the decode worker (or reuse the live peer), import the
//                         memory keys of the reservation's runs
//   AddSlice (per slice)  one (group, block, layer) slice: local bytes -> a reserved slot
//   Claim                 prepare the plan, send the PushClaim, await the decode worker's
//                         PushVerdict: nothing is written before it agreed that the slots are
//                         this reservation's
//   Post (per layer)      put a range of layers on the wire (layer L while L+1 computes)
//   Finish                wait for every posted layer, bounded by the caller's deadline
//
// Every failure is attributed (kvrelay.v1.ErrorInfo: whose fault, which FailureReason) and
// counted in kvrelay:kv_transfer_failures_total{reason} from its status code, never from its
// text; a push that completes records the transfer metrics.
//
// Shared by every session of one worker: ClaimVerdicts (fed by the transport's inbound
// handler), PeerCache and PushMetrics, all reached through a PushContext. Used by both of
// PrefillWorker's paths (KV blocks and the Mamba state); it knows nothing of PrefillWorker.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "kvrelay/v1/decode.pb.h"
#include "prefill/peer_cache.h"
#include "transfer/transport.h"

namespace kvrelay::prefill {

// The decode workers' answers (PushVerdict) to the push claims in flight, by (peer, request
// tag). Thread-safe. OnInbound must be fed every inbound event of the transport the claims go
// over (it ignores what is not a verdict or a peer going away).
class ClaimVerdicts {
 public:
  ClaimVerdicts() = default;
  ClaimVerdicts(const ClaimVerdicts&) = delete;
  ClaimVerdicts& operator=(const ClaimVerdicts&) = delete;

  // Sends `claim` to `peer` under its request's tag (worker::RequestTag) and waits until
  // `deadline` for the verdict. OK: the push is allowed. Otherwise: the verdict's code with a
  // kvrelay.v1.ErrorInfo (ROLE_DECODE, the decode worker's reason; PERMISSION_DENIED when the
  // reservation is not the request's), ALREADY_EXISTS when a claim of the same request to the
  // same peer is in flight, DEADLINE_EXCEEDED when no verdict came in time, UNAVAILABLE when the
  // peer went away, INTERNAL for a malformed verdict, or SendControl's failure.
  absl::Status Exchange(transfer::Transport& transport, transfer::PeerId peer,
                        const kvrelay::v1::PushClaim& claim, absl::Time deadline);
  void OnInbound(const transfer::InboundEvent& event);

 private:
  absl::Mutex mu_;
  // nullopt until the verdict arrives.
  absl::flat_hash_map<std::pair<transfer::PeerId, uint64_t>, std::optional<absl::Status>> verdicts_
      ABSL_GUARDED_BY(mu_);
};

// The transfer metric families of pushes, with `labels` ({model_name}) on each. Thread-safe
// (the registry's metrics are). The registry must outlive it.
class PushMetrics {
 public:
  PushMetrics(MetricsRegistry* registry, MetricLabels labels);
  // kvrelay:kv_transfer_failures_total{reason}: "timeout", "peer_lost", "corrupt", "cancelled",
  // "refused", "unreachable" or "error".
  void CountFailure(const char* reason);
  // One push that delivered `bytes` in `elapsed` (first layer posted to last layer delivered)
  // to the decode worker whose node id is `decode`; also counted per link in
  // kvrelay:kv_transfer_link_bytes_total / _seconds_total{decode}.
  void RecordPush(int64_t bytes, absl::Duration elapsed, const std::string& decode);

 private:
  MetricsRegistry* const registry_;
  const MetricLabels labels_;
  Counter* const pushed_bytes_;
  Histogram* const transfer_seconds_;
  Histogram* const transfer_bytes_;
};

// What the sessions of one worker share; every pointer must outlive the sessions.
struct PushContext {
  transfer::Transport* transport = nullptr;
  PeerCache* peers = nullptr;
  ClaimVerdicts* verdicts = nullptr;
  PushMetrics* metrics = nullptr;
  // Bounds the claim's wait and every posted layer (within the caller's deadline).
  absl::Duration transfer_timeout = absl::Seconds(30);
};

// One layer's bytes of one block: `length` bytes at `local_offset` of `local` into the
// reserved slot `remote_slot` of the target's group `group`, at `offset_in_unit` inside it.
struct PushSlice {
  int group = 0;
  const transfer::MemoryRegion* local = nullptr;  // registered with the context's transport
  uint64_t local_offset = 0;
  int64_t remote_slot = 0;
  uint64_t offset_in_unit = 0;
  uint64_t length = 0;
  int32_t layer = 0;
};

// One push of one request's KV into one decode worker's reservation. One thread at a time.
// Destroying it cancels (and waits for) what is still in flight, then drops the imported keys;
// the local regions of its slices must outlive it.
class PushSession {
 public:
  // Connects to `target`'s decode worker and imports every run's memory key. Failures:
  // PERMISSION_DENIED (ROLE_CLIENT, FAILURE_UNAUTHORIZED) when it refused target.data_plane_key;
  // the connect's code (ROLE_DECODE, FAILURE_UNREACHABLE, counted "unreachable") when it cannot
  // be reached; a memory key it refused (ROLE_DECODE, FAILURE_TRANSFER, counted "refused").
  // `target` must outlive the session.
  static absl::StatusOr<std::unique_ptr<PushSession>> Open(
      const PushContext& context, std::string request_id,
      const kvrelay::v1::ReserveResponse& target, absl::Time deadline);
  ~PushSession();
  PushSession(const PushSession&) = delete;
  PushSession& operator=(const PushSession&) = delete;

  // Adds one slice to the plan. REQUIRES: before Claim. INVALID_ARGUMENT (ROLE_CLIENT,
  // FAILURE_INVALID_REQUEST) when the group's runs do not hold `slice.remote_slot`.
  absl::Status AddSlice(const PushSlice& slice);
  // Prepares the plan and claims the slots. Failures: Prepare's (unattributed); a refusal
  // (PERMISSION_DENIED: ROLE_DECODE with FAILURE_EXPIRED for a reservation that lapsed, else
  // ROLE_CLIENT with FAILURE_UNAUTHORIZED; counted "refused"); any other failure to get a
  // verdict (ROLE_DECODE, FAILURE_TRANSFER, counted by its code).
  absl::Status Claim();
  // Starts `layers`. A failure is kept and reported by Finish, and no later Post starts.
  // REQUIRES: Claim returned OK.
  void Post(transfer::LayerRange layers);
  // Waits for every posted layer until the caller's deadline and returns the bytes pushed
  // (recorded in the metrics). Failures (counted by their code): DEADLINE_EXCEEDED (ROLE_CLIENT,
  // FAILURE_CALLER_DEADLINE) once the caller's deadline passed; else the transfer's code
  // (ROLE_DECODE, FAILURE_CORRUPT for DATA_LOSS, otherwise FAILURE_TRANSFER).
  absl::StatusOr<int64_t> Finish();

 private:
  PushSession(const PushContext& context, std::string request_id,
              const kvrelay::v1::ReserveResponse& target, absl::Time deadline);
  absl::Status Connect();
  absl::Status ImportKeys();
  // `s` attributed to the target decode worker with `reason`.
  absl::Status DecodeFailure(absl::Status s, kvrelay::v1::FailureReason reason) const;
  absl::Status ClaimFailure(absl::Status claimed) const;
  absl::Status PushFailure(absl::Status failed) const;

  const PushContext context_;
  const std::string request_id_;
  const kvrelay::v1::ReserveResponse& target_;
  const absl::Time deadline_;  // the caller's
  transfer::PeerId peer_ = 0;
  // Memory keys per reservation: imported for this push, forgotten by the destructor once
  // handles_ are terminal.
  std::vector<transfer::RegionId> imported_;
  transfer::TransferBatch batch_;
  std::optional<transfer::TransferPlan> plan_;  // set by a successful Claim
  transfer::PostOptions post_options_;
  absl::Time first_post_ = absl::InfiniteFuture();
  absl::Status post_status_;
  std::vector<transfer::TransferHandlePtr> handles_;
};

}  // namespace kvrelay::prefill
