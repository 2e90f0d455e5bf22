#pragma once

// ServiceHost: the lifecycle every kvrelay server shares — a gRPC server with the standard
// grpc.health.v1 service, Prometheus /metrics on its own port, one "listening on" line for
// launchers, and a drain on SIGTERM/SIGINT: health turns NOT_SERVING, new RPCs are refused,
// in-flight RPCs get up to drain_timeout to finish, then the process exits 0.
//
// Usage (in a subcommand, before any thread is created):
//   ServiceHost::BlockShutdownSignals();
//   ... build services ...
//   KV_ASSIGN_OR_RETURN(auto host, ServiceHost::Start(options, {&service}, &metrics));
//   host->WaitForShutdown();
//
// Thread-safe. The services and registry must outlive the host.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "grpcpp/grpcpp.h"

namespace kvrelay::worker {

struct ServiceHostOptions {
  std::string name;  // "prefill", "decode", "gateway", "cachestore"
  std::string host = "127.0.0.1";
  int port = 0;          // 0: any free port
  int metrics_port = 0;  // 0: any free port
  absl::Duration drain_timeout = absl::Seconds(30);
  int max_message_bytes = 16 << 20;
};

class ServiceHost {
 public:
  // Blocks SIGTERM and SIGINT in the calling thread and every thread it later creates, so
  // WaitForShutdown() can receive them synchronously.
  static void BlockShutdownSignals();

  static absl::StatusOr<std::unique_ptr<ServiceHost>> Start(
      const ServiceHostOptions& options, const std::vector<grpc::Service*>& services,
      const MetricsRegistry* metrics);
  ~ServiceHost();

  int port() const { return port_; }
  int metrics_port() const { return http_->port(); }
  std::string address() const;  // host:port
  bool draining() const { return draining_.load(std::memory_order_acquire); }

  // Blocks until SIGTERM/SIGINT or RequestShutdown(), then drains. `on_drain` runs after
  // health turned NOT_SERVING and before the server stops (e.g. deregister from the store).
  void WaitForShutdown(const std::function<void()>& on_drain = {});
  void RequestShutdown() { shutdown_requested_.store(true, std::memory_order_release); }

 private:
  ServiceHost(ServiceHostOptions options, std::unique_ptr<grpc::Server> server, int port,
              std::unique_ptr<HttpServer> http);

  const ServiceHostOptions options_;
  std::unique_ptr<grpc::Server> server_;
  const int port_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<bool> draining_{false};           // release by the drainer, acquire by readers
  std::atomic<bool> shutdown_requested_{false};
};

// The tail of every server subcommand: serves `service` until SIGTERM/SIGINT, then drains
// (`on_drain` first). Returns the process exit code (1 when the server cannot start).
int ServeUntilSignal(const ServiceHostOptions& options, grpc::Service* service,
                     const MetricsRegistry* metrics, const std::function<void()>& on_drain = {});

// Parses "host:port" with 1 <= port <= 65535. InvalidArgument naming `what` otherwise.
absl::Status CheckHostPort(const std::string& address, const std::string& what);

// A model's default served name: the base name of its directory ("/models/tiny-llama/" ->
// "tiny-llama").
std::string ModelNameFromDir(std::string dir);

}  // namespace kvrelay::worker
