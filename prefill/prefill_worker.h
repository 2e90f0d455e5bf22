#pragma once

// PrefillWorker: computes a prompt's KV blocks, or reuses them, and pushes them into a decode
// worker's reserved slots layer by layer.
//
// Per request: chained, tenant-salted block hashes of the full blocks the decode worker asked
// for -> MatchPrefix under a lease -> reused blocks copied from this node's cache segment into
// the request's KV slots -> one transport plan for every (group, block, layer) slice -> layer
// L is posted as soon as the model finished it, so it is on the wire while layer L+1 computes
// -> wait for every layer -> commit the new blocks to the cache store (copies in the segment)
// -> release the lease.
//
// Mamba (an SSM-state layout, prefill/mamba_prefill.cc): the same hashes and match, but the
// request resumes from the deepest state checkpoint cached here, computes the rest, pushes one
// constant-size state and commits one checkpoint per computed block.
//
// Domain logic only: the gRPC glue is prefill/server/PrefillService. Every failure carries a
// kvrelay.v1.ErrorInfo saying which role and node failed (proto/grpc_status.h).
//
// Thread-safe; one model computation at a time (the runner is shared), transfers of earlier
// requests overlap later computations.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "kv/reuse_cost.h"
#include "kvrelay/v1/prefill.pb.h"
#include "model/attention_model.h"
#include "transfer/transport.h"
#include "worker/block_fetch.h"
#include "worker/worker_core.h"
#include "worker/worker_metrics.h"

namespace kvrelay::prefill {

struct PrefillWorkerOptions {
  // cachestore_address is required; pool_blocks are shared by all requests in flight.
  worker::WorkerCoreOptions core{.role = "prefill", .pool_blocks = 4096, .cache_slots = 1024};
  std::string model_name;
  absl::Duration transfer_timeout = absl::Seconds(30);
  absl::Duration lease_ttl = absl::Seconds(60);
  // Pulling a prefix held on another node: at most this long (then the rest is recomputed).
  absl::Duration fetch_timeout = absl::Seconds(2);
  // A link the cost model judged too slow is tried again after this long (it may be fast now).
  absl::Duration fetch_reprobe_interval = absl::Seconds(5);
  // Off: blocks held on other nodes are always recomputed (the behaviour before pulls).
  bool pull_remote_prefix = true;
};

class PrefillWorker {
 public:
  static absl::StatusOr<std::unique_ptr<PrefillWorker>> Create(PrefillWorkerOptions options,
                                                               MetricsRegistry* metrics,
                                                               worker::WorkerCoreDeps deps = {});
  ~PrefillWorker();

  // Computes or reuses the prompt's full blocks and pushes them into request.target by
  // `deadline` (the caller's; transfers are bounded by options.transfer_timeout too).
  absl::StatusOr<kvrelay::v1::PrefillResponse> Run(const kvrelay::v1::PrefillRequest& request,
                                                   absl::Time deadline);
  kvrelay::v1::PrefillStatusResponse Describe() const;
  // Registers with the cache store once the gRPC server listens on `grpc_address` (requests
  // before that fail Unavailable). ALREADY_EXISTS when another live process holds the node id.
  absl::Status ConnectStore(const std::string& grpc_address);

  const std::string& transport_address() const { return core_->transport_address; }
  const std::string& node_id() const { return core_->node_id; }
  // Where the model computes and why ("device cpu (--device cpu)"), for the listening line.
  std::string device_line() const { return core_->DeviceLine(); }
  uint64_t incarnation() const { return core_->incarnation; }
  Clock* clock() const { return core_->clock; }

