#pragma once

// The tail `kvrelay prefill` and `kvrelay decode` share: serve, register, wait, drain.
//
// Thread-safe (no state).

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/server/service_host.h"
#include "grpcpp/grpcpp.h"

namespace kvrelay::worker::server {

// Serves `service` on `host`, then, once the gRPC address is reachable, registers the worker
// with the store under that address as others see it (`advertise_host`, see
// kvrelay::server::AdvertisedHost) through `connect_store`, and serves until SIGTERM/SIGINT,
// then drains: `on_drain` gets the drain's deadline (now + host.drain_timeout) and returns once
// the worker is idle and deregistered; only then does the gRPC server stop. Returns the exit code:
// 0, or 1 with "kvrelay <host.name>: <status>" on stderr when the server or the registration fails.
int ServeWorker(const kvrelay::server::ServiceHostOptions& host, grpc::Service* service,
                const MetricsRegistry* metrics, const std::string& advertise_host,
                const std::function<absl::Status(const std::string& grpc_address)>& connect_store,
                std::function<void(absl::Time deadline)> on_drain = {});

}  // namespace kvrelay::worker::server
