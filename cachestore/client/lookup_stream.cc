#include "cachestore/client/lookup_stream.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore {

std::shared_ptr<LookupStream> LookupStream::Open(v1::CacheStore::Stub* stub) {
  std::shared_ptr<LookupStream> stream(new LookupStream());
  stub->async()->MatchPrefixStream(&stream->ctx_, stream.get());
  // The one read that stays outstanding for the stream's life (re-armed after each answer).
  stream->StartRead(&stream->read_);
  stream->StartCall();
  return stream;
}

bool LookupStream::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_;
}

void LookupStream::Cancel() {
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  ctx_.TryCancel();
}

bool LookupStream::WaitDone(absl::Duration timeout) {
  // Polled: nothing of this object may be touched by OnDone after it says it is done, so no
  // Notification or CondVar (whose Notify/Signal still run on their memory) is used for it.
  const absl::Time deadline = absl::Now() + timeout;
  while (!finished()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

LookupStream::Result LookupStream::Lookup(const v1::MatchPrefixRequest& request,
                                          absl::Time deadline) {
  auto pending = std::make_shared<Pending>();
  uint64_t id = 0;
  const v1::MatchPrefixStreamRequest* start = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (done_) {
      Result refused;
      refused.not_sent = true;
      refused.stream_ended = true;
      refused.status = end_status_;
      return refused;
    }
    if (!ended_ && static_cast<int>(pending_.size()) >= kMaxInFlight) {
      Result refused;
      refused.not_sent = true;
      refused.status = absl::ResourceExhaustedError(
          absl::StrCat("lookup stream: ", kMaxInFlight, " lookups waiting already"));
      return refused;
    }
    id = next_id_++;
    pending_[id] = pending;
    if (ended_) {
      // Ending (the store refused it, or it broke) and OnDone has not said why yet: nothing is
      // sent, the lookup waits for OnDone as the ones the stream carried do, and gets its status.
      pending->result.not_sent = true;
    } else {
      v1::MatchPrefixStreamRequest& out = writes_.emplace_back();
      out.set_id(id);
      *out.mutable_request() = request;
      // Whole milliseconds left, at least 1 (the store refuses 0); the wait below is exact.
      const absl::Duration left = deadline - absl::Now();
      out.set_timeout_ms(std::clamp<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1, 600000));
      if (!writing_) {
        writing_ = true;
        start = &out;
        // While !ended_ the stream's read is outstanding, so the call cannot have finished and
        // a hold may be added; it keeps OnDone away until the write below is started.
        AddHold();
      }
    }
  }
  if (start != nullptr) {
    StartWrite(start);
    RemoveHold();
  }
  if (!pending->done.WaitForNotificationWithDeadline(deadline)) {
    absl::MutexLock lock(&mu_);
    if (pending_.erase(id) > 0) {
      Result late;
      late.status = absl::DeadlineExceededError(
          "MatchPrefix: no answer on the lookup stream before the deadline");
      return late;
    }
    // Answered (or failed) just now: the result is being handed over.
  }
  pending->done.WaitForNotification();
  return std::move(pending->result);
}

void LookupStream::OnWriteDone(bool ok) {
  const v1::MatchPrefixStreamRequest* next = nullptr;
  {
    absl::MutexLock lock(&mu_);
    writes_.pop_front();
    if (!ok) {
      // The stream is broken; the read fails too and OnDone reports why.
      ended_ = true;
      writing_ = false;
      writes_.clear();
    } else if (!writes_.empty()) {
      next = &writes_.front();
    } else {
      writing_ = false;
    }
  }
  if (next != nullptr) StartWrite(next);
}

void LookupStream::OnReadDone(bool ok) {
  if (!ok) {
    absl::MutexLock lock(&mu_);
    ended_ = true;  // OnDone follows with the status
    return;
  }
  std::shared_ptr<Pending> pending;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(read_.id());
    if (it != pending_.end()) {
      pending = std::move(it->second);
      pending_.erase(it);
    }
  }
  // An answer nobody waits for (its caller's deadline passed) is dropped; a lease it carries
  // runs out by its TTL, as a late unary answer's does.
  if (pending != nullptr) {
    Result& r = pending->result;
    r.term = read_.term();
    if (read_.code() == 0) {
      r.response.Swap(read_.mutable_response());
    } else {
      absl::Status status(static_cast<absl::StatusCode>(read_.code()), read_.message());
      if (read_.has_error_info())
        status = proto::WithErrorInfo(std::move(status), read_.error_info());
      r.status = std::move(status);
    }
    pending->done.Notify();
  }
  read_.Clear();
  StartRead(&read_);
}

void LookupStream::OnDone(const grpc::Status& grpc_status) {
  absl::Status status = proto::FromGrpcStatus(grpc_status);
  std::vector<std::shared_ptr<Pending>> waiting;
  {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    if (status.ok()) {
      status = absl::UnavailableError("lookup stream: the store closed it");
    } else if (absl::IsCancelled(status) && !cancelled_) {
      // Cancelled by the store (it drains): another instance or a new stream will answer.
      status = absl::UnavailableError(
          absl::StrCat("lookup stream: cancelled by the store (", status.message(), ")"));
    }
    for (auto& [id, pending] : pending_) waiting.push_back(std::move(pending));
    pending_.clear();
    done_ = true;
    end_status_ = status;
  }
  for (const std::shared_ptr<Pending>& pending : waiting) {
    pending->result.status = status;
    pending->result.stream_ended = true;
    pending->done.Notify();
  }
  finished_.store(true, std::memory_order_release);  // last access: the owner may now free this
}

}  // namespace kvrelay::cachestore
