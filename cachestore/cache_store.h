#pragma once

// CacheStore: the cache store's domain service, which the gRPC glue (cachestore/server) calls.
// It composes the NodeRegistry, BlockIndex (+ EvictionPolicy), LeaseTable, placement, the event
// log and the Wal/Snapshot durability.
//
// Thread safety: all methods are thread-safe. Lock order:
//   mu_ (mutations: register, allocate, commit, abort, tick, snapshot)
//     -> BlockIndex locks (see block_index.h) -> registry / lease table (leaf locks)
//     -> events_mu_, tokens_mu_ (leaves)
// MatchPrefix / QueryPrefix / Heartbeat / ReleaseLease never take mu_ (Heartbeat only to
// publish a suspect node's return): they use the index's shard locks and the leaf locks only,
// so lookups are not serialized behind writers.
//
// Time comes from the injected Clock; Tick() does all time-driven work (node suspicion and
// expiry, lease expiry, reclaiming abandoned allocations, watermark eviction, snapshots). The
// server calls it periodically; tests call it after SimulatedClock::Advance.
//
// Identity: nodes are (node_id, incarnation) (see node_registry.h). Allocations and leases taken
// by a Caller are bound to it: only the same node and incarnation may commit, abort or release
// them, and their ids are random. When a node is forgotten or replaced, its blocks, allocations
// and leases go with it before its registry index can be reused.
//
// Event sequence numbers are strictly increasing across restarts, kill -9 included: before a
// number past the logged high-water mark is handed out, a new mark (1024 ahead) is logged.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cachestore/block_index.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/lease_table.h"
#include "cachestore/limits.h"
#include "cachestore/node_registry.h"
#include "cachestore/wal.h"
#include "common/clock.h"
#include "kv/hf_config.h"

