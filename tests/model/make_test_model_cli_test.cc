// `kvrelay make-test-model` end to end: the binary writes a model directory that the runner
// loads and runs; bad flags exit 2 with a message naming the flag.

#include <string>
#include <vector>

#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "model/mamba_runner.h"
#include "model/model_runner.h"
#include "model/sampler.h"
#include "tests/testing/process_harness.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay {
namespace {

using ::testing::HasSubstr;

TEST(MakeTestModelCli, WritesLoadableModelForEveryArch) {
  testing::TempDir dir;
  for (const std::string arch : {"llama", "deepseek_v3", "gemma3", "gpt2", "mamba"}) {
    const std::string out = dir.File(arch);
    testing::CommandResult r =
        testing::RunKvrelay({"make-test-model", "--arch", arch, "--seed", "5", "--out", out});
    ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
    KV_ASSERT_OK_AND_ASSIGN(std::string config, ReadFileToString(out + "/config.json"));
    const std::string preset = arch == "deepseek_v3" ? "tiny-deepseek-v3" : "tiny-" + arch;
    KV_ASSERT_OK_AND_ASSIGN(std::string want, kv::PresetConfigJson(preset));
    EXPECT_EQ(config, want);
    if (arch == "mamba") {
      KV_ASSERT_OK_AND_ASSIGN(auto mamba, model::MambaRunner::Load(out));
      model::MambaSequence seq(mamba->layout());
      KV_ASSERT_OK_AND_ASSIGN(std::vector<float> logits, mamba->Prefill(seq, {1, 2, 3}));
      EXPECT_EQ(logits.size(), static_cast<size_t>(mamba->config().vocab_size));
      continue;
    }
    KV_ASSERT_OK_AND_ASSIGN(auto runner, model::ModelRunner::Load(out));
    KV_ASSERT_OK_AND_ASSIGN(auto cache, model::KvCache::Create(runner->layout(), 4));
    model::Sequence seq(cache.get());
    KV_ASSERT_OK_AND_ASSIGN(std::vector<float> logits, runner->Prefill(seq, {1, 2, 3}));
    EXPECT_EQ(logits.size(), static_cast<size_t>(runner->config().vocab_size));
  }
}

TEST(MakeTestModelCli, OverridesAndShards) {
  testing::TempDir dir;
  testing::CommandResult r = testing::RunKvrelay(
      {"make-test-model", "--arch", "llama", "--layers", "2", "--hidden", "128", "--heads", "4",
       "--shards", "2", "--dtype", "fp16", "--seed", "1", "--out", dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  KV_ASSERT_OK_AND_ASSIGN(auto runner, model::ModelRunner::Load(dir.path()));
  EXPECT_EQ(runner->config().num_hidden_layers, 2);
  EXPECT_EQ(runner->config().hidden_size, 128);
  EXPECT_EQ(runner->config().head_dim, 32);
  EXPECT_EQ(runner->layout().dtype(), kv::DType::kFp16);
  EXPECT_TRUE(ReadFileToString(dir.File("model.safetensors.index.json")).ok());
}

TEST(MakeTestModelCli, BadUsageExitsTwo) {
  testing::TempDir dir;
  testing::CommandResult r =
      testing::RunKvrelay({"make-test-model", "--arch", "gpt5", "--out", dir.path()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--arch"));
  r = testing::RunKvrelay({"make-test-model", "--arch", "llama"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--out"));
  r = testing::RunKvrelay(
      {"make-test-model", "--arch", "llama", "--dtype", "int4", "--out", dir.path()});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.stderr_text, HasSubstr("--dtype"));
}

}  // namespace
}  // namespace kvrelay