 private:
  explicit PrefillWorker(PrefillWorkerOptions options, MetricsRegistry* metrics);
  absl::Status Init(worker::WorkerCoreDeps deps);
  // `status` attributed to this node with `reason`.
  absl::Status Own(absl::Status status, kvrelay::v1::FailureReason reason) const;
  absl::Status Validate(const kvrelay::v1::PrefillRequest& request) const;
  // The config and layout of whichever runner this worker has.
  const kv::ModelConfig& model_config() const { return core_->model_config(); }
  // Run's Mamba path (prefill/mamba_prefill.cc), after validation: resumes from the deepest
  // state checkpoint cached here, computes the rest, pushes the one final state and commits a
  // checkpoint per new block.
  absl::StatusOr<kvrelay::v1::PrefillResponse> RunMamba(const kvrelay::v1::PrefillRequest& request,
                                                        absl::Time deadline, absl::Time start);
  // The prompt's chained block hashes and what the store holds of them, under a lease that is
  // released when this goes out of scope. Both the KV and the Mamba path start here.
  class PrefixLookup {
   public:
    PrefixLookup(std::vector<kv::BlockHash> chain, worker::PrefixMatch match,
                 worker::StoreLink* store)
        : chain(std::move(chain)), match(std::move(match)), store_(store) {}
    PrefixLookup(const PrefixLookup&) = delete;
    PrefixLookup& operator=(const PrefixLookup&) = delete;
    ~PrefixLookup() { store_->ReleaseLease(match.lease_id); }
    worker::StoreLink& store() const { return *store_; }

    const std::vector<kv::BlockHash> chain;
    const worker::PrefixMatch match;

   private:
    worker::StoreLink* const store_;
  };
  // Hashes the first `full_tokens` tokens and matches them. A store outage costs reuse, not
  // the request (an empty match); only a worker not yet registered fails.
  absl::StatusOr<std::unique_ptr<PrefixLookup>> LookUpPrefix(
      const kvrelay::v1::PrefillRequest& request, const kv::ModelLayout& layout,
      absl::Span<const int32_t> tokens, int64_t full_tokens, absl::Time deadline);
  // The data-plane peer of the target decode worker, failures attributed as Run attributes them.
  absl::StatusOr<transfer::PeerId> ConnectDecode(const kvrelay::v1::ReserveResponse& target,
                                                 absl::Time deadline);
  // A put batch to the request's decode worker over `peer`, carrying its reservation token.
  transfer::TransferBatch PushBatch(transfer::PeerId peer,
                                    const kvrelay::v1::PrefillRequest& request) const;
  // Layer `layer`'s slice of local slot `local_slot` of group `g` into the target's `remote_slot`.
  // INVALID_ARGUMENT (the caller's) when the target's runs do not hold `remote_slot`.
  absl::StatusOr<transfer::BlockTransfer> PushSlice(const kvrelay::v1::ReserveResponse& target,
                                                    int g, int64_t local_slot, int64_t remote_slot,
                                                    int32_t layer) const;
  // Prepares `batch` and claims the target's slots; nothing is written before the decode worker
  // agreed that they are this reservation's.
  absl::StatusOr<transfer::TransferPlan> PrepareClaimed(const transfer::TransferBatch& batch,
                                                        const kvrelay::v1::PrefillRequest& request,
                                                        absl::Time deadline);
  // A failed push claim, attributed as Run attributes it.
  absl::Status ClaimFailure(const kvrelay::v1::ReserveResponse& target, absl::Status claimed);
  // A failed push: the caller's deadline, or the decode worker's fault.
  absl::Status PushFailure(const kvrelay::v1::ReserveResponse& target, absl::Status failed,
                           absl::Time deadline);
  // `s` attributed to the target decode worker with `reason`.
  absl::Status DecodeFailure(const kvrelay::v1::ReserveResponse& target, absl::Status s,
                             kvrelay::v1::FailureReason reason) const;
  absl::StatusOr<transfer::PeerId> PeerFor(const std::string& address, const std::string& key,
                                           absl::Time deadline);
  // Sends the PushClaim for `request` over `peer` and waits (until `deadline`) for the decode
  // worker's verdict: OK, or PERMISSION_DENIED when the reservation is not the request's.
  // Memory keys per reservation: imports every run's key of `target` on `peer` (appending the
  // region ids to `imported`, which the caller forgets once its transfers are terminal); a
  // refused key is counted and attributed to the decode worker.
  absl::Status ImportTargetKeys(transfer::PeerId peer, const kvrelay::v1::ReserveResponse& target,
                                std::vector<transfer::RegionId>& imported);
  // Where the decode worker's slot `slot` of `group` is written: the group's region and the slot
  // index in it (the run holding it, with runs; else the pool's region and `slot`).
  static absl::StatusOr<std::pair<transfer::RegionId, int64_t>> TargetSlot(
      const kvrelay::v1::GroupTarget& group, int64_t slot);
  absl::Status ClaimPush(transfer::PeerId peer, const kvrelay::v1::PrefillRequest& request,
                         absl::Time deadline);
  void OnInbound(transfer::InboundEvent event);
  struct PulledPrefix {
    int64_t blocks = 0;
    uint64_t bytes = 0;
    bool attempted = false;
    kv::PullOrRecompute decision;
  };
  // Blocks [first, matched) of `chain` held on other nodes: pulled (appended to `slots`) or
  // left for recompute, as the cost model decides. Never fails the request.
  PulledPrefix PullHeldElsewhere(const worker::PrefixMatch& match,
                                 const std::vector<kv::BlockHash>& chain, int64_t first,
                                 int64_t wanted_end, const std::string& request_id,
                                 absl::Time deadline, std::vector<std::vector<kv::SlotId>>& slots);
  kv::RateMeter& LinkMeter(const std::string& address);
  // `labels` and model_name.
  MetricLabels WithModel(MetricLabels labels) const;
  void CountTransferFailure(const char* reason);

