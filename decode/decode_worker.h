#pragma once

// DecodeWorker: the decode side of disaggregated serving.
//
//  Reserve   allocates KV slots for a request's full prompt blocks (sliding-window groups only
//            for blocks the first query can still see) and says where a prefill worker must
//            write them: region id + slot offsets per layer group.
//  (data)    the prefill worker pushes one transport Post per model layer, tagged with the
//            request; the inbound handler counts layers and records verification failures.
//  Generate  waits for every layer (bounded by the RPC deadline), adopts the blocks as the
//            sequence's prefix, hands it to the scheduler and streams tokens. If a transfer
//            failed or a checksum did not match, the pushed blocks are dropped and the worker
//            computes the prompt itself: corrupted KV is never used.
//  Scheduler one thread owns the ModelRunner: it prefills each new sequence's partial tail
//            (first token), then runs one batched DecodeStep over all active sequences per
//            iteration (continuous batching: sequences join and leave between steps).
//
// Thread-safe. Owns the transport, the KV memory, the model runner and the scheduler thread.

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "kvrelay/v1/decode.grpc.pb.h"
#include "model/model_runner.h"
#include "transfer/transport.h"
#include "worker/worker_core.h"

namespace kvrelay::decode {

struct DecodeWorkerOptions {
  // cachestore_address empty: no multi-turn commits. Default node id "decode-0".
  worker::WorkerCoreOptions core{.node_id = "decode-0"};
  std::string model_name;  // what requests must name; empty accepts any
  int32_t max_batch = 32;
  absl::Duration reservation_ttl = absl::Seconds(60);
  absl::Duration transfer_wait = absl::Seconds(30);  // upper bound on waiting for a push
};

class DecodeWorker final : public kvrelay::v1::Decode::Service {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(DecodeWorkerOptions options,
                                                               MetricsRegistry* metrics);
  ~DecodeWorker() override;

  grpc::Status Reserve(grpc::ServerContext* context, const kvrelay::v1::ReserveRequest* request,
                       kvrelay::v1::ReserveResponse* response) override;
  grpc::Status Generate(grpc::ServerContext* context, const kvrelay::v1::DecodeRequest* request,
                        grpc::ServerWriter<kvrelay::v1::DecodeChunk>* writer) override;
  grpc::Status Release(grpc::ServerContext* context, const kvrelay::v1::ReleaseRequest* request,
                       kvrelay::v1::ReleaseResponse* response) override;
  grpc::Status Status(grpc::ServerContext* context,
                      const kvrelay::v1::DecodeStatusRequest* request,
                      kvrelay::v1::DecodeStatusResponse* response) override;

  const std::string& transport_address() const;
  // Stops admitting work (SIGTERM drain); in-flight sequences finish.
  void Drain();

 private:
  struct Reservation;
  struct Active;
  explicit DecodeWorker(DecodeWorkerOptions options, MetricsRegistry* metrics);
  absl::Status Init();
  void OnInbound(transfer::InboundEvent event);
  void SchedulerLoop();
  void ReleaseReservationSlots(Reservation& r);
  absl::Status ValidatePrompt(const google::protobuf::RepeatedField<int32_t>& tokens,
                              int32_t max_tokens) const;

  const DecodeWorkerOptions options_;
  MetricsRegistry* metrics_;

  // Lock order: mu_ before any Active::mu.
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Reservation>> reservations_ ABSL_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Active>> pending_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int32_t active_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread scheduler_;

  Counter* generated_tokens_;
  Counter* received_bytes_;
  Counter* recomputed_requests_;
  Gauge* active_gauge_;
  Histogram* step_seconds_;

  // Declared last: destroyed first, so the transport stops calling OnInbound before the
  // reservations it touches go away.
  std::unique_ptr<worker::WorkerCore> core_;
  model::ModelRunner* runner_ = nullptr;     // core_->runner
  worker::RegisteredKvCache* kv_ = nullptr;  // core_->kv
  worker::StoreLink* store_ = nullptr;       // core_->store, may be null
};

}  // namespace kvrelay::decode
