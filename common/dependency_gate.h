#pragma once

// DependencyGate: a process's memory of one dependency (the cache store) on the request path.
// After a call to it fails because it did not answer (DEADLINE_EXCEEDED with the call's own
// limit, not the request's, or UNAVAILABLE), the gate opens: the next calls fail fast with
// UNAVAILABLE naming the dependency and when it failed, for a cool-down. When the cool-down has
// passed the gate is half-open: exactly one call goes out as the probe; its answer closes the
// gate, its failure opens it again for twice the cool-down (bounded). So a hung dependency
// costs one bounded wait per process, then nothing but a probe per cool-down.
//
//   DependencyGate::Ticket ticket = gate.Admit();
//   if (!ticket.ok()) return ticket.status();          // fail fast: skip the dependency
//   absl::Status s = CallIt(...);
//   ticket.Record(s, /*caller_bound=*/...);             // a ticket not recorded decides nothing
//
// Only structured codes decide (never message text): DEADLINE_EXCEEDED and UNAVAILABLE are "did
// not answer"; any other status is an answer, so it closes the gate. Time comes from the
// injected Clock. Thread-safe.

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/probe_backoff.h"

namespace kvrelay {

struct DependencyGateOptions {
  std::string name;  // in every fast-fail message, e.g. "the cache store at host:7000"
  absl::Duration min_cooldown = absl::Milliseconds(250);
  absl::Duration max_cooldown = absl::Seconds(10);
  // With a registry: kvrelay:dependency_state{dependency=<metric_label>} (0 closed, 1 open,
  // 2 half-open) and kvrelay:dependency_fast_failures_total{dependency=<metric_label>}, each
  // with `extra_labels` too (a worker's model_name).
  MetricsRegistry* metrics = nullptr;
  std::string metric_label;
  MetricLabels extra_labels;
};

class DependencyGate {
 public:
  using State = ProbeBackoff::State;

  // One admitted call (or a refusal). Movable; a ticket destroyed without Record frees its
  // probe slot and decides nothing.
  class Ticket {
   public:
    Ticket(Ticket&& other) noexcept;
    Ticket& operator=(Ticket&&) = delete;
    Ticket(const Ticket&) = delete;
    ~Ticket();
    bool ok() const { return refusal_.ok(); }
    // UNAVAILABLE naming the dependency when refused; OK when admitted.
    const absl::Status& status() const { return refusal_; }
    // True when this call is the half-open probe.
    bool probe() const { return probe_; }
    // The admitted call's outcome. `caller_bound`: the caller's own deadline (not the
    // dependency's per-call limit) ended the call, so a DEADLINE_EXCEEDED says nothing about
    // the dependency. Once per ticket; no-op on a refused one.
    void Record(const absl::Status& status, bool caller_bound = false);

   private:
    friend class DependencyGate;
    Ticket(DependencyGate* gate, absl::Status refusal, bool probe)
        : gate_(gate), refusal_(std::move(refusal)), probe_(probe) {}
    DependencyGate* gate_;  // null once recorded or refused
    absl::Status refusal_;
    bool probe_;
  };

  // An admitted call with its bound: the request's deadline or the call's limit, whichever
  // comes first (a probe's limit is tighter still).
  struct BoundCall {
    Ticket ticket;
    absl::Time deadline;        // the RPC's (wall-clock)
    bool caller_bound = false;  // the request's deadline is the nearer one
    // Records the call's outcome with the gate (once).
    void Done(const absl::Status& status) { ticket.Record(status, caller_bound); }
  };

  DependencyGate(Clock* clock, DependencyGateOptions options);
  DependencyGate(const DependencyGate&) = delete;
  DependencyGate& operator=(const DependencyGate&) = delete;

  // Lets a call go out (closed; or half-open with no probe in flight: it becomes the probe) or
  // refuses it at once.
  Ticket Admit() ABSL_LOCKS_EXCLUDED(mu_);
  // Admit, bounded: a call that must end by `request_deadline` and by `limit` (wall-clock), and
  // a probe also within `probe_limit` from now. The gate's refusal while it is open.
  absl::StatusOr<BoundCall> AdmitCall(absl::Time request_deadline, absl::Time limit,
                                      absl::Duration probe_limit) ABSL_LOCKS_EXCLUDED(mu_);
  State state() const ABSL_LOCKS_EXCLUDED(mu_);
  // The cool-down the gate opens (or opened) for next.
  absl::Duration cooldown() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t fast_failures() const ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& name() const { return options_.name; }
  // Whether `status` (not bound by the caller's deadline) says the dependency did not answer.
  static bool DidNotAnswer(const absl::Status& status, bool caller_bound);

 private:
  void Finish(bool probe, const absl::Status& status, bool caller_bound) ABSL_LOCKS_EXCLUDED(mu_);
  void OpenLocked(absl::Time now, const absl::Status& why, bool after_probe)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLocked(State state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  const DependencyGateOptions options_;
  Gauge* state_gauge_ = nullptr;
  Counter* fast_fail_counter_ = nullptr;
  mutable absl::Mutex mu_;
  ProbeBackoff backoff_ ABSL_GUARDED_BY(mu_);
  absl::Time failed_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::StatusCode failed_with_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  int64_t fast_failures_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrelay
