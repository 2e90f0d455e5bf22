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
// Batches: a message may carry several lookups (`lookups`, from clients that saw
// kvrelay-lookup-batch in this stream's initial metadata); they are answered in order in one
// message, each answer with its own id and status, so one failing lookup never fails its
// neighbours. The per-message costs (a read and a write reaction, their wake-ups, a TCP segment
// each way) are then paid once per batch instead of once per lookup. A lookup whose own
// timeout_ms has passed when its turn comes is answered DEADLINE_EXCEEDED without being looked
// up (no lease for a caller that has gone). A not-leader answer ends the stream as for a single
// lookup; answers already computed in that batch are dropped (a lease they took runs out by its
// TTL, as a late answer's does).
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
#include "proto/limits.h"

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
    // Tells the client it may send `lookups` (sent with the first answer).
    ctx_->AddInitialMetadata(limits::kLookupBatchMetadataKey,
                             absl::StrCat(limits::kMaxLookupsPerStreamMessage));
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
    service_->stream_messages_->Increment();
    bool not_leader = false;
    grpc::Status status;
    response_.Clear();
    if (request_.lookups_size() == 0) {
      status = Answer(request_, absl::Now(), &response_, &not_leader);
    } else if (grpc::Status malformed = CheckBatch(); !malformed.ok()) {
      service_->errors_[kMatchStream]->Increment();
      Finish(malformed);
      return;
    } else {
      const absl::Time received = absl::Now();
      for (const v1::MatchPrefixStreamRequest& lookup : request_.lookups()) {
        status = Answer(lookup, received, response_.add_answers(), &not_leader);
        if (not_leader) break;
      }
    }
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

  // A message with `lookups` must carry nothing else and stay within the batch limits.
  grpc::Status CheckBatch() const {
    if (request_.id() != 0 || request_.has_request() || request_.timeout_ms() != 0) {
      return ClientInvalid(
          "lookup stream: a message with lookups must leave id, request and "
          "timeout_ms unset");
    }
    if (request_.lookups_size() > limits::kMaxLookupsPerStreamMessage) {
      return ClientInvalid(absl::StrCat("lookups: at most ", limits::kMaxLookupsPerStreamMessage,
                                        " per message, got ", request_.lookups_size()));
    }
    int64_t blocks = 0;
    for (const v1::MatchPrefixStreamRequest& lookup : request_.lookups()) {
      if (lookup.lookups_size() > 0) {
        return ClientInvalid(absl::StrCat("lookups: lookup ", lookup.id(), " has lookups itself"));
      }
      blocks += lookup.request().chain_size() +
                static_cast<int64_t>(lookup.request().chain_packed().size() / 16);
    }
    if (blocks > limits::kMaxBlocksPerStreamMessage) {
      return ClientInvalid(absl::StrCat("lookups: at most ", limits::kMaxBlocksPerStreamMessage,
                                        " chain blocks per message, got ", blocks));
    }
    return grpc::Status::OK;
  }

  // Fills `answer` for `lookup`, which arrived at `received`. Returns the status that ends the
  // stream when `*not_leader`.
  grpc::Status Answer(const v1::MatchPrefixStreamRequest& lookup, absl::Time received,
                      v1::MatchPrefixStreamResponse* answer, bool* not_leader) {
    answer->set_id(lookup.id());
    grpc::Status status;
    std::optional<int64_t> term;
    const absl::Time start = absl::Now();
    if (lookup.timeout_ms() < 1 || lookup.timeout_ms() > service_->limits_.max_ttl_ms) {
      status = ClientInvalid(absl::StrCat("timeout_ms: want 1-", service_->limits_.max_ttl_ms,
                                          ", got ", lookup.timeout_ms()));
    } else if (ctx_->deadline() < std::chrono::system_clock::now()) {
      status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "lookup stream: the stream's own deadline passed");
    } else if (start > received + absl::Milliseconds(lookup.timeout_ms())) {
      // Waited behind others of its batch past its own deadline: its caller has gone.
      status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "lookup stream: the lookup's timeout_ms passed before its turn");
    } else {
      status = service_->MatchPrefixCore(ctx_, kMatchStream, lookup.request(),
                                         answer->mutable_response(), &term, not_leader);
    }
    service_->latency_[kMatchStream]->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    if (!status.ok()) service_->errors_[kMatchStream]->Increment();
    if (*not_leader) return status;
    if (term.has_value()) answer->set_term(*term);
    if (!status.ok()) {
      answer->clear_response();
      answer->set_code(static_cast<int32_t>(status.error_code()));
      std::string message = status.error_message();
      if (message.size() > kMaxErrorMessageBytes) message.resize(kMaxErrorMessageBytes);
      answer->set_message(std::move(message));
      std::optional<v1::ErrorInfo> info = proto::GetErrorInfo(proto::FromGrpcStatus(status));
      if (info.has_value()) *answer->mutable_error_info() = *std::move(info);
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
