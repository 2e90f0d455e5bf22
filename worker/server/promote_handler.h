#pragma once

// The gRPC glue of Promote, which the prefill and decode services both serve: the caller's
// authorization for `method`, the deadline from the ServerContext (a call without one gets a
// few seconds), absl::Status (with its ErrorInfo) to grpc::Status.
//
// Thread-safe (no state).

#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/server/auth.h"
#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/common.pb.h"

namespace kvrelay::worker::server {

using PromoteFn = std::function<absl::StatusOr<kvrelay::v1::PromoteResponse>(
    const kvrelay::v1::PromoteRequest&, absl::Time deadline)>;

grpc::Status HandlePromote(const kvrelay::server::Authorizer& authorizer,
                           grpc::ServerContext* context, const char* method,
                           const kvrelay::v1::PromoteRequest& request,
                           kvrelay::v1::PromoteResponse* response, const PromoteFn& promote);

}  // namespace kvrelay::worker::server
