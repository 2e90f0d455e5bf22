#pragma once

// Leadership: whether this cache store instance may serve, and with which term. A store run
// without --etcd has none (it always serves, term 0); with --etcd, HighAvailability implements
// it from the etcd election (cachestore/server/high_availability.h).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "kvrelay/v1/common.pb.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore::server {

// The metadata key every reply of a store with --etcd carries: the leader's term in decimal.
// Clients keep the highest term they have seen and drop replies from an older one.
inline constexpr char kTermMetadataKey[] = "kvrelay-store-term";

class Leadership {
 public:
  virtual ~Leadership() = default;
  // The term while this instance leads and may serve; otherwise NotLeaderError(...).
  virtual absl::StatusOr<int64_t> LeaderTerm() const = 0;
};

// UNAVAILABLE with ErrorInfo {ROLE_STORE, FAILURE_NOT_LEADER, address = the leader's gRPC
// address ("" when unknown)}: nothing was applied; the caller retries at `leader_address`.
inline absl::Status NotLeaderError(const std::string& why, const std::string& leader_address) {
  return proto::Attribute(absl::UnavailableError(why), kvrelay::v1::ROLE_STORE, "",
                          kvrelay::v1::FAILURE_NOT_LEADER, leader_address);
}

}  // namespace kvrelay::cachestore::server
