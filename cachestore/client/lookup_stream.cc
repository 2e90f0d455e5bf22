#include "cachestore/client/lookup_stream.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore {

namespace {
void* AsTag(intptr_t tag) { return reinterpret_cast<void*>(tag); }

gpr_timespec ToGprTime(absl::Time t) {
  if (t == absl::InfiniteFuture()) return gpr_inf_future(GPR_CLOCK_REALTIME);
  const timespec ts = absl::ToTimespec(t);
  gpr_timespec out;
  out.tv_sec = ts.tv_sec;
  out.tv_nsec = static_cast<int32_t>(ts.tv_nsec);
  out.clock_type = GPR_CLOCK_REALTIME;
  return out;
}
}  // namespace

std::shared_ptr<LookupStream> LookupStream::Open(v1::CacheStore::Stub* stub) {
  std::shared_ptr<LookupStream> stream(new LookupStream());
  absl::MutexLock lock(&stream->mu_);
  stream->rw_ = stub->PrepareAsyncMatchPrefixStream(&stream->ctx_, &stream->cq_);
  // StartCall sends the headers on the write side: lookups queue until its tag is back.
  stream->rw_->StartCall(AsTag(kStarted));
  stream->writing_ = true;
  // The one read that stays outstanding for the stream's life (re-armed after each answer).
  stream->rw_->Read(&stream->read_, AsTag(kRead));
  stream->outstanding_ = 2;
  return stream;
}

LookupStream::~LookupStream() {
  if (finished_.load(std::memory_order_acquire)) return;
  // Nobody else holds the stream: end the call and drain its queue here (a cancelled call's
  // operations all complete locally, at once).
  ctx_.TryCancel();
  WaitDone(absl::InfiniteDuration());
}

bool LookupStream::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_ || cancelled_;
}

void LookupStream::Cancel() {
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  ctx_.TryCancel();
}

bool LookupStream::finished() {
  if (finished_.load(std::memory_order_acquire)) return true;
  absl::MutexLock lock(&mu_);
  if (!driving_) {
    PollNow();
    HandOff();
  }
  return finished_.load(std::memory_order_acquire);
}

bool LookupStream::WaitDone(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (!finished_.load(std::memory_order_acquire)) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    if (!driving_) {
      driving_ = true;
      DriveOnce(std::min(deadline, now + absl::Milliseconds(10)));
      driving_ = false;
      HandOff();
    } else {
      // A lookup drives: look again shortly (its driver takes the events in).
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](bool* driving) { return !*driving; }, &driving_),
                           std::min(deadline - now, absl::Milliseconds(10)));
    }
  }
  return true;
}

void LookupStream::StartWrite(const v1::MatchPrefixStreamRequest& request) {
  writing_ = true;
  ++outstanding_;
  rw_->Write(request, AsTag(kWritten));
}

void LookupStream::DriveOnce(absl::Time until) {
  void* tag = nullptr;
  bool ok = false;
  mu_.Unlock();
  const grpc::CompletionQueue::NextStatus status = cq_.AsyncNext(&tag, &ok, ToGprTime(until));
  mu_.Lock();
  if (status == grpc::CompletionQueue::GOT_EVENT) {
    Handle(static_cast<Tag>(reinterpret_cast<intptr_t>(tag)), ok);
  } else if (status == grpc::CompletionQueue::SHUTDOWN) {
    finished_.store(true, std::memory_order_release);
  }
}

void LookupStream::PollNow() {
  driving_ = true;
  // Each AsyncNext with a past deadline polls once and returns an event that is there.
  while (!finished_.load(std::memory_order_acquire)) {
    void* tag = nullptr;
    bool ok = false;
    mu_.Unlock();
    const grpc::CompletionQueue::NextStatus status =
        cq_.AsyncNext(&tag, &ok, gpr_inf_past(GPR_CLOCK_MONOTONIC));
    mu_.Lock();
    if (status == grpc::CompletionQueue::TIMEOUT) break;
    if (status == grpc::CompletionQueue::SHUTDOWN) {
      finished_.store(true, std::memory_order_release);
      break;
    }
    Handle(static_cast<Tag>(reinterpret_cast<intptr_t>(tag)), ok);
  }
  driving_ = false;
}

void LookupStream::HandOff() {
  if (driving_) return;
  for (auto& [id, pending] : pending_) {
    if (!pending->done) {
      pending->answered.Signal();
      return;
    }
  }
}

