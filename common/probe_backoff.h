#pragma once

// ProbeBackoff: the state machine behind every "stop calling it for a while, then let one call
// probe" mechanism (the gateway's per-worker CircuitBreaker, the request path's DependencyGate).
// Closed until Open; open for the cool-down; half-open once it has passed, when exactly one
// caller takes the probe. A reopen after a failed probe doubles the cool-down (up to `max`);
// Close restores `min`. State is derived from the time given, so no caller has to move it.
//
// Not thread-safe: its owner's mutex guards it.

#include <algorithm>

#include "absl/time/time.h"

namespace kvrelay {

class ProbeBackoff {
 public:
  enum class State { kClosed = 0, kOpen = 1, kHalfOpen = 2 };

  ProbeBackoff(absl::Duration min_cooldown, absl::Duration max_cooldown)
      : min_(min_cooldown), max_(max_cooldown), cooldown_(min_cooldown) {}

  State At(absl::Time now) const {
    if (!open_) return State::kClosed;
    return now < open_until_ ? State::kOpen : State::kHalfOpen;
  }
  // Half-open with no probe out: the caller becomes the probe.
  bool TakeProbe(absl::Time now) {
    if (At(now) != State::kHalfOpen || probe_out_) return false;
    probe_out_ = true;
    return true;
  }
  bool probe_out() const { return probe_out_; }
  // The probe ended without telling anything: the next caller may probe.
  void ReleaseProbe() { probe_out_ = false; }
  // Opens (again) from `now`; `after_failed_probe` doubles the cool-down first.
  void Open(absl::Time now, bool after_failed_probe) {
    if (after_failed_probe) cooldown_ = std::min(cooldown_ * 2, max_);
    open_ = true;
    probe_out_ = false;
    open_until_ = now + cooldown_;
  }
  // Something says the peer may be back: an open breaker turns half-open now (the cool-down
  // is kept, so a failed probe still doubles it).
  void ProbeNow(absl::Time now) {
    if (open_ && now < open_until_) open_until_ = now;
  }
  void Close() {
    open_ = false;
    probe_out_ = false;
    cooldown_ = min_;
  }
  bool open() const { return open_; }
  absl::Time open_until() const { return open_until_; }
  // The cool-down the next Open uses (before any doubling).
  absl::Duration cooldown() const { return cooldown_; }

 private:
  const absl::Duration min_;
  const absl::Duration max_;
  absl::Duration cooldown_;
  bool open_ = false;
  bool probe_out_ = false;
  absl::Time open_until_ = absl::InfinitePast();
};

}  // namespace kvrelay
