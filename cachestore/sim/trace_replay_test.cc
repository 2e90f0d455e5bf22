#include "cachestore/sim/trace_replay.h"

#include <unistd.h>

#include <cstdio>
#include <string>

#include "cachestore/eviction_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::cachestore::sim {
namespace {

using ::kvrelay::testing::StatusIs;

constexpr char kTracePath[] = "/work/shared/data/traces/synthetic_trace.jsonl";

std::string TracePath() {
  const char* env = std::getenv("KVRELAY_TRACE");
  if (env != nullptr) return env;
  // The shared data folder sits beside the source tree: <root>/../shared.
  const char* src = std::getenv("KVRELAY_SOURCE_DIR");
  if (src != nullptr) {
    std::string p = std::string(src) + "/../shared/data/traces/synthetic_trace.jsonl";
    if (access(p.c_str(), R_OK) == 0) return p;
  }
  return kTracePath;
}

TEST(ParseTraceTest, ReadsHashIdsAndNamesBadLines) {
  KV_ASSERT_OK_AND_ASSIGN(auto trace,
                          ParseTrace("{\"hash_ids\": [1, 2, 3]}\n\n{\"hash_ids\": []}\n"));
  ASSERT_EQ(trace.size(), 2u);
  EXPECT_THAT(trace[0].hash_ids, ::testing::ElementsAre(1, 2, 3));
  EXPECT_THAT(ParseTrace("{\"hash_ids\": [1]}\nnot json\n"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("line 2")));
  EXPECT_THAT(ParseTrace("{\"hash_ids\": [-1]}"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("hash_ids")));
  EXPECT_THAT(ParseTrace("{\"input_length\": 3}"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("hash_ids")));
}

TEST(ReplayTraceTest, RejectsBadCapacityAndPolicy) {
  std::vector<TraceRequest> trace = {{{1, 2}}};
  EXPECT_THAT(ReplayTrace(trace, 0, "lru"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("capacity")));
  EXPECT_THAT(ReplayTrace(trace, 10, "fifo"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("fifo")));
}

// A hand-computed scenario: capacity 3, plain LRU.
//   [1,2]    miss 2, cache {1,2}
//   [1,2,3]  hits 2, cache {1,2,3}
//   [4]      miss, evicts 1 (least recent) -> {2,3,4}
//   [1,2]    1 is gone: 0 hits even though 2 is cached (prefix hit rule)
TEST(ReplayTraceTest, PlainLruCountsOnlyLeadingHits) {
  std::vector<TraceRequest> trace = {{{1, 2}}, {{1, 2, 3}}, {{4}}, {{1, 2}}};
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult r, ReplayTrace(trace, 3, "lru"));
  EXPECT_EQ(r.blocks, 8);
  EXPECT_EQ(r.hit_blocks, 2);
  EXPECT_EQ(r.requests, 4);
}

// The same trace with leaf-first eviction: [4] evicts leaf 3, not root 1, so the last request
// hits both blocks.
TEST(ReplayTraceTest, LeafFirstKeepsSharedPrefix) {
  std::vector<TraceRequest> trace = {{{1, 2}}, {{1, 2, 3}}, {{4}}, {{1, 2}}};
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru, ReplayTrace(trace, 3, "leaf-lru"));
  EXPECT_EQ(lru.hit_blocks, 4);
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult lrfu, ReplayTrace(trace, 3, "lrfu"));
  EXPECT_EQ(lrfu.hit_blocks, 4);
}

