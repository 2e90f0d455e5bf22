// Issue 17: eviction policies on generated traces of several shapes, Belady as the ceiling, the
// window-aware store, and trace validation.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "cachestore/adaptive_policy.h"
#include "cachestore/sim/trace_gen.h"
#include "cachestore/sim/trace_replay.h"
#include "cachestore/sim/window_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::cachestore::sim {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(TraceGenTest, DeterministicPerSeedAndShape) {
  for (const std::string& shape : TraceShapeNames()) {
    KV_ASSERT_OK_AND_ASSIGN(auto a, GenerateTrace(shape, 7, 200));
    KV_ASSERT_OK_AND_ASSIGN(auto b, GenerateTrace(shape, 7, 200));
    KV_ASSERT_OK_AND_ASSIGN(auto c, GenerateTrace(shape, 8, 200));
    ASSERT_EQ(a.size(), 200u) << shape;
    EXPECT_EQ(TraceToJsonLines(a), TraceToJsonLines(b)) << shape;
    EXPECT_NE(TraceToJsonLines(a), TraceToJsonLines(c)) << shape;
    // What it writes parses back, lengths agreeing with the block counts.
    KV_ASSERT_OK_AND_ASSIGN(auto parsed, ParseTrace(TraceToJsonLines(a)));
    ASSERT_EQ(parsed.size(), a.size());
    EXPECT_EQ(parsed[5].hash_ids, a[5].hash_ids);
    EXPECT_EQ(parsed[5].input_length, a[5].input_length);
  }
  EXPECT_THAT(GenerateTrace("zipf", 1, 10),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape")));
  EXPECT_THAT(GenerateTrace("scan", 1, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("requests")));
}

TEST(ParseTraceTest, BadLinesNameLineAndField) {
  EXPECT_THAT(ParseTrace("{\"hash_ids\": [1]}\n[1, 2]\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2: not a JSON object")));
  EXPECT_THAT(ParseTrace("{\"input_length\": -5, \"hash_ids\": []}"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1: input_length")));
  EXPECT_THAT(ParseTrace("\n{\"output_length\": -1, \"hash_ids\": [3]}"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 2: output_length")));
  EXPECT_THAT(ParseTrace("{\"timestamp\": \"soon\", \"hash_ids\": [3]}"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1: timestamp")));
  EXPECT_THAT(ParseTrace("{\"input_length\": 1500, \"hash_ids\": [1, 2]}"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("line 1: input_length 1500 needs 3 blocks")));
  EXPECT_THAT(ParseTrace("{\"timestamp\": 1}"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("line 1: hash_ids")));
  KV_ASSERT_OK_AND_ASSIGN(auto ok, ParseTrace("{\"timestamp\": 4, \"input_length\": 1024, "
                                              "\"output_length\": 2, \"hash_ids\": [1, 2]}"));
  EXPECT_EQ(ok[0].input_length, 1024);
  EXPECT_EQ(ok[0].timestamp_ms, 4);
}

// Belady on a hand-checked trace: capacity 2, [1] [2] [3] [1] [2]. After [3] the cache must drop
// one of 1 and 2 (both used later) or not cache 3 (never used again): Belady does the latter and
// hits both later requests.
TEST(BeladyTest, BypassesBlocksUsedLast) {
  std::vector<TraceRequest> trace = {{{1}}, {{2}}, {{3}}, {{1}}, {{2}}};
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult belady, ReplayTrace(trace, 2, "belady"));
  EXPECT_EQ(belady.hit_blocks, 2);
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru, ReplayTrace(trace, 2, "lru"));
  EXPECT_EQ(lru.hit_blocks, 0);
}

// The doorkeeper: a prefix seen twice stays while one-off requests churn through the rest of the
// cache (capacity 4). Leaf-LRU loses it to the one-offs.
TEST(ProbationLruTest, OneOffRequestsLeaveBeforeAReusedPrefix) {
  std::vector<TraceRequest> trace = {{{1, 2}}, {{1, 2}}, {{10}}, {{11}},
                                     {{12}},   {{13}},   {{14}}, {{1, 2}}};
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult probation, ReplayTrace(trace, 4, "probation-lru"));
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult leaf_lru, ReplayTrace(trace, 4, "leaf-lru"));
  EXPECT_EQ(probation.hit_blocks, 4);
  EXPECT_EQ(leaf_lru.hit_blocks, 2);
}

// The lag (capacity 2, so one cache = 2 accesses): B is evicted (t3), A is hit (t4), B is
// re-fetched (t5, the doorkeeper saw it). D (t6) must evict A or B. probation-lru keeps the more
// recent B; probation-lag ranks the re-fetch 2 ticks back (5 - 2 = 3 < 4), keeps A, which is hit
// again at t7.
TEST(ProbationLagTest, ReFetchedBlockLeavesBeforeABlockHitEarlier) {
  std::vector<TraceRequest> trace = {{{2}}, {{1}}, {{3}}, {{1}}, {{2}}, {{4}}, {{1}}};
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult lag, ReplayTrace(trace, 2, "probation-lag"));
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult probation, ReplayTrace(trace, 2, "probation-lru"));
  EXPECT_EQ(lag.policy, "probation-lag");
  EXPECT_EQ(lag.hit_blocks, 2);        // t4 and t7
  EXPECT_EQ(probation.hit_blocks, 1);  // t4 only
}

