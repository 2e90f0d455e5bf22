// The cache store's robustness on a SimulatedClock (issues 10 and 13): node identity
// (incarnations), soft state (suspect before forgotten, re-announcing blocks), own-node placement
// with eviction and no slot leaks, event sequence numbers across crashes and log replay, bounded
// inputs and caller-bound ids.

#include <algorithm>
#include <cstdio>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "cachestore/cache_store.h"
#include "common/check.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/block_hash.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::cachestore {
namespace {

using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint64_t kBlockBytes = 4096;

std::vector<BlockHash> Chain(const std::string& tenant, int n, int start = 0) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n * 4; ++i) tokens.push_back(start + i);
  return kv::HashChain(kv::LayoutFingerprint{}, tenant, tokens, 4);
}

class StoreFixture {
 public:
  explicit StoreFixture(std::string data_dir = "") {
    options_.clock = &clock_;
    options_.data_dir = std::move(data_dir);
    options_.wal_fsync = false;
    options_.high_watermark = 1.0;
    options_.low_watermark = 1.0;
    options_.default_node_ttl = absl::Seconds(10);
    options_.suspect_grace = absl::Seconds(30);
    Restart();
  }
  // A new store process on the same data dir (the old one is dropped without a final
  // snapshot, like kill -9).
  void Restart() {
    store_.reset();
    auto store = CacheStore::Create(options_);
    KV_CHECK(store.ok());
    store_ = *std::move(store);
  }
  CacheStore& store() { return *store_; }
  CacheStoreOptions& options() { return options_; }

  static NodeSpec Spec(const std::string& id, uint64_t incarnation, int64_t slots,
                       NodeRole role = NodeRole::kPrefill) {
    NodeSpec spec;
    spec.node_id = id;
    spec.incarnation = incarnation;
    spec.role = role;
    spec.grpc_address = id + ".grpc:7100";
    spec.transport_kind = "ucx";
    spec.transport_address = id + ".data:13337";
    spec.ttl = absl::Seconds(10);
    if (slots > 0) spec.segments.push_back({"kv", Tier::kHost, slots, kBlockBytes, "key-" + id});
    return spec;
  }
  absl::StatusOr<RegisterResult> Register(const std::string& id, uint64_t incarnation,
                                          int64_t slots, NodeRole role = NodeRole::kPrefill) {
    return store_->RegisterNode(Spec(id, incarnation, slots, role));
  }
  absl::StatusOr<AllocateResult> Allocate(const Caller& caller, const std::vector<BlockHash>& chain,
                                          BlockHash first_parent = {}) {
    AllocateArgs args;
    BlockHash parent = first_parent;
    for (const BlockHash& h : chain) {
      args.blocks.push_back({h, parent, kBlockBytes});
      parent = h;
    }
    args.caller = caller;
    return store_->Allocate(args, absl::InfiniteFuture());
  }
  absl::StatusOr<int> Commit(const Caller& caller, const std::vector<BlockHash>& chain) {
    absl::StatusOr<AllocateResult> a = Allocate(caller, chain);
    if (!a.ok()) return a.status();
    if (a->allocation_id == 0) return 0;
    return store_->Commit(a->allocation_id, {}, caller);
  }
  int Match(const std::vector<BlockHash>& chain) {
    absl::StatusOr<MatchResult> r = store_->MatchPrefix(chain, absl::ZeroDuration());
    KV_CHECK(r.ok());
    return r->matched;
  }
  // Advances time in steps, heartbeating `beating` at each, and ticks.
  void Advance(absl::Duration d, const std::vector<Caller>& beating = {}) {
    const absl::Duration step = absl::Seconds(2);
    for (absl::Duration done; done < d; done += step) {
      clock_.Advance(std::min(step, d - done));
      for (const Caller& c : beating) KV_CHECK(store_->Heartbeat(c.node_id, c.incarnation).ok());
      store_->Tick();
    }
  }
  // Used slots the registry counts on `node_id` vs replicas the index lists there.
  std::pair<int64_t, int64_t> SlotsVsIndex(const std::string& node_id) {
    int64_t used = -1;
    for (const NodeInfo& n : store_->ListNodes()) {
      if (n.spec.node_id == node_id) used = n.used_slots;
    }
    std::optional<uint16_t> index = store_->registry().Find(node_id);
    int64_t listed = 0;
    store_->index().ForEachReplica([&](const Replica& r) {
      if (index.has_value() && r.node == *index) ++listed;
    });
    return {used, listed};
  }

