#include "gateway/gateway.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "gateway/fake_endpoints.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "proto/grpc_status.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::gateway {
namespace {

// RFC 4231 test case 2: HMAC-SHA256(key "Jefe", "what do ya want for nothing?").
TEST(TenantSalt, IsHmacSha256OfTheTenant) {
  const std::string salt = DeriveTenantSalt("Jefe", "what do ya want for nothing?");
  ASSERT_EQ(salt.size(), 16u);
  const unsigned char expected[16] = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e,
                                      0x6a, 0x04, 0x24, 0x26, 0x08, 0x95, 0x75, 0xc7};
  EXPECT_EQ(salt, std::string(reinterpret_cast<const char*>(expected), 16));
}

TEST(TenantSalt, SeparatesTenantsAndSecrets) {
  EXPECT_EQ(DeriveTenantSalt("s", "alice"), DeriveTenantSalt("s", "alice"));
  EXPECT_NE(DeriveTenantSalt("s", "alice"), DeriveTenantSalt("s", "bob"));
  EXPECT_NE(DeriveTenantSalt("s1", "alice"), DeriveTenantSalt("s2", "alice"));
}

}  // namespace
}  // namespace kvrelay::gateway

namespace kvrelay::gateway {
namespace {

using ::kvrelay::gateway::testing::FakeDecodeEndpoint;
using ::kvrelay::gateway::testing::FakePrefillEndpoint;

// A Gateway over one fake prefill and one fake decode worker, with a real config.json.
class GatewayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KV_ASSERT_OK_AND_ASSIGN(const std::string config, kv::PresetConfigJson("llama3-8b"));
    KV_ASSERT_OK(WriteFileAtomically(dir_.File("config.json"), config));
  }
  absl::Status Start(GatewayOptions options = {}, int decode_workers = 1) {
    options.model_dir = dir_.path();
    options.model_name = "llama";
    options.tenant_secret = "secret";
    Gateway::Workers workers;
    auto prefill = std::make_unique<FakePrefillEndpoint>("p0:1", "p0", &clock_);
    prefill_ = prefill.get();
    workers.prefill.push_back(std::move(prefill));
    for (int i = 0; i < decode_workers; ++i) {
      const std::string name = absl::StrCat("d", i);
      auto decode = std::make_unique<FakeDecodeEndpoint>(name + ":1", name, &clock_);
      decodes_.push_back(decode.get());
      workers.decode.push_back(std::move(decode));
    }
    decode_ = decodes_[0];
    KV_ASSIGN_OR_RETURN(gateway_, Gateway::Create(std::move(options), std::move(workers),
                                                  /*store=*/nullptr, &metrics_, &clock_));
    return absl::OkStatus();
  }
  static kvrelay::v1::GenerateRequest Request(int32_t prompt_tokens, int32_t max_tokens) {
    kvrelay::v1::GenerateRequest request;
    for (int32_t i = 0; i < prompt_tokens; ++i) request.add_tokens(i + 1);
    request.set_max_tokens(max_tokens);
    request.set_tenant("acme");
    return request;
  }
  absl::Status Generate(const kvrelay::v1::GenerateRequest& request) {
    return gateway_->Generate(
        request, absl::Now() + absl::Seconds(60),
        [this](const kvrelay::v1::GenerateResponse& r) {
          tokens_.insert(tokens_.end(), r.tokens().begin(), r.tokens().end());
          if (r.has_summary()) summary_ = r.summary();
          return true;
        },
        [] { return false; }, "client-1");
  }

  ::kvrelay::testing::TempDir dir_;
  SimulatedClock clock_;  // the breakers'
  MetricsRegistry metrics_;
  FakePrefillEndpoint* prefill_ = nullptr;
  FakeDecodeEndpoint* decode_ = nullptr;  // decodes_[0]
  std::vector<FakeDecodeEndpoint*> decodes_;
  std::unique_ptr<Gateway> gateway_;
  std::vector<int32_t> tokens_;
  kvrelay::v1::GenerateSummary summary_;
};

TEST_F(GatewayTest, ServesARequestThroughItsWorkers) {
  KV_ASSERT_OK(Start());
  EXPECT_EQ(gateway_->num_prefill(), 1u);
  EXPECT_EQ(gateway_->num_decode(), 1u);
  KV_ASSERT_OK(Generate(Request(20, 4)));
  EXPECT_EQ(tokens_, (std::vector<int32_t>{1020, 1021, 1022, 1023}));
  EXPECT_EQ(summary_.attempts(), 1);
  EXPECT_EQ(summary_.generated_tokens(), 4);
  // The salt is the tenant's, derived from the gateway's secret (never the client's choice).
  ASSERT_EQ(prefill_->requests.size(), 1u);
  EXPECT_EQ(prefill_->requests[0].tenant_salt(), DeriveTenantSalt("secret", "acme"));
  EXPECT_EQ(prefill_->requests[0].model(), "llama");
  const std::string text = metrics_.RenderText();
  EXPECT_NE(text.find("kvrelay:prompt_tokens_total{model_name=\"llama\"} 20"), std::string::npos)
      << text;
}

