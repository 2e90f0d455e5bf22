// `kvrelay health`: one grpc.health.v1 Check against a kvrelay server, for container health
// checks (the image's HEALTHCHECK) and scripts. Exit 0 when SERVING, 1 otherwise.

#include <cstdio>
#include <iostream>

#include "absl/strings/numbers.h"
#include "common/flags.h"
#include "cli/up/health_check.h"
#include "cli/up/up_command.h"
#include "common/server/server_flags.h"

namespace kvrelay::cli {

int RunHealthCommand(const std::vector<std::string>& args) {
  std::string address;
  absl::Duration timeout = absl::Seconds(2);
  FlagSet flags("health", "Checks a kvrelay server's grpc.health.v1 status: exit 0 when SERVING.");
  flags.AddString("address", &address, "server HOST:PORT");
  flags.AddDuration("timeout", &timeout, "deadline of the check");
  server::SecurityOptions security;
  server::AddSecurityFlags(flags, security);
  if (std::optional<int> exit_code = server::ParseCommandLine(flags, args, "health", &security)) {
    return *exit_code;
  }
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) {
    std::fprintf(stderr, "kvrelay health: --address must be HOST:PORT, got '%s'\n",
                 address.c_str());
    return 2;
  }
  if (timeout <= absl::ZeroDuration()) {
    std::fprintf(stderr, "kvrelay health: --timeout must be positive\n");
    return 2;
  }
  if (absl::Status s = CheckServing(address, timeout, security); !s.ok()) {
    std::fprintf(stderr, "kvrelay health: %s: %s\n", address.c_str(), s.ToString().c_str());
    return 1;
  }
  std::printf("%s SERVING\n", address.c_str());
  return 0;
}

}  // namespace kvrelay::cli
