#include "gateway/generate_call.h"

#include <memory>
#include <string>
#include <vector>

#include "gateway/fake_endpoints.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "proto/grpc_status.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::gateway {
namespace {

using ::kvrelay::gateway::testing::FakeDecodeEndpoint;
using ::kvrelay::gateway::testing::FakePrefillEndpoint;
using ::kvrelay::gateway::testing::StallUntil;
using ::kvrelay::gateway::testing::WorkerFailure;
using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;
using State = CircuitBreaker::State;

constexpr int32_t kPromptTokens = 40;
constexpr int32_t kMaxTokens = 8;

// Token ids the decode fake generates for this prompt: 1000 + position.
std::vector<int32_t> Expected(int32_t n) {
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < n; ++i) tokens.push_back(1000 + kPromptTokens + i);
  return tokens;
}

// One GenerateCall at a time over fake workers; every clock is one SimulatedClock.
class GenerateCallTest : public ::testing::Test {
 protected:
  GenerateCallTest()
      : config_(*kv::LoadPreset("llama3-8b")),
        metrics_(&registry_, "m"),
        tenant_reservations_("tenant", "tokens of decode KV reserved", "--t", 1 << 20, nullptr),
        client_reservations_("client", "tokens of decode KV reserved", "--c", 1 << 20, nullptr),
        workers_(WorkerSetOptions{.breaker = {.open_for = absl::Seconds(1)},
                                  .block_tokens = config_.layout.block_tokens()},
                 &clock_, /*store=*/nullptr, {}) {
    for (int32_t i = 0; i < kPromptTokens; ++i) request_.add_tokens(i + 1);
    request_.set_max_tokens(kMaxTokens);
    request_.set_tenant("acme");
  }

  FakePrefillEndpoint* AddPrefill(const std::string& name) {
    auto endpoint = std::make_unique<FakePrefillEndpoint>(name + ":1", name, &clock_);
    FakePrefillEndpoint* raw = endpoint.get();
    workers_.AddFixed(std::move(endpoint));
    return raw;
  }
  FakeDecodeEndpoint* AddDecode(const std::string& name) {
    auto endpoint = std::make_unique<FakeDecodeEndpoint>(name + ":1", name, &clock_);
    FakeDecodeEndpoint* raw = endpoint.get();
    workers_.AddFixed(std::move(endpoint));
    return raw;
  }
  WorkerSet::Node* DecodeNode(size_t i) { return workers_.Nodes().decode[i].get(); }
  WorkerSet::Node* PrefillNode(size_t i) { return workers_.Nodes().prefill[i].get(); }

  // Runs the request with `timeout` left; the tokens and summary land in streamed_/summary_.
  absl::Status Run(absl::Duration timeout = absl::Seconds(60)) { return MakeCall(timeout)->Run(); }
  std::unique_ptr<GenerateCall> MakeCall(absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time start = clock_.Now();
    return std::make_unique<GenerateCall>(
        options_,
        GenerateCallDeps{.workers = &workers_,
                         .metrics = &metrics_,
                         .tenant_reservations = &tenant_reservations_,
                         .client_reservations = &client_reservations_,
                         .layout = &config_.layout,
                         .clock = &clock_},
        GenerateCallRequest{.request = &request_,
                            .tenant_salt = "salt",
                            .client = "client-1",
                            .request_id_prefix = "gw-test",
                            .start = start,
                            .deadline = start + timeout},
        sink_, cancelled_);
  }
  double CounterValue(const std::string& name, MetricLabels labels) {
    labels["model_name"] = "m";
    return registry_.GetCounter(name, "", labels)->value();
  }

