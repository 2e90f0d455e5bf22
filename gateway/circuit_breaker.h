#pragma once

// CircuitBreaker: per-node health as the gateway sees it. Closed: traffic flows. A failure
// attributed to the node opens it for `open_for` (doubling on each failed probe, up to
// `max_open_for`); when that passes it is half-open: exactly one request probes the node, and
// its outcome closes the breaker or opens it again. Overload (the node said "full") is not a
// failure: it only steers the next pick away for a short `busy_for`.
//
// Time comes from the injected Clock. Thread-safe.

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace kvrelay::gateway {

struct CircuitBreakerOptions {
  absl::Duration open_for = absl::Seconds(1);
  absl::Duration max_open_for = absl::Seconds(30);
  absl::Duration busy_for = absl::Milliseconds(200);
};

class CircuitBreaker {
 public:
  enum class State { kClosed, kOpen, kHalfOpen };

  CircuitBreaker(Clock* clock, CircuitBreakerOptions options) : clock_(clock), options_(options) {}

  // True if a request may go to the node now. In half-open state only the first caller gets
  // true (it becomes the probe) until its outcome is recorded.
  bool Allow();
  // True if the node is closed and not busy (for ranking; does not take the probe).
  bool Healthy() const;
  void RecordSuccess();
  void RecordFailure();
  void RecordBusy();
  State state() const;
  int64_t failures() const;

 private:
  Clock* const clock_;
  const CircuitBreakerOptions options_;
  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kClosed;
  absl::Time open_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time busy_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration current_open_for_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  bool probe_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  int64_t failures_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrelay::gateway
