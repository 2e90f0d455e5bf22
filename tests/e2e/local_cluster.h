#pragma once

// LocalCluster: a real kvrelay cluster for end-to-end tests, started with `kvrelay up` (cache
// store, prefill and decode workers, gateway: separate processes on loopback) and stopped with
// SIGTERM. Parses the endpoints table `kvrelay up` prints so a test can talk to (or kill) each
// service.
//
// Not thread-safe; owned by one test thread (the Generate calls a test makes against the
// gateway may come from many threads).

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/server/credentials.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/test_env.h"

namespace kvrelay::e2e {

// For ClusterOptions::worker_args of tests that count reused tokens: a store call on the request
// path slowed past its 500 ms default (ASan on a loaded 2-core CI machine) makes the worker skip
// the store for a moment, which costs reuse and changes those counts, not tokens.
inline constexpr char kPatientStoreCalls[] = "--store-request-timeout 5s";

struct ClusterOptions {
  std::string model_dir;
  int prefill = 1;
  int decode = 2;
  // Extra `kvrelay up` flags, e.g. {"--cachestore-args", "--node-ttl 2s"}.
  std::vector<std::string> extra_args;
  // Extra flags for every prefill and decode worker, joined to any --prefill-args and
  // --decode-args in extra_args.
  std::string worker_args;
  // `kvrelay up --device` (every worker). "cpu" by default: the tests compare tokens with the
  // CPU's co-located reference bit for bit, on machines with a GPU too; "" leaves `up`'s
  // default (auto).
  std::string device = "cpu";
  absl::Duration start_timeout = absl::Seconds(90);
  // The gateway's link canaries (synthetic requests to a decode worker whose pushes were
  // slow). Off by default: a canary's Prefill would change the token and push counts the tests
  // check; the multi-host slow-link test runs them.
  bool link_canaries = false;
  // Mutual TLS with `kvrelay up`'s throwaway certificates (client_security() then holds the
  // client certificate); plain text (--insecure) otherwise, for tests not about security.
  bool tls = false;
};

struct ServiceInfo {
  std::string name;  // cachestore, prefill-0, decode-1, gateway
  std::string address;
  std::string metrics_address;
  pid_t pid = -1;
};

class LocalCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const ClusterOptions& options);
  ~LocalCluster();  // SIGKILLs `kvrelay up` if still running (its children follow)

  const std::string& gateway() const { return gateway_; }
  // The client certificate `kvrelay up` issued (tenant "default"); insecure without tls.
  const server::SecurityOptions& client_security() const { return client_security_; }
  // Where `kvrelay up` keeps its data: tls/ (the CA, every certificate), tenant-token-keys.
  const std::string& data_dir() const { return data_->path(); }
  const std::vector<ServiceInfo>& services() const { return services_; }
  // The service named `name`; NotFound otherwise.
  absl::StatusOr<ServiceInfo> Service(const std::string& name) const;

  // SIGTERM to `kvrelay up`; returns its exit code (0: every service drained and exited 0).
  absl::StatusOr<int> Stop(absl::Duration timeout = absl::Seconds(60));
  // `kvrelay up`'s stdout and stderr (the services' output, prefixed), for failure messages.
  std::string Log() const;
  testing::ChildProcess& process() { return *up_; }

 private:
  LocalCluster() = default;
  std::unique_ptr<testing::TempDir> data_;
  std::unique_ptr<testing::ChildProcess> up_;
  std::string gateway_;
  server::SecurityOptions client_security_;
  std::vector<ServiceInfo> services_;
};

// GET http://<metrics_address>/metrics: the body (Prometheus text) of a 200 response.
absl::StatusOr<std::string> ScrapeText(const std::string& metrics_address);

// Scrapes http://<metrics_address>/metrics and returns the sum of every sample of `metric`
// (all label sets). NotFound if the metric is absent.
absl::StatusOr<double> ScrapeMetric(const std::string& metrics_address, const std::string& metric);

}  // namespace kvrelay::e2e
