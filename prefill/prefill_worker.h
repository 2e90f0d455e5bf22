#pragma once

// PrefillWorker: computes a prompt's KV blocks, or reuses them, and pushes them into a decode
// worker's reserved slots layer by layer.
//
// Per request: chained, tenant-salted block hashes of the full blocks the decode worker asked
// for -> MatchPrefix under a lease -> reused blocks copied from this node's cache segment, or
// pulled from another node's (PrefixPuller), into the request's KV slots -> one push session
// (PushSession) with a slice per (group, block, layer) -> layer L is posted as soon as the
// model finished it, so it is on the wire while layer L+1 computes -> wait for every layer ->
// commit the new blocks to the cache store (copies in the segment) -> release the lease.
//
// Mamba (an SSM-state layout, prefill/mamba_prefill.cc): the same hashes and match, but the
// request resumes from the deepest state checkpoint cached here, computes the rest, pushes one
// constant-size state and commits one checkpoint per computed block.
//
// This class composes the model, the store link, PushSession (prefill/push_session.h) and
// PrefixPuller (prefill/prefix_puller.h); it owns neither protocol.
// Domain logic only: the gRPC glue is prefill/server/PrefillService. Every failure carries a
// kvrelay.v1.ErrorInfo saying which role and node failed (proto/grpc_status.h).
//
// Admission: a request whose predicted start (prompt tokens queued here / the measured compute
// rate, see PrefillQueue) is past its deadline is refused at once with RESOURCE_EXHAUSTED
// (FAILURE_OVERLOADED, "queue", the predicted wait).
//
// Thread-safe; one model computation at a time (the runner is shared), transfers of earlier
// requests overlap later computations.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "kv/reuse_cost.h"
#include "kvrelay/v1/prefill.pb.h"
#include "model/attention_model.h"
#include "prefill/admission.h"
#include "prefill/peer_cache.h"
#include "prefill/prefix_puller.h"
#include "prefill/push_session.h"
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
  // Admission: the longest predicted wait before a request's compute starts that is admitted,
  // below its deadline (--max-queue-wait; zero, the default: the deadline alone). A latency
  // target (a TTFT SLO) set here sheds what would miss it instead of queueing it.
  absl::Duration max_queue_wait = absl::ZeroDuration();
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
  // A gateway's Promote: blocks this node holds on its disk tier back into DRAM, for a prefill
  // worker elsewhere to pull (worker::WorkerCore::Promote).
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline);
  // SIGTERM drain: refuses new requests (UNAVAILABLE, FAILURE_DRAINING: gateways go elsewhere
  // without counting it a failure) while admitted ones finish; waits until none is left or
  // `deadline`, then deregisters. Returns whether every request finished in time. Blocks.
  bool Drain(absl::Time deadline);
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
  // The prompt's chained block hashes and what the store holds of them, under a lease that is
  // released when this goes out of scope. Both the KV and the Mamba path start here.
  class PrefixLookup {
   public:
    PrefixLookup(std::vector<kv::BlockHash> chain, worker::PrefixMatch match,
                 worker::StoreLink* store, absl::Time deadline)
        : chain(std::move(chain)), match(std::move(match)), deadline(deadline), store_(store) {}
    PrefixLookup(const PrefixLookup&) = delete;
    PrefixLookup& operator=(const PrefixLookup&) = delete;
    // Bounded as every store call of the request (a lease not released expires at the store).
    ~PrefixLookup() { store_->ReleaseLease(match.lease_id, deadline); }
    worker::StoreLink& store() const { return *store_; }

    const std::vector<kv::BlockHash> chain;
    const worker::PrefixMatch match;
    const absl::Time deadline;  // the request's: bounds every store call made for it

   private:
    worker::StoreLink* const store_;
  };
  // The KV path's reused leading blocks: `hit_blocks` from this node's segment, then those
  // pulled from another node.
  struct ReusedPrefix {
    int64_t hit_blocks = 0;   // from this node's DRAM cache segment
    int64_t disk_blocks = 0;  // after those: read back from this node's disk tier (promoted)
    PulledPrefix pulled;
    // The disk blocks' layer-wise read, still in progress: the prefill waits for each layer's
    // stage before computing that layer. Null without disk blocks. Destroyed (which cancels
    // it) before the sequence that owns its destination slots.
    std::unique_ptr<worker::DiskCache::StagedRead> disk_read;
    int64_t blocks() const { return hit_blocks + disk_blocks + pulled.blocks; }
  };
  // The Mamba path's computed states: the one after the last full block and the checkpoints of
  // blocks [resume_blocks, full_blocks).
  struct MambaStates {
    std::vector<uint8_t> final_state;
    std::vector<std::vector<uint8_t>> checkpoints;
  };

  explicit PrefillWorker(PrefillWorkerOptions options, MetricsRegistry* metrics);
  // Starts reading blocks chain[first, ...) that this node's disk tier holds into fresh KV slots
  // (appended to `slots[g]`), layer stage by layer stage (`read`), when reading them is
  // predicted faster than recomputing them (kv::ChoosePullOrRecompute with the tier's measured
  // read rate). Returns how many; never fails the request (a read that fails is recomputed).
  int64_t PromoteFromDisk(const std::vector<kv::BlockHash>& chain, int64_t first,
                          int64_t wanted_end, const std::string& request_id, absl::Time deadline,
                          std::vector<std::vector<kv::SlotId>>& slots,
                          std::unique_ptr<worker::DiskCache::StagedRead>& read);
  absl::Status Init(worker::WorkerCoreDeps deps);
  // Prefills a few blocks of dummy tokens before serving and takes the compute rate from them,
  // so admission predicts waits from the first request on; without it a cold worker admitted
  // every request of a burst until one had finished (12.8 s queues in the simulator).
  void MeasureComputeRate();
  // `status` attributed to this node with `reason`.
  absl::Status Own(absl::Status status, kvrelay::v1::FailureReason reason) const;
  // Run's first step: the request's fields (Validate, the caller's fault) and the layout
  // fingerprints of the request (this node's fault) and of the target (the decode node's).
  absl::Status CheckRequest(const kvrelay::v1::PrefillRequest& request) const;
  absl::Status Validate(const kvrelay::v1::PrefillRequest& request) const;
  // The config and layout of whichever runner this worker has.
  const kv::ModelConfig& model_config() const { return core_->model_config(); }
  // What every push session of this worker shares.
  PushContext push_context();
  void OnInbound(transfer::InboundEvent event);

  // --- The KV path (prefill/prefill_worker.cc) ---
  absl::StatusOr<kvrelay::v1::PrefillResponse> RunKv(const kvrelay::v1::PrefillRequest& request,
                                                     absl::Time deadline, absl::Time start);
  // The decode worker holds every full block: nothing to compute or push.
  kvrelay::v1::PrefillResponse HeldByDecode(kvrelay::v1::PrefillResponse response,
                                            int64_t full_tokens);
  // Hashes the first `full_tokens` tokens and matches them. A store outage costs reuse, not
  // the request (an empty match); only a worker not yet registered fails.
  absl::StatusOr<std::unique_ptr<PrefixLookup>> LookUpPrefix(
      const kvrelay::v1::PrefillRequest& request, const kv::ModelLayout& layout,
      absl::Span<const int32_t> tokens, int64_t full_tokens, absl::Time deadline);
  // The leading blocks cached here, then those pulled from other nodes (or left for recompute),
  // adopted by `seq`.
  absl::StatusOr<ReusedPrefix> ReusePrefix(const kvrelay::v1::PrefillRequest& request,
                                           const PrefixLookup& lookup,
                                           absl::Span<const int32_t> tokens, absl::Time deadline,
                                           model::Sequence& seq);
  // A claimed push session with one slice per (group, wanted block, layer) of `seq`.
  absl::StatusOr<std::unique_ptr<PushSession>> PlanKvPush(
      const kvrelay::v1::PrefillRequest& request, const model::Sequence& seq, absl::Time deadline);
  // Computes tokens[compute_from, end) into `seq`, posting each layer as soon as it is done
  // (every layer at once when nothing is left to compute). With `disk_read`, layer L is
  // computed once its stage is read and verified, and nothing is posted before the whole read
  // verified; when it fails, `*disk_failed` is set and its status returned (the caller rewinds
  // `seq` and computes the read blocks instead).
  absl::Status ComputeAndPush(model::Sequence& seq, absl::Span<const int32_t> tokens,
                              int64_t compute_from, PushSession& push,
                              worker::DiskCache::StagedRead* disk_read, absl::Time deadline,
                              bool* disk_failed);
  // Publishes blocks [first, last) of `seq` for later requests; the blocks committed (0 when the
  // store failed: a lost commit costs later reuse, not this request).
  int32_t CommitKv(const std::string& request_id, const PrefixLookup& lookup, int64_t first,
                   int64_t last, const model::Sequence& seq);

  // --- The Mamba path (prefill/mamba_prefill.cc) ---
  // Resumes from the deepest state checkpoint cached here, computes the rest, pushes the one
  // final state and commits a checkpoint per new block.
  absl::StatusOr<kvrelay::v1::PrefillResponse> RunMamba(const kvrelay::v1::PrefillRequest& request,
                                                        absl::Time deadline, absl::Time start);
  // INVALID_ARGUMENT (the caller's) unless the target reserves exactly the last block's slot.
  static absl::Status CheckMambaTarget(const kvrelay::v1::ReserveResponse& target);
  // The deepest matched block whose checkpoint is in this node's segment: (blocks, slot), or
  // (0, -1) for none.
  absl::StatusOr<std::pair<int64_t, int64_t>> FindCheckpoint(const worker::PrefixMatch& match,
                                                             int64_t full_blocks) const;
  // Restores the checkpoint in `resume_slot` (if any) and computes tokens[resume_blocks *
  // block_tokens, end).
  absl::StatusOr<MambaStates> ComputeMamba(absl::Span<const int32_t> tokens, int64_t resume_blocks,
                                           int64_t resume_slot);
  // Puts `state` into a registered slot and pushes it into the target's last reserved slot;
  // the bytes pushed.
  absl::StatusOr<int64_t> PushMambaState(const kvrelay::v1::PrefillRequest& request,
                                         const std::vector<uint8_t>& state, absl::Time deadline);
  // Publishes the checkpoints of blocks [first, last) under their hashes, with their tokens
  // (`tokens`: the prompt's); as CommitKv.
  int32_t CommitCheckpoints(const std::string& request_id, const PrefixLookup& lookup,
                            int64_t first, int64_t last,
                            const std::vector<std::vector<uint8_t>>& checkpoints,
                            absl::Span<const int32_t> tokens);

  const PrefillWorkerOptions options_;
  MetricsRegistry* metrics_;
  const MetricLabels model_labels_;  // {model_name}: on every family this worker exports
  // Push claims in flight, fed by OnInbound (which runs once core_'s transport exists).
  ClaimVerdicts verdicts_;
  PushMetrics push_metrics_;
  kv::RateMeter prefill_rate_;  // prompt tokens per second of compute here (read by puller_)
  // Prompt tokens admitted and not finished; admission by predicted start (reads prefill_rate_).
  std::unique_ptr<PrefillQueue> queue_;
  std::unique_ptr<worker::WorkerCore> core_;
  // One forward pass at a time: the runners are used only under it (their layouts are read
  // through model_config()).
  absl::Mutex compute_mu_;
  model::AttentionModel* runner_ ABSL_PT_GUARDED_BY(compute_mu_) = nullptr;  // null for Mamba
  model::MambaRunner* mamba_ ABSL_PT_GUARDED_BY(compute_mu_) = nullptr;      // null for attention
  // core_'s transport, KV memory and cache segment.
  transfer::Transport* transport_ = nullptr;
  worker::RegisteredKvCache* kv_ = nullptr;
  worker::CacheSegment* segment_ = nullptr;
  // Drain's handshake with Run, both sequentially consistent: Run counts itself in `calls_`,
  // then reads `draining_`; Drain sets `draining_`, then waits for `calls_` to reach zero.
  std::atomic<bool> draining_{false};
  std::atomic<int32_t> calls_{0};
  // core_->store once ConnectStore ran; release by ConnectStore, acquire by requests.
  std::atomic<worker::StoreLink*> store_{nullptr};

  // Data-plane peers, shared by pushes and pulls (declared after core_: destroyed before it).
  std::unique_ptr<PeerCache> peers_;
  // Pulls of prefixes held on other nodes (holds a region of core_'s transport).
  std::unique_ptr<PrefixPuller> puller_;

  Counter* prefix_query_tokens_;
  Counter* prefix_hit_tokens_;
  Counter* computed_tokens_;
  Counter* layers_during_disk_read_ = nullptr;
  Counter* pushed_tokens_;  // tokens of the blocks pushed (not those the decode worker held)
  Histogram* prefill_seconds_;
  Gauge* running_;          // in progress, not waiting for compute_mu_
  Gauge* waiting_;          // waiting for compute_mu_
  Counter* refused_queue_;  // refused at admission: predicted start past the deadline
  std::unique_ptr<worker::KvCacheMetrics> kv_metrics_;  // reads kv_: reset before core_ goes
};

}  // namespace kvrelay::prefill
