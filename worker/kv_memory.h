#pragma once

// KV memory a worker shares over the data plane:
//  - RegisteredKvCache: a model::KvCache whose per-group pools are registered with a
//    transport, so peers can put into (decode) or read from (prefill) its slots;
//  - CacheSegment: whole-block slots (every group's unit of one block, back to back) that the
//    cache store hands out for committed blocks, also registered with the transport.
//
// Thread-safe as their parts are (BlockPool, KvCache). Lifetimes: the transport must outlive
// both; members are declared so regions are deregistered before memory is freed.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/disk/disk_tier.h"
#include "kv/model_layout.h"
#include "kv/pool/block_pool.h"
#include "model/kv_cache.h"
#include "transfer/transport.h"

namespace kvrelay::worker {

class RegisteredKvCache {
 public:
  // `private_memory`: the pools are private regions (Transport::AllocatePrivateMemory), which
  // no peer reaches except through keys of their sub-ranges handed out one by one.
  static absl::StatusOr<std::unique_ptr<RegisteredKvCache>> Create(const kv::ModelLayout& layout,
                                                                   int64_t blocks_per_group,
                                                                   transfer::Transport* transport,
                                                                   bool private_memory = false);
  model::KvCache& cache() const { return *cache_; }
  const transfer::MemoryRegion& region(int group) const { return *regions_[group]; }

 private:
  RegisteredKvCache() = default;
  // Each pool's memory is allocated by the transport (RegionMemoryResource): over shared
  // memory UCX 1.13 writes directly only into memory it allocated itself.
  std::vector<std::unique_ptr<kv::BlockPool>> pools_;
  std::unique_ptr<model::KvCache> cache_;
  std::vector<const transfer::MemoryRegion*> regions_;  // owned by the pools' resources
};

class CacheSegment {
 public:
  static absl::StatusOr<std::unique_ptr<CacheSegment>> Create(const kv::ModelLayout& layout,
                                                              int64_t num_slots,
                                                              transfer::Transport* transport);
  int64_t num_slots() const { return pool_->num_slots(); }
  // Bytes of one whole block (sum of BlockBytes over groups); the slot size the store sees.
  uint64_t block_bytes() const { return block_bytes_; }
  uint64_t slot_stride() const { return pool_->slot_stride(); }
  const transfer::MemoryRegion& region() const { return *region_; }
  // Where group g's unit of `slot` starts. REQUIRES: 0 <= slot < num_slots().
  uint8_t* GroupUnit(int64_t slot, int group) const;

  // Copies block `block_index` of `seq` (every group) into `slot`. FailedPrecondition when a
  // group's block was freed (-1).
  absl::Status StoreBlock(const model::Sequence& seq, int64_t block_index, int64_t slot) const;
  // Copies a block unit's bytes (block_bytes() of them, laid out as LoadBlockBytes reads them:
  // a block read back from the disk tier) into `slot`. InvalidArgument for another size.
  absl::Status StoreBlockBytes(absl::Span<const uint8_t> unit, int64_t slot) const;
  // Copies `slot` into freshly allocated KvCache slots, one per group (appended to
  // `group_slots[g]`); the caller owns one reference on each.
  absl::Status LoadBlock(int64_t slot, model::KvCache& cache,
                         std::vector<std::vector<kv::SlotId>>& group_slots) const;
  // As LoadBlock, from a block unit's bytes held elsewhere (block_bytes() of them, every group's
  // unit at group_offset(g)): a block read back from the disk tier. InvalidArgument for another
  // size.
  absl::Status LoadBlockBytes(absl::Span<const uint8_t> unit, model::KvCache& cache,
                              std::vector<std::vector<kv::SlotId>>& group_slots) const;

  // The slot table: one SlotEntry per slot naming the block it holds, so a reader on another
  // node (which gets the bytes over the data plane) checks identity and integrity before it
  // uses them. Cleared before a slot's bytes change, written after they are complete.
  struct SlotEntry {
    uint64_t hash_hi = 0;
    uint64_t hash_lo = 0;
    uint64_t checksum = 0;  // kv::BlockChecksum of the slot's block_bytes()
    uint64_t reserved = 0;
  };
  static constexpr uint64_t kSlotEntryBytes = sizeof(SlotEntry);
  void ClearEntry(int64_t slot) const;
  // Records that `slot` now holds block `hash` (checksums its bytes).
  void PublishEntry(int64_t slot, const kv::BlockHash& hash) const;
  SlotEntry Entry(int64_t slot) const;
  const transfer::MemoryRegion& table_region() const { return *table_; }
  // Where group g's unit starts within a block unit (the same for every node of one layout).
  uint64_t group_offset(int group) const { return group_offsets_[group]; }
  // The serialized kvrelay.v1.SegmentAccess registered as the segment's memory key.
  std::string AccessKey(const std::string& data_plane_key, uint64_t transport_incarnation) const;

 private:
  CacheSegment() = default;
  kv::ModelLayout layout_;
  std::vector<uint64_t> group_offsets_;
  uint64_t block_bytes_ = 0;
  std::unique_ptr<kv::BlockPool> pool_;  // used for its memory only; the store assigns slots
  const transfer::MemoryRegion* region_ = nullptr;  // owned by pool_'s resource
  transfer::MemoryRegionPtr table_;                 // num_slots x kSlotEntryBytes
};

// Where one leading block of a prefix can be read from another node (see SegmentAccess).
struct RemoteReplica {
  std::string node_id;
  std::string transport_address;
  uint64_t transport_incarnation = 0;
  std::string data_plane_key;
  uint64_t region_id = 0;
  uint64_t table_region_id = 0;
  uint64_t slot_stride = 0;
  int64_t slot = 0;
};

// One (group, block, layer) slice of a block unit: layer-major inside a unit, so each layer
// of each block is one contiguous run of BlockBytes(g) / layers_in_group bytes.
struct LayerSlice {
  uint64_t offset_in_unit = 0;
  uint64_t length = 0;
};
LayerSlice SliceOfLayer(const kv::ModelLayout& layout, const model::KvCache& cache, int32_t layer);

// A block cut into stages for layer-wise disk reads (DiskCacheOptions::stages): stage s holds
// the strips of layers [first_layer(s), first_layer(s + 1)) in every group, so a prefix read
// back from disk can be used up to a layer while later layers are still being read. At most
// `max_stages` stages of whole layers, as even as the layer count allows.
struct DiskStagePlan {
  std::vector<std::vector<kv::PayloadRange>> stages;
  std::vector<int> stage_of_layer;
};
DiskStagePlan PlanDiskStages(const CacheSegment& segment, const model::KvCache& cache,
                             int max_stages);
// Where each of a block's bytes goes when it is read into freshly allocated KvCache slots, one
// per group (appended to `group_slots[g]`, one reference each owned by the caller), as
// CacheSegment::LoadBlockBytes lays it out.
absl::StatusOr<std::vector<kv::DiskTier::Destination>> AllocateBlockDestinations(
    const CacheSegment& segment, model::KvCache& cache,
    std::vector<std::vector<kv::SlotId>>& group_slots);

// The decode worker's choice of which full prompt blocks it wants per group: every block for
// full attention and MLA; for sliding-window groups only the blocks a query at position
// >= first_query_position can still attend to; for SSM groups only the block ending at
// first_query_position (its state is the sequence's state there).
bool BlockWanted(const kv::LayerGroup& group, int32_t block_tokens, int64_t block_index,
                 int64_t first_query_position);

// Tag of a request's transfers, shared by prefill and decode: XXH3-64 of the request id.
uint64_t RequestTag(const std::string& request_id);

}  // namespace kvrelay::worker
