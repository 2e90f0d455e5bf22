#pragma once

// Test-only fakes of the worker endpoints at the gateway's own interface
// (gateway/worker_endpoints.h), for the unit tests of WorkerSet and GenerateCall. Each fake
// answers from settings the test makes and records what it was asked. Time passes only where a
// fake advances the SimulatedClock it shares with the code under test (a call that "takes"
// time, a worker that stalls until the step's deadline).
//
// The decode fake generates token 1000 + p for sequence position p (prompt included), so a
// request that failed over and continued on another worker streams the same ids as one that
// did not.
//
// One thread at a time (the code under test calls endpoints on its caller's thread).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "gateway/worker_endpoints.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway::testing {

// Advances `clock` to `deadline` (a call that never answered) and fails as gRPC would.
inline absl::Status StallUntil(SimulatedClock* clock, absl::Time deadline,
                               const std::string& what) {
  if (deadline > clock->Now()) clock->Set(deadline);
  return absl::DeadlineExceededError(absl::StrCat(what, " did not answer in time"));
}

// What both fakes answer to Promote, and record.
struct FakePromoter {
  absl::StatusOr<kvrelay::v1::PromoteResponse> AnswerPromote(
      const kvrelay::v1::PromoteRequest& request) {
    promotes.push_back(request);
    if (!promote_status.ok()) return promote_status;
    kvrelay::v1::PromoteResponse response;
    response.set_promoted(promoted);
    return response;
  }
  int32_t promoted = 0;         // what Promote answers
  absl::Status promote_status;  // what Promote fails with, if not OK
  std::vector<kvrelay::v1::PromoteRequest> promotes;
};

class FakePrefillEndpoint final : public PrefillEndpoint, public FakePromoter {
 public:
  FakePrefillEndpoint(std::string address, std::string node_id, SimulatedClock* clock)
      : address_(std::move(address)), node_id_(std::move(node_id)), clock_(clock) {}
  const std::string& address() const override { return address_; }

  absl::StatusOr<kvrelay::v1::PrefillResponse> Prefill(const kvrelay::v1::PrefillRequest& request,
                                                       absl::Time deadline) override {
    requests.push_back(request);
    if (on_prefill) return on_prefill(request, deadline);
    clock_->Advance(prefill_time);
    kvrelay::v1::PrefillResponse response;
    response.set_computed_tokens(request.tokens_size());
    response.set_pushed_tokens(request.tokens_size());
    response.set_pushed_bytes(int64_t{1024} * request.tokens_size());
    response.set_prefix_source("none");
    return response;
  }
  absl::StatusOr<kvrelay::v1::PrefillStatusResponse> Status(absl::Time /*deadline*/) override {
    ++status_calls;
    if (!status.ok()) return status;
    kvrelay::v1::PrefillStatusResponse response;
    response.set_node_id(node_id_);
    response.set_layout_fingerprint(layout_fingerprint);
    response.set_layout_description(layout_fingerprint.empty() ? "" : "fake " + layout_fingerprint);
    return response;
  }
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time /*deadline*/) override {
    return AnswerPromote(request);
  }

  // Settings.
  std::string layout_fingerprint;  // what Status reports (empty: says none)
  std::function<absl::StatusOr<kvrelay::v1::PrefillResponse>(const kvrelay::v1::PrefillRequest&,
                                                             absl::Time deadline)>
      on_prefill;                                        // replaces the default answer
  absl::Duration prefill_time = absl::Milliseconds(20);  // the default answer's duration
  absl::Status status;                                   // what Status() fails with, if not OK
  // Record.
  std::vector<kvrelay::v1::PrefillRequest> requests;
  int status_calls = 0;

 private:
  const std::string address_;
  const std::string node_id_;
  SimulatedClock* const clock_;
};

class FakeDecodeEndpoint final : public DecodeEndpoint, public FakePromoter {
 public:
  FakeDecodeEndpoint(std::string address, std::string node_id, SimulatedClock* clock)
      : address_(std::move(address)), node_id_(std::move(node_id)), clock_(clock) {}
  const std::string& address() const override { return address_; }

  absl::StatusOr<kvrelay::v1::ReserveResponse> Reserve(const kvrelay::v1::ReserveRequest& request,
                                                       absl::Time deadline) override {
    reserves.push_back(request);
    if (on_reserve) return on_reserve(request, deadline);
    kvrelay::v1::ReserveResponse response;
    response.set_node_id(node_id_);
    response.set_reservation_token(absl::StrCat("token-", request.request_id()));
    return response;
  }

  absl::Status Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                        absl::Duration chunk_timeout, const DecodeChunkSink& sink) override {
    generates.push_back(request);
    for (int32_t i = 0; i < request.max_tokens(); ++i) {
      if (i == fail_after_tokens) return fail_status;
      if (stall_after_tokens == i) {
        return StallUntil(clock_, std::min(deadline, clock_->Now() + chunk_timeout),
                          absl::StrCat("decode worker ", address_));
      }
      clock_->Advance(token_time);
      kvrelay::v1::DecodeChunk chunk;
      const int32_t token = 1000 + request.tokens_size() + i;
      chunk.add_tokens(token);
      const bool last = i + 1 == request.max_tokens() || token == request.eos_token();
      if (last && !drop_last_chunk) chunk.set_done(true);
      if (!sink(chunk)) return absl::CancelledError("the caller went away");
      if (last) break;
    }
    return absl::OkStatus();
  }

  void Release(const std::string& /*request_id*/, const std::string& reservation_token,
               absl::Time /*deadline*/) override {
    released.push_back(reservation_token);
  }
  absl::StatusOr<kvrelay::v1::DecodeStatusResponse> Status(absl::Time /*deadline*/) override {
    ++status_calls;
    kvrelay::v1::DecodeStatusResponse response;
    response.set_node_id(node_id_);
    response.set_layout_fingerprint(layout_fingerprint);
    response.set_layout_description(layout_fingerprint.empty() ? "" : "fake " + layout_fingerprint);
    return response;
  }
  absl::StatusOr<kvrelay::v1::PromoteResponse> Promote(const kvrelay::v1::PromoteRequest& request,
                                                       absl::Time /*deadline*/) override {
    return AnswerPromote(request);
  }

  // Settings.
  std::string layout_fingerprint;  // what Status reports (empty: says none)
  int status_calls = 0;
  std::function<absl::StatusOr<kvrelay::v1::ReserveResponse>(const kvrelay::v1::ReserveRequest&,
                                                             absl::Time deadline)>
      on_reserve;                                      // replaces the default answer
  absl::Duration token_time = absl::Milliseconds(10);  // per generated token
  int32_t fail_after_tokens = -1;                      // fails with fail_status after n tokens
  absl::Status fail_status;
  int32_t stall_after_tokens = -1;  // sends nothing more after n tokens (until chunk_timeout)
  bool drop_last_chunk = false;     // every token arrives, the closing `done` does not
  // Record.
  std::vector<kvrelay::v1::ReserveRequest> reserves;
  std::vector<kvrelay::v1::DecodeRequest> generates;
  std::vector<std::string> released;  // reservation tokens

 private:
  const std::string address_;
  const std::string node_id_;
  SimulatedClock* const clock_;
};

// A failure a worker attributes to itself (ErrorInfo role and node).
inline absl::Status WorkerFailure(absl::Status status, kvrelay::v1::Role role,
                                  const std::string& node_id) {
  return proto::Attribute(std::move(status), role, node_id, kvrelay::v1::FAILURE_UNREACHABLE);
}

}  // namespace kvrelay::gateway::testing