  SimulatedClock clock_;
  kv::ModelConfig config_;
  MetricsRegistry registry_;
  GatewayMetrics metrics_;
  QuotaTable tenant_reservations_;
  QuotaTable client_reservations_;
  WorkerSet workers_;
  GenerateCallOptions options_{.model_name = "m", .max_attempts = 3};
  kvrelay::v1::GenerateRequest request_;
  std::vector<int32_t> streamed_;
  kvrelay::v1::GenerateSummary summary_;
  bool summary_seen_ = false;
  int32_t stop_after_tokens_ = -1;  // the sink says "enough" once it has this many
  GenerateSink sink_ = [this](const kvrelay::v1::GenerateResponse& r) {
    if (r.has_summary()) {
      summary_ = r.summary();
      summary_seen_ = true;
    }
    streamed_.insert(streamed_.end(), r.tokens().begin(), r.tokens().end());
    return stop_after_tokens_ < 0 || static_cast<int32_t>(streamed_.size()) < stop_after_tokens_;
  };
  std::function<bool()> cancelled_ = [] { return false; };
  FakeDecodeEndpoint* first_asked_ = nullptr;  // AFullWorkerIsNotAskedTwice...
};

TEST_F(GenerateCallTest, ACanaryMeasuresThePushIntoItsDecodeNodeAndReleasesItsReservation) {
  FakePrefillEndpoint* p = AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  request_.clear_tokens();
  for (int32_t i = 0; i < 80; ++i) request_.add_tokens(i + 1);  // 80 KiB pushed by the fake
  request_.set_max_tokens(1);
  p->prefill_time = absl::Milliseconds(500);
  KV_ASSERT_OK(MakeCall()->Canary(PrefillNode(0), DecodeNode(0)));

  ASSERT_EQ(d->reserves.size(), 1u);
  ASSERT_EQ(p->requests.size(), 1u);
  EXPECT_TRUE(p->requests[0].skip_store_lookup()) << "a synthetic prompt is not kept for reuse";
  EXPECT_EQ(p->requests[0].target().reservation_token(), "token-gw-test-1");
  EXPECT_TRUE(d->generates.empty());
  EXPECT_EQ(d->released, std::vector<std::string>{"token-gw-test-1"});
  EXPECT_TRUE(streamed_.empty());
  EXPECT_FALSE(summary_seen_);
  // The push is measured as a request's: the Prefill call's time over the MiB it pushed.
  const std::optional<double> learned = DecodeNode(0)->transfer_seconds_per_mib.Last();
  ASSERT_TRUE(learned.has_value());
  EXPECT_NEAR(*learned, 0.5 / (80.0 * 1024 / (1 << 20)), 1e-6);
  EXPECT_EQ(DecodeNode(0)->breaker.state(), State::kClosed);
  EXPECT_EQ(DecodeNode(0)->picked.load(), 0);

  // A canary that fails counts against no one.
  p->on_prefill = [](const kvrelay::v1::PrefillRequest&, absl::Time) {
    return absl::StatusOr<kvrelay::v1::PrefillResponse>(absl::UnavailableError("down"));
  };
  EXPECT_THAT(MakeCall()->Canary(PrefillNode(0), DecodeNode(0)),
              StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(d->released.size(), 2u);
  EXPECT_EQ(PrefillNode(0)->breaker.state(), State::kClosed);
}

TEST_F(GenerateCallTest, ReservesPrefillsAndStreamsThenSendsTheSummary) {
  FakePrefillEndpoint* p = AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  ASSERT_TRUE(summary_seen_);
  EXPECT_EQ(summary_.attempts(), 1);
  EXPECT_EQ(summary_.prompt_tokens(), kPromptTokens);
  EXPECT_EQ(summary_.generated_tokens(), kMaxTokens);
  EXPECT_EQ(summary_.prefill_worker(), "p0:1");
  EXPECT_EQ(summary_.decode_worker(), "d0:1");
  EXPECT_EQ(summary_.transferred_bytes(), 1024 * kPromptTokens);
  EXPECT_GT(summary_.ttft_ms(), 0);

  // Reserve books prompt + max_tokens with the prompt's two full blocks (16 tokens each).
  ASSERT_EQ(d->reserves.size(), 1u);
  EXPECT_EQ(d->reserves[0].request_id(), "gw-test-1");
  EXPECT_EQ(d->reserves[0].prompt_tokens(), kPromptTokens);
  EXPECT_EQ(d->reserves[0].max_tokens(), kMaxTokens);
  EXPECT_EQ(d->reserves[0].chain_packed().size(), 2u * 16);
  // The prefill goes to the reservation; the stream claims it with its token.
  ASSERT_EQ(p->requests.size(), 1u);
  EXPECT_EQ(p->requests[0].target().reservation_token(), "token-gw-test-1");
  EXPECT_EQ(p->requests[0].tenant_salt(), "salt");
  ASSERT_EQ(d->generates.size(), 1u);
  EXPECT_EQ(d->generates[0].reservation_token(), "token-gw-test-1");
  EXPECT_EQ(d->generates[0].pushed_tokens(), kPromptTokens);
  EXPECT_EQ(DecodeNode(0)->in_flight.load(), 0);
  EXPECT_EQ(CounterValue("kvrelay:request_success_total", {{"finished_reason", "length"}}), 1);
}

TEST_F(GenerateCallTest, ReservedTokensCountUntilTheStreamStarts) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  int64_t held_at_reserve = -1;
  d->on_reserve = [&](const kvrelay::v1::ReserveRequest& r, absl::Time) {
    held_at_reserve = tenant_reservations_.Held("acme");
    kvrelay::v1::ReserveResponse response;
    response.set_reservation_token("t-" + r.request_id());
    return response;
  };
  KV_ASSERT_OK(Run());
  EXPECT_EQ(held_at_reserve, kPromptTokens + kMaxTokens);
  EXPECT_EQ(tenant_reservations_.Held("acme"), 0);
  EXPECT_EQ(client_reservations_.Held("client-1"), 0);
}

