#pragma once

// The one cost model for reusing a cached prefix that is held on another node: pull its blocks
// over the data plane, recompute them here, or route the request to the holder. Pure
// arithmetic over measured rates, so prefill workers (pull vs recompute) and the gateway
// (route vs not) decide the same way, and the inputs of every decision can be reported.

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvrelay::kv {

// An exponentially weighted rate (units per second) of observed work: bytes moved over one
// link, tokens computed by one node. Thread-safe.
class RateMeter {
 public:
  // `weight` of each new observation in (0, 1].
  explicit RateMeter(double weight = 0.5) : weight_(weight) {}
  // `units` done in `seconds` (> 0) at `now`.
  void Observe(double units, double seconds, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // An attempt of `units` that did not finish within `seconds`: the rate is at most
  // units / seconds from now on (a link that slowed down is believed at once, not averaged in).
  void ObserveCeiling(double units, double seconds, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // Units per second; 0 until observed.
  double rate() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time last_observed() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const double weight_;
  mutable absl::Mutex mu_;
  double rate_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

enum class ReuseChoice { kPull, kRecompute };
const char* ReuseChoiceName(ReuseChoice choice);  // "pull", "recompute"

struct PullOrRecomputeInputs {
  uint64_t bytes = 0;                // layout bytes of the blocks held elsewhere
  int64_t tokens = 0;                // their tokens
  double link_bytes_per_second = 0;  // 0: the link to the holder is not measured yet
  double link_latency_seconds = 0;
  double prefill_tokens_per_second = 0;  // 0: this node's rate is not measured yet
};

struct PullOrRecompute {
  ReuseChoice choice = ReuseChoice::kPull;
  double pull_seconds = 0;       // estimate; 0 when the link is not measured
  double recompute_seconds = 0;  // estimate; 0 when the rate is not measured
};

// The cheaper of the two estimates. An unmeasured link is pulled from (that measures it); an
// unmeasured compute rate with a measured link also pulls.
PullOrRecompute ChoosePullOrRecompute(const PullOrRecomputeInputs& in);

// The gateway's estimate for sending a request to one prefill node: its queue (requests ahead,
// each taking `seconds_per_request`) plus the prompt tokens it must compute or fetch
// (`tokens_to_compute` at `tokens_per_second`). Lower is better; compare nodes with it.
double RouteSeconds(int64_t queue_ahead, double seconds_per_request, int64_t tokens_to_compute,
                    double tokens_per_second);

}  // namespace kvrelay::kv