// Belady under the store's rule. Capacity 2: [1] [2] [3] [1]: at [3] the evictable leaves are 1
// (needed next) and 2 (never again), so 2 goes and the last request hits; LRU evicts 1. A block
// with a cached child is never the victim: with [1,2] cached, [3] must evict leaf 2 although 1
// is the block used furthest in the future. A request longer than the cache stores what fits
// (its own blocks are leased) and evicts nothing of it.
TEST(ReplayTraceTest, BeladyLeafEvictsFurthestLeafAndKeepsLeases) {
  const std::vector<TraceRequest> trace = {{{1}}, {{2}}, {{3}}, {{1}}};
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru, ReplayTrace(trace, 2, "lru"));
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult leaf, ReplayTrace(trace, 2, "belady-leaf"));
  EXPECT_EQ(lru.hit_blocks, 0);
  EXPECT_EQ(leaf.hit_blocks, 1);
  EXPECT_EQ(leaf.policy, "belady-leaf");

  // [1,2] [3] [2] [1,2]: at [3], block 1 (next access 4) is needed after block 2 (access 3), so
  // the unconstrained rule would drop 1; leaf-first must drop 2 (1 has a cached child). [2] then
  // misses and evicts 3 (never used again), and the last request hits both blocks.
  const std::vector<TraceRequest> chained = {{{1, 2}}, {{3}}, {{2}}, {{1, 2}}};
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult chained_leaf, ReplayTrace(chained, 2, "belady-leaf"));
  EXPECT_EQ(chained_leaf.evictions, 2);
  EXPECT_EQ(chained_leaf.hit_blocks, 2);

  KV_ASSERT_OK_AND_ASSIGN(ReplayResult longer, ReplayTrace({{{1, 2, 3}}, {{1}}}, 2, "belady-leaf"));
  EXPECT_EQ(longer.evictions, 0);
  EXPECT_EQ(longer.hit_blocks, 1);
}

// A synthetic workload with no file: a hot 4-block prefix (a "system prompt") starts every
// third request, with a 2-block unique tail; between them come two cold one-off requests of 6
// blocks. With room for 12 blocks, the 12 cold blocks between two hot requests flush the hot
// prefix out of plain LRU every time; a frequency-aware policy keeps it once it has been seen
// twice.
TEST(ReplayTraceTest, SyntheticHotPrefixFrequencyBeatsLru) {
  std::vector<TraceRequest> trace;
  uint64_t next_cold = 1000;
  constexpr int kHot = 60;
  for (int i = 0; i < kHot; ++i) {
    TraceRequest hot;
    for (uint64_t b = 0; b < 4; ++b) hot.hash_ids.push_back(b);
    for (int b = 0; b < 2; ++b) hot.hash_ids.push_back(next_cold++);
    trace.push_back(std::move(hot));
    for (int c = 0; c < 2; ++c) {
      TraceRequest cold;
      for (int b = 0; b < 6; ++b) cold.hash_ids.push_back(next_cold++);
      trace.push_back(std::move(cold));
    }
  }
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru, ReplayTrace(trace, 12, "lru"));
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult leaf_lru, ReplayTrace(trace, 12, "leaf-lru"));
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult lrfu, ReplayTrace(trace, 12, "lrfu"));
  std::printf("hot-prefix hits: lru %lld leaf-lru %lld lrfu %lld\n",
              static_cast<long long>(lru.hit_blocks), static_cast<long long>(leaf_lru.hit_blocks),
              static_cast<long long>(lrfu.hit_blocks));
  EXPECT_EQ(lru.hit_blocks, 0);
  EXPECT_EQ(leaf_lru.hit_blocks, 0);
  // The first two hot requests may miss (first sight, then a ghost comeback); every later one
  // hits its whole 4-block prefix.
  EXPECT_GE(lrfu.hit_blocks, (kHot - 2) * 4);
}

TEST(ReplayTraceTest, MooncakeTraceMatchesReferenceLruAndDefaultNeverLower) {
  const std::string path = TracePath();
  if (access(path.c_str(), R_OK) != 0) GTEST_SKIP() << "trace not present: " << path;
  KV_ASSERT_OK_AND_ASSIGN(auto trace, LoadTrace(path));
  const struct {
    int64_t capacity;
    double reference_lru;
  } kCases[] = {{2000, 0.1439}, {6000, 0.3107}, {20000, 0.5715}};
  for (const auto& c : kCases) {
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru, ReplayTrace(trace, c.capacity, "lru"));
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult def, ReplayTrace(trace, c.capacity, kDefaultPolicy));
    std::printf("capacity %lld: lru %.4f default %.4f (x%.3f)\n",
                static_cast<long long>(c.capacity), lru.hit_rate(), def.hit_rate(),
                def.hit_rate() / lru.hit_rate());
    EXPECT_NEAR(lru.hit_rate(), c.reference_lru, 0.002) << "capacity " << c.capacity;
    EXPECT_GE(def.hit_rate(), lru.hit_rate()) << "capacity " << c.capacity;
    // Measured 1.092x at 2k blocks (README's policy table); the default before probation-lag
    // reached 1.076x.
    if (c.capacity == 2000) {
      EXPECT_GE(def.hit_rate(), 1.08 * lru.hit_rate());
      // Belady under the store's rule (leaf-first, leased, no bypass) is the ceiling an online
      // leaf-first policy faces: 0.3742, as cachestore/tools/policy_model.py's belady-leaf,
      // against unconstrained Belady's 0.3795.
      KV_ASSERT_OK_AND_ASSIGN(ReplayResult leaf, ReplayTrace(trace, c.capacity, "belady-leaf"));
      KV_ASSERT_OK_AND_ASSIGN(ReplayResult belady, ReplayTrace(trace, c.capacity, "belady"));
      std::printf("capacity 2000: belady %.4f belady-leaf %.4f\n", belady.hit_rate(),
                  leaf.hit_rate());
      EXPECT_NEAR(leaf.hit_rate(), 0.3742, 0.0005);
      EXPECT_LE(leaf.hit_rate(), belady.hit_rate());
      EXPECT_GT(leaf.hit_rate(), def.hit_rate());
    }
  }
}