namespace kvrelay::cachestore {

struct CacheStoreOptions {
  std::string policy =
      std::string(kDefaultPolicy);  // adaptive|lrfu|probation-lag|probation-lru|leaf-lru
  std::string data_dir;             // empty: no durability
  bool wal_fsync = true;
  Clock* clock = nullptr;  // not owned; default Clock::Real()
  // Long enough to ride out a multi-second CPU stall; a node past it only becomes suspect.
  absl::Duration default_node_ttl = absl::Seconds(10);
  // How long a suspect node (silent past its TTL) keeps its blocks before it is forgotten.
  absl::Duration suspect_grace = absl::Seconds(30);
  Limits limits;
  absl::Duration commit_timeout = absl::Seconds(30);
  absl::Duration max_lease_ttl = absl::Minutes(10);
  // Watermark eviction (fractions of all registered slots), run by Tick().
  double high_watermark = 0.95;
  double low_watermark = 0.90;
  int64_t snapshot_every_ops = 100000;  // WAL records between snapshots
  size_t event_retention = 1 << 16;     // events kept for WatchEvents resumption
  // Evicted blocks whose statistics are remembered: kGhostCaches x registered slots, at most this.
  size_t max_ghost_blocks = 4 << 20;
  // Tokens per KV block of every node's layout (--block-tokens): a node that registers with
  // another value is refused (CheckBlockTokens), and ListNodes tells the gateway.
  int32_t block_tokens = kv::kDefaultBlockTokens;
  // Keep the tokens committers send with their blocks (CommitRequest.token_ids) while a block
  // is cached, for the KV events' BlockStored.token_ids. Set when a KV-event publisher runs;
  // off, tokens are dropped on arrival and cost nothing. Memory only (cachestore/README.md).
  bool keep_block_tokens = false;
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

// Who is calling: a registered node (node_id + incarnation), or nobody (empty node_id: legacy
// clients and read-only tools). incarnation 0 = "whatever is registered" (legacy).
struct Caller {
  std::string node_id;
  uint64_t incarnation = 0;
  bool anonymous() const { return node_id.empty(); }
};

struct NodePrefix {
  std::string node_id;
  int matched = 0;
  // Of `matched`, the blocks this node holds only on its disk tier (SSD): reading them costs a
  // disk read, not a copy from DRAM.
  int disk_blocks = 0;
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
  // A node allocating for itself places only in its own segments, evicting there (leaf-first,
  // by policy) when they are full; never on another node. Anonymous: placement by preference
  // (a preferred node's full segment is evicted into before spilling elsewhere).
  Caller caller;
  // A registered caller with segments: blocks committed elsewhere without a replica on the
  // caller get a slot in its segment too (added as a replica at Commit).
  bool add_local_replicas = false;
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
  // Same numbers as kvrelay.v1.Event.Kind.
  enum class Kind {
    kStored = 1,
    kRemoved = 2,
    kNodeJoined = 3,   // registered (a new incarnation)
    kNodeSuspect = 4,  // missed its TTL: its blocks are skipped
    kNodeLive = 5,     // back within the grace period: its blocks count again
    kNodeLeft = 6,     // deregistered, replaced or forgotten: its blocks are gone
  };
  uint64_t sequence = 0;
  Kind kind = Kind::kStored;
  BlockHash hash;                     // block events
  BlockHash parent;                   // block events
  std::vector<std::string> node_ids;  // kStored: replica nodes; kRemoved: nodes it was on
  NodeSpec node;                      // node events (segments left out)
  // kStored: the block's tokens when the store keeps them (keep_block_tokens) and its
  // committer sent them; empty otherwise.
  std::vector<int32_t> token_ids;
  // Block events of a disk tier's replicas: kSsd (the KV events' medium DISK); otherwise
  // unspecified (the node's DRAM tier).
  Tier tier = Tier::kUnspecified;
};

struct RegisterResult {
  absl::Duration ttl;
  uint64_t incarnation = 0;  // as registered (assigned when the request had 0)
  bool revived = false;      // the same incarnation was suspect and is live again
};

struct HeartbeatResult {
  bool known = false;                  // false: not registered (forgotten or never): register again
  NodeState state = NodeState::kLive;  // state before this heartbeat
};

// A block a (re-)registered node still holds, re-announced so the index converges without
// recompute.
struct AnnouncedBlock {
  BlockHash hash;
  BlockHash parent;  // zero for a root; must be committed or announced earlier in the batch
  uint32_t slot = 0;
  uint64_t size_bytes = 0;
};
// Same numbers as kvrelay.v1.AnnounceRejection.Reason.
enum class AnnounceRejection {
  kBadInput = 1,       // zero hash, size over the slot, slot out of range
  kSlotInUse = 2,      // the store has another block in that slot
  kParentMissing = 3,  // parent neither committed nor earlier in the batch
  kInFlight = 4,       // the hash is being written by an allocation
  kConflict = 5,       // the store lists the block on this node at another slot
};
struct AnnounceResult {
  int accepted = 0;         // newly indexed (block or replica)
  int already_present = 0;  // the store already listed this exact replica
  std::vector<std::pair<int, AnnounceRejection>> rejected;  // (index in the batch, why)
};

struct StoreStats {
  int64_t nodes = 0;  // live
  int64_t suspect_nodes = 0;
  uint64_t store_incarnation = 0;
  int64_t committed_blocks = 0;
  int64_t allocated_blocks = 0;
  int64_t active_leases = 0;
  int64_t evictions = 0;
  int64_t disk_blocks = 0;  // distinct blocks with a replica on some node's disk tier
  uint64_t last_sequence = 0;
  // Memory a long run could grow, so a soak can tell which part did: the index structures
  // (BlockIndex::MemoryUsageBytes), the events kept for WatchEvents resumption, the blocks
  // whose token ids are kept for KV events.
  int64_t index_bytes = 0;
  int64_t retained_events = 0;
  int64_t kept_token_blocks = 0;
  std::vector<TierUsage> tiers;
  std::string policy;
};

// Monotonic counters for /metrics. Relaxed atomics: each is read on its own.
struct StoreCounters {
  std::atomic<int64_t> prefix_queries{0};
  std::atomic<int64_t> prefix_query_blocks{0};
  std::atomic<int64_t> prefix_hit_blocks{0};
  // The same hits by the fastest tier holding each block (where a reader fetches it from),
  // indexed by Tier; they add up to prefix_hit_blocks.
  std::atomic<int64_t> prefix_hit_blocks_by_tier[4] = {};
  std::atomic<int64_t> allocated_blocks{0};
  std::atomic<int64_t> committed_blocks{0};
  std::atomic<int64_t> aborted_blocks{0};
  std::atomic<int64_t> reclaimed_blocks{0};
  std::atomic<int64_t> evicted_blocks{0};
  std::atomic<int64_t> expired_nodes{0};
  std::atomic<int64_t> suspected_nodes{0};
  std::atomic<int64_t> refused_registrations{0};
  std::atomic<int64_t> announced_blocks{0};
  std::atomic<int64_t> expired_leases{0};
};

class CacheStore {
 public:
  // Replays the snapshot and log under data_dir (cutting a bad log tail with a warning).
  static absl::StatusOr<std::unique_ptr<CacheStore>> Create(CacheStoreOptions options);
  ~CacheStore();

