#include "prefill/server/prefill_service.h"

#include "proto/grpc_status.h"
#include "worker/server/promote_handler.h"

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
  return worker::server::HandlePromote(
      authorizer_, context, "/kvrelay.v1.Prefill/Promote", *request, response,
      [this](const kvrelay::v1::PromoteRequest& r, absl::Time deadline) {
        return worker_->Promote(r, deadline);
      });
}

}  // namespace kvrelay::prefill::server
