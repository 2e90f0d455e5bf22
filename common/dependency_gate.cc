#include "common/dependency_gate.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvrelay {

DependencyGate::Ticket::Ticket(Ticket&& other) noexcept
    : gate_(std::exchange(other.gate_, nullptr)),
      refusal_(std::move(other.refusal_)),
      probe_(other.probe_) {}

DependencyGate::Ticket::~Ticket() {
  // Abandoned without an outcome: the probe slot must not stay taken forever.
  if (gate_ != nullptr && probe_) {
    gate_->Finish(probe_, absl::CancelledError("abandoned"), /*caller_bound=*/true);
  }
}

void DependencyGate::Ticket::Record(const absl::Status& status, bool caller_bound) {
  if (gate_ == nullptr) return;
  std::exchange(gate_, nullptr)->Finish(probe_, status, caller_bound);
}

DependencyGate::DependencyGate(Clock* clock, DependencyGateOptions options)
    : clock_(clock),
      options_(std::move(options)),
      backoff_(options_.min_cooldown, options_.max_cooldown) {
  if (options_.metrics != nullptr) {
    MetricLabels labels = options_.extra_labels;
    labels["dependency"] = options_.metric_label;
    state_gauge_ = options_.metrics->GetGauge(
        "kvrelay:dependency_state",
        "Request-path gate of a dependency: 0 closed (calls go), 1 open (calls fail fast), "
        "2 half-open (one probe goes)",
        labels);
    fast_fail_counter_ = options_.metrics->GetCounter(
        "kvrelay:dependency_fast_failures_total",
        "Request-path calls not sent because the dependency did not answer just before", labels);
    state_gauge_->Set(0);
  }
}

bool DependencyGate::DidNotAnswer(const absl::Status& status, bool caller_bound) {
  if (absl::IsUnavailable(status)) return true;
  return absl::IsDeadlineExceeded(status) && !caller_bound;
}

void DependencyGate::PublishLocked(State state) {
  if (state_gauge_ != nullptr) state_gauge_->Set(static_cast<double>(state));
}

DependencyGate::Ticket DependencyGate::Admit() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  const State state = backoff_.At(now);
  PublishLocked(state);
  if (state == State::kClosed) return Ticket(this, absl::OkStatus(), false);
  if (backoff_.TakeProbe(now)) return Ticket(this, absl::OkStatus(), true);
  ++fast_failures_;
  if (fast_fail_counter_ != nullptr) fast_fail_counter_->Increment();
  const absl::Duration next =
      state == State::kOpen ? backoff_.open_until() - now : absl::ZeroDuration();  // a probe is out
  return Ticket(
      nullptr,
      absl::UnavailableError(absl::StrCat(
          options_.name, " did not answer (", absl::StatusCodeToString(failed_with_), ") at ",
          absl::FormatTime("%H:%M:%E3S UTC", failed_at_, absl::UTCTimeZone()),
          "; calls to it fail fast until one probe gets an answer",
          state == State::kOpen ? absl::StrCat(" (next probe in ", absl::FormatDuration(next), ")")
                                : " (a probe is out now)")),
      false);
}

absl::StatusOr<DependencyGate::BoundCall> DependencyGate::AdmitCall(absl::Time request_deadline,
                                                                    absl::Time limit,
                                                                    absl::Duration probe_limit) {
  Ticket ticket = Admit();
  if (!ticket.ok()) return ticket.status();
  const absl::Time bound = ticket.probe() ? std::min(limit, absl::Now() + probe_limit) : limit;
  return BoundCall{.ticket = std::move(ticket),
                   .deadline = std::min(request_deadline, bound),
                   .caller_bound = request_deadline < bound};
}

void DependencyGate::OpenLocked(absl::Time now, const absl::Status& why, bool after_probe) {
  backoff_.Open(now, after_probe);
  failed_at_ = now;
  failed_with_ = why.code();
  PublishLocked(State::kOpen);
}

void DependencyGate::Finish(bool probe, const absl::Status& status, bool caller_bound) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  if (probe) backoff_.ReleaseProbe();
  if (DidNotAnswer(status, caller_bound)) {
    // A failed probe: it is still away, wait twice as long before the next one.
    if (probe || !backoff_.open()) OpenLocked(now, status, /*after_probe=*/probe);
    // Open already: a call admitted before it opened failed too; that is no news.
    return;
  }
  // Out of the caller's time, cancelled or abandoned: nothing learned; a half-open gate stays
  // so, and the next call probes.
  if (absl::IsCancelled(status) || (caller_bound && absl::IsDeadlineExceeded(status))) return;
  // Any answer, even an error, shows the dependency answers.
  backoff_.Close();
  PublishLocked(State::kClosed);
}

DependencyGate::State DependencyGate::state() const {
  absl::MutexLock lock(&mu_);
  return backoff_.At(clock_->Now());
}

absl::Duration DependencyGate::cooldown() const {
  absl::MutexLock lock(&mu_);
  return backoff_.cooldown();
}

int64_t DependencyGate::fast_failures() const {
  absl::MutexLock lock(&mu_);
  return fast_failures_;
}

}  // namespace kvrelay