TEST(RecentFilterTest, RemembersWithinTheHistoryOnly) {
  RecentFilter filter(/*capacity_blocks=*/100);
  const BlockHash a = TraceBlockHash(1), b = TraceBlockHash(2);
  EXPECT_FALSE(filter.SeenThenStamp(a, 0));
  EXPECT_TRUE(filter.SeenThenStamp(a, 5));
  EXPECT_FALSE(filter.SeenThenStamp(b, 5));
  // Last stamped at tick 5 (epoch 0); epoch 7 is within 8 epochs of 100 ticks, epoch 16 is not.
  EXPECT_TRUE(filter.SeenThenStamp(b, 799));
  EXPECT_FALSE(filter.SeenThenStamp(a, 1600));
}

// The store's filter is made for a million slots before any node registers; a capacity hint
// resizes it. The new table starts empty (as at start-up), then remembers as before; a size used
// before gets its table back, emptied.
TEST(RecentFilterTest, CapacityHintResizesAndStartsEmpty) {
  RecentFilter filter(/*capacity_blocks=*/1 << 20);
  const BlockHash a = TraceBlockHash(1), b = TraceBlockHash(2);
  EXPECT_FALSE(filter.SeenThenStamp(a, 0));
  EXPECT_TRUE(filter.SeenThenStamp(a, 1));
  filter.SetCapacity(100);
  EXPECT_FALSE(filter.SeenThenStamp(a, 2)) << "the resized table starts empty";
  EXPECT_TRUE(filter.SeenThenStamp(a, 3));
  EXPECT_FALSE(filter.SeenThenStamp(b, 5));
  EXPECT_TRUE(filter.SeenThenStamp(b, 799));  // the 100-block history: 8 epochs of 100 ticks
  EXPECT_FALSE(filter.SeenThenStamp(a, 1600));
  filter.SetCapacity(1 << 20);  // back to the first size: that table, emptied
  EXPECT_FALSE(filter.SeenThenStamp(a, 1601));
  EXPECT_TRUE(filter.SeenThenStamp(a, 1602));
}

