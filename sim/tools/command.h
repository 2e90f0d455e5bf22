#pragma once

// `kvrelay simulate`: a request trace through the gateway's routing, the cache store and the
// workers' admission on a simulated clock (sim/simulation.h), for cluster sizes no test machine
// holds. Registered in cli/main.cc.

#include <string>
#include <vector>

namespace kvrelay::sim::tools {

int RunSimulateCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::sim::tools
