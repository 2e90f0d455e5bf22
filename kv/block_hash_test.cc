#include "kv/block_hash.h"

#include <thread>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"
#include "kv/checksum.h"

namespace kvrelay::kv {
namespace {

// The layout whose fingerprint model_layout_test pins ("model-a", 2 layers, 2 KV heads x 32).
LayoutFingerprint TestFingerprint() {
  LayerGroup g{LayerKind::kFullAttention, {0, 1}, 2, 32};
  return ModelLayout::Create("model-a", DType::kBf16, 16, {g})->fingerprint();
}

std::vector<int32_t> Iota(int32_t from, int32_t n) {
  std::vector<int32_t> v(n);
  for (int32_t i = 0; i < n; ++i) v[i] = from + i;
  return v;
}

// Golden vectors, computed independently with Python's hashlib from the encoding documented
// in block_hash.h. They pin the hash across builds, machines and releases.
TEST(BlockHash, GoldenVectors) {
  const LayoutFingerprint fp = TestFingerprint();
  std::vector<int32_t> tokens = Iota(0, 32);
  std::vector<BlockHash> chain = HashChain(fp, "tenant-a", tokens, 16);
  ASSERT_EQ(chain.size(), 2u);
  EXPECT_EQ(chain[0].ToHex(), "b63fc942d6bb9829526130d2ce5f464c");
  EXPECT_EQ(chain[1].ToHex(), "eaabae505a08255c76411c5c19e4f63e");
  std::vector<int32_t> sevens(4, 7);
  EXPECT_EQ(HashBlock(BlockHash{}, fp, "", sevens).ToHex(), "957dd52fac58480254f34be02415f3d4");
}

TEST(BlockHash, ChainMatchesBlockByBlock) {
  const LayoutFingerprint fp = TestFingerprint();
  std::vector<int32_t> tokens = Iota(100, 16 * 5 + 7);  // 5 full blocks + a partial one
  std::vector<BlockHash> chain = HashChain(fp, "salt", tokens, 16);
  ASSERT_EQ(chain.size(), 5u);  // the partial block is not hashed
  BlockHash parent;
  for (size_t i = 0; i < chain.size(); ++i) {
    parent = HashBlock(parent, fp, "salt", absl::MakeConstSpan(tokens).subspan(i * 16, 16));
    EXPECT_EQ(chain[i], parent) << i;
  }
}

TEST(BlockHash, SharedPrefixSharesHashesThenDiverges) {
  const LayoutFingerprint fp = TestFingerprint();
  std::vector<int32_t> a = Iota(0, 64);
  std::vector<int32_t> b = a;
  b[40] = 9999;  // inside block 2
  std::vector<BlockHash> ha = HashChain(fp, "t", a, 16);
  std::vector<BlockHash> hb = HashChain(fp, "t", b, 16);
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_EQ(ha[1], hb[1]);
  EXPECT_NE(ha[2], hb[2]);
  // Chaining: identical block-3 tokens still hash differently after a divergent parent.
  EXPECT_NE(ha[3], hb[3]);
}

TEST(BlockHash, SaltIsLengthPrefixedAndSeparatesTenants) {
  const LayoutFingerprint fp = TestFingerprint();
  std::vector<int32_t> tokens = Iota(0, 16);
  EXPECT_NE(HashBlock({}, fp, "tenant-a", tokens), HashBlock({}, fp, "tenant-b", tokens));
  EXPECT_NE(HashBlock({}, fp, "", tokens), HashBlock({}, fp, "x", tokens));
  // ("ab", "c") vs ("a", "bc"): salt and extra keys are both length-prefixed.
  EXPECT_NE(HashBlock({}, fp, "ab", tokens, "c"), HashBlock({}, fp, "a", tokens, "bc"));
  EXPECT_EQ(HashBlock({}, fp, "ab", tokens, "c"), HashBlock({}, fp, "ab", tokens, "c"));
}

TEST(BlockHash, LayoutChangesTheHash) {
  std::vector<int32_t> tokens = Iota(0, 32);
  LayerGroup g{LayerKind::kFullAttention, {0, 1}, 2, 32};
  auto bf16 = ModelLayout::Create("m", DType::kBf16, 16, {g});
  auto fp8 = ModelLayout::Create("m", DType::kFp8, 16, {g});
  ASSERT_TRUE(bf16.ok() && fp8.ok());
  EXPECT_NE(HashChain(bf16->fingerprint(), "", tokens, 16)[0],
            HashChain(fp8->fingerprint(), "", tokens, 16)[0]);
}

TEST(BlockHash, TokenCountIsPartOfTheInput) {
  const LayoutFingerprint fp = TestFingerprint();
  std::vector<int32_t> four = {1, 2, 3, 4};
  std::vector<int32_t> eight = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_NE(HashBlock({}, fp, "", four), HashBlock({}, fp, "", eight));
  // A token id moved into the salt must not give the same input bytes.
  std::vector<int32_t> three = {2, 3, 4};
  EXPECT_NE(HashBlock({}, fp, std::string("\x01\0\0\0", 4), three), HashBlock({}, fp, "", four));
}

TEST(BlockHash, NoCollisionsOverManyBlocksAndThreadsAgree) {
  const LayoutFingerprint fp = TestFingerprint();
  std::vector<int32_t> tokens = Iota(0, 16 * 20000);
  std::vector<BlockHash> chain = HashChain(fp, "s", tokens, 16);
  absl::flat_hash_set<BlockHash> unique(chain.begin(), chain.end());
  EXPECT_EQ(unique.size(), chain.size());
  std::vector<BlockHash> other;
  std::thread t([&] { other = HashChain(fp, "s", tokens, 16); });
  t.join();
  EXPECT_EQ(other, chain);
}

TEST(BlockHash, BytesRoundTrip) {
  BlockHash h{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  EXPECT_EQ(h.ToHex(), "0123456789abcdeffedcba9876543210");
  auto bytes = h.ToBytes();
  EXPECT_EQ(BlockHash::FromBytes(bytes), h);
}

TEST(Checksum, DetectsASingleFlippedBit) {
  std::vector<uint8_t> block(1 << 16);
  for (size_t i = 0; i < block.size(); ++i) block[i] = static_cast<uint8_t>(i * 131);
  const uint64_t before = BlockChecksum(block.data(), block.size());
  EXPECT_EQ(before, BlockChecksum(block.data(), block.size()));
  block[12345] ^= 0x10;
  EXPECT_NE(before, BlockChecksum(block.data(), block.size()));
  // XXH3-64 of the empty input, from the xxHash reference.
  EXPECT_EQ(BlockChecksum(nullptr, 0), 0x2D06800538D394C2ULL);
}

TEST(Checksum, PiecesInOrderEqualTheWhole) {
  std::vector<uint8_t> block(3 * 4096 + 17);
  uint32_t x = 12345;
  for (uint8_t& b : block) {
    x = x * 1103515245u + 12345u;  // no period of 4 KiB: swapped pieces differ
    b = static_cast<uint8_t>(x >> 24);
  }
  BlockChecksummer pieces;
  pieces.Update(block.data(), 4096);
  pieces.Update(block.data() + 4096, 8192);
  pieces.Update(block.data() + 3 * 4096, 17);
  EXPECT_EQ(pieces.Digest(), BlockChecksum(block.data(), block.size()));
  BlockChecksummer swapped;
  swapped.Update(block.data() + 4096, 8192);
  swapped.Update(block.data(), 4096);
  swapped.Update(block.data() + 3 * 4096, 17);
  EXPECT_NE(swapped.Digest(), BlockChecksum(block.data(), block.size()));
}

}  // namespace
}  // namespace kvrelay::kv
