#include "worker/disk_cache.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::worker {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kBlockBytes = 2 * 4096 + 300;
// Header (4 KiB) + payload rounded up to 4 KiB.
constexpr uint64_t kSlotBytes = 4096 + 3 * 4096;

kv::LayoutFingerprint Fingerprint(uint8_t seed) {
  kv::LayoutFingerprint f;
  for (size_t i = 0; i < f.bytes.size(); ++i) f.bytes[i] = static_cast<uint8_t>(seed + i);
  return f;
}

std::vector<uint8_t> Bytes(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(kBlockBytes);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

kv::BlockHash HashOf(uint32_t seed) { return kv::BlockHash{0x5000 + seed, 0x9000 + seed}; }

std::vector<kv::BlockHash> Chain(uint32_t from, uint32_t n) {
  std::vector<kv::BlockHash> chain;
  for (uint32_t i = 0; i < n; ++i) chain.push_back(HashOf(from + i));
  return chain;
}

class DiskCacheTest : public ::testing::Test {
 protected:
  DiskCacheOptions Options(int64_t slots, uint8_t layout = 1) {
    DiskCacheOptions o;
    o.directory = dir_.path();
    o.capacity_bytes = static_cast<uint64_t>(slots) * kSlotBytes;
    o.block_bytes = kBlockBytes;
    o.layout = Fingerprint(layout);
    o.node_id = "test-node";
    o.queue_depth = 4;
    o.metrics = &metrics_;
    return o;
  }
  std::unique_ptr<DiskCache> Open(DiskCacheOptions o) {
    absl::StatusOr<std::unique_ptr<DiskCache>> cache = DiskCache::Open(std::move(o));
    EXPECT_TRUE(cache.ok()) << cache.status();
    return cache.ok() ? *std::move(cache) : nullptr;
  }
  // Demotes blocks seed..seed+n-1 and waits until they are on disk.
  static void DemoteAll(DiskCache& cache, uint32_t seed, uint32_t n) {
    for (uint32_t i = seed; i < seed + n; ++i) {
      const std::vector<uint8_t> bytes = Bytes(i);
      EXPECT_TRUE(cache.Demote(HashOf(i), bytes)) << i;
    }
    ASSERT_TRUE(cache.Flush(absl::Now() + absl::Seconds(20)));
  }
  static absl::Time Soon() { return absl::Now() + absl::Seconds(20); }
  double Metric(const std::string& line) {
    const std::string text = "\n" + metrics_.RenderText();
    const size_t at = text.find("\n" + line + " ");  // a sample, not its # HELP line
    if (at == std::string::npos) return -1;
    return std::stod(text.substr(at + line.size() + 2));
  }

  kvrelay::testing::TempDir dir_;
  MetricsRegistry metrics_;
};

TEST_F(DiskCacheTest, DemotedBlocksReadBackVerified) {
  std::unique_ptr<DiskCache> cache = Open(Options(8));
  ASSERT_NE(cache, nullptr);
  EXPECT_TRUE(cache->up());
  EXPECT_EQ(cache->num_slots(), 8);
  DemoteAll(*cache, 0, 3);
  EXPECT_EQ(cache->listed_blocks(), 3);
  // An unbroken run from `first`, stopping at the first block it does not list.
  std::vector<kv::BlockHash> chain = Chain(0, 3);
  chain.push_back(HashOf(77));
  EXPECT_EQ(cache->HeldRun(chain, 0), 3);
  EXPECT_EQ(cache->HeldRun(chain, 1), 2);
  EXPECT_EQ(cache->HeldRun(chain, 3), 0);
  KV_ASSERT_OK_AND_ASSIGN(auto read, cache->Read(Chain(0, 3), Soon()));
  ASSERT_EQ(read.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(read[i], Bytes(i)) << i;
  EXPECT_GT(cache->read_bytes_per_second(), 0);
  EXPECT_EQ(Metric("kvrelay:disk_tier_promoted_blocks_total"), 3);
  EXPECT_EQ(Metric("kvrelay:disk_tier_demoted_blocks_total"), 3);
  EXPECT_EQ(Metric("kvrelay:disk_tier_up"), 1);
  // A block listed already is not written twice.
  EXPECT_FALSE(cache->Demote(HashOf(0), Bytes(0)));
  // The wrong size is never taken.
  EXPECT_FALSE(cache->Demote(HashOf(50), std::vector<uint8_t>(10)));
}

TEST_F(DiskCacheTest, AFullTierOverwritesTheLeastRecentlyUsedBlock) {
  std::unique_ptr<DiskCache> cache = Open(Options(3));
  ASSERT_NE(cache, nullptr);
  DemoteAll(*cache, 0, 3);
  // Block 0 is read (used): block 1 is now the oldest.
  KV_ASSERT_OK_AND_ASSIGN(auto read, cache->Read(Chain(0, 1), Soon()));
  ASSERT_EQ(read.size(), 1u);
  DemoteAll(*cache, 10, 1);
  EXPECT_EQ(cache->listed_blocks(), 3);
  EXPECT_EQ(cache->HeldRun(Chain(0, 1), 0), 1);
  EXPECT_EQ(cache->HeldRun(Chain(1, 1), 0), 0);
  EXPECT_EQ(cache->HeldRun(Chain(2, 1), 0), 1);
  KV_ASSERT_OK_AND_ASSIGN(read, cache->Read(Chain(10, 1), Soon()));
  ASSERT_EQ(read.size(), 1u);
  EXPECT_EQ(read[0], Bytes(10));
}

// kill -9 and restart: the new process lists only what its scan verified.
TEST_F(DiskCacheTest, ARestartListsOnlyBlocksThatVerify) {
  std::string path;
  {
    std::unique_ptr<DiskCache> cache = Open(Options(8));
    ASSERT_NE(cache, nullptr);
    DemoteAll(*cache, 0, 4);
    path = cache->path();
  }
  // A flipped byte in some slot's payload (the scan reads every slot; which block it hit does
  // not matter, only that exactly one fails).
  {
    int fd = open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    uint8_t byte = 0;
    const off_t at = static_cast<off_t>(kSlotBytes + 4096 + 1000);  // slot 1's payload
    ASSERT_EQ(pread(fd, &byte, 1, at), 1);
    byte ^= 0x40;
    ASSERT_EQ(pwrite(fd, &byte, 1, at), 1);
    close(fd);
  }
  std::unique_ptr<DiskCache> cache = Open(Options(8));
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(cache->scanned_blocks(), 3);
  EXPECT_EQ(cache->rejected_at_scan(), 1);
  EXPECT_EQ(cache->listed_blocks(), 3);
  int64_t readable = 0;
  for (uint32_t i = 0; i < 4; ++i) {
    if (cache->HeldRun(Chain(i, 1), 0) == 0) continue;
    KV_ASSERT_OK_AND_ASSIGN(auto read, cache->Read(Chain(i, 1), Soon()));
    ASSERT_EQ(read.size(), 1u);
    EXPECT_EQ(read[0], Bytes(i));
    ++readable;
  }
  EXPECT_EQ(readable, 3);
}

// A byte flipped while the block is listed: the read fails verification, the block is unlisted
// (recomputed by the caller), the blocks before it are returned.
TEST_F(DiskCacheTest, AFlippedByteIsDetectedOnRead) {
  std::unique_ptr<DiskCache> cache = Open(Options(4));
  ASSERT_NE(cache, nullptr);
  DemoteAll(*cache, 0, 2);
  // Demotions fill free slots from 0 up: block 1 is in slot 1.
  {
    int fd = open(cache->path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    uint8_t byte = 0;
    const off_t at = static_cast<off_t>(kSlotBytes + 4096 + 17);
    ASSERT_EQ(pread(fd, &byte, 1, at), 1);
    byte ^= 1;
    ASSERT_EQ(pwrite(fd, &byte, 1, at), 1);
    close(fd);
  }
  KV_ASSERT_OK_AND_ASSIGN(auto read, cache->Read(Chain(0, 2), Soon()));
  ASSERT_EQ(read.size(), 1u);
  EXPECT_EQ(read[0], Bytes(0));
  EXPECT_EQ(cache->HeldRun(Chain(0, 2), 0), 1);
  EXPECT_EQ(Metric("kvrelay:disk_tier_corrupt_blocks_total"), 1);
}

// Another layout (or, through the block hash, another tenant) never matches: its own file.
TEST_F(DiskCacheTest, AnotherLayoutSeesNothing) {
  {
    std::unique_ptr<DiskCache> cache = Open(Options(4, /*layout=*/1));
    ASSERT_NE(cache, nullptr);
    DemoteAll(*cache, 0, 2);
  }
  std::unique_ptr<DiskCache> other = Open(Options(4, /*layout=*/2));
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(other->listed_blocks(), 0);
  EXPECT_EQ(other->HeldRun(Chain(0, 2), 0), 0);
}

TEST_F(DiskCacheTest, AnIoErrorStopsTheTierAndItSaysSo) {
  DiskCacheOptions o = Options(4);
  o.inject_result = [](bool is_write, int64_t, int result) { return is_write ? -EIO : result; };
  std::unique_ptr<DiskCache> cache = Open(std::move(o));
  ASSERT_NE(cache, nullptr);
  EXPECT_TRUE(cache->Demote(HashOf(0), Bytes(0)));
  ASSERT_TRUE(cache->Flush(Soon()));
  EXPECT_FALSE(cache->up());
  EXPECT_THAT(cache->stopped_reason(), HasSubstr("io_error"));
  EXPECT_EQ(cache->listed_blocks(), 0);
  EXPECT_FALSE(cache->Demote(HashOf(1), Bytes(1)));
  EXPECT_THAT(cache->Read(Chain(0, 1), Soon()), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ(Metric("kvrelay:disk_tier_up"), 0);
  EXPECT_EQ(Metric("kvrelay:disk_tier_stopped_total{reason=\"io_error\"}"), 1);
}

// A disk too small for --ssd-bytes (a 64 KiB tmpfs): the worker starts with the tier stopped.
TEST_F(DiskCacheTest, AFullDiskStopsTheTierAtOpen) {
  if (mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, "size=64k") != 0) {
    GTEST_SKIP() << "SKIP: cannot mount a size-limited tmpfs here (" << std::strerror(errno) << ")";
  }
  std::unique_ptr<DiskCache> cache = Open(Options(64));
  umount2(dir_.path().c_str(), MNT_DETACH);
  ASSERT_NE(cache, nullptr);
  EXPECT_FALSE(cache->up());
  EXPECT_THAT(cache->stopped_reason(), HasSubstr("full"));
  EXPECT_FALSE(cache->Demote(HashOf(0), Bytes(0)));
  EXPECT_EQ(Metric("kvrelay:disk_tier_stopped_total{reason=\"full\"}"), 1);
}

// What the store is told: every listed block first, then each change in order (an overwritten
// slot: the new block; a block that failed verification: a zero hash).
TEST_F(DiskCacheTest, AListenerHearsEverySlotChangeInOrder) {
  std::unique_ptr<DiskCache> cache = Open(Options(2));
  ASSERT_NE(cache, nullptr);
  DemoteAll(*cache, 0, 1);
  absl::Mutex mu;
  std::vector<std::pair<int64_t, kv::BlockHash>> heard;
  cache->Listen([&](int64_t slot, const kv::BlockHash& hash) {
    absl::MutexLock lock(&mu);
    heard.push_back({slot, hash});
  });
  {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(heard.size(), 1u);
    EXPECT_EQ(heard[0].second, HashOf(0));
  }
  DemoteAll(*cache, 1, 2);  // the free slot, then block 0's (the oldest) again
  size_t before_stop = 0;
  {
    absl::MutexLock lock(&mu);
    // Applied in order, what was heard is what the tier lists; block 0's slot was emptied
    // before block 2 was announced there.
    std::map<int64_t, kv::BlockHash> slots;
    for (const auto& [slot, hash] : heard) slots[slot] = hash;
    std::map<int64_t, kv::BlockHash> listed;
    for (const auto& [slot, hash] : cache->Listed()) listed[slot] = hash;
    EXPECT_EQ(slots, listed);
    EXPECT_EQ(listed.size(), 2u);
    EXPECT_EQ(listed[heard[0].first], HashOf(2));
    ASSERT_EQ(heard.size(), 4u);
    EXPECT_EQ(
        std::count(heard.begin(), heard.end(), std::make_pair(heard[0].first, kv::BlockHash{})), 1);
    before_stop = heard.size();
  }
  cache->Listen({});
  DemoteAll(*cache, 3, 1);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(heard.size(), before_stop);
}

// An SSD hit slower than recomputing is recomputed; a fast or not yet measured disk is read.
TEST(ChooseDiskOrRecomputeTest, ASlowDiskIsNotRead) {
  // 6 blocks of 1 MiB (96 tokens) against 10,000 tokens/s of compute (9.6 ms).
  const uint64_t bytes = 6 << 20;
  EXPECT_EQ(ChooseDiskOrRecompute(bytes, 96, /*disk_bytes_per_second=*/50e6, 10000).choice,
            kv::ReuseChoice::kRecompute);  // 126 ms to read
  EXPECT_EQ(ChooseDiskOrRecompute(bytes, 96, /*disk_bytes_per_second=*/2e9, 10000).choice,
            kv::ReuseChoice::kPull);  // 3 ms to read
  EXPECT_EQ(ChooseDiskOrRecompute(bytes, 96, /*disk_bytes_per_second=*/0, 10000).choice,
            kv::ReuseChoice::kPull);  // not measured yet: read, which measures it
  const kv::PullOrRecompute slow = ChooseDiskOrRecompute(bytes, 96, 50e6, 10000);
  EXPECT_GT(slow.pull_seconds, slow.recompute_seconds);
}

TEST_F(DiskCacheTest, AReadPastItsDeadlineReturnsNothing) {
  std::unique_ptr<DiskCache> cache = Open(Options(4));
  ASSERT_NE(cache, nullptr);
  DemoteAll(*cache, 0, 1);
  EXPECT_THAT(cache->Read(Chain(0, 1), absl::Now() - absl::Seconds(1)),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
}

// Four stages, each a quarter of the block (as a layout's layer strips would be).
std::vector<std::vector<kv::PayloadRange>> QuarterStages() {
  std::vector<std::vector<kv::PayloadRange>> stages;
  for (uint64_t q = 0; q < 4; ++q) {
    const uint64_t from = kBlockBytes * q / 4, to = kBlockBytes * (q + 1) / 4;
    stages.push_back({{from, to - from}});
  }
  return stages;
}

// Layer-wise promotion: each stage is in the caller's memory (a block's groups in separate
// places) as soon as it verified, while later stages are still being read, here behind a slow
// disk (every read 30 ms).
TEST_F(DiskCacheTest, AStagedReadHandsOutEachStageWhileLaterOnesAreRead) {
  DiskCacheOptions o = Options(8);
  o.stages = QuarterStages();
  o.inject_result = [](bool is_write, int64_t, int result) {
    if (!is_write) absl::SleepFor(absl::Milliseconds(30));
    return result;
  };
  std::unique_ptr<DiskCache> cache = Open(std::move(o));
  ASSERT_NE(cache, nullptr);
  ASSERT_EQ(cache->num_stages(), 4);
  DemoteAll(*cache, 0, 3);
  const uint64_t half = kBlockBytes / 2;
  std::vector<std::vector<uint8_t>> low(3, std::vector<uint8_t>(half, 0));
  std::vector<std::vector<uint8_t>> high(3, std::vector<uint8_t>(kBlockBytes - half, 0));
  std::vector<std::vector<kv::DiskTier::Destination>> places;
  for (size_t b = 0; b < 3; ++b) {
    places.push_back({{0, half, low[b].data()}, {half, kBlockBytes - half, high[b].data()}});
  }
  std::vector<kv::BlockHash> chain = Chain(0, 3);
  chain.push_back(HashOf(99));  // not on disk: the read stops before it
  places.push_back({});
  KV_ASSERT_OK_AND_ASSIGN(auto read, cache->ReadStaged(chain, std::move(places), Soon()));
  EXPECT_EQ(read->blocks(), 3);
  KV_ASSERT_OK(read->WaitForStage(0, Soon()));
  EXPECT_LT(read->stages_done(), 4) << "the last stage was read with the first";
  for (size_t b = 0; b < 3; ++b) {
    const std::vector<uint8_t> want = Bytes(static_cast<uint32_t>(b));
    EXPECT_TRUE(std::equal(low[b].begin(), low[b].begin() + kBlockBytes / 4, want.begin()));
  }
  KV_ASSERT_OK(read->WaitForStage(3, Soon()));
  for (size_t b = 0; b < 3; ++b) {
    const std::vector<uint8_t> want = Bytes(static_cast<uint32_t>(b));
    EXPECT_EQ(low[b], std::vector<uint8_t>(want.begin(), want.begin() + half)) << b;
    EXPECT_EQ(high[b], std::vector<uint8_t>(want.begin() + half, want.end())) << b;
  }
  EXPECT_EQ(Metric("kvrelay:disk_tier_promoted_blocks_total"), 3);
  EXPECT_GT(cache->read_bytes_per_second(), 0);
}

// A flipped byte in a later stage fails that stage and every one after it; the block leaves the
// tier. A cancelled read writes nothing more into the caller's memory.
TEST_F(DiskCacheTest, AStagedReadFailsAtTheBadStageAndACancelledOneStopsWriting) {
  DiskCacheOptions o = Options(8);
  o.stages = QuarterStages();
  std::unique_ptr<DiskCache> cache = Open(std::move(o));
  ASSERT_NE(cache, nullptr);
  DemoteAll(*cache, 0, 2);
  const auto listed = cache->Listed();
  int64_t slot_of_1 = -1;
  for (const auto& [slot, hash] : listed) {
    if (hash == HashOf(1)) slot_of_1 = slot;
  }
  ASSERT_GE(slot_of_1, 0);
  {
    // The last payload byte lies in the last stage.
    const int fd = open(cache->path().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const uint8_t junk = static_cast<uint8_t>(~Bytes(1).back());
    ASSERT_EQ(
        pwrite(fd, &junk, 1, static_cast<off_t>(slot_of_1 * kSlotBytes + 4096 + kBlockBytes - 1)),
        1);
    close(fd);
  }
  std::vector<std::vector<uint8_t>> blocks(2, std::vector<uint8_t>(kBlockBytes, 0));
  std::vector<std::vector<kv::DiskTier::Destination>> places;
  for (auto& b : blocks) places.push_back({{0, kBlockBytes, b.data()}});
  KV_ASSERT_OK_AND_ASSIGN(auto read, cache->ReadStaged(Chain(0, 2), std::move(places), Soon()));
  KV_ASSERT_OK(read->WaitForStage(2, Soon()));
  EXPECT_THAT(read->WaitForStage(3, Soon()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("stage 3 checksum")));
  EXPECT_EQ(cache->HeldRun(Chain(0, 2), 0), 1);  // block 1 is gone from the tier
  EXPECT_EQ(Metric("kvrelay:disk_tier_corrupt_blocks_total"), 1);

  // Once Cancel() returns, the read writes nothing more into the destination (the caller
  // frees it), whether the tier thread had started on it or not.
  std::vector<uint8_t> untouched(kBlockBytes, 0);
  std::vector<std::vector<kv::DiskTier::Destination>> one;
  one.push_back({{0, kBlockBytes, untouched.data()}});
  {
    KV_ASSERT_OK_AND_ASSIGN(auto cancelled, cache->ReadStaged(Chain(0, 1), std::move(one), Soon()));
    cancelled->Cancel();
    std::fill(untouched.begin(), untouched.end(), 0xEE);
  }
  // A whole read queued after it returns only once the tier thread is past the cancelled job.
  KV_ASSERT_OK_AND_ASSIGN(auto again, cache->Read(Chain(0, 1), Soon()));
  EXPECT_EQ(again.size(), 1u);
  EXPECT_EQ(untouched, std::vector<uint8_t>(kBlockBytes, 0xEE));
}

}  // namespace
}  // namespace kvrelay::worker
