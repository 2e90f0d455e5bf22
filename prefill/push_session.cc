#include "prefill/push_session.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "proto/grpc_status.h"
#include "worker/kv_memory.h"

namespace kvrelay::prefill {
namespace {

using ::kvrelay::proto::Attribute;

// Why a push to a decode worker failed, from the status code alone (never its text): the
// `reason` label of kvrelay:kv_transfer_failures_total.
const char* TransferFailureReason(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return "timeout";
    case absl::StatusCode::kUnavailable:
      return "peer_lost";
    case absl::StatusCode::kDataLoss:
      return "corrupt";
    case absl::StatusCode::kCancelled:
      return "cancelled";
    case absl::StatusCode::kPermissionDenied:
      return "refused";
    default:
      return "error";
  }
}

// A verdict as the decode worker sent it; its reason travels as the status's ErrorInfo.
absl::Status ParseVerdict(const std::string& message) {
  kvrelay::v1::PushVerdict answer;
  if (!answer.ParseFromString(message) || answer.code() < 0 || answer.code() > 16) {
    return absl::InternalError("data plane: malformed push verdict from the decode worker");
  }
  absl::Status verdict(static_cast<absl::StatusCode>(answer.code()),
                       absl::StrCat("decode worker: ", answer.message()));
  if (verdict.ok()) return verdict;
  kvrelay::v1::ErrorInfo info;
  info.set_role(kvrelay::v1::ROLE_DECODE);
  info.set_reason(answer.reason());
  return proto::WithErrorInfo(std::move(verdict), info);
}

// Where the decode worker's slot `slot` of `group` is written: the group's region and the slot
// index in it (the run holding it, with runs; else the pool's region and `slot`).
absl::StatusOr<std::pair<transfer::RegionId, int64_t>> TargetSlot(
    const kvrelay::v1::GroupTarget& group, int64_t slot) {
  if (group.runs_size() == 0) return std::make_pair(group.region_id(), slot);
  for (const kvrelay::v1::SlotRun& run : group.runs()) {
    if (slot >= run.first_slot() && slot - run.first_slot() < run.slot_count()) {
      return std::make_pair(run.region_id(), slot - run.first_slot());
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("target: slot ", slot, " is in none of its group's runs"));
}

}  // namespace

// --- ClaimVerdicts --------------------------------------------------------------------------

absl::Status ClaimVerdicts::Exchange(transfer::Transport& transport, transfer::PeerId peer,
                                     const kvrelay::v1::PushClaim& claim, absl::Time deadline) {
  const std::pair<transfer::PeerId, uint64_t> key{peer, worker::RequestTag(claim.request_id())};
  {
    absl::MutexLock lock(&mu_);
    if (!verdicts_.try_emplace(key, std::nullopt).second) {
      return absl::AlreadyExistsError(absl::StrCat("request '", claim.request_id(),
                                                   "' is already pushing to this decode worker"));
    }
  }
  absl::Status result = transport.SendControl(peer, key.second, claim.SerializeAsString());
  absl::MutexLock lock(&mu_);
  if (result.ok()) {
    auto arrived = [this, &key]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return verdicts_[key].has_value(); };
    if (!mu_.AwaitWithDeadline(absl::Condition(&arrived), deadline)) {
      result = absl::DeadlineExceededError("data plane: no answer to the push claim in time");
    } else {
      result = *verdicts_[key];
    }
  }
  verdicts_.erase(key);
  return result;
}

void ClaimVerdicts::OnInbound(const transfer::InboundEvent& event) {
  if (event.kind == transfer::InboundEvent::Kind::kPeerDown) {
    absl::MutexLock lock(&mu_);
    for (auto& [key, verdict] : verdicts_) {
      if (key.first == event.peer && !verdict.has_value()) {
        verdict = absl::UnavailableError(
            absl::StrCat("data plane: the decode worker went away: ", event.status.message()));
      }
    }
    return;
  }
  if (event.kind != transfer::InboundEvent::Kind::kControl) return;
  absl::Status verdict = ParseVerdict(event.message);
  absl::MutexLock lock(&mu_);
  // Only a claim in flight takes a verdict: a late or unasked one is dropped.
  auto it = verdicts_.find({event.peer, event.tag});
  if (it != verdicts_.end() && !it->second.has_value()) it->second = std::move(verdict);
}

// --- PushMetrics ----------------------------------------------------------------------------

PushMetrics::PushMetrics(MetricsRegistry* registry, MetricLabels labels)
    : registry_(registry),
      labels_(std::move(labels)),
      pushed_bytes_(registry_->GetCounter("kvrelay:prefill_pushed_kv_bytes_total",
                                          "KV bytes pushed to decode workers.", labels_)),
      transfer_seconds_(registry_->GetHistogram(
          "kvrelay:kv_transfer_time_seconds",
          "Histogram of transfer duration of KV pushes to decode workers (first layer posted to "
          "last layer delivered).",
          KvTransferTimeBucketsSeconds(), labels_)),
      transfer_bytes_(
          registry_->GetHistogram("kvrelay:kv_transfer_bytes",
                                  "Histogram of bytes transferred per KV push to a decode worker.",
                                  KvTransferBytesBuckets(), labels_)) {}