 private:
  SimulatedClock clock_;
  CacheStoreOptions options_;
  std::unique_ptr<CacheStore> store_;
};

// --- Identity -----------------------------------------------------------------------------

TEST(IdentityTest, SecondLiveIncarnationOfAnIdIsRefusedNamingTheHolder) {
  StoreFixture f;
  ASSERT_THAT(f.Register("prefill-0", 111, 8), IsOk());
  // Two replicas started with the same default id (issue 10.1) on two hosts: the second is
  // refused.
  NodeSpec elsewhere = StoreFixture::Spec("prefill-0", 222, 8);
  elsewhere.grpc_address = "prefill-1.grpc:7100";
  EXPECT_THAT(f.store().RegisterNode(elsewhere),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       AllOf(HasSubstr("prefill-0"), HasSubstr("prefill-0.data:13337"),
                             HasSubstr("incarnation 111"))));
  // The same (id, incarnation) again is idempotent.
  KV_ASSERT_OK_AND_ASSIGN(RegisterResult again, f.Register("prefill-0", 111, 8));
  EXPECT_EQ(again.incarnation, 111u);
  EXPECT_EQ(f.store().Stats().nodes, 1);
  EXPECT_EQ(f.store().counters().refused_registrations.load(), 1);
  // The same incarnation with another spec is a bug in the node, not a restart.
  EXPECT_THAT(f.Register("prefill-0", 111, 16),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("new incarnation")));
}

TEST(IdentityTest, ARestartOnTheSameAddressReplacesTheGoneProcessAndItsBlocks) {
  StoreFixture f;
  const Caller old_proc{"decode-0", 111};
  ASSERT_THAT(f.Register("decode-0", 111, 8, NodeRole::kDecode), IsOk());
  ASSERT_THAT(f.Commit(old_proc, Chain("t", 3)), IsOk());
  ASSERT_EQ(f.Match(Chain("t", 3)), 3);
  // kill -9 and a restart within the TTL: the new process listens on the old one's gRPC address
  // (servers bind without SO_REUSEPORT), so the old one is gone; its blocks went with it.
  KV_ASSERT_OK_AND_ASSIGN(RegisterResult next, f.Register("decode-0", 222, 8, NodeRole::kDecode));
  EXPECT_EQ(next.incarnation, 222u);
  EXPECT_EQ(f.Match(Chain("t", 3)), 0);
  EXPECT_EQ(f.store().Stats().nodes, 1);
  // Another role at that address is not a successor.
  EXPECT_THAT(f.Register("decode-0", 333, 8, NodeRole::kPrefill),
              StatusIs(absl::StatusCode::kAlreadyExists));
}

TEST(IdentityTest, LegacyRegistrationGetsAnIncarnationAndADuplicateIsStillRefused) {
  StoreFixture f;
  KV_ASSERT_OK_AND_ASSIGN(RegisterResult first, f.Register("decode-0", 0, 8));
  EXPECT_NE(first.incarnation, 0u);
  EXPECT_THAT(f.Register("decode-0", 0, 8), StatusIs(absl::StatusCode::kAlreadyExists));
}

TEST(IdentityTest, BlocksOfAnEarlierIncarnationAreNeverMatched) {
  StoreFixture f;
  const Caller old_proc{"prefill-0", 111};
  ASSERT_THAT(f.Register("prefill-0", 111, 8), IsOk());
  auto chain = Chain("t", 3);
  ASSERT_THAT(f.Commit(old_proc, chain), IsOk());
  ASSERT_EQ(f.Match(chain), 3);
  KV_ASSERT_OK_AND_ASSIGN(MatchResult m, f.store().MatchPrefix(chain, absl::ZeroDuration()));
  EXPECT_EQ(m.ReplicaLocation(0, 0).incarnation, 111u);
  // The process dies; past its TTL it is suspect and a new incarnation replaces it at once.
  f.Advance(absl::Seconds(12));
  EXPECT_THAT(f.Register("prefill-0", 222, 8), IsOk());
  EXPECT_EQ(f.Match(chain), 0);
  EXPECT_EQ(f.store().Stats().committed_blocks, 0);
  // The old process, if it was only paused, is refused everywhere, naming the node.
  EXPECT_THAT(f.store().Heartbeat("prefill-0", 111),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("prefill-0"), HasSubstr("222"))));
  EXPECT_THAT(f.Allocate(old_proc, Chain("t", 1, 500)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("prefill-0")));
  EXPECT_THAT(f.store().AnnounceBlocks(old_proc, "kv", {{chain[0], {}, 0, kBlockBytes}}),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(f.store().DeregisterNode(old_proc), StatusIs(absl::StatusCode::kFailedPrecondition));
  // The new incarnation starts empty and works.
  EXPECT_THAT(f.Commit({"prefill-0", 222}, chain), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(m, f.store().MatchPrefix(chain, absl::ZeroDuration()));
  EXPECT_EQ(m.ReplicaLocation(0, 0).incarnation, 222u);
}

TEST(IdentityTest, AllocationsAndLeasesAreBoundToTheCallerAndIdsAreRandom) {
  StoreFixture f;
  const Caller a{"a", 1}, a_other{"a", 9}, b{"b", 2};
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  ASSERT_THAT(f.Register("b", 2, 16), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult x, f.Allocate(a, Chain("t", 2)));
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult y, f.Allocate(a, Chain("t", 2, 100)));
  // Random 64-bit ids, not a counter.
  EXPECT_NE(x.allocation_id + 1, y.allocation_id);
  EXPECT_GT(std::max(x.allocation_id, y.allocation_id), uint64_t{1} << 32);
  EXPECT_THAT(f.store().Commit(x.allocation_id, {}, b),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       AllOf(HasSubstr("node 'a'"), HasSubstr("node 'b'"))));
  EXPECT_THAT(f.store().Abort(x.allocation_id, b), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(f.store().Abort(x.allocation_id, {}),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("anonymous")));
  EXPECT_THAT(f.store().Commit(x.allocation_id, {}, a_other),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("incarnation")));
  EXPECT_THAT(f.store().Commit(x.allocation_id, {}, a), IsOk());
  EXPECT_THAT(f.store().Abort(y.allocation_id, a), IsOk());
  // Leases.
  KV_ASSERT_OK_AND_ASSIGN(MatchResult m, f.store().MatchPrefix(Chain("t", 2), absl::Seconds(5), a));
  ASSERT_NE(m.lease_id, 0u);
  EXPECT_THAT(f.store().ReleaseLease(m.lease_id, b),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("node 'a'")));
  EXPECT_THAT(f.store().ReleaseLease(m.lease_id, a_other),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(f.store().index().LeasesOf(Chain("t", 2)[0]), 1);
  EXPECT_THAT(f.store().ReleaseLease(m.lease_id, a), IsOk());
  EXPECT_EQ(f.store().index().LeasesOf(Chain("t", 2)[0]), 0);
}

