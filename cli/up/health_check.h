#pragma once

// grpc.health.v1 Check against a kvrelay server (every server registers the "" service).

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/server/credentials.h"

namespace kvrelay::cli::up {

// OK when `address` answers SERVING within `timeout`; Unavailable for NOT_SERVING or
// UNKNOWN (naming the status), the RPC's own error otherwise.
absl::Status CheckServing(const std::string& address, absl::Duration timeout,
                          const server::SecurityOptions& security = {});

}  // namespace kvrelay::cli::up
