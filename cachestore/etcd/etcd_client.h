#pragma once

// EtcdClient: the few etcd v3 calls the cache store's high availability needs, over etcd's own
// gRPC protos (Debian ships no C or C++ etcd client): leases (grant, keepalive, revoke), reads,
// create-if-absent and revision-guarded writes (transactions), and waiting for a key to change
// (a watch). Every call has a deadline (EtcdOptions::rpc_timeout); an endpoint that does not
// answer is skipped for the next one of the list.
//
//   KV_ASSIGN_OR_RETURN(auto etcd, EtcdClient::Create({.endpoints = {"127.0.0.1:2379"}}));
//   KV_ASSIGN_OR_RETURN(int64_t lease, etcd->GrantLease(absl::Seconds(2)));
//   KV_ASSIGN_OR_RETURN(auto created, etcd->CreateIfAbsent("/leader", "me:7000", lease));
//
// Errors: Unavailable when no endpoint answers, DeadlineExceeded past rpc_timeout, NotFound for
// an expired or unknown lease, InvalidArgument for bad arguments. Thread-safe.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/security/credentials.h"

namespace kvrelay::etcd {

struct EtcdOptions {
  // host:port (an http:// or https:// prefix is accepted), tried in order.
  std::vector<std::string> endpoints;
  absl::Duration rpc_timeout = absl::Seconds(2);
  // Mutual TLS (an etcd started with --client-cert-auth): the CA bundle etcd's certificate must
  // chain to, this client's certificate and its key, all three or none (plain text). Create
  // refuses files that do not verify (server::VerifyTlsFiles), naming the file.
  std::string ca_file, cert_file, key_file;
  bool tls() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// "a:2379,https://b:2379" -> {"a:2379", "b:2379"}. InvalidArgument naming the bad entry.
absl::StatusOr<std::vector<std::string>> ParseEndpoints(const std::string& text);

struct KeyValue {
  std::string key, value;
  int64_t create_revision = 0;  // the revision of the write that created it
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

class EtcdClient {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdOptions options);

  // A lease of `ttl` (whole seconds, >= 1 s; etcd's minimum TTL may raise it): its id.
  absl::StatusOr<int64_t> GrantLease(absl::Duration ttl);
  absl::Status RevokeLease(int64_t lease);
  // Renews the lease once; the TTL etcd granted. NotFound when the lease has expired.
  absl::StatusOr<absl::Duration> KeepAlive(int64_t lease);

  absl::StatusOr<std::optional<KeyValue>> Get(const std::string& key);

  struct CreateResult {
    bool created = false;  // false: the key existed; `kv` is its current holder
    KeyValue kv;
  };
  // Creates `key` = `value` bound to `lease` (0 = none) unless it exists, in one transaction.
  absl::StatusOr<CreateResult> CreateIfAbsent(const std::string& key, const std::string& value,
                                              int64_t lease);
  // Deletes `key` only while it is the incarnation created at `create_revision`. False if not.
  absl::StatusOr<bool> DeleteIfCreatedAt(const std::string& key, int64_t create_revision);
  // Writes `key` = `value` only while `guard_key` is the incarnation created at
  // `guard_revision` (a write fenced by a leadership term). False if not.
  absl::StatusOr<bool> PutIfGuardCreatedAt(const std::string& guard_key, int64_t guard_revision,
                                           const std::string& key, const std::string& value);
  // Waits until `key` changes (is written or deleted) after `after_revision`: true when it did,
  // false when `deadline` came first.
  absl::StatusOr<bool> WaitForChange(const std::string& key, int64_t after_revision,
                                     absl::Time deadline);

  const std::string& endpoint() const;  // the one calls go to now
  bool tls() const { return options_.tls(); }

 private:
  explicit EtcdClient(EtcdOptions options);
  // Runs `call` against the current endpoint, moving on to the next one when it does not answer.
  template <typename Call>
  absl::Status WithEndpoint(Call&& call);
  void SetCallDeadline(grpc::ClientContext& ctx) const;  // now + rpc_timeout

  struct Stubs {
    std::string address;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
    std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  };
  // A gRPC channel whose connection was refused keeps failing for seconds after the server is
  // back (reconnect backoff); an endpoint that failed gets a fresh channel instead, at most
  // every kReconnectEvery.
  struct Endpoint {
    std::string address;
    mutable absl::Mutex mu;
    std::shared_ptr<const Stubs> stubs ABSL_GUARDED_BY(mu);
    absl::Time connected_at ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<const Stubs> Connect(const std::string& address) const;
  std::shared_ptr<const Stubs> StubsOf(size_t i) const;
  void Reconnect(size_t i);

  EtcdOptions options_;
  // Plain text, or SSL credentials from the verified files; fixed at Create.
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::atomic<size_t> current_{0};
};

}  // namespace kvrelay::etcd
