// Policy scenarios for the cache store over a SimulatedClock: no sleeps, time moves only when a
// scenario says so, and Tick() runs the time-driven work (TTL expiry, reclaim, watermarks).

#include "cachestore/cache_store.h"

#include <malloc.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/block_hash.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::cachestore {
namespace {

using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kBlockBytes = 4096;

// Real chained block hashes: tokens [start, start + n * 4) in blocks of 4, salted per tenant.
std::vector<BlockHash> Chain(const std::string& tenant, int n, int start = 0) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n * 4; ++i) tokens.push_back(start + i);
  return kv::HashChain(kv::LayoutFingerprint{}, tenant, tokens, 4);
}

// The scenario DSL: s.Node("a", 8); s.Commit(s.Chain(...), "a"); s.Advance(31s); s.Match(...).
class Scenario {
 public:
  explicit Scenario(std::string policy = "lrfu", std::string data_dir = "") {
    options_.policy = std::move(policy);
    options_.clock = &clock_;
    options_.data_dir = std::move(data_dir);
    options_.commit_timeout = absl::Seconds(30);
    options_.high_watermark = 1.0;
    options_.low_watermark = 1.0;
    Restart();
  }
  void Restart() {
    store_.reset();
    auto store = CacheStore::Create(options_);
    KV_CHECK(store.ok());
    store_ = *std::move(store);
  }
  CacheStoreOptions& options() { return options_; }
  CacheStore& store() { return *store_; }

  void Node(const std::string& id, int64_t slots, absl::Duration ttl = absl::Seconds(10),
            Tier tier = Tier::kHost) {
    NodeSpec spec;
    spec.node_id = id;
    spec.transport_kind = "inproc";
    spec.transport_address = id;
    spec.ttl = ttl;
    spec.segments.push_back(SegmentSpec{"seg0", tier, slots, kBlockBytes, "key-" + id});
    ASSERT_THAT(store_->RegisterNode(spec), IsOk());
  }
  absl::StatusOr<AllocateResult> Allocate(const std::vector<BlockHash>& chain,
                                          const std::string& on = "", BlockHash first_parent = {}) {
    AllocateArgs args;
    BlockHash parent = first_parent;
    for (const BlockHash& h : chain) {
      args.blocks.push_back({h, parent, kBlockBytes});
      parent = h;
    }
    args.preferred_node = on;
    return store_->Allocate(args, absl::InfiniteFuture());
  }
  // Allocate + Commit; returns the blocks committed.
  absl::StatusOr<int> Commit(const std::vector<BlockHash>& chain, const std::string& on = "",
                             BlockHash first_parent = {}) {
    absl::StatusOr<AllocateResult> a = Allocate(chain, on, first_parent);
    if (!a.ok()) return a.status();
    if (a->allocation_id == 0) return 0;
    return store_->Commit(a->allocation_id, {});
  }
  int Match(const std::vector<BlockHash>& chain, absl::Duration lease = absl::ZeroDuration()) {
    absl::StatusOr<MatchResult> r = store_->MatchPrefix(chain, lease);
    KV_CHECK(r.ok());
    last_lease_ = r->lease_id;
    last_match_ = *r;
    return r->matched;
  }
  uint64_t last_lease() const { return last_lease_; }
  const MatchResult& last_match() const { return last_match_; }
  void Advance(absl::Duration d) {
    clock_.Advance(d);
    store_->Tick();
  }
  void Heartbeat(const std::string& id) {
    absl::StatusOr<HeartbeatResult> r = store_->Heartbeat(id);
    ASSERT_TRUE(r.ok() && r->known) << id;
  }

 private:
  SimulatedClock clock_;
  CacheStoreOptions options_;
  std::unique_ptr<CacheStore> store_;
  uint64_t last_lease_ = 0;
  MatchResult last_match_;
};

TEST(ScenarioTest, BlocksAreVisibleOnlyAfterCommit) {
  Scenario s;
  s.Node("a", 16);
  auto chain = Chain("t", 4);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult alloc, s.Allocate(chain));
  ASSERT_EQ(alloc.blocks.size(), 4u);
  EXPECT_EQ(alloc.blocks[0].replicas[0].node_id, "a");
  EXPECT_EQ(s.Match(chain), 0);  // allocated, not committed
  KV_ASSERT_OK_AND_ASSIGN(int n, s.store().Commit(alloc.allocation_id, {chain[0], chain[1]}));
  EXPECT_EQ(n, 2);
  EXPECT_EQ(s.Match(chain), 2);
  KV_ASSERT_OK_AND_ASSIGN(n, s.store().Commit(alloc.allocation_id, {}));
  EXPECT_EQ(n, 2);
  EXPECT_EQ(s.Match(chain), 4);
  // Every replica is a distinct slot of the segment.
  std::set<int64_t> slots;
  for (const auto& b : s.last_match().blocks) slots.insert(b.replicas.at(0).slot);
  EXPECT_EQ(s.last_match().ReplicaLocation(2, 0).node_id, "a");
  EXPECT_EQ(s.last_match().segments.size(), 1u);
  EXPECT_EQ(slots.size(), 4u);
  // Allocating committed blocks again reserves nothing and points at the stored copies.
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult again, s.Allocate(chain));
  EXPECT_EQ(again.allocation_id, 0u);
  EXPECT_TRUE(again.blocks[3].already_committed);
}

