#include "kv/disk/disk_tier.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::kv {
namespace {

using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

// Not a multiple of 4 KiB, so the padding path runs.
constexpr uint64_t kBlockBytes = 3 * 4096 + 100;

LayoutFingerprint Fingerprint(uint8_t seed) {
  LayoutFingerprint f;
  for (size_t i = 0; i < f.bytes.size(); ++i) f.bytes[i] = static_cast<uint8_t>(seed + i);
  return f;
}

std::vector<uint8_t> BlockBytes(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(kBlockBytes);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

BlockHash HashOf(uint32_t seed) { return BlockHash{0x1000 + seed, 0x2000 + seed}; }

DiskTierOptions Options(const std::string& dir, int64_t slots, uint8_t layout_seed = 1) {
  DiskTierOptions o;
  o.directory = dir;
  o.block_bytes = kBlockBytes;
  o.capacity_bytes = static_cast<uint64_t>(slots) * (DiskTier::kHeaderBytes + 4 * 4096);
  o.layout = Fingerprint(layout_seed);
  o.queue_depth = 4;
  return o;
}

// Writes blocks seed = slot for slots [0, n).
void WriteSlots(DiskTier& tier, int64_t n, std::vector<std::vector<uint8_t>>& data) {
  std::vector<DiskTier::BlockWrite> writes;
  data.clear();
  for (int64_t s = 0; s < n; ++s) data.push_back(BlockBytes(static_cast<uint32_t>(s)));
  for (int64_t s = 0; s < n; ++s) {
    writes.push_back({s, HashOf(static_cast<uint32_t>(s)), data[s]});
  }
  for (const absl::Status& st : tier.WriteBlocks(writes)) ASSERT_THAT(st, IsOk());
}

absl::Status ReadOne(DiskTier& tier, int64_t slot, const BlockHash& hash,
                     std::vector<uint8_t>& out) {
  out.assign(kBlockBytes, 0);
  DiskTier::BlockRead read{slot, hash, absl::MakeSpan(out)};
  return tier.ReadBlocks({&read, 1})[0];
}

// Overwrites `bytes` at `offset` of the tier's file behind its back (as a failing disk would).
void PokeFile(const std::string& path, off_t offset, const void* bytes, size_t n) {
  int fd = open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(pwrite(fd, bytes, n, offset), static_cast<ssize_t>(n));
  close(fd);
}

TEST(DiskTierTest, BlocksRoundTripAndSurviveReopen) {
  testing::TempDir dir;
  std::vector<std::vector<uint8_t>> data;
  {
    auto tier = DiskTier::Open(Options(dir.path(), 16));
    ASSERT_THAT(tier.status(), IsOk());
    EXPECT_EQ((*tier)->num_slots(), 16);
    WriteSlots(**tier, 10, data);  // more than the queue depth
    std::vector<uint8_t> out;
    for (int64_t s = 0; s < 10; ++s) {
      ASSERT_THAT(ReadOne(**tier, s, HashOf(s), out), IsOk());
      EXPECT_EQ(out, data[s]) << "slot " << s;
    }
  }
  // A restarted worker (same directory and layout) finds every block and reads it back.
  auto tier = DiskTier::Open(Options(dir.path(), 16));
  ASSERT_THAT(tier.status(), IsOk());
  int64_t rejected = -1;
  auto blocks = (*tier)->Scan(&rejected);
  ASSERT_THAT(blocks.status(), IsOk());
  ASSERT_EQ(blocks->size(), 10u);
  EXPECT_EQ(rejected, 0);
  for (const auto& b : *blocks) EXPECT_EQ(b.hash, HashOf(static_cast<uint32_t>(b.slot)));
  std::vector<uint8_t> out;
  ASSERT_THAT(ReadOne(**tier, 7, HashOf(7), out), IsOk());
  EXPECT_EQ(out, data[7]);
}

// Three stages over two "groups" (the block's halves, as a two-group layout's units lie): each
// stage a range of each half, so a stage is two ranges apart in memory.
std::vector<std::vector<PayloadRange>> ThreeStages() {
  const uint64_t half = kBlockBytes / 2;
  const uint64_t a = half / 3, b = 2 * half / 3;
  return {{{0, a}, {half, a}},
          {{a, b - a}, {half + a, b - a}},
          {{b, half - b}, {half + b, kBlockBytes - half - b}}};
}

TEST(DiskTierTest, StagesReadBackOneAfterAnotherIntoTheirPlaces) {
  testing::TempDir dir;
  DiskTierOptions options = Options(dir.path(), 8);
  options.stages = ThreeStages();
  auto tier = DiskTier::Open(options);
  ASSERT_THAT(tier.status(), IsOk());
  ASSERT_EQ((*tier)->num_stages(), 3);
  std::vector<std::vector<uint8_t>> data;
  WriteSlots(**tier, 5, data);
  // Whole reads still return the block as it was (the stage order is the tier's own).
  std::vector<uint8_t> whole;
  ASSERT_THAT(ReadOne(**tier, 3, HashOf(3), whole), IsOk());
  EXPECT_EQ(whole, data[3]);

  // Each block's halves go to separate memory, as a block's groups go to separate pools.
  const uint64_t half = kBlockBytes / 2;
  std::vector<std::vector<uint8_t>> low(5, std::vector<uint8_t>(half, 0));
  std::vector<std::vector<uint8_t>> high(5, std::vector<uint8_t>(kBlockBytes - half, 0));
  std::vector<DiskTier::StageChecksums> sums(5);
  std::vector<DiskTier::StagedRead> reads;
  for (int64_t s = 0; s < 5; ++s) reads.push_back({s, HashOf(s), &sums[s]});
  for (int stage = 0; stage < 3; ++stage) {
    std::vector<int> delivered;
    auto statuses = (*tier)->ReadStage(reads, stage, [&](size_t i, absl::Span<const uint8_t> b) {
      const DiskTier::Destination places[] = {{0, half, low[i].data()},
                                              {half, kBlockBytes - half, high[i].data()}};
      (*tier)->ScatterStage(stage, b, places);
      delivered.push_back(static_cast<int>(i));
    });
    for (const absl::Status& st : statuses) ASSERT_THAT(st, IsOk()) << "stage " << stage;
    EXPECT_EQ(delivered.size(), 5u);
    // Before the last stage, the bytes of later stages are not there yet.
    if (stage == 0) {
      EXPECT_NE(std::vector<uint8_t>(low[1].begin(), low[1].end()),
                std::vector<uint8_t>(data[1].begin(), data[1].begin() + half));
    }
  }
  for (int64_t s = 0; s < 5; ++s) {
    EXPECT_EQ(low[s], std::vector<uint8_t>(data[s].begin(), data[s].begin() + half));
    EXPECT_EQ(high[s], std::vector<uint8_t>(data[s].begin() + half, data[s].end()));
  }
}

TEST(DiskTierTest, AFlippedByteFailsOnlyItsStageAndAnotherPlanNeverVerifies) {
  testing::TempDir dir;
  DiskTierOptions options = Options(dir.path(), 8);
  options.stages = ThreeStages();
  std::vector<std::vector<uint8_t>> data;
  std::string path;
  {
    auto tier = DiskTier::Open(options);
    ASSERT_THAT(tier.status(), IsOk());
    WriteSlots(**tier, 2, data);
    path = (*tier)->path();
    // The last byte of the file's payload belongs to the last stage.
    const off_t last =
        static_cast<off_t>((*tier)->slot_bytes() + DiskTier::kHeaderBytes + kBlockBytes - 1);
    const uint8_t flipped = static_cast<uint8_t>(~data[1].back());
    PokeFile(path, last, &flipped, 1);
    DiskTier::StageChecksums sums;
    const DiskTier::StagedRead read{1, HashOf(1), &sums};
    int delivered = 0;
    auto count = [&](size_t, absl::Span<const uint8_t>) { ++delivered; };
    EXPECT_THAT((*tier)->ReadStage({&read, 1}, 0, count)[0], IsOk());
    EXPECT_THAT((*tier)->ReadStage({&read, 1}, 1, count)[0], IsOk());
    EXPECT_THAT((*tier)->ReadStage({&read, 1}, 2, count)[0],
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("stage 2 checksum")));
    EXPECT_EQ(delivered, 2);  // the bad stage is never handed out
    // Another block asked for at stage 0 is refused before any byte is handed out.
    const DiskTier::StagedRead wrong{0, HashOf(1), &sums};
    EXPECT_THAT((*tier)->ReadStage({&wrong, 1}, 0, count)[0],
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not")));
    EXPECT_EQ(delivered, 2);
  }
  // The same file opened with another stage plan (the bytes would land in the wrong places):
  // nothing verifies.
  options.stages = {{{0, kBlockBytes / 2}}, {{kBlockBytes / 2, kBlockBytes - kBlockBytes / 2}}};
  auto tier = DiskTier::Open(options);
  ASSERT_THAT(tier.status(), IsOk());
  int64_t rejected = 0;
  auto blocks = (*tier)->Scan(&rejected);
  ASSERT_THAT(blocks.status(), IsOk());
  EXPECT_TRUE(blocks->empty());
  EXPECT_EQ(rejected, 2);
  std::vector<uint8_t> out;
  EXPECT_THAT(ReadOne(**tier, 0, HashOf(0), out),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("another plan")));
}

TEST(DiskTierTest, AStagePlanThatDoesNotCoverTheBlockIsRefused) {
  testing::TempDir dir;
  DiskTierOptions options = Options(dir.path(), 8);
  options.stages = {{{0, 100}}, {{200, kBlockBytes - 200}}};
  EXPECT_THAT(DiskTier::Open(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gap at byte 100")));
  options.stages = {{{0, 300}}, {{200, kBlockBytes - 200}}};
  EXPECT_THAT(DiskTier::Open(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlap")));
  options.stages = {{{0, kBlockBytes - 1}}};
  EXPECT_THAT(DiskTier::Open(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cover")));
}

TEST(DiskTierTest, AnotherBlockOrAnEmptySlotIsDataLoss) {
  testing::TempDir dir;
  auto tier = DiskTier::Open(Options(dir.path(), 8));
  ASSERT_THAT(tier.status(), IsOk());
  std::vector<std::vector<uint8_t>> data;
  WriteSlots(**tier, 2, data);
  std::vector<uint8_t> out;
  EXPECT_THAT(ReadOne(**tier, 1, HashOf(0), out),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not")));
  EXPECT_THAT(ReadOne(**tier, 5, HashOf(5), out),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("holds no block")));
  EXPECT_THAT(ReadOne(**tier, 8, HashOf(8), out), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE((*tier)->disabled());
}

TEST(DiskTierTest, AFlippedByteIsDetectedAndOnlyThatBlockIsLost) {
  testing::TempDir dir;
  auto tier = DiskTier::Open(Options(dir.path(), 8));
  ASSERT_THAT(tier.status(), IsOk());
  std::vector<std::vector<uint8_t>> data;
  WriteSlots(**tier, 3, data);
  const off_t payload_byte =
      static_cast<off_t>((*tier)->slot_bytes() + DiskTier::kHeaderBytes + 77);
  const uint8_t flipped = data[1][77] ^ 0x01;
  PokeFile((*tier)->path(), payload_byte, &flipped, 1);
  std::vector<uint8_t> out;
  EXPECT_THAT(ReadOne(**tier, 1, HashOf(1), out),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("payload checksum")));
  ASSERT_THAT(ReadOne(**tier, 2, HashOf(2), out), IsOk());
  EXPECT_EQ(out, data[2]);
  // A flipped header byte fails the header checksum.
  const uint8_t junk = 0xAB;
  PokeFile((*tier)->path(), 20, &junk, 1);
  EXPECT_THAT(ReadOne(**tier, 0, HashOf(0), out),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("header checksum")));
  int64_t rejected = 0;
  auto blocks = (*tier)->Scan(&rejected);
  ASSERT_THAT(blocks.status(), IsOk());
  ASSERT_EQ(blocks->size(), 1u);
  EXPECT_EQ((*blocks)[0].slot, 2);
  EXPECT_EQ(rejected, 2);
  EXPECT_FALSE((*tier)->disabled());
}

TEST(DiskTierTest, ATornOverwriteIsNeverServed) {
  testing::TempDir dir;
  auto tier = DiskTier::Open(Options(dir.path(), 4));
  ASSERT_THAT(tier.status(), IsOk());
  const std::vector<uint8_t> old_block = BlockBytes(100);
  const std::vector<uint8_t> new_block = BlockBytes(200);
  DiskTier::BlockWrite w{0, HashOf(100), old_block};
  ASSERT_THAT((*tier)->WriteBlocks({&w, 1})[0], IsOk());
  w = {0, HashOf(200), new_block};
  ASSERT_THAT((*tier)->WriteBlocks({&w, 1})[0], IsOk());
  // The crash hit mid-write: the new header and first page, the old block's later pages.
  PokeFile((*tier)->path(), static_cast<off_t>(DiskTier::kHeaderBytes + 4096),
           old_block.data() + 4096, kBlockBytes - 4096);
  std::vector<uint8_t> out;
  EXPECT_THAT(ReadOne(**tier, 0, HashOf(200), out), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(ReadOne(**tier, 0, HashOf(100), out), StatusIs(absl::StatusCode::kDataLoss));
  // The other way round: the old header survived, the payload is partly new.
  w = {1, HashOf(100), old_block};
  ASSERT_THAT((*tier)->WriteBlocks({&w, 1})[0], IsOk());
  PokeFile((*tier)->path(), static_cast<off_t>((*tier)->slot_bytes() + DiskTier::kHeaderBytes),
           new_block.data(), 4096);
  EXPECT_THAT(ReadOne(**tier, 1, HashOf(100), out), StatusIs(absl::StatusCode::kDataLoss));
  int64_t rejected = 0;
  auto blocks = (*tier)->Scan(&rejected);
  ASSERT_THAT(blocks.status(), IsOk());
  EXPECT_TRUE(blocks->empty());
  EXPECT_EQ(rejected, 2);
}

TEST(DiskTierTest, ABlockCopiedToAnotherSlotOrLayoutNeverMatches) {
  testing::TempDir dir;
  std::vector<std::vector<uint8_t>> data;
  std::string path;
  {
    auto tier = DiskTier::Open(Options(dir.path(), 4, /*layout_seed=*/1));
    ASSERT_THAT(tier.status(), IsOk());
    WriteSlots(**tier, 1, data);
    path = (*tier)->path();
    // A misdirected copy of slot 0's image into slot 2.
    std::vector<uint8_t> image((*tier)->slot_bytes());
    int fd = open(path.c_str(), O_RDONLY);
    ASSERT_EQ(pread(fd, image.data(), image.size(), 0), static_cast<ssize_t>(image.size()));
    close(fd);
    PokeFile(path, static_cast<off_t>(2 * (*tier)->slot_bytes()), image.data(), image.size());
    std::vector<uint8_t> out;
    EXPECT_THAT(ReadOne(**tier, 2, HashOf(0), out),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("written for slot 0")));
  }
  // Another layout has a file of its own; even handed this one, nothing matches.
  const std::string other_path = dir.File("kvrelay-" + Fingerprint(2).ToHex() + ".tier");
  ASSERT_NE(other_path, path);
  ASSERT_EQ(rename(path.c_str(), other_path.c_str()), 0);
  auto other = DiskTier::Open(Options(dir.path(), 4, /*layout_seed=*/2));
  ASSERT_THAT(other.status(), IsOk());
  ASSERT_EQ((*other)->path(), other_path);
  int64_t rejected = 0;
  auto blocks = (*other)->Scan(&rejected);
  ASSERT_THAT(blocks.status(), IsOk());
  EXPECT_TRUE(blocks->empty());
  EXPECT_EQ(rejected, 2);
}

TEST(DiskTierTest, OneProcessPerFileAndBadOptionsAreNamed) {
  testing::TempDir dir;
  auto first = DiskTier::Open(Options(dir.path(), 4));
  ASSERT_THAT(first.status(), IsOk());
  EXPECT_THAT(DiskTier::Open(Options(dir.path(), 4)).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("in use")));
  DiskTierOptions tiny = Options(dir.path(), 4, 3);
  tiny.capacity_bytes = 4096;
  EXPECT_THAT(DiskTier::Open(tiny).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("hold no block slot")));
  DiskTierOptions deep = Options(dir.path(), 4, 4);
  deep.queue_depth = 0;
  EXPECT_THAT(DiskTier::Open(deep).status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DiskTierTest, AnIoErrorStopsTheTierWithAStructuredReason) {
  testing::TempDir dir;
  DiskTierOptions o = Options(dir.path(), 8);
  int writes_seen = 0;
  o.inject_result = [&](bool is_write, int64_t, int result) {
    return is_write && ++writes_seen == 3 ? -EIO : result;
  };
  auto tier = DiskTier::Open(o);
  ASSERT_THAT(tier.status(), IsOk());
  std::vector<DiskTier::BlockWrite> writes;
  std::vector<std::vector<uint8_t>> data;
  for (uint32_t s = 0; s < 6; ++s) data.push_back(BlockBytes(s));
  for (uint32_t s = 0; s < 6; ++s) writes.push_back({s, HashOf(s), data[s]});
  std::vector<absl::Status> statuses = (*tier)->WriteBlocks(writes);
  EXPECT_THAT(statuses[2], StatusIs(absl::StatusCode::kUnavailable, HasSubstr("slot 2")));
  EXPECT_TRUE((*tier)->disabled());
  EXPECT_EQ((*tier)->failure(), DiskTierFailure::kIoError);
  EXPECT_THAT((*tier)->disabled_reason(), HasSubstr("Input/output error"));
  // Writes and reads are refused at once from now on.
  EXPECT_THAT((*tier)->WriteBlocks(writes)[0], StatusIs(absl::StatusCode::kUnavailable));
  std::vector<uint8_t> out;
  EXPECT_THAT(ReadOne(**tier, 0, HashOf(0), out), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT((*tier)->Scan().status(), StatusIs(absl::StatusCode::kUnavailable));
}

TEST(DiskTierTest, AFailingReadStopsTheTier) {
  testing::TempDir dir;
  DiskTierOptions o = Options(dir.path(), 8);
  bool fail_reads = false;
  o.inject_result = [&](bool is_write, int64_t, int result) {
    return !is_write && fail_reads ? -EIO : result;
  };
  auto tier = DiskTier::Open(o);
  ASSERT_THAT(tier.status(), IsOk());
  std::vector<std::vector<uint8_t>> data;
  WriteSlots(**tier, 2, data);
  fail_reads = true;
  std::vector<uint8_t> out;
  EXPECT_THAT(ReadOne(**tier, 0, HashOf(0), out), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_EQ((*tier)->failure(), DiskTierFailure::kIoError);
}

// A size-limited tmpfs: the full disk is found at open when the file is preallocated, and
// mid-run (ENOSPC) when it is sparse; either way the blocks already written stay readable.
class DiskTierFullDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, "size=256k") != 0) {
      GTEST_SKIP() << "SKIP: cannot mount a size-limited tmpfs here (" << std::strerror(errno)
                   << "); needs CAP_SYS_ADMIN";
    }
    mounted_ = true;
  }
  void TearDown() override {
    if (mounted_) umount2(dir_.path().c_str(), MNT_DETACH);
  }
  testing::TempDir dir_;
  bool mounted_ = false;
};

TEST_F(DiskTierFullDiskTest, PreallocationFindsTheFullDiskAtOpen) {
  EXPECT_THAT(DiskTier::Open(Options(dir_.path(), 64)).status(),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("lower --ssd-bytes")));
}

TEST_F(DiskTierFullDiskTest, ASparseTierStopsTakingBlocksWhenTheDiskFills) {
  DiskTierOptions o = Options(dir_.path(), 64);
  o.preallocate = false;
  auto tier = DiskTier::Open(o);
  ASSERT_THAT(tier.status(), IsOk());
  std::vector<std::vector<uint8_t>> data;
  std::vector<DiskTier::BlockWrite> writes;
  for (uint32_t s = 0; s < 64; ++s) data.push_back(BlockBytes(s));
  for (uint32_t s = 0; s < 64; ++s) writes.push_back({s, HashOf(s), data[s]});
  std::vector<absl::Status> statuses = (*tier)->WriteBlocks(writes);
  EXPECT_EQ((*tier)->failure(), DiskTierFailure::kFull);
  EXPECT_THAT((*tier)->disabled_reason(), HasSubstr("full"));
  int written = 0;
  while (written < 64 && statuses[written].ok()) ++written;
  ASSERT_GT(written, 0);
  ASSERT_LT(written, 64);
  EXPECT_THAT(statuses[written], StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT((*tier)->WriteBlocks({&writes[0], 1})[0], StatusIs(absl::StatusCode::kUnavailable));
  std::vector<uint8_t> out;
  ASSERT_THAT(ReadOne(**tier, 0, HashOf(0), out), IsOk());
  EXPECT_EQ(out, data[0]);
}

}  // namespace
}  // namespace kvrelay::kv
