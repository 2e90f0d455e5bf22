#pragma once

// GatewayService: the gRPC glue for kvrelay.v1.Gateway over a Gateway — deadline and
// cancellation from the ServerContext, the stream writer, absl::Status to grpc::Status.
//
// Thread-safe. The gateway must outlive the service.

#include "gateway/gateway.h"
#include "kvrelay/v1/gateway.grpc.pb.h"

namespace kvrelay::gateway::server {

class GatewayService final : public kvrelay::v1::Gateway::Service {
 public:
  explicit GatewayService(Gateway* gateway) : gateway_(gateway) {}

  grpc::Status Generate(grpc::ServerContext* context, const kvrelay::v1::GenerateRequest* request,
                        grpc::ServerWriter<kvrelay::v1::GenerateResponse>* writer) override;

 private:
  Gateway* const gateway_;
};

}  // namespace kvrelay::gateway::server