TEST(ScenarioTest, AbandonedAllocationIsReclaimedAfterTimeout) {
  Scenario s;
  s.Node("a", 4, absl::Hours(1));
  auto chain = Chain("t", 4);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult alloc, s.Allocate(chain));
  // The node is full of uncommitted blocks: nothing evictable, so a new allocation fails.
  EXPECT_THAT(s.Allocate(Chain("t", 1, 1000)), StatusIs(absl::StatusCode::kResourceExhausted));
  s.Advance(absl::Seconds(29));
  EXPECT_EQ(s.store().Stats().allocated_blocks, 4);
  s.Advance(absl::Seconds(2));  // past the 30 s commit timeout
  EXPECT_EQ(s.store().Stats().allocated_blocks, 0);
  EXPECT_THAT(s.store().Commit(alloc.allocation_id, {}), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(s.Match(chain), 0);
  EXPECT_THAT(s.Commit(Chain("t", 4, 1000)), IsOk());  // the slots are free again
}

TEST(ScenarioTest, AbortFreesSlotsAndHidesBlocks) {
  Scenario s;
  s.Node("a", 2);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult alloc, s.Allocate(Chain("t", 2)));
  ASSERT_THAT(s.store().Abort(alloc.allocation_id), IsOk());
  EXPECT_THAT(s.store().Abort(alloc.allocation_id), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(s.Match(Chain("t", 2)), 0);
  EXPECT_THAT(s.Commit(Chain("u", 2)), IsOk());
}

TEST(ScenarioTest, LeasedBlocksAreNeverEvictedUntilReleased) {
  Scenario s;
  s.Node("a", 4, absl::Hours(1));
  auto chain = Chain("t", 4);
  ASSERT_THAT(s.Commit(chain), IsOk());
  ASSERT_EQ(s.Match(chain, absl::Seconds(60)), 4);
  const uint64_t lease = s.last_lease();
  ASSERT_NE(lease, 0u);
  EXPECT_THAT(s.Allocate(Chain("t", 1, 500)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("evictable")));
  EXPECT_EQ(s.Match(chain), 4);
  ASSERT_THAT(s.store().ReleaseLease(lease), IsOk());
  EXPECT_THAT(s.store().ReleaseLease(lease), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(s.Commit(Chain("t", 1, 500)), IsOk());
  EXPECT_EQ(s.Match(chain), 3);  // the leaf went, the prefix stayed
}

TEST(ScenarioTest, LeaseExpiresAfterItsTtl) {
  Scenario s;
  s.Node("a", 2, absl::Hours(1));
  auto chain = Chain("t", 2);
  ASSERT_THAT(s.Commit(chain), IsOk());
  ASSERT_EQ(s.Match(chain, absl::Seconds(5)), 2);
  EXPECT_EQ(s.store().Stats().active_leases, 1);
  s.Advance(absl::Seconds(4));
  EXPECT_THAT(s.Allocate(Chain("u", 1)), StatusIs(absl::StatusCode::kResourceExhausted));
  s.Advance(absl::Seconds(2));
  EXPECT_EQ(s.store().Stats().active_leases, 0);
  EXPECT_THAT(s.Commit(Chain("u", 1)), IsOk());
}

TEST(ScenarioTest, EvictionTakesLeavesFirstEvenWhenTheRootIsOlder) {
  // leaf-lru: plain recency would take chain A's root (least recently used) first.
  Scenario s("leaf-lru");
  s.Node("a", 4, absl::Hours(1));
  auto a = Chain("t", 3);
  ASSERT_THAT(s.Commit(a), IsOk());
  auto b = Chain("t", 1, 900);
  ASSERT_THAT(s.Commit(b), IsOk());
  ASSERT_THAT(s.Commit(Chain("t", 1, 950)), IsOk());  // needs one eviction
  EXPECT_EQ(s.Match(a), 2);                           // A's leaf went; its root and middle stay
  ASSERT_THAT(s.Commit(Chain("t", 1, 990)), IsOk());
  ASSERT_THAT(s.Commit(Chain("t", 1, 995)), IsOk());
  // Leaves go before parents at every step: A shrinks from the end, never loses its root early.
  const int left = s.Match(a);
  EXPECT_LE(left, 2);
  for (int i = 0; i < left; ++i) EXPECT_EQ(s.last_match().blocks[i].hash, a[i]);
}

TEST(ScenarioTest, FrequentPrefixSurvivesAScanUnderLrfu) {
  Scenario s("lrfu");
  s.Node("a", 8, absl::Hours(1));
  auto hot = Chain("t", 2);
  ASSERT_THAT(s.Commit(hot), IsOk());
  for (int i = 0; i < 5; ++i) ASSERT_EQ(s.Match(hot), 2);
  // A scan of 12 one-off blocks through 6 free-able slots.
  for (int i = 0; i < 12; ++i) ASSERT_THAT(s.Commit(Chain("scan", 1, 100 * (i + 1))), IsOk());
  EXPECT_EQ(s.Match(hot), 2);
}

TEST(ScenarioTest, NodeThatMissesHeartbeatsLosesItsBlocks) {
  Scenario s;
  s.Node("a", 8, absl::Seconds(10));
  s.Node("b", 8, absl::Seconds(10));
  auto on_a = Chain("t", 3);
  auto on_b = Chain("t", 3, 100);
  ASSERT_THAT(s.Commit(on_a, "a"), IsOk());
  ASSERT_THAT(s.Commit(on_b, "b"), IsOk());
  for (int i = 0; i < 3; ++i) {
    s.Advance(absl::Seconds(4));
    s.Heartbeat("b");  // only b keeps beating
  }
  // a is suspect: its blocks are skipped, not yet dropped.
  EXPECT_EQ(s.Match(on_a), 0);
  EXPECT_EQ(s.Match(on_b), 3);
  EXPECT_EQ(s.store().Stats().nodes, 1);
  EXPECT_EQ(s.store().Stats().suspect_nodes, 1);
  for (int i = 0; i < 8; ++i) {  // past the 30 s grace period: forgotten
    s.Advance(absl::Seconds(4));
    s.Heartbeat("b");
  }
  EXPECT_FALSE(s.store().Heartbeat("a")->known);
  EXPECT_EQ(s.store().Stats().nodes, 1);
  EXPECT_EQ(s.store().Stats().suspect_nodes, 0);
  EXPECT_EQ(s.store().Stats().committed_blocks, 3);
}

TEST(ScenarioTest, NodeDeathTakesDescendantsStoredElsewhere) {
  Scenario s;
  s.Node("a", 8, absl::Seconds(10));
  s.Node("b", 8, absl::Seconds(10));
  auto chain = Chain("t", 4);
  ASSERT_THAT(s.Commit({chain[0], chain[1]}, "a"), IsOk());
  ASSERT_THAT(s.Commit({chain[2], chain[3]}, "b", chain[1]), IsOk());
  ASSERT_EQ(s.Match(chain), 4);
  EXPECT_EQ(s.store().QueryPrefix(chain).at(0).node_id, "a");
  for (int i = 0; i < 11; ++i) {  // a stays silent past its TTL and the grace period
    s.Advance(absl::Seconds(4));
    s.Heartbeat("b");
  }
  // a died: its blocks go, and b's blocks (children of a's) go too — no orphan is kept.
  EXPECT_EQ(s.Match(chain), 0);
  EXPECT_EQ(s.store().Stats().committed_blocks, 0);
  EXPECT_EQ(s.store().Stats().nodes, 1);
}

TEST(ScenarioTest, ReplicasLandOnDistinctNodesAndSurviveOneDeath) {
  Scenario s;
  s.Node("a", 8, absl::Seconds(10));
  s.Node("b", 8, absl::Seconds(10));
  AllocateArgs args;
  auto chain = Chain("t", 2);
  args.blocks = {{chain[0], {}, kBlockBytes}, {chain[1], chain[0], kBlockBytes}};
  args.replicas = 2;
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult alloc, s.store().Allocate(args, absl::InfiniteFuture()));
  ASSERT_EQ(alloc.blocks[0].replicas.size(), 2u);
  EXPECT_NE(alloc.blocks[0].replicas[0].node_id, alloc.blocks[0].replicas[1].node_id);
  ASSERT_THAT(s.store().Commit(alloc.allocation_id, {}), IsOk());
  s.Advance(absl::Seconds(6));
  s.Heartbeat("b");
  s.Advance(absl::Seconds(6));
  ASSERT_EQ(s.Match(chain), 2);
  EXPECT_EQ(s.last_match().blocks[0].replicas.size(), 1u);
  EXPECT_EQ(s.last_match().ReplicaLocation(0, 0).node_id, "b");
}

