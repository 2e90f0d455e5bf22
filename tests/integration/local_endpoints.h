#pragma once

// The gateway's endpoint interfaces implemented by calling the real PrefillWorker and
// DecodeWorker in this process (no gRPC), for one-process serving tests. Kill() makes a worker
// behave like a dead process (every call fails Unavailable with no ErrorInfo, as a refused
// connection does); Revive() brings it back.

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "decode/decode_worker.h"
#include "gateway/worker_endpoints.h"
#include "prefill/prefill_worker.h"

namespace kvrelay::testing {

class LocalPrefillEndpoint final : public gateway::PrefillEndpoint {
 public:
  explicit LocalPrefillEndpoint(prefill::PrefillWorker* worker)
      : worker_(worker), address_("local-prefill:" + worker->node_id()) {}
  const std::string& address() const override { return address_; }
  void Kill() { dead_.store(true); }
  void Revive() { dead_.store(false); }
  // Runs before every Prefill (the request's decode reservation is held then). Set it before
  // any request runs.
  void SetBeforePrefill(std::function<void()> hook) { before_prefill_ = std::move(hook); }

  absl::StatusOr<kvrelay::v1::PrefillResponse> Prefill(const kvrelay::v1::PrefillRequest& request,
                                                       absl::Time deadline) override {
    if (dead_.load()) return absl::UnavailableError("connection refused");
    if (before_prefill_) before_prefill_();
    return worker_->Run(request, deadline);
  }
  absl::StatusOr<kvrelay::v1::PrefillStatusResponse> Status(absl::Time) override {
    if (dead_.load()) return absl::UnavailableError("connection refused");
    return worker_->Describe();
  }
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline) override {
    if (dead_.load()) return absl::UnavailableError("connection refused");
    return worker_->Promote(request, deadline);
  }

 private:
  prefill::PrefillWorker* const worker_;
  const std::string address_;
  std::atomic<bool> dead_{false};
  std::function<void()> before_prefill_;
};

class LocalDecodeEndpoint final : public gateway::DecodeEndpoint {
 public:
  explicit LocalDecodeEndpoint(decode::DecodeWorker* worker)
      : worker_(worker), address_("local-decode:" + worker->node_id()) {}
  const std::string& address() const override { return address_; }
  void Kill() { dead_.store(true); }
  void Revive() { dead_.store(false); }
  // After `tokens` streamed tokens the stream breaks as if the process died mid-request — if
  // `deaths` (shared by several endpoints) still allows one more death.
  void DieAfterTokens(int tokens, std::shared_ptr<std::atomic<int>> deaths) {
    deaths_ = std::move(deaths);
    die_after_tokens_.store(tokens);
  }

  absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(const kvrelay::v1::ReserveRequest& request,
                                                       absl::Time deadline) override {
    if (dead_.load()) return absl::UnavailableError("connection refused");
    return worker_->Reserve(request, deadline);
  }
  absl::Status Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                        absl::Duration, const gateway::DecodeChunkSink& sink) override {
    if (dead_.load()) return absl::UnavailableError("connection refused");
    int streamed = 0;
    bool broke = false;
    absl::Status s = worker_->Generate(
        request, deadline,
        [&](const kvrelay::v1::DecodeChunk& chunk) {
          const int limit = die_after_tokens_.load();
          if (limit >= 0 && streamed + chunk.tokens_size() > limit && deaths_ != nullptr &&
              deaths_->fetch_sub(1) > 0) {
            kvrelay::v1::DecodeChunk partial;
            for (int i = 0; i < limit - streamed; ++i) partial.add_tokens(chunk.tokens(i));
            if (partial.tokens_size() > 0) sink(partial);
            broke = true;
            dead_.store(true);
            return false;
          }
          streamed += chunk.tokens_size();
          return sink(chunk);
        },
        [] { return false; });
    if (broke) return absl::UnavailableError("Socket closed");
    return s;
  }
  void Release(const std::string& request_id, const std::string& reservation_token,
               absl::Time) override {
    if (!dead_.load()) (void)worker_->Release(request_id, reservation_token);
  }
  absl::StatusOr<kvrelay::v1::DecodeStatusResponse> Status(absl::Time) override {
    if (dead_.load()) return absl::UnavailableError("connection refused");
    return worker_->Describe();
  }
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time deadline) override {
    if (dead_.load()) return absl::UnavailableError("connection refused");
    return worker_->Promote(request, deadline);
  }

 private:
  decode::DecodeWorker* const worker_;
  const std::string address_;
  std::atomic<bool> dead_{false};
  std::atomic<int> die_after_tokens_{-1};
  std::shared_ptr<std::atomic<int>> deaths_;
};

}  // namespace kvrelay::testing
