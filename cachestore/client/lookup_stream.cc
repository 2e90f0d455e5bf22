#include "cachestore/client/lookup_stream.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"

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
  bool start = false;
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
      queued_.push_back(Queued{id, request, deadline});
      if (CanWriteLocked() && TakeNextMessageLocked()) {
        start = true;
        // While !ended_ the stream's read is outstanding, so the call cannot have finished and
        // a hold may be added; it keeps OnDone away until the write below is started.
        AddHold();
      }
    }
  }
  if (start) {
    StartWrite(&out_);
    RemoveHold();
  }
  if (!pending->done.WaitForNotificationWithDeadline(deadline)) {
    absl::MutexLock lock(&mu_);
    if (pending_.erase(id) > 0) {
      // Not sent yet: it never will be (the queue stays within kMaxInFlight).
      auto queued = std::find_if(queued_.begin(), queued_.end(),
                                 [id](const Queued& q) { return q.id == id; });
      if (queued != queued_.end()) queued_.erase(queued);
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

bool LookupStream::CanWriteLocked() const {
  return !writing_ && !ended_ && !queued_.empty() &&
         (!batching_ || unanswered_ < kMaxMessagesInFlight);
}

bool LookupStream::TakeNextMessageLocked() {
  out_.Clear();
  const absl::Time now = absl::Now();
  // Whole milliseconds left, at least 1 (the store refuses 0); the caller's wait is exact.
  auto timeout_ms = [now](absl::Time deadline) {
    return std::clamp<int64_t>(absl::ToInt64Milliseconds(deadline - now) + 1, 1, 600000);
  };
  auto blocks_of = [](const v1::MatchPrefixRequest& r) {
    return static_cast<int64_t>(r.chain_size()) +
           static_cast<int64_t>(r.chain_packed().size()) / 16;
  };
  int64_t blocks = 0;
  v1::MatchPrefixStreamRequest* single = nullptr;
  while (!queued_.empty()) {
    Queued& q = queued_.front();
    auto it = pending_.find(q.id);
    if (it == pending_.end()) {  // its caller left at its deadline
      queued_.pop_front();
      continue;
    }
    const int64_t b = blocks_of(q.request);
    if (single != nullptr || out_.lookups_size() > 0) {
      // A batch of two or more stays within the store's limits; the first lookup always goes.
      if (!batching_ || out_.lookups_size() + 1 > limits::kMaxLookupsPerStreamMessage ||
          blocks + b > limits::kMaxBlocksPerStreamMessage) {
        break;
      }
      if (single != nullptr) {
        // A second lookup joins: the first one moves into `lookups` too.
        v1::MatchPrefixStreamRequest* first = out_.add_lookups();
        first->set_id(single->id());
        first->set_timeout_ms(single->timeout_ms());
        first->mutable_request()->Swap(single->mutable_request());
        out_.clear_id();
        out_.clear_timeout_ms();
        out_.clear_request();
        single = nullptr;
      }
      v1::MatchPrefixStreamRequest* next = out_.add_lookups();
      next->set_id(q.id);
      next->set_timeout_ms(timeout_ms(q.deadline));
      next->mutable_request()->Swap(&q.request);
    } else {
      single = &out_;
      out_.set_id(q.id);
      out_.set_timeout_ms(timeout_ms(q.deadline));
      out_.mutable_request()->Swap(&q.request);
    }
    blocks += b;
    it->second->sent = true;
    queued_.pop_front();
  }
  if (single == nullptr && out_.lookups_size() == 0) return false;
  writing_ = true;
  ++unanswered_;
  return true;
}

void LookupStream::OnWriteDone(bool ok) {
  bool next = false;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      // The stream is broken; the read fails too and OnDone reports why. Lookups still queued
      // were never sent (OnDone says so: the client retries them on a new stream).
      ended_ = true;
      queued_.clear();
    } else {
      next = CanWriteLocked() && TakeNextMessageLocked();
    }
  }
  if (next) StartWrite(&out_);
}

void LookupStream::OnReadInitialMetadataDone(bool ok) {
  if (!ok) return;  // the stream failed: OnDone says why
  const std::multimap<grpc::string_ref, grpc::string_ref>& metadata =
      ctx_.GetServerInitialMetadata();
  if (metadata.find(limits::kLookupBatchMetadataKey) == metadata.end()) return;  // older store
  absl::MutexLock lock(&mu_);
  batching_ = true;
}

void LookupStream::Deliver(v1::MatchPrefixStreamResponse& answer,
                           std::shared_ptr<Pending> pending) {
  // An answer nobody waits for (its caller's deadline passed) is dropped; a lease it carries
  // runs out by its TTL, as a late unary answer's does.
  if (pending == nullptr) return;
  Result& r = pending->result;
  r.term = answer.term();
  if (answer.code() == 0) {
    r.response.Swap(answer.mutable_response());
  } else {
    absl::Status status(static_cast<absl::StatusCode>(answer.code()), answer.message());
    if (answer.has_error_info())
      status = proto::WithErrorInfo(std::move(status), answer.error_info());
    r.status = std::move(status);
  }
  pending->done.Notify();
}

void LookupStream::OnReadDone(bool ok) {
  if (!ok) {
    absl::MutexLock lock(&mu_);
    ended_ = true;  // OnDone follows with the status
    return;
  }
  // One answer, or a batch's answers in `answers`; each handed to its caller by id.
  absl::InlinedVector<std::pair<v1::MatchPrefixStreamResponse*, std::shared_ptr<Pending>>, 8>
      answered;
  bool next = false;
  {
    absl::MutexLock lock(&mu_);
    if (unanswered_ > 0) --unanswered_;
    auto take = [this, &answered](v1::MatchPrefixStreamResponse* answer)
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                      std::shared_ptr<Pending> pending;
                      auto it = pending_.find(answer->id());
                      if (it != pending_.end()) {
                        pending = std::move(it->second);
                        pending_.erase(it);
                      }
                      answered.emplace_back(answer, std::move(pending));
                    };
    if (read_.answers_size() == 0) {
      take(&read_);
    } else {
      for (v1::MatchPrefixStreamResponse& answer : *read_.mutable_answers()) take(&answer);
    }
    // The slot this answer freed goes to the lookups that queued meanwhile, as one message.
    next = CanWriteLocked() && TakeNextMessageLocked();
  }
  // Started before handing over the answers, so the store has the next batch at once. Inside a
  // reaction the call cannot finish, so no hold is needed.
  if (next) StartWrite(&out_);
  for (auto& [answer, pending] : answered) Deliver(*answer, std::move(pending));
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
    // `sent` is read without mu_: nothing sets it any more once done_ is set above.
    if (!pending->sent) pending->result.not_sent = true;
    pending->done.Notify();
  }
  finished_.store(true, std::memory_order_release);  // last access: the owner may now free this
}

}  // namespace kvrelay::cachestore
