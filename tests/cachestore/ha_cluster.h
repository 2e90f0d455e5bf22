#pragma once

// HaCluster: a real etcd (Debian's etcd-server) and N `kvrelay cachestore --etcd` processes on
// free loopback ports, each with its own data dir, for the HA tests and the failover bench.
// Failures come back as absl::Status (no gtest here, so bench/ can use it too). UseEtcdTls()
// before Start: etcd requires client certificates (--client-cert-auth) over https, and every
// store and the cluster's own etcd client present one (the cluster's throwaway CA).
//
// Not thread-safe: one thread drives it.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cachestore/client/cache_store_client.h"
#include "cachestore/etcd/etcd_client.h"
#include "common/server/dev_certs.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/test_env.h"

namespace kvrelay::testing {

class HaCluster {
 public:
  static constexpr char kEtcd[] = "/usr/bin/etcd";
  static constexpr char kLeaderKey[] = "/kvrelay/cachestore/leader";

  struct Leader {
    int index = -1;
    int64_t term = 0;
  };

  static bool EtcdInstalled() { return ::access(kEtcd, X_OK) == 0; }

  // Mutual TLS to etcd; call before Start. The certificates (etcd's server certificate, one
  // client certificate every store and this cluster's client share) come from a throwaway CA.
  absl::Status UseEtcdTls() {
    const std::string dir = dir_.File("etcd-tls");
    if (::mkdir(dir.c_str(), 0700) != 0) return absl::InternalError("mkdir " + dir);
    absl::StatusOr<std::unique_ptr<server::DevCertificateAuthority>> ca =
        server::DevCertificateAuthority::Create(dir);
    if (!ca.ok()) return ca.status();
    absl::StatusOr<server::SecurityOptions> etcd_server =
        (*ca)->Issue(server::PeerRole::kStore, "etcd");
    absl::StatusOr<server::SecurityOptions> client =
        (*ca)->Issue(server::PeerRole::kStore, "cachestore");
    if (!etcd_server.ok() || !client.ok()) {
      return etcd_server.ok() ? client.status() : etcd_server.status();
    }
    etcd_server_tls_ = *etcd_server;
    etcd_client_tls_ = *client;
    return absl::OkStatus();
  }
  bool etcd_tls() const { return !etcd_client_tls_.ca_file.empty(); }
  // A store's flags for its client certificate to etcd (none without UseEtcdTls).
  std::vector<std::string> EtcdTlsFlags() const {
    if (!etcd_tls()) return {};
    return {"--etcd-ca",  etcd_client_tls_.ca_file, "--etcd-cert", etcd_client_tls_.cert_file,
            "--etcd-key", etcd_client_tls_.key_file};
  }
  // etcd's client endpoint as a store's --etcd takes it.
  std::string etcd_url() const { return (etcd_tls() ? "https://" : "http://") + etcd_endpoint_; }

  absl::Status Start(int stores) {
    etcd_endpoint_ = absl::StrCat("127.0.0.1:", PickUnusedPort());
    etcd_peer_ = absl::StrCat("http://127.0.0.1:", PickUnusedPort());
    absl::Status s = StartEtcd();
    if (!s.ok()) return s;
    absl::StatusOr<std::unique_ptr<etcd::EtcdClient>> client =
        etcd::EtcdClient::Create({.endpoints = {etcd_endpoint_},
                                  .rpc_timeout = absl::Milliseconds(500),
                                  .ca_file = etcd_client_tls_.ca_file,
                                  .cert_file = etcd_client_tls_.cert_file,
                                  .key_file = etcd_client_tls_.key_file});
    if (!client.ok()) return client.status();
    etcd_client_ = *std::move(client);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!etcd_client_->Get("/ready").ok()) {
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError("etcd did not answer: " + etcd_->Stderr());
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    for (int i = 0; i < stores; ++i) {
      addresses_.push_back(absl::StrCat("127.0.0.1:", PickUnusedPort()));
      stores_.emplace_back();
    }
    for (int i = 0; i < stores; ++i) {
      if (s = StartStore(i); !s.ok()) return s;
    }
    return WaitForLeader(absl::Seconds(15)).status();
  }

  // Restarts etcd with the same data dir (after StopEtcd) or starts it.
  absl::Status StartEtcd() {
    std::vector<std::string> argv = {kEtcd,
                                     "--name",
                                     "t",
                                     "--data-dir",
                                     dir_.File("etcd"),
                                     "--listen-client-urls",
                                     etcd_url(),
                                     "--advertise-client-urls",
                                     etcd_url(),
                                     "--listen-peer-urls",
                                     etcd_peer_,
                                     "--initial-advertise-peer-urls",
                                     etcd_peer_,
                                     "--initial-cluster",
                                     "t=" + etcd_peer_,
                                     "--heartbeat-interval",
                                     "50",
                                     "--election-timeout",
                                     "300"};
    if (etcd_tls()) {
      for (const std::string& a :
           {std::string("--cert-file"), etcd_server_tls_.cert_file, std::string("--key-file"),
            etcd_server_tls_.key_file, std::string("--client-cert-auth"),
            std::string("--trusted-ca-file"), etcd_server_tls_.ca_file}) {
        argv.push_back(a);
      }
    }
    absl::StatusOr<std::unique_ptr<ChildProcess>> etcd = ChildProcess::Start(argv);
    if (!etcd.ok()) return etcd.status();
    etcd_ = *std::move(etcd);
    return absl::OkStatus();
  }

