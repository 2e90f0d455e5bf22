#pragma once

// Command-line handling every server subcommand shares: the listening and security flags, and
// the parse step (--config FILE.yaml expansion, --help, one-line usage errors).

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/flags.h"
#include "common/server/service_host.h"

namespace kvrelay::server {

// Registers --host, --port, --metrics-port, --drain-timeout, --tls-cert, --tls-key, --tls-ca and
// --insecure, writing into `options` (which must outlive Parse).
void AddServerFlags(FlagSet& flags, ServiceHostOptions& options);

// Registers only the client-side security flags (--tls-cert, --tls-key, --tls-ca, --insecure).
void AddSecurityFlags(FlagSet& flags, SecurityOptions& security);

// Expands --config, then kvrelay::ParseCommandLine (common/flags.h): returns an exit code to
// return at once (0 after --help, 2 with "kvrelay <command>: <message>" on stderr for bad
// usage), or nullopt to go on. Also settles `security` (SettleSecurity).
std::optional<int> ParseCommandLine(FlagSet& flags, const std::vector<std::string>& raw_args,
                                    const std::string& command,
                                    SecurityOptions* security = nullptr);

// ParseCommandLine for a server (its flags from AddServerFlags), then --cpus applied: the process
// is pinned to those CPUs (PinToCpus) before it starts a thread; a bad list is a usage error.
std::optional<int> ParseServerCommandLine(FlagSet& flags, const std::vector<std::string>& raw_args,
                                          const std::string& command, ServiceHostOptions& host);

// "0-3,8,10-11" -> {0,1,2,3,8,10,11} (sorted, distinct); InvalidArgument naming the bad part.
absl::StatusOr<std::vector<int>> ParseCpuList(const std::string& text);

// The CPUs this process may run on (its affinity), ascending.
absl::StatusOr<std::vector<int>> AllowedCpus();

// Restricts the process's threads, and so every thread started later, to `cpus`. Each must be one
// this process may run on (FailedPrecondition naming it and the allowed list otherwise).
absl::Status PinToCpus(const std::vector<int>& cpus);

// After Parse: mutual TLS when --tls-cert/--tls-key/--tls-ca are all given, plain text only with
// an explicit --insecure; InvalidArgument otherwise (neither, both, or only some --tls-*).
absl::Status SettleSecurity(const FlagSet& flags, SecurityOptions& security);

// Parses "host:port" with 1 <= port <= 65535 and a non-empty host. InvalidArgument naming
// `what` otherwise.
absl::Status CheckHostPort(const std::string& address, const std::string& what);

// Prints "kvrelay <command>: <message>" and returns `exit_code` (for usage errors after Parse).
using ::kvrelay::UsageError;

}  // namespace kvrelay::server

namespace kvrelay::server {

// The host other machines use to reach a server bound to `bind_host`: `advertise_host` when
// given; else `bind_host`, unless that is a wildcard (0.0.0.0, ::, empty), which is never
// advertised — then the first non-loopback IPv4 address of this machine (or its hostname).
std::string AdvertisedHost(const std::string& bind_host, const std::string& advertise_host);

// A model's default served name: the base name of its directory ("/models/tiny-llama/" ->
// "tiny-llama").
std::string ModelNameFromDir(std::string dir);

}  // namespace kvrelay::server
