#include "cachestore/adaptive_policy.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvrelay::cachestore {

int ReplayRequestInto(BlockIndex& index, absl::Span<const BlockHash> chain, int64_t capacity,
                      int64_t* cached, int64_t* evictions) {
  const int hits = index.MatchPrefix(chain, /*touch=*/false, /*lease=*/false, nullptr);
  std::vector<BlockHash> leased;
  leased.reserve(chain.size());
  BlockHash parent;
  for (const BlockHash& h : chain) {
    if (index.Touch(h, /*lease=*/true)) {
      leased.push_back(h);
      parent = h;
      continue;
    }
    while (*cached >= capacity) {
      if (!index.EvictOne().has_value()) break;
      --*cached;
      ++*evictions;
    }
    // A request longer than the whole cache: the rest of it cannot be stored.
    if (*cached >= capacity) break;
    NewBlock block;
    block.hash = h;
    block.parent = parent;
    if (!index.Insert(block, BlockState::kCommitted, /*lease=*/true).ok()) break;
    ++*cached;
    leased.push_back(h);
    parent = h;
  }
  index.ReleaseLeases(leased);
  return hits;
}

struct AdaptivePolicy::Shadow {
  Shadow(std::unique_ptr<EvictionPolicy> p, int64_t cap)
      : policy(std::move(p)), capacity(cap), index([&] {
          BlockIndex::Options o;
          o.policy = policy.get();
          o.ghost_capacity = static_cast<size_t>(kGhostCaches * cap);
          return o;
        }()) {}
  std::unique_ptr<EvictionPolicy> policy;
  int64_t capacity;
  BlockIndex index;
  int64_t cached = 0;
  int64_t evictions = 0;
};

AdaptivePolicy::AdaptivePolicy(int64_t capacity_blocks)
    : lrfu_(kLrfuHalfLifeCaches * static_cast<double>(std::max<int64_t>(capacity_blocks, 1))) {
  absl::MutexLock lock(&mu_);
  ResetShadows(capacity_blocks);
}

AdaptivePolicy::~AdaptivePolicy() = default;

void AdaptivePolicy::ResetShadows(int64_t capacity_blocks) const {
  capacity_ = std::max<int64_t>(capacity_blocks, 1);
  int64_t shadow_capacity = capacity_;
  while (shadow_capacity > kMaxShadowBlocks) shadow_capacity /= 2;
  lru_shadow_ =
      std::make_unique<Shadow>(std::make_unique<LruPolicy>(/*leaf_only=*/true), shadow_capacity);
  lrfu_shadow_ = std::make_unique<Shadow>(
      std::make_unique<LrfuPolicy>(kLrfuHalfLifeCaches * static_cast<double>(shadow_capacity)),
      shadow_capacity);
  score_ = 0;
}

void AdaptivePolicy::OnInsert(AccessStats& stats, uint64_t tick, const AccessStats* ghost) const {
  lrfu_.OnInsert(stats, tick, ghost);
}

void AdaptivePolicy::OnAccess(AccessStats& stats, uint64_t tick) const {
  lrfu_.OnAccess(stats, tick);
}

double AdaptivePolicy::Priority(const AccessStats& stats) const {
  return use_lrfu_.load(std::memory_order_relaxed) ? lrfu_.Priority(stats) : lru_.Priority(stats);
}

void AdaptivePolicy::SetCapacityHint(int64_t capacity_blocks) const {
  if (capacity_blocks <= 0) return;
  lrfu_.SetCapacityHint(capacity_blocks);
  absl::MutexLock lock(&mu_);
  if (capacity_blocks != capacity_) ResetShadows(capacity_blocks);
}

void AdaptivePolicy::OnRequest(absl::Span<const BlockHash> chain) const {
  if (chain.empty()) return;
  absl::MutexLock lock(&mu_);
  const int64_t shadow_capacity = lru_shadow_->capacity;
  if (shadow_capacity < capacity_) {
    // Sample whole chains by their root so shared prefixes stay together.
    const uint64_t rate = static_cast<uint64_t>(capacity_ / shadow_capacity);
    if ((chain[0].hi % rate) != 0) return;
  }
  const int lru_hits = ReplayRequestInto(lru_shadow_->index, chain, lru_shadow_->capacity,
                                         &lru_shadow_->cached, &lru_shadow_->evictions);
  const int lrfu_hits = ReplayRequestInto(lrfu_shadow_->index, chain, lrfu_shadow_->capacity,
                                          &lrfu_shadow_->cached, &lrfu_shadow_->evictions);
  score_ = score_ * std::exp2(-static_cast<double>(chain.size()) /
                              (kScoreMemoryCaches * static_cast<double>(shadow_capacity))) +
           (lrfu_hits - lru_hits);
  const bool want_lrfu = score_ > 0 ? true : score_ < 0 ? false : use_lrfu_.load();
  if (want_lrfu != use_lrfu_.load(std::memory_order_relaxed)) {
    use_lrfu_.store(want_lrfu, std::memory_order_relaxed);
    epoch_.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace kvrelay::cachestore