TEST(IdentityTest, DeregisterDropsTheNodeItsAllocationsAndLeasesAtOnce) {
  StoreFixture f;
  const Caller a{"a", 1};
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  ASSERT_THAT(f.Register("b", 2, 16), IsOk());
  ASSERT_THAT(f.Commit({"b", 2}, Chain("t", 2)), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(MatchResult m, f.store().MatchPrefix(Chain("t", 2), absl::Minutes(5), a));
  ASSERT_EQ(f.store().index().LeasesOf(Chain("t", 2)[0]), 1);
  ASSERT_THAT(f.Allocate(a, Chain("u", 3)), IsOk());
  ASSERT_THAT(f.store().DeregisterNode(a), IsOk());
  EXPECT_EQ(f.store().Stats().nodes, 1);
  EXPECT_EQ(f.store().Stats().allocated_blocks, 0);
  EXPECT_EQ(f.store().Stats().active_leases, 0);
  EXPECT_EQ(f.store().index().LeasesOf(Chain("t", 2)[0]), 0);
  EXPECT_THAT(f.Register("a", 3, 16), IsOk());  // a new process may take the id at once
}

// --- Soft state ---------------------------------------------------------------------------

TEST(SoftStateTest, SilentNodeIsSuspectThenLiveAgainWithItsBlocks) {
  StoreFixture f;
  const Caller a{"a", 1}, b{"b", 2};
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  ASSERT_THAT(f.Register("b", 2, 16), IsOk());
  auto on_a = Chain("t", 3);
  ASSERT_THAT(f.Commit(a, on_a), IsOk());
  // A 12 s stall of a (TTL 10 s): suspect, its blocks skipped but kept.
  f.Advance(absl::Seconds(12), {b});
  EXPECT_EQ(f.Match(on_a), 0);
  EXPECT_TRUE(f.store().QueryPrefix(on_a).empty());
  EXPECT_EQ(f.store().Stats().nodes, 1);
  EXPECT_EQ(f.store().Stats().suspect_nodes, 1);
  EXPECT_EQ(f.store().Stats().committed_blocks, 3);
  // Placement for others skips it (b has room); a itself may still place into its own segment.
  AllocateArgs anonymous;
  anonymous.blocks = {{Chain("v", 1)[0], {}, kBlockBytes}};
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult anon,
                          f.store().Allocate(anonymous, absl::InfiniteFuture()));
  EXPECT_EQ(anon.blocks[0].replicas[0].node_id, "b");
  // It comes back within the grace period: live again, blocks included.
  KV_ASSERT_OK_AND_ASSIGN(HeartbeatResult hb, f.store().Heartbeat("a", 1));
  EXPECT_TRUE(hb.known);
  EXPECT_EQ(hb.state, NodeState::kSuspect);
  EXPECT_EQ(f.Match(on_a), 3);
  EXPECT_EQ(f.store().Stats().suspect_nodes, 0);
  // Events tell watchers what happened.
  KV_ASSERT_OK_AND_ASSIGN(auto events, f.store().EventsSince(1, 100, absl::Now()));
  std::vector<StoreEvent::Kind> node_events;
  for (const StoreEvent& e : events) {
    if (e.node.node_id == "a") node_events.push_back(e.kind);
  }
  EXPECT_EQ(node_events, (std::vector<StoreEvent::Kind>{StoreEvent::Kind::kNodeJoined,
                                                        StoreEvent::Kind::kNodeSuspect,
                                                        StoreEvent::Kind::kNodeLive}));
}

TEST(SoftStateTest, SuspectNodeIsForgottenAfterTheGracePeriod) {
  StoreFixture f;
  const Caller a{"a", 1}, b{"b", 2};
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  ASSERT_THAT(f.Register("b", 2, 16), IsOk());
  ASSERT_THAT(f.Commit(a, Chain("t", 3)), IsOk());
  f.Advance(absl::Seconds(38), {b});  // TTL 10 + grace 30 not yet over
  EXPECT_EQ(f.store().Stats().suspect_nodes, 1);
  f.Advance(absl::Seconds(4), {b});
  EXPECT_EQ(f.store().Stats().suspect_nodes, 0);
  EXPECT_EQ(f.store().Stats().committed_blocks, 0);
  EXPECT_FALSE(f.store().Heartbeat("a", 1)->known);  // must register again (starts empty)
  EXPECT_EQ(f.store().counters().expired_nodes.load(), 1);
}

