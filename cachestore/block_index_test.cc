#include "cachestore/block_index.h"

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::cachestore {
namespace {

using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;

BlockHash H(uint64_t i) {
  uint64_t x = i * 0x9e3779b97f4a7c15ull + 1;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 32;
  return BlockHash{i + 1, x};
}

NewBlock B(uint64_t i, std::optional<uint64_t> parent, uint16_t node = 0) {
  NewBlock b;
  b.hash = H(i);
  if (parent) b.parent = H(*parent);
  b.size_bytes = 4096;
  b.replicas.push_back(Replica{node, 0, static_cast<uint32_t>(i)});
  return b;
}

class BlockIndexTest : public ::testing::Test {
 protected:
  BlockIndexTest() : policy_(1000) {
    BlockIndex::Options o;
    o.policy = &policy_;
    o.ghost_capacity = 100;
    index_ = std::make_unique<BlockIndex>(o);
  }
  LrfuPolicy policy_;
  std::unique_ptr<BlockIndex> index_;
};

TEST_F(BlockIndexTest, MatchStopsAtFirstMissingOrUncommitted) {
  ASSERT_THAT(index_->Insert(B(0, {}), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(1, 0), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(2, 1), BlockState::kAllocated), IsOk());
  std::vector<BlockHash> chain = {H(0), H(1), H(2)};
  std::vector<MatchedBlock> out;
  EXPECT_EQ(index_->MatchPrefix(chain, true, false, &out), 2);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].replicas[0].slot, 1u);
  EXPECT_THAT(index_->Insert(B(0, {}), BlockState::kCommitted),
              StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(index_->Insert(B(9, 8), BlockState::kCommitted),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("parent")));
}

TEST_F(BlockIndexTest, EvictsLeavesBeforeParentsAndSkipsLeased) {
  for (uint64_t i = 0; i < 5; ++i) {
    ASSERT_THAT(index_->Insert(B(i, i == 0 ? std::nullopt : std::optional<uint64_t>(i - 1)),
                               BlockState::kCommitted),
                IsOk());
  }
  ASSERT_TRUE(index_->Touch(H(4), /*lease=*/true));
  // Only the leaf is evictable, and it is leased: nothing goes.
  EXPECT_FALSE(index_->EvictOne().has_value());
  index_->ReleaseLeases(std::vector<BlockHash>{H(4)});
  for (int i = 4; i >= 0; --i) {
    auto e = index_->EvictOne();
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->hash, H(i));
  }
  EXPECT_EQ(index_->size(), 0);
  EXPECT_EQ(index_->ghost_size(), 5u);
}

