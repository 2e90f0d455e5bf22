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
// at once; Reserve also refuses a request whose predicted start (its place in the queue x the
// measured time between sequences leaving the batch, see DecodeAdmission) is past its
// deadline, or that finds max_queued waiting already; Generate refuses too if the queue filled
// since. Every refusal for capacity is RESOURCE_EXHAUSTED with ErrorInfo FAILURE_OVERLOADED,
// naming what is full ("queue", "kv_blocks") and the predicted wait (proto::Overloaded).
//
// Housekeeping (on the commit thread): every second reservations that lapsed untaken (their
// request's deadline, or the TTL) or were released end (ReservationTable::Sweep), so an idle worker
// holds no slot or booking for a request that went away; a Reserve answered after its caller's
// deadline (the process was paused) ends its own reservation at once. A finished sequence's blocks
// are committed to the cache segment on a commit thread (at most max_batch waiting, else skipped
// and counted), never on the scheduler's: a slow or hung store must not stall the batch.
//
// Domain logic only: the gRPC glue is decode/server/DecodeService. Failures carry a
// kvrelay.v1.ErrorInfo naming the role and node. Expiry decisions use the injected Clock;
// deadlines are absolute real times that bound blocking waits.
//
// Composition (each part knows nothing of this class):
//  ReservationTable  bookings, tokens, memory-key runs, expiry, release, the push gate (claims
//                    and deliveries from the transport's inbound thread).
//  BatchScheduler    the queue, max_batch / max_queued and the continuous-batching thread;
//                    this class is its BatchModel (attention or Mamba, sampling, commits).
//
// Thread-safe. Owns the transport, the KV memory, the model runner, the scheduler and commit
// threads.
// Lock order: publish_mu_ before the table's lock and before the scheduler's; those two are
// never held together (nor with a sequence's stream lock). The transport's inbound thread
// takes the table's lock, so nothing that waits for that thread (destroying a ReservedRun)
// runs under it. commit_mu_ is a leaf. No lock of this class is held while calling the model or
// the store.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/metrics.h"
#include "decode/admission.h"
#include "decode/batch_scheduler.h"
#include "decode/reservation_table.h"
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
  // Admission: the longest predicted wait for a batch place that is admitted, below the
  // request's deadline (--max-queue-wait; zero, the default: the deadline alone).
  absl::Duration max_queue_wait = absl::ZeroDuration();
};

// Receives the stream's chunks in order; returns false when the client went away.
using ChunkWriter = std::function<bool(const kvrelay::v1::DecodeChunk&)>;

class DecodeWorker : private BatchModel {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(DecodeWorkerOptions options,
                                                              MetricsRegistry* metrics,
                                                              worker::WorkerCoreDeps deps = {});
  ~DecodeWorker() override;