// A node that received blocks committed elsewhere keeps a copy: with add_local_replicas its
// allocation gets a slot for each such block, Commit lists it as one more replica, and the
// block survives the first holder's death. Without the flag the blocks come back committed.
TEST(ScenarioTest, AddLocalReplicasGivesACommittedBlockASecondHolder) {
  Scenario s;
  NodeSpec b;
  b.node_id = "b";
  b.incarnation = 77;
  b.transport_kind = "inproc";
  b.transport_address = "b";
  b.segments.push_back(SegmentSpec{"seg0", Tier::kHost, 8, kBlockBytes, "key-b"});
  ASSERT_THAT(s.store().RegisterNode(b), IsOk());  // first: node index 0
  s.Node("a", 8, absl::Seconds(10));
  const Caller caller{"b", 77};
  const auto chain = Chain("t", 3);
  ASSERT_THAT(s.Commit({chain[0], chain[1]}, "a"), kvrelay::testing::IsOkAndHolds(2));
  auto allocate = [&](bool keep) {
    AllocateArgs args;
    args.blocks = {{chain[0], {}, kBlockBytes},
                   {chain[1], chain[0], kBlockBytes},
                   {chain[2], chain[1], kBlockBytes}};
    args.caller = caller;
    args.add_local_replicas = keep;
    return s.store().Allocate(args, absl::InfiniteFuture());
  };
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult plain, allocate(false));
  EXPECT_TRUE(plain.blocks[0].already_committed);
  EXPECT_TRUE(plain.blocks[1].already_committed);
  ASSERT_THAT(s.store().Abort(plain.allocation_id, caller), IsOk());

  KV_ASSERT_OK_AND_ASSIGN(AllocateResult keep, allocate(true));
  ASSERT_EQ(keep.blocks.size(), 3u);
  for (const auto& block : keep.blocks) {
    EXPECT_FALSE(block.already_committed);
    ASSERT_EQ(block.replicas.size(), 1u);
    EXPECT_EQ(block.replicas[0].node_id, "b");
  }
  ASSERT_THAT(s.store().Commit(keep.allocation_id, {}, caller), kvrelay::testing::IsOkAndHolds(3));
  ASSERT_EQ(s.Match(chain), 3);
  EXPECT_EQ(s.last_match().blocks[0].replicas.size(), 2u);
  EXPECT_EQ(s.last_match().blocks[2].replicas.size(), 1u);
  // "a" goes silent and is forgotten: b's copies keep the whole chain.
  for (int i = 0; i < 8; ++i) {
    s.Advance(absl::Seconds(6));
    s.Heartbeat("b");
  }
  ASSERT_EQ(s.Match(chain), 3);
  EXPECT_EQ(s.last_match().ReplicaLocation(0, 0).node_id, "b");
}

