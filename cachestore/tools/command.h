#pragma once

// The cache store's offline tools, one `kvrelay` subcommand each (registered in the CLI's table):
//   trace-replay  replay a trace (file or generated) through the eviction code: policies x
//                 capacities, Belady as the ceiling; --window-aware for sliding-window layouts
//   trace-gen     write a generated trace (cachestore/sim/trace_gen.h shapes) as JSON lines
//   plan          capacity planner: trace + model(s) + memory per node -> hit rate, prefill
//                 compute saved, bytes moved per request; --plot writes a PNG
// Exit status: 0 ok, 2 bad flags or bad input (one line naming the flag or trace line), 1 other.

#include <string>
#include <vector>

namespace kvrelay::cachestore::tools {

int RunTraceReplayCommand(const std::vector<std::string>& args);
int RunTraceGenCommand(const std::vector<std::string>& args);
int RunPlanCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::cachestore::tools