TEST(SoftStateTest, AStoreRestartWithItsLogKeepsTheIndexForNodesThatComeBack) {
  testing::TempDir dir;
  StoreFixture f(dir.path());
  const Caller a{"a", 1};
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  auto chain = Chain("t", 4);
  ASSERT_THAT(f.Commit(a, chain), IsOk());
  f.Restart();  // a 10 s outage: the node heartbeats again once the store is back
  f.Advance(absl::Seconds(10));
  KV_ASSERT_OK_AND_ASSIGN(HeartbeatResult hb, f.store().Heartbeat("a", 1));
  EXPECT_TRUE(hb.known);
  EXPECT_EQ(f.Match(chain), 4);
}

TEST(SoftStateTest, ReannouncedBlocksRebuildTheIndexWithoutRecompute) {
  StoreFixture f;  // no data dir: a restart loses everything
  const Caller a{"a", 1};
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  auto chain = Chain("t", 5);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult alloc, f.Allocate(a, chain));
  ASSERT_THAT(f.store().Commit(alloc.allocation_id, {}, a), IsOk());
  std::vector<AnnouncedBlock> held;
  for (size_t i = 0; i < chain.size(); ++i) {
    held.push_back({chain[i], i == 0 ? BlockHash{} : chain[i - 1],
                    static_cast<uint32_t>(alloc.blocks[i].replicas[0].slot), kBlockBytes});
  }
  f.Restart();
  EXPECT_FALSE(f.store().Heartbeat("a", 1)->known);
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(AnnounceResult r, f.store().AnnounceBlocks(a, "kv", held));
  EXPECT_EQ(r.accepted, 5);
  EXPECT_TRUE(r.rejected.empty());
  KV_ASSERT_OK_AND_ASSIGN(MatchResult m, f.store().MatchPrefix(chain, absl::ZeroDuration()));
  ASSERT_EQ(m.matched, 5);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(m.ReplicaLocation(i, 0).slot, alloc.blocks[i].replicas[0].slot);
  }
  // Idempotent.
  KV_ASSERT_OK_AND_ASSIGN(r, f.store().AnnounceBlocks(a, "kv", held));
  EXPECT_EQ(r.accepted, 0);
  EXPECT_EQ(r.already_present, 5);
  // Slots are the store's: announced slots are taken, so an allocation never lands on them.
  EXPECT_EQ(f.SlotsVsIndex("a"), std::make_pair(int64_t{5}, int64_t{5}));
  // Bad entries are rejected one by one, with a reason; the rest still go in.
  auto other = Chain("u", 2);
  std::vector<AnnouncedBlock> bad = {
      {other[0], {}, held[0].slot, kBlockBytes},    // slot holds another block
      {other[1], other[0], 9, kBlockBytes},         // parent not indexed
      {Chain("w", 1)[0], {}, 999, kBlockBytes},     // slot out of range
      {Chain("x", 1)[0], {}, 10, kBlockBytes * 2},  // larger than a slot
      {Chain("y", 1)[0], {}, 11, kBlockBytes}};     // fine
  KV_ASSERT_OK_AND_ASSIGN(r, f.store().AnnounceBlocks(a, "kv", bad));
  EXPECT_EQ(r.accepted, 1);
  ASSERT_EQ(r.rejected.size(), 4u);
  EXPECT_EQ(r.rejected[0], std::make_pair(0, AnnounceRejection::kSlotInUse));
  EXPECT_EQ(r.rejected[1], std::make_pair(1, AnnounceRejection::kParentMissing));
  EXPECT_EQ(r.rejected[2], std::make_pair(2, AnnounceRejection::kBadInput));
  EXPECT_EQ(r.rejected[3], std::make_pair(3, AnnounceRejection::kBadInput));
  EXPECT_THAT(f.store().AnnounceBlocks(a, "nope", held),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("segment_id")));
}

// --- Placement and slot accounting ---------------------------------------------------------

