#include "worker/server/promote_handler.h"

#include "absl/time/clock.h"
#include "proto/grpc_status.h"

namespace kvrelay::worker::server {

grpc::Status HandlePromote(const kvrelay::server::Authorizer& authorizer,
                           grpc::ServerContext* context, const char* method,
                           const kvrelay::v1::PromoteRequest& request,
                           kvrelay::v1::PromoteResponse* response, const PromoteFn& promote) {
  if (absl::Status allowed = authorizer.Authorize(*context, method).status(); !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  // Best effort for a request on its way: a call without a deadline gets a few seconds.
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline > absl::Now() + absl::Minutes(1)) deadline = absl::Now() + absl::Seconds(5);
  absl::StatusOr<kvrelay::v1::PromoteResponse> result = promote(request, deadline);
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

}  // namespace kvrelay::worker::server
