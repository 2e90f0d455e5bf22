// Runs the real `kvrelay layout` binary.

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// The row of the seed table's first section that starts with `model`.
std::string SeedRow(const std::string& table, const std::string& model) {
  for (absl::string_view line : absl::StrSplit(table, '\n')) {
    if (absl::StartsWith(line, model + " ")) return std::string(line);
  }
  return "";
}

TEST(LayoutCommand, SeedTable) {
  testing::CommandResult r = testing::RunKvrelay({"layout", "--seed-table"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("Gemma 3 27B"));
  EXPECT_THAT(r.stdout_text, HasSubstr("Mamba 2.8B"));
  // Each row: bf16 bytes/token, its KiB, fp8_e4m3 bytes/token (the same hand figures as the
  // JSON test above), its KiB, and fp8 / bf16.
  EXPECT_THAT(SeedRow(r.stdout_text, "gpt2-xl"),
              MatchesRegex(".* 307,200 +300\\.0 +154,200 +150\\.6 +0\\.502$"));
  EXPECT_THAT(SeedRow(r.stdout_text, "llama3-8b"),
              MatchesRegex(".* 131,072 +128\\.0 +65,664 +64\\.1 +0\\.501$"));
  EXPECT_THAT(SeedRow(r.stdout_text, "llama3-70b"),
              MatchesRegex(".* 327,680 +320\\.0 +164,160 +160\\.3 +0\\.501$"));
  EXPECT_THAT(SeedRow(r.stdout_text, "deepseek-v3"),
              MatchesRegex(".* 70,272 +68\\.6 +40,016 +39\\.1 +0\\.569$"));
  EXPECT_THAT(SeedRow(r.stdout_text, "gemma3-27b"),
              MatchesRegex(".* 507,904 +496\\.0 +254,448 +248\\.5 +0\\.501$"));
  EXPECT_THAT(SeedRow(r.stdout_text, "mamba-2.8b"),
              MatchesRegex(".* 0 \\(state\\) +- +n/a \\(state\\) +- +-$"));
}

TEST(LayoutCommand, JsonForPresetAndConfig) {
  testing::CommandResult r =
      testing::RunKvrelay({"layout", "--preset", "deepseek-v3", "--tokens", "1000", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  nlohmann::json j = nlohmann::json::parse(r.stdout_text);
  EXPECT_EQ(j["model"], "deepseek-v3");
  EXPECT_EQ(j["kv_dtype"], "bf16");
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
  // --dtype sets the model's dtype, and the KV's with it; the fp8 figure counts its scales:
  // 32 layers x (K, V) x 8 KV heads x 128 E4M3 bytes + one float32 per (K/V, head) per 16 tokens.
  r = testing::RunKvrelay(
      {"layout", "--config", dir.File("config.json"), "--dtype", "fp8", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_EQ(nlohmann::json::parse(r.stdout_text)["bytes_per_token"],
            32 * 2 * 8 * 128 + 32 * 2 * 8 * 4 / 16);
  // --kv-dtype sets only the cache's: the model stays bf16 (the config's default).
  r = testing::RunKvrelay(
      {"layout", "--config", dir.File("config.json"), "--kv-dtype", "float8_e4m3fn", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  j = nlohmann::json::parse(r.stdout_text);
  EXPECT_EQ(j["kv_dtype"], "fp8_e4m3");
  EXPECT_EQ(j["model_dtype"], "bf16");
  EXPECT_EQ(j["bytes_per_token"], 32 * 2 * 8 * 128 + 32 * 2 * 8 * 4 / 16);
}

// What `layout --preset P --kv-dtype D --tokens T --json` must print, by hand.
struct Expected {
  std::string preset;
  std::string kv_dtype;
  int64_t tokens;
  int64_t bytes_per_token;
  int64_t block_bytes_group0;  // 16-token blocks
  int64_t bytes_for_tokens;
  std::string scales;  // a phrase kv_scales must contain; empty: no kv_scales
};

// The five seed models (and Llama 3 70B) in bf16 and fp8_e4m3, each figure written out as the
// arithmetic of kv/model_layout.h: fp8 attention strips are [K, V][16 tokens][heads][head_dim]
// E4M3 bytes then [K, V][heads] float32 scales per layer; the FlashMLA entry is 512 E4M3 latent
// bytes + 4 float32 tile scales + 64 bf16 rope values per token and layer.
TEST(LayoutCommand, SeedModelsInBothKvDtypesEqualTheHandCalculation) {
  const std::vector<Expected> cases = {
      // GPT-2 XL: MHA, 48 layers x 25 heads x 64.
      {"gpt2-xl", "bf16", 1000, 48 * 2 * 25 * 64 * 2, 48 * 2 * 16 * 25 * 64 * 2,
       int64_t{1000} * 48 * 2 * 25 * 64 * 2, ""},
      {"gpt2-xl", "fp8_e4m3", 1000, 48 * 2 * 25 * 64 + 48 * 2 * 25 * 4 / 16,
       48 * (2 * 16 * 25 * 64 + 2 * 25 * 4),
       // values of 1000 tokens + scales of the 63 blocks they touch (62 full, one partial)
       int64_t{1000} * 48 * 2 * 25 * 64 + 63 * 48 * 2 * 25 * 4,
       "per block, layer, K/V and KV head"},
      // Llama 3 8B: GQA, 32 layers x 8 KV heads x 128.
      {"llama3-8b", "bf16", 1024, 32 * 2 * 8 * 128 * 2, 32 * 2 * 16 * 8 * 128 * 2,
       int64_t{1024} * 32 * 2 * 8 * 128 * 2, ""},
      {"llama3-8b", "fp8_e4m3", 1024, 32 * 2 * 8 * 128 + 32 * 2 * 8 * 4 / 16,
       32 * (2 * 16 * 8 * 128 + 2 * 8 * 4),
       int64_t{1024} / 16 * 32 * (2 * 16 * 8 * 128 + 2 * 8 * 4),
       "per block, layer, K/V and KV head"},
      // Llama 3 70B: GQA, 80 layers x 8 KV heads x 128.
      {"llama3-70b", "fp8_e4m3", 16, 80 * 2 * 8 * 128 + 80 * 2 * 8 * 4 / 16,
       80 * (2 * 16 * 8 * 128 + 2 * 8 * 4), 80 * (2 * 16 * 8 * 128 + 2 * 8 * 4), "KV head"},
      // DeepSeek V3: MLA, 61 layers x (512 latent + 64 rope).
      {"deepseek-v3", "bf16", 1000, 61 * (512 + 64) * 2, 16 * 61 * (512 + 64) * 2,
       int64_t{1000} * 61 * (512 + 64) * 2, ""},
      {"deepseek-v3", "fp8_e4m3", 1000, 61 * (512 + 4 * 4 + 64 * 2),
       16 * 61 * (512 + 4 * 4 + 64 * 2), int64_t{1000} * 61 * (512 + 4 * 4 + 64 * 2),
       "per token, layer and 128 latent values"},
      // Gemma 3 27B: 62 layers x 16 KV heads x 128; 52 keep a 1024-token window, 10 are global.
      // At 32,768 tokens the windowed layers hold 1024 tokens (64 blocks), the global ones all
      // 32,768 (2048 blocks). Block bytes are checked per group below (block_bytes_group0 unused).
      {"gemma3-27b", "bf16", 32768, 62 * 2 * 16 * 128 * 2, 0,
       int64_t{1024} * 52 * 2 * 16 * 128 * 2 + int64_t{32768} * 10 * 2 * 16 * 128 * 2, ""},
      {"gemma3-27b", "fp8_e4m3", 32768, 62 * 2 * 16 * 128 + 62 * 2 * 16 * 4 / 16, 0,
       int64_t{1024} * 52 * 2 * 16 * 128 + 64 * 52 * 2 * 16 * 4 +
           int64_t{32768} * 10 * 2 * 16 * 128 + 2048 * 10 * 2 * 16 * 4,
       "per block, layer, K/V and KV head"},
      // Mamba 2.8B: no per-token bytes; 64 layers x 5120 x (conv 4 + state 16) bf16 per sequence.
      {"mamba-2.8b", "bf16", 32768, 0, 64 * 5120 * (4 + 16) * 2, 64 * 5120 * (4 + 16) * 2, ""},
  };
  for (const Expected& e : cases) {
    const std::string what = e.preset + " " + e.kv_dtype;
    testing::CommandResult r =
        testing::RunKvrelay({"layout", "--preset", e.preset, "--kv-dtype", e.kv_dtype, "--tokens",
                             std::to_string(e.tokens), "--json"});
    ASSERT_EQ(r.exit_code, 0) << what << ": " << r.stderr_text;
    const nlohmann::json j = nlohmann::json::parse(r.stdout_text);
    EXPECT_EQ(j["kv_dtype"], e.kv_dtype) << what;
    EXPECT_EQ(j["model_dtype"], "bf16") << what;
    EXPECT_EQ(j["bytes_per_token"], e.bytes_per_token) << what;
    EXPECT_EQ(j["bytes_for_tokens"], e.bytes_for_tokens) << what;
    if (e.preset == "gemma3-27b") {
      // One 16-token block of one group: 52 sliding or 10 global layers of strips.
      const int64_t strip =
          e.kv_dtype == "bf16" ? 2 * 16 * 16 * 128 * 2 : 2 * 16 * 16 * 128 + 2 * 16 * 4;
      int64_t sum = 0;
      for (const nlohmann::json& g : j["groups"]) {
        EXPECT_EQ(g["block_bytes"], g["layers"].get<int64_t>() * strip) << what;
        sum += g["block_bytes"].get<int64_t>();
      }
      EXPECT_EQ(sum, 62 * strip) << what;
    } else {
      EXPECT_EQ(j["groups"][0]["block_bytes"], e.block_bytes_group0) << what;
    }
    if (e.scales.empty()) {
      EXPECT_FALSE(j.contains("kv_scales")) << what;
    } else {
      EXPECT_THAT(j["kv_scales"].get<std::string>(), HasSubstr(e.scales)) << what;
    }
  }
}

// Mamba has no KV cache to quantise: fp8 is refused in one line naming the dtype, exit 2.
TEST(LayoutCommand, MambaRefusesAnFp8KvCache) {
  testing::CommandResult r =
      testing::RunKvrelay({"layout", "--preset", "mamba-2.8b", "--kv-dtype", "fp8_e4m3"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("kvrelay layout:"));
  EXPECT_THAT(r.stderr_text, HasSubstr("fp8_e4m3"));
  EXPECT_EQ(std::count(r.stderr_text.begin(), r.stderr_text.end(), '\n'), 1) << r.stderr_text;
  EXPECT_TRUE(r.stdout_text.empty()) << r.stdout_text;
}

TEST(LayoutCommand, HumanTable) {
  testing::CommandResult r =
      testing::RunKvrelay({"layout", "--preset", "gemma3-27b", "--tokens", "32768"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("sliding_window"));
  EXPECT_THAT(r.stdout_text, HasSubstr("full_attention"));
}

TEST(LayoutCommand, BadInputExitsNonZeroWithOneLine) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"layout", "--preset", "gpt5"},
           {"layout", "--preset", "llama3-8b", "--dtype", "int4"},
           {"layout", "--preset", "llama3-8b", "--kv-dtype", "e5m2"},
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
