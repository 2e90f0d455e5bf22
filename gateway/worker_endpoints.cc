#include "gateway/worker_endpoints.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway {
namespace {

void SetDeadline(grpc::ClientContext& context, absl::Time deadline) {
  context.set_deadline(absl::ToChronoTime(deadline));
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
    // A watchdog cancels the stream when no chunk arrived for chunk_timeout: a stopped or
    // partitioned worker must fail this attempt long before the request's deadline.
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
    std::atomic<bool> stalled{false};
    absl::Time last_chunk = absl::Now();
    std::thread watchdog([&] {
      std::unique_lock<std::mutex> lock(mu);
      while (!finished) {
        const absl::Time limit = last_chunk + chunk_timeout;
        if (absl::Now() >= limit) {
          stalled.store(true);
          context.TryCancel();
          return;
        }
        cv.wait_for(lock, absl::ToChronoMilliseconds(
                              std::min(limit - absl::Now(), absl::Milliseconds(100))));
      }
    });
    kvrelay::v1::DecodeChunk chunk;
    bool sink_stopped = false;
    while (reader->Read(&chunk)) {
      {
        std::lock_guard<std::mutex> lock(mu);
        last_chunk = absl::Now();
      }
      if (!sink(chunk)) {
        sink_stopped = true;
        context.TryCancel();
        break;
      }
    }
    absl::Status status = proto::FromGrpcStatus(reader->Finish());
    {
      std::lock_guard<std::mutex> lock(mu);
      finished = true;
    }
    cv.notify_all();
    watchdog.join();
    if (sink_stopped) return absl::CancelledError("the caller went away");
    if (stalled.load()) {
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
