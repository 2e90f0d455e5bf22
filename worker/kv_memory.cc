#include "worker/kv_memory.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv/checksum.h"
#include "kvrelay/v1/cachestore.pb.h"
#include "transfer/region_memory_resource.h"

namespace kvrelay::worker {

absl::StatusOr<std::unique_ptr<RegisteredKvCache>> RegisteredKvCache::Create(
    const kv::ModelLayout& layout, int64_t blocks_per_group, transfer::Transport* transport,
    bool private_memory) {
  auto out = std::unique_ptr<RegisteredKvCache>(new RegisteredKvCache());
  std::vector<kv::BlockPool*> raw;
  for (size_t g = 0; g < layout.groups().size(); ++g) {
    auto resource = std::make_unique<transfer::RegionMemoryResource>(transport, private_memory);
    transfer::RegionMemoryResource* raw_resource = resource.get();
    KV_ASSIGN_OR_RETURN(
        std::unique_ptr<kv::BlockPool> pool,
        kv::BlockPool::Create(
            {static_cast<size_t>(layout.BlockBytes(static_cast<int>(g))), blocks_per_group},
            std::move(resource)));
    out->regions_.push_back(raw_resource->region());
    raw.push_back(pool.get());
    out->pools_.push_back(std::move(pool));
  }
  KV_ASSIGN_OR_RETURN(out->cache_, model::KvCache::Wrap(layout, raw));
  return out;
}

absl::StatusOr<std::unique_ptr<CacheSegment>> CacheSegment::Create(const kv::ModelLayout& layout,
                                                                   int64_t num_slots,
                                                                   transfer::Transport* transport) {
  auto out = std::unique_ptr<CacheSegment>(new CacheSegment());
  out->layout_ = layout;
  for (size_t g = 0; g < layout.groups().size(); ++g) {
    out->group_offsets_.push_back(out->block_bytes_);
    out->block_bytes_ += static_cast<uint64_t>(layout.BlockBytes(static_cast<int>(g)));
  }
  auto resource = std::make_unique<transfer::RegionMemoryResource>(transport);
  transfer::RegionMemoryResource* raw_resource = resource.get();
  KV_ASSIGN_OR_RETURN(out->pool_,
                      kv::BlockPool::Create({out->block_bytes_, num_slots}, std::move(resource)));
  out->region_ = raw_resource->region();
  KV_ASSIGN_OR_RETURN(out->table_,
                      transport->AllocateMemory(static_cast<size_t>(num_slots) * kSlotEntryBytes));
  return out;
}

void CacheSegment::ClearEntry(int64_t slot) const {
  std::memset(table_->data() + static_cast<uint64_t>(slot) * kSlotEntryBytes, 0, kSlotEntryBytes);
}

void CacheSegment::PublishEntry(int64_t slot, const kv::BlockHash& hash) const {
  SlotEntry entry;
  entry.hash_hi = hash.hi;
  entry.hash_lo = hash.lo;
  entry.checksum = kv::BlockChecksum(GroupUnit(slot, 0), static_cast<size_t>(block_bytes_));
  std::memcpy(table_->data() + static_cast<uint64_t>(slot) * kSlotEntryBytes, &entry,
              kSlotEntryBytes);
}

CacheSegment::SlotEntry CacheSegment::Entry(int64_t slot) const {
  SlotEntry entry;
  std::memcpy(&entry, table_->data() + static_cast<uint64_t>(slot) * kSlotEntryBytes,
              kSlotEntryBytes);
  return entry;
}

std::string CacheSegment::AccessKey(const std::string& data_plane_key,
                                    uint64_t transport_incarnation) const {
  kvrelay::v1::SegmentAccess access;
  access.set_region_id(region_->id());
  access.set_table_region_id(table_->id());
  access.set_slot_stride(slot_stride());
  access.set_data_plane_key(data_plane_key);
  access.set_transport_incarnation(transport_incarnation);
  return access.SerializeAsString();
}

uint8_t* CacheSegment::GroupUnit(int64_t slot, int group) const {
  return static_cast<uint8_t*>(pool_->SlotAddress(static_cast<kv::SlotId>(slot))) +
         group_offsets_[group];
}

absl::Status CacheSegment::StoreBlock(const model::Sequence& seq, int64_t block_index,
                                      int64_t slot) const {
  if (slot < 0 || slot >= num_slots()) {
    return absl::InvalidArgumentError(absl::StrCat("cache slot ", slot, " out of range"));
  }
  for (int g = 0; g < seq.cache().num_groups(); ++g) {
    const std::vector<kv::SlotId>& blocks = seq.blocks(g);
    if (block_index >= static_cast<int64_t>(blocks.size()) || blocks[block_index] < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("block ", block_index, " of group ", g, " is not in the cache"));
    }
    std::memcpy(GroupUnit(slot, g), seq.cache().pool(g).SlotAddress(blocks[block_index]),
                static_cast<size_t>(layout_.BlockBytes(g)));
  }
  return absl::OkStatus();
}

absl::Status CacheSegment::StoreBlockBytes(absl::Span<const uint8_t> unit, int64_t slot) const {
  if (slot < 0 || slot >= num_slots()) {
    return absl::InvalidArgumentError(absl::StrCat("cache slot ", slot, " out of range"));
  }
  if (unit.size() != block_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("block unit of ", unit.size(), " bytes, want ", block_bytes_));
  }
  for (size_t g = 0; g < group_offsets_.size(); ++g) {
    std::memcpy(GroupUnit(slot, static_cast<int>(g)), unit.data() + group_offsets_[g],
                static_cast<size_t>(layout_.BlockBytes(static_cast<int>(g))));
  }
  return absl::OkStatus();
}

