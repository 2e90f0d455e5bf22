#pragma once

// LeaseTable: read leases taken by MatchPrefix. A lease pins its blocks (the BlockIndex keeps a
// per-block lease count) until it is released or its TTL passes. The table only remembers which
// blocks each lease holds and when it expires; the owner releases the pins in the index.
//
// Thread-safe.

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv/block_hash.h"

namespace kvrelay::cachestore {

class LeaseTable {
 public:
  // Returns a fresh non-zero lease id.
  uint64_t Add(std::vector<kv::BlockHash> blocks, absl::Time expiry);
  // The blocks of a live lease (and forgets it), or nullopt when unknown or already expired.
  std::optional<std::vector<kv::BlockHash>> Release(uint64_t lease_id);
  // Removes every lease with expiry <= now and returns their blocks.
  std::vector<std::vector<kv::BlockHash>> Expire(absl::Time now);
  int64_t active() const;

 private:
  struct Lease {
    std::vector<kv::BlockHash> blocks;
    absl::Time expiry;
  };
  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, uint64_t> by_expiry_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::cachestore
