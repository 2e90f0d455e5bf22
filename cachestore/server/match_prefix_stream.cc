// MatchPrefixStream: MatchPrefix lookups on one long-lived bidirectional stream (issue 19).
//
// Why: a unary MatchPrefix pays gRPC's per-call cost on both sides (a new HTTP/2 stream, HPACK
// headers and trailers, a call object, a completion per call), several times the cost of the
// lookup itself; on a stream a lookup is one message each way, which is what Redis's pipelining
// buys it. What is checked stays exactly what MatchPrefix checks, in the same code
// (MatchPrefixCore): the caller's certificate role when the stream opens (a caller that may not
// match is refused at once), and per lookup the node scope (node_id must be the certificate's),
// the leadership before and after the work, every field and limit, and lease issuing.
//
// A stream ends (Finish) when: the client closes it (OK); this instance does not lead or
// stopped leading while a lookup ran (UNAVAILABLE with FAILURE_NOT_LEADER, the client reopens
// on the leader); the store drains (StopStreams cancels it); a write fails (the client is gone).
// Any other failure of one lookup is answered in that lookup's message and the stream goes on.
//
// Threading: exactly one operation (a read or a write) is outstanding at a time, and each
// reaction starts the next one, so reactions of one stream never run concurrently and the
// reactor needs no lock of its own. StopStreams only calls TryCancel (thread-safe at any time)
// under streams_mu_; OnDone removes the stream under the same lock before deleting it.

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cachestore/server/service.h"
#include "proto/grpc_status.h"

namespace kvrelay::cachestore::server {

namespace {
using ::kvrelay::proto::ToGrpcStatus;

grpc::Status ClientInvalid(const std::string& msg) {
  return ToGrpcStatus(proto::Attribute(absl::InvalidArgumentError(msg), v1::ROLE_CLIENT, "",
                                       v1::FAILURE_INVALID_REQUEST));
}

// Error messages of one lookup are cut to this many bytes (the proto documents the bound).
constexpr size_t kMaxErrorMessageBytes = 512;
}  // namespace

class CacheStoreService::MatchStream final
    : public grpc::ServerBidiReactor<v1::MatchPrefixStreamRequest, v1::MatchPrefixStreamResponse> {
 public:
  MatchStream(CacheStoreService* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    grpc::Status refused = Admit();
    if (!refused.ok()) {
      service_->errors_[kMatchStream]->Increment();
      Finish(refused);
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The client closed its side (or the call was cancelled): nothing more to answer.
      Finish(grpc::Status::OK);
      return;
    }
    if (service_->stopping_.load(std::memory_order_acquire)) {
      Finish(ToGrpcStatus(
          absl::UnavailableError("cache store is draining: lookup stream closed, reconnect")));
      return;
    }
    bool not_leader = false;
    grpc::Status status = Answer(&not_leader);
    if (not_leader) {
      // Nothing this instance says is the cluster's any more: end the stream, naming the leader
      // where known, so the client reopens there.
      Finish(status);
      return;
    }
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "lookup stream: the client is gone"));
      return;
    }
    StartRead(&request_);
  }

  // Ends the stream from outside its reactions (drain): its outstanding read fails.
  void Cancel() { ctx_->TryCancel(); }

  void OnDone() override {
    if (registered_) {
      absl::MutexLock lock(&service_->streams_mu_);
      service_->streams_.erase(this);
    }
    delete this;
  }

 private:
  // Refuses the stream when the store drains, too many are open, the caller's role may not
  // match, or this instance does not lead; registers it otherwise.
  grpc::Status Admit() {
    if (service_->authorizer_.enforcing()) {
      // The role now; the node id of each lookup when it comes (node-scoped like MatchPrefix).
      absl::StatusOr<kvrelay::server::Peer> peer = service_->authorizer_.Identify(*ctx_);
      if (!peer.ok()) return ToGrpcStatus(peer.status());
      if (auto s = service_->Authorize(ctx_, kMatchStream, peer->id); !s.ok()) return s;
    }
    int64_t term = 0;
    if (auto s = service_->CurrentTerm(&term); !s.ok()) return s;
    absl::MutexLock lock(&service_->streams_mu_);
    // Under the lock StopStreams cancels under: a stream admitted here is cancelled by it.
    if (service_->stopping_.load(std::memory_order_acquire)) {
      return ToGrpcStatus(absl::UnavailableError("cache store is draining: no new lookup streams"));
    }
    if (static_cast<int>(service_->streams_.size()) >= kMaxLookupStreams) {
      return ToGrpcStatus(proto::Attribute(
          absl::ResourceExhaustedError(absl::StrCat(
              "cache store: ", kMaxLookupStreams, " lookup streams open already; use MatchPrefix")),
          v1::ROLE_STORE, "", v1::FAILURE_OVERLOADED));
    }
    service_->streams_.insert(this);
    registered_ = true;
    return grpc::Status::OK;
  }

  // Fills response_ for request_. Returns the status that ends the stream when `*not_leader`.
  grpc::Status Answer(bool* not_leader) {
    response_.Clear();
    response_.set_id(request_.id());
    grpc::Status status;
    std::optional<int64_t> term;
    const absl::Time start = absl::Now();
    if (request_.timeout_ms() < 1 || request_.timeout_ms() > service_->limits_.max_ttl_ms) {
      status = ClientInvalid(absl::StrCat("timeout_ms: want 1-", service_->limits_.max_ttl_ms,
                                          ", got ", request_.timeout_ms()));
    } else if (ctx_->deadline() < std::chrono::system_clock::now()) {
      status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "lookup stream: the stream's own deadline passed");
    } else {
      status = service_->MatchPrefixCore(ctx_, kMatchStream, request_.request(),
                                         response_.mutable_response(), &term, not_leader);
    }
    service_->latency_[kMatchStream]->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    if (!status.ok()) service_->errors_[kMatchStream]->Increment();
    if (*not_leader) return status;
    if (term.has_value()) response_.set_term(*term);
    if (!status.ok()) {
      response_.clear_response();
      response_.set_code(static_cast<int32_t>(status.error_code()));
      std::string message = status.error_message();
      if (message.size() > kMaxErrorMessageBytes) message.resize(kMaxErrorMessageBytes);
      response_.set_message(std::move(message));
      std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(proto::FromGrpcStatus(status));
      if (info.has_value()) *response_.mutable_error_info() = *std::move(info);
    }
    return grpc::Status::OK;
  }

  CacheStoreService* const service_;
  grpc::CallbackServerContext* const ctx_;
  bool registered_ = false;
  v1::MatchPrefixStreamRequest request_;
  v1::MatchPrefixStreamResponse response_;
};

grpc::ServerBidiReactor<v1::MatchPrefixStreamRequest, v1::MatchPrefixStreamResponse>*
CacheStoreService::MatchPrefixStream(grpc::CallbackServerContext* ctx) {
  return new MatchStream(this, ctx);
}

void CacheStoreService::StopStreams() {
  stopping_.store(true, std::memory_order_release);
  // Idle lookup streams wait in a read: cancelling wakes them (the read fails, they finish),
  // so the drain does not wait for its timeout on streams that will never end by themselves.
  absl::MutexLock lock(&streams_mu_);
  for (MatchStream* stream : streams_) stream->Cancel();
}

}  // namespace kvrelay::cachestore::server
