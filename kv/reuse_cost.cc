#include "kv/reuse_cost.h"

#include <algorithm>

namespace kvrelay::kv {

void RateMeter::Observe(double units, double seconds, absl::Time now) {
  if (!(seconds > 0) || !(units > 0)) return;
  absl::MutexLock lock(&mu_);
  // The average is over seconds per unit (a harmonic mean of rates): one slow sample weighs as
  // much as the time it cost, so a link that slowed down is noticed at once instead of being
  // averaged away by earlier fast pulls.
  const double per_unit = seconds / units;
  const double before = rate_ == 0 ? per_unit : 1.0 / rate_;
  rate_ = 1.0 / (weight_ * per_unit + (1 - weight_) * before);
  last_ = now;
}

void RateMeter::ObserveCeiling(double units, double seconds, absl::Time now) {
  if (!(seconds > 0) || !(units >= 0)) return;
  absl::MutexLock lock(&mu_);
  const double ceiling = units / seconds;
  rate_ = rate_ == 0 ? ceiling : std::min(rate_, ceiling);
  last_ = now;
}

double RateMeter::rate() const {
  absl::MutexLock lock(&mu_);
  return rate_;
}

absl::Time RateMeter::last_observed() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

const char* ReuseChoiceName(ReuseChoice choice) {
  return choice == ReuseChoice::kPull ? "pull" : "recompute";
}

PullOrRecompute ChoosePullOrRecompute(const PullOrRecomputeInputs& in) {
  PullOrRecompute out;
  if (in.link_bytes_per_second > 0) {
    out.pull_seconds =
        in.link_latency_seconds + static_cast<double>(in.bytes) / in.link_bytes_per_second;
  }
  if (in.prefill_tokens_per_second > 0) {
    out.recompute_seconds = static_cast<double>(in.tokens) / in.prefill_tokens_per_second;
  }
  const bool both_known = in.link_bytes_per_second > 0 && in.prefill_tokens_per_second > 0;
  out.choice = both_known && out.recompute_seconds < out.pull_seconds ? ReuseChoice::kRecompute
                                                                      : ReuseChoice::kPull;
  return out;
}

double RouteSeconds(int64_t queue_ahead, double seconds_per_request, int64_t tokens_to_compute,
                    double tokens_per_second) {
  const double queue =
      static_cast<double>(std::max<int64_t>(0, queue_ahead)) * std::max(0.0, seconds_per_request);
  const double compute =
      tokens_per_second > 0
          ? static_cast<double>(std::max<int64_t>(0, tokens_to_compute)) / tokens_per_second
          : 0;
  return queue + compute;
}

}  // namespace kvrelay::kv