TEST_F(GenerateCallTest, DecodeFailureMidStreamFailsOverAndContinuesFromTheStreamedTokens) {
  AddPrefill("p0");
  AddPrefill("p1");
  FakeDecodeEndpoint* d0 = AddDecode("d0");
  FakeDecodeEndpoint* d1 = AddDecode("d1");
  d0->fail_after_tokens = 3;
  d0->fail_status =
      WorkerFailure(absl::UnavailableError("d0 lost its device"), kvrelay::v1::ROLE_DECODE, "d0");
  const absl::Duration timeout = absl::Seconds(10);
  const absl::Time deadline = clock_.Now() + timeout;
  KV_ASSERT_OK(Run(timeout));
  EXPECT_LT(clock_.Now(), deadline);
  // Every token once, in order, although two workers made them.
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  EXPECT_EQ(summary_.attempts(), 2);
  EXPECT_EQ(summary_.decode_worker(), "d1:1");
  // The second attempt carries the streamed tokens as prompt and asks for the rest.
  ASSERT_EQ(d1->generates.size(), 1u);
  EXPECT_EQ(d1->generates[0].tokens_size(), kPromptTokens + 3);
  EXPECT_EQ(d1->generates[0].max_tokens(), kMaxTokens - 3);
  EXPECT_EQ(d1->reserves[0].request_id(), "gw-test-2");
  EXPECT_EQ(DecodeNode(0)->breaker.state(), State::kOpen);
  EXPECT_EQ(DecodeNode(1)->breaker.state(), State::kClosed);
  EXPECT_EQ(CounterValue("kvrelay:gateway_failovers_total", {}), 1);
  EXPECT_EQ(CounterValue("kvrelay:gateway_worker_failures_total",
                         {{"role", "decode"}, {"reason", "FAILURE_UNREACHABLE"}}),
            1);
}

TEST_F(GenerateCallTest, AStalledDecodeWorkerIsBlamedAfterTheChunkTimeout) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d0 = AddDecode("d0");
  AddDecode("d1");
  d0->stall_after_tokens = 2;
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  EXPECT_EQ(summary_.decode_worker(), "d1:1");
  EXPECT_EQ(DecodeNode(0)->breaker.state(), State::kOpen);
}

TEST_F(GenerateCallTest, PrefillFailureWithoutDetailBlamesThePrefillNodeAndReleasesTheSlot) {
  FakePrefillEndpoint* p0 = AddPrefill("p0");
  AddPrefill("p1");
  FakeDecodeEndpoint* d = AddDecode("d0");
  p0->on_prefill = [](const kvrelay::v1::PrefillRequest&, absl::Time) {
    return absl::UnavailableError("connection refused");  // no ErrorInfo: not kvrelay code
  };
  // Both prefill nodes are equally loaded: make the first pick p0.
  PrefillNode(1)->in_flight = 1;
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  EXPECT_EQ(summary_.prefill_worker(), "p1:1");
  EXPECT_EQ(summary_.attempts(), 2);
  EXPECT_EQ(PrefillNode(0)->breaker.state(), State::kOpen);
  EXPECT_EQ(DecodeNode(0)->breaker.state(), State::kClosed);
  // The first attempt's reservation was given back.
  EXPECT_EQ(d->released, std::vector<std::string>{"token-gw-test-1"});
}