// The service's mode: OnRequest only queues, a background thread learns. Fed one chain at a time
// (waiting for each to be learned), it must make exactly the decisions of inline learning.
TEST(AdaptivePolicyTest, BackgroundLearningDecidesAsInlineLearning) {
  KV_ASSERT_OK_AND_ASSIGN(auto trace, GenerateTrace("scan", 1, 300));
  AdaptivePolicy inline_policy(/*capacity_blocks=*/100);
  AdaptivePolicy background(/*capacity_blocks=*/100);
  // A whole core: never over it, so no chain is dropped (the budget has its own test below).
  background.SetLearnerBudget(/*cpu_share_of_one_core=*/1.0, absl::Seconds(1));
  background.LearnInBackground();
  std::vector<BlockHash> chain;
  int64_t fed = 0;
  for (const TraceRequest& r : trace) {
    chain.clear();
    for (uint64_t id : r.hash_ids) chain.push_back(TraceBlockHash(id));
    if (chain.empty()) continue;
    inline_policy.OnRequest(chain);
    background.OnRequest(chain);
    ++fed;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (background.learned_requests() < fed && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    ASSERT_EQ(background.learned_requests(), fed);
  }
  EXPECT_EQ(inline_policy.learned_requests(), fed);
  EXPECT_GT(inline_policy.switches(), 0);  // the scan makes it leave LRU
  EXPECT_EQ(background.switches(), inline_policy.switches());
  EXPECT_EQ(background.ranking(), inline_policy.ranking());
}

// A chain of `length` distinct blocks whose root's lo is `root_lo` (the sampling looks at it).
std::vector<BlockHash> ChainWithRoot(uint64_t root_lo, uint64_t salt, int length) {
  std::vector<BlockHash> chain;
  chain.push_back(BlockHash{salt, root_lo});
  for (int i = 1; i < length; ++i) chain.push_back(TraceBlockHash(salt * 4096 + i));
  return chain;
}

// Issue 19: the store's learner keeps to its CPU budget. Flooded with long chains it samples
// coarser (down to kMinShadowBlocks shadows), a chain outside the sample never reaches it, and
// once the load is light again it samples finer. The budget, 2 ms of CPU per 20 ms, is small
// enough for a flood of 256-block chains to break it and large enough for one short chain per
// window (~70 us here, mostly the wake-up) to stay under a quarter of it.
TEST(AdaptivePolicyTest, BackgroundLearnerKeepsToItsCpuBudget) {
  constexpr int64_t kCapacity = 16 * AdaptivePolicy::kMinShadowBlocks;
  AdaptivePolicy policy(kCapacity);
  EXPECT_EQ(policy.sample_shift(), 0);
  policy.SetLearnerBudget(/*cpu_share_of_one_core=*/0.1, /*window=*/absl::Milliseconds(20));
  // At SCHED_IDLE it would wait for CPU nothing else wants, which a loaded CI machine never has.
  policy.SetLearnerIdlePriority(false);
  policy.LearnInBackground();
  const auto flood_until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (uint64_t salt = 1;
       policy.sample_shift() < 1 && std::chrono::steady_clock::now() < flood_until; ++salt) {
    policy.OnRequest(ChainWithRoot(salt << 8, salt, 256));  // low bits 0: always sampled
    if (salt % 4 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_GE(policy.sample_shift(), 1) << "a flood never took the learner over its budget";
  EXPECT_GE(policy.budget_overruns(), 1);

  // Let the flood drain (the learner rests to its window's end and drops what queued): until
  // nothing was learned for 100 ms.
  int64_t before = -1;
  for (int i = 0; i < 100 && policy.learned_requests() != before; ++i) {
    before = policy.learned_requests();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  policy.OnRequest(ChainWithRoot(/*root_lo=*/1, 1u << 20, 16));  // outside any coarser sample
  policy.OnRequest(ChainWithRoot(/*root_lo=*/0, 2u << 20, 16));  // inside every sample
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (policy.learned_requests() == before && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Queued in order: had the first been queued, it would have been counted before the second.
  EXPECT_EQ(policy.learned_requests(), before + 1);

  // Short chains, one per window: far under a quarter of the budget, so it refines again. The
  // count, not the shift: a loaded machine may take it coarse again before the next look.
  const int64_t refinements = policy.budget_refinements();
  const auto light_until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (uint64_t salt = 3;
       policy.budget_refinements() == refinements && std::chrono::steady_clock::now() < light_until;
       ++salt) {
    policy.OnRequest(ChainWithRoot(salt << 8, salt << 20, 2));
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_GT(policy.budget_refinements(), refinements)
      << "a light load never brought finer sampling back";
}

// Requests under one shared prefix of `shared` blocks (a system prompt), each with `own` blocks
// of its own: request i's own ids are unique to it.
std::vector<BlockHash> UnderSharedPrefix(int shared, int own, uint64_t i) {
  std::vector<BlockHash> chain;
  for (int b = 1; b <= shared; ++b) chain.push_back(TraceBlockHash(static_cast<uint64_t>(b)));
  for (int b = 0; b < own; ++b) chain.push_back(TraceBlockHash(1'000'000 + i * 16 + b));
  return chain;
}

// Sampling by the root alone learns from every chain or from none when one prompt heads them
// all (the real conversation trace: one root block heads every request). The key moves to where
// the chains part, and the sample follows its rate again; distinct roots keep the root.
TEST(AdaptivePolicyTest, SamplingKeyMovesBelowASharedPrefix) {
  // 4x the shadows' bound: 1 in 4 chains by capacity alone.
  AdaptivePolicy shared_prompt(4 * AdaptivePolicy::kMaxShadowBlocks);
  ASSERT_EQ(shared_prompt.sample_shift(), 2);
  constexpr int kFirstJudgement = AdaptivePolicy::kKeyStatEvery * AdaptivePolicy::kKeyStatChains;
  uint64_t i = 0;
  for (; i < kFirstJudgement; ++i) shared_prompt.OnRequest(UnderSharedPrefix(12, 3, i));
  EXPECT_EQ(shared_prompt.sample_depth(), 12);
  const int64_t before = shared_prompt.sampled_requests();
  constexpr int kAfter = 4096;
  for (; i < kFirstJudgement + kAfter; ++i) shared_prompt.OnRequest(UnderSharedPrefix(12, 3, i));
  const double share = static_cast<double>(shared_prompt.sampled_requests() - before) / kAfter;
  EXPECT_GT(share, 0.20);  // 1 in 4; by the root alone it is 0 or 1
  EXPECT_LT(share, 0.30);

  AdaptivePolicy distinct_roots(4 * AdaptivePolicy::kMaxShadowBlocks);
  for (uint64_t r = 0; r < 4 * kFirstJudgement; ++r) {
    distinct_roots.OnRequest(UnderSharedPrefix(0, 4, r));
  }
  EXPECT_EQ(distinct_roots.sample_depth(), 0);
  const double root_share =
      static_cast<double>(distinct_roots.sampled_requests()) / (4 * kFirstJudgement);
  EXPECT_GT(root_share, 0.20);
  EXPECT_LT(root_share, 0.30);

  // Learning in the background, as the store does: the lookups' threads take the key samples.
  AdaptivePolicy background(4 * AdaptivePolicy::kMaxShadowBlocks);
  background.SetLearnerBudget(/*cpu_share_of_one_core=*/1.0, absl::Seconds(1));
  background.SetLearnerIdlePriority(false);
  background.LearnInBackground();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (uint64_t r = 0; background.sample_depth() == 0 && std::chrono::steady_clock::now() < until;
       ++r) {
    background.OnRequest(UnderSharedPrefix(12, 3, r));
    if (r % 64 == 63) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(background.sample_depth(), 12);
}

// The must-show rule: the default policy is never below LRU, and Belady is above everything,
// on every generated shape at capacities from tight to roomy (small traces keep it fast).
TEST(DefaultPolicyTest, NeverBelowLruOnEveryShapeAndCapacity) {
  for (const std::string& shape : TraceShapeNames()) {
    KV_ASSERT_OK_AND_ASSIGN(auto trace, GenerateTrace(shape, 1, 600));
    for (int64_t capacity : {100, 300, 1000, 3000}) {
      KV_ASSERT_OK_AND_ASSIGN(
          auto results,
          ReplaySweep(trace, {capacity}, {"lru", std::string(kDefaultPolicy), "belady"}));
      const double lru = results[0].hit_rate(), def = results[1].hit_rate(),
                   belady = results[2].hit_rate();
      std::printf("%-9s capacity %5lld: lru %.4f %s %.4f belady %.4f\n", shape.c_str(),
                  static_cast<long long>(capacity), lru, results[1].policy.c_str(), def, belady);
      EXPECT_GE(def, lru) << shape << " capacity " << capacity;
      EXPECT_GE(belady + 1e-9, def) << shape << " capacity " << capacity;
    }
  }
}

TEST(BeladyTest, MatchesReferenceOnSharedTrace) {
  const std::string path = "/work/shared/data/traces/synthetic_trace.jsonl";
  if (access(path.c_str(), R_OK) != 0) GTEST_SKIP() << "trace not present: " << path;
  KV_ASSERT_OK_AND_ASSIGN(auto trace, LoadTrace(path));
  EXPECT_NEAR(ReplayBelady(trace, 2000).hit_rate(), 0.3795, 0.0005);
  EXPECT_NEAR(ReplayBelady(trace, 20000).hit_rate(), 0.6396, 0.0005);
}

// Per-group match: blocks 0..5 cached; block 1 and 2's window parts reclaimed (interior). A
// request for the chain can resume after block 1 (window 0..1 intact? no: 1 is gone) -> the
// largest n with window parts of [n-2, n) present: n = 6 (blocks 4, 5 present).
TEST(WindowAwareCacheTest, MatchReportsUsablePerGroup) {
  LruPolicy policy(/*leaf_only=*/true);
  const BlockParts parts{/*full_bytes=*/10, /*window_bytes=*/50, /*window_blocks=*/2};
  WindowAwareCache cache(&policy, /*capacity_bytes=*/10'000, parts, /*window_aware=*/true);
  std::vector<BlockHash> chain;
  for (uint64_t i = 1; i <= 6; ++i) chain.push_back(TraceBlockHash(i));
  cache.Access(chain, WindowAwareCache::Match{});
  EXPECT_EQ(cache.used_bytes(), 6 * 60);
  WindowAwareCache::Match m = cache.MatchPrefix(chain);
  EXPECT_EQ(m.full_blocks, 6);
  EXPECT_EQ(m.usable_blocks, 6);
  EXPECT_EQ(m.window_from, 4);
  // A shorter prefix of the same chain: blocks 0..2 match fully.
  m = cache.MatchPrefix(absl::MakeSpan(chain).subspan(0, 3));
  EXPECT_EQ(m.usable_blocks, 3);
}

TEST(WindowAwareCacheTest, ReclaimsInteriorWindowPartsBeforeWholeBlocks) {
  LruPolicy policy(/*leaf_only=*/true);
  const BlockParts parts{/*full_bytes=*/10, /*window_bytes=*/50, /*window_blocks=*/2};
  // Room for 8 whole blocks (480 bytes).
  WindowAwareCache aware(&policy, 480, parts, /*window_aware=*/true);
  WindowAwareCache alike(&policy, 480, parts, /*window_aware=*/false);
  std::vector<BlockHash> a, b;
  for (uint64_t i = 1; i <= 6; ++i) a.push_back(TraceBlockHash(i));
  for (uint64_t i = 101; i <= 6 + 100; ++i) b.push_back(TraceBlockHash(i));
  for (WindowAwareCache* c : {&aware, &alike}) {
    c->Access(a, c->MatchPrefix(a));
    c->Access(b, c->MatchPrefix(b));
  }
  // Treated alike, 12 blocks cannot fit in 8: chain a lost blocks. Window-aware drops the
  // window parts of a's and b's interior blocks (0..3) and keeps every full part.
  EXPECT_EQ(aware.MatchPrefix(a).usable_blocks, 6);
  EXPECT_EQ(aware.MatchPrefix(b).usable_blocks, 6);
  EXPECT_LT(alike.MatchPrefix(a).usable_blocks, 6);
  EXPECT_GT(aware.counters().window_parts_reclaimed, 0);
  EXPECT_EQ(aware.counters().blocks_evicted, 0);
  EXPECT_LE(aware.used_bytes(), 480);
}

TEST(WindowAwareCacheTest, WindowAwareNeverWorseOnMultiTurn) {
  KV_ASSERT_OK_AND_ASSIGN(auto trace, GenerateTrace("multiturn", 3, 600));
  const BlockParts gemma_like{/*full_bytes=*/10, /*window_bytes=*/52, /*window_blocks=*/2};
  for (int64_t blocks : {200, 800, 3000}) {
    const int64_t bytes = blocks * 62;
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult aware,
                            ReplayWindowed(trace, bytes, gemma_like, true, "lrfu"));
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult alike,
                            ReplayWindowed(trace, bytes, gemma_like, false, "lrfu"));
    std::printf("window-aware %lld blocks of bytes: aware %.4f alike %.4f\n",
                static_cast<long long>(blocks), aware.hit_rate(), alike.hit_rate());
    EXPECT_GE(aware.hit_rate(), alike.hit_rate()) << blocks;
  }
  EXPECT_THAT(ReplayWindowed(trace, 0, gemma_like, true, "lrfu"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("capacity")));
}

}  // namespace
}  // namespace kvrelay::cachestore::sim
