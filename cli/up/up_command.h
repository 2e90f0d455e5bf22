#pragma once

#include <string>
#include <vector>

namespace kvrelay::cli {

// `kvrelay up`: a local cluster (cache store, workers, gateway) as child processes on loopback.
int RunUpCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::cli