TEST(ReplayTieredTest, DemotedBlocksHitOnDiskAndComeBackToDram) {
  // Two 3-block prompts that share nothing, alternating, with 3 DRAM blocks: DRAM alone never
  // hits (each prompt evicts the other); with a disk tier the other prompt is always on disk.
  std::vector<TraceRequest> trace;
  for (int i = 0; i < 6; ++i) {
    trace.push_back(i % 2 == 0 ? TraceRequest{{1, 2, 3}} : TraceRequest{{7, 8, 9}});
  }
  KV_ASSERT_OK_AND_ASSIGN(ReplayResult alone, ReplayTrace(trace, 3, "lru"));
  EXPECT_EQ(alone.hit_blocks, 0);
  KV_ASSERT_OK_AND_ASSIGN(TieredReplayResult tiered, ReplayTiered(trace, 3, 6, "lru"));
  EXPECT_EQ(tiered.total.blocks, 18);
  EXPECT_EQ(tiered.dram_hit_blocks, 0);
  EXPECT_EQ(tiered.disk_hit_blocks, 12);  // every prompt after the first two
  EXPECT_EQ(tiered.total.hit_blocks, 12);
  EXPECT_EQ(tiered.promotions, 12);
  EXPECT_EQ(tiered.demotions, 15);  // each of the last five prompts evicts the other's 3 blocks
  EXPECT_EQ(tiered.disk_evictions, 0);

  EXPECT_FALSE(ReplayTiered(trace, 3, 0, "lru").ok());
  EXPECT_FALSE(ReplayTiered(trace, 3, 6, "belady").ok());
  EXPECT_FALSE(ReplayTiered(trace, 3, 6, "nope").ok());
}

// Issue 30: DRAM = C with a disk of 8C keeps at least 0.95x the hit rate of DRAM alone at 9C,
// at capacities where DRAM alone at C is below half of Belady (0.091 vs 0.277 at 1,000 blocks,
// 0.157 vs 0.380 at 2,000). Measured 0.971x and 0.968x; LRU in both tiers is exactly LRU at 9C.
TEST(ReplayTieredTest, MooncakeTraceDiskEightTimesDramNearDramAtNineTimes) {
  const std::string path = TracePath();
  if (access(path.c_str(), R_OK) != 0) GTEST_SKIP() << "trace not present: " << path;
  KV_ASSERT_OK_AND_ASSIGN(auto trace, LoadTrace(path));
  for (int64_t c : {1000, 2000}) {
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult at_c, ReplayTrace(trace, c, kDefaultPolicy));
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult belady, ReplayTrace(trace, c, "belady"));
    ASSERT_LT(at_c.hit_rate(), 0.5 * belady.hit_rate()) << "capacity " << c;
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult at_9c, ReplayTrace(trace, 9 * c, kDefaultPolicy));
    KV_ASSERT_OK_AND_ASSIGN(TieredReplayResult tiered,
                            ReplayTiered(trace, c, 8 * c, kDefaultPolicy));
    std::printf(
        "dram %lld: alone %.4f, + disk %lld: %.4f (dram %lld ssd %lld blocks), dram "
        "alone at %lld: %.4f (x%.3f)\n",
        static_cast<long long>(c), at_c.hit_rate(), static_cast<long long>(8 * c),
        tiered.total.hit_rate(), static_cast<long long>(tiered.dram_hit_blocks),
        static_cast<long long>(tiered.disk_hit_blocks), static_cast<long long>(9 * c),
        at_9c.hit_rate(), tiered.total.hit_rate() / at_9c.hit_rate());
    EXPECT_GE(tiered.total.hit_rate(), 0.95 * at_9c.hit_rate()) << "capacity " << c;
    EXPECT_EQ(tiered.dram_hit_blocks + tiered.disk_hit_blocks, tiered.total.hit_blocks);
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru_9c, ReplayTrace(trace, 9 * c, "lru"));
    KV_ASSERT_OK_AND_ASSIGN(TieredReplayResult lru_tiered, ReplayTiered(trace, c, 8 * c, "lru"));
    EXPECT_EQ(lru_tiered.total.hit_blocks, lru_9c.hit_blocks) << "capacity " << c;
  }
}

