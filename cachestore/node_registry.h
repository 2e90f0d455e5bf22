#pragma once

// NodeRegistry: nodes (prefill / decode workers, cache nodes), their memory segments and slot
// allocation, and heartbeat liveness.
//
// Each node gets a small index (uint16) that block records use instead of the node id string;
// each segment an index within its node.
//
// Identity: a node is (node_id, incarnation), the incarnation being a random 64-bit number the
// process picks at start. One incarnation per id is registered at a time: a second live
// registration of the id with another incarnation is refused (ALREADY_EXISTS naming the holder);
// one that arrives while the old incarnation is suspect replaces it (the owner drops the old
// one's blocks first). Every block replica refers to a node index, and an index is only reused
// after the owner removed every replica on it, so a replica always belongs to the incarnation
// registered at its index; readers detect a removal racing their lookup via removals().
//
// Liveness (soft state): a live node that misses its TTL becomes SUSPECT (its replicas are
// skipped by new matches and placement, but kept); a heartbeat of the same incarnation makes it
// live again; after the grace period it is forgotten (the owner drops it and its blocks).
//
// Thread-safe (one mutex; callers never hold an index lock while calling in, see CacheStore).

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cachestore/block_index.h"

namespace kvrelay::cachestore {

// Same numbers as kvrelay.v1.Tier. Lower number = faster tier.
enum class Tier : uint8_t { kUnspecified = 0, kGpu = 1, kHost = 2, kSsd = 3 };
std::string_view TierName(Tier tier);  // "gpu", "host", "ssd", "unspecified"

struct SegmentSpec {
  std::string segment_id;
  Tier tier = Tier::kHost;
  int64_t capacity_slots = 0;
  uint64_t slot_bytes = 0;
  std::string memory_key;
  friend bool operator==(const SegmentSpec&, const SegmentSpec&) = default;
};

// Errors about who the caller is (wrong incarnation, id held by another process, another
// node's allocation or lease) carry this absl::Status payload, whose value is the node id the
// error is about; the gRPC glue turns it into ErrorInfo{reason: FAILURE_IDENTITY} (structured,
// so nobody parses the message).
inline constexpr char kIdentityPayload[] = "kvrelay.cachestore/identity";
absl::Status IdentityError(absl::Status status, std::string_view node_id);
// A node id held by a live process (ALREADY_EXISTS at registration) also carries this payload:
// "<ms since the holder's last heartbeat>/<its TTL in ms>", which the gRPC glue turns into
// ErrorInfo.holder_silent_ms / holder_ttl_ms.
inline constexpr char kHolderPayload[] = "kvrelay.cachestore/holder";

// Same numbers as kvrelay.v1.NodeRole.
enum class NodeRole : uint8_t { kUnspecified = 0, kPrefill = 1, kDecode = 2, kCache = 3 };
std::string_view NodeRoleName(NodeRole role);  // "prefill", "decode", "cache", "unspecified"

struct NodeSpec {
  std::string node_id;
  // Random per process start; never 0 once registered (the store assigns one for legacy
  // clients that send 0).
  uint64_t incarnation = 0;
  NodeRole role = NodeRole::kUnspecified;
  std::string grpc_address;    // where the node's own gRPC service listens (discovery)
  std::string transport_kind;  // data plane
  std::string transport_address;
  std::vector<SegmentSpec> segments;
  absl::Duration ttl = absl::Seconds(10);
  friend bool operator==(const NodeSpec&, const NodeSpec&) = default;
};

// What a node reports about its load with each heartbeat (routing input for the gateway).
struct NodeLoad {
  int64_t active_requests = 0;
  int64_t queued_requests = 0;
  int64_t free_kv_blocks = 0;
  int64_t total_kv_blocks = 0;
  int64_t disk_read_bytes_per_second = 0;
  friend bool operator==(const NodeLoad&, const NodeLoad&) = default;
};

enum class NodeState : uint8_t { kLive = 1, kSuspect = 2 };

// One registered node as ListNodes shows it.
struct NodeInfo {
  NodeSpec spec;
  NodeState state = NodeState::kLive;
  NodeLoad load;
  absl::Duration since_heartbeat;
  int64_t capacity_slots = 0;  // every segment
  int64_t used_slots = 0;
  int64_t ssd_capacity_slots = 0;  // of those, the disk tier's (Tier::kSsd) segments
  int64_t ssd_used_slots = 0;
};

// A replica described for a reader.
struct Location {
  std::string node_id;
  uint64_t incarnation = 0;
  std::string segment_id;
  int64_t slot = 0;
  Tier tier = Tier::kUnspecified;
  uint64_t offset_bytes = 0;
  uint64_t slot_bytes = 0;
  // The holder's data plane and the segment's memory key (see v1::SegmentRef).
  std::string transport_kind;
  std::string transport_address;
  std::string memory_key;
};

// What placement sees of one segment.
struct SegmentView {
  uint16_t node = 0;
  uint16_t segment = 0;
  Tier tier = Tier::kUnspecified;
  int64_t capacity_slots = 0;
  int64_t free_slots = 0;
  uint64_t slot_bytes = 0;
  const std::string* node_id = nullptr;  // valid until the registry changes
};

struct TierUsage {
  Tier tier = Tier::kUnspecified;
  int64_t capacity_bytes = 0;
  int64_t used_bytes = 0;
  int64_t capacity_slots = 0;
  int64_t used_slots = 0;
};

class NodeRegistry {
 public:
  static constexpr int kMaxNodes = 0xFFFF;