TEST(ScenarioTest, PlacementPrefersTheRequestedTierAndNode) {
  Scenario s;
  s.Node("gpu0", 8, absl::Hours(1), Tier::kGpu);
  s.Node("host0", 8, absl::Hours(1), Tier::kHost);
  AllocateArgs args;
  auto chain = Chain("t", 1);
  args.blocks = {{chain[0], {}, kBlockBytes}};
  args.preferred_tier = Tier::kHost;
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult r, s.store().Allocate(args, absl::InfiniteFuture()));
  EXPECT_EQ(r.blocks[0].replicas[0].node_id, "host0");
  EXPECT_EQ(r.blocks[0].replicas[0].tier, Tier::kHost);
  auto other = Chain("t", 1, 50);
  args.blocks = {{other[0], {}, kBlockBytes}};
  args.preferred_tier = Tier::kUnspecified;  // fastest tier with room
  KV_ASSERT_OK_AND_ASSIGN(r, s.store().Allocate(args, absl::InfiniteFuture()));
  EXPECT_EQ(r.blocks[0].replicas[0].node_id, "gpu0");
  // Too big for any slot: nothing to evict can help.
  args.blocks = {{Chain("t", 1, 70)[0], {}, kBlockBytes * 2}};
  EXPECT_THAT(s.store().Allocate(args, absl::InfiniteFuture()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("blocks[0]")));
}

// A node's disk tier (an SSD segment): never a placement target; what its slots hold is what
// the node announces; prefixes go on into it where DRAM ends, and QueryPrefix says how much of
// a node's run is on disk.
TEST(ScenarioTest, ADiskTierIsAnnouncedNotPlacedAndExtendsPrefixes) {
  Scenario s;
  NodeSpec spec;
  spec.node_id = "w";
  spec.incarnation = 7;
  spec.transport_kind = "inproc";
  spec.transport_address = "w";
  spec.ttl = absl::Hours(1);
  spec.segments.push_back(SegmentSpec{"kv", Tier::kHost, 2, kBlockBytes, "key-w"});
  spec.segments.push_back(SegmentSpec{"disk", Tier::kSsd, 16, kBlockBytes + 4096, ""});
  ASSERT_THAT(s.store().RegisterNode(spec), IsOk());
  const Caller w{"w", 7};
  // Own-node allocations go to DRAM only (2 slots), evicting there, never onto the disk.
  const auto chain = Chain("t", 2);
  for (int i = 0; i < 4; ++i) {
    AllocateArgs args;
    args.caller = w;
    args.blocks = {{Chain("r", 1, 1000 * (i + 1))[0], {}, kBlockBytes}};
    KV_ASSERT_OK_AND_ASSIGN(AllocateResult r, s.store().Allocate(args, absl::InfiniteFuture()));
    ASSERT_EQ(r.blocks[0].replicas.size(), 1u);
    EXPECT_EQ(r.blocks[0].replicas[0].segment_id, "kv") << i;
    KV_ASSERT_OK_AND_ASSIGN(int n, s.store().Commit(r.allocation_id, {}, w));
    EXPECT_EQ(n, 1);
  }
  EXPECT_LE(s.store().Stats().committed_blocks, 2);
  // The node demoted blocks 0 and 1 to its disk (slots 3 and 5).
  KV_ASSERT_OK_AND_ASSIGN(AnnounceResult a,
                          s.store().AnnounceBlocks(w, "disk",
                                                   std::vector<AnnouncedBlock>{
                                                       {chain[0], {}, 3, kBlockBytes},
                                                       {chain[1], {}, 5, kBlockBytes},
                                                   }));
  EXPECT_EQ(a.accepted, 2);
  EXPECT_EQ(s.store().Stats().disk_blocks, 2);
  // Blocks 0 and 1 are on disk only: a match of 2, with SSD locations, no lease needed.
  EXPECT_EQ(s.Match({chain[0], chain[1]}), 2);
  EXPECT_EQ(s.last_match().ReplicaLocation(0, 0).tier, Tier::kSsd);
  EXPECT_EQ(s.last_match().ReplicaLocation(0, 0).segment_id, "disk");
  EXPECT_EQ(s.last_match().ReplicaLocation(1, 0).slot, 5u);
  EXPECT_EQ(s.store().counters().prefix_hit_blocks_by_tier[static_cast<size_t>(Tier::kSsd)].load(),
            2);
  std::vector<NodePrefix> q = s.store().QueryPrefix({chain[0], chain[1]});
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q[0].node_id, "w");
  EXPECT_EQ(q[0].matched, 2);
  EXPECT_EQ(q[0].disk_blocks, 2);
  // The slot rewritten with another block: the first is gone from there; a zero hash empties it.
  const auto other = Chain("t", 1, 500);
  KV_ASSERT_OK_AND_ASSIGN(
      a, s.store().AnnounceBlocks(w, "disk", std::vector<AnnouncedBlock>{{other[0], {}, 3, 1}}));
  EXPECT_EQ(s.Match({chain[0]}), 0);
  EXPECT_EQ(s.Match(other), 1);
  KV_ASSERT_OK_AND_ASSIGN(
      a, s.store().AnnounceBlocks(w, "disk", std::vector<AnnouncedBlock>{{BlockHash{}, {}, 3, 1}}));
  EXPECT_EQ(s.Match(other), 0);
  EXPECT_EQ(s.store().Stats().disk_blocks, 1);
  // Out of the segment's range: refused.
  KV_ASSERT_OK_AND_ASSIGN(
      a, s.store().AnnounceBlocks(w, "disk", std::vector<AnnouncedBlock>{{other[0], {}, 16, 1}}));
  ASSERT_EQ(a.rejected.size(), 1u);
  EXPECT_EQ(a.rejected[0].second, AnnounceRejection::kBadInput);
  // The disk tier counts as SSD in Stats, and not in the DRAM slot totals.
  bool saw_ssd = false;
  for (const TierUsage& u : s.store().Stats().tiers) {
    if (u.tier != Tier::kSsd) continue;
    saw_ssd = true;
    EXPECT_EQ(u.capacity_slots, 16);
    EXPECT_EQ(u.used_slots, 1);
  }
  EXPECT_TRUE(saw_ssd);
  // Its disk replicas go with the node.
  ASSERT_THAT(s.store().DeregisterNode(w), IsOk());
  EXPECT_EQ(s.store().Stats().disk_blocks, 0);
  EXPECT_TRUE(s.store().QueryPrefix({chain[1]}).empty());
}

