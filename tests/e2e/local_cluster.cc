#include "tests/e2e/local_cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"

namespace kvrelay::e2e {

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(const ClusterOptions& options) {
  auto cluster = std::unique_ptr<LocalCluster>(new LocalCluster());
  cluster->data_ = std::make_unique<testing::TempDir>();
  std::vector<std::string> argv = {testing::BinaryPath("kvrelay"),
                                   "up",
                                   "--model",
                                   options.model_dir,
                                   "--prefill",
                                   absl::StrCat(options.prefill),
                                   "--decode",
                                   absl::StrCat(options.decode),
                                   "--gateway-address",
                                   "127.0.0.1:0",
                                   "--data-dir",
                                   cluster->data_->path(),
                                   "--start-timeout",
                                   absl::StrCat(absl::ToInt64Seconds(options.start_timeout), "s")};
  if (!options.tls) argv.push_back("--insecure");
  if (!options.device.empty()) argv.insert(argv.end(), {"--device", options.device});
  std::vector<std::string> extra = options.extra_args;
  // Appends `args` to the value of `role_flag` in `extra`, or adds the flag.
  auto join = [&extra](const char* role_flag, const std::string& args) {
    auto it = std::find(extra.begin(), extra.end(), role_flag);
    if (it != extra.end() && it + 1 != extra.end()) {
      absl::StrAppend(&*(it + 1), " ", args);
    } else {
      extra.insert(extra.end(), {role_flag, args});
    }
  };
  if (!options.worker_args.empty()) {
    for (const char* role_flag : {"--prefill-args", "--decode-args"}) {
      join(role_flag, options.worker_args);
    }
  }
  if (!options.link_canaries) join("--gateway-args", "--link-canary-interval 0");
  argv.insert(argv.end(), extra.begin(), extra.end());
  absl::StatusOr<std::unique_ptr<testing::ChildProcess>> up = testing::ChildProcess::Start(argv);
  if (!up.ok()) return up.status();
  cluster->up_ = *std::move(up);
  absl::StatusOr<std::string> ready =
      cluster->up_->WaitForOutput("kvrelay up: ready", options.start_timeout + absl::Seconds(30));
  if (!ready.ok()) {
    return absl::Status(ready.status().code(),
                        absl::StrCat("kvrelay up did not get ready: ", ready.status().message(),
                                     "\nlog:\n", cluster->Log()));
  }
  // "kvrelay up: endpoints" then "  <name> <addr> metrics <maddr> pid <pid>" per service.
  const std::string out = cluster->up_->Stdout();
  bool in_table = false;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, "kvrelay up: endpoints")) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    if (absl::StartsWith(line, "kvrelay up: mutual TLS; client flags ")) {
      // "... client flags --tls-cert C --tls-key K --tls-ca A (tenant T); ..."
      std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
      for (size_t i = 0; i + 1 < w.size(); ++i) {
        if (w[i] == "--tls-cert") cluster->client_security_.cert_file = w[i + 1];
        if (w[i] == "--tls-key") cluster->client_security_.key_file = w[i + 1];
        if (w[i] == "--tls-ca") cluster->client_security_.ca_file = w[i + 1];
      }
      cluster->client_security_.insecure = false;
      continue;
    }
    if (absl::StartsWith(line, "kvrelay up:")) break;
    std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (w.size() != 6 || w[2] != "metrics" || w[4] != "pid") {
      return absl::InternalError(absl::StrCat("unexpected endpoints line: '", line, "'"));
    }
    ServiceInfo s;
    s.name = w[0];
    s.address = w[1];
    s.metrics_address = w[3];
    int pid;
    if (!absl::SimpleAtoi(w[5], &pid)) return absl::InternalError(absl::StrCat("pid in ", line));
    s.pid = pid;
    if (s.name == "gateway") cluster->gateway_ = s.address;
    cluster->services_.push_back(std::move(s));
  }
  if (cluster->gateway_.empty()) {
    return absl::InternalError(absl::StrCat("no gateway in the endpoints table:\n", out));
  }
  return cluster;
}

LocalCluster::~LocalCluster() = default;

absl::StatusOr<ServiceInfo> LocalCluster::Service(const std::string& name) const {
  for (const ServiceInfo& s : services_) {
    if (s.name == name) return s;
  }
  return absl::NotFoundError(absl::StrCat("no service ", name));
}

absl::StatusOr<int> LocalCluster::Stop(absl::Duration timeout) {
  up_->Signal(SIGTERM);
  return up_->Wait(timeout);
}

std::string LocalCluster::Log() const {
  return absl::StrCat("--- stdout\n", up_->Stdout(), "--- stderr\n", up_->Stderr());
}

absl::StatusOr<std::string> ScrapeText(const std::string& metrics_address) {
  const size_t colon = metrics_address.rfind(':');
  int port;
  if (colon == std::string::npos || !absl::SimpleAtoi(metrics_address.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("bad metrics address ", metrics_address));
  }
  ScopedFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return absl::InternalError("socket");
  timeval tv{5, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, metrics_address.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad metrics host in ", metrics_address));
  }
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("connect ", metrics_address));
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n";
  if (::write(fd.get(), request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError("write /metrics request");
  }
  std::string response;
  char buf[8192];
  for (ssize_t n; (n = ::read(fd.get(), buf, sizeof(buf))) > 0;) response.append(buf, n);
  const size_t body = response.find("\r\n\r\n");
  if (!absl::StartsWith(response, "HTTP/1.") || response.find(" 200 ") > response.find('\n') ||
      body == std::string::npos) {
    return absl::UnavailableError(
        absl::StrCat("GET http://", metrics_address,
                     "/metrics: not a 200 response: ", response.substr(0, response.find('\n'))));
  }
  return response.substr(body + 4);
}

absl::StatusOr<double> ScrapeMetric(const std::string& metrics_address, const std::string& metric) {
  KV_ASSIGN_OR_RETURN(std::string response, ScrapeText(metrics_address));
  bool found = false;
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(response, '\n')) {
    line = absl::StripTrailingAsciiWhitespace(line);
    if (line.empty() || line[0] == '#' || !absl::StartsWith(line, metric)) continue;
    const absl::string_view rest = line.substr(metric.size());
    if (rest.empty() || (rest[0] != ' ' && rest[0] != '{')) continue;  // a longer name
    const size_t space = line.rfind(' ');
    double value;
    if (space == absl::string_view::npos || !absl::SimpleAtod(line.substr(space + 1), &value)) {
      continue;
    }
    sum += value;
    found = true;
  }
  if (!found) return absl::NotFoundError(absl::StrCat("no ", metric, " at ", metrics_address));
  return sum;
}

}  // namespace kvrelay::e2e
