#pragma once

// BlockIndex: every block the cache store knows, keyed by its chained hash (kv::BlockHash, which
// already covers layout and tenant salt), with state, size, replicas, parent link, lease count
// and access statistics. It is also the prefix matcher (MatchPrefix walks a chain) and owns the
// leaf-first eviction order; the EvictionPolicy only ranks.
//
// Layout (memory per block ~110 bytes, see README.md): kNumShards shards selected by hash bits;
// each shard has a flat_hash_map<BlockHash, uint32 local index> and a chunked slab of 64-byte
// Records (no per-block heap allocation; a block's first replica is inline, more go to a side
// map). Records refer to each other by RecordId (shard << 26 | local index), never pointers.
//
// Thread safety: all public methods are thread-safe.
// Lock order (acquire left to right, never the reverse):
//   evict_mu_  ->  shard[i].mu (one at a time; sweeps take all, ascending)  ->  heap_mu_
//   ghost_mu_ is a leaf lock taken alone (never while holding another index lock).
// MatchPrefix takes only shard locks, one at a time, so lookups never wait on eviction order.

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "cachestore/eviction_policy.h"
#include "kv/block_hash.h"

namespace kvrelay::cachestore {

using kv::BlockHash;
using RecordId = uint32_t;
inline constexpr RecordId kNoRecord = 0xFFFFFFFFu;

// Where one replica lives: registry-assigned node index, segment index within that node, slot.
struct Replica {
  uint16_t node = 0;
  uint16_t segment = 0;
  uint32_t slot = 0;
  friend bool operator==(const Replica&, const Replica&) = default;
};
using Replicas = absl::InlinedVector<Replica, 2>;

enum class BlockState : uint8_t { kFree = 0, kAllocated = 1, kCommitted = 2 };

struct MatchedBlock {
  BlockHash hash;
  uint32_t size_bytes = 0;
  Replicas replicas;
};

// A block that left the index (evicted, aborted or lost with its node).
struct RemovedBlock {
  BlockHash hash;
  BlockHash parent;  // zero for a root (or when parents are not tracked)
  uint32_t size_bytes = 0;
  BlockState state = BlockState::kCommitted;
  Replicas replicas;
};

// What Insert needs to know about a block.
struct NewBlock {
  BlockHash hash;
  BlockHash parent;  // zero = root
  uint32_t size_bytes = 0;
  Replicas replicas;
};

class BlockIndex {
 public:
  static constexpr int kShardBits = 6;
  static constexpr int kNumShards = 1 << kShardBits;

  struct Options {
    // Not owned; must outlive the index.
    const EvictionPolicy* policy = nullptr;
    // Evicted blocks whose stats are remembered (bounded FIFO); 0 disables the ghost history.
    size_t ghost_capacity = 0;
  };
  explicit BlockIndex(Options options);
  ~BlockIndex();
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  const EvictionPolicy& policy() const { return *options_.policy; }

  // Number of leading blocks of `chain` that are committed. With `touch`, each matched block
  // counts as accessed; with `lease`, each matched block's lease count is raised (under the same
  // shard lock that found it, so a matched block cannot be evicted before it is pinned) and the
  // caller must ReleaseLeases() the first `result` hashes later. `out` (optional) receives the
  // matched blocks.
  int MatchPrefix(absl::Span<const BlockHash> chain, bool touch, bool lease,
                  std::vector<MatchedBlock>* out);

  // Adds a block as kAllocated (invisible to MatchPrefix) or kCommitted. The parent must be
  // present (allocated or committed) unless it is zero. AlreadyExists if the hash is present,
  // FailedPrecondition naming the parent if it is missing. With `lease` the block starts pinned
  // (one lease) so it cannot be evicted before the caller releases it.
  absl::Status Insert(const NewBlock& block, BlockState state, bool lease = false);
  // kAllocated -> kCommitted. NotFound if absent; FailedPrecondition if the parent is not
  // committed. Committing a committed block is a no-op.
  absl::Status Commit(const BlockHash& hash);
  // Removes an uncommitted block (Abort / reclaim). Its replicas are returned so the caller frees
  // the slots. NotFound if absent, FailedPrecondition if committed or if it has children.
  absl::StatusOr<RemovedBlock> RemoveAllocated(const BlockHash& hash);
  // Removes a committed block and, when parents are tracked, all its descendants (children
  // first). Used by WAL replay of removals. Absent hashes are ignored.
  // Not analysed: it holds every shard's lock, taken in a loop, which the thread-safety
  // annotations cannot express.
  std::vector<RemovedBlock> RemoveSubtree(const BlockHash& hash) ABSL_NO_THREAD_SAFETY_ANALYSIS;

