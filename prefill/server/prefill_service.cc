#include "prefill/server/prefill_service.h"

#include "proto/grpc_status.h"

namespace kvrelay::prefill::server {

grpc::Status PrefillService::Prefill(grpc::ServerContext* context,
                                     const kvrelay::v1::PrefillRequest* request,
                                     kvrelay::v1::PrefillResponse* response) {
  if (absl::Status allowed =
          authorizer_.Authorize(*context, "/kvrelay.v1.Prefill/Prefill").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  // A call without a deadline still ends: two minutes is far above any sane prefill.
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline > absl::Now() + absl::Minutes(10)) deadline = absl::Now() + absl::Minutes(2);
  absl::StatusOr<kvrelay::v1::PrefillResponse> result = worker_->Run(*request, deadline);
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status PrefillService::Status(grpc::ServerContext* context,
                                    const kvrelay::v1::PrefillStatusRequest*,
                                    kvrelay::v1::PrefillStatusResponse* response) {
  if (absl::Status allowed = authorizer_.Authorize(*context, "/kvrelay.v1.Prefill/Status").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  *response = worker_->Describe();
  return grpc::Status::OK;
}

grpc::Status PrefillService::Promote(grpc::ServerContext* context,
                                     const kvrelay::v1::PromoteRequest* request,
                                     kvrelay::v1::PromoteResponse* response) {
  if (absl::Status allowed =
          authorizer_.Authorize(*context, "/kvrelay.v1.Prefill/Promote").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  // Best effort for a request on its way: a call without a deadline gets a few seconds.
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline > absl::Now() + absl::Minutes(1)) deadline = absl::Now() + absl::Seconds(5);
  absl::StatusOr<kvrelay::v1::PromoteResponse> result = worker_->Promote(*request, deadline);
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

}  // namespace kvrelay::prefill::server
