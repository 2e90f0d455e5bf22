#pragma once

#include <string>
#include <vector>

namespace kvrelay::cli::up {

// `kvrelay up`: a local cluster (cache store, workers, gateway) as child processes on loopback.
int RunUpCommand(const std::vector<std::string>& args);
// `kvrelay health --address HOST:PORT`: one grpc.health.v1 check (exit 0 when SERVING), for
// container health checks and scripts.
int RunHealthCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::cli::up
