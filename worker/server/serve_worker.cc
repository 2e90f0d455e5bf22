#include "worker/server/serve_worker.h"

#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/server/server_flags.h"

namespace kvrelay::worker::server {

int ServeWorker(const kvrelay::server::ServiceHostOptions& host, grpc::Service* service,
                const MetricsRegistry* metrics, const std::string& advertise_host,
                const std::function<absl::Status(const std::string& grpc_address)>& connect_store,
                std::function<void(absl::Time deadline)> on_drain) {
  kvrelay::server::ServiceHostOptions options = host;
  options.serving_at_start = false;
  absl::StatusOr<std::unique_ptr<kvrelay::server::ServiceHost>> server =
      kvrelay::server::ServiceHost::Start(options, {service}, metrics);
  absl::Status status = server.status();
  // Registered only now that the gateway can reach the advertised gRPC address. Health says
  // SERVING only once registered: a gateway that starts after this worker is healthy (kvrelay
  // up, readiness probes) then finds it in the store at once (ASan's slower start-up showed a
  // gateway that started in between and had no prefill worker for its first requests).
  if (status.ok()) {
    status = connect_store(absl::StrCat(kvrelay::server::AdvertisedHost(host.host, advertise_host),
                                        ":", (*server)->port()));
    if (status.ok()) (*server)->SetServing(true);
  }
  if (!status.ok()) {
    // The code and the message; the status's ErrorInfo payload is for programs, not people.
    std::fprintf(stderr, "kvrelay %s: %s: %s\n", host.name.c_str(),
                 absl::StatusCodeToString(status.code()).c_str(),
                 std::string(status.message()).c_str());
    return 1;
  }
  (*server)->WaitForShutdown({.on_drain = [&] {
    // Health turned NOT_SERVING; the worker refuses new work with FAILURE_DRAINING (gateways
    // skip it), finishes what it admitted and deregisters while its gRPC server still answers.
    if (on_drain) on_drain(absl::Now() + host.drain_timeout);
  }});
  return 0;
}

}  // namespace kvrelay::worker::server
