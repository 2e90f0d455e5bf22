#pragma once

// Chained block hashes: the identity of a block of KV cache.
//
//   h_i = SHA-256("kvrelay.block.v1" || h_{i-1} || layout fingerprint || len(salt) || salt ||
//                 len(extra) || extra || n || tokens of block i)   truncated to 128 bits.
//
// Only full blocks are hashed. Lengths are little-endian u32 prefixes so ("ab","c") and
// ("a","bc") differ; token ids are little-endian u32. The root parent is all zeros.
//
// SHA-256 (OpenSSL), not a fast non-cryptographic hash: a block hash decides whose KV bytes a
// request reads, so a crafted collision would leak one prompt's cache into another request.
// The input per block is small (block_tokens x 4 bytes), so the cost is ~1 us per block, far
// below the compute that produced the block; XXH3 is used for data checksums instead.
//
// Stable across processes, machines and endianness (golden vectors in tests).

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "kv/model_layout.h"

namespace kvrelay::kv {

struct BlockHash {
  uint64_t hi = 0;  // first 8 digest bytes, big-endian
  uint64_t lo = 0;  // next 8 digest bytes, big-endian

  std::string ToHex() const;  // 32 lowercase hex digits
  // 16 raw bytes (big-endian hi then lo), the wire form.
  std::array<uint8_t, 16> ToBytes() const;
  static BlockHash FromBytes(absl::Span<const uint8_t> bytes);  // REQUIRES: size 16
  bool IsZero() const { return hi == 0 && lo == 0; }

  friend bool operator==(const BlockHash&, const BlockHash&) = default;
  friend auto operator<=>(const BlockHash&, const BlockHash&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& b) {
    return H::combine(std::move(h), b.hi, b.lo);
  }
};

// The hash of one full block given its parent (BlockHash{} for the first block).
BlockHash HashBlock(const BlockHash& parent, const LayoutFingerprint& layout,
                    std::string_view tenant_salt, absl::Span<const int32_t> block_tokens,
                    std::string_view extra_keys = {});

// Hashes every full block of `tokens` (a trailing partial block is not hashed).
// REQUIRES: block_tokens > 0.
std::vector<BlockHash> HashChain(const LayoutFingerprint& layout, std::string_view tenant_salt,
                                 absl::Span<const int32_t> tokens, int32_t block_tokens,
                                 std::string_view extra_keys = {});

}  // namespace kvrelay::kv
