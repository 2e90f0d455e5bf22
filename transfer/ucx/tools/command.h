#pragma once

// The UCX transport's offline tool, a `kvrelay` subcommand (registered in cli/main.cc):
//   transfer-bench  moves blocks between two real processes over UCX on loopback and prints
//                   bandwidth and per-block latency. The sender (this process) starts the
//                   receiver by re-executing /proc/self/exe with `transfer-bench
//                   --role=receiver`; --role=receiver|sender run one peer (transfer_bench.h).

#include <string>
#include <vector>

namespace kvrelay::transfer::ucx::tools {

int RunTransferBenchCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::transfer::ucx::tools
