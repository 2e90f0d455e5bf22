#pragma once

#include <string>
#include <vector>

namespace kvrelay::cachestore::server {

// `kvrelay cachestore`: serves kvrelay.v1.CacheStore until SIGTERM, then drains and snapshots.
int RunCacheStoreCommand(const std::vector<std::string>& args);
// `kvrelay trace-replay`: replays a request trace through the index and eviction code.
int RunTraceReplayCommand(const std::vector<std::string>& args);

}  // namespace kvrelay::cachestore::server
