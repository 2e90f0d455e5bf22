// `kvrelay cachestore` (`kvrelay trace-replay` lives in cachestore/tools).

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cachestore/cache_store.h"
#include "cachestore/kvevents/kv_event_publisher.h"
#include "cachestore/server/command.h"
#include "cachestore/server/service.h"
#include "common/flags.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/server/server_flags.h"
#include "common/server/service_host.h"

namespace kvrelay::cachestore::server {

int RunCacheStoreCommand(const std::vector<std::string>& args) {
  // SIGTERM / SIGINT are taken synchronously by the main thread, so block them before any
  // thread starts.
  kvrelay::server::ServiceHost::BlockShutdownSignals();
  FlagSet flags("cachestore", "Runs the cache store service (kvrelay.v1.CacheStore over gRPC).");
  kvrelay::server::ServiceHostOptions host;
  host.name = "cachestore";
  host.drain_timeout = absl::Seconds(5);
  host.health_services = {"kvrelay.v1.CacheStore"};
  std::string data_dir;
  std::string policy(kvrelay::cachestore::kDefaultPolicy);
  absl::Duration node_ttl = absl::Seconds(10);
  absl::Duration suspect_grace = absl::Seconds(30);
  absl::Duration commit_timeout = absl::Seconds(30);
  absl::Duration tick = absl::Milliseconds(100);
  bool wal_fsync = true;
  double high = 0.95, low = 0.90;
  int64_t snapshot_every = 100000;
  kvrelay::server::AddServerFlags(flags, host);
  kvrelay::cachestore::kvevents::KvEventsOptions kv_events;
  kvrelay::cachestore::kvevents::AddKvEventsFlags(flags, &kv_events);
  flags.AddString("data-dir", &data_dir, "WAL + snapshot directory; empty = no durability");
  flags.AddString("policy", &policy,
                  "eviction policy: adaptive (default), lrfu, probation-lru or leaf-lru");
  flags.AddDuration("node-ttl", &node_ttl,
                    "default heartbeat TTL of a node; past it the node is suspect (its blocks "
                    "are skipped, not dropped)");
  flags.AddDuration("suspect-grace", &suspect_grace,
                    "how long a suspect node keeps its blocks before it is forgotten");
  flags.AddDuration("commit-timeout", &commit_timeout, "time to commit an allocation");
  flags.AddDuration("tick", &tick, "period of expiry / eviction / snapshot work");
  flags.AddBool("wal-fsync", &wal_fsync, "fdatasync the WAL after each batch");
  flags.AddDouble("high-watermark", &high, "evict when this fraction of slots is used");
  flags.AddDouble("low-watermark", &low, "... down to this fraction");
  flags.AddInt64("snapshot-every", &snapshot_every, "WAL records between snapshots");
  if (std::optional<int> exit_code =
          kvrelay::server::ParseCommandLine(flags, args, "cachestore", &host.security)) {
    return *exit_code;
  }
  kv_events.insecure = host.security.insecure;
  if (node_ttl < absl::Milliseconds(100) || node_ttl > absl::Minutes(10)) {
    return kvrelay::server::UsageError("cachestore", "--node-ttl: want 100ms-10m");
  }
  if (suspect_grace < absl::ZeroDuration() || suspect_grace > absl::Hours(24)) {
    return kvrelay::server::UsageError("cachestore", "--suspect-grace: want 0-24h");
  }
  if (tick <= absl::ZeroDuration()) {
    return kvrelay::server::UsageError("cachestore", "--tick: must be positive");
  }

  kvrelay::cachestore::CacheStoreOptions options;
  options.policy = policy;
  options.data_dir = data_dir;
  options.wal_fsync = wal_fsync;
  options.default_node_ttl = node_ttl;
  options.suspect_grace = suspect_grace;
  Limits limits;  // one instance for the store and the service
  options.limits = limits;
  options.commit_timeout = commit_timeout;
  options.high_watermark = high;
  options.low_watermark = low;
  options.snapshot_every_ops = snapshot_every;
  absl::StatusOr<std::unique_ptr<kvrelay::cachestore::CacheStore>> store =
      kvrelay::cachestore::CacheStore::Create(options);
  if (!store.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", store.status().ToString().c_str());
    return absl::IsInvalidArgument(store.status()) ? 2 : 1;
  }
  absl::StatusOr<std::unique_ptr<kvrelay::cachestore::kvevents::KvEventPublisher>> publisher =
      kvrelay::cachestore::kvevents::KvEventPublisher::Start(store->get(), kv_events);
  if (!publisher.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", publisher.status().ToString().c_str());
    return absl::IsInvalidArgument(publisher.status()) ? 2 : 1;
  }
  host.max_message_bytes = limits.max_message_bytes;
  MetricsRegistry metrics;
  CacheStoreService service(store->get(), limits, &metrics,
                            kvrelay::server::Authorizer(host.security));
  absl::StatusOr<std::unique_ptr<kvrelay::server::ServiceHost>> server =
      kvrelay::server::ServiceHost::Start(host, {&service}, &metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", server.status().ToString().c_str());
    return 1;
  }
  (*server)->WaitForShutdown({.on_drain = [&service] { service.StopStreams(); },
                              .on_tick = [&store] { (*store)->Tick(); },
                              .tick = tick});
  server->reset();
  publisher->reset();
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

}  // namespace kvrelay::cachestore::server