  // Removes one committed, unleased block that no other block descends from (for prefix-aware
  // policies), at the cost of one lookup: a block moving to another tier's index. NotFound if
  // absent, FailedPrecondition if it is leased, uncommitted or has children. Not a ghost (the
  // block lives on elsewhere).
  absl::StatusOr<RemovedBlock> RemoveLeaf(const BlockHash& hash);

  // Adds a replica to a committed block (a node re-announcing a copy it holds). AlreadyExists
  // if listed, NotFound if absent, FailedPrecondition if uncommitted or at the replica limit.
  absl::Status AddReplica(const BlockHash& hash, const Replica& replica);

  // Counts an access to a present block (any state); with `lease`, pins it. False if absent.
  bool Touch(const BlockHash& hash, bool lease);
  void ReleaseLeases(absl::Span<const BlockHash> hashes);

  // Evicts the committed, unleased block (a leaf, for prefix-aware policies) with the lowest
  // priority, or nullopt when nothing is evictable. `accept` (optional) may veto a candidate
  // (e.g. "frees a slot where we need one"); vetoed candidates stay cached and are re-queued.
  std::optional<RemovedBlock> EvictOne(
      const std::function<bool(const RemovedBlock&)>& accept = nullptr);

  // Drops every replica on `node`; blocks left with no replica, and all their descendants, are
  // removed (and returned). Allocated blocks are included.
  // Not analysed: it holds every shard's lock, taken in a loop (as RemoveSubtree).
  std::vector<RemovedBlock> RemoveNode(uint16_t node) ABSL_NO_THREAD_SAFETY_ANALYSIS;

  // Visits every committed block (any order) with its parent hash and replicas.
  void ForEachCommitted(const std::function<void(const NewBlock&)>& fn) const;
  // Calls fn for each replica of each present block (used to rebuild slot maps after replay).
  void ForEachReplica(const std::function<void(const Replica&)>& fn) const;

  bool Contains(const BlockHash& hash) const;
  std::optional<BlockState> StateOf(const BlockHash& hash) const;
  int LeasesOf(const BlockHash& hash) const;
  int64_t size() const;  // present blocks, any state
  int64_t committed_count() const;
  size_t ghost_size() const;
  // Resizes the ghost history (CacheStore keeps it at kGhostCaches x registered slots).
  void SetGhostCapacity(size_t blocks) { ghost_capacity_.store(blocks, std::memory_order_relaxed); }

  // Bytes of memory held by the index structures (maps, slabs, side tables, heap, ghosts).
  size_t MemoryUsageBytes() const;

 private:
  struct Record {
    BlockHash hash;         // 16
    AccessStats stats;      // 16
    RecordId parent;        // 4
    uint32_t num_children;  // 4
    uint32_t size_bytes;    // 4
    Replica replica0;       // 8
    uint16_t leases;        // 2
    uint16_t gen;           // 2: bumped when the slot is freed; heap entries carry it
    BlockState state;       // 1
    uint8_t flags;          // 1: kInHeap | replica count (low 4 bits)
  };
  static constexpr uint8_t kInHeap = 0x80;
  static constexpr uint8_t kReplicaMask = 0x0F;
  static constexpr int kChunkBits = 12;
  static constexpr uint32_t kChunkSize = 1u << kChunkBits;
  static constexpr int kLocalBits = 32 - kShardBits;