  // Registers (node_id, incarnation); see NodeRegistry::Register for the identity rules. An
  // incarnation of 0 (legacy clients) gets a random one, returned. InvalidArgument naming a bad
  // field, AlreadyExists naming the live holder of the id.
  absl::StatusOr<RegisterResult> RegisterNode(NodeSpec spec);
  // OK when a node whose layout has `block_tokens`-token blocks (0: the node did not say) may
  // register here; FailedPrecondition naming the node and both values otherwise (the block size
  // is in every block hash, so such a node could never share a block with the others).
  absl::Status CheckBlockTokens(const std::string& node_id, int32_t block_tokens) const;
  int32_t block_tokens() const { return options_.block_tokens; }
  // Drops the node, its blocks, allocations and leases at once (a clean shutdown).
  absl::Status DeregisterNode(const Caller& node);
  // known=false when the id is not registered. FailedPrecondition naming the node when the
  // incarnation differs (the caller was replaced). `load` (optional) is kept for ListNodes.
  absl::StatusOr<HeartbeatResult> Heartbeat(const std::string& node_id, uint64_t incarnation = 0,
                                            const NodeLoad* load = nullptr);
  // Longest prefix whose every block has a replica on a live node; lease_ttl > 0 takes a lease
  // (bound to a non-anonymous caller) on the matched blocks (none when nothing matched).
  // Replicas on suspect nodes are left out.
  absl::StatusOr<MatchResult> MatchPrefix(absl::Span<const BlockHash> chain,
                                          absl::Duration lease_ttl, const Caller& caller = {});
  std::vector<NodePrefix> QueryPrefix(absl::Span<const BlockHash> chain);
  // ResourceExhausted only when eviction cannot make room; nothing is reserved on failure.
  absl::StatusOr<AllocateResult> Allocate(const AllocateArgs& args, absl::Time deadline);
  // Commits the named blocks of the allocation (all when empty); returns how many. An
  // allocation taken by a node can be committed / aborted only by that node and incarnation
  // (PermissionDenied naming both nodes; FailedPrecondition for another incarnation).
  // `token_ids` (optional): the tokens of `hashes`, block_tokens per hash in the same order;
  // InvalidArgument naming both lengths when they do not match. Kept with keep_block_tokens.
  absl::StatusOr<int> Commit(uint64_t allocation_id, absl::Span<const BlockHash> hashes,
                             const Caller& caller = {}, absl::Span<const int32_t> token_ids = {});
  absl::Status Abort(uint64_t allocation_id, const Caller& caller = {});
  absl::Status ReleaseLease(uint64_t lease_id, const Caller& caller = {});
  // Re-announces blocks `node` still holds in `segment_id` (idempotent); see AnnouncedBlock.
  // A segment of tier SSD (the node's disk tier) takes "slot `slot` now holds `hash`" instead
  // (a zero hash: the slot holds nothing); parents are not needed there (see disk_blocks_).
  absl::StatusOr<AnnounceResult> AnnounceBlocks(const Caller& node, const std::string& segment_id,
                                                absl::Span<const AnnouncedBlock> blocks);
  // The tokens kept for a committed block (empty when none: keep_block_tokens off, not sent,
  // or recovered from disk).
  std::vector<int32_t> TokensOf(const BlockHash& hash) const;
  // Blocks whose tokens are kept (for tests).
  size_t kept_token_blocks() const;

  // The role a registered node gave (nullopt when not registered).
  std::optional<NodeRole> RoleOf(const std::string& node_id) const;
  // Registered nodes (live and suspect) with their addresses, role, load and liveness.
  std::vector<NodeInfo> ListNodes() const;
  // Random per process start: lets nodes and watchers notice a store restart.
  uint64_t store_incarnation() const { return store_incarnation_; }
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

