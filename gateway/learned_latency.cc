#include "gateway/learned_latency.h"

#include <algorithm>
#include <cmath>

namespace kvrelay::gateway {

void LearnedLatency::Observe(double seconds, absl::Time now, absl::Time began) {
  absl::MutexLock lock(&mu_);
  if (began < penalty_at_) return;
  seconds = std::max(seconds, 0.0);
  if (ewma_.has_value() && !penalized_) {
    if (seconds < 0.25 * *ewma_) {
      half_life_ = options_.half_life;  // it got fast: forget quickly again
    } else if (now - last_ >= half_life_) {
      half_life_ = std::min(half_life_ * 2, std::max(options_.max_half_life, options_.half_life));
    }
  }
  ewma_ =
      ewma_.has_value() && !penalized_ ? *ewma_ + options_.weight * (seconds - *ewma_) : seconds;
  penalized_ = false;
  last_ = now;
}

void LearnedLatency::ObservePenalty(double seconds, absl::Time now) {
  absl::MutexLock lock(&mu_);
  ewma_ = std::max(ewma_.value_or(0.0), seconds);
  penalized_ = true;
  penalty_at_ = now;
  last_ = now;
}

double Forget(double value, double prior, absl::Duration idle, absl::Duration half_life) {
  if (idle <= absl::ZeroDuration()) return value;
  if (idle == absl::InfiniteDuration()) return prior;
  const double kept = std::exp2(-absl::ToDoubleSeconds(idle) / absl::ToDoubleSeconds(half_life));
  return prior + (value - prior) * kept;
}

double LearnedLatency::Value(absl::Time now, double prior) const {
  absl::MutexLock lock(&mu_);
  if (!ewma_.has_value()) return prior;
  return Forget(*ewma_, prior, now - last_, half_life_);
}

absl::Duration LearnedLatency::half_life() const {
  absl::MutexLock lock(&mu_);
  return half_life_;
}

std::optional<double> LearnedLatency::Last() const {
  absl::MutexLock lock(&mu_);
  return ewma_;
}

void AdaptiveTimeout::Observe(absl::Duration round_trip) {
  absl::MutexLock lock(&mu_);
  round_trip = std::max(round_trip, absl::ZeroDuration());
  if (!measured_) {
    srtt_ = round_trip;
    rttvar_ = round_trip / 2;
    measured_ = true;
    return;
  }
  // RFC 6298 2.3 (alpha 1/8, beta 1/4).
  rttvar_ = rttvar_ * 3 / 4 + absl::AbsDuration(srtt_ - round_trip) / 4;
  srtt_ = srtt_ * 7 / 8 + round_trip / 8;
}

void DecayingCount::Add(absl::Time now) {
  absl::MutexLock lock(&mu_);
  count_ = Forget(count_, 0, now - at_, half_life_) + 1;
  at_ = now;
}

double DecayingCount::Value(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  return Forget(count_, 0, now - at_, half_life_);
}

absl::Duration AdaptiveTimeout::Timeout() const {
  absl::MutexLock lock(&mu_);
  if (!measured_) return ceiling_;
  return std::clamp(srtt_ + 4 * rttvar_, floor_, ceiling_);
}

}  // namespace kvrelay::gateway