TEST_F(GatewayTest, LinkCanariesGoToADecodeWorkerWhosePushesWereSlowUntilTheyAreFastAgain) {
  KV_ASSERT_OK(Start({}, /*decode_workers=*/2));
  EXPECT_EQ(gateway_->RunLinkCanaries(), 0) << "no push measured yet";
  // Pushes into d1 take 100 ms (real time: request figures are wall-clock), into d0 none.
  bool d1_slow = true;
  prefill_->on_prefill = [&d1_slow](const kvrelay::v1::PrefillRequest& request, absl::Time) {
    if (d1_slow && request.target().node_id() == "d1") absl::SleepFor(absl::Milliseconds(100));
    kvrelay::v1::PrefillResponse response;
    response.set_computed_tokens(request.tokens_size());
    response.set_pushed_tokens(request.tokens_size());
    response.set_pushed_bytes(1 << 20);
    return absl::StatusOr<kvrelay::v1::PrefillResponse>(response);
  };
  for (int i = 0; i < 2; ++i) KV_ASSERT_OK(Generate(Request(40, 2)));  // each new worker's first
  ASSERT_EQ(decodes_[1]->generates.size(), 1u);

  EXPECT_EQ(gateway_->RunLinkCanaries(), 1);
  ASSERT_EQ(decodes_[1]->reserves.size(), 2u);
  EXPECT_EQ(decodes_[0]->reserves.size(), 1u) << "the fast worker gets no canary";
  EXPECT_EQ(decodes_[1]->generates.size(), 1u) << "a canary generates nothing";
  EXPECT_EQ(decodes_[1]->released.size(), 1u);
  const kvrelay::v1::PrefillRequest& canary = prefill_->requests.back();
  EXPECT_TRUE(canary.skip_store_lookup()) << "nothing looked up or committed";
  EXPECT_EQ(canary.tenant_salt(), DeriveTenantSalt("secret", "kvrelay-link-canary"));
  EXPECT_EQ(canary.tokens_size(), 2 * 16 + 1) << "two 2 MiB blocks, and the last token";

  // Its link is fast again: the canaries see it, and stop once its figure is back.
  d1_slow = false;
  int rounds = 0;
  while (gateway_->RunLinkCanaries() > 0 && rounds < 30) ++rounds;
  EXPECT_LT(rounds, 30);
  EXPECT_EQ(gateway_->RunLinkCanaries(), 0);
}

TEST_F(GatewayTest, AnInvalidRequestIsTheCallersErrorAndReachesNoWorker) {
  KV_ASSERT_OK(Start());
  const absl::Status s = Generate(Request(0, 4));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_CLIENT);
  EXPECT_TRUE(decode_->reserves.empty());
}

TEST_F(GatewayTest, ATenantPastItsInflightQuotaIsRefusedWhileItsRequestRuns) {
  GatewayOptions options;
  options.max_inflight_per_tenant = 1;
  KV_ASSERT_OK(Start(options));
  absl::Status nested;
  decode_->on_reserve = [&](const kvrelay::v1::ReserveRequest&, absl::Time) {
    // The same tenant again while its first request holds the one slot.
    nested = Generate(Request(20, 4));
    return absl::UnavailableError("stop here");
  };
  EXPECT_FALSE(Generate(Request(20, 4)).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(nested)) << nested;
  EXPECT_THAT(std::string(nested.message()), ::testing::HasSubstr("--max-inflight-per-tenant"));
}

