#include "prefill/admission.h"

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace kvrelay::prefill {

PrefillQueue::PrefillQueue(const kv::RateMeter* rate, std::string node_id)
    : rate_(rate), node_id_(std::move(node_id)) {}

PrefillQueue::Ticket::~Ticket() {
  if (queue_ != nullptr) queue_->Give(tokens_);
}

void PrefillQueue::Give(int64_t tokens) {
  absl::MutexLock lock(&mu_);
  queued_tokens_ -= tokens;
}

int64_t PrefillQueue::queued_tokens() const {
  absl::MutexLock lock(&mu_);
  return queued_tokens_;
}

absl::Duration PrefillQueue::PredictedStart() const {
  absl::MutexLock lock(&mu_);
  return PredictedStartLocked();
}

absl::Duration PrefillQueue::PredictedStartLocked() const {
  const double rate = rate_->rate();
  if (rate <= 0 || queued_tokens_ <= 0) return absl::ZeroDuration();
  return absl::Seconds(static_cast<double>(queued_tokens_) / rate);
}

absl::StatusOr<PrefillQueue::Ticket> PrefillQueue::Admit(int64_t tokens, absl::Duration remaining) {
  absl::MutexLock lock(&mu_);
  // Checked and counted under one lock: two requests racing cannot both take the last room.
  const absl::Duration start = PredictedStartLocked();
  if (start > absl::ZeroDuration() && start >= remaining) {
    return proto::Overloaded(
        absl::StrCat("prefill node ", node_id_, ": ", queued_tokens_,
                     " prompt tokens queued; predicted start in ", absl::FormatDuration(start),
                     ", past the request's deadline (", absl::FormatDuration(remaining), " left)"),
        kvrelay::v1::ROLE_PREFILL, node_id_, "queue",
        absl::ToInt64Milliseconds(absl::Ceil(start, absl::Milliseconds(1))));
  }
  queued_tokens_ += tokens;
  return Ticket(this, tokens);
}

}  // namespace kvrelay::prefill
