#pragma once

#include <string>
#include <vector>

namespace kvrelay::gateway::server {

// `kvrelay gateway`: serves until SIGTERM, then drains. Returns the process exit code (2 for bad
// usage, with a one-line message on stderr).
int RunGatewayCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::gateway::server