  explicit NodeRegistry(int max_nodes = kMaxNodes) : max_nodes_(max_nodes) {}

  // Adds a node, or refreshes it when the same (id, incarnation) registers again with the same
  // spec (idempotent; a suspect node becomes live: `revived`). Another incarnation of a live id:
  // AlreadyExists naming the id and the address holding it — unless it registers from the same
  // role and gRPC address as the live holder: servers bind without SO_REUSEPORT, so a process
  // that listens on the holder's address is its successor (the holder is gone; a pod or host
  // restarted faster than its TTL). Another incarnation of a suspect id (or any other
  // incarnation with `force_replace`, used by WAL replay): `replaced` is set and
  // the caller must drop the old node's blocks, Remove() it and Register again. The same
  // incarnation with a different spec: FailedPrecondition. ResourceExhausted past max_nodes.
  struct RegisterResult {
    uint16_t index = 0;
    bool replaced = false;
    bool revived = false;
    bool added = false;
  };
  // `allow_successor` false: a live holder is never replaced by address (a registration whose
  // incarnation the store assigned says nothing about which process it is).
  absl::StatusOr<RegisterResult> Register(const NodeSpec& spec, absl::Time now,
                                          bool force_replace = false, bool allow_successor = true);

  enum class HeartbeatOutcome { kUnknown, kOk, kRevived, kWrongIncarnation };
  struct HeartbeatResult {
    HeartbeatOutcome outcome = HeartbeatOutcome::kUnknown;
    uint16_t index = 0;
    uint64_t registered_incarnation = 0;
  };
  // incarnation 0 (legacy clients) matches whatever incarnation is registered. `load` is
  // stored when given.
  HeartbeatResult Heartbeat(const std::string& node_id, uint64_t incarnation, absl::Time now,
                            const NodeLoad* load = nullptr);

  // Live nodes past their TTL become suspect (returned in `suspected`); suspect nodes past
  // TTL + grace are returned in `forget` for the owner to drop.
  struct Sweep {
    std::vector<uint16_t> suspected;
    std::vector<uint16_t> forget;
  };
  Sweep Expire(absl::Time now, absl::Duration grace);
  // Gives every node a fresh heartbeat (after a restart, live nodes get one TTL to check in).
  void TouchAll(absl::Time now);
  void Remove(uint16_t node);

