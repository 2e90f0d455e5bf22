// `kvrelay health`: one grpc.health.v1 Check against a kvrelay server, for container health
// checks (the image's HEALTHCHECK, exec probes of TLS servers) and scripts. Exit 0 when SERVING,
// 1 otherwise, 2 on bad usage.

#include <cstdio>

#include "cli/up/command.h"
#include "cli/up/health_check.h"
#include "common/flags.h"
#include "common/server/server_flags.h"

namespace kvrelay::cli::up {

int RunHealthCommand(const std::vector<std::string>& args) {
  std::string address;
  absl::Duration timeout = absl::Seconds(2);
  server::SecurityOptions security;
  FlagSet flags("health", "Checks a kvrelay server's grpc.health.v1 status: exit 0 when SERVING.");
  flags.AddString("address", &address, "server HOST:PORT");
  flags.AddDuration("timeout", &timeout, "deadline of the check");
  server::AddSecurityFlags(flags, security);
  if (std::optional<int> exit_code = server::ParseCommandLine(flags, args, "health", &security)) {
    return *exit_code;
  }
  if (absl::Status s = server::CheckHostPort(address, "--address"); !s.ok()) {
    return server::UsageError("health", std::string(s.message()));
  }
  if (timeout <= absl::ZeroDuration()) {
    return server::UsageError("health", "--timeout must be positive");
  }
  if (absl::Status s = CheckServing(address, timeout, security); !s.ok()) {
    std::fprintf(stderr, "kvrelay health: %s: %s\n", address.c_str(), s.ToString().c_str());
    return 1;
  }
  std::printf("%s SERVING\n", address.c_str());
  return 0;
}

}  // namespace kvrelay::cli::up
