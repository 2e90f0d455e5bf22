#include "worker/server/worker_flags.h"

#include <string>
#include <vector>

#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/test_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::worker::server {
namespace {

class WorkerFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override { KV_ASSERT_OK(model::WriteTestModel(dir_.path(), {.arch = "llama"})); }

  // Parses `args` (plus --insecure and --model) as `kvrelay decode` would.
  std::optional<int> Parse(std::vector<std::string> args) {
    host_.name = "decode";
    args.push_back("--insecure");
    args.push_back("--model=" + dir_.path());
    FlagSet flags("decode", "test");
    WorkerFlags worker_flags(host_, core_, model_name_);
    worker_flags.AddFlags(flags);
    return worker_flags.Parse(flags, args, /*cachestore_required=*/false);
  }

  kvrelay::testing::TempDir dir_;
  kvrelay::server::ServiceHostOptions host_;
  WorkerCoreOptions core_;
  std::string model_name_;
};

// config.json is parsed once, here, with the flag's block size, and handed down to the loader.
TEST_F(WorkerFlagsTest, ParsesTheConfigOnceWithTheFlagsBlockSize) {
  EXPECT_EQ(Parse({"--block-tokens=32"}), std::nullopt);
  EXPECT_EQ(core_.block_tokens, 32);
  ASSERT_TRUE(core_.model_config.has_value());
  EXPECT_EQ(core_.model_config->layout.block_tokens(), 32);
  EXPECT_EQ(core_.role, "decode");
  EXPECT_FALSE(model_name_.empty());
}

TEST_F(WorkerFlagsTest, DefaultsToTheOneDefaultBlockSize) {
  EXPECT_EQ(Parse({}), std::nullopt);
  ASSERT_TRUE(core_.model_config.has_value());
  EXPECT_EQ(core_.model_config->layout.block_tokens(), kv::kDefaultBlockTokens);
}

TEST_F(WorkerFlagsTest, RefusesABlockSizeOutOfRange) {
  EXPECT_EQ(Parse({"--block-tokens=0"}), 2);
  EXPECT_EQ(Parse({"--block-tokens=65537"}), 2);
}

// A directory without a config is the worker load's to report (exit 1 with the file's error),
// not a usage error.
TEST_F(WorkerFlagsTest, LeavesABrokenConfigToTheLoader) {
  kvrelay::testing::TempDir empty;
  host_.name = "decode";
  FlagSet flags("decode", "test");
  WorkerFlags worker_flags(host_, core_, model_name_);
  worker_flags.AddFlags(flags);
  EXPECT_EQ(worker_flags.Parse(flags, {"--insecure", "--model=" + empty.path()}, false),
            std::nullopt);
  EXPECT_FALSE(core_.model_config.has_value());
}

TEST_F(WorkerFlagsTest, TakesTheDiskTierFromFlagsAndConfig) {
  EXPECT_EQ(Parse({"--cachestore=127.0.0.1:1", "--ssd-dir=/nvme/kv", "--ssd-bytes=1048576"}),
            std::nullopt);
  EXPECT_EQ(core_.ssd_dir, "/nvme/kv");
  EXPECT_EQ(core_.ssd_bytes, 1048576);

  core_ = WorkerCoreOptions();
  const std::string config = dir_.path() + "/worker.yaml";
  KV_ASSERT_OK(
      WriteFileAtomically(config, "cachestore: 127.0.0.1:1\nssd-dir: /var/kv\nssd-bytes: 4096\n"));
  EXPECT_EQ(Parse({"--config=" + config}), std::nullopt);
  EXPECT_EQ(core_.ssd_dir, "/var/kv");
  EXPECT_EQ(core_.ssd_bytes, 4096);
}

TEST_F(WorkerFlagsTest, RefusesAnIncompleteDiskTier) {
  EXPECT_EQ(Parse({"--cachestore=127.0.0.1:1", "--ssd-dir=/nvme/kv"}), 2);  // no size
  core_ = WorkerCoreOptions();
  EXPECT_EQ(Parse({"--ssd-dir=/nvme/kv", "--ssd-bytes=4096"}), 2);  // no store
  core_ = WorkerCoreOptions();
  EXPECT_EQ(Parse({"--cachestore=127.0.0.1:1", "--ssd-bytes=4096"}), 2);  // no directory
}

}  // namespace
}  // namespace kvrelay::worker::server
