#include "sim/simulation.h"

#include <string>
#include <vector>

#include "common/check.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::sim {
namespace {

using cachestore::sim::TraceRequest;

kv::ModelLayout Layout() {
  absl::StatusOr<kv::ModelConfig> config = kv::LoadPreset("llama3-8b");
  KV_CHECK(config.ok());
  return config->layout;
}

// `n` requests, one every `gap_ms`, each of `blocks` trace blocks: request i's ids are
// {group, group*100+1, ...} with group = i % groups, so requests of a group share the prompt.
std::vector<TraceRequest> Trace(int n, int groups, int blocks, int64_t gap_ms, int output = 16) {
  std::vector<TraceRequest> trace;
  for (int i = 0; i < n; ++i) {
    TraceRequest r;
    const uint64_t group = static_cast<uint64_t>(i % groups);
    for (int b = 0; b < blocks; ++b) r.hash_ids.push_back(group * 1000 + static_cast<uint64_t>(b));
    r.input_length = blocks * 512 - 100;
    r.output_length = output;
    r.timestamp_ms = i * gap_ms;
    trace.push_back(r);
  }
  return trace;
}

HardwareProfile Profile() {
  HardwareProfile p;
  p.prefill_tokens_per_second = 20000;
  p.decode_fixed_ms = 10;
  return p;
}

TEST(TracePromptTokensTest, SharedLeadingIdsGiveSharedLeadingTokens) {
  TraceRequest a{.hash_ids = {1, 2, 3}, .input_length = 1400};
  TraceRequest b{.hash_ids = {1, 2, 9}, .input_length = 1536};
  const std::vector<int32_t> ta = TracePromptTokens(a, 0);
  const std::vector<int32_t> tb = TracePromptTokens(b, 0);
  ASSERT_EQ(ta.size(), 1400u);
  ASSERT_EQ(tb.size(), 1536u);
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 1024, tb.begin()));
  EXPECT_NE(ta[1024], tb[1024]);
  // Another population has its own ids.
  EXPECT_NE(TracePromptTokens(a, 1)[0], ta[0]);
}

TEST(SimulateTest, RepeatedPromptsHitAndEveryRequestCompletes) {
  ClusterSpec cluster;
  cluster.prefill_nodes = 2;
  cluster.decode_nodes = 2;
  TrafficSpec traffic;
  absl::StatusOr<SimReport> report =
      Simulate(Trace(40, 4, 4, 100), cluster, traffic, Profile(), Layout());
  KV_ASSERT_OK(report);
  EXPECT_EQ(report->requests, 40);
  EXPECT_EQ(report->ok, 40);
  for (const RequestRecord& r : report->records) {
    EXPECT_EQ(r.generated, 16);
    EXPECT_GT(r.ttft_ms, 0);
  }
  // 4 groups of 10: the first of each group computes, the other 9 find its full blocks
  // (all but the partial last block), wherever they run.
  EXPECT_GT(report->hit_rate, 0.8);
  EXPECT_LT(report->hit_rate, 0.95);
  EXPECT_GT(report->goodput_rps, 0);
  EXPECT_GT(report->store_calls_per_s, 0);
  EXPECT_FALSE(report->bottleneck.empty());
}

TEST(SimulateTest, KvAwareRoutingSendsARepeatToTheNodeThatHoldsItsPrefix) {
  ClusterSpec cluster;
  cluster.prefill_nodes = 4;
  cluster.decode_nodes = 2;
  TrafficSpec traffic;
  absl::StatusOr<SimReport> routed =
      Simulate(Trace(60, 6, 8, 200), cluster, traffic, Profile(), Layout());
  KV_ASSERT_OK(routed);
  cluster.prefix_routing = false;
  absl::StatusOr<SimReport> by_load =
      Simulate(Trace(60, 6, 8, 200), cluster, traffic, Profile(), Layout());
  KV_ASSERT_OK(by_load);
  EXPECT_EQ(routed->ok, 60);
  EXPECT_EQ(by_load->ok, 60);
  // Routed by prefix, a repeat runs where its prefix is: nothing to pull.
  EXPECT_EQ(routed->fetched_bytes, 0u);
  EXPECT_GE(routed->hit_rate, by_load->hit_rate);
  EXPECT_LE(routed->ttft_ms.p50, by_load->ttft_ms.p50);
}

TEST(SimulateTest, OverloadIsRefusedNotQueuedWithoutBound) {
  ClusterSpec cluster;
  cluster.prefill_nodes = 1;
  cluster.decode_nodes = 1;
  cluster.max_queue_wait = absl::Milliseconds(500);
  HardwareProfile slow = Profile();
  slow.prefill_tokens_per_second = 5000;  // 8 blocks: about 0.8 s each
  TrafficSpec traffic;
  // Unique prompts, 20 per second: far past what one node computes.
  absl::StatusOr<SimReport> report =
      Simulate(Trace(400, 400, 8, 50), cluster, traffic, slow, Layout());
  KV_ASSERT_OK(report);
  EXPECT_GT(report->refused, 200);
  EXPECT_EQ(report->failed, 0);
  EXPECT_EQ(report->ok + report->refused, 400);
  // The worker measured its rate before serving, so from the first request on what it admits
  // starts within the queue bound: TTFT at most the wait, its own compute and a decode step.
  // (Before that measurement the 16 requests of the first 0.8 s queued for up to 12.8 s.)
  int admitted = 0;
  for (const RequestRecord& r : report->records) {
    if (r.ok) {
      ++admitted;
      EXPECT_LT(r.ttft_ms, 500 + 1000 + 200) << "arrived at " << r.arrival_s;
    }
  }
  EXPECT_GT(admitted, 0);
  EXPECT_EQ(report->bottleneck, "prefill compute (prefill-0)");
  // Below 1: one prefill (0.8 s) is longer than the 500 ms bound, so the node admits only into
  // an empty queue and idles until the next arrival after each one.
  EXPECT_GT(report->bottleneck_utilisation, 0.7);
}

TEST(SimulateTest, SameInputsGiveTheSameRun) {
  ClusterSpec cluster;
  TrafficSpec traffic;
  absl::StatusOr<SimReport> a =
      Simulate(Trace(50, 5, 4, 30), cluster, traffic, Profile(), Layout());
  absl::StatusOr<SimReport> b =
      Simulate(Trace(50, 5, 4, 30), cluster, traffic, Profile(), Layout());
  KV_ASSERT_OK(a);
  KV_ASSERT_OK(b);
  EXPECT_EQ(a->RecordsCsv(), b->RecordsCsv());
}

TEST(ProfileTest, ParsesAndRejectsWithTheFieldNamed) {
  absl::StatusOr<HardwareProfile> p = ParseProfile(R"({"name": "x", "sources": ["s"],
      "prefill": {"tokens_per_second": 1000, "fixed_ms": 1},
      "decode": {"fixed_ms": 2}, "network": {"bytes_per_second": 1e9}, "rpc_ms": 0})");
  KV_ASSERT_OK(p);
  EXPECT_EQ(p->PrefillTime(1000, 0), absl::Milliseconds(1001));
  EXPECT_EQ(p->Transfer(1000000000), absl::Seconds(1) + absl::Microseconds(5));
  EXPECT_THAT(ParseProfile(R"({"prefill": {"tokens_per_sec": 1}})").status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                ::testing::HasSubstr("prefill.tokens_per_sec: unknown key")));
  EXPECT_THAT(ParseProfile(R"({"network": {"bytes_per_second": "fast"}})").status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                ::testing::HasSubstr("network.bytes_per_second")));
  EXPECT_THAT(ParseProfile("[1]").status(), testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kvrelay::sim
