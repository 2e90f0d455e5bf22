#pragma once

// DecodeWorker: the decode side of disaggregated serving.
//
//  Reserve   allocates KV slots for a request's full prompt blocks (sliding-window groups only
//            for blocks the first query can still see) and says where a prefill worker must
//            write them: region id + slot offsets per layer group, an unguessable reservation
//            token bound to those slots, the request and the expiry, and the data-plane key
//            without which the transport accepts no connection.
//  (claim)   before writing, the prefill worker sends a PushClaim (token + the slots it will
//            write) over the data plane; it is allowed only for a live, unclaimed reservation
//            whose token matches and whose slots include every one claimed, and binds the
//            reservation to that connection. Anything else: PushVerdict PERMISSION_DENIED.
//  (data)    the prefill worker pushes one transport Post per model layer, tagged with the
//            request and carrying the token; the inbound handler accepts a Post only from the
//            claiming connection, with the token, and only into the reservation's slots (else
//            the reservation is not used: the prompt is computed here), counts layers and
//            records verification failures. Tokens are compared in constant time.
//  Generate  waits for every layer (bounded by the RPC deadline), adopts the blocks as the
//            sequence's prefix, hands it to the scheduler and streams tokens. If a transfer
//            failed or a checksum did not match, the pushed blocks are dropped and the worker
//            computes the prompt itself: corrupted KV is never used.
//  Scheduler one thread owns the model (an AttentionModel: CPU or CUDA, --device): it prefills
//            each new sequence's partial tail (first token), then runs one batched decode step
//            over all active sequences per iteration (continuous batching: sequences join and
//            leave between steps): DecodeStepGreedy when every sequence samples greedily (the
//            model may pick tokens on its device), else DecodeStep and each one's sampler.
//
// Mamba (an SSM-state layout): Reserve holds one slot, for the state after the last pushed
// block; Generate restores the sequence's recurrent state from it and the scheduler runs
// MambaRunner instead of the attention model.
//
// Admission: Reserve books the KV blocks a request can ever need (prompt + max_tokens, windows
// capped) against the pool; a request that does not fit is refused at once with
// RESOURCE_EXHAUSTED, so every admitted request can finish. At most max_batch sequences decode
// at once and at most max_queued more wait; beyond that Generate is refused too.
//
// Domain logic only: the gRPC glue is decode/server/DecodeService. Failures carry a
// kvrelay.v1.ErrorInfo naming the role and node. Expiry decisions use the injected Clock;
// deadlines are absolute real times that bound blocking waits.
//
// Thread-safe. Owns the transport, the KV memory, the model runner and the scheduler thread.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "kvrelay/v1/decode.pb.h"
#include "model/attention_model.h"
#include "transfer/transport.h"
#include "worker/worker_core.h"
#include "worker/worker_metrics.h"

namespace kvrelay::decode {

struct DecodeWorkerOptions {
  // cachestore_address empty: no multi-turn commits.
  worker::WorkerCoreOptions core{.role = "decode"};
  std::string model_name;  // what requests must name; empty accepts any
  int32_t max_batch = 32;
  int32_t max_queued = 64;
  absl::Duration reservation_ttl = absl::Seconds(60);
  absl::Duration transfer_wait = absl::Seconds(30);  // upper bound on waiting for a push
};

// Receives the stream's chunks in order; returns false when the client went away.
using ChunkWriter = std::function<bool(const kvrelay::v1::DecodeChunk&)>;

class DecodeWorker {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(DecodeWorkerOptions options,
                                                              MetricsRegistry* metrics,
                                                              worker::WorkerCoreDeps deps = {});
  ~DecodeWorker();

  absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(const kvrelay::v1::ReserveRequest& request);
  // Streams the request's tokens through `write` until done, the deadline, or `cancelled()`.
  absl::Status Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                        const ChunkWriter& write, const std::function<bool()>& cancelled);
  // Releases a live reservation presented with its token (PERMISSION_DENIED for another token,
  // compared in constant time; the reservation stays). Idempotent: an unknown, claimed or
  // already released request is OK. A late push into released slots can never land in someone
  // else's.
  absl::Status Release(const std::string& request_id, const std::string& reservation_token);
  kvrelay::v1::DecodeStatusResponse Describe();
  // Registers with the cache store (if configured) once the gRPC server listens on
  // `grpc_address`. ALREADY_EXISTS when another live process holds the node id.
  absl::Status ConnectStore(const std::string& grpc_address);

  const std::string& transport_address() const;
  // kReservation or kPool (options' kAuto resolved by the transport's capabilities).
  worker::MemoryKeyScope memory_key_scope() const { return core_->memory_key_scope; }
  const std::string& node_id() const { return core_->node_id; }
  // Where the model computes and why ("device cpu (--device cpu)"), for the listening line.
  std::string device_line() const { return core_->DeviceLine(); }
  uint64_t incarnation() const { return core_->incarnation; }
  // Stops admitting work (SIGTERM drain); in-flight sequences finish.
  void Drain();

