// Runs the real `kvrelay layout` binary.

#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;

TEST(LayoutCommand, SeedTable) {
  testing::CommandResult r = testing::RunKvrelay({"layout", "--seed-table"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("307,200"));
  EXPECT_THAT(r.stdout_text, HasSubstr("131,072"));
  EXPECT_THAT(r.stdout_text, HasSubstr("70,272"));
  EXPECT_THAT(r.stdout_text, HasSubstr("68.6"));
  EXPECT_THAT(r.stdout_text, HasSubstr("Gemma 3 27B"));
  EXPECT_THAT(r.stdout_text, HasSubstr("Mamba 2.8B"));
}

TEST(LayoutCommand, JsonForPresetAndConfig) {
  testing::CommandResult r =
      testing::RunKvrelay({"layout", "--preset", "deepseek-v3", "--tokens", "1000", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  nlohmann::json j = nlohmann::json::parse(r.stdout_text);
  EXPECT_EQ(j["model"], "deepseek-v3");
  EXPECT_EQ(j["tokens"], 1000);
  EXPECT_EQ(j["bytes_per_token"], 70272);
  EXPECT_EQ(j["bytes_for_tokens"], 70272000);
  ASSERT_EQ(j["groups"].size(), 1u);
  EXPECT_EQ(j["groups"][0]["kind"], "mla_latent");
  EXPECT_EQ(j["groups"][0]["block_bytes"], 16 * 70272);

  testing::TempDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.File("config.json"),
                                  R"({"model_type":"llama","hidden_size":4096,
      "num_attention_heads":32,"num_key_value_heads":8,"num_hidden_layers":32})")
                  .ok());
  r = testing::RunKvrelay(
      {"layout", "--config", dir.File("config.json"), "--dtype", "fp8", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_EQ(nlohmann::json::parse(r.stdout_text)["bytes_per_token"], 65536);
}

TEST(LayoutCommand, HumanTable) {
  testing::CommandResult r =
      testing::RunKvrelay({"layout", "--preset", "gemma3-27b", "--tokens", "32768"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("sliding_window"));
  EXPECT_THAT(r.stdout_text, HasSubstr("full_attention"));
}

TEST(LayoutCommand, BadInputExitsNonZeroWithOneLine) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"layout", "--preset", "gpt5"},
                                             {"layout", "--preset", "llama3-8b", "--dtype", "int4"},
                                             {"layout", "--preset", "llama3-8b", "--tokens", "-1"},
                                             {"layout", "--config", "/nonexistent/config.json"},
                                             {"layout", "--bogus"},
                                             {"layout"}}) {
    testing::CommandResult r = testing::RunKvrelay(args);
    EXPECT_EQ(r.exit_code, 2) << args.back();
    EXPECT_THAT(r.stderr_text, HasSubstr("kvrelay layout:")) << args.back();
    EXPECT_EQ(std::count(r.stderr_text.begin(), r.stderr_text.end(), '\n'), 1) << r.stderr_text;
  }
  testing::CommandResult r = testing::RunKvrelay({"no-such-command"});
  EXPECT_EQ(r.exit_code, 2);
}

}  // namespace
}  // namespace kvrelay