TEST(PlacementTest, FullOwnSegmentEvictsThereAndNeverSpillsOrLeaks) {
  StoreFixture f;
  f.options().commit_timeout = absl::Seconds(5);
  f.Restart();
  const Caller p{"prefill-0", 7};
  ASSERT_THAT(f.Register("prefill-0", 7, 64), IsOk());
  ASSERT_THAT(f.Register("decode-0", 8, 1024, NodeRole::kDecode), IsOk());
  std::mt19937 rng(42);
  struct Open {
    uint64_t id;
    std::vector<BlockHash> hashes;
  };
  std::deque<Open> open;
  int committed = 0, aborted = 0, left = 0, refused = 0;
  // ~4,000 blocks through a 64-slot segment: shared prefixes, interleaved allocations, children
  // allocated under another allocation's uncommitted parent, aborts and abandoned allocations.
  for (int round = 0; round < 700; ++round) {
    const int prefix = static_cast<int>(rng() % 40);
    const int len = 1 + static_cast<int>(rng() % 8);
    std::vector<BlockHash> chain = Chain("t" + std::to_string(prefix), len, 16 * (round % 5));
    BlockHash parent;
    if (!open.empty() && rng() % 4 == 0) {
      parent = open.back().hashes.back();  // child of an uncommitted block of another allocation
      chain = Chain("c" + std::to_string(round), len);
    }
    absl::StatusOr<AllocateResult> a = f.Allocate(p, chain, parent);
    if (!a.ok()) {
      // In flight elsewhere (ALREADY_EXISTS) or every slot pinned by open allocations.
      ASSERT_TRUE(absl::IsAlreadyExists(a.status()) || absl::IsResourceExhausted(a.status()))
          << a.status();
      ++refused;
    } else {
      for (const AllocateResult::Block& b : a->blocks) {
        for (const Location& loc : b.replicas) {
          if (!b.already_committed) {
            ASSERT_EQ(loc.node_id, "prefill-0");  // never on decode-0
          }
        }
      }
      if (a->allocation_id != 0) {
        std::vector<BlockHash> mine;
        for (const AllocateResult::Block& b : a->blocks) {
          if (!b.already_committed) mine.push_back(b.hash);
        }
        open.push_back({a->allocation_id, mine});
      }
    }
    f.Advance(absl::Seconds(1), {p, {"decode-0", 8}});  // abandoned ones expire after 5 s
    while (open.size() > 3) {
      Open o = open.front();
      open.pop_front();
      switch (rng() % 4) {
        case 0:
        case 1:
          // May fail (FAILED_PRECONDITION) when a parent belongs to an allocation that aborted.
          if (f.store().Commit(o.id, {}, p).ok()) ++committed;
          break;
        case 2: {
          // NOT_FOUND when the commit timeout already reclaimed it.
          const absl::Status s = f.store().Abort(o.id, p);
          ASSERT_TRUE(s.ok() || absl::IsNotFound(s)) << s;
          ++aborted;
          break;
        }
        default:
          ++left;  // abandoned: reclaimed after the commit timeout
      }
    }
  }
  for (const Open& o : open) (void)f.store().Abort(o.id, p);
  f.Advance(absl::Seconds(6), {p, {"decode-0", 8}});  // reclaim the abandoned ones
  EXPECT_GT(committed, 100);
  EXPECT_GT(aborted, 50);
  EXPECT_GT(left, 50);
  EXPECT_GT(f.store().Stats().evictions, 200);
  EXPECT_EQ(f.store().Stats().allocated_blocks, 0);
  auto [used, listed] = f.SlotsVsIndex("prefill-0");
  EXPECT_EQ(used, listed) << "slots leaked";
  EXPECT_EQ(f.SlotsVsIndex("decode-0"), std::make_pair(int64_t{0}, int64_t{0}));
  // The full cache still caches: a new prompt sent three times hits.
  auto fresh = Chain("fresh", 6);
  for (int i = 0; i < 3; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(AllocateResult a, f.Allocate(p, fresh));
    if (a.allocation_id != 0) {
      ASSERT_THAT(f.store().Commit(a.allocation_id, {}, p), IsOk());
    }
    EXPECT_EQ(f.Match(fresh), 6) << "attempt " << i;
  }
  std::printf(
      "fill test: %lld blocks allocated through 64 slots; %d committed, %d aborted, %d "
      "abandoned, %d refused allocations, %lld evictions, %lld slots used == %lld indexed\n",
      static_cast<long long>(f.store().counters().allocated_blocks.load()), committed, aborted,
      left, refused, static_cast<long long>(f.store().Stats().evictions),
      static_cast<long long>(used), static_cast<long long>(listed));
}

