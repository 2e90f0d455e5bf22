#pragma once

// ServiceHost: the one lifecycle every kvrelay server shares (cache store, prefill, decode,
// gateway) — a gRPC server with the standard grpc.health.v1 service, Prometheus /metrics on its
// own port, one "listening on" line for launchers, and a drain on SIGTERM/SIGINT: health turns
// NOT_SERVING, `on_drain` runs, new RPCs are refused, in-flight RPCs get up to drain_timeout.
//
// Usage (in a subcommand, before any thread is created):
//   ServiceHost::BlockShutdownSignals();
//   ... build services ...
//   KV_ASSIGN_OR_RETURN(auto host, ServiceHost::Start(options, {&service}, &metrics));
//   host->WaitForShutdown({.on_drain = ...});
//
// Thread-safe. The services and the registry must outlive the host.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "common/server/credentials.h"
#include "grpcpp/grpcpp.h"

namespace kvrelay::server {

struct ServiceHostOptions {
  std::string name;  // "prefill", "decode", "gateway", "cachestore"
  std::string host = "127.0.0.1";
  int port = 0;          // 0: any free port
  int metrics_port = 0;  // 0: any free port
  absl::Duration drain_timeout = absl::Seconds(30);
  int max_message_bytes = 16 << 20;
  SecurityOptions security;
  // Fully qualified gRPC service names reported SERVING by grpc.health.v1 besides "" (e.g.
  // "kvrelay.v1.CacheStore").
  std::vector<std::string> health_services;
  // False: health stays NOT_SERVING until SetServing(true) (a worker: once registered).
  bool serving_at_start = true;
  // Words appended to the listening line after the metrics address (a worker's device and
  // why, e.g. "device cpu (--device cpu)"); launchers read only the words before them.
  std::string listening_note;
  // --cpus: the CPUs the whole process runs on ("0-3,8"; empty: wherever the system puts it).
  // Applied by ParseServerCommandLine, before any thread starts, so every thread inherits it.
  std::string cpus;
};

struct ShutdownHooks {
  std::function<void()> on_drain;  // after NOT_SERVING, before the stop; spends drain_timeout
  std::function<void()> on_tick;   // periodically on the waiting thread until the signal
  absl::Duration tick = absl::Milliseconds(100);
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
  // An in-process channel to this server (tests, co-located callers).
  std::shared_ptr<grpc::Channel> InProcessChannel();

  // Blocks until SIGTERM/SIGINT or RequestShutdown(), then drains.
  void WaitForShutdown(const ShutdownHooks& hooks = {});
  void RequestShutdown() { shutdown_requested_.store(true, std::memory_order_release); }
  // grpc.health.v1 status of "" and every health_services name (see serving_at_start).
  void SetServing(bool serving);

 private:
  ServiceHost(ServiceHostOptions options, std::unique_ptr<grpc::Server> server, int port,
              std::unique_ptr<HttpServer> http);

  const ServiceHostOptions options_;
  std::unique_ptr<grpc::Server> server_;
  const int port_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<bool> draining_{false};  // release by the drainer, acquire by readers
  std::atomic<bool> shutdown_requested_{false};
};

// The tail of every server subcommand: serves `services` until SIGTERM/SIGINT, then drains.
// Returns the process exit code (1 when the server cannot start).
int ServeUntilSignal(const ServiceHostOptions& options, const std::vector<grpc::Service*>& services,
                     const MetricsRegistry* metrics, const ShutdownHooks& hooks = {});

}  // namespace kvrelay::server