void PushMetrics::CountFailure(const char* reason) {
  MetricLabels labels = labels_;
  labels["reason"] = reason;
  registry_
      ->GetCounter("kvrelay:kv_transfer_failures_total",
                   "KV pushes to decode workers that failed, by reason.", labels)
      ->Increment();
}

void PushMetrics::RecordPush(int64_t bytes, absl::Duration elapsed, const std::string& decode) {
  pushed_bytes_->Increment(static_cast<double>(bytes));
  transfer_seconds_->Observe(absl::ToDoubleSeconds(elapsed));
  transfer_bytes_->Observe(static_cast<double>(bytes));
  // Per link (this worker -> one decode worker): bytes over seconds is the link's rate while
  // pushing; the families above add up every link.
  MetricLabels link = labels_;
  link["decode"] = decode;
  registry_
      ->GetCounter("kvrelay:kv_transfer_link_bytes_total",
                   "KV bytes pushed to each decode worker (label decode: its node id).", link)
      ->Increment(static_cast<double>(bytes));
  registry_
      ->GetCounter("kvrelay:kv_transfer_link_seconds_total",
                   "Time spent pushing to each decode worker, first layer posted to last "
                   "delivered (label decode: its node id).",
                   link)
      ->Increment(absl::ToDoubleSeconds(elapsed));
}

// --- PushSession ----------------------------------------------------------------------------

PushSession::PushSession(const PushContext& context, std::string request_id,
                         const kvrelay::v1::ReserveResponse& target, absl::Time deadline)
    : context_(context), request_id_(std::move(request_id)), target_(target), deadline_(deadline) {
  batch_.direction = transfer::Direction::kPut;
  batch_.tag = worker::RequestTag(request_id_);
  // The decode worker checks the reservation's token with every DONE.
  batch_.credential = target_.reservation_token();
}

PushSession::~PushSession() {
  // Cancels and waits for what is in flight: no transfer uses a key once it is forgotten.
  handles_.clear();
  for (transfer::RegionId id : imported_) (void)context_.transport->ForgetRegion(peer_, id);
}

absl::StatusOr<std::unique_ptr<PushSession>> PushSession::Open(
    const PushContext& context, std::string request_id, const kvrelay::v1::ReserveResponse& target,
    absl::Time deadline) {
  auto session = std::unique_ptr<PushSession>(
      new PushSession(context, std::move(request_id), target, deadline));
  KV_RETURN_IF_ERROR(session->Connect());
  KV_RETURN_IF_ERROR(session->ImportKeys());
  return session;
}

absl::Status PushSession::Connect() {
  absl::StatusOr<transfer::PeerId> connected =
      context_.peers->Get(target_.transport().address(), target_.data_plane_key(), deadline_);
  if (absl::IsPermissionDenied(connected.status())) {
    // The key is the caller's (from Reserve): not the decode worker's fault.
    return Attribute(absl::PermissionDeniedError(
                         absl::StrCat("target.data_plane_key: decode node ", target_.node_id(),
                                      " at ", target_.transport().address(), " refused it")),
                     kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_UNAUTHORIZED);
  }
  if (!connected.ok()) {
    context_.metrics->CountFailure("unreachable");
    return DecodeFailure(
        absl::Status(
            connected.status().code(),
            absl::StrCat("data plane: cannot reach decode node ", target_.node_id(), " at ",
                         target_.transport().address(), ": ", connected.status().message())),
        kvrelay::v1::FAILURE_UNREACHABLE);
  }
  peer_ = *connected;
  batch_.peer = peer_;
  return absl::OkStatus();
}

absl::Status PushSession::ImportKeys() {
  transfer::Transport& transport = *context_.transport;
  for (int g = 0; g < target_.groups_size(); ++g) {
    for (int i = 0; i < target_.groups(g).runs_size(); ++i) {
      const kvrelay::v1::SlotRun& run = target_.groups(g).runs(i);
      absl::StatusOr<transfer::RegionId> id = transport.ImportRegion(peer_, run.memory_key());
      if (id.ok() && *id != run.region_id()) {
        (void)transport.ForgetRegion(peer_, *id);
        id = absl::InvalidArgumentError(
            absl::StrCat("the key is of region ", *id, ", not ", run.region_id()));
      }
      if (!id.ok()) {
        context_.metrics->CountFailure("refused");
        return DecodeFailure(
            absl::Status(
                id.status().code(),
                absl::StrCat("target.groups[", g, "].runs[", i, "].memory_key of decode node ",
                             target_.node_id(), ": ", id.status().message())),
            kvrelay::v1::FAILURE_TRANSFER);
      }
      imported_.push_back(*id);
    }
  }
  return absl::OkStatus();
}

