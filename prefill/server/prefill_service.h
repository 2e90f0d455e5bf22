#pragma once

// PrefillService: the gRPC glue for kvrelay.v1.Prefill over a PrefillWorker — deadlines from
// the ServerContext, absl::Status (with its ErrorInfo) to grpc::Status. Nothing else.
//
// Thread-safe. The worker must outlive the service.

#include "common/server/auth.h"
#include "kvrelay/v1/prefill.grpc.pb.h"
#include "prefill/prefill_worker.h"

namespace kvrelay::prefill::server {

class PrefillService final : public kvrelay::v1::Prefill::Service {
 public:
  // `authorizer` checks each caller against common/server/auth.h (default: nothing checked).
  explicit PrefillService(PrefillWorker* worker, kvrelay::server::Authorizer authorizer = {})
      : worker_(worker), authorizer_(authorizer) {}

  grpc::Status Prefill(grpc::ServerContext* context, const kvrelay::v1::PrefillRequest* request,
                       kvrelay::v1::PrefillResponse* response) override;
  grpc::Status Status(grpc::ServerContext* context,
                      const kvrelay::v1::PrefillStatusRequest* request,
                      kvrelay::v1::PrefillStatusResponse* response) override;
  grpc::Status Promote(grpc::ServerContext* context, const kvrelay::v1::PromoteRequest* request,
                       kvrelay::v1::PromoteResponse* response) override;

 private:
  PrefillWorker* const worker_;
  const kvrelay::server::Authorizer authorizer_;
};

}  // namespace kvrelay::prefill::server
