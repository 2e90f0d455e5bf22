#include "cli/up/health_check.h"

#include "absl/strings/str_cat.h"
#include "common/server/credentials.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/grpc_status.h"

namespace kvrelay::cli::up {

absl::Status CheckServing(const std::string& address, absl::Duration timeout,
                          const server::SecurityOptions& security) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = server::MakeChannel(address, security);
  if (!channel.ok()) return channel.status();
  auto stub = grpc::health::v1::Health::NewStub(*channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return proto::FromGrpcStatus(status);
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(
        absl::StrCat(address, " health is ",
                     grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::cli::up