 private:
  struct Reservation;
  struct Active;
  class ReservedRun;
  using ReservedRuns = std::vector<std::unique_ptr<ReservedRun>>;
  explicit DecodeWorker(DecodeWorkerOptions options, MetricsRegistry* metrics);
  absl::Status Init(worker::WorkerCoreDeps deps);
  absl::Status Own(absl::Status status, kvrelay::v1::FailureReason reason) const;
  // FailedPrecondition (FAILURE_IDENTITY) unless `fingerprint` is this worker's layout's.
  absl::Status CheckLayoutFingerprint(const std::string& fingerprint) const;
  // Checks a PushClaim (control message `event`) and answers it; binds the reservation to the
  // claiming peer when allowed.
  void OnPushClaim(const transfer::InboundEvent& event);
  // Whether a kBlocks event may count for reservation `r`: from its claiming peer, with its
  // token, every block inside one of its slots. REQUIRES: mu_ held.
  absl::Status AuthorizeBlocks(const Reservation& r, const transfer::InboundEvent& event) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // KV blocks per group a request of `tokens` total tokens can ever hold.
  std::vector<int64_t> BlockBudget(int64_t tokens) const;
  void ReturnBudget(const std::vector<int64_t>& budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnInbound(transfer::InboundEvent event);
  void SchedulerLoop();
  // Frees the reservation's slots; its per-reservation registrations move to `ended`, to be
  // destroyed (ucp_mem_unmap, which waits for the transport's thread) once mu_ is released:
  // that thread takes mu_ in OnInbound.
  void ReleaseReservationSlots(Reservation& r, ReservedRuns& ended);
  // --memory-key-scope reservation: registers each contiguous run of `r`'s pushed slots on its
  // own and adds the runs and their keys to `response`. REQUIRES: mu_ not held.
  absl::Status RegisterReservationRuns(const std::shared_ptr<Reservation>& r,
                                       kvrelay::v1::ReserveResponse& response);
  // The config and layout of whichever runner this worker has.
  const kv::ModelConfig& model_config() const { return core_->model_config(); }
  // Mamba: the pushed state (in the slot of the last pushed block, `slots` as a reservation
  // holds them) as a sequence of `prefix_tokens` tokens; every slot is released.
  absl::StatusOr<std::unique_ptr<model::MambaSequence>> AdoptPushedState(
      std::vector<std::vector<kv::SlotId>> slots, int64_t prefix_tokens);
  // Sets the running/waiting gauges and the KV usage from the state mu_ guards; called where
  // that state changes.
  void PublishLoad() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const DecodeWorkerOptions options_;
  MetricsRegistry* metrics_;
  std::string data_plane_key_;  // constant after Init; what Reserve hands out
  Counter* refused_pushes_;

  // Lock order: mu_ before any Active::mu.
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Reservation>> reservations_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Active>> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int32_t active_count_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t running_count_ ABSL_GUARDED_BY(mu_) = 0;
  // Blocks per group booked by live reservations and sequences (never above the pool size).
  std::vector<int64_t> booked_ ABSL_GUARDED_BY(mu_);
  std::thread scheduler_;

  Counter* generated_tokens_;
  Counter* received_bytes_;
  Counter* recomputed_requests_;
  Counter* held_blocks_;                // leading blocks found in the cache segment at Reserve
  Gauge* reservation_regions_;          // per-reservation registrations alive now
  Counter* reservation_regions_total_;  // ... ever made
  Gauge* active_gauge_;
  Histogram* step_seconds_;
  Counter* refused_overloaded_;
  Gauge* running_gauge_;
  Gauge* waiting_gauge_;
  // Booked share of the tightest pool (kvrelay:kv_cache_usage_perc): set by PublishLoad under
  // mu_, read by scrapes without it (relaxed: a scrape may see it a moment late).
  std::atomic<double> usage_perc_{0};
  std::unique_ptr<worker::KvCacheMetrics> kv_metrics_;  // reads usage_perc_

  // Declared last: destroyed first, so the transport stops calling OnInbound before the
  // reservations it touches go away.
  std::unique_ptr<worker::WorkerCore> core_;
  model::AttentionModel* runner_ = nullptr;  // core_->runner (null for Mamba)
  model::MambaRunner* mamba_ = nullptr;      // core_->mamba (null for attention models)
  worker::RegisteredKvCache* kv_ = nullptr;  // core_->kv
  // core_->store once ConnectStore ran (null without a store); release by ConnectStore,
  // acquire by the scheduler.
  std::atomic<worker::StoreLink*> store_{nullptr};
};

}  // namespace kvrelay::decode
