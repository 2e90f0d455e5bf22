// `kvrelay cachestore` (`kvrelay trace-replay` lives in cachestore/tools).

#include <signal.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cachestore/cache_store.h"
#include "cachestore/server/metrics_http.h"
#include "cachestore/server/service.h"
#include "common/flags.h"
#include "common/logging.h"
#include "gateway/cli/commands.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"

namespace kvrelay::cli {

int RunCacheStoreCommand(const std::vector<std::string>& args) {
  FlagSet flags("cachestore", "Runs the cache store service (kvrelay.v1.CacheStore over gRPC).");
  std::string host = "127.0.0.1";
  int32_t port = 0;
  int32_t metrics_port = 0;
  std::string data_dir;
  std::string policy(cachestore::kDefaultPolicy);
  absl::Duration node_ttl = absl::Seconds(10);
  absl::Duration commit_timeout = absl::Seconds(30);
  absl::Duration tick = absl::Milliseconds(100);
  absl::Duration drain = absl::Seconds(5);
  bool wal_fsync = true;
  double high = 0.95, low = 0.90;
  int64_t snapshot_every = 100000;
  flags.AddString("host", &host, "IPv4 address to listen on (gRPC and metrics)");
  flags.AddInt32("port", &port, "gRPC port; 0 picks a free one");
  flags.AddInt32("metrics-port", &metrics_port, "Prometheus /metrics port; 0 picks a free one");
  flags.AddString("data-dir", &data_dir, "WAL + snapshot directory; empty = no durability");
  flags.AddString("policy", &policy, "eviction policy: lrfu (default), adaptive or leaf-lru");
  flags.AddDuration("node-ttl", &node_ttl, "default heartbeat TTL of a node");
  flags.AddDuration("commit-timeout", &commit_timeout, "time to commit an allocation");
  flags.AddDuration("tick", &tick, "period of expiry / eviction / snapshot work");
  flags.AddDuration("drain", &drain, "grace for in-flight RPCs on SIGTERM");
  flags.AddBool("wal-fsync", &wal_fsync, "fdatasync the WAL after each batch");
  flags.AddDouble("high-watermark", &high, "evict when this fraction of slots is used");
  flags.AddDouble("low-watermark", &low, "... down to this fraction");
  flags.AddInt64("snapshot-every", &snapshot_every, "WAL records between snapshots");
  if (absl::Status s = flags.Parse(args); !s.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  if (port < 0 || port > 65535 || metrics_port < 0 || metrics_port > 65535) {
    std::fprintf(stderr, "kvrelay cachestore: port / metrics-port: want 0-65535\n");
    return 2;
  }
  if (tick <= absl::ZeroDuration()) {
    std::fprintf(stderr, "kvrelay cachestore: tick: must be positive\n");
    return 2;
  }
  // SIGTERM / SIGINT are taken synchronously by the main thread (sigtimedwait), so block them
  // before any thread starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  cachestore::CacheStoreOptions options;
  options.policy = policy;
  options.data_dir = data_dir;
  options.wal_fsync = wal_fsync;
  options.default_node_ttl = node_ttl;
  options.commit_timeout = commit_timeout;
  options.high_watermark = high;
  options.low_watermark = low;
  options.snapshot_every_ops = snapshot_every;
  absl::StatusOr<std::unique_ptr<cachestore::CacheStore>> store =
      cachestore::CacheStore::Create(options);
  if (!store.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", store.status().ToString().c_str());
    return absl::IsInvalidArgument(store.status()) ? 2 : 1;
  }
  cachestore::server::Limits limits;
  cachestore::server::CacheStoreService service(store->get(), limits);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(),
                           &bound_port);
  builder.SetMaxReceiveMessageSize(limits.max_message_bytes);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound_port == 0) {
    std::fprintf(stderr, "kvrelay cachestore: port: cannot listen on %s:%d\n", host.c_str(), port);
    return 1;
  }
  if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService()) {
    health->SetServingStatus("kvrelay.v1.CacheStore", true);
  }
  absl::StatusOr<std::unique_ptr<cachestore::server::MetricsHttpServer>> metrics =
      cachestore::server::MetricsHttpServer::Start(host, metrics_port,
                                                   [&service] { return service.RenderMetrics(); });
  if (!metrics.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", metrics.status().ToString().c_str());
    server->Shutdown();
    return 1;
  }
  std::printf("cachestore listening on %s:%d metrics %s:%d\n", host.c_str(), bound_port,
              host.c_str(), (*metrics)->port());
  std::fflush(stdout);

  // Main thread: periodic Tick() and signal wait in one loop.
  int signo = 0;
  while (signo <= 0) {
    timespec ts = absl::ToTimespec(tick);
    signo = sigtimedwait(&sigs, nullptr, &ts);
    (*store)->Tick();
  }
  KV_LOG(INFO) << "cachestore: signal " << signo << ", draining for up to " << drain;
  // Health turns NOT_SERVING first so launchers and load balancers stop sending work.
  if (grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService()) {
    health->Shutdown();
  }
  service.StopStreams();
  server->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(drain));
  server->Wait();
  metrics->reset();
  if (!data_dir.empty()) {
    absl::Status s = (*store)->WriteSnapshotNow();
    if (!s.ok()) {
      KV_LOG(WARNING) << "cachestore: final snapshot: " << s;
    }
  }
  std::printf("cachestore stopped\n");
  std::fflush(stdout);
  return 0;
}

}  // namespace kvrelay::cli
