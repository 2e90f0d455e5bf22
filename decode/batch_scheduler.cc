#include "decode/batch_scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvrelay::decode {

BatchSequence::Output BatchSequence::Await(absl::Time until) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !out_.empty() || done_; };
  mu_.AwaitWithDeadline(absl::Condition(&ready), until);
  Output output;
  output.tokens.swap(out_);
  output.done = done_;
  output.status = status_;
  return output;
}

void BatchSequence::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
}

bool BatchSequence::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool BatchSequence::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

bool BatchSequence::Finished() const {
  return generated_ >= max_tokens_ || (eos_token_ >= 0 && last_token_ == eos_token_);
}

void BatchSequence::Emit(int32_t token) {
  last_token_ = token;
  ++generated_;
  absl::MutexLock lock(&mu_);
  out_.push_back(token);
}

void BatchSequence::Finish(absl::Status status) {
  retired_ = true;
  absl::MutexLock lock(&mu_);
  done_ = true;
  status_ = std::move(status);
}

BatchScheduler::BatchScheduler(BatchSchedulerOptions options, BatchModel* model)
    : options_(options), model_(model) {}

BatchScheduler::~BatchScheduler() { Stop(); }

void BatchScheduler::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void BatchScheduler::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  std::deque<SequencePtr> queued;
  {
    absl::MutexLock lock(&mu_);
    queued.swap(queued_);
  }
  for (const SequencePtr& seq : queued)
    Retire(*seq, absl::UnavailableError("decode worker stopping"));
}

bool BatchScheduler::Full() const {
  absl::MutexLock lock(&mu_);
  return running_count_ + static_cast<int32_t>(queued_.size()) >=
         options_.max_batch + options_.max_queued;
}

void BatchScheduler::Submit(SequencePtr seq) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queued_.push_back(std::move(seq));
      ++active_count_;
      return;
    }
  }
  Retire(*seq, absl::UnavailableError("decode worker stopping"));
}

BatchScheduler::Counts BatchScheduler::counts() const {
  absl::MutexLock lock(&mu_);
  return Counts{.running = running_count_,
                .queued = static_cast<int32_t>(queued_.size()),
                .active = active_count_};
}

void BatchScheduler::Retire(BatchSequence& seq, absl::Status status) {
  model_->Retire(seq, status);
  seq.Finish(std::move(status));
}

bool BatchScheduler::NextAdmissions(const std::vector<SequencePtr>& running,
                                    std::vector<SequencePtr>& admitted) {
  absl::MutexLock lock(&mu_);
  auto has_work = [this, &running]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queued_.empty() || !running.empty();
  };
  mu_.Await(absl::Condition(&has_work));
  if (stopping_) return false;
  while (!queued_.empty() &&
         static_cast<int32_t>(running.size() + admitted.size()) < options_.max_batch) {
    admitted.push_back(std::move(queued_.front()));
    queued_.pop_front();
  }
  return true;
}

void BatchScheduler::Admit(std::vector<SequencePtr>& admitted, std::vector<SequencePtr>& running) {
  for (SequencePtr& seq : admitted) {
    absl::StatusOr<int32_t> first = model_->Prefill(*seq);
    if (!first.ok()) {
      Retire(*seq, first.status());
      continue;
    }
    seq->Emit(*first);
    if (seq->Finished()) {
      Retire(*seq, absl::OkStatus());
    } else {
      running.push_back(std::move(seq));
    }
  }
  admitted.clear();
}

void BatchScheduler::StepBatch(std::vector<SequencePtr>& running) {
  std::vector<BatchSequence*> batch;
  batch.reserve(running.size());
  for (const SequencePtr& seq : running) batch.push_back(seq.get());
  absl::StatusOr<std::vector<int32_t>> tokens = model_->Step(batch);
  if (tokens.ok() && tokens->size() != batch.size()) {
    tokens = absl::InternalError(absl::StrCat("the model's step returned ", tokens->size(),
                                              " tokens for ", batch.size(), " sequences"));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!tokens.ok()) {
      Retire(*batch[i], tokens.status());
      continue;
    }
    batch[i]->Emit((*tokens)[i]);
    if (batch[i]->Finished()) Retire(*batch[i], absl::OkStatus());
  }
}

void BatchScheduler::EndIteration(const std::vector<SequencePtr>& running) {
  {
    absl::MutexLock lock(&mu_);
    running_count_ = static_cast<int32_t>(running.size());
    active_count_ = static_cast<int32_t>(running.size() + queued_.size());
  }
  model_->OnIteration();
}

void BatchScheduler::Loop() {
  std::vector<SequencePtr> running;
  std::vector<SequencePtr> admitted;
  auto drop_retired = [&running] {
    running.erase(std::remove_if(running.begin(), running.end(),
                                 [](const SequencePtr& seq) { return seq->retired(); }),
                  running.end());
  };
  while (NextAdmissions(running, admitted)) {
    Admit(admitted, running);
    // Sequences whose client went away leave before the step.
    for (const SequencePtr& seq : running) {
      if (seq->cancelled()) Retire(*seq, absl::CancelledError("client went away"));
    }
    drop_retired();
    if (!running.empty()) {
      StepBatch(running);
      drop_retired();
    }
    EndIteration(running);
  }
  for (const SequencePtr& seq : running) {
    Retire(*seq, absl::UnavailableError("decode worker stopping"));
  }
}

}  // namespace kvrelay::decode