  // Extra flags of store `i` (its own KV-event endpoints, say); set before Start.
  std::function<std::vector<std::string>(int)> extra_store_flags;

  // Starts (or restarts, after KillStore) store `i` on its port with its data dir.
  absl::Status StartStore(int i) {
    std::vector<std::string> flags = EtcdTlsFlags();
    if (extra_store_flags) {
      for (std::string& f : extra_store_flags(i)) flags.push_back(std::move(f));
    }
    absl::StatusOr<std::unique_ptr<ChildProcess>> proc =
        StartStoreProcess(addresses_[i], dir_.File(absl::StrCat("store", i)), flags);
    if (!proc.ok()) return proc.status();
    stores_[i] = *std::move(proc);
    absl::StatusOr<std::string> line =
        stores_[i]->WaitForOutput("cachestore listening on", absl::Seconds(30));
    if (!line.ok()) {
      return absl::Status(
          line.status().code(),
          absl::StrCat("store ", i, ": ", line.status().message(), "\n", stores_[i]->Stderr()));
    }
    return absl::OkStatus();
  }

  // A store process on `address` with `data_dir` and these etcd TLS flags, not waited for.
  absl::StatusOr<std::unique_ptr<ChildProcess>> StartStoreProcess(
      const std::string& address, const std::string& data_dir,
      const std::vector<std::string>& etcd_tls_flags) {
    std::vector<std::string> argv = {BinaryPath("kvrelay"),
                                     "cachestore",
                                     "--port",
                                     address.substr(address.rfind(':') + 1),
                                     "--metrics-port",
                                     "0",
                                     "--data-dir",
                                     data_dir,
                                     "--tick",
                                     "20ms",
                                     "--insecure",
                                     "--etcd",
                                     etcd_url(),
                                     "--etcd-lease-ttl",
                                     "2s",
                                     "--wal-fsync=false"};
    argv.insert(argv.end(), etcd_tls_flags.begin(), etcd_tls_flags.end());
    return ChildProcess::Start(argv);
  }
  std::string TempPath(const std::string& name) { return dir_.File(name); }

  void KillStore(int i) {
    stores_[i]->Signal(SIGKILL);
    (void)stores_[i]->Wait(absl::Seconds(10));
  }

  // The instance etcd names as leader that also serves (answers ListNodes), waiting for one
  // with a term above `above_term`.
  absl::StatusOr<Leader> WaitForLeader(absl::Duration timeout, int64_t above_term = 0) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      absl::StatusOr<std::optional<etcd::KeyValue>> kv = etcd_client_->Get(kLeaderKey);
      if (kv.ok() && kv->has_value() && (*kv)->create_revision > above_term) {
        const int index = IndexOf((*kv)->value);
        if (index >= 0 && Serves(index)) return Leader{index, (*kv)->create_revision};
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return absl::DeadlineExceededError(absl::StrCat("no store leads with a term above ", above_term,
                                                    " after ", absl::FormatDuration(timeout)));
  }

  // True when store `i` answers a leader-only call.
  bool Serves(int i) {
    absl::StatusOr<std::unique_ptr<cachestore::CacheStoreClient>> c = Direct(i);
    if (!c.ok()) return false;
    cachestore::CallOptions call;
    call.deadline = absl::Now() + absl::Milliseconds(300);
    return (*c)->ListNodes(call).ok();
  }

  // A client of store `i` alone (no failover).
  absl::StatusOr<std::unique_ptr<cachestore::CacheStoreClient>> Direct(
      int i, cachestore::CacheStoreClient::Options options = {}) {
    options.own_connection = true;
    return cachestore::CacheStoreClient::Connect(addresses_[i], options);
  }

  int IndexOf(const std::string& address) const {
    for (size_t i = 0; i < addresses_.size(); ++i) {
      if (addresses_[i] == address) return static_cast<int>(i);
    }
    return -1;
  }

  std::string Logs() const {
    std::string out;
    for (size_t i = 0; i < stores_.size(); ++i) {
      if (stores_[i] != nullptr)
        absl::StrAppend(&out, "--- store ", i, " ---\n", stores_[i]->Stderr());
    }
    return out;
  }

  std::string addresses() const { return absl::StrJoin(addresses_, ","); }
  const std::string& address(int i) const { return addresses_[i]; }
  ChildProcess* store(int i) { return stores_[i].get(); }
  ChildProcess* etcd() { return etcd_.get(); }
  etcd::EtcdClient* etcd_client() { return etcd_client_.get(); }
  int size() const { return static_cast<int>(stores_.size()); }

 private:
  TempDir dir_;
  std::string etcd_endpoint_, etcd_peer_;
  std::unique_ptr<ChildProcess> etcd_;
  std::unique_ptr<etcd::EtcdClient> etcd_client_;
  server::SecurityOptions etcd_server_tls_, etcd_client_tls_;  // empty without UseEtcdTls
  std::vector<std::string> addresses_;
  std::vector<std::unique_ptr<ChildProcess>> stores_;
};

}  // namespace kvrelay::testing