  // --- High availability (issue 20): a leader's log, followed by standbys ---
  // Every op the store logs (whether or not it has a data dir) is also kept in memory at
  // increasing positions (the last `retention` ops), for standbys to follow.
  void EnableReplicationLog(size_t retention = 1 << 16);
  // Ops at positions >= from, up to `max`, waiting until at least one exists or `deadline`;
  // `*next` = the position after the last op returned. OutOfRange when `from` is no longer
  // retained or is ahead of the log.
  absl::StatusOr<std::vector<WalOp>> ReplicationSince(uint64_t from, size_t max,
                                                      absl::Time deadline, uint64_t* next);
  // The position after the last logged op.
  uint64_t replication_position() const;
  // The whole committed state as ops (nodes, then blocks parent-first) and the position it
  // reflects: applying them to an empty store and then the ops from `*position` on gives the
  // leader's state.
  std::vector<WalOp> ReplicationSnapshot(uint64_t* position);
  // Standby: forgets every node, block, allocation and lease (before applying a snapshot).
  void ResetForReplication();
  // Standby: applies the leader's ops (no events are published) and appends them to this
  // instance's own WAL.
  absl::Status ApplyReplicated(absl::Span<const WalOp> ops);
  // Standby that now leads: the nodes it learned from the log get one TTL to heartbeat to it,
  // and new event sequence numbers start past the highest one the log carried.
  void PromoteToLeader();

  // For tests and benches.
  BlockIndex& index() { return *index_; }
  NodeRegistry& registry() { return registry_; }

 private:
  struct PendingAllocation {
    Caller owner;  // anonymous: committed / aborted by whoever holds the (random) id
    absl::Time deadline;
    std::vector<BlockHash> hashes;  // parent-first order; committed ones are removed
    absl::flat_hash_map<BlockHash, BlockHash> parents;
    // Slots reserved for one more replica of an already committed block (add_local_replicas).
    struct ExtraReplica {
      BlockHash hash;
      BlockHash parent;
      Replica replica;
    };
    std::vector<ExtraReplica> extra;
    bool empty() const { return hashes.empty() && extra.empty(); }
  };

