#pragma once

// NodeRegistry: nodes (prefill / decode workers, cache nodes), their memory segments and slot
// allocation, and heartbeat liveness.
//
// Each node gets a small index (uint16) that block records use instead of the node id string;
// each segment an index within its node. A node that misses its TTL is reported by Expired() and
// removed by the owner (CacheStore), which also drops its blocks from the index.
//
// Thread-safe (one mutex; callers never hold an index lock while calling in, see CacheStore).

#include <cstdint>
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

struct NodeSpec {
  std::string node_id;
  std::string transport_kind;
  std::string transport_address;
  std::vector<SegmentSpec> segments;
  absl::Duration ttl = absl::Seconds(10);
  friend bool operator==(const NodeSpec&, const NodeSpec&) = default;
};

// A replica described for a reader.
struct Location {
  std::string node_id;
  std::string segment_id;
  int64_t slot = 0;
  Tier tier = Tier::kUnspecified;
  uint64_t offset_bytes = 0;
  uint64_t slot_bytes = 0;
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

  // Adds a node or updates its heartbeat if it is registered with the same spec. A node
  // re-registering with a different spec is reported as `replaced` (the caller must drop its
  // blocks and call Register again after Remove). ResourceExhausted past kMaxNodes.
  struct RegisterResult {
    uint16_t index = 0;
    bool replaced = false;
  };
  absl::StatusOr<RegisterResult> Register(const NodeSpec& spec, absl::Time now);
  // False when the node is unknown.
  bool Heartbeat(const std::string& node_id, absl::Time now);
  // Nodes whose last heartbeat is older than their TTL.
  std::vector<uint16_t> Expired(absl::Time now) const;
  // Gives every node a fresh heartbeat (after a restart, live nodes get one TTL to check in).
  void TouchAll(absl::Time now);
  void Remove(uint16_t node);

  std::optional<uint16_t> Find(const std::string& node_id) const;
  std::optional<std::string> NodeId(uint16_t node) const;
  std::optional<NodeSpec> Spec(uint16_t node) const;
  std::vector<NodeSpec> AllSpecs() const;
  std::optional<uint16_t> FindSegment(uint16_t node, const std::string& segment_id) const;
  int64_t size() const;

  // Slot bookkeeping. ReserveSlot: nullopt when the segment is full or gone.
  std::optional<uint32_t> ReserveSlot(uint16_t node, uint16_t segment);
  void FreeSlot(const Replica& replica);
  // Marks a specific slot used (WAL replay). False if out of range or already used.
  bool MarkUsed(const Replica& replica);

  std::vector<SegmentView> Segments() const;
  Location Describe(const Replica& replica) const;
  std::vector<TierUsage> Usage() const;
  // Used / capacity slots over all segments.
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
    std::vector<Segment> segments;
    bool live = false;
  };

  mutable absl::Mutex mu_;
  std::vector<Node> nodes_ ABSL_GUARDED_BY(mu_);
  std::vector<uint16_t> free_indices_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint16_t> by_id_ ABSL_GUARDED_BY(mu_);
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