absl::Status CacheSegment::LoadBlock(int64_t slot, model::KvCache& cache,
                                     std::vector<std::vector<kv::SlotId>>& group_slots) const {
  if (slot < 0 || slot >= num_slots()) {
    return absl::InvalidArgumentError(absl::StrCat("cache slot ", slot, " out of range"));
  }
  group_slots.resize(static_cast<size_t>(cache.num_groups()));
  for (int g = 0; g < cache.num_groups(); ++g) {
    KV_ASSIGN_OR_RETURN(kv::SlotId s, cache.pool(g).Allocate());
    std::memcpy(cache.pool(g).SlotAddress(s), GroupUnit(slot, g),
                static_cast<size_t>(layout_.BlockBytes(g)));
    group_slots[g].push_back(s);
  }
  return absl::OkStatus();
}

absl::Status CacheSegment::LoadBlockBytes(absl::Span<const uint8_t> unit, model::KvCache& cache,
                                          std::vector<std::vector<kv::SlotId>>& group_slots) const {
  if (unit.size() != block_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("block unit of ", unit.size(), " bytes, want ", block_bytes_));
  }
  group_slots.resize(static_cast<size_t>(cache.num_groups()));
  for (int g = 0; g < cache.num_groups(); ++g) {
    KV_ASSIGN_OR_RETURN(kv::SlotId s, cache.pool(g).Allocate());
    std::memcpy(cache.pool(g).SlotAddress(s), unit.data() + group_offsets_[g],
                static_cast<size_t>(layout_.BlockBytes(g)));
    group_slots[g].push_back(s);
  }
  return absl::OkStatus();
}

LayerSlice SliceOfLayer(const kv::ModelLayout& layout, const model::KvCache& cache, int32_t layer) {
  const int g = cache.group_of_layer(layer);
  const uint64_t layer_bytes = static_cast<uint64_t>(layout.BlockBytes(g)) /
                               static_cast<uint64_t>(layout.groups()[g].num_layers());
  return {static_cast<uint64_t>(cache.index_in_group(layer)) * layer_bytes, layer_bytes};
}

DiskStagePlan PlanDiskStages(const CacheSegment& segment, const model::KvCache& cache,
                             int max_stages) {
  const kv::ModelLayout& layout = cache.layout();
  const int32_t layers = layout.num_layers();
  const int stages = std::max(1, std::min<int>(max_stages, layers));
  DiskStagePlan plan;
  plan.stages.resize(static_cast<size_t>(stages));
  plan.stage_of_layer.resize(static_cast<size_t>(layers));
  for (int s = 0; s < stages; ++s) {
    std::vector<kv::PayloadRange>& ranges = plan.stages[static_cast<size_t>(s)];
    for (int32_t layer = layers * s / stages; layer < layers * (s + 1) / stages; ++layer) {
      plan.stage_of_layer[static_cast<size_t>(layer)] = s;
      const LayerSlice slice = SliceOfLayer(layout, cache, layer);
      const uint64_t offset =
          segment.group_offset(cache.group_of_layer(layer)) + slice.offset_in_unit;
      if (!ranges.empty() && ranges.back().offset + ranges.back().length == offset) {
        ranges.back().length += slice.length;  // the next layer of the same group
      } else {
        ranges.push_back({offset, slice.length});
      }
    }
  }
  return plan;
}

absl::StatusOr<std::vector<kv::DiskTier::Destination>> AllocateBlockDestinations(
    const CacheSegment& segment, model::KvCache& cache,
    std::vector<std::vector<kv::SlotId>>& group_slots) {
  group_slots.resize(static_cast<size_t>(cache.num_groups()));
  std::vector<kv::DiskTier::Destination> places;
  for (int g = 0; g < cache.num_groups(); ++g) {
    absl::StatusOr<kv::SlotId> slot = cache.pool(g).Allocate();
    if (!slot.ok()) {
      // Nothing half-allocated is left behind: this block's earlier groups go back.
      for (int h = 0; h < g; ++h) {
        cache.pool(h).Release(group_slots[h].back()).IgnoreError();
        group_slots[h].pop_back();
      }
      return slot.status();
    }
    group_slots[g].push_back(*slot);
    places.push_back({segment.group_offset(g), static_cast<uint64_t>(cache.layout().BlockBytes(g)),
                      static_cast<uint8_t*>(cache.pool(g).SlotAddress(*slot))});
  }
  return places;
}

bool BlockWanted(const kv::LayerGroup& group, int32_t block_tokens, int64_t block_index,
                 int64_t first_query_position) {
  // A recurrent state summarises every token before it: only the state after the last pushed
  // block (the one ending where the first query starts) is wanted.
  if (group.kind == kv::LayerKind::kSsmState) {
    return (block_index + 1) * block_tokens == first_query_position;
  }
  if (group.kind != kv::LayerKind::kSlidingWindow) return true;
  // A query at position q sees keys k with q - k < window; the block's last token is
  // (block_index + 1) * block_tokens - 1.
  const int64_t last_token = (block_index + 1) * block_tokens - 1;
  return first_query_position - last_token < group.window_tokens;
}

uint64_t RequestTag(const std::string& request_id) {
  return kv::BlockChecksum(request_id.data(), request_id.size());
}

}  // namespace kvrelay::worker
