#pragma once

// CacheStore: the cache store's domain service, which the gRPC glue (cachestore/server) calls.
// It composes the NodeRegistry, BlockIndex (+ EvictionPolicy), LeaseTable, placement, the event
// log and the Wal/Snapshot durability.
//
// Thread safety: all methods are thread-safe. Lock order:
//   mu_ (mutations: register, allocate, commit, abort, tick, snapshot)
//     -> BlockIndex locks (see block_index.h) -> registry / lease table (leaf locks)
//     -> events_mu_ (leaf)
// MatchPrefix / QueryPrefix / Heartbeat / ReleaseLease never take mu_: they use the index's
// shard locks and the leaf locks only, so lookups are not serialized behind writers.
//
// Time comes from the injected Clock; Tick() does all time-driven work (node expiry, lease
// expiry, reclaiming abandoned allocations, watermark eviction, snapshots). The server calls it
// periodically; tests call it after SimulatedClock::Advance.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cachestore/block_index.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/lease_table.h"
#include "cachestore/node_registry.h"
#include "cachestore/wal.h"
#include "common/clock.h"

namespace kvrelay::cachestore {

struct CacheStoreOptions {
  std::string policy = std::string(kDefaultPolicy);  // a prefix-aware policy: lrfu | leaf-lru
  std::string data_dir;                              // empty: no durability
  bool wal_fsync = true;
  Clock* clock = nullptr;                            // not owned; default Clock::Real()
  absl::Duration default_node_ttl = absl::Seconds(10);
  absl::Duration commit_timeout = absl::Seconds(30);
  absl::Duration max_lease_ttl = absl::Minutes(10);
  // Watermark eviction (fractions of all registered slots), run by Tick().
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  int64_t snapshot_every_ops = 100000;  // WAL records between snapshots
  size_t event_retention = 1 << 16;     // events kept for WatchEvents resumption
  // Evicted blocks whose statistics are remembered: kGhostCaches x registered slots, at most this.
  size_t max_ghost_blocks = 4 << 20;
};

// MatchPrefix's answer. Replicas refer to `segments` (distinct node/segment pairs, resolved
// once per call) instead of carrying strings per block.
struct MatchResult {
  int matched = 0;
  uint64_t lease_id = 0;
  std::vector<Location> segments;  // slot / offset unset
  struct Replica {
    uint32_t segment = 0;  // index into segments
    uint32_t slot = 0;
  };
  struct Block {
    BlockHash hash;
    uint32_t size_bytes = 0;
    absl::InlinedVector<Replica, 2> replicas;
  };
  std::vector<Block> blocks;
  // The full location of block b's k-th replica.
  Location ReplicaLocation(size_t b, size_t k) const {
    const Replica& r = blocks[b].replicas[k];
    Location loc = segments[r.segment];
    loc.slot = r.slot;
    loc.offset_bytes = static_cast<uint64_t>(r.slot) * loc.slot_bytes;
    return loc;
  }
};

struct NodePrefix {
  std::string node_id;
  int matched = 0;
};

struct AllocateArgs {
  struct Block {
    BlockHash hash;
    BlockHash parent;
    uint64_t size_bytes = 0;
  };
  std::vector<Block> blocks;
  std::string preferred_node;
  Tier preferred_tier = Tier::kUnspecified;
  int replicas = 1;
};

struct AllocateResult {
  uint64_t allocation_id = 0;
  struct Block {
    BlockHash hash;
    std::vector<Location> replicas;
    bool already_committed = false;
  };
  std::vector<Block> blocks;
  absl::Duration commit_timeout;
};

struct StoreEvent {
  // kNodeRemoved: node_ids[0] expired or re-registered with a new spec; it holds no block now
  // (blocks it held alone were removed by kRemoved events just before).
  enum class Kind { kStored = 1, kRemoved = 2, kNodeRemoved = 3 };
  uint64_t sequence = 0;
  Kind kind = Kind::kStored;
  BlockHash hash;
  BlockHash parent;
  std::vector<std::string> node_ids;
};

struct StoreStats {
  int64_t nodes = 0;
  int64_t committed_blocks = 0;
  int64_t allocated_blocks = 0;
  int64_t active_leases = 0;
  int64_t evictions = 0;
  uint64_t last_sequence = 0;
  std::vector<TierUsage> tiers;
  std::string policy;
};

// Monotonic counters for /metrics. Relaxed atomics: each is read on its own.
struct StoreCounters {
  std::atomic<int64_t> prefix_queries{0};
  std::atomic<int64_t> prefix_query_blocks{0};
  std::atomic<int64_t> prefix_hit_blocks{0};
  std::atomic<int64_t> allocated_blocks{0};
  std::atomic<int64_t> committed_blocks{0};
  std::atomic<int64_t> aborted_blocks{0};
  std::atomic<int64_t> reclaimed_blocks{0};
  std::atomic<int64_t> evicted_blocks{0};
  std::atomic<int64_t> expired_nodes{0};
  std::atomic<int64_t> expired_leases{0};
};

class CacheStore {
 public:
  // Replays the snapshot and log under data_dir (cutting a bad log tail with a warning).
  static absl::StatusOr<std::unique_ptr<CacheStore>> Create(CacheStoreOptions options);
  ~CacheStore();

