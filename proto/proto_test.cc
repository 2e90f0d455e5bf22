#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kvrelay/v1/common.pb.h"
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

TEST(GrpcStatus, CarriesErrorInfoAcrossTheWire) {
  absl::Status status = Attribute(absl::UnavailableError("push failed"), kvrelay::v1::ROLE_DECODE,
                                  "decode-a", kvrelay::v1::FAILURE_TRANSFER, "10.0.0.3:7000");
  grpc::Status wire = ToGrpcStatus(status);
  EXPECT_FALSE(wire.error_details().empty());
  absl::Status back = FromGrpcStatus(wire);
  EXPECT_EQ(back.code(), absl::StatusCode::kUnavailable);
  std::optional<kvrelay::v1::ErrorInfo> info = GetErrorInfo(back);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->role(), kvrelay::v1::ROLE_DECODE);
  EXPECT_EQ(info->node_id(), "decode-a");
  EXPECT_EQ(info->reason(), kvrelay::v1::FAILURE_TRANSFER);
  EXPECT_EQ(info->address(), "10.0.0.3:7000");
  // No detail: nothing attached, nothing invented.
  EXPECT_FALSE(GetErrorInfo(FromGrpcStatus(ToGrpcStatus(absl::InternalError("x")))).has_value());
  // Garbage details are ignored, not fatal.
  EXPECT_FALSE(GetErrorInfo(FromGrpcStatus(
                                grpc::Status(grpc::StatusCode::INTERNAL, "x", "\xff\xff garbage")))
                   .has_value());
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
