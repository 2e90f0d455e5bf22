#pragma once

// absl::Status <-> grpc::Status, carrying kvrelay.v1.ErrorInfo across the wire.
//
// Abseil's codes follow google.rpc.Code, as gRPC's do, so the code conversion is a cast. The
// structured detail travels as an absl::Status payload under kErrorInfoTypeUrl inside a process
// and as a google.rpc.Status-compatible RpcStatus in grpc::Status::error_details() on the wire.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "kvrelay/v1/common.pb.h"

namespace kvrelay::proto {

inline constexpr char kErrorInfoTypeUrl[] = "type.googleapis.com/kvrelay.v1.ErrorInfo";

// `status` with `info` attached (replacing an earlier ErrorInfo). OK stays OK.
absl::Status WithErrorInfo(absl::Status status, const kvrelay::v1::ErrorInfo& info);
// Shorthand: attributes `status` to (role, node, reason).
absl::Status Attribute(absl::Status status, kvrelay::v1::Role role, const std::string& node_id,
                       kvrelay::v1::FailureReason reason, const std::string& address = "");
// RESOURCE_EXHAUSTED with ErrorInfo{role, node, FAILURE_OVERLOADED, exhausted, retry_after_ms}:
// a refusal for capacity. `exhausted` names what is full ("slots", "kv_blocks", "queue",
// "inflight"); `retry_after_ms` the predicted wait until there is room (0: unknown).
absl::Status Overloaded(std::string message, kvrelay::v1::Role role, const std::string& node_id,
                        const std::string& exhausted, int64_t retry_after_ms);
// The attached ErrorInfo, if any.
std::optional<kvrelay::v1::ErrorInfo> GetErrorInfo(const absl::Status& status);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvrelay::proto