TEST(PlacementTest, ParentLeftByAnAbortedAllocationIsReclaimedWhenItsChildGoes) {
  StoreFixture f;
  const Caller p{"p", 1};
  ASSERT_THAT(f.Register("p", 1, 8), IsOk());
  auto chain = Chain("t", 2);
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult first, f.Allocate(p, {chain[0]}));
  KV_ASSERT_OK_AND_ASSIGN(AllocateResult second, f.Allocate(p, {chain[1]}, chain[0]));
  ASSERT_THAT(f.store().Abort(first.allocation_id, p), IsOk());  // chain[0] still has a child
  EXPECT_EQ(f.SlotsVsIndex("p"), std::make_pair(int64_t{2}, int64_t{2}));
  EXPECT_THAT(f.store().Commit(second.allocation_id, {}, p),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("parent")));
  ASSERT_THAT(f.store().Abort(second.allocation_id, p), IsOk());
  EXPECT_EQ(f.SlotsVsIndex("p"), std::make_pair(int64_t{0}, int64_t{0}));
  EXPECT_EQ(f.store().index().size(), 0);
}

TEST(PlacementTest, LegacyPreferredNodeEvictsThereBeforeSpilling) {
  StoreFixture f;
  ASSERT_THAT(f.Register("p", 1, 4), IsOk());
  ASSERT_THAT(f.Register("d", 2, 64), IsOk());
  AllocateArgs args;
  args.preferred_node = "p";
  for (int i = 0; i < 10; ++i) {
    auto chain = Chain("t", 1, 100 * i);
    args.blocks = {{chain[0], {}, kBlockBytes}};
    KV_ASSERT_OK_AND_ASSIGN(AllocateResult a, f.store().Allocate(args, absl::InfiniteFuture()));
    EXPECT_EQ(a.blocks[0].replicas[0].node_id, "p");
    ASSERT_THAT(f.store().Commit(a.allocation_id, {}), IsOk());
  }
  EXPECT_EQ(f.store().Stats().evictions, 6);
}

// --- Events and sequence numbers ------------------------------------------------------------

TEST(EventsTest, WatchFromOneAfterALogReplayDoesNotCrash) {
  // Issue 13.5: replay published removal events under numbers the log did not know, so
  // EventsSince(1) indexed past the retained events.
  testing::TempDir dir;
  StoreFixture f(dir.path());
  const Caller a{"a", 1};
  ASSERT_THAT(f.Register("a", 1, 16), IsOk());
  ASSERT_THAT(f.Commit(a, Chain("t", 4)), IsOk());
  ASSERT_THAT(f.store().DeregisterNode(a), IsOk());  // logs one kRemoveNode, 4 removals
  ASSERT_THAT(f.Register("a", 2, 16), IsOk());
  const uint64_t before = f.store().last_sequence();
  f.Restart();
  for (uint64_t from : {uint64_t{1}, uint64_t{2}, before, before + 1}) {
    absl::StatusOr<std::vector<StoreEvent>> e =
        f.store().EventsSince(from, 100, absl::Now() + absl::Milliseconds(1));
    EXPECT_TRUE(e.ok() || absl::IsOutOfRange(e.status())) << from << ": " << e.status();
  }
  EXPECT_THAT(f.store().EventsSince(f.store().last_sequence() + 5, 10, absl::Now()),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("ahead")));
  ASSERT_THAT(f.Commit({"a", 2}, Chain("u", 1)), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(auto fresh,
                          f.store().EventsSince(f.store().last_sequence(), 10, absl::Now()));
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_GT(fresh[0].sequence, before);
}

