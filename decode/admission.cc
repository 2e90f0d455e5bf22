#include "decode/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace kvrelay::decode {

DecodeAdmission::DecodeAdmission(DecodeAdmissionOptions options, std::string node_id)
    : options_(options), node_id_(std::move(node_id)) {}

void DecodeAdmission::ObserveResidency(absl::Duration residency) {
  if (residency < absl::ZeroDuration()) return;
  absl::MutexLock lock(&mu_);
  residency_ = residency_ == absl::ZeroDuration()
                   ? residency
                   : residency_ * (1 - options_.weight) + residency * options_.weight;
}

absl::Duration DecodeAdmission::residency() const {
  absl::MutexLock lock(&mu_);
  return residency_;
}

absl::Duration DecodeAdmission::NextDeparture(int32_t running) const {
  if (running <= 0) return absl::ZeroDuration();
  // In a steady batch of `running` sequences one leaves every residency / running.
  return residency() / running;
}

absl::Duration DecodeAdmission::PredictedWait(int32_t ahead) const {
  if (ahead < options_.max_batch) return absl::ZeroDuration();
  if (ahead >= options_.max_batch + options_.max_queued) return absl::InfiniteDuration();
  // Place 1 waits for one sequence to leave, place k for k of them.
  const int64_t place = int64_t{ahead} - options_.max_batch + 1;
  return NextDeparture(options_.max_batch) * place;
}

absl::Status DecodeAdmission::Check(int32_t ahead, absl::Duration remaining) const {
  const absl::Duration wait = PredictedWait(ahead);
  if (wait == absl::ZeroDuration() || wait < remaining) return absl::OkStatus();
  const bool full = wait == absl::InfiniteDuration();
  // A client told to come back should come when a place may have freed.
  const absl::Duration retry = full ? NextDeparture(options_.max_batch) : wait;
  return proto::Overloaded(
      full ? absl::StrCat("decode node ", node_id_, ": the batch (", options_.max_batch,
                          ") and its queue (", options_.max_queued, ") are full")
           : absl::StrCat("decode node ", node_id_, ": ", ahead,
                          " sequences ahead; predicted start in ", absl::FormatDuration(wait),
                          ", past the request's deadline (", absl::FormatDuration(remaining),
                          " left)"),
      kvrelay::v1::ROLE_DECODE, node_id_, "queue",
      absl::ToInt64Milliseconds(absl::Ceil(retry, absl::Milliseconds(1))));
}

}  // namespace kvrelay::decode
