#pragma once

// AdaptivePolicy ("adaptive", the default): ranks the live cache, online, by whichever of three
// leaf-first rankings is significantly winning on the workload the store sees right now:
//   0  LRU (pure recency),
//   1  LRFU with a half-life of 1 cache-full of block accesses (recency-leaning frequency),
//   2  probation-lag (eviction_policy.h): LRU, but a block not seen within the last 8 caches of
//      accesses ranks below all others until its next access (a doorkeeper against one-off tails)
//      and a re-fetched one ranks a cache of accesses older until its next access,
// LRFU with the ghost history and first-sight penalty of eviction_policy.h. Recency, frequency
// and admission are the three classic answers; which one fits is decided online.
//
// The decision comes from three shadow caches of the same capacity that replay every request's
// chain (OnRequest), in the spirit of set dueling (Qureshi et al., ISCA 2007) and miniature
// simulations (Waldspurger et al., ATC 2017). The live ranking starts as LRU and moves to
// another only when that shadow's lead in prefix hits over the current one is statistically
// significant: the decayed sum of per-request hit differences exceeds kSwitchZ standard
// deviations of itself (a paired sequential test; the variance is the decayed sum of squared
// differences). Switching on noise is what cost the previous two-way version 1.5% on the
// Mooncake trace: a switch re-shapes the cache, so a coin-flip switch loses. A switch bumps
// epoch() so the BlockIndex re-ranks its eviction heap once.
//
// Shadows hold metadata only (a BlockIndex each). Above kMaxShadowBlocks of capacity they sample
// chains by a key block's hash bits (rate kMaxShadowBlocks / capacity, power of two) and run at
// the sampled capacity, so their cost stays bounded (spatial sampling, as SHARDS: a sampled
// chain is seen on every access, so reuse distances scale with the rate and nothing else).
//
// The key block is the chain's block at the sampling depth (its last block if shorter), 0 (the
// root) to start with. A root that heads most chains, a deployment's system prompt, would put
// all of them in the sample or none: the shadows would learn from everything or from nothing,
// whatever the rate (Mooncake's conversation trace: one root block heads all 12,031 requests).
// So while sampling, 1 in kKeyStatEvery chains is kept for key statistics; per kKeyStatChains
// of them, a key heading more than a quarter moves the depth to where the chains it heads part
// (their longest common prefix): sampling then keeps whole subtrees below the shared prefix,
// which every ranking keeps cached alike. Chains sharing a key share every block before it
// (hashes are chained), so a deeper key never splits a prefix that more than one chain shares
// below the depth. The depth only grows (kMaxSampleDepth at most); a change restarts the
// shadows, as a change of rate does.
//
// Learning in the background (the store), the learner also keeps within a CPU budget
// (kLearnerCpuShare of one core per kLearnerWindow): after a window that goes over it the
// learner rests until the window ends, dropping what queued meanwhile, and the
// kOverrunWindowsBeforeCoarser-th such window in a row halves the sampling rate (shadows of half
// the capacity, down to kMinShadowBlocks; the shadows and their evidence restart, the live
// ranking stays); kQuietWindowsBeforeFiner windows under a quarter of the budget
// double the rate again; the window right after a change is not judged (the fresh shadows' first
// touches). A lookup of a chain outside the sample costs one mask test. Issue 19:
// the learner replaying every lookup into three shadows took a third of the store's CPU under a
// 16-client lookup load even at SCHED_IDLE, and the lookup rate with it. Inline learning
// (trace replay, tests) has no budget: its figures are unchanged.
//
// Thread-safe: OnRequest serialises on a mutex; the other methods are lock-free.

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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
  static constexpr int kRankings = 3;
  static constexpr int64_t kMaxShadowBlocks = 1 << 16;
  // LRFU half-life of ranking 1, in cache-fulls of block accesses.
  static constexpr double kFastHalfLifeCaches = 1.0;
  // The hit-difference sums forget with a half-life of this many shadow caches of block
  // accesses, so a workload that shifts is followed.
  static constexpr double kScoreMemoryCaches = 4.0;
  // Significance of a switch: the lead must exceed this many standard deviations of itself
  // (one standard deviation: one-sided p ~ 0.16). At 2 the test almost never fires on the
  // Mooncake trace (the per-request hit differences are noisy) and, when it fires late, can land
  // below LRU (0.954x at 1,000 blocks); see README.md.
  static constexpr double kSwitchZ = 1.0;

  explicit AdaptivePolicy(int64_t capacity_blocks);
  ~AdaptivePolicy() override;

  std::string_view name() const override { return "adaptive"; }
  bool prefix_aware() const override { return true; }
  void OnInsert(AccessStats& stats, const BlockHash& hash, uint64_t tick,
                const AccessStats* ghost) const override;
  void OnAccess(AccessStats& stats, const BlockHash& hash, uint64_t tick) const override;
  double Priority(const AccessStats& stats) const override;
  void SetCapacityHint(int64_t capacity_blocks) const override;
  void OnRequest(absl::Span<const BlockHash> chain) const override;
  void LearnInBackground() const override;
  // Chains queued for the background learner at most (beyond: skipped, a sample).
  static constexpr size_t kMaxQueuedRequests = 256;
  // The background learner's CPU budget (see above).
  static constexpr double kLearnerCpuShare = 0.10;
  static constexpr absl::Duration kLearnerWindow = absl::Seconds(1);
  static constexpr int64_t kMinShadowBlocks = 1024;
  static constexpr int kQuietWindowsBeforeFiner = 30;
  static constexpr int kOverrunWindowsBeforeCoarser = 2;
  // Sampling key statistics (see above).
  static constexpr int kKeyStatEvery = 16;
  static constexpr size_t kKeyStatChains = 64;
  static constexpr int kMaxSampleDepth = 256;
  // Replaces the budget above (tests); takes effect at the learner's next window.
  void SetLearnerBudget(double cpu_share_of_one_core, absl::Duration window) const;
  // Samples `halvings` steps coarser than the capacity asks, as the CPU budget does under load
  // and with the same bound (shadows of kMinShadowBlocks at least): replay tools use it to show
  // what the store decides when its learner samples.
  void SetBudgetSampling(int halvings) const ABSL_LOCKS_EXCLUDED(mu_);
  // False: the learner keeps the starting thread's scheduling instead of SCHED_IDLE (tests that
  // need it to run while other tests hold every core). Before LearnInBackground.
  void SetLearnerIdlePriority(bool idle) const;
  uint64_t epoch() const override { return epoch_.load(std::memory_order_acquire); }

  // 0 = LRU, 1 = LRFU, 2 = probation-lag (see above).
  int ranking() const { return ranking_.load(std::memory_order_relaxed); }
  int64_t switches() const { return static_cast<int64_t>(epoch()); }
  // Chains the shadows have learned from (or, learning inline, skipped by sampling) so far.
  int64_t learned_requests() const { return learned_.load(std::memory_order_acquire); }
  // The shadows learn from 1 in 2^sample_shift() chains (by capacity and by the CPU budget).
  int sample_shift() const { return std::countr_one(sample_mask_.load(std::memory_order_relaxed)); }
  // Times the background learner went over its budget.
  int64_t budget_overruns() const { return overruns_.load(std::memory_order_relaxed); }
  // Times a light load doubled the sampling rate again.
  int64_t budget_refinements() const { return refinements_.load(std::memory_order_relaxed); }
  // Chains replayed into the shadows so far (in the sample).
  int64_t sampled_requests() const { return sampled_.load(std::memory_order_relaxed); }
  // The position of the block whose hash decides whether a chain is in the sample.
  int sample_depth() const { return sample_depth_.load(std::memory_order_relaxed); }

 private:
  struct Shadow;
  void ResetShadows(int64_t capacity_blocks) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One step coarser (true) or finer sampling for the budget; false when at its bound.
  bool CoarserSampling() const ABSL_LOCKS_EXCLUDED(mu_);
  bool FinerSampling() const ABSL_LOCKS_EXCLUDED(mu_);
  bool InSample(absl::Span<const BlockHash> chain) const {
    const size_t depth = static_cast<size_t>(sample_depth_.load(std::memory_order_relaxed));
    return (chain[std::min(depth, chain.size() - 1)].lo &
            sample_mask_.load(std::memory_order_relaxed)) == 0;
  }
  // True for 1 in kKeyStatEvery chains while sampling. Lookups count per thread (`per_thread`:
  // no cache line shared between the store's threads); learning inline counts per policy, so a
  // replay's figures do not depend on what ran before it.
  bool TakeForKeyStats(bool per_thread) const;
  // Adds one chain to the key statistics and, per kKeyStatChains, maybe deepens the key.
  void NoteKeyStats(absl::Span<const BlockHash> chain) const ABSL_LOCKS_EXCLUDED(mu_);
  // Replays one chain into the shadows and maybe switches the live ranking.
  void Learn(absl::Span<const BlockHash> chain) const ABSL_LOCKS_EXCLUDED(mu_);
  void LearnerLoop() const;

  // Live stats: last_tick (LRU), crf (LRFU), probation (probation-LRU), all kept up to date.
  LrfuPolicy fast_;
  ProbationLruPolicy probation_;
  LruPolicy lru_{/*leaf_only=*/true};
  // Relaxed: which ranking a heap comparison uses; epoch_ (release on switch, acquire in
  // epoch()) tells the index to re-rank after a change.
  mutable std::atomic<int> ranking_{0};
  mutable std::atomic<uint64_t> epoch_{0};
  mutable std::atomic<int64_t> learned_{0};

  mutable absl::Mutex mu_;
  mutable int64_t capacity_ ABSL_GUARDED_BY(mu_) = 0;
  // Halvings of the shadows' capacity beyond kMaxShadowBlocks', for the CPU budget.
  mutable int budget_shift_ ABSL_GUARDED_BY(mu_) = 0;
  // 2^shift - 1 of the current sampling: a chain is learned iff its key block's lo & mask == 0
  // (lo: a replay's TraceBlockHash keeps the trace's id in hi and its mix in lo; in the store
  // both are hash bits).
  mutable std::atomic<uint64_t> sample_mask_{0};
  mutable std::atomic<int> sample_depth_{0};
  mutable std::atomic<int64_t> sampled_{0};
  mutable std::atomic<uint64_t> offered_{0};  // chains offered while sampling, learning inline
  mutable std::atomic<int64_t> overruns_{0};
  mutable std::atomic<int64_t> refinements_{0};
  // Chains kept for the key statistics since the last judgement (each cut after
  // kMaxSampleDepth + 1 blocks).
  mutable std::vector<std::vector<BlockHash>> key_stats_ ABSL_GUARDED_BY(mu_);
  mutable std::array<std::unique_ptr<Shadow>, kRankings> shadows_ ABSL_GUARDED_BY(mu_);
  // lead_[a][b]: decayed sum over requests of (hits of shadow a - hits of shadow b);
  // spread_[a][b]: decayed sum of its squares (the sum's variance if a and b were equal).
  mutable std::array<std::array<double, kRankings>, kRankings> lead_ ABSL_GUARDED_BY(mu_){};
  mutable std::array<std::array<double, kRankings>, kRankings> spread_ ABSL_GUARDED_BY(mu_){};

  // Background learning (LearnInBackground): chains waiting for LearnerLoop.
  mutable absl::Mutex queue_mu_ ABSL_ACQUIRED_AFTER(mu_);
  struct Queued {
    std::vector<BlockHash> chain;
    bool learn = false;      // in the sample: replay it into the shadows
    bool key_stats = false;  // taken for the key statistics
  };
  mutable std::deque<Queued> queue_ ABSL_GUARDED_BY(queue_mu_);
  // Learning in the background: set once (under queue_mu_, so the learner starts once), read
  // without the lock by every lookup.
  mutable std::atomic<bool> background_{false};
  // queue_.size(), readable without the lock: a lookup that finds the queue full skips at once.
  mutable std::atomic<size_t> queued_{0};
  mutable bool stop_ ABSL_GUARDED_BY(queue_mu_) = false;
  mutable double budget_share_ ABSL_GUARDED_BY(queue_mu_) = kLearnerCpuShare;
  mutable absl::Duration budget_window_ ABSL_GUARDED_BY(queue_mu_) = kLearnerWindow;
  mutable bool idle_priority_ ABSL_GUARDED_BY(queue_mu_) = true;
  mutable std::thread learner_;
};

}  // namespace kvrelay::cachestore
