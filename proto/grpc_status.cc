#include "proto/grpc_status.h"

#include <algorithm>
#include <limits>

namespace kvrelay::proto {

absl::Status WithErrorInfo(absl::Status status, const kvrelay::v1::ErrorInfo& info) {
  if (status.ok()) return status;
  status.SetPayload(kErrorInfoTypeUrl, absl::Cord(info.SerializeAsString()));
  return status;
}

absl::Status Attribute(absl::Status status, kvrelay::v1::Role role, const std::string& node_id,
                       kvrelay::v1::FailureReason reason, const std::string& address) {
  kvrelay::v1::ErrorInfo info;
  info.set_role(role);
  info.set_node_id(node_id);
  info.set_reason(reason);
  info.set_address(address);
  return WithErrorInfo(std::move(status), info);
}

absl::Status Overloaded(std::string message, kvrelay::v1::Role role, const std::string& node_id,
                        const std::string& exhausted, int64_t retry_after_ms) {
  kvrelay::v1::ErrorInfo info;
  info.set_role(role);
  info.set_node_id(node_id);
  info.set_reason(kvrelay::v1::FAILURE_OVERLOADED);
  info.set_exhausted(exhausted);
  // Clamped to the field's range; a wait past ~49 days is as good as unknown anyway.
  info.set_retry_after_ms(static_cast<uint32_t>(
      std::clamp<int64_t>(retry_after_ms, 0, std::numeric_limits<uint32_t>::max())));
  return WithErrorInfo(absl::ResourceExhaustedError(std::move(message)), info);
}

std::optional<kvrelay::v1::ErrorInfo> GetErrorInfo(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kErrorInfoTypeUrl);
  if (!payload.has_value()) return std::nullopt;
  kvrelay::v1::ErrorInfo info;
  if (!info.ParseFromString(std::string(*payload))) return std::nullopt;
  return info;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  std::string details;
  if (std::optional<kvrelay::v1::ErrorInfo> info = GetErrorInfo(status)) {
    kvrelay::v1::RpcStatus rpc;
    rpc.set_code(static_cast<int32_t>(status.code()));
    rpc.set_message(std::string(status.message()));
    kvrelay::v1::RpcAny* any = rpc.add_details();
    any->set_type_url(kErrorInfoTypeUrl);
    any->set_value(info->SerializeAsString());
    details = rpc.SerializeAsString();
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()),
                      details);
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  if (!status.error_details().empty()) {
    kvrelay::v1::RpcStatus rpc;
    if (rpc.ParseFromString(status.error_details())) {
      for (const kvrelay::v1::RpcAny& any : rpc.details()) {
        if (any.type_url() == kErrorInfoTypeUrl) {
          out.SetPayload(kErrorInfoTypeUrl, absl::Cord(any.value()));
        }
      }
    }
  }
  return out;
}

}  // namespace kvrelay::proto
