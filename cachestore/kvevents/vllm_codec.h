#pragma once

// vLLM's KV-event wire format (vllm/distributed/kv_events.py), encoded with msgpack-c: a
// KVEventBatch is a msgpack map {"ts": float64 seconds, "events": [...],
// "data_parallel_rank": int}, each event a map tagged {"type": "BlockStored" | "BlockRemoved" |
// "AllBlocksCleared", ...} with the fields in vLLM's declaration order. Optional fields whose
// value is None are left out, as msgspec's omit_defaults does; required Optional fields
// (lora_id, medium, lora_name, parent_block_hash) are written as nil.
//
// Pure functions; thread-safe.

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace kvrelay::cachestore::kvevents {

struct BlockStored {
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_block_hash;
  std::vector<int32_t> token_ids;
  int32_t block_size = 0;
  std::optional<std::string> medium;  // "GPU" / "CPU"; nil when unknown
  std::optional<int32_t> group_idx;   // omitted when unset
  std::optional<std::string> kv_cache_spec_kind;
  std::optional<int32_t> kv_cache_spec_sliding_window;
};

struct BlockRemoved {
  std::vector<uint64_t> block_hashes;
  std::optional<std::string> medium;
  std::optional<int32_t> group_idx;
};

struct AllBlocksCleared {};

using KvEvent = std::variant<BlockStored, BlockRemoved, AllBlocksCleared>;

struct KvEventBatch {
  double ts = 0;  // seconds since the epoch
  std::vector<KvEvent> events;
  int32_t data_parallel_rank = 0;
};

// The msgpack bytes of `batch`.
std::string EncodeKvEventBatch(const KvEventBatch& batch);

}  // namespace kvrelay::cachestore::kvevents