TEST_F(GenerateCallTest, CorruptedPushIsRecomputedByTheDecodeWorkerWithoutFailover) {
  FakePrefillEndpoint* p = AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  p->on_prefill = [](const kvrelay::v1::PrefillRequest&, absl::Time) {
    return proto::Attribute(absl::DataLossError("checksum mismatch"), kvrelay::v1::ROLE_DECODE,
                            "d0", kvrelay::v1::FAILURE_CORRUPT);
  };
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  EXPECT_EQ(summary_.attempts(), 1);
  ASSERT_EQ(d->generates.size(), 1u);
  EXPECT_EQ(d->generates[0].pushed_tokens(), 0);  // nothing usable arrived
  EXPECT_EQ(CounterValue("kvrelay:gateway_worker_failures_total",
                         {{"role", "decode"}, {"reason", "FAILURE_CORRUPT"}}),
            1);
}

TEST_F(GenerateCallTest, GivesUpWhenTheDeadlineIsSpentWithoutBlamingTheLastWorker) {
  AddPrefill("p0");
  std::vector<FakeDecodeEndpoint*> decodes = {AddDecode("d0"), AddDecode("d1"), AddDecode("d2")};
  for (FakeDecodeEndpoint* d : decodes) {
    // Reserve never answers: each attempt waits out its reserve timeout (2 s).
    d->on_reserve = [this, d](const kvrelay::v1::ReserveRequest&, absl::Time deadline) {
      return StallUntil(&clock_, deadline, "reserve on " + d->address());
    };
  }
  options_.max_attempts = 10;
  const absl::Time start = clock_.Now();
  const absl::Status s = Run(absl::Seconds(5));
  // Two attempts fail at 2 s and 4 s; the third stops at the request's own deadline.
  EXPECT_EQ(clock_.Now(), start + absl::Seconds(5));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("reserve on d2:1"));
  EXPECT_EQ(DecodeNode(0)->breaker.failures(), 1);
  EXPECT_EQ(DecodeNode(1)->breaker.failures(), 1);
  // The caller's deadline is never a worker's fault.
  EXPECT_EQ(DecodeNode(2)->breaker.failures(), 0);
  EXPECT_EQ(DecodeNode(2)->breaker.state(), State::kClosed);
  EXPECT_TRUE(streamed_.empty());
  EXPECT_FALSE(summary_seen_);
}

TEST_F(GenerateCallTest, GivesUpNamingTheRoleWhenEveryWorkerFailed) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  d->on_reserve = [](const kvrelay::v1::ReserveRequest&, absl::Time) {
    return WorkerFailure(absl::InternalError("out of memory"), kvrelay::v1::ROLE_DECODE, "d0");
  };
  const absl::Status s = Run();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("no healthy decode worker (1 known, 1 failed for this request)"));
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_GATEWAY);
  EXPECT_EQ(d->reserves.size(), 1u);
  EXPECT_EQ(CounterValue("kvrelay:gateway_failures_total", {{"reason", "UNAVAILABLE"}}), 1);
}

TEST_F(GenerateCallTest, RunsOutOfAttempts) {
  for (const char* name : {"p0", "p1", "p2"}) {
    AddPrefill(name)->on_prefill = [](const kvrelay::v1::PrefillRequest&, absl::Time) {
      return WorkerFailure(absl::InternalError("model crashed"), kvrelay::v1::ROLE_PREFILL, "");
    };
  }
  AddDecode("d0");
  options_.max_attempts = 2;
  const absl::Status s = Run();
  EXPECT_TRUE(absl::IsInternal(s)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("model crashed"));
  EXPECT_EQ(CounterValue("kvrelay:gateway_worker_failures_total",
                         {{"role", "prefill"}, {"reason", "FAILURE_UNREACHABLE"}}),
            2);
}