// Block events of a disk tier say so (the KV events' medium DISK).
TEST(ScenarioTest, DiskTierEventsCarryTheirTier) {
  Scenario s;
  NodeSpec spec;
  spec.node_id = "w";
  spec.incarnation = 9;
  spec.transport_kind = "inproc";
  spec.transport_address = "w";
  spec.ttl = absl::Hours(1);
  spec.segments.push_back(SegmentSpec{"kv", Tier::kHost, 2, kBlockBytes, "key-w"});
  spec.segments.push_back(SegmentSpec{"disk", Tier::kSsd, 4, kBlockBytes, ""});
  ASSERT_THAT(s.store().RegisterNode(spec), IsOk());
  const uint64_t from = s.store().last_sequence() + 1;
  const auto chain = Chain("t", 2);
  const Caller w{"w", 9};
  ASSERT_THAT(
      s.store().AnnounceBlocks(w, "disk", std::vector<AnnouncedBlock>{{chain[0], {}, 0, 1}}),
      IsOk());
  ASSERT_THAT(
      s.store().AnnounceBlocks(w, "disk", std::vector<AnnouncedBlock>{{chain[1], {}, 0, 1}}),
      IsOk());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<StoreEvent> events,
                          s.store().EventsSince(from, 10, absl::Now()));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].kind, StoreEvent::Kind::kStored);
  EXPECT_EQ(events[0].hash, chain[0]);
  EXPECT_EQ(events[1].kind, StoreEvent::Kind::kRemoved);
  EXPECT_EQ(events[1].hash, chain[0]);
  EXPECT_EQ(events[2].kind, StoreEvent::Kind::kStored);
  EXPECT_EQ(events[2].hash, chain[1]);
  for (const StoreEvent& e : events) {
    EXPECT_EQ(e.tier, Tier::kSsd);
    EXPECT_THAT(e.node_ids, ::testing::ElementsAre("w"));
  }
}

TEST(ScenarioTest, HitsAreCountedByTheFastestTierHoldingEachBlock) {
  Scenario s;
  s.Node("gpu0", 8, absl::Hours(1), Tier::kGpu);
  s.Node("host0", 8, absl::Hours(1), Tier::kHost);
  const auto on_gpu = Chain("t", 2);
  const auto on_host = Chain("t", 3, 100);
  ASSERT_THAT(s.Commit(on_gpu, "gpu0"), IsOk());
  ASSERT_THAT(s.Commit(on_host, "host0"), IsOk());
  ASSERT_EQ(s.Match(on_gpu), 2);
  ASSERT_EQ(s.Match(on_host), 3);
  ASSERT_EQ(s.Match(Chain("t", 2, 200)), 0);
  const StoreCounters& c = s.store().counters();
  EXPECT_EQ(c.prefix_hit_blocks_by_tier[static_cast<size_t>(Tier::kGpu)].load(), 2);
  EXPECT_EQ(c.prefix_hit_blocks_by_tier[static_cast<size_t>(Tier::kHost)].load(), 3);
  EXPECT_EQ(c.prefix_hit_blocks_by_tier[static_cast<size_t>(Tier::kSsd)].load(), 0);
  EXPECT_EQ(c.prefix_hit_blocks.load(), 5);
}

TEST(ScenarioTest, WatermarkEvictionRunsOnTick) {
  Scenario s;
  s.options().high_watermark = 0.75;
  s.options().low_watermark = 0.5;
  s.Restart();
  s.Node("a", 8, absl::Hours(1));
  for (int i = 0; i < 7; ++i) ASSERT_THAT(s.Commit(Chain("t", 1, 10 * i)), IsOk());
  s.Advance(absl::Milliseconds(100));
  EXPECT_EQ(s.store().Stats().committed_blocks, 4);
  EXPECT_EQ(s.store().Stats().evictions, 3);
}

