// `kvrelay cachestore` (`kvrelay trace-replay` lives in cachestore/tools).

#include "cachestore/server/command.h"

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cachestore/cache_store.h"
#include "cachestore/etcd/etcd_client.h"
#include "cachestore/kvevents/kv_event_publisher.h"
#include "cachestore/server/high_availability.h"
#include "cachestore/server/service.h"
#include "common/flags.h"
#include "common/heap.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/server/server_flags.h"
#include "common/server/service_host.h"
#include "kv/hf_config.h"

namespace kvrelay::cachestore::server {

// How often the store's server hands free heap pages back (RunCacheStoreCommand's tick).
constexpr absl::Duration kHeapTrimEvery = absl::Seconds(30);

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
  int64_t event_retention = 1 << 16;
  std::string etcd_endpoints, advertise_address;
  HaOptions ha_options;
  kvrelay::server::AddServerFlags(flags, host);
  flags.AddString("etcd", &etcd_endpoints,
                  "high availability: etcd endpoints (HOST:PORT,...); every instance campaigns, "
                  "the leader serves, the others follow its log as warm standbys");
  flags.AddString("advertise-address", &advertise_address,
                  "with --etcd: the gRPC HOST:PORT clients and the other instances reach this "
                  "one at (default: the listening address)");
  flags.AddString("election-key", &ha_options.election_key, "with --etcd: the leader key");
  flags.AddDuration("etcd-lease-ttl", &ha_options.lease_ttl,
                    "with --etcd: the leader's lease; a dead leader is replaced after about this");
  flags.AddString("etcd-ca", &ha_options.etcd_ca_file,
                  "with --etcd: mutual TLS to etcd (an etcd with --client-cert-auth): PEM CA "
                  "bundle etcd's certificate must chain to; with --etcd-cert and --etcd-key, "
                  "all checked at start (none of the three: plain text)");
  flags.AddString("etcd-cert", &ha_options.etcd_cert_file,
                  "with --etcd-ca: this store's PEM client certificate for etcd");
  flags.AddString("etcd-key", &ha_options.etcd_key_file, "with --etcd-ca: its PEM private key");
  kvrelay::cachestore::kvevents::KvEventsOptions kv_events;
  kvrelay::cachestore::kvevents::AddKvEventsFlags(flags, &kv_events);
  flags.AddString("data-dir", &data_dir, "WAL + snapshot directory; empty = no durability");
  flags.AddString(
      "policy", &policy,
      "eviction policy: adaptive (default), lrfu, probation-lag, probation-lru or leaf-lru");
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
  flags.AddInt64("event-retention", &event_retention,
                 "block and node events kept in memory for WatchEvents to resume from (about "
                 "350 bytes each)");
  int32_t block_tokens = kv::kDefaultBlockTokens;
  flags.AddInt32("block-tokens", &block_tokens,
                 "tokens per KV block every worker and gateway must use (a worker that "
                 "registers with another value is refused)");
  if (std::optional<int> exit_code =
          kvrelay::server::ParseServerCommandLine(flags, args, "cachestore", host)) {
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
  if (event_retention < 1 || event_retention > (int64_t{1} << 24)) {
    return kvrelay::server::UsageError("cachestore", "--event-retention: want 1-16777216");
  }
  if (absl::Status s = kv::CheckBlockTokensFlag(block_tokens); !s.ok()) {
    return kvrelay::server::UsageError("cachestore", s.message());
  }
  if (!etcd_endpoints.empty()) {
    absl::StatusOr<std::vector<std::string>> endpoints = etcd::ParseEndpoints(etcd_endpoints);
    if (!endpoints.ok()) {
      return kvrelay::server::UsageError("cachestore",
                                         absl::StrCat("--etcd: ", endpoints.status().message()));
    }
    ha_options.etcd_endpoints = *std::move(endpoints);
    if (ha_options.lease_ttl < absl::Seconds(1) || ha_options.lease_ttl > absl::Minutes(1)) {
      return kvrelay::server::UsageError("cachestore", "--etcd-lease-ttl: want 1s-1m");
    }
    if (!advertise_address.empty()) {
      if (absl::Status s = kvrelay::server::CheckHostPort(advertise_address, "--advertise-address");
          !s.ok()) {
        return kvrelay::server::UsageError("cachestore", std::string(s.message()));
      }
    }
  } else if (!advertise_address.empty()) {
    return kvrelay::server::UsageError("cachestore", "--advertise-address needs --etcd");
  } else if (!ha_options.etcd_ca_file.empty() || !ha_options.etcd_cert_file.empty() ||
             !ha_options.etcd_key_file.empty()) {
    return kvrelay::server::UsageError("cachestore",
                                       "--etcd-ca, --etcd-cert and --etcd-key need --etcd");
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
  options.event_retention = static_cast<size_t>(event_retention);
  options.block_tokens = block_tokens;
  // The events' BlockStored.token_ids; without a publisher tokens are dropped on arrival.
  options.keep_block_tokens = !kv_events.endpoint.empty();
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
  std::unique_ptr<HighAvailability> ha;
  if (!ha_options.etcd_endpoints.empty()) {
    ha_options.security = host.security;
    absl::StatusOr<std::unique_ptr<HighAvailability>> created =
        HighAvailability::Create(store->get(), ha_options);
    if (!created.ok()) {
      std::fprintf(stderr, "kvrelay cachestore: %s\n", created.status().ToString().c_str());
      return absl::IsInvalidArgument(created.status()) ? 2 : 1;
    }
    ha = *std::move(created);
    ha->RegisterMetrics(&metrics);
  }
  const kvrelay::server::Authorizer authorizer(host.security);
  CacheStoreService service(store->get(), limits, &metrics, authorizer, ha.get());
  ReplicationService replication(store->get(), ha.get(), authorizer);
  std::vector<grpc::Service*> services = {&service};
  if (ha != nullptr) services.push_back(&replication);
  absl::StatusOr<std::unique_ptr<kvrelay::server::ServiceHost>> server =
      kvrelay::server::ServiceHost::Start(host, services, &metrics);
  if (!server.ok()) {
    std::fprintf(stderr, "kvrelay cachestore: %s\n", server.status().ToString().c_str());
    return 1;
  }
  if (ha != nullptr) {
    absl::Status started =
        ha->Start(advertise_address.empty() ? (*server)->address() : advertise_address);
    if (!started.ok()) {
      std::fprintf(stderr, "kvrelay cachestore: %s\n", started.ToString().c_str());
      return 1;
    }
  }
  // Only the leader does time-driven work: a standby gets no heartbeats and must not expire the
  // nodes it follows (the leader's expiries arrive through its log).
  HighAvailability* ha_ptr = ha.get();
  absl::Time next_trim = absl::Now() + kHeapTrimEvery;
  (*server)->WaitForShutdown({.on_drain =
                                  [&service, &replication, ha_ptr] {
                                    service.StopStreams();
                                    replication.StopStreams();
                                    // Hand over now, not after the drain: the RPCs still
                                    // running are refused at their end (FAILURE_NOT_LEADER)
                                    // and their clients retry at the new leader.
                                    if (ha_ptr != nullptr) ha_ptr->Stop();
                                  },
                              .on_tick =
                                  [&store, ha_ptr, &next_trim] {
                                    if (ha_ptr == nullptr || ha_ptr->IsLeading()) (*store)->Tick();
                                    // Request and stream buffers freed after a burst (every
                                    // node re-registering after a cut) stay resident in
                                    // glibc's arenas: a 30-minute soak's store RSS wandered
                                    // +-10 MiB and ended 6.8% up with its index flat.
                                    if (absl::Now() >= next_trim) {
                                      ReleaseFreeHeapMemory();
                                      next_trim = absl::Now() + kHeapTrimEvery;
                                    }
                                  },
                              .tick = tick});
  server->reset();
  ha.reset();  // resigns: a standby takes over at once
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
