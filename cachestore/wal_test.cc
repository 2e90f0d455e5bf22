#include "cachestore/wal.h"

#include <fcntl.h>
#include <unistd.h>

#include <string>

#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::cachestore {
namespace {

using ::kvrelay::testing::IsOk;
using ::kvrelay::testing::StatusIs;

WalOp Block(uint64_t seq) {
  WalOp op;
  op.type = WalOp::Type::kCommitBlock;
  op.sequence = seq;
  op.hash = kv::BlockHash{seq, seq * 7 + 1};
  op.parent = kv::BlockHash{seq - 1, 0};
  op.size_bytes = 4096;
  op.replicas = {{"node-a", "seg0", static_cast<uint32_t>(seq)}};
  return op;
}

TEST(WalOpTest, RoundTripsEveryType) {
  WalOp reg;
  reg.type = WalOp::Type::kRegisterNode;
  reg.node.node_id = "n1";
  reg.node.transport_kind = "ucx";
  reg.node.transport_address = "127.0.0.1:1";
  reg.node.ttl = absl::Seconds(3);
  reg.node.segments = {{"s", Tier::kGpu, 10, 4096, std::string("\0key", 4)}};
  KV_ASSERT_OK_AND_ASSIGN(WalOp back, DecodeWalOp(EncodeWalOp(reg)));
  EXPECT_EQ(back.node, reg.node);
  KV_ASSERT_OK_AND_ASSIGN(back, DecodeWalOp(EncodeWalOp(Block(5))));
  EXPECT_EQ(back.hash, Block(5).hash);
  EXPECT_EQ(back.parent, Block(5).parent);
  EXPECT_EQ(back.replicas[0].slot, 5u);
  const std::string enc = EncodeWalOp(Block(5));
  EXPECT_THAT(DecodeWalOp(enc.substr(0, enc.size() - 1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DecodeWalOp("\x09"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(WalOpTest, TokensTravelOnlyWhenIncluded) {
  WalOp op = Block(5);
  op.token_ids = {1, -2, 70000, 0x7fffffff};
  // The replication stream's encoding carries them...
  KV_ASSERT_OK_AND_ASSIGN(WalOp back, DecodeWalOp(EncodeWalOp(op, WalTokens::kInclude)));
  EXPECT_EQ(back.token_ids, op.token_ids);
  EXPECT_EQ(back.replicas[0].slot, 5u);
  // ... the WAL's does not: byte for byte the record of a block without tokens.
  EXPECT_EQ(EncodeWalOp(op), EncodeWalOp(Block(5)));
  KV_ASSERT_OK_AND_ASSIGN(back, DecodeWalOp(EncodeWalOp(op)));
  EXPECT_TRUE(back.token_ids.empty());
  // A cut token list is refused, not read as garbage.
  const std::string enc = EncodeWalOp(op, WalTokens::kInclude);
  EXPECT_THAT(DecodeWalOp(enc.substr(0, enc.size() - 2)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(WalOpTest, LoggedBlocksComeBackWithoutTokens) {
  testing::TempDir dir;
  WalOp op = Block(1);
  op.token_ids = {11, 12, 13, 14};
  {
    Wal::Recovered rec;
    KV_ASSERT_OK_AND_ASSIGN(auto wal, Wal::Open(dir.File("wal.log"), /*fsync=*/false, &rec));
    ASSERT_THAT(wal->Append({op}), IsOk());
  }
  Wal::Recovered rec;
  KV_ASSERT_OK_AND_ASSIGN(auto wal, Wal::Open(dir.File("wal.log"), /*fsync=*/false, &rec));
  ASSERT_EQ(rec.ops.size(), 1u);
  EXPECT_EQ(rec.ops[0].hash, op.hash);
  EXPECT_TRUE(rec.ops[0].token_ids.empty());
  EXPECT_EQ(rec.cut_bytes, 0);
  ASSERT_THAT(WriteSnapshot(dir.File("snapshot"), {op}), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<WalOp> snap, ReadSnapshot(dir.File("snapshot")));
  ASSERT_EQ(snap.size(), 1u);
  EXPECT_TRUE(snap[0].token_ids.empty());
}

class WalFileTest : public ::testing::Test {
 protected:
  std::string path() const { return dir_.File("wal.log"); }
  void WriteThree() {
    Wal::Recovered rec;
    KV_ASSERT_OK_AND_ASSIGN(auto wal, Wal::Open(path(), /*fsync=*/false, &rec));
    ASSERT_THAT(wal->Append({Block(1), Block(2)}), IsOk());
    ASSERT_THAT(wal->Append({Block(3)}), IsOk());
  }
  int64_t FileSize() const {
    absl::StatusOr<std::string> s = ReadFileToString(path());
    return s.ok() ? static_cast<int64_t>(s->size()) : -1;
  }
  testing::TempDir dir_;
};

TEST_F(WalFileTest, ReopenReadsEverything) {
  WriteThree();
  Wal::Recovered rec;
  KV_ASSERT_OK_AND_ASSIGN(auto wal, Wal::Open(path(), false, &rec));
  ASSERT_EQ(rec.ops.size(), 3u);
  EXPECT_EQ(rec.cut_bytes, 0);
  EXPECT_EQ(rec.ops[2].sequence, 3u);
}

TEST_F(WalFileTest, TornTailIsCutWithoutLosingIntactRecords) {
  WriteThree();
  const int64_t full = FileSize();
  ASSERT_EQ(::truncate(path().c_str(), full - 5), 0);  // a crash mid-write of record 3
  Wal::Recovered rec;
  KV_ASSERT_OK_AND_ASSIGN(auto wal, Wal::Open(path(), false, &rec));
  ASSERT_EQ(rec.ops.size(), 2u);
  EXPECT_GT(rec.cut_bytes, 0);
  EXPECT_THAT(rec.cut_reason, ::testing::HasSubstr("torn"));
  // Appending after the cut continues a clean log.
  ASSERT_THAT(wal->Append({Block(4)}), IsOk());
  wal.reset();
  Wal::Recovered again;
  KV_ASSERT_OK_AND_ASSIGN(wal, Wal::Open(path(), false, &again));
  ASSERT_EQ(again.ops.size(), 3u);
  EXPECT_EQ(again.ops[2].sequence, 4u);
  EXPECT_EQ(again.cut_bytes, 0);
}

TEST_F(WalFileTest, CorruptRecordAndEverythingAfterItIsCut) {
  WriteThree();
  absl::StatusOr<std::string> data = ReadFileToString(path());
  ASSERT_TRUE(data.ok());
  std::string bad = *data;
  // Flip a payload byte of the second record.
  const size_t first_len = 8 + EncodeWalOp(Block(1)).size();
  bad[first_len + 12] ^= 0x5a;
  ASSERT_THAT(WriteFileAtomically(path(), bad), IsOk());
  Wal::Recovered rec;
  KV_ASSERT_OK_AND_ASSIGN(auto wal, Wal::Open(path(), false, &rec));
  ASSERT_EQ(rec.ops.size(), 1u);
  EXPECT_THAT(rec.cut_reason, ::testing::HasSubstr("checksum"));
  EXPECT_EQ(FileSize(), static_cast<int64_t>(first_len));
}

TEST_F(WalFileTest, GarbageTailIsCut) {
  WriteThree();
  const int64_t full = FileSize();
  {
    int fd = ::open(path().c_str(), O_WRONLY | O_APPEND);
    ASSERT_GE(fd, 0);
    const char junk[] = "\xff\xff\xff\x7fgarbage-after-crash";
    ASSERT_GT(::write(fd, junk, sizeof(junk)), 0);
    ::close(fd);
  }
  Wal::Recovered rec;
  KV_ASSERT_OK_AND_ASSIGN(auto wal, Wal::Open(path(), false, &rec));
  EXPECT_EQ(rec.ops.size(), 3u);
  EXPECT_EQ(FileSize(), full);
}

TEST_F(WalFileTest, SnapshotRoundTripAndCorruptionIsDataLoss) {
  const std::string snap = dir_.File("snapshot");
  EXPECT_THAT(ReadSnapshot(snap), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_THAT(WriteSnapshot(snap, {Block(1), Block(2)}), IsOk());
  KV_ASSERT_OK_AND_ASSIGN(auto ops, ReadSnapshot(snap));
  EXPECT_EQ(ops.size(), 2u);
  ASSERT_EQ(::truncate(snap.c_str(), 20), 0);
  EXPECT_THAT(ReadSnapshot(snap), StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace kvrelay::cachestore
