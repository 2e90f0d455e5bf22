#include "cachestore/tools/planner.h"

#include <string>
#include <vector>

#include "cachestore/eviction_policy.h"
#include "cachestore/tools/command.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::cachestore::tools {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(PlanModelTest, BlockPartsFollowTheLayout) {
  KV_ASSERT_OK_AND_ASSIGN(PlanModel llama, LoadPlanModel("llama3-70b"));
  // 80 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 320 KiB per token.
  EXPECT_EQ(llama.parts.full_bytes, 512 * 327680);
  EXPECT_EQ(llama.parts.window_bytes, 0);
  KV_ASSERT_OK_AND_ASSIGN(PlanModel dsv3, LoadPlanModel("deepseek-v3"));
  EXPECT_EQ(dsv3.parts.full_bytes, 512 * 70272);  // 61 x (512 + 64) x 2
  KV_ASSERT_OK_AND_ASSIGN(PlanModel gemma, LoadPlanModel("gemma3-27b"));
  // 10 global + 52 sliding layers, 16 KV heads x 128, window 1024 tokens = 2 blocks.
  EXPECT_EQ(gemma.parts.full_bytes, int64_t{512} * 10 * 16 * 128 * 2 * 2);
  EXPECT_EQ(gemma.parts.window_bytes, int64_t{512} * 52 * 16 * 128 * 2 * 2);
  EXPECT_EQ(gemma.parts.window_blocks, 2);
  // Prefill FLOPs grow faster than linearly (attention) and saving a prefix saves its FLOPs.
  EXPECT_GT(PrefillFlops(llama, 2000), 2 * PrefillFlops(llama, 1000));
  EXPECT_THAT(LoadPlanModel("llama9"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model: 'llama9'")));
}

TEST(PlanTest, HitRateGrowsWithMemoryAndBadParametersAreNamed) {
  TraceSourceFlags source;
  source.shape = "agent";
  source.requests = 300;
  KV_ASSERT_OK_AND_ASSIGN(LoadedTrace trace, source.Load());
  KV_ASSERT_OK_AND_ASSIGN(PlanModel model, LoadPlanModel("deepseek-v3"));
  PlanOptions options;
  options.memory_gib = {1, 4, 16};
  options.policies = {"lrfu"};
  KV_ASSERT_OK_AND_ASSIGN(auto rows, Plan(trace, model, options));
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_LE(rows[0].hit_rate, rows[1].hit_rate);
  EXPECT_LE(rows[1].hit_rate, rows[2].hit_rate);
  EXPECT_GT(rows[2].hit_rate, 0.3);
  EXPECT_GT(rows[2].compute_saved, rows[0].compute_saved);
  EXPECT_GT(rows[2].bytes_read_per_request, rows[0].bytes_read_per_request);
  options.memory_gib = {0.001};  // 1 MiB: less than one 34 MiB block
  EXPECT_THAT(Plan(trace, model, options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("memory-gib")));
  EXPECT_THAT(ParsePositiveDoubles("memory-gib", "8,-1"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("memory-gib")));
  EXPECT_THAT(ParsePolicyList("policy", "lru,mru"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'mru'")));
  TraceSourceFlags both;
  both.trace = "x.jsonl";
  both.shape = "scan";
  EXPECT_THAT(both.Load(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--trace")));
}

// What one `kvrelay` subcommand returned and printed.
struct CommandRun {
  int code = 0;
  std::string out, err;
};
CommandRun RunCaptured(int (*command)(const std::vector<std::string>&),
                       const std::vector<std::string>& args) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  CommandRun run;
  run.code = command(args);
  run.out = ::testing::internal::GetCapturedStdout();
  run.err = ::testing::internal::GetCapturedStderr();
  return run;
}

// The command as an operator runs it: the plan is for the store's own policy unless told
// otherwise, a target the smallest size already reaches is reported as an upper bound (the real
// least memory lies below what was measured), and a bad flag is a usage error naming it.
TEST(PlanCommandTest, PlansTheStoresPolicyAndBoundsATargetReachedAtOnce) {
  const CommandRun run = RunCaptured(
      RunPlanCommand, {"--shape", "agent", "--requests", "300", "--model", "deepseek-v3",
                       "--memory-gib", "16,32", "--target-hit-rate", "0.3"});
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_THAT(run.out, HasSubstr(std::string("deepseek-v3 ") + std::string(kDefaultPolicy)));
  EXPECT_THAT(run.out, HasSubstr("need at most 16.0 GiB per node (the smallest size given)"));

  const CommandRun bad = RunCaptured(RunPlanCommand, {"--shape", "agent", "--memory-gib", "8,-1"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("memory-gib"));
}

TEST(TraceReplayCommandTest, LearnerSamplingIsAPowerOfTwo) {
  const CommandRun bad =
      RunCaptured(RunTraceReplayCommand, {"--shape", "scan", "--learner-sampling", "3"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("learner-sampling"));

  const CommandRun run = RunCaptured(
      RunTraceReplayCommand, {"--shape", "scan", "--requests", "200", "--capacity-blocks", "300000",
                              "--learner-sampling", "4"});
  EXPECT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_THAT(run.out, HasSubstr("policy adaptive capacity 300000 blocks"));
}

}  // namespace
}  // namespace kvrelay::cachestore::tools
