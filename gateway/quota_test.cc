#include "gateway/quota.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::gateway {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(QuotaTable, RefusesPastTheLimitNamingTheKeyAndTheFlag) {
  Counter refusals;
  QuotaTable quota("client", "requests in flight", "--max-inflight-per-client", 2, &refusals);
  const std::string alice = "spiffe://kvrelay/client/alice";
  KV_ASSERT_OK_AND_ASSIGN(QuotaTable::Lease a, quota.Take(alice));
  KV_ASSERT_OK_AND_ASSIGN(QuotaTable::Lease b, quota.Take(alice));
  absl::StatusOr<QuotaTable::Lease> c = quota.Take(alice);
  ASSERT_THAT(c, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(c.status().message(), HasSubstr("client 'spiffe://kvrelay/client/alice'"));
  EXPECT_THAT(c.status().message(), HasSubstr("--max-inflight-per-client 2"));
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(c.status());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_CLIENT);
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_OVERLOADED);
  EXPECT_EQ(refusals.value(), 1);
  // Other keys have their own share.
  KV_EXPECT_OK(quota.Take("spiffe://kvrelay/client/bob").status());
  EXPECT_EQ(quota.Held("spiffe://kvrelay/client/bob"), 0);  // that lease was destroyed
  // A returned (or destroyed) lease gives its unit back, once.
  a.Return();
  a.Return();
  EXPECT_EQ(quota.Held(alice), 1);
  KV_ASSERT_OK_AND_ASSIGN(QuotaTable::Lease d, quota.Take(alice));
  QuotaTable::Lease moved = std::move(d);
  EXPECT_EQ(quota.Held(alice), 2);
  { QuotaTable::Lease gone = std::move(b); }
  EXPECT_EQ(quota.Held(alice), 1);
}

TEST(QuotaTable, CountsUnitsAndRefusesWhatWouldPassTheLimit) {
  QuotaTable tokens("client", "tokens of decode KV reserved", "--max-reserved-tokens-per-client",
                    100, nullptr);
  KV_ASSERT_OK_AND_ASSIGN(QuotaTable::Lease a, tokens.Take("c", 60));
  absl::StatusOr<QuotaTable::Lease> b = tokens.Take("c", 41);
  ASSERT_THAT(b, StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(b.status().message(),
              HasSubstr("client 'c' already has 60 tokens of decode KV reserved and this request "
                        "needs 41 (quota --max-reserved-tokens-per-client 100)"));
  KV_ASSERT_OK_AND_ASSIGN(QuotaTable::Lease c, tokens.Take("c", 40));  // exactly the limit
  EXPECT_EQ(tokens.Held("c"), 100);
  a.Return();
  EXPECT_EQ(tokens.Held("c"), 40);
  // One request larger than the whole quota never fits.
  EXPECT_THAT(tokens.Take("d", 101), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(tokens.Held("d"), 0);
}

TEST(QuotaTable, NoLimitAndNoIdentityCountNothing) {
  QuotaTable unlimited("tenant", "requests in flight", "--max-inflight-per-tenant", 0, nullptr);
  std::vector<QuotaTable::Lease> leases;
  for (int i = 0; i < 1000; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(QuotaTable::Lease l, unlimited.Take("t"));
    leases.push_back(std::move(l));
  }
  EXPECT_EQ(unlimited.Held("t"), 0);
  QuotaTable one("client", "requests in flight", "--max-inflight-per-client", 1, nullptr);
  KV_ASSERT_OK_AND_ASSIGN(QuotaTable::Lease first, one.Take(""));
  KV_EXPECT_OK(one.Take("").status());  // --insecure callers: no identity, no client quota
}

}  // namespace
}  // namespace kvrelay::gateway
