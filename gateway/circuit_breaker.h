#pragma once

// CircuitBreaker: per-node health as the gateway sees it. Closed: traffic flows. A failure
// attributed to the node opens it for `open_for` (doubling on each failed probe, up to
// `max_open_for`); when that passes it is half-open: exactly one request probes the node, and
// its outcome closes the breaker or opens it again. Overload (the node said "full") is not a
// failure: it never opens the breaker and never makes the node unhealthy; it only marks the
// node busy for a short while (`busy_for`, or less when the node predicted room sooner), so
// the pickers try another node first and the gateway can refuse at once when all are busy.
// Draining (the node said FAILURE_DRAINING: it got SIGTERM and finishes what it admitted) is
// not a failure either: the node is skipped for `draining_for` (renewed by each refusal)
// without opening the breaker; a restarted discovered worker is a new node anyway.
//
// Time comes from the injected Clock. Thread-safe.

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/probe_backoff.h"

namespace kvrelay::gateway {

struct CircuitBreakerOptions {
  absl::Duration open_for = absl::Seconds(1);
  absl::Duration max_open_for = absl::Seconds(30);
  absl::Duration busy_for = absl::Milliseconds(200);
  absl::Duration draining_for = absl::Seconds(5);
};

class CircuitBreaker {
 public:
  using State = ProbeBackoff::State;

  CircuitBreaker(Clock* clock, CircuitBreakerOptions options)
      : clock_(clock), options_(options), backoff_(options.open_for, options.max_open_for) {}

  // True if a request may go to the node now (busy or not). In half-open state only the first
  // caller gets true (it becomes the probe) until its outcome is recorded.
  bool Allow();
  // True if the node is closed and not draining (for ranking; does not take the probe). A busy
  // node is healthy.
  bool Healthy() const;
  // True while the node drains: it refused with FAILURE_DRAINING less than draining_for ago.
  bool Draining() const;
  // True while the node is busy: it refused for capacity less than its busy time ago.
  bool Busy() const;
  // How long until the node predicted room at its last refusal (its own figure, not capped
  // by busy_for; busy_for when it gave none); zero once passed or when it never refused.
  absl::Duration PredictedWait() const;
  void RecordSuccess();
  void RecordFailure();
  // The node refused for capacity: busy for `predicted_wait` when the node said (> 0 and below
  // busy_for), else busy_for. Closes a half-open breaker (a full node is alive).
  void RecordBusy(absl::Duration predicted_wait = absl::ZeroDuration());
  // The node refused because it drains: skipped for draining_for; not a failure (closes a
  // half-open breaker: the node is alive).
  void RecordDraining();
  // The registry says the node is back (heartbeating again): an open breaker turns
  // half-open now, so the next request probes it.
  void ProbeNow();
  State state() const;
  int64_t failures() const;

 private:
  Clock* const clock_;
  const CircuitBreakerOptions options_;
  mutable absl::Mutex mu_;
  ProbeBackoff backoff_ ABSL_GUARDED_BY(mu_);
  absl::Time busy_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time room_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // see PredictedWait
  absl::Time draining_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t failures_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrelay::gateway