TEST_F(GenerateCallTest, EveryDecodeWorkerFullIsResourceExhaustedAndNoFailure) {
  AddPrefill("p0");
  for (const char* name : {"d0", "d1"}) {
    AddDecode(name)->on_reserve = [name](const kvrelay::v1::ReserveRequest&, absl::Time) {
      return proto::Overloaded("no free slots", kvrelay::v1::ROLE_DECODE, name, "kv_blocks", 0);
    };
  }
  const absl::Status s = Run();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("every decode worker is at capacity (2 refused this request, full: "
                        "kv_blocks)"));
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_GATEWAY);
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_OVERLOADED);
  EXPECT_EQ(info->exhausted(), "kv_blocks");
  EXPECT_GT(info->retry_after_ms(), 0u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(DecodeNode(i)->breaker.state(), State::kClosed);
    EXPECT_TRUE(DecodeNode(i)->breaker.Healthy());  // overload is not sickness
    EXPECT_TRUE(DecodeNode(i)->breaker.Busy());     // passed over for a moment
    EXPECT_EQ(DecodeNode(i)->breaker.failures(), 0);
  }
  EXPECT_EQ(CounterValue("kvrelay:gateway_breaker_opens_total", {{"role", "decode"}}), 0);
  EXPECT_EQ(
      CounterValue("kvrelay:gateway_shed_total", {{"tier", "decode"}, {"reason", "kv_blocks"}}), 1);
}

// The smallest reproduction of issue 34 at the gateway: one decode worker refused one request
// for capacity; the requests that come meanwhile are refused for capacity too, at once and
// without asking it (never "no healthy decode worker"), and it serves again after busy_for.
TEST_F(GenerateCallTest, ABusyOnlyWorkerIsRefusedAtOnceNotUnavailableAndServesAfterBusyFor) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  bool full = true;
  d->on_reserve = [&full](const kvrelay::v1::ReserveRequest& r,
                          absl::Time) -> absl::StatusOr<kvrelay::v1::ReserveResponse> {
    if (full)
      return proto::Overloaded("no KV left", kvrelay::v1::ROLE_DECODE, "d0", "kv_blocks", 0);
    kvrelay::v1::ReserveResponse response;
    response.set_node_id("d0");
    response.set_reservation_token(absl::StrCat("token-", r.request_id()));
    return response;
  };
  EXPECT_TRUE(absl::IsResourceExhausted(Run()));
  EXPECT_EQ(d->reserves.size(), 1u);
  for (int i = 0; i < 3; ++i) {
    const absl::Status s = Run();
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("every decode worker is at capacity"));
  }
  EXPECT_EQ(d->reserves.size(), 1u);  // refused without a call
  full = false;
  clock_.Advance(CircuitBreakerOptions().busy_for);
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  EXPECT_EQ(DecodeNode(0)->breaker.failures(), 0);
  EXPECT_EQ(CounterValue("kvrelay:gateway_breaker_opens_total", {{"role", "decode"}}), 0);
}

TEST_F(GenerateCallTest, AFullWorkerIsNotAskedTwiceAndAnotherServes) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d0 = AddDecode("d0");
  FakeDecodeEndpoint* d1 = AddDecode("d1");
  for (FakeDecodeEndpoint* d : {d0, d1}) {
    d->on_reserve = [d, this](const kvrelay::v1::ReserveRequest& r,
                              absl::Time) -> absl::StatusOr<kvrelay::v1::ReserveResponse> {
      if (d->reserves.size() == 1 && d == first_asked_) {
        return proto::Overloaded("full", kvrelay::v1::ROLE_DECODE, "", "slots", 0);
      }
      if (first_asked_ == nullptr) {
        first_asked_ = d;
        return proto::Overloaded("full", kvrelay::v1::ROLE_DECODE, "", "slots", 0);
      }
      kvrelay::v1::ReserveResponse response;
      response.set_reservation_token(absl::StrCat("token-", r.request_id()));
      return response;
    };
  }
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  ASSERT_NE(first_asked_, nullptr);
  EXPECT_EQ(first_asked_->reserves.size(), 1u);
  EXPECT_EQ(d0->reserves.size() + d1->reserves.size(), 2u);
  EXPECT_EQ(DecodeNode(0)->breaker.failures() + DecodeNode(1)->breaker.failures(), 0);
}

