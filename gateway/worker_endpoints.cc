#include "gateway/worker_endpoints.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway {
namespace {

void SetDeadline(grpc::ClientContext& context, absl::Time deadline) {
  context.set_deadline(absl::ToChronoTime(deadline));
}

// Cancels a stream's context when no chunk arrived for `timeout`: a stopped or partitioned
// worker must fail its attempt long before the request's deadline. Its thread runs from
// construction to Stop() (or destruction). Touch() and stalled() from the reading thread.
class StallWatchdog {
 public:
  StallWatchdog(grpc::ClientContext* context, absl::Duration timeout)
      : context_(context), timeout_(timeout), thread_([this] { Run(); }) {}
  ~StallWatchdog() { Stop(); }

  // A chunk arrived: the wait starts again.
  void Touch() {
    absl::MutexLock lock(&mu_);
    last_chunk_ = absl::Now();
  }
  // Ends the watch (idempotent); after it, stalled() is final.
  void Stop() {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }
  bool stalled() const { return stalled_.load(); }

 private:
  void Run() {
    absl::MutexLock lock(&mu_);
    while (!finished_) {
      const absl::Time limit = last_chunk_ + timeout_;
      if (absl::Now() >= limit) {
        stalled_.store(true);
        context_->TryCancel();
        return;
      }
      // Wakes early only when the stream finished.
      mu_.AwaitWithTimeout(absl::Condition(&finished_),
                           std::min(limit - absl::Now(), absl::Milliseconds(100)));
    }
  }

  grpc::ClientContext* const context_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time last_chunk_ ABSL_GUARDED_BY(mu_) = absl::Now();
  std::atomic<bool> stalled_{false};
  std::thread thread_;  // last: starts once the members it reads exist
};

// Promote on either worker's stub (both services serve it).
template <typename Stub>
absl::StatusOr<kvrelay::v1::PromoteResponse> CallPromote(Stub& stub,
                                                         const kvrelay::v1::PromoteRequest& request,
                                                         absl::Time deadline) {
  grpc::ClientContext context;
  SetDeadline(context, deadline);
  kvrelay::v1::PromoteResponse response;
  KV_RETURN_IF_ERROR(proto::FromGrpcStatus(stub.Promote(&context, request, &response)));
  return response;
}

class GrpcPrefillEndpoint final : public PrefillEndpoint {
 public:
  GrpcPrefillEndpoint(std::string address, std::shared_ptr<grpc::Channel> channel)
      : address_(std::move(address)), stub_(kvrelay::v1::Prefill::NewStub(channel)) {}
  const std::string& address() const override { return address_; }

  absl::StatusOr<kvrelay::v1::PrefillResponse> Prefill(const kvrelay::v1::PrefillRequest& request,
                                                       absl::Time deadline) override {
    grpc::ClientContext context;
    SetDeadline(context, deadline);
    kvrelay::v1::PrefillResponse response;
    KV_RETURN_IF_ERROR(proto::FromGrpcStatus(stub_->Prefill(&context, request, &response)));
    return response;
  }
  absl::StatusOr<kvrelay::v1::PrefillStatusResponse> Status(absl::Time deadline) override {
    grpc::ClientContext context;
    SetDeadline(context, deadline);
    kvrelay::v1::PrefillStatusResponse response;
    KV_RETURN_IF_ERROR(proto::FromGrpcStatus(
        stub_->Status(&context, kvrelay::v1::PrefillStatusRequest(), &response)));
    return response;
  }

  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline) override {
    return CallPromote(*stub_, request, deadline);
  }

 private:
  const std::string address_;
  std::unique_ptr<kvrelay::v1::Prefill::Stub> stub_;
};

class GrpcDecodeEndpoint final : public DecodeEndpoint {
 public:
  GrpcDecodeEndpoint(std::string address, std::shared_ptr<grpc::Channel> channel)
      : address_(std::move(address)), stub_(kvrelay::v1::Decode::NewStub(channel)) {}
  const std::string& address() const override { return address_; }

  absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(const kvrelay::v1::ReserveRequest& request,
                                                       absl::Time deadline) override {
    grpc::ClientContext context;
    SetDeadline(context, deadline);
    kvrelay::v1::ReserveResponse response;
    KV_RETURN_IF_ERROR(proto::FromGrpcStatus(stub_->Reserve(&context, request, &response)));
    return response;
  }

  absl::Status Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                        absl::Duration chunk_timeout, const DecodeChunkSink& sink) override {
    grpc::ClientContext context;
    SetDeadline(context, deadline);
    std::unique_ptr<grpc::ClientReader<kvrelay::v1::DecodeChunk>> reader =
        stub_->Generate(&context, request);
    StallWatchdog watchdog(&context, chunk_timeout);
    kvrelay::v1::DecodeChunk chunk;
    bool sink_stopped = false;
    while (reader->Read(&chunk)) {
      watchdog.Touch();
      if (!sink(chunk)) {
        sink_stopped = true;
        context.TryCancel();
        break;
      }
    }
    absl::Status status = proto::FromGrpcStatus(reader->Finish());
    watchdog.Stop();
    if (sink_stopped) return absl::CancelledError("the caller went away");
    if (watchdog.stalled()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "decode worker ", address_, " sent nothing for ", absl::FormatDuration(chunk_timeout)));
    }
    return status;
  }

  void Release(const std::string& request_id, const std::string& reservation_token,
               absl::Time deadline) override {
    grpc::ClientContext context;
    SetDeadline(context, deadline);
    kvrelay::v1::ReleaseRequest request;
    request.set_request_id(request_id);
    request.set_reservation_token(reservation_token);
    kvrelay::v1::ReleaseResponse ignored;
    (void)stub_->Release(&context, request, &ignored);
  }

  absl::StatusOr<kvrelay::v1::DecodeStatusResponse> Status(absl::Time deadline) override {
    grpc::ClientContext context;
    SetDeadline(context, deadline);
    kvrelay::v1::DecodeStatusResponse response;
    KV_RETURN_IF_ERROR(proto::FromGrpcStatus(
        stub_->Status(&context, kvrelay::v1::DecodeStatusRequest(), &response)));
    return response;
  }

  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline) override {
    return CallPromote(*stub_, request, deadline);
  }

 private:
  const std::string address_;
  std::unique_ptr<kvrelay::v1::Decode::Stub> stub_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillEndpoint>> MakeGrpcPrefillEndpoint(
    const std::string& address, const ::kvrelay::server::SecurityOptions& security) {
  KV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                      ::kvrelay::server::MakeChannel(address, security));
  return std::make_unique<GrpcPrefillEndpoint>(address, std::move(channel));
}

absl::StatusOr<std::unique_ptr<DecodeEndpoint>> MakeGrpcDecodeEndpoint(
    const std::string& address, const ::kvrelay::server::SecurityOptions& security) {
  KV_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                      ::kvrelay::server::MakeChannel(address, security));
  return std::make_unique<GrpcDecodeEndpoint>(address, std::move(channel));
}

}  // namespace kvrelay::gateway
