#include "gateway/tokenizer/byte_tokenizer.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::gateway {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ByteTokenizer, RoundTripsUtf8) {
  const std::string text = "héllo, wörld \xF0\x9F\x99\x82\n";
  std::vector<int32_t> tokens = EncodeBytes(text);
  EXPECT_EQ(tokens.size(), text.size());
  EXPECT_THAT(EncodeBytes("Ab"), ElementsAre(65, 98));
  EXPECT_EQ(EncodeBytes("\xff")[0], 255);
  KV_ASSERT_OK_AND_ASSIGN(std::string back, DecodeBytes(tokens));
  EXPECT_EQ(back, text);
  EXPECT_EQ(DecodeForDisplay(tokens), text);
  EXPECT_TRUE(EncodeBytes("").empty());
}

TEST(ByteTokenizer, RejectsNonByteIds) {
  EXPECT_THAT(DecodeBytes({65, 300}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 1 is 300")));
  EXPECT_THAT(DecodeBytes({-1}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ByteTokenizer, DisplayEscapesWhatIsNotText) {
  // 0x01 control byte, a lone continuation byte, a truncated 2-byte sequence, an id >= 256.
  EXPECT_EQ(DecodeForDisplay({'a', 0x01, 0x80, 'b', 0xC3, 'c', 511}), "a\\x01\\x80b\\xc3c<511>");
}

}  // namespace
}  // namespace kvrelay::gateway
