// `kvrelay status`: the cluster as its gateways and cache store see it, in one table (or
// --json). Asks every --gateway for Gateway/Status at once (each answer carries the gateway's
// workers, their own Status, and the store's registry and stats, asked by the gateway), all
// within --timeout, then merges and prints them (cli/status_render.h).

#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cli/command.h"
#include "cli/status_render.h"
#include "common/flags.h"
#include "common/server/server_flags.h"
#include "gateway/client/gateway_client.h"

namespace kvrelay::cli {

int RunStatusCommand(const std::vector<std::string>& args) {
  std::string gateways_text;
  server::SecurityOptions security;
  bool json = false;
  absl::Duration timeout = absl::Seconds(5);
  FlagSet flags("status",
                "Prints the cluster as its gateways and cache store see it: every node's role, "
                "incarnation, address, state (serving, draining, suspect, unregistered), cache "
                "occupancy, hit rate, in-flight requests, breakers and measured rates, and the "
                "store's leader. Needs an admin (or gateway) certificate under mutual TLS.");
  flags.AddString("gateway", &gateways_text, "gateway addresses HOST:PORT[,HOST:PORT...]");
  server::AddSecurityFlags(flags, security);
  flags.AddDuration("timeout", &timeout, "bound on the whole command (every call within it)");
  flags.AddBool("json", &json, "print one JSON object instead of the table");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (absl::Status s = server::SettleSecurity(flags, security); !s.ok()) {
    return UsageError("status", s.message());
  }
  std::vector<std::string> addresses;
  for (absl::string_view a : absl::StrSplit(gateways_text, ',', absl::SkipWhitespace())) {
    const std::string address(absl::StripAsciiWhitespace(a));
    if (absl::Status s = server::CheckHostPort(address, "--gateway"); !s.ok()) {
      return UsageError("status", s.message());
    }
    addresses.push_back(address);
  }
  if (addresses.empty()) return UsageError("status", "--gateway HOST:PORT is required");
  if (timeout <= absl::ZeroDuration()) return UsageError("status", "--timeout must be positive");

  std::vector<GatewayReply> replies(addresses.size());
  {
    // All gateways at once: a gateway that does not answer costs --timeout once.
    std::vector<std::thread> askers;
    for (size_t i = 0; i < addresses.size(); ++i) {
      askers.emplace_back([&, i] {
        replies[i].address = addresses[i];
        replies[i].reply = gateway::client::GatewayClient(addresses[i], security).Status(timeout);
      });
    }
    for (std::thread& t : askers) t.join();
  }
  bool any = false;
  for (const GatewayReply& r : replies) any = any || r.reply.ok();
  const ClusterStatus status = MergeStatus(std::move(replies));
  if (json) {
    std::cout << StatusJson(status).dump(2) << std::endl;
  } else {
    std::cout << StatusTable(status) << std::flush;
  }
  if (!any) std::fprintf(stderr, "kvrelay status: no gateway answered\n");
  return any ? 0 : 1;
}

}  // namespace kvrelay::cli
