#pragma once

// Unguessable 64-bit identifiers (allocation ids, lease ids, incarnations) from the kernel's
// CSPRNG: a caller that did not receive an id cannot name it (issue 13.4: sequential ids let
// anyone abort, commit or release others' work).

#include <cstdint>

namespace kvrelay::cachestore {

// Never 0 (0 means "none" on the wire).
uint64_t RandomId();

}  // namespace kvrelay::cachestore