  // Returns the TTL applied. InvalidArgument naming a bad field.
  absl::StatusOr<absl::Duration> RegisterNode(NodeSpec spec);
  bool Heartbeat(const std::string& node_id);
  // lease_ttl > 0 takes a lease on the matched blocks (none when nothing matched).
  absl::StatusOr<MatchResult> MatchPrefix(absl::Span<const BlockHash> chain,
                                          absl::Duration lease_ttl);
  std::vector<NodePrefix> QueryPrefix(absl::Span<const BlockHash> chain);
  // ResourceExhausted only when eviction cannot make room; nothing is reserved on failure.
  absl::StatusOr<AllocateResult> Allocate(const AllocateArgs& args, absl::Time deadline);
  // Commits the named blocks of the allocation (all when empty); returns how many.
  absl::StatusOr<int> Commit(uint64_t allocation_id, absl::Span<const BlockHash> hashes);
  absl::Status Abort(uint64_t allocation_id);
  absl::Status ReleaseLease(uint64_t lease_id);
  StoreStats Stats() const;
  const StoreCounters& counters() const { return counters_; }
  const EvictionPolicy& policy() const { return *policy_; }

  // Time-driven work; returns quickly when there is none.
  void Tick();
  absl::Status WriteSnapshotNow();

  // Events with sequence >= from (0 = from the next new one), up to `max`, waiting until at
  // least one is available or `deadline`. OutOfRange when `from` is older than the oldest event
  // retained.
  absl::StatusOr<std::vector<StoreEvent>> EventsSince(uint64_t from, size_t max,
                                                      absl::Time deadline);
  uint64_t last_sequence() const;

  // For tests and benches.
  BlockIndex& index() { return *index_; }
  NodeRegistry& registry() { return registry_; }

 private:
  struct PendingAllocation {
    absl::Time deadline;
    std::vector<BlockHash> hashes;  // parent-first order; committed ones are removed
    absl::flat_hash_map<BlockHash, BlockHash> parents;
  };

  explicit CacheStore(CacheStoreOptions options, EvictionPolicyPtr policy);
  absl::Status Recover();
  absl::Status ApplyOp(const WalOp& op, uint64_t* max_seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveNodeLocked(uint16_t node, bool log) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees slots, logs and publishes a removal for each block.
  void OnRemoved(const std::vector<RemovedBlock>& removed, std::vector<WalOp>* wal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(PendingAllocation& pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendWal(const std::vector<WalOp>& ops) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeSnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t Publish(StoreEvent event);  // assigns and returns the sequence
  std::vector<Location> Describe(const Replicas& replicas) const;
  std::vector<WalReplica> WalReplicas(const Replicas& replicas) const;
  void UpdateCapacityHint();

  const CacheStoreOptions options_;
  Clock* const clock_;
  const EvictionPolicyPtr policy_;
  NodeRegistry registry_;
  std::unique_ptr<BlockIndex> index_;
  LeaseTable leases_;
  StoreCounters counters_;

  absl::Mutex mu_;
  std::unique_ptr<Wal> wal_ ABSL_GUARDED_BY(mu_);
  uint64_t next_allocation_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, PendingAllocation> allocations_ ABSL_GUARDED_BY(mu_);
  int64_t allocated_blocks_ ABSL_GUARDED_BY(mu_) = 0;

  mutable absl::Mutex events_mu_;
  absl::CondVar events_cv_;
  std::deque<StoreEvent> events_ ABSL_GUARDED_BY(events_mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(events_mu_) = 1;
};

}  // namespace kvrelay::cachestore
