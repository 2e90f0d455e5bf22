#include "common/server/server_flags.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/config_file.h"
#include "common/errno_status.h"
#include "common/status_macros.h"

namespace kvrelay::server {

void AddSecurityFlags(FlagSet& flags, SecurityOptions& security) {
  flags.AddString("tls-cert", &security.cert_file,
                  "PEM certificate of this component (mutual TLS with --tls-key, --tls-ca)");
  flags.AddString("tls-key", &security.key_file, "PEM private key of --tls-cert");
  flags.AddString("tls-ca", &security.ca_file, "PEM CA bundle peers' certificates must chain to");
  flags.AddBool("insecure", &security.insecure,
                "plain-text gRPC without authentication (used when no --tls-* flag is given)");
}

void AddServerFlags(FlagSet& flags, ServiceHostOptions& options) {
  flags.AddString("host", &options.host, "address to listen on (gRPC and metrics)");
  flags.AddInt32("port", &options.port, "gRPC port (0: any free port)");
  flags.AddInt32("metrics-port", &options.metrics_port,
                 "Prometheus /metrics port (0: any free port)");
  flags.AddDuration("drain-timeout", &options.drain_timeout,
                    "on SIGTERM, how long in-flight RPCs may finish");
  flags.AddString("cpus", &options.cpus,
                  "CPUs the process runs on, e.g. 0-3,8 (default: any); keeps its gRPC threads' "
                  "wake-ups on those cores, away from co-located inference workers");
  AddSecurityFlags(flags, options.security);
}

absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text) {
  std::vector<int> cpus;
  if (text.empty()) return absl::InvalidArgumentError("empty CPU list");
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::vector<absl::string_view> ends = absl::StrSplit(part, absl::MaxSplits('-', 1));
    int first = -1, last = -1;
    if (!absl::SimpleAtoi(ends[0], &first) ||
        !absl::SimpleAtoi(ends.size() == 2 ? ends[1] : ends[0], &last) || first < 0 ||
        last < first || last >= CPU_SETSIZE) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", part, "' is not a CPU number or range N-M (0 <= N <= M < ", CPU_SETSIZE, ")"));
    }
    for (int c = first; c <= last; ++c) cpus.push_back(c);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

absl::StatusOr<std::vector<int>> AllowedCpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) {
    return ErrnoToStatus(errno, "sched_getaffinity");
  }
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  return cpus;
}

absl::Status PinToCpus(const std::vector<int>& cpus) {
  KV_ASSIGN_OR_RETURN(const std::vector<int> allowed, AllowedCpus());
  if (cpus.empty()) return absl::InvalidArgumentError("no CPU to run on");
  cpu_set_t wanted;
  CPU_ZERO(&wanted);
  for (int c : cpus) {
    if (c < 0 || c >= CPU_SETSIZE || !std::binary_search(allowed.begin(), allowed.end(), c)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CPU ", c, " is not one this process may run on (allowed: ", absl::StrJoin(allowed, ","),
          ")"));
    }
    CPU_SET(c, &wanted);
  }
  // Every thread, the caller and those libraries started while loading (OpenBLAS's pool); a
  // thread that exits meanwhile is no error.
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", error)) {
    pid_t tid = 0;
    if (!absl::SimpleAtoi(task.path().filename().string(), &tid)) continue;
    if (::sched_setaffinity(tid, sizeof(wanted), &wanted) != 0 && errno != ESRCH) {
      return ErrnoToStatus(errno, absl::StrCat("sched_setaffinity of thread ", tid));
    }
  }
  if (error) return ErrnoToStatus(error.value(), "list /proc/self/task");
  return absl::OkStatus();
}

std::optional<int> ParseServerCommandLine(FlagSet& flags, const std::vector<std::string>& raw_args,
                                          const std::string& command, ServiceHostOptions& host) {
  if (std::optional<int> exit_code = ParseCommandLine(flags, raw_args, command, &host.security)) {
    return exit_code;
  }
  if (!host.cpus.empty()) {
    absl::StatusOr<std::vector<int>> cpus = ParseCpuList(host.cpus);
    absl::Status pinned = cpus.ok() ? PinToCpus(*cpus) : cpus.status();
    if (!pinned.ok()) return UsageError(command, absl::StrCat("--cpus: ", pinned.message()));
  }
  return std::nullopt;
}

absl::Status SettleSecurity(const FlagSet& flags, SecurityOptions& security) {
  const bool any_tls =
      !security.cert_file.empty() || !security.key_file.empty() || !security.ca_file.empty();
  const bool asked_insecure = flags.WasSet("insecure") && security.insecure;
  if (any_tls && asked_insecure) {
    return absl::InvalidArgumentError("--insecure and --tls-* exclude each other");
  }
  if (!any_tls && !asked_insecure) {
    // No silent plain text: an operator who forgot the certificates must not get a cluster
    // anyone on the network can drive.
    return absl::InvalidArgumentError(
        "mutual TLS needs --tls-cert, --tls-key and --tls-ca (scripts/certs.sh makes them); "
        "plain text only with an explicit --insecure");
  }
  security.insecure = !any_tls;
  if (any_tls &&
      (security.cert_file.empty() || security.key_file.empty() || security.ca_file.empty())) {
    return absl::InvalidArgumentError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca");
  }
  return absl::OkStatus();
}

std::optional<int> ParseCommandLine(FlagSet& flags, const std::vector<std::string>& raw_args,
                                    const std::string& command, SecurityOptions* security) {
  absl::StatusOr<std::vector<std::string>> args = ExpandConfigFile(raw_args);
  if (!args.ok()) return UsageError(command, args.status().message());
  if (std::optional<int> exit_code = ::kvrelay::ParseCommandLine(flags, *args)) {
    return exit_code;
  }
  if (security != nullptr) {
    if (absl::Status s = SettleSecurity(flags, *security); !s.ok()) {
      return UsageError(command, std::string(s.message()));
    }
  }
  return std::nullopt;
}

absl::Status CheckHostPort(const std::string& address, const std::string& what) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be HOST:PORT, got '", address, "'"));
  }
  return absl::OkStatus();
}

}  // namespace kvrelay::server

namespace kvrelay::server {

std::string AdvertisedHost(const std::string& bind_host, const std::string& advertise_host) {
  if (!advertise_host.empty()) return advertise_host;
  if (!bind_host.empty() && bind_host != "0.0.0.0" && bind_host != "::" && bind_host != "[::]") {
    return bind_host;
  }
  ifaddrs* addresses = nullptr;
  std::string found;
  if (::getifaddrs(&addresses) == 0) {
    for (ifaddrs* a = addresses; a != nullptr && found.empty(); a = a->ifa_next) {
      if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
      if ((a->ifa_flags & IFF_LOOPBACK) != 0 || (a->ifa_flags & IFF_UP) == 0) continue;
      char text[INET_ADDRSTRLEN] = {};
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
      if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) != nullptr) found = text;
    }
    ::freeifaddrs(addresses);
  }
  if (!found.empty()) return found;
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0 && host[0] != '\0') return host;
  return "127.0.0.1";
}

std::string ModelNameFromDir(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir.substr(dir.rfind('/') + 1);
}

}  // namespace kvrelay::server