// A rolling restart: the worker that got SIGTERM refuses new work (FAILURE_DRAINING). The
// request goes to another worker without spending an attempt or opening a breaker, and later
// requests skip the draining worker.
TEST_F(GenerateCallTest, ADrainingWorkerIsSkippedWithoutSpendingAnAttempt) {
  FakePrefillEndpoint* p0 = AddPrefill("p0");
  FakePrefillEndpoint* p1 = AddPrefill("p1");
  FakeDecodeEndpoint* d0 = AddDecode("d0");
  FakeDecodeEndpoint* d1 = AddDecode("d1");
  auto draining = [](kvrelay::v1::Role role, const std::string& node) {
    return proto::Attribute(absl::UnavailableError(node + " is draining"), role, node,
                            kvrelay::v1::FAILURE_DRAINING);
  };
  d0->on_reserve = [&](const kvrelay::v1::ReserveRequest&,
                       absl::Time) -> absl::StatusOr<kvrelay::v1::ReserveResponse> {
    return draining(kvrelay::v1::ROLE_DECODE, "d0");
  };
  p0->on_prefill = [&](const kvrelay::v1::PrefillRequest&,
                       absl::Time) -> absl::StatusOr<kvrelay::v1::PrefillResponse> {
    return draining(kvrelay::v1::ROLE_PREFILL, "p0");
  };
  // One attempt a failure may spend: only drains happen, so none is spent.
  options_.max_attempts = 1;
  for (int i = 0; i < 3; ++i) {
    streamed_.clear();
    KV_ASSERT_OK(Run());
    EXPECT_EQ(streamed_, Expected(kMaxTokens));
  }
  EXPECT_EQ(d1->generates.size(), 3u);
  EXPECT_EQ(p1->requests.size(), 3u);
  // Each draining worker was asked once; the later requests skipped it.
  EXPECT_EQ(d0->reserves.size(), 1u);
  EXPECT_EQ(p0->requests.size(), 1u);
  for (WorkerSet::Node* n : {DecodeNode(0), DecodeNode(1), PrefillNode(0), PrefillNode(1)}) {
    EXPECT_EQ(n->breaker.failures(), 0);
    EXPECT_EQ(n->breaker.state(), State::kClosed);
  }
  EXPECT_TRUE(DecodeNode(0)->breaker.Draining());
  EXPECT_EQ(CounterValue("kvrelay:gateway_breaker_opens_total", {{"role", "decode"}}), 0);
  EXPECT_EQ(CounterValue("kvrelay:gateway_breaker_opens_total", {{"role", "prefill"}}), 0);
}

TEST_F(GenerateCallTest, AFullPrefillQueueIsNotAFailureAndItsPredictedWaitIsReported) {
  FakePrefillEndpoint* p = AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  p->on_prefill = [](const kvrelay::v1::PrefillRequest&, absl::Time) {
    return proto::Overloaded("queue past the deadline", kvrelay::v1::ROLE_PREFILL, "p0", "queue",
                             1500);
  };
  const absl::Status s = Run();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_GATEWAY);
  EXPECT_EQ(info->exhausted(), "queue");
  EXPECT_EQ(info->retry_after_ms(), 1500u);  // the worker's own prediction
  EXPECT_EQ(d->released.size(), 1u);         // the decode reservation went back
  EXPECT_EQ(PrefillNode(0)->breaker.state(), State::kClosed);
  EXPECT_EQ(PrefillNode(0)->breaker.failures(), 0);
  EXPECT_EQ(CounterValue("kvrelay:gateway_breaker_opens_total", {{"role", "prefill"}}), 0);
}

