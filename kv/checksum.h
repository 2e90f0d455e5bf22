#pragma once

// Block integrity checksums: XXH3-64 over a block unit's bytes (libxxhash). Not a security
// boundary (that is the transport's and the cache store's authorisation); it detects torn,
// truncated or corrupted transfers at memory speed.

#include <cstddef>
#include <cstdint>
#include <memory>

namespace kvrelay::kv {

uint64_t BlockChecksum(const void* data, size_t size);

// The same checksum over bytes that arrive in pieces (e.g. a block unit whose layer groups
// live in different pools): Update with each piece in order, then Digest ==
// BlockChecksum(concatenation).
class BlockChecksummer {
 public:
  BlockChecksummer();
  ~BlockChecksummer();
  BlockChecksummer(const BlockChecksummer&) = delete;
  BlockChecksummer& operator=(const BlockChecksummer&) = delete;
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvrelay::kv
