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

// 8 shared prefixes of 96 blocks taking turns, each request with its own last trace block, on
// 1 prefill + 1 decode node whose store segments hold 200 blocks each: DRAM alone keeps at most
// the last prefix or two. A disk tier of 1,600 blocks per node keeps them all: the decode node
// holds the prefix again after the gateway's Promote, and the prefill node, which must still
// compute each request's own tail, reads the prefix back from its own disk (layer by layer,
// faster than recomputing at this profile's 6 GB/s). A disk slower than recomputing is never
// read by the prefill node, and a Promote that cannot finish by its deadline reads nothing.
TEST(SimulateTest, ADiskTierKeepsThePrefixesDramCannot) {
  ClusterSpec cluster;
  cluster.prefill_nodes = 1;
  cluster.decode_nodes = 1;
  cluster.cache_blocks = 200;
  TrafficSpec traffic;
  std::vector<TraceRequest> trace = Trace(64, 8, 4, 300);
  for (size_t i = 0; i < trace.size(); ++i) trace[i].hash_ids.back() = 100000 + i;
  absl::StatusOr<SimReport> dram = Simulate(trace, cluster, traffic, Profile(), Layout());
  KV_ASSERT_OK(dram);
  cluster.disk_blocks = 1600;
  absl::StatusOr<SimReport> disk = Simulate(trace, cluster, traffic, Profile(), Layout());
  KV_ASSERT_OK(disk);
  HardwareProfile slow_disk = Profile();
  slow_disk.disk_read_bytes_per_second = 1e6;
  absl::StatusOr<SimReport> slow = Simulate(trace, cluster, traffic, slow_disk, Layout());
  KV_ASSERT_OK(slow);
  std::printf(
      "hit rate: DRAM alone %.3f; with the disk tier %.3f (own disk %.3f, %lld blocks promoted), "
      "TTFT p50 %.1f -> %.1f ms; a disk slower than compute %.3f\n",
      dram->hit_rate, disk->hit_rate, disk->disk_hit_rate,
      static_cast<long long>(disk->promoted_blocks), dram->ttft_ms.p50, disk->ttft_ms.p50,
      slow->hit_rate);
  EXPECT_EQ(dram->ok, 64);
  EXPECT_EQ(disk->ok, 64);
  EXPECT_EQ(slow->ok, 64);
  EXPECT_EQ(dram->disk_hit_rate, 0);
  EXPECT_EQ(dram->promoted_blocks, 0);
  // After each prefix's first run, its 7 later runs find it (3 of 4 trace blocks) on disk.
  EXPECT_GT(disk->hit_rate, dram->hit_rate + 0.4) << dram->hit_rate;
  EXPECT_GT(disk->disk_hit_rate, 0.4);
  EXPECT_GT(disk->promoted_blocks, 0);
  int64_t from_disk = 0;
  for (const RequestRecord& r : disk->records) from_disk += r.prefix_source == "disk" ? 1 : 0;
  EXPECT_GE(from_disk, 40);
  EXPECT_LT(disk->ttft_ms.p50, dram->ttft_ms.p50);
  EXPECT_EQ(slow->disk_hit_rate, 0);
  EXPECT_EQ(slow->promoted_blocks, 0);
  EXPECT_LE(slow->hit_rate, dram->hit_rate + 0.05);
}

TEST(ProfileTest, ParsesAndRejectsWithTheFieldNamed) {
  absl::StatusOr<HardwareProfile> p = ParseProfile(R"({"name": "x", "sources": ["s"],
      "prefill": {"tokens_per_second": 1000, "fixed_ms": 1},
      "decode": {"fixed_ms": 2}, "network": {"bytes_per_second": 1e9}, "rpc_ms": 0})");
  KV_ASSERT_OK(p);
  EXPECT_EQ(p->PrefillTime(1000, 0), absl::Milliseconds(1001));
  EXPECT_EQ(p->Transfer(1000000000), absl::Seconds(1) + absl::Microseconds(5));
  EXPECT_EQ(p->DiskRead(6000000000), absl::Seconds(1));  // the default: 6 GB/s
  KV_ASSERT_OK_AND_ASSIGN(HardwareProfile d,
                          ParseProfile(R"({"disk": {"read_bytes_per_second": 2e9}})"));
  EXPECT_EQ(d.DiskRead(1000000000), absl::Milliseconds(500));
  EXPECT_THAT(ParseProfile(R"({"disk": {"read_bytes_per_second": 0}})").status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                ::testing::HasSubstr("disk.read_bytes_per_second")));
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
