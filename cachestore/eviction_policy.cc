#include "cachestore/eviction_policy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "cachestore/adaptive_policy.h"

namespace kvrelay::cachestore {

namespace {
double Decay(double crf, uint64_t from_tick, uint64_t to_tick, double half_life) {
  if (to_tick <= from_tick) return crf;
  return crf * std::exp2(-static_cast<double>(to_tick - from_tick) / half_life);
}
}  // namespace

float LrfuPolicy::InsertedCrf(float ghost_crf, uint64_t ghost_tick, uint64_t tick) const {
  if (ghost_crf < 0) return kFirstSightCrf;
  return static_cast<float>(1.0 + Decay(ghost_crf, ghost_tick, tick, half_life()));
}

float LrfuPolicy::AccessedCrf(float crf, uint64_t last_tick, uint64_t tick) const {
  // A repeated access at the same tick (one request touching a block twice) does not count twice.
  if (tick == last_tick) return crf;
  return static_cast<float>(Decay(crf, last_tick, tick, half_life()) + 1.0);
}

double LrfuPolicy::PriorityOf(float crf, uint64_t last_tick) const {
  return std::log2(std::max(crf, 1e-30f)) + static_cast<double>(last_tick) / half_life();
}

void LrfuPolicy::OnInsert(AccessStats& stats, uint64_t tick, const AccessStats* ghost) const {
  stats.crf = ghost == nullptr ? kFirstSightCrf : InsertedCrf(ghost->crf, ghost->last_tick, tick);
  stats.last_tick = tick;
}

void LrfuPolicy::OnAccess(AccessStats& stats, uint64_t tick) const {
  stats.crf = AccessedCrf(stats.crf, stats.last_tick, tick);
  stats.last_tick = tick;
}

double LrfuPolicy::Priority(const AccessStats& stats) const {
  return PriorityOf(stats.crf, stats.last_tick);
}

void LrfuPolicy::SetCapacityHint(int64_t capacity_blocks) const {
  if (capacity_blocks <= 0) return;
  half_life_.store(kLrfuHalfLifeCaches * static_cast<double>(capacity_blocks),
                   std::memory_order_relaxed);
}

absl::StatusOr<EvictionPolicyPtr> MakeEvictionPolicy(std::string_view name,
                                                     int64_t capacity_blocks) {
  if (capacity_blocks <= 0) capacity_blocks = 1 << 20;
  if (name == "lru") return EvictionPolicyPtr(new LruPolicy(/*leaf_only=*/false));
  if (name == "leaf-lru") return EvictionPolicyPtr(new LruPolicy(/*leaf_only=*/true));
  if (name == "lrfu") {
    return EvictionPolicyPtr(
        new LrfuPolicy(kLrfuHalfLifeCaches * static_cast<double>(capacity_blocks)));
  }
  if (name == "adaptive") return EvictionPolicyPtr(new AdaptivePolicy(capacity_blocks));
  return absl::InvalidArgumentError(absl::StrCat("policy: unknown eviction policy '",
                                                 std::string(name),
                                                 "' (want lru, leaf-lru, lrfu or adaptive)"));
}

}  // namespace kvrelay::cachestore
