#pragma once

// What the pickers learn about a worker and forget again. LearnedLatency: an EWMA of a node's
// latency samples that drifts back toward a prior (the fleet's typical figure) while no sample
// arrives, so a node that was slow, hung or cut off is tried again once left alone a while,
// and gets its traffic back when it is fast. AdaptiveTimeout: a call timeout set from the
// measured round trips (RFC 6298's SRTT + 4 RTTVAR), so a hung peer costs a few round trips,
// not a fixed worst case.
//
// Thread-safe.

#include <algorithm>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvrelay::gateway {

struct LearnedLatencyOptions {
  double weight = 0.3;                          // of each new sample, in (0, 1]
  absl::Duration half_life = absl::Seconds(2);  // of the distance to the prior, without samples
  // A sample after a forgetting (idle for a half-life or more) that confirms the figure (at
  // least a quarter of it) doubles the half-life, up to this: a node that is still slow is
  // probed ever more rarely, like a breaker's cool-down; a fast sample restores half_life.
  absl::Duration max_half_life = absl::Seconds(32);
};

class LearnedLatency {
 public:
  explicit LearnedLatency(LearnedLatencyOptions options = {})
      : options_(options), half_life_(options.half_life) {}

  // A sample of `seconds` (>= 0) at `now`, of work that began at `began`. Ignored when it
  // began before the last penalty: it describes the fault the penalty already recorded (a
  // request stuck on a paused node answers seconds late once the node runs again).
  void Observe(double seconds, absl::Time now, absl::Time began = absl::InfiniteFuture())
      ABSL_LOCKS_EXCLUDED(mu_);
  // A failure that cost `seconds`: believed at once (the estimate is at least that), not
  // averaged in, so one timeout moves traffic away; the next sample is believed at once too,
  // so a node that answers again is not held back by its penalty.
  void ObservePenalty(double seconds, absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  // The estimate at `now`: the EWMA moved toward `prior` by half of the remaining distance per
  // half_life since the last sample; `prior` itself before any sample.
  double Value(absl::Time now, double prior) const ABSL_LOCKS_EXCLUDED(mu_);
  // The EWMA as last sampled; nullopt before any sample.
  std::optional<double> Last() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Duration half_life() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const LearnedLatencyOptions options_;
  mutable absl::Mutex mu_;
  std::optional<double> ewma_ ABSL_GUARDED_BY(mu_);
  absl::Time last_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool penalized_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time penalty_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration half_life_ ABSL_GUARDED_BY(mu_);  // the current one (see max_half_life)
};

// A count that halves every `half_life`: how many requests a node got lately.
class DecayingCount {
 public:
  explicit DecayingCount(absl::Duration half_life = absl::Seconds(5)) : half_life_(half_life) {}
  void Add(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  double Value(absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const absl::Duration half_life_;
  mutable absl::Mutex mu_;
  double count_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// `value` moved toward `prior` by half the distance per `half_life` of `idle` (the same
// forgetting as LearnedLatency's, for figures kept elsewhere, e.g. kv::RateMeter's).
double Forget(double value, double prior, absl::Duration idle, absl::Duration half_life);

class AdaptiveTimeout {
 public:
  // Timeouts stay within [floor, ceiling]; `ceiling` until the first sample.
  AdaptiveTimeout(absl::Duration floor, absl::Duration ceiling)
      : floor_(floor), ceiling_(std::max(floor, ceiling)) {}

  void Observe(absl::Duration round_trip) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Duration Timeout() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const absl::Duration floor_;
  const absl::Duration ceiling_;
  mutable absl::Mutex mu_;
  bool measured_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration srtt_ ABSL_GUARDED_BY(mu_);
  absl::Duration rttvar_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::gateway