  // `deadline` (the caller's, real time): a request that cannot start by then is refused.
  absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(
      const kvrelay::v1::ReserveRequest& request, absl::Time deadline = absl::InfiniteFuture());
  // Streams the request's tokens through `write` until done, the deadline, or `cancelled()`.
  absl::Status Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                        const ChunkWriter& write, const std::function<bool()>& cancelled);
  // Releases a live reservation presented with its token (PERMISSION_DENIED for another token,
  // compared in constant time; the reservation stays). Idempotent: an unknown, claimed or
  // already released request is OK. A late push into released slots can never land in someone
  // else's.
  absl::Status Release(const std::string& request_id, const std::string& reservation_token);
  kvrelay::v1::DecodeStatusResponse Describe();
  // A gateway's Promote: blocks this node holds on its disk tier back into DRAM, so its next
  // Reserve finds them (not pushed) and a prefill worker can pull them
  // (worker::WorkerCore::Promote).
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline);
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
  // SIGTERM drain: refuses new reservations (UNAVAILABLE, FAILURE_DRAINING: gateways go
  // elsewhere without counting it a failure) while requests already reserved are generated;
  // waits until none is left (reserved, queued or running) or `deadline`, then deregisters.
  // Returns whether every request finished in time. Blocks the caller.
  bool Drain(absl::Time deadline);

 private:
  struct Active;
  // What Generate admitted: the reservation it took (if any) and the blocks booked for it.
  struct Admission {
    std::optional<TakenReservation> push;
    std::vector<int64_t> budget;
  };
  explicit DecodeWorker(DecodeWorkerOptions options, MetricsRegistry* metrics);
  absl::Status Init(worker::WorkerCoreDeps deps);
  absl::Status Own(absl::Status status, kvrelay::v1::FailureReason reason) const;
  // FailedPrecondition (FAILURE_IDENTITY) unless `fingerprint` is this worker's layout's.
  absl::Status CheckLayoutFingerprint(const std::string& fingerprint,
                                      const std::string& description) const;
  // UNAVAILABLE (FAILURE_DRAINING) once Drain() ran.
  absl::Status CheckNotDraining() const;
  // KV blocks per group a request of `tokens` total tokens can ever hold.
  std::vector<int64_t> BlockBudget(int64_t tokens) const;

  // The push gate: a PushClaim control message is answered with a PushVerdict; blocks are
  // counted by the table or refused.
  void OnInbound(transfer::InboundEvent event);
  void OnPushClaim(const transfer::InboundEvent& event);

  // Reserve's steps. What to book for `request` (its held prefix loaded from the cache
  // segment, when the store link has it).
  absl::StatusOr<ReservationRequest> PlanReservation(const kvrelay::v1::ReserveRequest& request);
  // RESOURCE_EXHAUSTED ("queue") when what is ahead of a new request would not let it start
  // before `deadline` (see DecodeAdmission).
  absl::Status AdmitReserve(absl::Time deadline);
  kvrelay::v1::ReserveResponse DescribeGrant(int32_t full_blocks, int32_t held_blocks,
                                             const ReservationGrant& grant) const;
  // --memory-key-scope reservation: registers each contiguous run of the pushed slots on its
  // own, adds the runs and their keys to `response` and hands the runs to the table.
  absl::Status RegisterReservationRuns(const std::string& request_id, int32_t held_blocks,
                                       const ReservationGrant& grant,
                                       kvrelay::v1::ReserveResponse& response);

  // Generate's steps. INVALID_ARGUMENT (client's) for a malformed request; the identity check.
  absl::Status CheckDecodeRequest(const kvrelay::v1::DecodeRequest& request) const;
  // Takes the request's reservation (waiting for its push until `deadline` and transfer_wait)
  // or books its budget; RESOURCE_EXHAUSTED when the batch queue or the KV is full.
  absl::StatusOr<Admission> Admit(const kvrelay::v1::DecodeRequest& request, absl::Time deadline);
  std::shared_ptr<Active> NewSequence(const kvrelay::v1::DecodeRequest& request,
                                      std::vector<int64_t> budget) const;
  // Adopts the pushed (and held) prefix when it is complete and this prompt's, else frees it;
  // sets the tail the scheduler computes. Returns the KV bytes received.
  absl::StatusOr<int64_t> AttachPrefix(const kvrelay::v1::DecodeRequest& request,
                                       const std::vector<int32_t>& tokens,
                                       std::optional<TakenReservation> push, Active& active);
  // Whether the pushed prefix of `push` can be used for this request (else: logged, counted).
  bool PushUsable(const kvrelay::v1::DecodeRequest& request, const std::vector<int32_t>& tokens,
                  const TakenReservation& push);
  // Streams the sequence's tokens through `write` until done, cancelled or the deadline.
  absl::Status StreamTokens(Active& active, absl::Time deadline, const ChunkWriter& write,
                            const std::function<bool()>& cancelled, int64_t received_bytes,
                            int32_t computed_tokens);

  // BatchModel, on the scheduler thread.
  absl::StatusOr<int32_t> Prefill(BatchSequence& seq) override;
  absl::StatusOr<std::vector<int32_t>> Step(absl::Span<BatchSequence* const> batch) override;
  void Retire(BatchSequence& seq, const absl::Status& status) override;
  void OnIteration() override;
  // Multi-turn reuse: a finished sequence's full blocks go into the cache segment on the
  // commit thread, never on the scheduler's (a slow or hung store would stall every sequence
  // in the batch). The job keeps the sequence's slots and booking until the commit ends; the
  // stream's done chunk waits for it (bounded by the request's deadline), so a next turn sent
  // after it finds the blocks.
  struct CommitJob {
    std::string request_id;
    std::string tenant_salt;
    std::unique_ptr<model::Sequence> seq;
    int32_t held_blocks = 0;
    absl::Time deadline = absl::InfiniteFuture();
    std::vector<int64_t> budget;
    std::shared_ptr<absl::Notification> done;
  };
  // Fewer than max_batch jobs wait (only the scheduler's thread queues, so room stays).
  bool CommitQueueHasRoom() ABSL_LOCKS_EXCLUDED(commit_mu_);
  // Queues `job`; once commits stopped, ends it uncommitted at once.
  void QueueCommit(CommitJob job) ABSL_LOCKS_EXCLUDED(commit_mu_);
  // The commit thread. Between jobs, and at least every second, it also ends lapsed and
  // released reservations (ReservationTable::Sweep) and republishes the load gauges, so an
  // idle worker shows and holds nothing a gone request reserved. A commit waiting on a slow
  // store delays a sweep by at most its store call's limit.
  void CommitLoop();
  // Keeps every full block of the job's sequence in the cache segment.
  void CommitSequence(const CommitJob& job, worker::StoreLink& store) const;
  // Frees the job's slots and booking and tells its stream.
  void EndCommit(CommitJob& job);
  // Stops the commit thread; queued jobs end uncommitted. Idempotent.
  void StopCommits() ABSL_LOCKS_EXCLUDED(commit_mu_);

  // The config and layout of whichever runner this worker has.
  const kv::ModelConfig& model_config() const { return core_->model_config(); }
  // Mamba: the pushed state (in the slot of the last pushed block, `slots` as a reservation
  // holds them) as a sequence of `prefix_tokens` tokens; every slot is released.
  absl::StatusOr<std::unique_ptr<model::MambaSequence>> AdoptPushedState(
      std::vector<std::vector<kv::SlotId>> slots, int64_t prefix_tokens);
  // Sets the running/waiting gauges and the KV usage from the table's and the scheduler's
  // state; called where that state changes. Serialized by publish_mu_ so the last call's
  // snapshot is what the gauges show.
  void PublishLoad() ABSL_LOCKS_EXCLUDED(publish_mu_);

  const DecodeWorkerOptions options_;
  MetricsRegistry* metrics_;
  std::string data_plane_key_;  // constant after Init; what Reserve hands out
  // Drain's handshake with Reserve and Generate, both sequentially consistent: a call counts
  // itself in `calls_` and then reads `draining_`; Drain sets `draining_` and then waits for
  // `calls_` to reach zero, so a call either sees the drain or is waited for.
  std::atomic<bool> draining_{false};
  std::atomic<int32_t> calls_{0};  // Reserve and Generate calls running now

  Counter* refused_pushes_;
  Counter* generated_tokens_;
  Counter* received_bytes_;
  Counter* recomputed_requests_;
  Counter* held_blocks_;                // leading blocks found in the cache segment at Reserve
  Gauge* reservation_regions_;          // per-reservation registrations alive now
  Counter* reservation_regions_total_;  // ... ever made
  Gauge* active_gauge_;
  Histogram* step_seconds_;
  Counter* refused_overloaded_;
  Counter* refused_queue_;  // refused at Reserve: predicted start past the deadline
  Gauge* running_gauge_;
  Gauge* waiting_gauge_;
  Gauge* reservations_gauge_;  // reservations in the table (lapsed ones until swept)
  absl::Mutex publish_mu_;
  // Booked share of the tightest pool (kvrelay:kv_cache_usage_perc): set by PublishLoad, read
  // by scrapes without a lock (relaxed: a scrape may see it a moment late).
  std::atomic<double> usage_perc_{0};
  std::unique_ptr<worker::KvCacheMetrics> kv_metrics_;  // reads usage_perc_

  std::unique_ptr<worker::WorkerCore> core_;
  model::AttentionModel* runner_ = nullptr;  // core_->runner (null for Mamba)
  model::MambaRunner* mamba_ = nullptr;      // core_->mamba (null for attention models)
  worker::RegisteredKvCache* kv_ = nullptr;  // core_->kv
  // core_->store once ConnectStore ran (null without a store); release by ConnectStore,
  // acquire by the scheduler.
  std::atomic<worker::StoreLink*> store_{nullptr};
  // Declared after core_: destroyed before the KV pools they hold slots of. The destructor
  // stops the inbound handler and the scheduler first.
  std::unique_ptr<ReservationTable> table_;
  std::unique_ptr<DecodeAdmission> admission_;  // before scheduler_: its thread observes it
  std::unique_ptr<BatchScheduler> scheduler_;
  Counter* commits_skipped_;  // finished sequences not committed: the commit queue was full
  absl::Mutex commit_mu_;
  std::deque<CommitJob> commits_ ABSL_GUARDED_BY(commit_mu_);
  bool stop_commits_ ABSL_GUARDED_BY(commit_mu_) = false;
  std::thread commit_thread_;
};

}  // namespace kvrelay::decode