absl::Status PushSession::AddSlice(const PushSlice& slice) {
  KV_DCHECK(!plan_.has_value());
  const kvrelay::v1::GroupTarget& group = target_.groups(slice.group);
  absl::StatusOr<std::pair<transfer::RegionId, int64_t>> where =
      TargetSlot(group, slice.remote_slot);
  if (!where.ok()) {
    // The caller named a slot outside its own target's runs.
    return Attribute(where.status(), kvrelay::v1::ROLE_CLIENT, "",
                     kvrelay::v1::FAILURE_INVALID_REQUEST);
  }
  transfer::BlockTransfer t;
  t.local = slice.local;
  t.local_offset = slice.local_offset;
  t.remote_region = where->first;
  t.remote_offset =
      static_cast<uint64_t>(where->second) * group.slot_stride_bytes() + slice.offset_in_unit;
  t.length = slice.length;
  t.layer = slice.layer;
  batch_.blocks.push_back(t);
  return absl::OkStatus();
}

absl::Status PushSession::Claim() {
  KV_ASSIGN_OR_RETURN(transfer::TransferPlan plan, context_.transport->Prepare(batch_));
  kvrelay::v1::PushClaim claim;
  claim.set_request_id(request_id_);
  claim.set_reservation_token(target_.reservation_token());
  *claim.mutable_groups() = target_.groups();
  // A caller naming another request's slots gets PERMISSION_DENIED here.
  absl::Status claimed =
      context_.verdicts->Exchange(*context_.transport, peer_, claim,
                                  std::min(deadline_, absl::Now() + context_.transfer_timeout));
  if (!claimed.ok()) return ClaimFailure(std::move(claimed));
  plan_ = std::move(plan);
  post_options_.deadline = std::min(deadline_, absl::Now() + context_.transfer_timeout);
  return absl::OkStatus();
}

void PushSession::Post(transfer::LayerRange layers) {
  KV_DCHECK(plan_.has_value());
  if (!post_status_.ok()) return;
  if (first_post_ == absl::InfiniteFuture()) first_post_ = absl::Now();
  absl::StatusOr<transfer::TransferHandlePtr> handle =
      context_.transport->Post(*plan_, layers, post_options_);
  if (handle.ok()) {
    handles_.push_back(*std::move(handle));
  } else {
    post_status_ = handle.status();
  }
}

absl::StatusOr<int64_t> PushSession::Finish() {
  int64_t pushed = 0;
  absl::Status transfer_status = post_status_;
  for (const transfer::TransferHandlePtr& handle : handles_) {
    absl::Status s = handle->Wait(deadline_);
    if (!s.ok() && transfer_status.ok()) transfer_status = s;
    pushed += handle->bytes();
  }
  if (!transfer_status.ok()) return PushFailure(std::move(transfer_status));
  if (first_post_ != absl::InfiniteFuture()) {
    context_.metrics->RecordPush(pushed, absl::Now() - first_post_, target_.node_id());
  }
  return pushed;
}

absl::Status PushSession::DecodeFailure(absl::Status s, kvrelay::v1::FailureReason reason) const {
  kvrelay::v1::ErrorInfo info;
  info.set_role(kvrelay::v1::ROLE_DECODE);
  info.set_node_id(target_.node_id());
  info.set_incarnation(target_.incarnation());
  info.set_address(target_.transport().address());
  info.set_reason(reason);
  return proto::WithErrorInfo(std::move(s), info);
}

absl::Status PushSession::ClaimFailure(absl::Status claimed) const {
  context_.metrics->CountFailure(TransferFailureReason(claimed));
  if (absl::IsPermissionDenied(claimed)) {
    absl::Status refused = absl::PermissionDeniedError(absl::StrCat(
        "target: decode node ", target_.node_id(), " refused the push: ", claimed.message()));
    // A lapsed reservation is the decode worker's to report (retry with a new one); any other
    // refusal is the caller's (not its reservation's token or slots).
    std::optional<kvrelay::v1::ErrorInfo> why = proto::GetErrorInfo(claimed);
    if (why.has_value() && why->reason() == kvrelay::v1::FAILURE_EXPIRED) {
      return DecodeFailure(std::move(refused), kvrelay::v1::FAILURE_EXPIRED);
    }
    return Attribute(std::move(refused), kvrelay::v1::ROLE_CLIENT, "",
                     kvrelay::v1::FAILURE_UNAUTHORIZED);
  }
  return DecodeFailure(
      absl::Status(claimed.code(), absl::StrCat("data plane: push claim to decode node ",
                                                target_.node_id(), ": ", claimed.message())),
      kvrelay::v1::FAILURE_TRANSFER);
}

absl::Status PushSession::PushFailure(absl::Status failed) const {
  context_.metrics->CountFailure(TransferFailureReason(failed));
  // The caller's own deadline is not the decode worker's fault.
  if (absl::IsDeadlineExceeded(failed) && absl::Now() >= deadline_) {
    return Attribute(
        absl::DeadlineExceededError(absl::StrCat(
            "the request's deadline passed while pushing to decode node ", target_.node_id())),
        kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  return DecodeFailure(
      absl::Status(failed.code(),
                   absl::StrCat("data plane: push to decode node ", target_.node_id(), " at ",
                                target_.transport().address(), " failed: ", failed.message())),
      absl::IsDataLoss(failed) ? kvrelay::v1::FAILURE_CORRUPT : kvrelay::v1::FAILURE_TRANSFER);
}

}  // namespace kvrelay::prefill
