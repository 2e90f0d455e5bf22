#pragma once

// PrefillQueue: the prompt tokens a prefill worker has admitted and not finished, and the
// admission rule on them. A request's predicted start is the tokens ahead of it divided by the
// worker's measured compute rate (prompt tokens per second); one whose predicted start is past
// its deadline is refused at once with RESOURCE_EXHAUSTED (ErrorInfo ROLE_PREFILL,
// FAILURE_OVERLOADED, "queue", the predicted start), so the queue is bounded by predicted wait,
// not by length. Until the rate is measured every request is admitted (the worker measures it
// before it serves: PrefillWorker::MeasureComputeRate).
//
// Called by PrefillWorker::Run (RPC threads): Admit, then the Ticket gives the tokens back when
// the request ends.
//
// Thread-safe. The rate meter must outlive the queue, and the queue its tickets.

#include <cstdint>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv/reuse_cost.h"

namespace kvrelay::prefill {

class PrefillQueue {
 public:
  // `rate`: the worker's compute rate; `node_id` names it in refusals.
  PrefillQueue(const kv::RateMeter* rate, std::string node_id);
  PrefillQueue(const PrefillQueue&) = delete;
  PrefillQueue& operator=(const PrefillQueue&) = delete;

  // One admitted request's tokens in the queue; given back when destroyed.
  class Ticket {
   public:
    Ticket(Ticket&& other) noexcept
        : queue_(std::exchange(other.queue_, nullptr)), tokens_(other.tokens_) {}
    Ticket& operator=(Ticket&&) = delete;
    Ticket(const Ticket&) = delete;
    ~Ticket();

   private:
    friend class PrefillQueue;
    Ticket(PrefillQueue* queue, int64_t tokens) : queue_(queue), tokens_(tokens) {}
    PrefillQueue* queue_;
    int64_t tokens_;
  };

  // Admits a request of `tokens` to compute with `remaining` until its deadline, or refuses it
  // (RESOURCE_EXHAUSTED as above) when the tokens ahead would not let it start in time.
  absl::StatusOr<Ticket> Admit(int64_t tokens, absl::Duration remaining) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t queued_tokens() const ABSL_LOCKS_EXCLUDED(mu_);
  // When a request admitted now would start: the queued tokens at the measured rate (zero
  // when nothing is queued or the rate is not measured yet).
  absl::Duration PredictedStart() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Duration PredictedStartLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Give(int64_t tokens) ABSL_LOCKS_EXCLUDED(mu_);

  const kv::RateMeter* const rate_;
  const std::string node_id_;
  mutable absl::Mutex mu_;
  int64_t queued_tokens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrelay::prefill