TEST(ScenarioTest, EventsCarrySequenceNumbersAndResume) {
  Scenario s("leaf-lru");
  s.Node("a", 2, absl::Hours(1));
  auto chain = Chain("t", 2);
  ASSERT_THAT(s.Commit(chain), IsOk());
  ASSERT_THAT(s.Commit(Chain("u", 1)), IsOk());  // evicts chain's leaf
  KV_ASSERT_OK_AND_ASSIGN(auto events, s.store().EventsSince(1, 100, absl::Now()));
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].kind, StoreEvent::Kind::kNodeJoined);  // the registration
  EXPECT_EQ(events[0].node.node_id, "a");
  EXPECT_EQ(events[1].kind, StoreEvent::Kind::kStored);
  EXPECT_EQ(events[1].hash, chain[0]);
  EXPECT_EQ(events[2].parent, chain[0]);
  EXPECT_EQ(events[3].kind, StoreEvent::Kind::kRemoved);
  EXPECT_EQ(events[3].hash, chain[1]);
  for (size_t i = 0; i < events.size(); ++i) EXPECT_EQ(events[i].sequence, i + 1);
  KV_ASSERT_OK_AND_ASSIGN(auto tail, s.store().EventsSince(4, 100, absl::Now()));
  ASSERT_EQ(tail.size(), 2u);
  EXPECT_EQ(tail[0].sequence, 4u);
}

TEST(TenancyTest, SameSaltHits) {
  Scenario s;
  s.Node("a", 16);
  ASSERT_THAT(s.Commit(Chain("tenant-a", 4)), IsOk());
  EXPECT_EQ(s.Match(Chain("tenant-a", 4)), 4);
}

TEST(TenancyTest, DifferentSaltMisses) {
  Scenario s;
  s.Node("a", 16);
  ASSERT_THAT(s.Commit(Chain("tenant-a", 4)), IsOk());
  EXPECT_EQ(s.Match(Chain("tenant-b", 4)), 0);  // same tokens, other tenant
}

