#pragma once

#include <string>
#include <vector>

namespace kvrelay::gateway::server {

// `kvrelay gateway`: serves until SIGTERM, then drains. Returns the process exit code (2 for bad
// usage, with a one-line message on stderr).
int RunGatewayCommand(const std::vector<std::string>& args);

// `kvrelay token --tenant T --tenant-token-keys FILE [--ttl D]`: prints a bearer token (JWT,
// HS256) for tenant T signed with the file's first key, which a gateway started with the same
// --tenant-token-keys accepts until it expires.
int RunTokenCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::gateway::server
