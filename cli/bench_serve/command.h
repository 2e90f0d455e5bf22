#pragma once

#include <string>
#include <vector>

namespace kvrelay::cli::bench_serve {

// `kvrelay bench-serve`: drives a gateway with a Mooncake trace or a synthetic workload and
// reports TTFT/TPOT/ITL/E2E percentiles, throughput, goodput, prefix hit rate, errors, fault
// costs and (with --verify) wrong tokens. Exit code: 0 done, 1 nothing succeeded or an error
// after the run started, 2 bad flags or input, 3 wrong tokens were served.
int RunBenchServeCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::cli::bench_serve
