#pragma once

// EvictionPolicy: a pure ranking of blocks by how much they are worth keeping.
//
// A policy owns no per-block state and never sees the index: the BlockIndex stores each block's
// AccessStats inline in its record, calls OnInsert / OnAccess to update them and asks Priority()
// for the block's rank (the lowest priority among evictable blocks goes first). Which blocks are
// evictable (committed, unleased and, for prefix-aware policies, leaves) is the index's job.
//
// Contract that makes lazy eviction heaps exact: between two accesses a block's Priority() is
// constant, and an access never lowers it. The index keeps a min-heap of priorities taken when a
// block became evictable; on pop it recomputes the priority and re-inserts the block if it grew.
//
// Policies (MakeEvictionPolicy names):
//   "lru"       plain LRU over blocks, not prefix-aware: any committed block may go, even one
//               whose children stay. The baseline of `kvrelay trace-replay`; not for the service.
//   "leaf-lru"  LRU over leaves only: a block is never evicted before its descendants.
//   "adaptive"  (default) leaf-LRU or leaf-LRFU with a fast or a slow half-life, chosen online
//               by shadow caches and a significance test: adaptive_policy.h.
//   "lrfu"      leaf-first LRFU: frequency and recency with exponential aging. Each
//               access adds 1 to a combined recency-frequency value (crf) that halves every
//               `half_life` block accesses (Lee et al., "LRFU", IEEE ToC 2001). Stats of evicted
//               blocks are kept in a bounded ghost history (kGhostCaches x capacity) so a block
//               that comes back resumes its old frequency instead of starting cold (as ARC's
//               ghost lists do). A block never seen before starts with crf = kFirstSightCrf (a
//               first sighting is weak evidence of reuse: it ranks as if it had been accessed
//               two half-lives ago), which makes one-off scans leave first, as 2Q/ARC's
//               probation lists do, while the penalty stays bounded so stale history still ages
//               out.
//
// Thread-safe: all methods are const; SetHalfLife may race with Priority (atomic).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"

namespace kvrelay::cachestore {

// Per-block access statistics, stored inline in every index record (12 bytes).
struct AccessStats {
  uint64_t last_tick = 0;  // logical access clock (one tick per block access) at the last access
  float crf = 0;           // LRFU combined recency-frequency at last_tick; unused by LRU
  // ProbationLruPolicy flags (kOnProbation, kRefetched), cleared by the next access. Fills the
  // padding after crf, so the record does not grow.
  uint32_t probation = 0;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual std::string_view name() const = 0;
  // True when only leaves may be evicted (children always go before their parent).
  virtual bool prefix_aware() const = 0;
  // Stats of block `hash` first stored at `tick`. `ghost` is its stats when it was last evicted
  // (from the index's bounded ghost history) or null.
  virtual void OnInsert(AccessStats& stats, const kv::BlockHash& hash, uint64_t tick,
                        const AccessStats* ghost) const = 0;
  virtual void OnAccess(AccessStats& stats, const kv::BlockHash& hash, uint64_t tick) const = 0;
  // Lower goes first. Constant between accesses; never lowered by OnAccess.
  virtual double Priority(const AccessStats& stats) const = 0;
  // Tells the policy how many blocks the cache holds; policies whose aging scales with the cache
  // (LRFU) use it. Safe to call at any time.
  virtual void SetCapacityHint(int64_t capacity_blocks) const { (void)capacity_blocks; }
  // The chain of one request, as it arrives (before its blocks are accessed). Adaptive policies
  // learn from it (AdaptivePolicy replays it into shadow caches); others ignore it.
  virtual void OnRequest(absl::Span<const kv::BlockHash> chain) const { (void)chain; }
  // From now on OnRequest only queues the chain and a background thread learns from it, so
  // lookups never wait on learning (the service calls this; replay tools learn inline, so their
  // results are deterministic). Chains arriving while the queue is full are skipped.
  virtual void LearnInBackground() const {}
  // Changes when Priority() re-ranks blocks other than by access (an adaptive policy switched
  // rankings); the index then rebuilds its eviction heap once.
  virtual uint64_t epoch() const { return 0; }
};

// RecentFilter: "was this block accessed within the last kProbationHistoryCaches cache-fulls of
// block accesses?" (TinyLFU's doorkeeper, as a clock instead of a periodically cleared bit set).
// A table of kProbationHistoryCaches x capacity entries in 4-way buckets; an entry is a 16-bit
// fingerprint of the hash and the 16-bit epoch (one cache-full of accesses) of its last access;
// a miss replaces the bucket's oldest entry. 32 bytes per cache slot, O(1), lock-free (relaxed
// atomics: a lost or torn update only changes one admission). A fingerprint collision (1 in
// 65,536) says "seen" wrongly; an entry pushed out says "not seen" for a block that was.
class RecentFilter {
 public:
  // Sized for `capacity_blocks` (>= 1).
  explicit RecentFilter(int64_t capacity_blocks);
  // Reports whether `hash` was stamped recently, then stamps it at `tick`.
  bool SeenThenStamp(const kv::BlockHash& hash, uint64_t tick) const;
  // The history becomes kProbationHistoryCaches x `capacity_blocks` accesses; when that needs a
  // table of another size, a fresh (empty) one sized for it takes over, as at start-up. The
  // store's policy is made before any node registers, for a million slots (a 32 MiB table, one
  // cache miss per block access: ~2x the index lookup itself under MatchPrefix load); the first
  // capacity hint sizes it to the real cache. Old tables stay allocated until the filter goes
  // (a lookup may still be reading one), one per size; pages never touched cost nothing.
  void SetCapacity(int64_t capacity_blocks) const ABSL_LOCKS_EXCLUDED(tables_mu_);

