#include "kvrelay/v1/common.pb.h"

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "proto/grpc_status.h"

namespace kvrelay::proto {
namespace {

TEST(GrpcStatus, RoundTripsEveryCode) {
  for (int code = 0; code <= 16; ++code) {
    absl::Status status(static_cast<absl::StatusCode>(code), code == 0 ? "" : "what went wrong");
    absl::Status back = FromGrpcStatus(ToGrpcStatus(status));
    EXPECT_EQ(back.code(), status.code());
    EXPECT_EQ(back.message(), status.message());
  }
}

TEST(CommonProto, BlockLocationSerializes) {
  kvrelay::v1::BlockLocation location;
  location.set_node_id("decode-0");
  location.set_slot(42);
  location.set_tier(kvrelay::v1::TIER_HOST);
  std::string wire = location.SerializeAsString();
  kvrelay::v1::BlockLocation parsed;
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_EQ(parsed.node_id(), "decode-0");
  EXPECT_EQ(parsed.slot(), 42);
  EXPECT_EQ(parsed.tier(), kvrelay::v1::TIER_HOST);
}

}  // namespace
}  // namespace kvrelay::proto