TEST_F(BlockIndexTest, RemoveLeafTakesOnlyAFreeLeafAndItsParentBecomesEvictable) {
  ASSERT_THAT(index_->Insert(B(0, {}), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(1, 0), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(2, {}), BlockState::kAllocated), IsOk());
  EXPECT_THAT(index_->RemoveLeaf(H(0)).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(index_->RemoveLeaf(H(2)).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(index_->RemoveLeaf(H(7)).status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_TRUE(index_->Touch(H(1), /*lease=*/true));
  EXPECT_THAT(index_->RemoveLeaf(H(1)).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  const BlockHash leased = H(1);
  index_->ReleaseLeases({&leased, 1});
  absl::StatusOr<RemovedBlock> removed = index_->RemoveLeaf(H(1));
  ASSERT_THAT(removed.status(), IsOk());
  EXPECT_EQ(removed->hash, H(1));
  EXPECT_EQ(removed->parent, H(0));
  const BlockHash chain[] = {H(0), H(1)};
  EXPECT_EQ(index_->MatchPrefix(chain, false, false, nullptr), 1);
  // The parent is a leaf now: the next eviction takes it (its stale heap entry is skipped).
  std::optional<RemovedBlock> evicted = index_->EvictOne();
  ASSERT_TRUE(evicted.has_value());
  EXPECT_EQ(evicted->hash, H(0));
  EXPECT_FALSE(index_->EvictOne().has_value());  // the allocated block is not evictable
}

TEST_F(BlockIndexTest, RemoveSubtreeTakesALeafAloneAndAnInnerBlockWithItsDescendants) {
  // 0 <- 1 <- 2, 1 <- 3; 4 alone.
  ASSERT_THAT(index_->Insert(B(0, {}), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(1, 0), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(2, 1), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(3, 1), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(4, {}), BlockState::kCommitted), IsOk());
  EXPECT_TRUE(index_->RemoveSubtree(H(9)).empty());  // absent: ignored
  // A leaf (the replay of an eviction): itself only, its parent named and still counting the
  // other child.
  std::vector<RemovedBlock> leaf = index_->RemoveSubtree(H(2));
  ASSERT_EQ(leaf.size(), 1u);
  EXPECT_EQ(leaf[0].hash, H(2));
  EXPECT_EQ(leaf[0].parent, H(1));
  EXPECT_EQ(leaf[0].replicas.size(), 1u);
  EXPECT_THAT(index_->RemoveLeaf(H(1)).status(), StatusIs(absl::StatusCode::kFailedPrecondition));
  // An inner block: it and every descendant, children first.
  std::vector<RemovedBlock> inner = index_->RemoveSubtree(H(0));
  ASSERT_EQ(inner.size(), 3u);
  EXPECT_EQ(inner[0].hash, H(3));
  EXPECT_EQ(inner[2].hash, H(0));
  EXPECT_EQ(index_->committed_count(), 1);
  EXPECT_TRUE(index_->Contains(H(4)));
  // The last leaf left is still evictable after the removals (its heap entry intact).
  std::optional<RemovedBlock> evicted = index_->EvictOne();
  ASSERT_TRUE(evicted.has_value());
  EXPECT_EQ(evicted->hash, H(4));
}

TEST_F(BlockIndexTest, RemoveNodeCascadesToDescendants) {
  ASSERT_THAT(index_->Insert(B(0, {}, /*node=*/1), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(1, 0, /*node=*/2), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(2, 1, /*node=*/2), BlockState::kCommitted), IsOk());
  ASSERT_THAT(index_->Insert(B(3, {}, /*node=*/2), BlockState::kCommitted), IsOk());
  auto removed = index_->RemoveNode(1);
  EXPECT_EQ(removed.size(), 3u);
  EXPECT_FALSE(index_->Contains(H(2)));
  EXPECT_TRUE(index_->Contains(H(3)));
  EXPECT_EQ(index_->committed_count(), 1);
}

TEST_F(BlockIndexTest, ConcurrentMatchesDuringEvictionStayConsistent) {
  constexpr int kChains = 64, kLen = 16;
  for (int c = 0; c < kChains; ++c) {
    for (int i = 0; i < kLen; ++i) {
      const uint64_t id = c * kLen + i;
      ASSERT_THAT(index_->Insert(B(id, i == 0 ? std::nullopt : std::optional<uint64_t>(id - 1)),
                                 BlockState::kCommitted),
                  IsOk());
    }
  }
  std::atomic<bool> bad{false};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&, t] {
      std::vector<BlockHash> chain(kLen);
      for (int round = 0; round < 300; ++round) {
        const int c = (round * 7 + t) % kChains;
        for (int i = 0; i < kLen; ++i) chain[i] = H(c * kLen + i);
        const int n = index_->MatchPrefix(chain, true, true, nullptr);
        // While leased, the matched prefix cannot be evicted.
        if (index_->MatchPrefix(absl::MakeConstSpan(chain).subspan(0, n), false, false, nullptr) !=
            n) {
          bad = true;
        }
        index_->ReleaseLeases(absl::MakeConstSpan(chain).subspan(0, n));
      }
    });
  }
  int evicted = 0;
  while (index_->EvictOne().has_value() && evicted < kChains * kLen) ++evicted;
  for (auto& t : readers) t.join();
  EXPECT_FALSE(bad);
  EXPECT_GT(evicted, 0);
}

// The layout promise (<= 200 bytes per block at scale) checked at 1M blocks of 256-block
// chains; the bench measures 10M.
TEST_F(BlockIndexTest, MemoryPerBlockIsCompact) {
  constexpr int kBlocks = 1000000;
  for (int i = 0; i < kBlocks; ++i) {
    const bool root = i % 256 == 0;
    ASSERT_THAT(index_->Insert(B(i, root ? std::nullopt : std::optional<uint64_t>(i - 1)),
                               BlockState::kCommitted),
                IsOk());
  }
  const double per_block = static_cast<double>(index_->MemoryUsageBytes()) / kBlocks;
  std::printf("index memory: %.1f bytes per block at %d blocks\n", per_block, kBlocks);
  EXPECT_LE(per_block, 200.0);
}

}  // namespace
}  // namespace kvrelay::cachestore
