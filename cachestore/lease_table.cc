#include "cachestore/lease_table.h"

#include "absl/strings/str_cat.h"
#include "cachestore/node_registry.h"
#include "cachestore/random_id.h"

namespace kvrelay::cachestore {

uint64_t LeaseTable::Add(std::vector<kv::BlockHash> blocks, absl::Time expiry, Owner owner) {
  absl::MutexLock lock(&mu_);
  uint64_t id = RandomId();
  while (leases_.contains(id)) id = RandomId();
  leases_[id] = Lease{std::move(blocks), expiry, std::move(owner)};
  by_expiry_.emplace(expiry, id);
  return id;
}

void LeaseTable::EraseExpiryEntry(uint64_t lease_id, absl::Time expiry) {
  auto range = by_expiry_.equal_range(expiry);
  for (auto e = range.first; e != range.second; ++e) {
    if (e->second == lease_id) {
      by_expiry_.erase(e);
      break;
    }
  }
}

absl::StatusOr<std::vector<kv::BlockHash>> LeaseTable::Release(uint64_t lease_id,
                                                               const Owner& caller) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(
        absl::StrCat("lease_id: ", lease_id, " is unknown, released or expired"));
  }
  const Owner& owner = it->second.owner;
  if (!owner.node_id.empty()) {
    if (caller.node_id != owner.node_id) {
      return IdentityError(
          absl::PermissionDeniedError(absl::StrCat(
              "lease_id: lease ", lease_id, " belongs to node '", owner.node_id, "', not to ",
              caller.node_id.empty() ? std::string("an anonymous caller")
                                     : absl::StrCat("node '", caller.node_id, "'"))),
          caller.node_id);
    }
    if (caller.incarnation != owner.incarnation) {
      return IdentityError(
          absl::FailedPreconditionError(absl::StrCat(
              "incarnation: lease ", lease_id, " belongs to node '", owner.node_id,
              "' incarnation ", owner.incarnation, ", not incarnation ", caller.incarnation)),
          caller.node_id);
    }
  }
  EraseExpiryEntry(lease_id, it->second.expiry);
  std::vector<kv::BlockHash> blocks = std::move(it->second.blocks);
  leases_.erase(it);
  return blocks;
}

std::vector<std::vector<kv::BlockHash>> LeaseTable::RemoveOwner(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  std::vector<std::vector<kv::BlockHash>> out;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.owner.node_id == node_id) {
      EraseExpiryEntry(it->first, it->second.expiry);
      out.push_back(std::move(it->second.blocks));
      leases_.erase(it++);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<std::vector<kv::BlockHash>> LeaseTable::Expire(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<std::vector<kv::BlockHash>> out;
  while (!by_expiry_.empty() && by_expiry_.begin()->first <= now) {
    auto it = leases_.find(by_expiry_.begin()->second);
    if (it != leases_.end()) {
      out.push_back(std::move(it->second.blocks));
      leases_.erase(it);
    }
    by_expiry_.erase(by_expiry_.begin());
  }
  return out;
}

int64_t LeaseTable::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(leases_.size());
}

}  // namespace kvrelay::cachestore