 private:
  static constexpr int kWays = 4;
  struct Table {
    struct Free {
      void operator()(uint32_t* p) const { std::free(p); }
    };
    std::unique_ptr<uint32_t[], Free> entries;  // read and written through std::atomic_ref
    uint64_t mask = 0;                          // buckets - 1
  };
  static std::unique_ptr<Table> MakeTable(int64_t capacity_blocks);

  // Acquire in SeenThenStamp, release in SetCapacity: a new table is seen zeroed.
  mutable std::atomic<const Table*> table_{nullptr};
  mutable absl::Mutex tables_mu_;
  // Every table made.
  mutable std::vector<std::unique_ptr<Table>> tables_ ABSL_GUARDED_BY(tables_mu_);
  mutable std::atomic<int64_t> epoch_ticks_;
};

inline constexpr int64_t kProbationHistoryCaches = 8;

using EvictionPolicyPtr = std::unique_ptr<const EvictionPolicy>;

// "lru", "leaf-lru", "lrfu", "probation-lru", "probation-lag" (see above) or "adaptive"
// (adaptive_policy.h: leaf-LRU or LRFU, whichever wins significantly in shadow caches right now).
// InvalidArgument naming the value otherwise. `capacity_blocks` (> 0) sets the LRFU half-life to
// kLrfuHalfLifeCaches cache-fulls of accesses.
absl::StatusOr<EvictionPolicyPtr> MakeEvictionPolicy(std::string_view name,
                                                     int64_t capacity_blocks);

inline constexpr std::string_view kDefaultPolicy = "adaptive";
// LRFU aging: a block's weight halves after this many cache-fulls of block accesses. At 2 a
// block touched once is worth as much as one touched twice half-life ago; see README.md.
inline constexpr double kLrfuHalfLifeCaches = 2.0;
// Initial crf of a block with no history: 2^-2, i.e. two half-lives of aging.
inline constexpr float kFirstSightCrf = 0.25f;
// Ghost history size, in cache-fulls of blocks.
inline constexpr int64_t kGhostCaches = 2;

class LruPolicy final : public EvictionPolicy {
 public:
  explicit LruPolicy(bool leaf_only) : leaf_only_(leaf_only) {}
  std::string_view name() const override { return leaf_only_ ? "leaf-lru" : "lru"; }
  bool prefix_aware() const override { return leaf_only_; }
  void OnInsert(AccessStats& stats, const kv::BlockHash&, uint64_t tick,
                const AccessStats*) const override {
    stats.last_tick = tick;
  }
  void OnAccess(AccessStats& stats, const kv::BlockHash&, uint64_t tick) const override {
    stats.last_tick = tick;
  }
  double Priority(const AccessStats& stats) const override {
    return static_cast<double>(stats.last_tick);
  }

