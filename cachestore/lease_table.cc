#include "cachestore/lease_table.h"

namespace kvrelay::cachestore {

uint64_t LeaseTable::Add(std::vector<kv::BlockHash> blocks, absl::Time expiry) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  leases_[id] = Lease{std::move(blocks), expiry};
  by_expiry_.emplace(expiry, id);
  return id;
}

std::optional<std::vector<kv::BlockHash>> LeaseTable::Release(uint64_t lease_id) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return std::nullopt;
  auto range = by_expiry_.equal_range(it->second.expiry);
  for (auto e = range.first; e != range.second; ++e) {
    if (e->second == lease_id) {
      by_expiry_.erase(e);
      break;
    }
  }
  std::vector<kv::BlockHash> blocks = std::move(it->second.blocks);
  leases_.erase(it);
  return blocks;
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
