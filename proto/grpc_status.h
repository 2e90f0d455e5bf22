#pragma once

// absl::Status <-> grpc::Status. Abseil's codes follow google.rpc.Code, as gRPC's do, so the
// conversion is a cast.

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvrelay::proto {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

}  // namespace kvrelay::proto