 private:
  const bool leaf_only_;
};

// "probation-lru": leaf-first LRU with a doorkeeper (in the spirit of 2Q's A1 queue, S3-FIFO's
// small FIFO and TinyLFU's doorkeeper): a block inserted without having been accessed within
// the last kProbationHistoryCaches cache-fulls of accesses is on probation and ranks below every
// other block (LRU among themselves); its next access ends probation. One-off request tails and
// scans leave first; anything seen twice within the history is kept by recency.
//
// "probation-lag" adds SRRIP's distinction between a hit and a miss (Jaleel et al., ISCA 2010:
// a miss inserts at a "long" re-reference prediction, a hit promotes to "near"): a block
// inserted by a miss although the doorkeeper saw it (a re-fetch: it was evicted, so its last
// reuse gap was longer than its residency) ranks as if accessed kRefetchLagCaches cache-fulls
// of accesses before its insertion, until its next access. A block that is hit while cached
// proves a reuse gap the cache can hold; a re-fetched one has only proved one it could not.
class ProbationLruPolicy final : public EvictionPolicy {
 public:
  static constexpr uint32_t kOnProbation = 1;
  static constexpr uint32_t kRefetched = 2;
  // `refetch_lag_caches` 0: "probation-lru"; > 0: "probation-lag" with that lag.
  explicit ProbationLruPolicy(int64_t capacity_blocks, double refetch_lag_caches = 0)
      : recent_(capacity_blocks),
        lag_caches_(refetch_lag_caches),
        lag_ticks_(refetch_lag_caches *
                   static_cast<double>(std::max<int64_t>(capacity_blocks, 1))) {}
  std::string_view name() const override {
    return lag_caches_ > 0 ? "probation-lag" : "probation-lru";
  }
  bool prefix_aware() const override { return true; }
  // Probation unless the filter saw the block accessed recently or it has a ghost (evicted
  // recently); otherwise a re-fetch (kRefetched). Every access stamps the filter.
  void OnInsert(AccessStats& stats, const kv::BlockHash& hash, uint64_t tick,
                const AccessStats* ghost) const override;
  void OnAccess(AccessStats& stats, const kv::BlockHash& hash, uint64_t tick) const override;
  double Priority(const AccessStats& stats) const override {
    double p = static_cast<double>(stats.last_tick);
    // Probation sinks a block by 2^52 ticks (more accesses than any store makes).
    if ((stats.probation & kOnProbation) != 0) return p - 0x1p52;
    if ((stats.probation & kRefetched) != 0) p -= lag_ticks_.load(std::memory_order_relaxed);
    return p;
  }
  void SetCapacityHint(int64_t capacity_blocks) const override {
    if (capacity_blocks <= 0) return;
    recent_.SetCapacity(capacity_blocks);
    lag_ticks_.store(lag_caches_ * static_cast<double>(capacity_blocks), std::memory_order_relaxed);
  }

 private:
  RecentFilter recent_;
  const double lag_caches_;
  // Relaxed: a stale value only makes one heap comparison approximate; the lazy heap re-checks.
  mutable std::atomic<double> lag_ticks_;
};

// The lag of "probation-lag": one cache-full of accesses, the residency of a block under LRU
// (how long a block stays after its last access). A re-fetched block ranks as a block hit one
// residency ago would, i.e. it stays about half as long as a hit block unless it is hit. See
// README.md for the values tried (0.5 and 2 caches).
inline constexpr double kRefetchLagCaches = 1.0;

class LrfuPolicy final : public EvictionPolicy {
 public:
  // REQUIRES: half_life_accesses > 0.
  explicit LrfuPolicy(double half_life_accesses) : half_life_(half_life_accesses) {}
  std::string_view name() const override { return "lrfu"; }
  bool prefix_aware() const override { return true; }
  void OnInsert(AccessStats& stats, const kv::BlockHash& hash, uint64_t tick,
                const AccessStats* ghost) const override;
  void OnAccess(AccessStats& stats, const kv::BlockHash& hash, uint64_t tick) const override;
  // log2(crf) + last_tick / half_life: comparing crf decayed to any common time t is the same as
  // comparing this, because decay multiplies every crf by 2^(-(t - last_tick) / half_life).
  double Priority(const AccessStats& stats) const override;
  void SetCapacityHint(int64_t capacity_blocks) const override;
  // REQUIRES: half_life_accesses > 0.
  void SetHalfLife(double half_life_accesses) const {
    half_life_.store(half_life_accesses, std::memory_order_relaxed);
  }
  double half_life() const { return half_life_.load(std::memory_order_relaxed); }
  // The crf update rules on one value, for a policy that keeps several (AdaptivePolicy).
  // `ghost_crf` / `ghost_tick`: the value when the block was last evicted, or negative crf.
  float InsertedCrf(float ghost_crf, uint64_t ghost_tick, uint64_t tick) const;
  float AccessedCrf(float crf, uint64_t last_tick, uint64_t tick) const;
  double PriorityOf(float crf, uint64_t last_tick) const;

 private:
  // Relaxed: a stale value only makes one heap comparison approximate; the lazy heap re-checks.
  mutable std::atomic<double> half_life_;
};

}  // namespace kvrelay::cachestore
