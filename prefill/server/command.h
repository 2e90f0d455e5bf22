#pragma once

#include <string>
#include <vector>

namespace kvrelay::prefill::server {

// `kvrelay prefill`: serves until SIGTERM, then drains. Returns the process exit code (2 for bad
// usage, with a one-line message on stderr).
int RunPrefillCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::prefill::server