  explicit CacheStore(CacheStoreOptions options, EvictionPolicyPtr policy);
  absl::Status Recover();
  absl::Status ApplyOp(const WalOp& op, uint64_t* max_seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the node, its blocks, the allocations it owns and its leases; publishes kNodeLeft.
  void RemoveNodeLocked(uint16_t node, bool log, std::string_view why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Allocation ownership check (see Commit).
  absl::Status CheckOwner(uint64_t allocation_id, const PendingAllocation& pending,
                          const Caller& caller) const;
  // Finds segments for one block (replicas on distinct nodes), evicting by policy while
  // nothing fits: only on `only_node` when set, else first on `prefer_node` then anywhere.
  absl::StatusOr<std::vector<const SegmentView*>> PlaceLocked(
      const AllocateArgs& args, size_t i, std::optional<uint16_t> only_node,
      std::optional<uint16_t> prefer_node, absl::Time deadline, std::vector<SegmentView>* views,
      std::vector<WalOp>* wal) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Allocated blocks whose allocation ended while a child in another allocation still pointed
  // at them: removed as soon as they are childless.
  void ReapOrphansLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishNodeEventLocked(StoreEvent::Kind kind, const NodeSpec& spec)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees slots, logs and publishes a removal for each block.
  void OnRemoved(const std::vector<RemovedBlock>& removed, std::vector<WalOp>* wal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(PendingAllocation& pending) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendWal(const std::vector<WalOp>& ops) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeSnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The committed state as ops: nodes, then blocks parent-first, then a sequence mark; with
  // `tokens`, each block's kept tokens (for standbys; a snapshot file never has them).
  std::vector<WalOp> StateAsOpsLocked(WalTokens tokens) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps `tokens` for `hash` (keep_block_tokens, non-empty, not kept yet).
  void KeepTokens(const BlockHash& hash, absl::Span<const int32_t> tokens);
  void DropTokens(const BlockHash& hash);
  // Assigns and returns the sequence (0 while replaying the log: nothing is published).
  uint64_t Publish(StoreEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<Location> Describe(const Replicas& replicas) const;
  // AnnounceBlocks into a disk-tier segment.
  AnnounceResult AnnounceDiskLocked(uint16_t node, uint16_t segment, uint64_t slot_bytes,
                                    int64_t capacity_slots, absl::Span<const AnnouncedBlock> blocks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets every disk replica of `node` (removed, replaced or forgotten).
  void DropDiskReplicasLocked(uint16_t node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks chain[from, ...) in an unbroken run that some live node's disk tier holds, with their
  // replicas (the run stops at a block no live node's disk holds).
  std::vector<MatchedBlock> DiskRun(absl::Span<const BlockHash> chain, size_t from) const;
  // (node << 16 | segment, index into MatchResult::segments) of the segments described so far.
  using SegmentRefs = absl::InlinedVector<std::pair<uint32_t, uint32_t>, 4>;
  // Appends `block` to `result`, each of its replicas' segments described once per result.
  void AppendMatched(const MatchedBlock& block, SegmentRefs& seen, MatchResult& result) const;
  std::vector<WalReplica> WalReplicas(const Replicas& replicas) const;
  void UpdateCapacityHint();

  const CacheStoreOptions options_;
  Clock* const clock_;
  const uint64_t store_incarnation_;
  const EvictionPolicyPtr policy_;
  NodeRegistry registry_;
  std::unique_ptr<BlockIndex> index_;
  LeaseTable leases_;
  StoreCounters counters_;

  absl::Mutex mu_;
  std::unique_ptr<Wal> wal_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, PendingAllocation> allocations_ ABSL_GUARDED_BY(mu_);
  std::vector<BlockHash> orphans_ ABSL_GUARDED_BY(mu_);
  bool replaying_ ABSL_GUARDED_BY(mu_) = false;
  // Sequence numbers up to this are covered by a logged kSequenceMark.
  uint64_t sequence_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t allocated_blocks_ ABSL_GUARDED_BY(mu_) = 0;

  // The highest event sequence number seen in replicated ops (standby).
  uint64_t replicated_max_sequence_ ABSL_GUARDED_BY(mu_) = 0;

  // The replication log (leaf lock, taken under mu_ by AppendWal).
  mutable absl::Mutex repl_mu_;
  absl::CondVar repl_cv_;
  bool repl_enabled_ ABSL_GUARDED_BY(repl_mu_) = false;
  size_t repl_retention_ ABSL_GUARDED_BY(repl_mu_) = 0;
  std::deque<WalOp> repl_ops_ ABSL_GUARDED_BY(repl_mu_);
  uint64_t repl_end_ ABSL_GUARDED_BY(repl_mu_) = 0;  // position after the newest op

  // Kept block tokens (keep_block_tokens): a leaf lock, read by the KV-event publisher's state
  // resend without mu_.
  mutable absl::Mutex tokens_mu_;
  absl::flat_hash_map<BlockHash, std::vector<int32_t>> tokens_ ABSL_GUARDED_BY(tokens_mu_);

  // Disk replicas (segments of tier SSD): blocks a node keeps on its own NVMe after they left
  // DRAM. Kept apart from the index: no parents, no leases, no eviction by the store (the
  // node's disk overwrites its least recently used blocks and announces what each slot now
  // holds); MatchPrefix and QueryPrefix go on into them where the DRAM prefix ends. Memory only
  // (not logged): a node re-announces them whenever it registers again. Readers verify every
  // block read from disk, so an entry gone stale costs a recompute, never a wrong block.
  // Lock order: mu_ -> disk_mu_ -> the registry's lock (disk_mu_ is also taken alone).
  mutable absl::Mutex disk_mu_;
  struct DiskBlock {
    uint32_t size_bytes = 0;
    Replicas replicas;
  };
  absl::flat_hash_map<BlockHash, DiskBlock> disk_blocks_ ABSL_GUARDED_BY(disk_mu_);
  // (node << 48 | segment << 32 | slot) -> the block announced there.
  absl::flat_hash_map<uint64_t, BlockHash> disk_slots_ ABSL_GUARDED_BY(disk_mu_);

  mutable absl::Mutex events_mu_;
  absl::CondVar events_cv_;
  std::deque<StoreEvent> events_ ABSL_GUARDED_BY(events_mu_);
  uint64_t next_sequence_ ABSL_GUARDED_BY(events_mu_) = 1;
};

}  // namespace kvrelay::cachestore
