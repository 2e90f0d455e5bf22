// `kvrelay generate` (co-located path and argument errors) and `kvrelay up` argument errors,
// through the real binary; ParseListeningLine directly.

#include <signal.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/colocated.h"
#include "cli/up/supervisor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/test_model.h"
#include "platform/device_platform.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "tokenizer/byte_tokenizer.h"

namespace kvrelay::cli {
namespace {

using ::testing::HasSubstr;

class CliClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    model::TestModelOptions options;
    options.arch = "llama";
    options.seed = 3;
    ASSERT_TRUE(model::WriteTestModel(model_dir(), options).ok());
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string model_dir() { return dir_->File("llama"); }
  static testing::TempDir* dir_;
};
testing::TempDir* CliClientTest::dir_ = nullptr;

TEST_F(CliClientTest, ColocatedJsonMatchesTheLibrary) {
  KV_ASSERT_OK_AND_ASSIGN(auto generator, ColocatedGenerator::Load(model_dir()));
  GenerationRequest request;
  request.tokens = {5, 17, 300, 4, 4, 9, 100, 511, 0, 42, 7, 8, 1, 2, 3, 4, 5, 6, 7};
  request.max_tokens = 6;
  KV_ASSERT_OK_AND_ASSIGN(GenerationResult expected, generator->Generate(request));
  ASSERT_EQ(expected.tokens.size(), 6u);

  testing::CommandResult r = testing::RunKvrelay(
      {"generate", "--colocated", "--model", model_dir(), "--tokens",
       "5,17,300,4,4,9,100,511,0,42,7,8,1,2,3,4,5,6,7", "--max-tokens", "6", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  nlohmann::json j = nlohmann::json::parse(r.stdout_text);
  EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), expected.tokens);
  EXPECT_EQ(j["prompt_tokens"], 19);
  EXPECT_EQ(j["computed_prompt_tokens"], 19);
  EXPECT_EQ(j["prefix_hit_tokens"], 0);
  EXPECT_EQ(j["transferred_bytes"], 0);
  EXPECT_EQ(j["generated_tokens"], 6);
  EXPECT_GT(j["ttft_ms"].get<double>(), 0.0);
  EXPECT_EQ(j["mode"], "colocated");

  // --prompt is the byte-level encoding of the text.
  request.tokens = *tokenizer::ByteTokenizer().Encode("kvrelay moves KV blocks");
  KV_ASSERT_OK_AND_ASSIGN(expected, generator->Generate(request));
  r = testing::RunKvrelay({"generate", "--colocated", "--model", model_dir(), "--prompt",
                           "kvrelay moves KV blocks", "--max-tokens", "6", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  j = nlohmann::json::parse(r.stdout_text);
  EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), expected.tokens);
  EXPECT_EQ(j["text"], tokenizer::DecodeBytesForDisplay(expected.tokens));

  // Human output names the tokens and the summary.
  r = testing::RunKvrelay(
      {"generate", "--colocated", "--model", model_dir(), "--prompt", "hi", "--max-tokens", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_THAT(r.stdout_text, HasSubstr("tokens: "));
  EXPECT_THAT(r.stdout_text, HasSubstr("ttft "));
}

TEST_F(CliClientTest, ColocatedDeviceIsTheReferenceCpuByDefaultAndNeverFallsBack) {
  const std::vector<std::string> base = {"generate",     "--colocated", "--model",
                                         model_dir(),    "--tokens",    "5,17,300,4",
                                         "--max-tokens", "5",           "--json"};
  testing::CommandResult plain = testing::RunKvrelay(base);
  ASSERT_EQ(plain.exit_code, 0) << plain.stderr_text;
  std::vector<std::string> on_cpu = base;
  on_cpu.insert(on_cpu.end(), {"--device", "cpu"});
  testing::CommandResult cpu = testing::RunKvrelay(on_cpu);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.stderr_text;
  EXPECT_EQ(nlohmann::json::parse(cpu.stdout_text)["tokens"],
            nlohmann::json::parse(plain.stdout_text)["tokens"]);

  std::vector<std::string> bad = base;
  bad.insert(bad.end(), {"--device", "gpu"});
  testing::CommandResult r = testing::RunKvrelay(bad);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--device"));

  // --device is the co-located run's; a gateway's workers choose their own.
  r = testing::RunKvrelay(
      {"generate", "--gateway", "127.0.0.1:1", "--insecure", "--tokens", "1", "--device", "cpu"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--device is for --colocated"));

  if (platform::MakeDevicePlatform().ok()) GTEST_SKIP() << "a CUDA device is usable here";
  std::vector<std::string> on_cuda = base;
  on_cuda.insert(on_cuda.end(), {"--device", "cuda"});
  r = testing::RunKvrelay(on_cuda);
  EXPECT_EQ(r.exit_code, 2) << r.stdout_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("--device cuda"));
  EXPECT_EQ(r.stdout_text, "");
}

TEST_F(CliClientTest, SeededSamplingRepeats) {
  std::vector<std::string> args = {
      "generate", "--colocated",   "--model", model_dir(), "--tokens", "1,2,3,4", "--max-tokens",
      "12",       "--temperature", "1.5",     "--seed",    "99",       "--json"};
  testing::CommandResult a = testing::RunKvrelay(args);
  testing::CommandResult b = testing::RunKvrelay(args);
  ASSERT_EQ(a.exit_code, 0) << a.stderr_text;
  ASSERT_EQ(b.exit_code, 0) << b.stderr_text;
  EXPECT_EQ(nlohmann::json::parse(a.stdout_text)["tokens"],
            nlohmann::json::parse(b.stdout_text)["tokens"]);
}

TEST_F(CliClientTest, StopsAtEos) {
  KV_ASSERT_OK_AND_ASSIGN(auto generator, ColocatedGenerator::Load(model_dir()));
  GenerationRequest request;
  request.tokens = {9, 8, 7};
  request.max_tokens = 8;
  KV_ASSERT_OK_AND_ASSIGN(GenerationResult full, generator->Generate(request));
  request.eos_token = full.tokens[2];
  KV_ASSERT_OK_AND_ASSIGN(GenerationResult stopped, generator->Generate(request));
  // Stops at the first occurrence of the eos token, which is included.
  size_t first = 0;
  while (full.tokens[first] != request.eos_token) ++first;
  EXPECT_EQ(stopped.tokens,
            std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + first + 1));
}

TEST_F(CliClientTest, BadInputExitsTwoWithOneLine) {
  const std::string m = model_dir();
  const std::vector<std::vector<std::string>> cases = {
      {"generate", "--tokens", "1,2"},                                   // no mode
      {"generate", "--colocated", "--gateway", "x:1", "--tokens", "1"},  // both modes
      {"generate", "--colocated", "--tokens", "1"},                      // no model
      {"generate", "--colocated", "--model", m},                         // no prompt
      {"generate", "--colocated", "--model", m, "--tokens", "1", "--prompt", "a"},
      {"generate", "--colocated", "--model", m, "--tokens", ""},
      {"generate", "--colocated", "--model", m, "--prompt", ""},
      {"generate", "--colocated", "--model", m, "--tokens", "1,two"},
      {"generate", "--colocated", "--model", m, "--tokens", "1,512"},  // vocab is 512
      {"generate", "--colocated", "--model", m, "--tokens", "-1"},
      {"generate", "--colocated", "--model", m, "--tokens", "1", "--max-tokens", "0"},
      {"generate", "--colocated", "--model", m, "--tokens", "1", "--max-tokens", "100000"},
      {"generate", "--colocated", "--model", m, "--tokens", "1", "--temperature", "-1"},
      {"generate", "--colocated", "--model", "/nonexistent", "--tokens", "1"},
      {"generate", "--bogus"},
      {"generate", "--gateway", "127.0.0.1:1", "--model", m, "--tokens", "1"},
      {"up", "--prefill", "0"},
      {"up", "--decode", "17"},
      {"up", "--gateway-address", "localhost"},
      {"up", "--gateway-address", "127.0.0.1:99999"},
      {"up", "--arch", "gpt5"},
      {"up", "--arch", "llama", "--model", m},
      {"up", "--model", "/nonexistent"},
      {"up", "--kv-cache-dtype", "int4"},
      // A recurrent state has no fp8 form: refused before anything starts.
      {"up", "--arch", "mamba", "--insecure", "--kv-cache-dtype", "fp8_e4m3"},
  };
  for (const std::vector<std::string>& args : cases) {
    testing::CommandResult r = testing::RunKvrelay(args);
    const std::string what = absl::StrJoin(args, " ");
    EXPECT_EQ(r.exit_code, 2) << what << "\n" << r.stderr_text;
    EXPECT_THAT(r.stderr_text, HasSubstr("kvrelay " + args[0] + ":")) << what;
    EXPECT_EQ(std::count(r.stderr_text.begin(), r.stderr_text.end(), '\n'), 1) << what << "\n"
                                                                               << r.stderr_text;
  }
}

// `up`'s first line names the KV dtype and gives the bytes per token of that layout: the test
// model is 4 layers x (K, V) x 2 KV heads x 32, plus for fp8 one float32 scale per (layer, K/V,
// head) per 16-token block. The cluster is stopped as soon as the line is out.
TEST_F(CliClientTest, UpNamesTheKvDtypeAndItsBytesFirst) {
  struct Case {
    std::vector<std::string> flags;
    std::string line;
  };
  const std::vector<Case> cases = {
      {{}, absl::StrCat("(llama, KV bf16, ", 4 * 2 * 2 * 32 * 2, " KV bytes per token)")},
      {{"--kv-cache-dtype", "fp8"},
       absl::StrCat("(llama, KV fp8_e4m3, ", 4 * 2 * 2 * 32 + 4 * 2 * 2 * 4 / 16,
                    " KV bytes per token)")}};
  for (const Case& c : cases) {
    testing::TempDir data;
    std::vector<std::string> argv = {testing::BinaryPath("kvrelay"),
                                     "up",
                                     "--model",
                                     model_dir(),
                                     "--insecure",
                                     "--gateway-address",
                                     "127.0.0.1:0",
                                     "--http-address",
                                     "",
                                     "--data-dir",
                                     data.path()};
    argv.insert(argv.end(), c.flags.begin(), c.flags.end());
    KV_ASSERT_OK_AND_ASSIGN(std::unique_ptr<testing::ChildProcess> up,
                            testing::ChildProcess::Start(argv));
    absl::StatusOr<std::string> first = up->WaitForOutput("KV bytes per token)", absl::Seconds(60));
    up->Signal(SIGTERM);
    EXPECT_TRUE(up->Wait(absl::Seconds(60)).ok());
    ASSERT_TRUE(first.ok()) << first.status() << "\n" << up->Stderr();
    EXPECT_THAT(up->Stdout(),
                HasSubstr(absl::StrCat("kvrelay up: model ", model_dir(), " ", c.line)))
        << up->Stdout();
  }
}

TEST_F(CliClientTest, UnreachableGatewayIsARuntimeFailure) {
  const int port = testing::PickUnusedPort();  // nothing listens there
  testing::CommandResult r =
      testing::RunKvrelay({"generate", "--gateway", absl::StrCat("127.0.0.1:", port), "--tokens",
                           "1,2,3", "--timeout", "3s", "--insecure"});
  EXPECT_EQ(r.exit_code, 1) << r.stderr_text;
  EXPECT_THAT(r.stderr_text, HasSubstr("kvrelay generate: "));
  EXPECT_EQ(std::count(r.stderr_text.begin(), r.stderr_text.end(), '\n'), 1) << r.stderr_text;
}

TEST(ParseListeningLine, ReadsAddresses) {
  std::optional<up::Endpoint> e =
      up::ParseListeningLine("decode listening on 127.0.0.1:4000 metrics 127.0.0.1:4001");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->address, "127.0.0.1:4000");
  EXPECT_EQ(e->metrics_address, "127.0.0.1:4001");
  e = up::ParseListeningLine("[x] gateway listening on [::1]:5");
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->address, "[::1]:5");
  EXPECT_EQ(e->metrics_address, "");
  EXPECT_FALSE(up::ParseListeningLine("prefill: loading model").has_value());
  EXPECT_FALSE(up::ParseListeningLine("listening on nothing").has_value());
  EXPECT_EQ(up::DescribeExit(3), "exit status 3");
  EXPECT_THAT(up::DescribeExit(-9), HasSubstr("signal 9"));
}

}  // namespace
}  // namespace kvrelay::cli
