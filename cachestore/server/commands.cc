// `kvrelay cachestore` and `kvrelay trace-replay`.

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cachestore/cache_store.h"
#include "cachestore/server/command.h"
#include "cachestore/server/service.h"
#include "cachestore/trace_replay.h"
#include "common/flags.h"
#include "common/logging.h"
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
  flags.AddString("data-dir", &data_dir, "WAL + snapshot directory; empty = no durability");
  flags.AddString("policy", &policy, "eviction policy: lrfu (default) or leaf-lru");
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
  host.max_message_bytes = limits.max_message_bytes;
  CacheStoreService service(store->get(), limits);
  absl::StatusOr<std::unique_ptr<kvrelay::server::ServiceHost>> server =
      kvrelay::server::ServiceHost::Start(host, {&service}, /*metrics=*/nullptr,
                                          [&service] { return service.RenderMetrics(); });
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", server.status().ToString().c_str());
    return 1;
  }
  (*server)->WaitForShutdown({.on_drain = [&service] { service.StopStreams(); },
                              .on_tick = [&store] { (*store)->Tick(); },
                              .tick = tick});
  server->reset();
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

int RunTraceReplayCommand(const std::vector<std::string>& args) {
  FlagSet flags("trace-replay",
                "Replays a Mooncake-format trace through the cache store's index and eviction "
                "code and prints the prefix hit rate.");
  std::string trace;
  int64_t capacity = 0;
  std::string policy(kvrelay::cachestore::kDefaultPolicy);
  bool json = false;
  flags.AddString("trace", &trace, "JSON-lines trace with hash_ids (required)");
  flags.AddInt64("capacity-blocks", &capacity, "cache capacity in blocks (required, > 0)");
  flags.AddString("policy", &policy, "lru (plain baseline), leaf-lru or lrfu (default)");
  flags.AddBool("json", &json, "print one JSON object");
  if (absl::Status s = flags.Parse(args); !s.ok()) {
    std::fprintf(stderr, "kvrelay trace-replay: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::cout << flags.Usage();
    return 0;
  }
  if (trace.empty()) {
    std::fprintf(stderr, "kvrelay trace-replay: trace: required\n");
    return 2;
  }
  if (capacity <= 0) {
    std::fprintf(stderr, "kvrelay trace-replay: capacity-blocks: must be positive, got %lld\n",
                 static_cast<long long>(capacity));
    return 2;
  }
  absl::StatusOr<std::vector<kvrelay::cachestore::TraceRequest>> requests = kvrelay::cachestore::LoadTrace(trace);
  if (!requests.ok()) {
    std::fprintf(stderr, "kvrelay trace-replay: %s\n", requests.status().ToString().c_str());
    return absl::IsInvalidArgument(requests.status()) ? 2 : 1;
  }
  absl::StatusOr<kvrelay::cachestore::ReplayResult> r =
      kvrelay::cachestore::ReplayTrace(*requests, capacity, policy);
  if (!r.ok()) {
    std::fprintf(stderr, "kvrelay trace-replay: %s\n", r.status().ToString().c_str());
    return 2;
  }
  if (json) {
    std::printf(
        "{\"policy\": \"%s\", \"capacity_blocks\": %lld, \"hit_rate\": %.6f, \"requests\": %lld, "
        "\"blocks\": %lld, \"hit_blocks\": %lld, \"evictions\": %lld}\n",
        r->policy.c_str(), static_cast<long long>(r->capacity_blocks), r->hit_rate(),
        static_cast<long long>(r->requests), static_cast<long long>(r->blocks),
        static_cast<long long>(r->hit_blocks), static_cast<long long>(r->evictions));
  } else {
    std::printf("policy %s capacity %lld blocks: hit rate %.4f (%lld of %lld blocks, %lld "
                "requests, %lld evictions)\n",
                r->policy.c_str(), static_cast<long long>(r->capacity_blocks), r->hit_rate(),
                static_cast<long long>(r->hit_blocks), static_cast<long long>(r->blocks),
                static_cast<long long>(r->requests), static_cast<long long>(r->evictions));
  }
  return 0;
}

}  // namespace kvrelay::cachestore::server
