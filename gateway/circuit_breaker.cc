#include "gateway/circuit_breaker.h"

#include <algorithm>

namespace kvrelay::gateway {

bool CircuitBreaker::Allow() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (state_ == State::kOpen && now >= open_until_) {
    state_ = State::kHalfOpen;
    probe_in_flight_ = false;
  }
  switch (state_) {
    case State::kClosed:
      return true;
    case State::kOpen:
      return false;
    case State::kHalfOpen:
      if (probe_in_flight_) return false;
      probe_in_flight_ = true;
      return true;
  }
  return false;
}

bool CircuitBreaker::Healthy() const {
  absl::MutexLock lock(&mu_);
  return state_ == State::kClosed;
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
  state_ = State::kClosed;
  probe_in_flight_ = false;
  current_open_for_ = absl::ZeroDuration();
}

void CircuitBreaker::RecordFailure() {
  absl::MutexLock lock(&mu_);
  ++failures_;
  // A failed probe doubles the pause; a first failure opens for the base duration.
  current_open_for_ = state_ == State::kHalfOpen
                          ? std::min(current_open_for_ * 2, options_.max_open_for)
                          : std::max(current_open_for_, options_.open_for);
  if (current_open_for_ <= absl::ZeroDuration()) current_open_for_ = options_.open_for;
  state_ = State::kOpen;
  probe_in_flight_ = false;
  open_until_ = clock_->Now() + current_open_for_;
}

void CircuitBreaker::RecordBusy(absl::Duration predicted_wait) {
  absl::MutexLock lock(&mu_);
  const absl::Duration busy_for = predicted_wait > absl::ZeroDuration()
                                      ? std::min(predicted_wait, options_.busy_for)
                                      : options_.busy_for;
  const absl::Time now = clock_->Now();
  busy_until_ = std::max(busy_until_, now + busy_for);
  room_at_ = now + (predicted_wait > absl::ZeroDuration() ? predicted_wait : options_.busy_for);
  if (state_ == State::kHalfOpen) {
    // The probe reached a live node that is merely full: it is alive.
    state_ = State::kClosed;
    probe_in_flight_ = false;
    current_open_for_ = absl::ZeroDuration();
  }
}

CircuitBreaker::State CircuitBreaker::state() const {
  absl::MutexLock lock(&mu_);
  if (state_ == State::kOpen && clock_->Now() >= open_until_) return State::kHalfOpen;
  return state_;
}

int64_t CircuitBreaker::failures() const {
  absl::MutexLock lock(&mu_);
  return failures_;
}

}  // namespace kvrelay::gateway
