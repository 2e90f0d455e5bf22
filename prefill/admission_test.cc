#include "prefill/admission.h"

#include "common/clock.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::prefill {
namespace {

class PrefillQueueTest : public ::testing::Test {
 protected:
  SimulatedClock clock_;
  kv::RateMeter rate_{/*weight=*/1.0};
  PrefillQueue queue_{&rate_, "p0"};
};

TEST_F(PrefillQueueTest, AdmitsEverythingUntilTheRateIsMeasured) {
  KV_ASSERT_OK_AND_ASSIGN(PrefillQueue::Ticket a, queue_.Admit(100000, absl::Milliseconds(1)));
  KV_ASSERT_OK_AND_ASSIGN(PrefillQueue::Ticket b, queue_.Admit(100000, absl::Milliseconds(1)));
  EXPECT_EQ(queue_.queued_tokens(), 200000);
  EXPECT_EQ(queue_.PredictedStart(), absl::ZeroDuration());
}

TEST_F(PrefillQueueTest, RefusesAtOnceWhatCannotStartBeforeItsDeadline) {
  rate_.Observe(1000, 1.0, clock_.Now());  // 1000 prompt tokens per second
  KV_ASSERT_OK_AND_ASSIGN(PrefillQueue::Ticket first, queue_.Admit(2000, absl::Seconds(1)));
  // 2000 tokens ahead: starts in 2 s.
  EXPECT_EQ(queue_.PredictedStart(), absl::Seconds(2));
  KV_ASSERT_OK_AND_ASSIGN(PrefillQueue::Ticket second, queue_.Admit(500, absl::Seconds(3)));
  const absl::Status s = queue_.Admit(500, absl::Seconds(2)).status();  // 2.5 s ahead now
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_PREFILL);
  EXPECT_EQ(info->node_id(), "p0");
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_OVERLOADED);
  EXPECT_EQ(info->exhausted(), "queue");
  EXPECT_EQ(info->retry_after_ms(), 2500u);
  EXPECT_EQ(queue_.queued_tokens(), 2500);  // the refused request took nothing
}

TEST_F(PrefillQueueTest, TicketsGiveTheirTokensBack) {
  rate_.Observe(1000, 1.0, clock_.Now());
  {
    KV_ASSERT_OK_AND_ASSIGN(PrefillQueue::Ticket t, queue_.Admit(5000, absl::Seconds(1)));
    EXPECT_FALSE(queue_.Admit(1, absl::Seconds(1)).ok());
  }
  EXPECT_EQ(queue_.queued_tokens(), 0);
  KV_EXPECT_OK(queue_.Admit(1, absl::Milliseconds(1)).status());
}

}  // namespace
}  // namespace kvrelay::prefill
