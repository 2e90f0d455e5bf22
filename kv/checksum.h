#pragma once

// Block integrity checksums: XXH3-64 over a block unit's bytes (libxxhash). Not a security
// boundary (that is the transport's and the cache store's authorisation); it detects torn,
// truncated or corrupted transfers at memory speed.

#include <cstddef>
#include <cstdint>

namespace kvrelay::kv {

uint64_t BlockChecksum(const void* data, size_t size);

}  // namespace kvrelay::kv