  const PrefillWorkerOptions options_;
  MetricsRegistry* metrics_;
  std::unique_ptr<worker::WorkerCore> core_;
  model::AttentionModel* runner_ = nullptr;   // core_->runner (null for Mamba)
  model::MambaRunner* mamba_ = nullptr;       // core_->mamba (null for attention models)
  transfer::Transport* transport_ = nullptr;  // core_->transport
  worker::RegisteredKvCache* kv_ = nullptr;   // core_->kv
  worker::CacheSegment* segment_ = nullptr;   // core_->segment
  // core_->store once ConnectStore ran; release by ConnectStore, acquire by requests.
  std::atomic<worker::StoreLink*> store_{nullptr};

  absl::Mutex compute_mu_;  // one forward pass at a time; taken before peers_mu_ never
  absl::Mutex peers_mu_;
  absl::flat_hash_map<std::string, transfer::PeerId> peers_ ABSL_GUARDED_BY(peers_mu_);
  // Verdicts on push claims in flight, by (peer, request tag): nullopt until it arrives.
  absl::Mutex verdicts_mu_;
  absl::flat_hash_map<std::pair<transfer::PeerId, uint64_t>, std::optional<absl::Status>> verdicts_
      ABSL_GUARDED_BY(verdicts_mu_);

  // Pulls: one at a time (they share the slot-entry scratch region).
  absl::Mutex fetch_mu_;
  transfer::MemoryRegionPtr fetch_scratch_ ABSL_GUARDED_BY(fetch_mu_);
  // Pulls given up on, until they are terminal (declared after core_: destroyed before it).
  std::unique_ptr<worker::FetchQuarantine> fetch_quarantine_;
  absl::Mutex meters_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<kv::RateMeter>> link_meters_
      ABSL_GUARDED_BY(meters_mu_);
  kv::RateMeter prefill_rate_;  // prompt tokens per second of compute here

  const MetricLabels model_labels_;  // {model_name}: on every family this worker exports
  Counter* prefix_query_tokens_;
  Counter* fetched_bytes_;
  Counter* fetched_tokens_;
  Counter* prefix_hit_tokens_;
  Counter* computed_tokens_;
  Counter* pushed_bytes_;
  Histogram* transfer_seconds_;
  Histogram* transfer_bytes_;
  Histogram* prefill_seconds_;
  Gauge* running_;                                      // in progress, not waiting for compute_mu_
  Gauge* waiting_;                                      // waiting for compute_mu_
  std::unique_ptr<worker::KvCacheMetrics> kv_metrics_;  // reads kv_: reset before core_ goes
};

}  // namespace kvrelay::prefill
