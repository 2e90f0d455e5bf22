#include "gateway/server/gateway_service.h"

#include <algorithm>

#include "proto/grpc_status.h"

namespace kvrelay::gateway::server {

grpc::Status GatewayService::Generate(grpc::ServerContext* context,
                                      const kvrelay::v1::GenerateRequest* request,
                                      grpc::ServerWriter<kvrelay::v1::GenerateResponse>* writer) {
  absl::StatusOr<kvrelay::server::Peer> peer =
      authorizer_.Authorize(*context, "/kvrelay.v1.Gateway/Generate");
  if (!peer.ok()) return proto::ToGrpcStatus(peer.status());
  absl::string_view authorization;
  const auto& metadata = context->client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  absl::StatusOr<std::string> tenant = ResolveTenant(*peer, authorizer_.enforcing(), authorization,
                                                     request->tenant(), verifier_, absl::Now());
  if (!tenant.ok()) return proto::ToGrpcStatus(tenant.status());
  kvrelay::v1::GenerateRequest authenticated;
  if (*tenant != request->tenant()) {
    authenticated = *request;
    authenticated.set_tenant(*tenant);
    request = &authenticated;
  }
  // The per-client quotas count by the caller's certificate (one client process), whatever
  // tenant its bearer tokens name; --insecure callers have no identity.
  const std::string client =
      peer->authenticated ? kvrelay::server::SpiffeUri(peer->role, peer->id) : std::string();
  return proto::ToGrpcStatus(gateway_->Generate(
      *request, absl::FromChrono(context->deadline()),
      [writer](const kvrelay::v1::GenerateResponse& response) { return writer->Write(response); },
      [context] { return context->IsCancelled(); }, client));
}

grpc::Status GatewayService::Status(grpc::ServerContext* context,
                                    const kvrelay::v1::GatewayStatusRequest* /*request*/,
                                    kvrelay::v1::GatewayStatusResponse* response) {
  if (absl::Status allowed = authorizer_.Authorize(*context, "/kvrelay.v1.Gateway/Status").status();
      !allowed.ok()) {
    return proto::ToGrpcStatus(allowed);
  }
  const absl::Time deadline =
      std::min(absl::FromChrono(context->deadline()), absl::Now() + absl::Seconds(10));
  absl::StatusOr<kvrelay::v1::GatewayStatusResponse> status = gateway_->Status(deadline);
  if (!status.ok()) return proto::ToGrpcStatus(status.status());
  *response = *std::move(status);
  return grpc::Status::OK;
}

}  // namespace kvrelay::gateway::server
