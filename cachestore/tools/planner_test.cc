#include "cachestore/tools/planner.h"

#include <cmath>
#include <cstdint>
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
using ::testing::AllOf;
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

TEST(PlanModelTest, Fp8BlocksAreTheLayoutsBytesScalesIncluded) {
  KV_ASSERT_OK_AND_ASSIGN(PlanModel llama, LoadPlanModel("llama3-70b", kv::DType::kFp8));
  EXPECT_EQ(llama.config.layout.dtype(), kv::DType::kFp8);
  // Per layer: (K, V) x 512 tokens x 8 KV heads x 128 E4M3 bytes, then one float32 scale per
  // (K/V, KV head) for the whole 512-token block.
  EXPECT_EQ(llama.parts.full_bytes, int64_t{80} * (2 * 512 * 8 * 128 + 2 * 8 * 4));
  KV_ASSERT_OK_AND_ASSIGN(PlanModel dsv3, LoadPlanModel("deepseek-v3", kv::DType::kFp8));
  // The FlashMLA entry: 512 E4M3 latent bytes + 4 float32 tile scales + 64 bf16 rope values.
  EXPECT_EQ(dsv3.parts.full_bytes, int64_t{512} * 61 * (512 + 4 * 4 + 64 * 2));
  KV_ASSERT_OK_AND_ASSIGN(PlanModel gemma, LoadPlanModel("gemma3-27b", kv::DType::kFp8));
  EXPECT_EQ(gemma.parts.full_bytes, int64_t{10} * (2 * 512 * 16 * 128 + 2 * 16 * 4));
  EXPECT_EQ(gemma.parts.window_bytes, int64_t{52} * (2 * 512 * 16 * 128 + 2 * 16 * 4));
  EXPECT_EQ(gemma.parts.window_blocks, 2);
  // A recurrent state has no fp8 form: refused naming the model, not taken for a missing file.
  EXPECT_THAT(LoadPlanModel("mamba-2.8b", kv::DType::kFp8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model: mamba-2.8b"), HasSubstr("fp8_e4m3"))));
}

// fp8 sizes the same cache in the fp8 layout's bytes: at any memory the capacity is the bf16
// capacity scaled by bf16 / fp8 block bytes (to the whole block), and memory scaled by the
// bytes ratio buys exactly the bf16 capacity and hit rate: the cache a hit rate needs halves.
TEST(PlanTest, Fp8CapacityIsBf16ScaledByTheLayoutsBytesRatio) {
  TraceSourceFlags source;
  source.shape = "agent";
  source.requests = 300;
  KV_ASSERT_OK_AND_ASSIGN(LoadedTrace trace, source.Load());
  KV_ASSERT_OK_AND_ASSIGN(PlanModel bf16, LoadPlanModel("llama3-70b"));
  KV_ASSERT_OK_AND_ASSIGN(PlanModel fp8, LoadPlanModel("llama3-70b", kv::DType::kFp8));
  const int64_t bf16_block = bf16.parts.full_bytes, fp8_block = fp8.parts.full_bytes;
  ASSERT_EQ(bf16_block, int64_t{80} * 2 * 512 * 8 * 128 * 2);
  PlanOptions options;
  options.memory_gib = {16, 64};
  options.policies = {"lru"};
  KV_ASSERT_OK_AND_ASSIGN(auto bf16_rows, Plan(trace, bf16, options));
  KV_ASSERT_OK_AND_ASSIGN(auto fp8_rows, Plan(trace, fp8, options));
  ASSERT_EQ(bf16_rows.size(), 2u);
  ASSERT_EQ(fp8_rows.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const int64_t bytes = static_cast<int64_t>(options.memory_gib[i] * 1073741824.0);
    EXPECT_EQ(bf16_rows[i].capacity_blocks, bytes / bf16_block);
    EXPECT_EQ(fp8_rows[i].capacity_blocks, bytes / fp8_block);
    // bf16 capacity x (bf16 / fp8 block bytes), short of it only by the last partial block.
    const double scaled = static_cast<double>(bytes / bf16_block) * bf16_block / fp8_block;
    EXPECT_GE(static_cast<double>(fp8_rows[i].capacity_blocks), std::floor(scaled));
    EXPECT_LE(static_cast<double>(fp8_rows[i].capacity_blocks), scaled + 2);
    EXPECT_GE(fp8_rows[i].hit_rate, bf16_rows[i].hit_rate);
  }
  // N whole blocks (and half a spare) of each layout: the same capacity, the same hit rate.
  for (int64_t blocks : {64, 256}) {
    PlanOptions b = options, f = options;
    b.memory_gib = {(static_cast<double>(blocks) + 0.5) * bf16_block / 1073741824.0};
    f.memory_gib = {(static_cast<double>(blocks) + 0.5) * fp8_block / 1073741824.0};
    KV_ASSERT_OK_AND_ASSIGN(auto br, Plan(trace, bf16, b));
    KV_ASSERT_OK_AND_ASSIGN(auto fr, Plan(trace, fp8, f));
    EXPECT_EQ(br[0].capacity_blocks, blocks);
    EXPECT_EQ(fr[0].capacity_blocks, blocks);
    EXPECT_EQ(fr[0].hit_rate, br[0].hit_rate);
    EXPECT_NEAR(f.memory_gib[0] / b.memory_gib[0],
                (2.0 * 512 * 8 * 128 + 2 * 8 * 4) / (2.0 * 512 * 8 * 128 * 2), 1e-12);
  }
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

// DRAM with a disk tier behind it: at least the hit rate of the same DRAM alone, split by tier;
// the flag names what it cannot parse.
TEST(PlanTest, ADiskTierAddsHitsOnTopOfTheSameDram) {
  TraceSourceFlags source;
  source.shape = "agent";
  source.requests = 300;
  KV_ASSERT_OK_AND_ASSIGN(LoadedTrace trace, source.Load());
  KV_ASSERT_OK_AND_ASSIGN(PlanModel model, LoadPlanModel("deepseek-v3"));
  KV_ASSERT_OK_AND_ASSIGN(TierSizes sizes, ParseTierSizes("--tiers", "dram=1GiB,ssd=8GiB"));
  EXPECT_EQ(sizes.dram_bytes, uint64_t{1} << 30);
  EXPECT_EQ(sizes.ssd_bytes, uint64_t{8} << 30);
  KV_ASSERT_OK_AND_ASSIGN(auto rows, PlanTiered(trace, model, sizes, {"lru"}));
  ASSERT_EQ(rows.size(), 1u);
  const TieredPlanRow& r = rows[0];
  EXPECT_NEAR(r.hit_rate, r.dram_hit_rate + r.disk_hit_rate, 1e-9);
  EXPECT_GE(r.hit_rate, r.dram_only_hit_rate);
  EXPECT_GT(r.disk_hit_rate, 0);
  EXPECT_GT(r.disk_read_bytes_per_request, 0);
  EXPECT_GE(r.ssd_blocks, 8 * r.dram_blocks);
  EXPECT_GT(r.ttft_saved_ms_per_request, 0) << "a fast disk saves prefill time";
  // A disk slower than recomputing saves nothing: the estimate says so (negative).
  KV_ASSERT_OK_AND_ASSIGN(
      auto slow, PlanTiered(trace, model, sizes, {"lru"},
                            {.prefill_flops_per_second = 1e18, .disk_read_bytes_per_second = 1e6}));
  EXPECT_LT(slow[0].ttft_saved_ms_per_request, 0);
  EXPECT_THAT(PlanTiered(trace, model, sizes, {"lru"}, {.disk_read_bytes_per_second = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("positive")));
  EXPECT_THAT(ParseTierSizes("--tiers", "dram=1GiB"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("both")));
  EXPECT_THAT(ParseTierSizes("--tiers", "dram=1GiB,ssd=lots"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ssd=lots")));
  EXPECT_THAT(ParseTierSizes("--tiers", "dram=1GiB,hbm=2GiB"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'hbm'")));
  EXPECT_THAT(PlanTiered(trace, model, sizes, {"belady"}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("offline")));
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

// --kv-dtype sizes every model in that layout and says so; an SSM state refuses fp8.
TEST(PlanCommandTest, KvDtypeIsNamedAndSizesTheBlocks) {
  const CommandRun run =
      RunCaptured(RunPlanCommand, {"--shape", "agent", "--requests", "100", "--model",
                                   "deepseek-v3", "--memory-gib", "8", "--kv-dtype", "fp8"});
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  // 512 tokens x 61 layers x 656 bytes.
  EXPECT_THAT(run.out, HasSubstr("model deepseek-v3: KV fp8_e4m3, 20488192 bytes per 512-token"));
  EXPECT_THAT(run.out, HasSubstr("(KV fp8_e4m3)"));
  const CommandRun json =
      RunCaptured(RunPlanCommand, {"--shape", "agent", "--requests", "100", "--model", "llama3-8b",
                                   "--memory-gib", "8", "--json"});
  ASSERT_EQ(json.code, 0) << json.out << json.err;
  EXPECT_THAT(json.out, HasSubstr("\"kv_dtype\": \"bf16\""));

  const CommandRun mamba = RunCaptured(
      RunPlanCommand, {"--shape", "agent", "--model", "mamba-2.8b", "--kv-dtype", "fp8_e4m3"});
  EXPECT_EQ(mamba.code, 2);
  EXPECT_THAT(mamba.err, HasSubstr("fp8_e4m3"));
  const CommandRun bad = RunCaptured(RunPlanCommand, {"--shape", "agent", "--kv-dtype", "int4"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_THAT(bad.err, HasSubstr("kv-dtype"));
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
