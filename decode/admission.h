#pragma once

// DecodeAdmission: whether a decode worker can start a new request within the request's
// remaining deadline, from what is ahead of it and what the worker measured. A request that
// finds fewer than max_batch sequences ahead starts at once; past that it waits for a place in
// the batch, and its predicted wait is (its place in the queue) x (the measured time between
// two sequences leaving the batch: mean residency / max_batch). A request whose predicted wait
// is past its deadline, or that finds max_batch + max_queued ahead, is refused at once with
// RESOURCE_EXHAUSTED (ErrorInfo FAILURE_OVERLOADED, "queue", the predicted wait): the queue is
// bounded by predicted wait, and by length only as a backstop. Until a residency is measured
// the length bound alone applies.
//
// Called by DecodeWorker: Check at Reserve (RPC threads), ObserveResidency when a sequence
// leaves the batch (the scheduler thread). Pure policy: no clock; callers pass durations.
//
// Thread-safe.

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvrelay::decode {

struct DecodeAdmissionOptions {
  int32_t max_batch = 32;   // sequences in one step (> 0), as BatchSchedulerOptions
  int32_t max_queued = 64;  // sequences that may wait for the batch (>= 0)
  // Weight of each new residency in the moving average, in (0, 1] (default 0.2).
  double weight = 0.2;
};

class DecodeAdmission {
 public:
  // `node_id` names the worker in refusals.
  DecodeAdmission(DecodeAdmissionOptions options, std::string node_id);

  // One sequence spent `residency` in the batch (admission to its last token).
  void ObserveResidency(absl::Duration residency) ABSL_LOCKS_EXCLUDED(mu_);
  // Mean residency so far; zero until observed.
  absl::Duration residency() const ABSL_LOCKS_EXCLUDED(mu_);

  // How long a request with `ahead` sequences before it (running, queued, or reserved and not
  // yet generating) waits for a place in the batch: zero below max_batch; InfiniteDuration
  // when the queue is full; zero too when no residency is measured yet (unknown).
  absl::Duration PredictedWait(int32_t ahead) const ABSL_LOCKS_EXCLUDED(mu_);
  // OK to start a request with `ahead` before it and `remaining` until its deadline, else
  // RESOURCE_EXHAUSTED (ROLE_DECODE, this node, FAILURE_OVERLOADED, "queue", the predicted
  // wait or, for a full queue, the time until the next place frees when measured).
  absl::Status Check(int32_t ahead, absl::Duration remaining) const ABSL_LOCKS_EXCLUDED(mu_);
  // The time between two sequences leaving a batch of `running` (when KV frees up next);
  // zero when nothing runs or nothing is measured.
  absl::Duration NextDeparture(int32_t running) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const DecodeAdmissionOptions options_;
  const std::string node_id_;
  mutable absl::Mutex mu_;
  absl::Duration residency_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
};

}  // namespace kvrelay::decode