TEST_F(GatewayTest, PastItsInflightCapTheGatewayRefusesAtOnceWithoutAWorker) {
  GatewayOptions options;
  options.max_inflight = 1;
  KV_ASSERT_OK(Start(options));
  absl::Status nested;
  size_t reserves_seen = 0;
  decode_->on_reserve = [&](const kvrelay::v1::ReserveRequest& r,
                            absl::Time) -> absl::StatusOr<kvrelay::v1::ReserveResponse> {
    // Another tenant while the first request holds the one place.
    kvrelay::v1::GenerateRequest other = Request(20, 4);
    other.set_tenant("globex");
    reserves_seen = decode_->reserves.size();
    if (reserves_seen == 1) nested = Generate(other);
    kvrelay::v1::ReserveResponse response;
    response.set_reservation_token(absl::StrCat("token-", r.request_id()));
    return response;
  };
  KV_ASSERT_OK(Generate(Request(20, 4)));
  EXPECT_TRUE(absl::IsResourceExhausted(nested)) << nested;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(nested);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_GATEWAY);
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_OVERLOADED);
  EXPECT_EQ(info->exhausted(), "inflight");
  EXPECT_EQ(decode_->reserves.size(), 1u);  // the refused request reached no worker
  const std::string text = metrics_.RenderText();
  EXPECT_NE(text.find("kvrelay:gateway_shed_total{model_name=\"llama\",reason=\"inflight\","
                      "tier=\"gateway\"} 1"),
            std::string::npos)
      << text;
  // The place is free again.
  KV_ASSERT_OK(Generate(Request(20, 4)));
}

TEST_F(GatewayTest, StatusReportsEachWorkerItsBreakerAndItsOwnStatus) {
  KV_ASSERT_OK(Start());
  KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::GatewayStatusResponse healthy,
                          gateway_->Status(absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(healthy.model(), "llama");
  EXPECT_TRUE(healthy.store_address().empty());  // no store: no registry, no stats
  ASSERT_EQ(healthy.workers_size(), 2);
  const kvrelay::v1::WorkerStatus& p = healthy.workers(0);
  EXPECT_EQ(p.role(), kvrelay::v1::NODE_ROLE_PREFILL);
  EXPECT_EQ(p.node_id(), "p0");  // learned from its Status
  EXPECT_EQ(p.address(), "p0:1");
  EXPECT_FALSE(p.discovered());
  EXPECT_EQ(p.breaker(), kvrelay::v1::BREAKER_STATE_CLOSED);
  EXPECT_TRUE(p.answered());
  EXPECT_EQ(p.prefill().node_id(), "p0");
  const kvrelay::v1::WorkerStatus& d = healthy.workers(1);
  EXPECT_EQ(d.role(), kvrelay::v1::NODE_ROLE_DECODE);
  EXPECT_EQ(d.node_id(), "d0");
  EXPECT_TRUE(d.answered());
  EXPECT_TRUE(d.has_decode());

  // A decode failure opens its breaker; a draining prefill refuses its Status with
  // FAILURE_DRAINING, which the answer carries as a reason, not as text.
  decode_->on_reserve = [](const kvrelay::v1::ReserveRequest&,
                           absl::Time) -> absl::StatusOr<kvrelay::v1::ReserveResponse> {
    return proto::Attribute(absl::UnavailableError("gone"), kvrelay::v1::ROLE_DECODE, "d0",
                            kvrelay::v1::FAILURE_UNREACHABLE);
  };
  EXPECT_FALSE(Generate(Request(20, 4)).ok());
  prefill_->status = proto::Attribute(absl::UnavailableError("draining"), kvrelay::v1::ROLE_PREFILL,
                                      "p0", kvrelay::v1::FAILURE_DRAINING);
  KV_ASSERT_OK_AND_ASSIGN(kvrelay::v1::GatewayStatusResponse sick,
                          gateway_->Status(absl::Now() + absl::Seconds(5)));
  ASSERT_EQ(sick.workers_size(), 2);
  EXPECT_FALSE(sick.workers(0).answered());
  EXPECT_EQ(sick.workers(0).status_code(), static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_EQ(sick.workers(0).status_reason(), kvrelay::v1::FAILURE_DRAINING);
  EXPECT_FALSE(sick.workers(0).has_prefill());
  EXPECT_EQ(sick.workers(1).breaker(), kvrelay::v1::BREAKER_STATE_OPEN);
  EXPECT_GE(sick.workers(1).breaker_failures(), 1);
  EXPECT_GE(sick.workers(1).picked(), 1);
  EXPECT_EQ(sick.workers(1).in_flight(), 0);

  // A deadline already past is the caller's error.
  EXPECT_TRUE(absl::IsDeadlineExceeded(gateway_->Status(absl::Now()).status()));
}

TEST_F(GatewayTest, CreateNeedsWorkersOrAStoreToFindThem) {
  GatewayOptions options;
  options.model_dir = dir_.path();
  EXPECT_TRUE(absl::IsInvalidArgument(
      Gateway::Create(options, Gateway::Workers(), nullptr, &metrics_, &clock_).status()));
}

}  // namespace
}  // namespace kvrelay::gateway
