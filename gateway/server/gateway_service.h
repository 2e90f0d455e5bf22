#pragma once

// GatewayService: the gRPC glue for kvrelay.v1.Gateway over a Gateway — deadline and
// cancellation from the ServerContext, the stream writer, absl::Status to grpc::Status, and
// the caller's authenticated tenant in place of the request's field.
//
// Thread-safe. The gateway must outlive the service.

#include "common/server/auth.h"
#include "gateway/gateway.h"
#include "gateway/tenant_auth.h"
#include "kvrelay/v1/gateway.grpc.pb.h"

namespace kvrelay::gateway::server {

class GatewayService final : public kvrelay::v1::Gateway::Service {
 public:
  // `authorizer` checks each caller against common/server/auth.h (default: nothing checked);
  // the tenant comes from the caller's credential (gateway/tenant_auth.h), with bearer tokens
  // checked by `verifier` (may be null: no token keys configured; must outlive the service).
  explicit GatewayService(Gateway* gateway, kvrelay::server::Authorizer authorizer = {},
                          const TenantTokenVerifier* verifier = nullptr)
      : gateway_(gateway), authorizer_(authorizer), verifier_(verifier) {}

  grpc::Status Generate(grpc::ServerContext* context, const kvrelay::v1::GenerateRequest* request,
                        grpc::ServerWriter<kvrelay::v1::GenerateResponse>* writer) override;
  // Gateway::Status within the call's deadline (10 s when it has none).
  grpc::Status Status(grpc::ServerContext* context,
                      const kvrelay::v1::GatewayStatusRequest* request,
                      kvrelay::v1::GatewayStatusResponse* response) override;

 private:
  Gateway* const gateway_;
  const kvrelay::server::Authorizer authorizer_;
  const TenantTokenVerifier* const verifier_;
};

}  // namespace kvrelay::gateway::server
