#include "kv/checksum.h"

#include <xxhash.h>

namespace kvrelay::kv {

uint64_t BlockChecksum(const void* data, size_t size) { return XXH3_64bits(data, size); }

}  // namespace kvrelay::kv