// Mooncake's real conversation trace (FAST'25 release), which no policy was developed on: the
// issue's held-out check. Not in the shared data, so it runs only where KVRELAY_HELDOUT_TRACE
// names it (cachestore/README.md, "Held-out trace", says how to get it). Capacities are the
// table's plus 14k and 30k, where every single ranking but LRU falls below LRU (0.94x / 0.86x)
// and only the switch keeps the default at or above it.
TEST(ReplayTraceTest, HeldOutConversationTraceDefaultNeverBelowLru) {
  const char* path = std::getenv("KVRELAY_HELDOUT_TRACE");
  if (path == nullptr) GTEST_SKIP() << "KVRELAY_HELDOUT_TRACE not set";
  KV_ASSERT_OK_AND_ASSIGN(auto trace, LoadTrace(path));
  for (int64_t capacity : {1000, 2000, 6000, 14000, 20000, 30000}) {
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru, ReplayTrace(trace, capacity, "lru"));
    KV_ASSERT_OK_AND_ASSIGN(ReplayResult def, ReplayTrace(trace, capacity, kDefaultPolicy));
    std::printf("held-out capacity %lld: lru %.4f default %.4f (x%.3f)\n",
                static_cast<long long>(capacity), lru.hit_rate(), def.hit_rate(),
                def.hit_rate() / lru.hit_rate());
    EXPECT_GE(def.hit_rate(), lru.hit_rate()) << "capacity " << capacity;
    // Where capacity is tight the issue asks for 1.3x; measured 1.72x / 2.08x / 1.33x.
    if (capacity <= 6000) {
      EXPECT_GE(def.hit_rate(), 1.3 * lru.hit_rate()) << "capacity " << capacity;
    }
  }
  // As the store learns under load, from 1 in 2 / 4 / 8 chains more (its CPU budget). One root
  // block heads every request, so sampling by the root learned from all chains or none: at 6k
  // none (0.1393, LRU's), at 20k all, on shadows a quarter of the cache (0.2517, 0.88x LRU).
  // Measured with the key below the shared block: 0.1814-0.1815 and 0.2893-0.2973.
  for (int halvings : {1, 2, 3}) {
    ReplayOptions options;
    options.learner_halvings = halvings;
    for (int64_t capacity : {6000, 20000}) {
      KV_ASSERT_OK_AND_ASSIGN(ReplayResult lru, ReplayTrace(trace, capacity, "lru"));
      KV_ASSERT_OK_AND_ASSIGN(ReplayResult def,
                              ReplayTrace(trace, capacity, kDefaultPolicy, options));
      std::printf("held-out capacity %lld, learning from 1 in %d more: default %.4f (x%.3f)\n",
                  static_cast<long long>(capacity), 1 << halvings, def.hit_rate(),
                  def.hit_rate() / lru.hit_rate());
      EXPECT_GE(def.hit_rate(), lru.hit_rate()) << capacity << " / " << halvings;
      if (capacity == 6000) {
        EXPECT_GE(def.hit_rate(), 1.25 * lru.hit_rate()) << halvings;
      }
    }
  }
}

}  // namespace
}  // namespace kvrelay::cachestore::sim
