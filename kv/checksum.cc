#include "kv/checksum.h"

#include <xxhash.h>

namespace kvrelay::kv {

uint64_t BlockChecksum(const void* data, size_t size) { return XXH3_64bits(data, size); }

// libxxhash's state is opaque unless XXH_STATIC_LINKING_ONLY; it is allocated by the library.
struct BlockChecksummer::State {
  XXH3_state_t* xxh = XXH3_createState();
  ~State() { XXH3_freeState(xxh); }
};

BlockChecksummer::BlockChecksummer() : state_(std::make_unique<State>()) {
  XXH3_64bits_reset(state_->xxh);
}
BlockChecksummer::~BlockChecksummer() = default;

void BlockChecksummer::Update(const void* data, size_t size) {
  XXH3_64bits_update(state_->xxh, data, size);
}

uint64_t BlockChecksummer::Digest() const { return XXH3_64bits_digest(state_->xxh); }

}  // namespace kvrelay::kv
