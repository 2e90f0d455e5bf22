#include "gateway/circuit_breaker.h"

#include <algorithm>

namespace kvrelay::gateway {

bool CircuitBreaker::Allow() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (now < draining_until_) return false;
  return backoff_.At(now) == State::kClosed || backoff_.TakeProbe(now);
}

bool CircuitBreaker::Healthy() const {
  absl::MutexLock lock(&mu_);
  return !backoff_.open() && clock_->Now() >= draining_until_;
}

bool CircuitBreaker::Draining() const {
  absl::MutexLock lock(&mu_);
  return clock_->Now() < draining_until_;
}

bool CircuitBreaker::Busy() const {
  absl::MutexLock lock(&mu_);
  return clock_->Now() < busy_until_;
}

absl::Duration CircuitBreaker::PredictedWait() const {
  absl::MutexLock lock(&mu_);
  return std::max(absl::ZeroDuration(), room_at_ - clock_->Now());
}

void CircuitBreaker::RecordSuccess() {
  absl::MutexLock lock(&mu_);
  backoff_.Close();
}

void CircuitBreaker::RecordFailure() {
  absl::MutexLock lock(&mu_);
  ++failures_;
  // A failed probe doubles the pause; any other failure (re)opens it for the current one.
  backoff_.Open(clock_->Now(), /*after_failed_probe=*/backoff_.probe_out());
}

void CircuitBreaker::RecordBusy(absl::Duration predicted_wait) {
  absl::MutexLock lock(&mu_);
  const absl::Duration busy_for = predicted_wait > absl::ZeroDuration()
                                      ? std::min(predicted_wait, options_.busy_for)
                                      : options_.busy_for;
  const absl::Time now = clock_->Now();
  busy_until_ = std::max(busy_until_, now + busy_for);
  room_at_ = now + (predicted_wait > absl::ZeroDuration() ? predicted_wait : options_.busy_for);
  // The probe reached a live node that is merely full: it is alive.
  if (backoff_.probe_out()) backoff_.Close();
}

void CircuitBreaker::RecordDraining() {
  absl::MutexLock lock(&mu_);
  draining_until_ = clock_->Now() + options_.draining_for;
  if (backoff_.probe_out()) backoff_.Close();
}

void CircuitBreaker::ProbeNow() {
  absl::MutexLock lock(&mu_);
  backoff_.ProbeNow(clock_->Now());
}

CircuitBreaker::State CircuitBreaker::state() const {
  absl::MutexLock lock(&mu_);
  return backoff_.At(clock_->Now());
}

int64_t CircuitBreaker::failures() const {
  absl::MutexLock lock(&mu_);
  return failures_;
}

}  // namespace kvrelay::gateway
