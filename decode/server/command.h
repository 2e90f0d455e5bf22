#pragma once

#include <string>
#include <vector>

namespace kvrelay::decode::server {

// `kvrelay decode`: serves until SIGTERM, then drains. Returns the process exit code (2 for bad
// usage, with a one-line message on stderr).
int RunDecodeCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::decode::server
