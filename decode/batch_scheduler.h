#pragma once

// BatchScheduler: continuous batching over a model it is handed.
//
// One thread owns the model. Each iteration it admits queued sequences while fewer than
// max_batch run (each is prefilled: its first token), drops sequences whose stream cancelled,
// then runs one batched step over every running sequence (one token each). Sequences join and
// leave between steps; a sequence leaves after max_tokens tokens, its eos token, a failure, or
// a cancel. At most max_batch run and max_queued more wait: Full() says when to refuse.
//
// BatchSequence is one sequence's stopping rule and its stream: the scheduler emits tokens into
// it, the request's thread takes them (Await) and may Cancel. Subclass it to carry what the
// model needs (KV cache, sampler); the BatchModel gets the sequences back as it submitted them.
//
// Thread-safe. Lock order: BatchScheduler's mutex and each BatchSequence's mutex are leaves,
// never held together; the BatchModel is called on the scheduler thread with neither held, so
// it may call counts() and take its own locks. The model must outlive the scheduler.

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace kvrelay::decode {

class BatchSequence {
 public:
  // eos_token < 0: none.
  BatchSequence(int32_t max_tokens, int32_t eos_token)
      : max_tokens_(max_tokens), eos_token_(eos_token) {}
  virtual ~BatchSequence() = default;
  BatchSequence(const BatchSequence&) = delete;
  BatchSequence& operator=(const BatchSequence&) = delete;

  // The stream's side; any thread.
  struct Output {
    std::vector<int32_t> tokens;  // emitted since the last Await
    bool done = false;            // no token follows
    absl::Status status;          // when done: OK, or why the sequence ended early
  };
  // Waits until a token is ready, the sequence is done, or `until`; takes the tokens.
  Output Await(absl::Time until);
  // Asks the scheduler to drop the sequence before its next step (idempotent).
  void Cancel();
  bool cancelled() const;
  bool done() const;

  // The scheduler's side (its thread only).
  int32_t max_tokens() const { return max_tokens_; }
  int32_t generated() const { return generated_; }
  int32_t last_token() const { return last_token_; }  // -1 before the first
  // Max tokens reached or the eos token emitted.
  bool Finished() const;
  void Emit(int32_t token);
  // Marks the stream done with `status`.
  void Finish(absl::Status status);
  bool retired() const { return retired_; }

 private:
  const int32_t max_tokens_;
  const int32_t eos_token_;
  // Scheduler thread only.
  int32_t generated_ = 0;
  int32_t last_token_ = -1;
  bool retired_ = false;

  mutable absl::Mutex mu_;
  std::vector<int32_t> out_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// What the scheduler drives; all calls on the scheduler thread, no scheduler lock held.
class BatchModel {
 public:
  virtual ~BatchModel() = default;
  // Computes the sequence's prompt (what is not cached yet) and picks its first token.
  virtual absl::StatusOr<int32_t> Prefill(BatchSequence& seq) = 0;
  // One step over `batch`: the next token of each sequence, in order (batch.size() of them).
  virtual absl::StatusOr<std::vector<int32_t>> Step(absl::Span<BatchSequence* const> batch) = 0;
  // `seq` leaves with `status` (OK: it finished): free what it holds. Called once per
  // submitted sequence (those still queued at Stop included), before its stream sees done.
  virtual void Retire(BatchSequence& seq, const absl::Status& status) = 0;
  // After every iteration: counts() changed.
  virtual void OnIteration() {}
};

struct BatchSchedulerOptions {
  int32_t max_batch = 32;   // sequences in one step (> 0)
  int32_t max_queued = 64;  // sequences that may wait for a place in the batch (>= 0)
};

class BatchScheduler {
 public:
  // `model` must outlive the scheduler. Nothing runs until Start().
  BatchScheduler(BatchSchedulerOptions options, BatchModel* model);
  // Stops (see Stop).
  ~BatchScheduler();
  BatchScheduler(const BatchScheduler&) = delete;
  BatchScheduler& operator=(const BatchScheduler&) = delete;

  // Starts the scheduler thread. REQUIRES: called once.
  void Start();
  // Joins the thread; sequences still running or queued are retired with UNAVAILABLE.
  // Idempotent; Submit after Stop retires the sequence at once.
  void Stop();

  // Whether max_batch + max_queued sequences run or wait: a new one should be refused. The
  // bound is soft by the Submits racing this check.
  bool Full() const;
  // Queues `seq` for the batch. REQUIRES: not submitted before.
  void Submit(std::shared_ptr<BatchSequence> seq);

  struct Counts {
    int32_t running = 0;  // in the batch at the end of the last iteration
    int32_t queued = 0;   // waiting for the batch
    int32_t active = 0;   // running + queued, counting Submits since the last iteration
  };
  Counts counts() const;

 private:
  using SequencePtr = std::shared_ptr<BatchSequence>;
  void Loop();
  // Waits for work; moves up to max_batch - running.size() queued sequences to `admitted`.
  // False when stopping.
  bool NextAdmissions(const std::vector<SequencePtr>& running, std::vector<SequencePtr>& admitted);
  // Prefills `admitted`; those not finished by their first token join `running`.
  void Admit(std::vector<SequencePtr>& admitted, std::vector<SequencePtr>& running);
  // One step over `running`; retires sequences that finished or failed.
  void StepBatch(std::vector<SequencePtr>& running);
  void Retire(BatchSequence& seq, absl::Status status);
  // Publishes the counts and tells the model.
  void EndIteration(const std::vector<SequencePtr>& running);

  const BatchSchedulerOptions options_;
  BatchModel* const model_;

  mutable absl::Mutex mu_;
  std::deque<SequencePtr> queued_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int32_t running_count_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t active_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // started by Start; joined by Stop
};

}  // namespace kvrelay::decode
