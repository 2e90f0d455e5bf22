#include "kv/prompt_validation.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/limits.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::kv {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

ModelConfig Config(int32_t vocab, int32_t max_positions) {
  ModelConfig c;
  c.vocab_size = vocab;
  c.max_position_embeddings = max_positions;
  return c;
}

TEST(ValidatePrompt, AcceptsAValidPrompt) {
  std::vector<int32_t> tokens = {0, 5, 99};
  KV_EXPECT_OK(ValidatePrompt(tokens, 4, Config(100, 8)));
  KV_EXPECT_OK(ValidatePrompt(tokens, -1, Config(100, 3)));  // max_tokens not checked
}

TEST(ValidatePrompt, NamesWhatIsWrong) {
  const ModelConfig config = Config(100, 8);
  EXPECT_THAT(ValidatePrompt({}, 1, config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  std::vector<int32_t> bad = {1, 100};
  EXPECT_THAT(ValidatePrompt(bad, 1, config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens[1] = 100")));
  std::vector<int32_t> negative = {-3};
  EXPECT_THAT(ValidatePrompt(negative, 1, config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens[0] = -3")));
  std::vector<int32_t> long_prompt(9, 1);
  EXPECT_THAT(ValidatePrompt(long_prompt, 1, config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the maximum 8")));
  std::vector<int32_t> ok = {1, 2};
  EXPECT_THAT(ValidatePrompt(ok, 0, config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_tokens")));
  EXPECT_THAT(ValidatePrompt(ok, limits::kMaxGenerateTokens + 1, Config(100, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_tokens")));
  EXPECT_THAT(ValidatePrompt(ok, 7, config),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_position_embeddings 8")));
  std::vector<int32_t> over_limit(limits::kMaxPromptTokens + 1, 1);
  EXPECT_THAT(ValidatePrompt(over_limit, 1, Config(100, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceeds the maximum")));
}

}  // namespace
}  // namespace kvrelay::kv
