#include "prefill/prefix_source.h"

namespace kvrelay::prefill {

const char* PrefixSourceName(const PrefixOutcome& o) {
  if (o.pulled_blocks > 0) return "pulled";
  if (o.pull_attempted || o.matched > o.hit_blocks + o.disk_blocks) return "recomputed";
  if (o.disk_blocks > 0) return "disk";
  if (o.hit_blocks > 0) return "local";
  return "none";
}

}  // namespace kvrelay::prefill
