#pragma once

// Trace replay: runs a Mooncake-format request trace (one JSON object per line with `hash_ids`,
// chained 512-token block ids; see ../shared/data/traces/README.md) through the same BlockIndex
// and EvictionPolicy code the cache store serves with, at a fixed capacity in blocks.
//
// Per request: its hits are the longest run of leading blocks that are committed; then every
// block is accessed in order (inserted if missing, evicting when the index is full). The
// request's blocks are leased while it is replayed, as a real request pins what it reads, so a
// request never evicts its own prefix.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kv/block_hash.h"

namespace kvrelay::cachestore::sim {

using kv::BlockHash;

struct TraceRequest {
  std::vector<uint64_t> hash_ids;
  // Optional fields (-1 when the line has none): prompt and output tokens, arrival time.
  int64_t input_length = -1;
  int64_t output_length = -1;
  int64_t timestamp_ms = -1;
};

// Parses JSON lines; blank lines are skipped. InvalidArgument naming the line and field for a
// line that is not a JSON object, a missing or non-array hash_ids, a negative or non-integer id,
// a negative or non-integer length / timestamp, or an input_length that disagrees with the
// number of 512-token blocks (ceil(input_length / 512) == len(hash_ids), as the format says).
absl::StatusOr<std::vector<TraceRequest>> ParseTrace(std::string_view text);
absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path);

struct ReplayResult {
  std::string policy;
  int64_t capacity_blocks = 0;
  int64_t requests = 0;
  int64_t blocks = 0;      // all blocks of all requests
  int64_t hit_blocks = 0;  // leading cached blocks
  int64_t evictions = 0;
  // Window parts (sliding-window groups) read with the hit blocks; see window_store.h.
  int64_t hit_window_blocks = 0;
  double hit_rate() const { return blocks == 0 ? 0.0 : static_cast<double>(hit_blocks) / blocks; }
};

// The index key of trace block id `id` (a fixed bijective mix, so shards see hash-like keys).
BlockHash TraceBlockHash(uint64_t id);

struct ReplayOptions {
  // The adaptive policy's shadows learn from 1 in 2^learner_halvings times fewer chains than
  // the capacity asks, as the store's learner does over its CPU budget (adaptive_policy.h;
  // bounded as there); other policies ignore it. 0: as the capacity asks.
  int learner_halvings = 0;
};

// InvalidArgument for a non-positive capacity or an unknown policy. Policies "belady" and
// "belady-leaf" are offline (see ReplayBelady, ReplayBeladyLeaf); every other name goes through
// MakeEvictionPolicy.
absl::StatusOr<ReplayResult> ReplayTrace(const std::vector<TraceRequest>& trace,
                                         int64_t capacity_blocks, std::string_view policy,
                                         const ReplayOptions& options = {});

// Belady's offline optimum for this hit rule, the ceiling of every online policy: on a miss
// with the cache full, the cached block whose next use is furthest in the future is evicted,
// unless the incoming block's own next use is even later (then it is not cached). Blocks are
// not leased and not kept leaf-first: a parent's next use is never later than its child's, so
// the rule drops children first anyway. Matches the reference figures of the shared trace's
// README (0.3795 / 0.5534 / 0.6396 at 2k / 6k / 20k blocks).
ReplayResult ReplayBelady(const std::vector<TraceRequest>& trace, int64_t capacity_blocks);

// Policy "belady-leaf": furthest-next-use eviction under the store's own replay rule, the
// ceiling for a leaf-first policy. Leaf-first (a block with a cached child never goes), the
// request's blocks leased while it is replayed, every block inserted (no bypass, as in the
// store: a committed block is indexed); on a miss with the cache full the evictable leaf whose
// next access is furthest goes (next accesses counted in block accesses, so within one request
// the deeper block goes first). Like ReplayBelady a greedy rule, not a proven optimum; on the
// shared trace it is 0.3742 at 2k blocks against ReplayBelady's 0.3795 (see cachestore/README.md).
ReplayResult ReplayBeladyLeaf(const std::vector<TraceRequest>& trace, int64_t capacity_blocks);

// A DRAM tier of `dram_blocks` in front of a disk tier of `disk_blocks` (issue 30), both run by
// the store's own BlockIndex: the DRAM tier by `policy` (as ReplayTrace), the disk tier by LRU
// over single blocks (it sees demotions, not requests). A block the DRAM policy evicts is demoted
// to disk (the disk's LRU block goes when it is full); a request's hits are the leading blocks
// found in either tier, and a hit on disk promotes the block back into DRAM (exclusive tiers: it
// leaves the disk, so the two hold dram + disk distinct blocks). Online policies only.
struct TieredReplayResult {
  ReplayResult total;  // hit_blocks: leading blocks found in DRAM or on disk
  int64_t disk_blocks = 0;
  int64_t dram_hit_blocks = 0;
  int64_t disk_hit_blocks = 0;
  int64_t demotions = 0;       // DRAM -> disk
  int64_t promotions = 0;      // disk -> DRAM
  int64_t disk_evictions = 0;  // dropped from disk
};
absl::StatusOr<TieredReplayResult> ReplayTiered(const std::vector<TraceRequest>& trace,
                                                int64_t dram_blocks, int64_t disk_blocks,
                                                std::string_view policy,
                                                const ReplayOptions& options = {});

// True for the offline policies ReplayTrace runs without an EvictionPolicy ("belady",
// "belady-leaf").
bool IsOfflinePolicy(std::string_view policy);

// Every policy at every capacity (one trace load, results in capacity-major order).
absl::StatusOr<std::vector<ReplayResult>> ReplaySweep(const std::vector<TraceRequest>& trace,
                                                      const std::vector<int64_t>& capacities,
                                                      const std::vector<std::string>& policies,
                                                      const ReplayOptions& options = {});

}  // namespace kvrelay::cachestore::sim
