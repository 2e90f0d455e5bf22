#pragma once

// DecodeService: the gRPC glue for kvrelay.v1.Decode over a DecodeWorker — deadlines and
// cancellation from the ServerContext, the stream writer, absl::Status (with its ErrorInfo) to
// grpc::Status. Nothing else.
//
// Thread-safe. The worker must outlive the service.

#include "common/server/auth.h"
#include "decode/decode_worker.h"
#include "kvrelay/v1/decode.grpc.pb.h"

namespace kvrelay::decode::server {

class DecodeService final : public kvrelay::v1::Decode::Service {
 public:
  // `authorizer` checks each caller against common/server/auth.h (default: nothing checked).
  explicit DecodeService(DecodeWorker* worker, kvrelay::server::Authorizer authorizer = {})
      : worker_(worker), authorizer_(authorizer) {}

  grpc::Status Reserve(grpc::ServerContext* context, const kvrelay::v1::ReserveRequest* request,
                       kvrelay::v1::ReserveResponse* response) override;
  grpc::Status Generate(grpc::ServerContext* context, const kvrelay::v1::DecodeRequest* request,
                        grpc::ServerWriter<kvrelay::v1::DecodeChunk>* writer) override;
  grpc::Status Release(grpc::ServerContext* context, const kvrelay::v1::ReleaseRequest* request,
                       kvrelay::v1::ReleaseResponse* response) override;
  grpc::Status Status(grpc::ServerContext* context, const kvrelay::v1::DecodeStatusRequest* request,
                      kvrelay::v1::DecodeStatusResponse* response) override;
  grpc::Status Promote(grpc::ServerContext* context, const kvrelay::v1::PromoteRequest* request,
                       kvrelay::v1::PromoteResponse* response) override;

 private:
  DecodeWorker* const worker_;
  const kvrelay::server::Authorizer authorizer_;
};

}  // namespace kvrelay::decode::server
