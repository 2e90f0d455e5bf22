#pragma once

// How the gateway reaches workers: one interface per role, so the routing and failover logic
// (gateway/gateway.h) is the same whether workers sit behind gRPC (GrpcPrefillEndpoint,
// GrpcDecodeEndpoint, the production path) or in the same process (one-process serving tests
// call the real PrefillWorker / DecodeWorker directly).
//
// Every call takes an absolute deadline; failures carry kvrelay.v1.ErrorInfo where the worker
// attached one (proto/grpc_status.h).
//
// Thread-safe.

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/server/credentials.h"
#include "kvrelay/v1/decode.grpc.pb.h"
#include "kvrelay/v1/prefill.grpc.pb.h"

namespace kvrelay::gateway {

class PrefillEndpoint {
 public:
  virtual ~PrefillEndpoint() = default;
  virtual const std::string& address() const = 0;
  virtual absl::StatusOr<kvrelay::v1::PrefillResponse> Prefill(
      const kvrelay::v1::PrefillRequest& request, absl::Time deadline) = 0;
  virtual absl::StatusOr<kvrelay::v1::PrefillStatusResponse> Status(absl::Time deadline) = 0;
  // Blocks the worker holds on its disk tier back into its DRAM segment (best effort).
  virtual absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(
      const kvrelay::v1::PromoteRequest& request, absl::Time deadline) = 0;
};

// Receives decode chunks in order; returns false to stop (the caller went away).
using DecodeChunkSink = std::function<bool(const kvrelay::v1::DecodeChunk&)>;

class DecodeEndpoint {
 public:
  virtual ~DecodeEndpoint() = default;
  virtual const std::string& address() const = 0;
  virtual absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(
      const kvrelay::v1::ReserveRequest& request, absl::Time deadline) = 0;
  // Streams until done or error. `chunk_timeout` bounds the wait for each chunk (the first
  // token included): a worker that stalls longer fails the attempt with DeadlineExceeded.
  virtual absl::Status Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                                absl::Duration chunk_timeout, const DecodeChunkSink& sink) = 0;
  // Best effort (the reservation lapses anyway); `reservation_token` is Reserve's.
  virtual void Release(const std::string& request_id, const std::string& reservation_token,
                       absl::Time deadline) = 0;
  virtual absl::StatusOr<kvrelay::v1::DecodeStatusResponse> Status(absl::Time deadline) = 0;
  // As PrefillEndpoint::Promote.
  virtual absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(
      const kvrelay::v1::PromoteRequest& request, absl::Time deadline) = 0;
};

absl::StatusOr<std::unique_ptr<PrefillEndpoint>> MakeGrpcPrefillEndpoint(
    const std::string& address, const ::kvrelay::server::SecurityOptions& security);
absl::StatusOr<std::unique_ptr<DecodeEndpoint>> MakeGrpcDecodeEndpoint(
    const std::string& address, const ::kvrelay::server::SecurityOptions& security);

}  // namespace kvrelay::gateway