TEST_F(GenerateCallTest, ARefusalAtGenerateIsBusyAndRetriedOnAnotherWorker) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d0 = AddDecode("d0");
  FakeDecodeEndpoint* d1 = AddDecode("d1");
  for (FakeDecodeEndpoint* d : {d0, d1}) {
    d->fail_after_tokens = 0;
    d->fail_status =
        proto::Overloaded("batch queue full", kvrelay::v1::ROLE_DECODE, "", "queue", 0);
  }
  // Whichever is asked first refuses; the other serves.
  d0->on_reserve = [d0, d1](const kvrelay::v1::ReserveRequest& r, absl::Time) {
    if (d1->generates.empty())
      d1->fail_after_tokens = -1;
    else
      d0->fail_after_tokens = -1;
    kvrelay::v1::ReserveResponse response;
    response.set_reservation_token(absl::StrCat("token-", r.request_id()));
    return response;
  };
  d1->on_reserve = [d0, d1](const kvrelay::v1::ReserveRequest& r, absl::Time) {
    if (d0->generates.empty())
      d0->fail_after_tokens = -1;
    else
      d1->fail_after_tokens = -1;
    kvrelay::v1::ReserveResponse response;
    response.set_reservation_token(absl::StrCat("token-", r.request_id()));
    return response;
  };
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  EXPECT_EQ(d0->generates.size() + d1->generates.size(), 2u);
  EXPECT_EQ(DecodeNode(0)->breaker.failures() + DecodeNode(1)->breaker.failures(), 0);
}

TEST_F(GenerateCallTest, ARetryAfterARefusalRespectsTheDeadline) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d0 = AddDecode("d0");
  FakeDecodeEndpoint* d1 = AddDecode("d1");
  // Whichever is asked first answers "full" only when the deadline has passed.
  for (FakeDecodeEndpoint* d : {d0, d1}) {
    d->on_reserve = [this](const kvrelay::v1::ReserveRequest&, absl::Time deadline) {
      clock_.Set(deadline);
      return proto::Overloaded("full", kvrelay::v1::ROLE_DECODE, "", "slots", 0);
    };
  }
  const absl::Status s = Run(absl::Seconds(1));
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(d0->reserves.size() + d1->reserves.size(), 1u);  // no second try past the deadline
}

TEST_F(GenerateCallTest, InvalidInputAWorkerReportsEndsTheCallAtOnce) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d0 = AddDecode("d0");
  AddDecode("d1");
  d0->on_reserve = [](const kvrelay::v1::ReserveRequest&, absl::Time) {
    return proto::Attribute(absl::InvalidArgumentError("prompt_tokens too long"),
                            kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_INVALID_REQUEST);
  };
  const absl::Status s = Run();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(DecodeNode(0)->breaker.state(), State::kClosed);
  EXPECT_EQ(DecodeNode(0)->breaker.failures(), 0);
  EXPECT_EQ(DecodeNode(1)->breaker.failures(), 0);
}

TEST_F(GenerateCallTest, AClientThatWentAwayIsCancelledAndNobodysFault) {
  AddPrefill("p0");
  AddDecode("d0");
  cancelled_ = [this] { return streamed_.size() >= 2; };
  const absl::Status s = Run();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_CLIENT);
  EXPECT_EQ(streamed_.size(), 2u);
  EXPECT_EQ(DecodeNode(0)->breaker.failures(), 0);
  EXPECT_FALSE(summary_seen_);
}

TEST_F(GenerateCallTest, ASinkThatHasWhatItWantsEndsOkWithTheSummary) {
  AddPrefill("p0");
  AddDecode("d0");
  stop_after_tokens_ = 3;
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(3));
  ASSERT_TRUE(summary_seen_);
  EXPECT_EQ(summary_.generated_tokens(), 3);
  EXPECT_EQ(CounterValue("kvrelay:request_success_total", {{"finished_reason", "stop"}}), 1);
}

TEST_F(GenerateCallTest, ALostClosingMessageAfterTheLastTokenIsNotAFailure) {
  AddPrefill("p0");
  FakeDecodeEndpoint* d = AddDecode("d0");
  d->drop_last_chunk = true;
  KV_ASSERT_OK(Run());
  EXPECT_EQ(streamed_, Expected(kMaxTokens));
  EXPECT_EQ(summary_.attempts(), 1);
}

}  // namespace
}  // namespace kvrelay::gateway