TEST(BadInputTest, FieldsAreNamed) {
  Scenario s;
  s.Node("a", 4);
  auto chain = Chain("t", 2);
  AllocateArgs args;
  EXPECT_THAT(s.store().Allocate(args, absl::InfiniteFuture()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks")));
  args.blocks = {{chain[0], {}, kBlockBytes}};
  args.replicas = 9;
  EXPECT_THAT(s.store().Allocate(args, absl::InfiniteFuture()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("replicas")));
  args.replicas = 1;
  args.blocks = {{chain[0], {}, 0}};
  EXPECT_THAT(s.store().Allocate(args, absl::InfiniteFuture()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks[0].size_bytes")));
  args.blocks = {{chain[1], chain[0], kBlockBytes}};
  EXPECT_THAT(s.store().Allocate(args, absl::InfiniteFuture()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("blocks[0].parent")));
  args.blocks = {{chain[0], {}, kBlockBytes}, {chain[0], {}, kBlockBytes}};
  EXPECT_THAT(s.store().Allocate(args, absl::InfiniteFuture()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocks[1].hash")));
  EXPECT_THAT(s.store().MatchPrefix(chain, absl::Hours(2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lease_ttl_ms")));
  EXPECT_THAT(s.store().Commit(12345, {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("allocation_id")));
  // Nothing leaked: the node still has all 4 slots.
  EXPECT_THAT(s.Commit(Chain("t", 4, 300)), IsOk());
  CacheStoreOptions bad;
  bad.policy = "lru";
  EXPECT_THAT(CacheStore::Create(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("policy")));
}

TEST(DurabilityTest, RestartReplaysCommittedBlocksButNotAllocations) {
  testing::TempDir dir;
  auto committed = Chain("t", 3);
  auto pending = Chain("t", 2, 700);
  {
    Scenario s("lrfu", dir.path());
    s.options().wal_fsync = false;
    s.Node("a", 16, absl::Seconds(10));
    ASSERT_THAT(s.Commit(committed), IsOk());
    ASSERT_THAT(s.Allocate(pending), IsOk());
    s.Restart();  // the process "dies" and comes back on the same data dir
    EXPECT_EQ(s.Match(committed), 3);
    EXPECT_EQ(s.Match(pending), 0);
    EXPECT_EQ(s.store().Stats().allocated_blocks, 0);
    // Slots of replayed blocks are taken: 13 more fit, the 14th needs an eviction.
    ASSERT_THAT(s.Commit(Chain("t", 13, 2000)), IsOk());
    EXPECT_EQ(s.store().Stats().evictions, 0);
    // The recovered node gets one TTL to heartbeat, then goes with its blocks.
    s.Advance(absl::Seconds(11));
    EXPECT_EQ(s.Match(committed), 0);
  }
}

TEST(DurabilityTest, SnapshotPlusLogReplay) {
  testing::TempDir dir;
  auto first = Chain("t", 4);
  auto second = Chain("t", 3, 400);
  {
    Scenario s("lrfu", dir.path());
    s.options().snapshot_every_ops = 3;  // snapshot after a few records
    s.Restart();
    s.Node("a", 16, absl::Hours(1));
    ASSERT_THAT(s.Commit(first), IsOk());
    ASSERT_THAT(s.Commit(second), IsOk());
    const uint64_t seq = s.store().last_sequence();
    s.Restart();
    EXPECT_EQ(s.Match(first), 4);
    EXPECT_EQ(s.Match(second), 3);
    // Sequence numbers survive restarts and never go back (numbers may be skipped).
    EXPECT_GE(s.store().last_sequence(), seq);
    ASSERT_THAT(s.store().WriteSnapshotNow(), IsOk());
    s.Restart();
    EXPECT_EQ(s.Match(first), 4);
  }
}

// The tokens Chain(tenant, n, start) hashed: [start, start + n * 4).
std::vector<int32_t> ChainTokens(int n, int start = 0) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n * 4; ++i) tokens.push_back(start + i);
  return tokens;
}

// Makes `s` a store that keeps block tokens (it runs a KV-event publisher), with blocks of 4
// tokens as Chain's.
void KeepTokens(Scenario& s) {
  s.options().block_tokens = 4;
  s.options().keep_block_tokens = true;
  s.options().wal_fsync = false;
  s.Restart();
}

TEST(BlockTokensTest, CommittedTokensReachTheEventAndGoWithTheBlock) {
  Scenario s("leaf-lru");
  KeepTokens(s);
  s.Node("a", 3, absl::Hours(1));
  const auto chain = Chain("t", 2, 100);
  const std::vector<int32_t> tokens = ChainTokens(2, 100);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult a, s.Allocate(chain));
  KV_ASSERT_OK_AND_ASSIGN(int n, s.store().Commit(a.allocation_id, chain, {}, tokens));
  EXPECT_EQ(n, 2);
  KV_ASSERT_OK_AND_ASSIGN(auto events, s.store().EventsSince(1, 100, absl::Now()));
  ASSERT_EQ(events.size(), 3u);  // joined, stored x2
  EXPECT_EQ(events[1].kind, StoreEvent::Kind::kStored);
  EXPECT_EQ(events[1].hash, chain[0]);
  EXPECT_EQ(events[1].token_ids, std::vector<int32_t>({100, 101, 102, 103}));
  EXPECT_EQ(events[2].token_ids, std::vector<int32_t>({104, 105, 106, 107}));
  EXPECT_EQ(s.store().TokensOf(chain[1]), std::vector<int32_t>({104, 105, 106, 107}));
  EXPECT_EQ(s.store().kept_token_blocks(), 2u);
  // Two more blocks in a 3-slot node: chain's leaf is evicted, and its tokens with it.
  ASSERT_THAT(s.Commit(Chain("u", 2)), IsOk());
  EXPECT_EQ(s.Match(chain), 1);
  EXPECT_TRUE(s.store().TokensOf(chain[1]).empty());
  EXPECT_EQ(s.store().kept_token_blocks(), 1u);  // chain[0]; "u" was committed without tokens
  // The node leaves: every block goes, every token with it.
  ASSERT_THAT(s.store().DeregisterNode({"a", 0}), IsOk());
  EXPECT_EQ(s.store().kept_token_blocks(), 0u);
}

TEST(BlockTokensTest, WrongLengthIsRefusedNamingBothNumbers) {
  Scenario s;
  KeepTokens(s);
  s.Node("a", 8, absl::Hours(1));
  const auto chain = Chain("t", 2);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult a, s.Allocate(chain));
  std::vector<int32_t> tokens = ChainTokens(2);
  tokens.pop_back();
  EXPECT_THAT(s.store().Commit(a.allocation_id, chain, {}, tokens),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("token_ids: 7 tokens for 2 hashes of 4 tokens each (want 8)")));
  // Tokens without the hashes they belong to.
  EXPECT_THAT(s.store().Commit(a.allocation_id, {}, {}, ChainTokens(2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("8 tokens for 0 hashes")));
  // Nothing was committed by the refused calls.
  EXPECT_EQ(s.Match(chain), 0);
  KV_ASSERT_OK_AND_ASSIGN(int n, s.store().Commit(a.allocation_id, chain, {}, ChainTokens(2)));
  EXPECT_EQ(n, 2);
}

TEST(BlockTokensTest, WithoutAPublisherTokensAreNotKept) {
  Scenario s;
  s.options().block_tokens = 4;
  s.Restart();
  s.Node("a", 8, absl::Hours(1));
  const auto chain = Chain("t", 2);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult a, s.Allocate(chain));
  ASSERT_THAT(s.store().Commit(a.allocation_id, chain, {}, ChainTokens(2)), IsOk());
  EXPECT_EQ(s.store().kept_token_blocks(), 0u);
  KV_ASSERT_OK_AND_ASSIGN(auto events, s.store().EventsSince(1, 100, absl::Now()));
  for (const StoreEvent& e : events) EXPECT_TRUE(e.token_ids.empty());
}

// Tokens are never written to disk: after a restart the recovered blocks have none (not
// garbage), and their state resend carries empty token_ids; new commits carry tokens again.
TEST(BlockTokensTest, RestartFromTheWalKeepsNoTokens) {
  testing::TempDir dir;
  Scenario s("lrfu", dir.path());
  KeepTokens(s);
  s.Node("a", 16, absl::Hours(1));
  const auto first = Chain("t", 3);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult a, s.Allocate(first));
  ASSERT_THAT(s.store().Commit(a.allocation_id, first, {}, ChainTokens(3)), IsOk());
  ASSERT_EQ(s.store().kept_token_blocks(), 3u);
  // The log holds no token: the tokens' bytes (as 32-bit little-endian) appear nowhere in it.
  KV_ASSERT_OK_AND_ASSIGN(std::string wal, ReadFileToString(dir.path() + "/wal.log"));
  const std::string token_bytes("\x04\x00\x00\x00\x05\x00\x00\x00\x06\x00\x00\x00", 12);
  EXPECT_EQ(wal.find(token_bytes), std::string::npos);
  s.Restart();
  EXPECT_EQ(s.Match(first), 3);
  EXPECT_EQ(s.store().kept_token_blocks(), 0u);
  for (const BlockHash& h : first) EXPECT_TRUE(s.store().TokensOf(h).empty());
  ASSERT_THAT(s.store().WriteSnapshotNow(), IsOk());  // a snapshot has none either
  s.Restart();
  EXPECT_EQ(s.store().kept_token_blocks(), 0u);
  const auto second = Chain("t", 1, 500);
  KV_ASSERT_OK_AND_ASSIGN(a, s.Allocate(second));
  const uint64_t from = s.store().last_sequence() + 1;
  ASSERT_THAT(s.store().Commit(a.allocation_id, second, {}, ChainTokens(1, 500)), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(auto events, s.store().EventsSince(from, 100, absl::Now()));
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind, StoreEvent::Kind::kStored);
  EXPECT_EQ(events.back().token_ids, ChainTokens(1, 500));
}

// The replication stream carries the tokens (a standby's events keep them after promotion);
// the standby's own WAL does not.
TEST(BlockTokensTest, ReplicationCarriesTokensToAStandby) {
  Scenario leader;
  KeepTokens(leader);
  leader.store().EnableReplicationLog();
  leader.Node("a", 8, absl::Hours(1));
  const auto chain = Chain("t", 2);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult a, leader.Allocate(chain));
  ASSERT_THAT(leader.store().Commit(a.allocation_id, chain, {}, ChainTokens(2)), IsOk());
  uint64_t position = 0;
  std::vector<WalOp> snapshot = leader.store().ReplicationSnapshot(&position);
  testing::TempDir dir;
  Scenario standby("lrfu", dir.path());
  KeepTokens(standby);
  std::vector<WalOp> decoded;
  for (const WalOp& op : snapshot) {
    KV_ASSERT_OK_AND_ASSIGN(WalOp d, DecodeWalOp(EncodeWalOp(op, WalTokens::kInclude)));
    decoded.push_back(std::move(d));
  }
  ASSERT_THAT(standby.store().ApplyReplicated(decoded), IsOk());
  EXPECT_EQ(standby.store().TokensOf(chain[1]), std::vector<int32_t>({4, 5, 6, 7}));
  // A live op too: one more block.
  const auto more = Chain("t", 1, 900);
  KV_ASSERT_OK_AND_ASSIGN(a, leader.Allocate(more));
  ASSERT_THAT(leader.store().Commit(a.allocation_id, more, {}, ChainTokens(1, 900)), IsOk());
  uint64_t next = 0;
  KV_ASSERT_OK_AND_ASSIGN(std::vector<WalOp> ops,
                          leader.store().ReplicationSince(position, 100, absl::Now(), &next));
  decoded.clear();
  for (const WalOp& op : ops) {
    KV_ASSERT_OK_AND_ASSIGN(WalOp d, DecodeWalOp(EncodeWalOp(op, WalTokens::kInclude)));
    decoded.push_back(std::move(d));
  }
  ASSERT_THAT(standby.store().ApplyReplicated(decoded), IsOk());
  EXPECT_EQ(standby.store().TokensOf(more[0]), ChainTokens(1, 900));
  // Promoted, the standby resends its state with the tokens; its disk never had them.
  standby.store().PromoteToLeader();
  EXPECT_EQ(standby.store().kept_token_blocks(), 3u);
  standby.Restart();
  EXPECT_EQ(standby.Match(chain), 2);
  EXPECT_EQ(standby.store().kept_token_blocks(), 0u);
}

// What keeping tokens costs per block (cachestore/README.md quotes the figure): the heap of a
// store that keeps them minus that of one that does not, after the same commits of 16-token
// blocks. Event retention is kept tiny in both, so only the per-block map is measured (the
// retained events' copies are bounded by event_retention, not by the cache).
TEST(BlockTokensTest, MemoryPerBlock) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan's allocator does not report through mallinfo2";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer)
  GTEST_SKIP() << "the sanitizer's allocator does not report through mallinfo2";
#endif
#endif
  constexpr int kBlocks = 20000, kBatch = 1000, kTokens = 16;
  size_t grown[2] = {0, 0};
  for (bool keep : {false, true}) {
    Scenario s;
    s.options().block_tokens = kTokens;
    s.options().keep_block_tokens = keep;
    s.options().event_retention = 16;
    s.Restart();
    s.Node("a", kBlocks, absl::Hours(1));
    const auto chain = Chain("t", kBlocks);  // hashes only: the store does not rehash tokens
    std::vector<int32_t> tokens(static_cast<size_t>(kBatch) * kTokens, 7);
    // Large tables come from mmap: hblkhd counts those, uordblks the rest.
    auto heap = [] {
      const struct mallinfo2 m = mallinfo2();
      return m.uordblks + m.hblkhd;
    };
    const size_t before = heap();
    for (int b = 0; b < kBlocks; b += kBatch) {
      const std::vector<BlockHash> part(chain.begin() + b, chain.begin() + b + kBatch);
      KV_ASSERT_OK_AND_ASSIGN(AllocateResult a,
                              s.Allocate(part, "", b == 0 ? BlockHash{} : chain[b - 1]));
      KV_ASSERT_OK_AND_ASSIGN(int n, s.store().Commit(a.allocation_id, part, {}, tokens));
      ASSERT_EQ(n, kBatch);
    }
    const size_t after = heap();
    grown[keep ? 1 : 0] = after > before ? after - before : 0;
    EXPECT_EQ(s.store().kept_token_blocks(), keep ? static_cast<size_t>(kBlocks) : 0u);
  }
  const double per_block =
      (static_cast<double>(grown[1]) - static_cast<double>(grown[0])) / kBlocks;
  std::printf(
      "kept tokens: %.0f bytes per block of %d tokens (%d blocks; heap grew %zu B with "
      "tokens kept, %zu B without)\n",
      per_block, kTokens, kBlocks, grown[1], grown[0]);
  EXPECT_GE(per_block, kTokens * 4.0);  // at least the tokens themselves
  EXPECT_LE(per_block, 256.0);
}

}  // namespace
}  // namespace kvrelay::cachestore
