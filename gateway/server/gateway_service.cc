#include "gateway/server/gateway_service.h"

#include "proto/grpc_status.h"

namespace kvrelay::gateway::server {

grpc::Status GatewayService::Generate(grpc::ServerContext* context,
                                      const kvrelay::v1::GenerateRequest* request,
                                      grpc::ServerWriter<kvrelay::v1::GenerateResponse>* writer) {
  return proto::ToGrpcStatus(gateway_->Generate(
      *request, absl::FromChrono(context->deadline()),
      [writer](const kvrelay::v1::GenerateResponse& response) { return writer->Write(response); },
      [context] { return context->IsCancelled(); }));
}

}  // namespace kvrelay::gateway::server
