#pragma once

// AdaptivePolicy ("adaptive", the default): picks, online, whichever of two rankings is winning
// on the workload the store is seeing right now: leaf-first LRU or leaf-first LRFU (frequency with
// aging, ghosts, first-sight penalty; see eviction_policy.h). Nothing is tuned to a trace: the
// decision comes from two shadow caches of the same capacity that replay every request's chain
// (OnRequest) with each ranking, in the spirit of set dueling (Qureshi et al., ISCA 2007) and
// miniature simulations (Waldspurger et al., ATC 2017): the live ranking is the one whose shadow
// earned more prefix hits over roughly the last cache-full of block accesses. A switch bumps
// epoch() so the BlockIndex re-ranks its eviction heap once.
//
// Shadows hold metadata only (a BlockIndex each). Above kMaxShadowBlocks of capacity they sample
// chains by the root block's hash bits (rate kMaxShadowBlocks / capacity, power of two) and run
// at the sampled capacity, so their cost stays bounded.
//
// Thread-safe: OnRequest serialises on a mutex; the other methods are lock-free.

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "cachestore/block_index.h"
#include "cachestore/eviction_policy.h"

namespace kvrelay::cachestore {

// One request replayed into `index` with the trace-replay rule: leading hits are counted, then
// every block is accessed (inserted if missing, evicting leaf-first while the index holds
// `capacity` blocks), the request's blocks leased while it runs. `cached` is the caller's count
// of blocks in the index. Returns the leading hits; adds evictions to *evictions.
int ReplayRequestInto(BlockIndex& index, absl::Span<const BlockHash> chain, int64_t capacity,
                      int64_t* cached, int64_t* evictions);

class AdaptivePolicy final : public EvictionPolicy {
 public:
  static constexpr int64_t kMaxShadowBlocks = 1 << 16;
  // The score forgets with a half-life of this many shadow caches of block accesses: long
  // enough that a switch (which re-shapes the cache) is not undone by noise, short enough to
  // follow a workload that shifts.
  static constexpr double kScoreMemoryCaches = 4.0;

  explicit AdaptivePolicy(int64_t capacity_blocks);
  ~AdaptivePolicy() override;

  std::string_view name() const override { return "adaptive"; }
  bool prefix_aware() const override { return true; }
  void OnInsert(AccessStats& stats, uint64_t tick, const AccessStats* ghost) const override;
  void OnAccess(AccessStats& stats, uint64_t tick) const override;
  double Priority(const AccessStats& stats) const override;
  void SetCapacityHint(int64_t capacity_blocks) const override;
  void OnRequest(absl::Span<const BlockHash> chain) const override;
  uint64_t epoch() const override { return epoch_.load(std::memory_order_acquire); }

  bool using_lrfu() const { return use_lrfu_.load(std::memory_order_relaxed); }
  int64_t switches() const { return static_cast<int64_t>(epoch()); }

 private:
  struct Shadow;
  void ResetShadows(int64_t capacity_blocks) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Both rankings read the same stats: last_tick (LRU) and crf (LRFU), kept up to date by lrfu_.
  LrfuPolicy lrfu_;
  LruPolicy lru_{/*leaf_only=*/true};
  // Relaxed: which ranking a heap comparison uses; epoch_ (release on switch, acquire in
  // epoch()) tells the index to re-rank after a change.
  mutable std::atomic<bool> use_lrfu_{true};
  mutable std::atomic<uint64_t> epoch_{0};

  mutable absl::Mutex mu_;
  mutable int64_t capacity_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::unique_ptr<Shadow> lru_shadow_ ABSL_GUARDED_BY(mu_);
  mutable std::unique_ptr<Shadow> lrfu_shadow_ ABSL_GUARDED_BY(mu_);
  // Decayed (LRFU shadow hits - LRU shadow hits); see kScoreMemoryCaches.
  mutable double score_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrelay::cachestore