  // The node registered under `node_id` if its incarnation is `incarnation` (0 = any, legacy):
  // NotFound when the id is unknown, FailedPrecondition naming both incarnations otherwise.
  absl::StatusOr<uint16_t> Check(const std::string& node_id, uint64_t incarnation) const;

  std::optional<uint16_t> Find(const std::string& node_id) const;
  std::optional<std::string> NodeId(uint16_t node) const;
  std::optional<NodeSpec> Spec(uint16_t node) const;
  std::vector<NodeSpec> AllSpecs() const;
  std::vector<NodeInfo> List(absl::Time now) const;
  std::optional<uint16_t> FindSegment(uint16_t node, const std::string& segment_id) const;
  int64_t size() const;  // registered (live + suspect)
  int64_t live_count() const;

  // Lock-free liveness for the lookup path: true while the node at `node` is suspect.
  bool IsSuspect(uint16_t node) const {
    return suspect_[node].load(std::memory_order_acquire) != 0;
  }
  // Number of suspect nodes; 0 lets lookups skip the per-replica check.
  int suspect_count() const { return suspect_count_.load(std::memory_order_acquire); }
  // Bumped by every Remove (release); a lookup that read it before and after resolving node
  // indices knows no index changed owner in between.
  uint64_t removals() const { return removals_.load(std::memory_order_acquire); }

  // Slot bookkeeping. ReserveSlot: nullopt when the segment is full or gone.
  std::optional<uint32_t> ReserveSlot(uint16_t node, uint16_t segment);
  void FreeSlot(const Replica& replica);
  // Marks a specific slot used (WAL replay, announcements). False if out of range or used.
  bool MarkUsed(const Replica& replica);

  // Segments of live nodes (suspect ones are not offered to placement) plus, when given, all
  // segments of `include` even if suspect.
  // SSD segments (disk tiers) are left out of both: the store does not place blocks there.
  std::vector<SegmentView> Segments(std::optional<uint16_t> include = std::nullopt) const;
  Location Describe(const Replica& replica) const;
  std::vector<TierUsage> Usage() const;
  // Used / capacity slots over all segments but disk tiers (SSD).
  std::pair<int64_t, int64_t> SlotTotals() const;

 private:
  struct Segment {
    SegmentSpec spec;
    uint32_t next_unused = 0;
    std::vector<uint32_t> free_list;
    int64_t used = 0;
  };
  struct Node {
    NodeSpec spec;
    absl::Time last_heartbeat;
    absl::Time suspect_since;
    NodeState state = NodeState::kLive;
    NodeLoad load;
    std::vector<Segment> segments;
    bool live = false;  // slot in use (live or suspect)
  };
  void SetSuspect(uint16_t index, bool suspect) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_nodes_;
  mutable absl::Mutex mu_;
  std::vector<Node> nodes_ ABSL_GUARDED_BY(mu_);
  // Oldest-freed first, so an index is reused as late as possible.
  std::deque<uint16_t> free_indices_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint16_t> by_id_ ABSL_GUARDED_BY(mu_);
  // Written under mu_, read lock-free (acquire) by lookups.
  std::unique_ptr<std::atomic<uint8_t>[]> suspect_ { new std::atomic<uint8_t>[ kMaxNodes + 1 ]() };
  std::atomic<int> suspect_count_{0};
  std::atomic<uint64_t> removals_{0};
};

// Placement: picks `replicas` segments on distinct nodes for a block of `size_bytes`.
// Order of preference: preferred node (if any), preferred tier (if any; else the fastest tier
// with room), then the segment with the largest free fraction, which spreads load and keeps
// headroom on every node. Returns fewer than asked when not enough segments have a free slot.
std::vector<const SegmentView*> ChoosePlacement(const std::vector<SegmentView>& segments,
                                                uint64_t size_bytes,
                                                const std::string& preferred_node,
                                                Tier preferred_tier, int replicas);

}  // namespace kvrelay::cachestore
