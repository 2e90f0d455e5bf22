#include "decode/admission.h"

#include "gtest/gtest.h"
#include "proto/grpc_status.h"

namespace kvrelay::decode {
namespace {

DecodeAdmission Admission() {
  return DecodeAdmission({.max_batch = 4, .max_queued = 8, .weight = 0.5}, "d0");
}

TEST(DecodeAdmission, StartsAtOnceWhileTheBatchHasRoom) {
  DecodeAdmission admission = Admission();
  admission.ObserveResidency(absl::Seconds(20));
  EXPECT_EQ(admission.PredictedWait(3), absl::ZeroDuration());
  EXPECT_TRUE(admission.Check(3, absl::Milliseconds(1)).ok());
}

TEST(DecodeAdmission, PredictsTheWaitFromItsPlaceAndTheMeasuredResidency) {
  DecodeAdmission admission = Admission();
  admission.ObserveResidency(absl::Seconds(8));
  admission.ObserveResidency(absl::Seconds(16));  // moving average: 12 s
  EXPECT_EQ(admission.residency(), absl::Seconds(12));
  // A batch of 4 loses one sequence every 3 s; place 1 waits 3 s, place 3 waits 9 s.
  EXPECT_EQ(admission.PredictedWait(4), absl::Seconds(3));
  EXPECT_EQ(admission.PredictedWait(6), absl::Seconds(9));
  EXPECT_EQ(admission.NextDeparture(2), absl::Seconds(6));
}

TEST(DecodeAdmission, RefusesAtOnceWhatCannotStartBeforeItsDeadline) {
  DecodeAdmission admission = Admission();
  admission.ObserveResidency(absl::Seconds(12));
  EXPECT_TRUE(admission.Check(6, absl::Seconds(10)).ok());  // starts in 9 s
  const absl::Status s = admission.Check(6, absl::Seconds(8));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_DECODE);
  EXPECT_EQ(info->node_id(), "d0");
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_OVERLOADED);
  EXPECT_EQ(info->exhausted(), "queue");
  EXPECT_EQ(info->retry_after_ms(), 9000u);
}

TEST(DecodeAdmission, AFullQueueIsRefusedEvenBeforeAnythingIsMeasured) {
  DecodeAdmission admission = Admission();
  // Unmeasured: the length bound alone applies.
  EXPECT_TRUE(admission.Check(11, absl::Milliseconds(1)).ok());
  const absl::Status s = admission.Check(12, absl::Hours(1));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_EQ(proto::GetErrorInfo(s)->retry_after_ms(), 0u);  // unknown
  admission.ObserveResidency(absl::Seconds(4));
  EXPECT_EQ(proto::GetErrorInfo(admission.Check(12, absl::Hours(1)))->retry_after_ms(), 1000u);
}

}  // namespace
}  // namespace kvrelay::decode