void LookupStream::Handle(Tag tag, bool ok) {
  --outstanding_;
  switch (tag) {
    case kStarted:  // a call that could not start fails its read too, which ends the stream
    case kWritten:
      writing_ = false;
      if (!ok) {
        // The stream is broken; the read fails too and Finish reports why.
        ended_ = true;
        writes_.clear();
      } else if (!writes_.empty()) {
        StartWrite(writes_.front());
        writes_.pop_front();
      }
      break;
    case kRead:
      if (!ok) {
        ended_ = true;
        writes_.clear();
        ++outstanding_;
        rw_->Finish(&finish_status_, AsTag(kFinished));
        break;
      }
      // An answer nobody waits for (its caller's deadline passed) is dropped; a lease it
      // carries runs out by its TTL, as a late unary answer's does.
      if (auto it = pending_.find(read_.id()); it != pending_.end()) {
        Pending* pending = it->second;
        pending_.erase(it);
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
        pending->done = true;
        pending->answered.Signal();
      }
      read_.Clear();
      ++outstanding_;
      rw_->Read(&read_, AsTag(kRead));
      break;
    case kFinished: {
      absl::Status status = proto::FromGrpcStatus(finish_status_);
      ended_ = true;
      if (status.ok()) {
        status = absl::UnavailableError("lookup stream: the store closed it");
      } else if (absl::IsCancelled(status) && !cancelled_) {
        // Cancelled by the store (it drains): another instance or a new stream will answer.
        status = absl::UnavailableError(
            absl::StrCat("lookup stream: cancelled by the store (", status.message(), ")"));
      }
      done_ = true;
      end_status_ = status;
      for (auto& [id, pending] : pending_) {
        pending->result.status = status;
        pending->result.stream_ended = true;
        pending->done = true;
        pending->answered.Signal();
      }
      pending_.clear();
      break;
    }
  }
  if (done_ && outstanding_ == 0 && !shut_down_) {
    // Every tag is back: the queue may be shut down; its SHUTDOWN says the call is over.
    shut_down_ = true;
    cq_.Shutdown();
  }
}

LookupStream::Result LookupStream::Lookup(const v1::MatchPrefixRequest& request,
                                          absl::Time deadline) {
  auto refused = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Result r;
    r.not_sent = true;
    r.stream_ended = true;
    r.status = end_status_;
    return r;
  };
  absl::MutexLock lock(&mu_);
  if (done_) return refused();
  if (!ended_ && static_cast<int>(pending_.size()) >= kMaxInFlight) {
    Result r;
    r.not_sent = true;
    r.status = absl::ResourceExhaustedError(
        absl::StrCat("lookup stream: ", kMaxInFlight, " lookups waiting already"));
    return r;
  }
  const absl::Time now = absl::Now();
  if (pending_.empty() && !driving_ && !ended_ && now - last_driven_ > kIdleBeforePoll) {
    // Idle for a while, so nobody took in what the store did meanwhile (closed the stream,
    // died, drained): do that before writing to it.
    PollNow();
    if (done_) return refused();
  }
  Pending me;
  const uint64_t id = next_id_++;
  pending_[id] = &me;
  if (ended_) {
    // Ending and Finish has not said why yet: nothing is sent, the lookup waits for the
    // stream's status as the ones the stream carried do.
    me.result.not_sent = true;
  } else {
    // Whole milliseconds left, at least 1 (the store refuses 0); the wait below is exact.
    const absl::Duration left = deadline - now;
    const int64_t timeout_ms = std::clamp<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1, 600000);
    if (!writing_) {
      // Written at once: the message borrows the caller's request instead of copying it
      // (Write serializes before it returns).
      v1::MatchPrefixStreamRequest out;
      out.set_id(id);
      out.set_timeout_ms(timeout_ms);
      out.unsafe_arena_set_allocated_request(const_cast<v1::MatchPrefixRequest*>(&request));
      StartWrite(out);
      out.unsafe_arena_release_request();
    } else {
      v1::MatchPrefixStreamRequest& out = writes_.emplace_back();
      out.set_id(id);
      out.set_timeout_ms(timeout_ms);
      *out.mutable_request() = request;
    }
  }
  while (!me.done) {
    if (absl::Now() >= deadline) {
      pending_.erase(id);
      HandOff();
      Result late;
      late.status = absl::DeadlineExceededError(
          "MatchPrefix: no answer on the lookup stream before the deadline");
      return late;
    }
    if (!driving_) {
      driving_ = true;
      DriveOnce(deadline);
      driving_ = false;
    } else {
      me.answered.WaitWithDeadline(&mu_, deadline);
    }
  }
  last_driven_ = absl::Now();
  HandOff();
  return std::move(me.result);
}

}  // namespace kvrelay::cachestore
