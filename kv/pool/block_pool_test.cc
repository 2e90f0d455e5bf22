#include "kv/pool/block_pool.h"

#include <atomic>
#include <cstring>
#include <set>
#include <thread>

#include "common/check.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::kv {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

std::unique_ptr<BlockPool> MakePool(size_t slot_bytes, int64_t slots) {
  auto pool = BlockPool::Create({slot_bytes, slots}, MakeHostMemoryResource());
  KV_CHECK(pool.ok());
  return *std::move(pool);
}

TEST(BlockPool, AllocatesDistinctAlignedSlotsUntilFull) {
  auto pool = MakePool(1000, 8);
  EXPECT_EQ(pool->slot_stride(), 1024u);  // rounded to the 256-byte alignment
  std::set<SlotId> seen;
  for (int i = 0; i < 8; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(SlotId s, pool->Allocate());
    EXPECT_TRUE(seen.insert(s).second);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->SlotAddress(s)) % 256, 0u);
    EXPECT_EQ(pool->SlotOf(static_cast<uint8_t*>(pool->SlotAddress(s)) + 999), s);
    std::memset(pool->SlotAddress(s), i, 1000);  // the memory is really there
  }
  EXPECT_EQ(pool->free_slots(), 0);
  EXPECT_THAT(pool->Allocate(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("full")));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->base()) % 4096, 0u);
}

TEST(BlockPool, ReferenceCountsFreeAtZeroOnly) {
  auto pool = MakePool(64, 2);
  KV_ASSERT_OK_AND_ASSIGN(SlotId s, pool->Allocate());
  KV_ASSERT_OK(pool->AddRef(s));
  EXPECT_EQ(pool->RefCount(s), 2);
  KV_ASSERT_OK(pool->Release(s));
  EXPECT_EQ(pool->free_slots(), 1);
  KV_ASSERT_OK(pool->Release(s));
  EXPECT_EQ(pool->free_slots(), 2);
  EXPECT_THAT(pool->Release(s), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(pool->AddRef(s), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(pool->free_slots(), 2);  // a double free did not push the slot twice
  EXPECT_THAT(pool->Release(7), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("7")));
  EXPECT_THAT(pool->AddRef(-1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(BlockPool, AllocateManyIsAllOrNothing) {
  auto pool = MakePool(64, 4);
  KV_ASSERT_OK_AND_ASSIGN(std::vector<SlotId> three, pool->AllocateMany(3));
  EXPECT_EQ(three.size(), 3u);
  EXPECT_THAT(pool->AllocateMany(2), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(pool->free_slots(), 1);
  for (SlotId s : three) KV_ASSERT_OK(pool->Release(s));
  EXPECT_EQ(pool->free_slots(), 4);
}

TEST(BlockPool, RejectsBadOptions) {
  EXPECT_THAT(BlockPool::Create({0, 4}, MakeHostMemoryResource()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slot_bytes")));
  EXPECT_THAT(BlockPool::Create({64, 0}, MakeHostMemoryResource()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("num_slots")));
  EXPECT_THAT(BlockPool::Create({64, 4, 100}, MakeHostMemoryResource()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slot_alignment")));
  EXPECT_THAT(BlockPool::Create({64, 4}, std::unique_ptr<MemoryResource>()),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(BlockPool, HugePoolUsesHugePagesWhenAvailable) {
  // 64 MiB: big enough for MAP_HUGETLB or THP; either way the pool works.
  auto pool = MakePool(2 << 20, 32);
  KV_ASSERT_OK_AND_ASSIGN(SlotId s, pool->Allocate());
  std::memset(pool->SlotAddress(s), 0xab, pool->slot_bytes());
  EXPECT_EQ(static_cast<uint8_t*>(pool->SlotAddress(s))[pool->slot_bytes() - 1], 0xab);
}

// Many threads allocate, write a signature, share, check, release. A slot handed out twice
// would show another thread's signature.
TEST(BlockPool, ConcurrentThreadsNeverShareASlot) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 20000;
  auto pool = MakePool(64, 32);
  std::atomic<int> errors{0};
  std::atomic<int> exhausted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        absl::StatusOr<SlotId> slot = pool->Allocate();
        if (!slot.ok()) {
          exhausted.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        auto* word = static_cast<std::atomic<int64_t>*>(pool->SlotAddress(*slot));
        const int64_t mine = (int64_t{t} << 32) | i;
        word->store(mine, std::memory_order_relaxed);
        if (!pool->AddRef(*slot).ok()) errors.fetch_add(1);
        if (word->load(std::memory_order_relaxed) != mine) errors.fetch_add(1);
        if (!pool->Release(*slot).ok()) errors.fetch_add(1);
        if (word->load(std::memory_order_relaxed) != mine) errors.fetch_add(1);
        if (!pool->Release(*slot).ok()) errors.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(pool->free_slots(), 32);
  for (SlotId s = 0; s < 32; ++s) EXPECT_EQ(pool->RefCount(s), 0);
}

}  // namespace
}  // namespace kvrelay::kv