TEST(EventsTest, SequenceNumbersStrictlyIncreaseAcrossCrashes) {
  testing::TempDir dir;
  StoreFixture f(dir.path());
  f.options().snapshot_every_ops = 7;  // snapshots and log resets in between
  f.Restart();
  uint64_t high = 0;
  for (int crash = 0; crash < 4; ++crash) {
    const Caller a{"a", static_cast<uint64_t>(crash + 1)};
    // Events from before a restart are not replayed: watch from the first one after it.
    const uint64_t from = f.store().last_sequence() + 1;
    ASSERT_THAT(f.Register("a", a.incarnation, 16), IsOk());
    ASSERT_THAT(f.Commit(a, Chain("t", 3, 100 * crash)), IsOk());
    // Unlogged removal events: the node is dropped with its blocks.
    ASSERT_THAT(f.store().DeregisterNode(a), IsOk());
    KV_ASSERT_OK_AND_ASSIGN(auto events, f.store().EventsSince(from, 1000, absl::Now()));
    for (const StoreEvent& e : events) {
      EXPECT_GT(e.sequence, high) << "crash " << crash;
      high = e.sequence;
    }
    ASSERT_FALSE(events.empty());
    f.Restart();  // kill -9: no final snapshot
    EXPECT_GE(f.store().last_sequence(), high);
  }
}

// --- Bounds and discovery --------------------------------------------------------------------

TEST(BoundsTest, AdvertisedCapacityIsBounded) {
  StoreFixture f;
  NodeSpec spec = StoreFixture::Spec("fake", 1, 8);
  spec.segments[0].capacity_slots = int64_t{1} << 40;
  EXPECT_THAT(f.store().RegisterNode(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("capacity_slots")));
  spec.segments[0].capacity_slots = 8;
  spec.segments[0].slot_bytes = uint64_t{1} << 40;
  EXPECT_THAT(f.store().RegisterNode(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slot_bytes")));
  spec = StoreFixture::Spec("fake", 1, 0);
  for (int i = 0; i < 64; ++i) {
    spec.segments.push_back(
        {"s" + std::to_string(i), Tier::kSsd, int64_t{1} << 24, uint64_t{1} << 30, ""});
  }
  EXPECT_THAT(f.store().RegisterNode(spec),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("in all")));
  f.options().limits.max_nodes = 2;
  f.Restart();
  ASSERT_THAT(f.Register("a", 1, 1), IsOk());
  ASSERT_THAT(f.Register("b", 1, 1), IsOk());
  EXPECT_THAT(f.Register("c", 1, 1), StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST(DiscoveryTest, ListNodesShowsRoleAddressesLoadAndLiveness) {
  StoreFixture f;
  ASSERT_THAT(f.Register("p", 11, 8, NodeRole::kPrefill), IsOk());
  ASSERT_THAT(f.Register("d", 22, 0, NodeRole::kDecode), IsOk());  // no segment: discovery only
  NodeLoad load{3, 1, 100, 512};
  ASSERT_THAT(f.store().Heartbeat("d", 22, &load), IsOk());
  f.Advance(absl::Seconds(12), {{"d", 22}});
  std::vector<NodeInfo> nodes = f.store().ListNodes();
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].spec.node_id, "d");
  EXPECT_EQ(nodes[0].spec.role, NodeRole::kDecode);
  EXPECT_EQ(nodes[0].spec.incarnation, 22u);
  EXPECT_EQ(nodes[0].spec.grpc_address, "d.grpc:7100");
  EXPECT_EQ(nodes[0].spec.transport_address, "d.data:13337");
  EXPECT_EQ(nodes[0].load, load);
  EXPECT_EQ(nodes[0].state, NodeState::kLive);
  EXPECT_EQ(nodes[1].spec.node_id, "p");
  EXPECT_EQ(nodes[1].state, NodeState::kSuspect);
  EXPECT_EQ(nodes[1].capacity_slots, 8);
}

}  // namespace
}  // namespace kvrelay::cachestore
