#include "cachestore/eviction_policy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "cachestore/adaptive_policy.h"
#include "common/check.h"

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

void LrfuPolicy::OnInsert(AccessStats& stats, const kv::BlockHash&, uint64_t tick,
                          const AccessStats* ghost) const {
  stats.crf = ghost == nullptr ? kFirstSightCrf : InsertedCrf(ghost->crf, ghost->last_tick, tick);
  stats.last_tick = tick;
}

void LrfuPolicy::OnAccess(AccessStats& stats, const kv::BlockHash&, uint64_t tick) const {
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

std::unique_ptr<RecentFilter::Table> RecentFilter::MakeTable(int64_t capacity_blocks) {
  uint64_t buckets = 256;
  while (buckets * kWays <
         static_cast<uint64_t>(kProbationHistoryCaches * std::max<int64_t>(capacity_blocks, 1))) {
    buckets *= 2;
  }
  auto table = std::make_unique<Table>();
  // Zeroed by calloc (an empty entry is 0); large tables get untouched pages from the kernel.
  table->entries.reset(static_cast<uint32_t*>(std::calloc(buckets * kWays, sizeof(uint32_t))));
  KV_CHECK(table->entries != nullptr);  // out of memory
  table->mask = buckets - 1;
  return table;
}

RecentFilter::RecentFilter(int64_t capacity_blocks)
    : epoch_ticks_(std::max<int64_t>(capacity_blocks, 1)) {
  tables_.push_back(MakeTable(capacity_blocks));
  table_.store(tables_.back().get(), std::memory_order_release);
}

void RecentFilter::SetCapacity(int64_t capacity_blocks) const {
  epoch_ticks_.store(std::max<int64_t>(capacity_blocks, 1), std::memory_order_relaxed);
  std::unique_ptr<Table> sized = MakeTable(capacity_blocks);
  absl::MutexLock lock(&tables_mu_);
  if (sized->mask == table_.load(std::memory_order_relaxed)->mask) return;  // same size
  // Back to a size used before: that table again, emptied (a lookup that still holds it may
  // write a stamp meanwhile: one admission decided on it, as with any lost update). So there is
  // at most one table per size.
  for (const std::unique_ptr<Table>& t : tables_) {
    if (t->mask != sized->mask) continue;
    for (uint64_t i = 0; i < (t->mask + 1) * kWays; ++i) {
      std::atomic_ref<uint32_t>(t->entries[i]).store(0, std::memory_order_relaxed);
    }
    table_.store(t.get(), std::memory_order_release);
    return;
  }
  tables_.push_back(std::move(sized));
  table_.store(tables_.back().get(), std::memory_order_release);
}

bool RecentFilter::SeenThenStamp(const kv::BlockHash& hash, uint64_t tick) const {
  // Epochs run 1..65535 (0 marks an empty entry); ages are taken modulo 65535.
  constexpr uint32_t kEpochs = 65535;
  const uint32_t now = static_cast<uint32_t>(
      (tick / static_cast<uint64_t>(epoch_ticks_.load(std::memory_order_relaxed))) % kEpochs + 1);
  const uint64_t mixed = (hash.lo ^ (hash.hi * 0x9e3779b97f4a7c15ull)) * 0xbf58476d1ce4e5b9ull;
  const uint32_t fingerprint = static_cast<uint32_t>(mixed >> 48);
  const Table* table = table_.load(std::memory_order_acquire);
  uint32_t* bucket = &table->entries[((mixed >> 8) & table->mask) * kWays];
  int oldest = 0;
  uint32_t oldest_age = 0;
  for (int i = 0; i < kWays; ++i) {
    const uint32_t e = std::atomic_ref<uint32_t>(bucket[i]).load(std::memory_order_relaxed);
    const uint32_t epoch = e & 0xFFFF;
    if (epoch == 0) {
      if (oldest_age <= kEpochs) oldest = i, oldest_age = kEpochs + 1;  // empty: fill first
      continue;
    }
    const uint32_t age = (now + kEpochs - epoch) % kEpochs;
    if ((e >> 16) == fingerprint) {
      std::atomic_ref<uint32_t>(bucket[i]).store((fingerprint << 16) | now,
                                                 std::memory_order_relaxed);
      return age < static_cast<uint32_t>(kProbationHistoryCaches);
    }
    if (age >= oldest_age) oldest = i, oldest_age = age;
  }
  std::atomic_ref<uint32_t>(bucket[oldest])
      .store((fingerprint << 16) | now, std::memory_order_relaxed);
  return false;
}

void ProbationLruPolicy::OnInsert(AccessStats& stats, const kv::BlockHash& hash, uint64_t tick,
                                  const AccessStats* ghost) const {
  const bool seen = recent_.SeenThenStamp(hash, tick);
  stats.probation = (seen || ghost != nullptr) ? kRefetched : kOnProbation;
  stats.last_tick = tick;
}

void ProbationLruPolicy::OnAccess(AccessStats& stats, const kv::BlockHash& hash,
                                  uint64_t tick) const {
  recent_.SeenThenStamp(hash, tick);
  stats.probation = 0;
  stats.last_tick = tick;
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
  if (name == "probation-lru") return EvictionPolicyPtr(new ProbationLruPolicy(capacity_blocks));
  if (name == "probation-lag") {
    return EvictionPolicyPtr(new ProbationLruPolicy(capacity_blocks, kRefetchLagCaches));
  }
  if (name == "adaptive") return EvictionPolicyPtr(new AdaptivePolicy(capacity_blocks));
  return absl::InvalidArgumentError(
      absl::StrCat("policy: unknown eviction policy '", std::string(name),
                   "' (want lru, leaf-lru, lrfu, probation-lru, probation-lag or adaptive)"));
}

}  // namespace kvrelay::cachestore
