#pragma once

// High availability of the cache store on etcd (issue 20, `kvrelay cachestore --etcd`).
//
// Every instance campaigns for the leader key under a lease (etcd::LeaderElection, which fails
// closed on its own clock). The leader serves every RPC; the others are warm standbys that
// follow the leader's log over CacheStoreReplication/Follow (a snapshot, then each WAL record
// as the leader logs it), apply it to their own CacheStore and append it to their own WAL, and
// answer every other RPC with UNAVAILABLE + FAILURE_NOT_LEADER naming the leader's address.
// When the leader goes (kill -9, lost lease, SIGSTOP past its TTL) a standby wins the key, stops
// following, promotes its store (the nodes it knows get one TTL to heartbeat to it) and serves
// with the new term. A leader that lost its lease refuses at once (LeaderTerm() checks the
// election on every call) and, once it follows the new leader, replaces its state with the new
// leader's snapshot: whatever it applied after its last replicated op is dropped.
//
// Fencing: the term is the leader key's create revision (it grows with every new leader). Every
// reply carries it (kTermMetadataKey); the replication stream carries it and a follower drops a
// stream whose term is not the one etcd names or is older than one it has seen.
//
// Thread-safe. The store must outlive this object; the destructor resigns (a standby takes over
// at once on a clean shutdown).

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "cachestore/cache_store.h"
#include "cachestore/etcd/etcd_client.h"
#include "cachestore/etcd/leader_election.h"
#include "cachestore/server/leadership.h"
#include "common/metrics.h"
#include "common/server/auth.h"
#include "common/server/credentials.h"
#include "grpcpp/grpcpp.h"
#include "kvrelay/v1/replication.grpc.pb.h"

namespace kvrelay::cachestore::server {

struct HaOptions {
  std::vector<std::string> etcd_endpoints;
  // Mutual TLS to etcd (--etcd-ca, --etcd-cert, --etcd-key): all three or none (plain text).
  std::string etcd_ca_file, etcd_cert_file, etcd_key_file;
  // This instance's gRPC address as clients and the other instances reach it (host:port).
  std::string advertise_address;
  std::string election_key = "/kvrelay/cachestore/leader";
  absl::Duration lease_ttl = absl::Seconds(2);  // etcd's minimum; failover takes about this
  // Per etcd call; a keepalive slower than this counts as etcd unreachable (the lease still
  // holds until it could have expired).
  absl::Duration etcd_timeout = absl::Seconds(1);
  // Credentials for the Follow stream to the leader (a store certificate under mTLS).
  kvrelay::server::SecurityOptions security;
};

class HighAvailability final : public Leadership {
 public:
  // Connects to etcd (lazily) and starts nothing yet: LeaderTerm() refuses until Start().
  static absl::StatusOr<std::unique_ptr<HighAvailability>> Create(CacheStore* store,
                                                                  HaOptions options);
  ~HighAvailability() override;

  // Campaigns and follows. `advertise_address` replaces the option when non-empty (the address
  // is known only once the server listens).
  absl::Status Start(const std::string& advertise_address = "");

  // Stops following and resigns (a standby takes over at once); every call is refused from
  // now on. Idempotent; the destructor calls it. REQUIRES: not concurrently with Start().
  void Stop();

  absl::StatusOr<int64_t> LeaderTerm() const override;
  bool IsLeading() const { return LeaderTerm().ok(); }
  etcd::LeaderElection::State election_state() const;
  // Replication progress as a follower: ops applied, and how far behind the leader's log end
  // the last batch left it.
  uint64_t applied_position() const { return position_.load(std::memory_order_relaxed); }
  int64_t lag_ops() const { return lag_ops_.load(std::memory_order_relaxed); }

  // kvrelay:cachestore_ha_* families (leading, term, lag, takeovers).
  void RegisterMetrics(MetricsRegistry* metrics);

 private:
  HighAvailability(CacheStore* store, HaOptions options, std::unique_ptr<etcd::EtcdClient> etcd);
  void Run();  // the role thread: promote, step down, follow
  // One Follow stream to `leader` expecting `term`, until it ends or leadership changes.
  absl::Status FollowOnce(const std::string& leader, int64_t term);
  void OnElectionChange(const etcd::LeaderElection::State& state);

  CacheStore* const store_;
  HaOptions options_;
  std::unique_ptr<etcd::EtcdClient> etcd_;
  std::unique_ptr<etcd::LeaderElection> election_;
  // The term this instance serves with; set by the role thread only after the store was
  // promoted (release), read by LeaderTerm (acquire).
  std::atomic<int64_t> serving_term_{0};
  std::atomic<int64_t> takeovers_{0};
  absl::Mutex follow_mu_;
  grpc::ClientContext* follow_ctx_ ABSL_GUARDED_BY(follow_mu_) = nullptr;
  // The leader process whose log this instance applied, and the position after it (role thread
  // only, but read for metrics).
  uint64_t followed_incarnation_ = 0;
  std::atomic<uint64_t> position_{0};
  std::atomic<int64_t> lag_ops_{0};
  int64_t max_term_seen_ = 0;
  absl::Notification stop_;
  std::thread thread_;
};

// kvrelay.v1.CacheStoreReplication: the leader's side of Follow.
class ReplicationService final : public kvrelay::v1::CacheStoreReplication::Service {
 public:
  // Not owned; all must outlive the service.
  ReplicationService(CacheStore* store, const Leadership* leadership,
                     kvrelay::server::Authorizer authorizer)
      : store_(store), leadership_(leadership), authorizer_(std::move(authorizer)) {}

  grpc::Status Follow(grpc::ServerContext* ctx, const kvrelay::v1::FollowRequest* req,
                      grpc::ServerWriter<kvrelay::v1::ReplicationBatch>* writer) override;
  // Makes Follow streams end (server shutdown).
  void StopStreams() { stopping_.store(true, std::memory_order_release); }

 private:
  CacheStore* const store_;
  const Leadership* const leadership_;
  const kvrelay::server::Authorizer authorizer_;
  // Release/acquire pair: StopStreams() publishes, Follow loops observe.
  std::atomic<bool> stopping_{false};
};

}  // namespace kvrelay::cachestore::server
