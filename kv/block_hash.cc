#include "kv/block_hash.h"

#include "absl/strings/escaping.h"
#include "common/check.h"
#include "kv/digest.h"

namespace kvrelay::kv {
namespace {

uint64_t LoadBigEndian64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
  return v;
}

void StoreBigEndian64(uint64_t v, uint8_t* p) {
  for (int i = 7; i >= 0; --i) {
    p[i] = static_cast<uint8_t>(v & 0xff);
    v >>= 8;
  }
}

// Encodes one block's hash input into `w` (cleared first) and digests it.
BlockHash HashInto(internal::ByteWriter& w, const BlockHash& parent,
                   const LayoutFingerprint& layout, std::string_view tenant_salt,
                   absl::Span<const int32_t> tokens, std::string_view extra_keys) {
  w.Clear();
  w.Bytes("kvrelay.block.v1");
  std::array<uint8_t, 16> parent_bytes = parent.ToBytes();
  w.Bytes(std::string_view(reinterpret_cast<const char*>(parent_bytes.data()), 16));
  w.Bytes(std::string_view(reinterpret_cast<const char*>(layout.bytes.data()), 16));
  w.LengthPrefixed(tenant_salt);
  w.LengthPrefixed(extra_keys);
  w.U32(static_cast<uint32_t>(tokens.size()));
  for (int32_t t : tokens) w.U32(static_cast<uint32_t>(t));
  std::array<uint8_t, 32> digest = internal::Sha256(w.data());
  return BlockHash::FromBytes(absl::MakeConstSpan(digest.data(), 16));
}

}  // namespace

std::string BlockHash::ToHex() const {
  std::array<uint8_t, 16> b = ToBytes();
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(b.data()), 16));
}

std::array<uint8_t, 16> BlockHash::ToBytes() const {
  std::array<uint8_t, 16> b;
  StoreBigEndian64(hi, b.data());
  StoreBigEndian64(lo, b.data() + 8);
  return b;
}

BlockHash BlockHash::FromBytes(absl::Span<const uint8_t> bytes) {
  KV_DCHECK(bytes.size() == 16);
  return BlockHash{LoadBigEndian64(bytes.data()), LoadBigEndian64(bytes.data() + 8)};
}

BlockHash HashBlock(const BlockHash& parent, const LayoutFingerprint& layout,
                    std::string_view tenant_salt, absl::Span<const int32_t> block_tokens,
                    std::string_view extra_keys) {
  internal::ByteWriter w;
  return HashInto(w, parent, layout, tenant_salt, block_tokens, extra_keys);
}

std::vector<BlockHash> HashChain(const LayoutFingerprint& layout, std::string_view tenant_salt,
                                 absl::Span<const int32_t> tokens, int32_t block_tokens,
                                 std::string_view extra_keys) {
  KV_CHECK(block_tokens > 0);
  const size_t full_blocks = tokens.size() / static_cast<size_t>(block_tokens);
  std::vector<BlockHash> chain;
  chain.reserve(full_blocks);
  internal::ByteWriter w;
  BlockHash parent;
  for (size_t i = 0; i < full_blocks; ++i) {
    parent = HashInto(w, parent, layout, tenant_salt,
                      tokens.subspan(i * block_tokens, block_tokens), extra_keys);
    chain.push_back(parent);
  }
  return chain;
}

}  // namespace kvrelay::kv
