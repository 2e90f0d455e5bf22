#include "decode/server/decode_service.h"

#include "proto/grpc_status.h"
#include "worker/server/promote_handler.h"

namespace kvrelay::decode::server {

grpc::Status DecodeService::Reserve(grpc::ServerContext* context,
                                    const kvrelay::v1::ReserveRequest* request,
                                    kvrelay::v1::ReserveResponse* response) {
  if (absl::Status allowed = authorizer_.Authorize(*context, "/kvrelay.v1.Decode/Reserve").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  // The caller's deadline: a request that cannot start by then is refused now.
  absl::StatusOr<kvrelay::v1::ReserveResponse> result =
      worker_->Reserve(*request, absl::FromChrono(context->deadline()));
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status DecodeService::Generate(grpc::ServerContext* context,
                                     const kvrelay::v1::DecodeRequest* request,
                                     grpc::ServerWriter<kvrelay::v1::DecodeChunk>* writer) {
  if (absl::Status allowed =
          authorizer_.Authorize(*context, "/kvrelay.v1.Decode/Generate").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  // A stream without a deadline still ends: an hour bounds any sane generation.
  absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline > absl::Now() + absl::Hours(1)) deadline = absl::Now() + absl::Hours(1);
  return proto::ToGrpcStatus(worker_->Generate(
      *request, deadline,
      [writer](const kvrelay::v1::DecodeChunk& chunk) { return writer->Write(chunk); },
      [context] { return context->IsCancelled(); }));
}

grpc::Status DecodeService::Release(grpc::ServerContext* context,
                                    const kvrelay::v1::ReleaseRequest* request,
                                    kvrelay::v1::ReleaseResponse*) {
  if (absl::Status allowed = authorizer_.Authorize(*context, "/kvrelay.v1.Decode/Release").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  return proto::ToGrpcStatus(worker_->Release(request->request_id(), request->reservation_token()));
}

grpc::Status DecodeService::Status(grpc::ServerContext* context,
                                   const kvrelay::v1::DecodeStatusRequest*,
                                   kvrelay::v1::DecodeStatusResponse* response) {
  if (absl::Status allowed = authorizer_.Authorize(*context, "/kvrelay.v1.Decode/Status").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  *response = worker_->Describe();
  return grpc::Status::OK;
}

grpc::Status DecodeService::Promote(grpc::ServerContext* context,
                                    const kvrelay::v1::PromoteRequest* request,
                                    kvrelay::v1::PromoteResponse* response) {
  return worker::server::HandlePromote(
      authorizer_, context, "/kvrelay.v1.Decode/Promote", *request, response,
      [this](const kvrelay::v1::PromoteRequest& r, absl::Time deadline) {
        return worker_->Promote(r, deadline);
      });
}

}  // namespace kvrelay::decode::server
