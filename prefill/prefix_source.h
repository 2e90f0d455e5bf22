#pragma once

// The name a prefill gives to where its reused prefix came from (PrefillResponse.prefix_source),
// shared by PrefillWorker and `kvrelay simulate`'s prefill nodes so both report alike.

#include <cstdint>

namespace kvrelay::prefill {

struct PrefixOutcome {
  int64_t matched = 0;          // leading blocks the store found cached anywhere
  int64_t hit_blocks = 0;       // of them, read from this node's DRAM segment
  int64_t disk_blocks = 0;      // read back from this node's disk tier
  int64_t pulled_blocks = 0;    // pulled from another node
  bool pull_attempted = false;  // a pull was chosen or tried (it may have brought nothing)
};

// "decode" is not among them: the decode worker holding the whole prompt ends a prefill before
// any lookup. "pulled" when a pull brought blocks; "recomputed" when blocks held elsewhere were
// computed instead; then "disk", "local", "none".
const char* PrefixSourceName(const PrefixOutcome& outcome);

}  // namespace kvrelay::prefill