  struct Shard {
    mutable absl::Mutex mu;
    absl::flat_hash_map<BlockHash, uint32_t> map ABSL_GUARDED_BY(mu);
    std::vector<std::unique_ptr<Record[]>> chunks ABSL_GUARDED_BY(mu);
    uint32_t next_unused ABSL_GUARDED_BY(mu) = 0;
    std::vector<uint32_t> free_list ABSL_GUARDED_BY(mu);
    // Replicas beyond the first, by local index.
    absl::flat_hash_map<uint32_t, Replicas> extra_replicas ABSL_GUARDED_BY(mu);
    int64_t committed ABSL_GUARDED_BY(mu) = 0;
  };
  struct HeapEntry {
    double priority;
    RecordId id;
    uint16_t gen;
    bool operator>(const HeapEntry& o) const { return priority > o.priority; }
  };

  static int ShardOf(const BlockHash& h) { return static_cast<int>(h.lo >> (64 - kShardBits)); }
  static RecordId MakeId(int shard, uint32_t local) {
    return (static_cast<uint32_t>(shard) << kLocalBits) | local;
  }
  static int ShardOfId(RecordId id) { return static_cast<int>(id >> kLocalBits); }
  static uint32_t LocalOf(RecordId id) { return id & ((1u << kLocalBits) - 1); }

  static Record& Rec(Shard& s, uint32_t local) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    return s.chunks[local >> kChunkBits][local & (kChunkSize - 1)];
  }
  static const Record& RecC(const Shard& s, uint32_t local) ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
    return s.chunks[local >> kChunkBits][local & (kChunkSize - 1)];
  }
  uint32_t AllocRecord(Shard& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Erases the record from the map and the slab; returns what it was.
  RemovedBlock FreeRecord(Shard& s, uint32_t local, BlockHash parent_hash)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  static Replicas ReplicasOf(const Shard& s, uint32_t local, const Record& r)
      ABSL_SHARED_LOCKS_REQUIRED(s.mu);
  bool Evictable(const Record& r) const;
  // Pushes the record into the eviction heap if it is evictable and not already queued.
  void MaybeQueue(Shard& s, uint32_t local, Record& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu);
  // Lowers a parent's child count (after a child left); queues it if it became a leaf.
  void DetachFromParent(RecordId parent);
  BlockHash HashOf(RecordId id) const;
  // The ancestor walk of the whole-index sweeps (RemoveSubtree, RemoveNode): returns `marked`
  // completed over every record, each taking the value of its nearest marked ancestor (itself
  // included), false where none is marked.
  // REQUIRES: every shard's mu held (a set of locks the analysis cannot name).
  absl::flat_hash_map<RecordId, bool> InheritFromAncestors(
      absl::flat_hash_map<RecordId, bool> marked) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  void RememberGhost(const BlockHash& hash, const AccessStats& stats);
  std::optional<AccessStats> TakeGhost(const BlockHash& hash);
  uint64_t NextTick() { return tick_.fetch_add(1, std::memory_order_relaxed) + 1; }

  const Options options_;
  // Relaxed: ticks only need to be unique and increasing per block; they order nothing else.
  std::atomic<uint64_t> tick_{0};
  std::array<Shard, kNumShards> shards_;

  absl::Mutex evict_mu_ ABSL_ACQUIRED_BEFORE(heap_mu_);
  mutable absl::Mutex heap_mu_;
  std::vector<HeapEntry> heap_ ABSL_GUARDED_BY(heap_mu_);  // min-heap via std::greater
  // policy().epoch() the heap's priorities were computed under; a change re-ranks the heap.
  uint64_t heap_epoch_ ABSL_GUARDED_BY(evict_mu_) = 0;
  void RerankHeap() ABSL_EXCLUSIVE_LOCKS_REQUIRED(evict_mu_);

  // Relaxed: a resize only needs to be seen eventually.
  std::atomic<size_t> ghost_capacity_;
  mutable absl::Mutex ghost_mu_;
  struct Ghost {
    AccessStats stats;
    uint64_t serial;  // matches the FIFO entry that may drop it
  };
  absl::flat_hash_map<BlockHash, Ghost> ghosts_ ABSL_GUARDED_BY(ghost_mu_);
  // Oldest first; an entry whose serial no longer matches the map is stale and skipped.
  std::deque<std::pair<BlockHash, uint64_t>> ghost_fifo_ ABSL_GUARDED_BY(ghost_mu_);
  uint64_t ghost_serial_ ABSL_GUARDED_BY(ghost_mu_) = 0;
};

}  // namespace kvrelay::cachestore
