#pragma once

// LeaseTable: read leases taken by MatchPrefix. A lease pins its blocks (the BlockIndex keeps a
// per-block lease count) until it is released or its TTL passes. The table only remembers which
// blocks each lease holds, who took it and when it expires; the owner releases the pins in the
// index. Lease ids are random (unguessable); a lease taken by a node can only be released by
// that node and incarnation.
//
// Thread-safe.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv/block_hash.h"

namespace kvrelay::cachestore {

// Who took a lease: empty node_id = an anonymous reader (legacy), releasable by anyone who
// holds the id.
struct LeaseOwner {
  std::string node_id;
  uint64_t incarnation = 0;
};

class LeaseTable {
 public:
  using Owner = LeaseOwner;
  // Returns a fresh random non-zero lease id.
  uint64_t Add(std::vector<kv::BlockHash> blocks, absl::Time expiry, Owner owner = {});
  // The blocks of a live lease (and forgets it). NotFound when unknown or already expired;
  // PermissionDenied (naming both nodes) when the lease belongs to another node, or
  // FailedPrecondition to another incarnation of the caller's node.
  absl::StatusOr<std::vector<kv::BlockHash>> Release(uint64_t lease_id, const Owner& caller = {});
  // Forgets every lease taken by `node_id` (its process is gone) and returns their blocks.
  std::vector<std::vector<kv::BlockHash>> RemoveOwner(const std::string& node_id);
  // Removes every lease with expiry <= now and returns their blocks.
  std::vector<std::vector<kv::BlockHash>> Expire(absl::Time now);
  int64_t active() const;

 private:
  struct Lease {
    std::vector<kv::BlockHash> blocks;
    absl::Time expiry;
    Owner owner;
  };
  void EraseExpiryEntry(uint64_t lease_id, absl::Time expiry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, uint64_t> by_expiry_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay::cachestore
