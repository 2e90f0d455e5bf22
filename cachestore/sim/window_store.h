#pragma once

// WindowAwareCache: a byte-budgeted prefix cache that keeps a block's layer groups apart.
//
// For a layout with sliding-window groups (Gemma 3: 52 of 62 layers see only the last 1,024
// tokens), resuming a prefix of n blocks needs the full-attention part of blocks 0..n-1 but the
// window part only of the last `window_blocks` blocks before n. So the window part of an interior
// block (one that is not within window_blocks of the end of a request that touched it) is worth
// nothing unless a later request stops exactly there. This cache stores every block as two
// parts, "full" (full attention, MLA) and "window" (sliding-window groups; an SSM group's state
// snapshot is the same thing with window_blocks = 1), and under memory pressure reclaims window
// parts of interior blocks first (least recently used first), then whole blocks through the
// index's eviction policy (leaf-first, as the cache store evicts).
//
// A match reports per group what is usable: full parts of the leading `full_blocks`, and the
// largest resume point `usable_blocks` <= full_blocks whose preceding window is complete. With
// window_aware = false the parts are never split (every layer treated alike): the baseline.
//
// Not thread-safe (an offline model of the store's accounting; the index under it is the real
// BlockIndex).

#include <cstdint>
#include <queue>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "cachestore/block_index.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/sim/trace_replay.h"

namespace kvrelay::cachestore::sim {

struct BlockParts {
  int64_t full_bytes = 0;     // full-attention / MLA groups, per block
  int64_t window_bytes = 0;   // sliding-window groups (+ SSM state snapshots), per block
  int32_t window_blocks = 0;  // blocks of window needed before a resume point (0: no window part)
};

class WindowAwareCache {
 public:
  struct Match {
    int full_blocks = 0;    // leading blocks whose full part is cached
    int usable_blocks = 0;  // resume point: blocks the worker may skip computing
    int window_from = 0;    // window parts are needed (and cached) for [window_from, usable)
  };
  struct Counters {
    int64_t window_parts_reclaimed = 0;
    int64_t blocks_evicted = 0;
  };

  // REQUIRES: policy outlives this; capacity_bytes > 0; parts.full_bytes + window_bytes > 0.
  WindowAwareCache(const EvictionPolicy* policy, int64_t capacity_bytes, BlockParts parts,
                   bool window_aware);

  Match MatchPrefix(absl::Span<const BlockHash> chain);
  // A request that resumed at match.usable_blocks and computed the rest: every block is
  // accessed; blocks from usable_blocks on get both parts (recomputed); the windows before the
  // chain's end (window_blocks + 1 blocks) and before the match's resume / branch points are
  // kept; other window parts become reclaimable.
  void Access(absl::Span<const BlockHash> chain, const Match& match);

  int64_t used_bytes() const { return used_bytes_; }
  const Counters& counters() const { return counters_; }

 private:
  struct PartState {
    bool window_present = false;
    bool interior = false;       // window part reclaimable first
    bool branch_window = false;  // in the window before a branch point (sticky)
    bool has_child = false;      // a block was stored after this one
    uint64_t tick = 0;           // last access, for LRU order of reclaimable window parts
  };
  bool MakeRoom(int64_t bytes);
  bool ReclaimOneWindowPart();

  const EvictionPolicy* policy_;
  const int64_t capacity_bytes_;
  const BlockParts parts_;
  const bool window_aware_;
  BlockIndex index_;
  absl::flat_hash_map<BlockHash, PartState> parts_state_;
  // Min-heap (tick, hash) of interior window parts; stale entries are skipped on pop.
  std::priority_queue<std::pair<uint64_t, BlockHash>, std::vector<std::pair<uint64_t, BlockHash>>,
                      std::greater<>>
      reclaim_;
  uint64_t tick_ = 0;
  int64_t used_bytes_ = 0;
  Counters counters_;
};

// Replays a trace (as ReplayTrace does) through a WindowAwareCache of `capacity_bytes`:
// hit_blocks counts usable (resumable) blocks; hit_window_blocks the window parts read with them.
// `per_request_hits` (optional) receives each request's usable blocks. InvalidArgument for a
// non-positive capacity, empty parts or an unknown policy ("belady" is not offered here).
absl::StatusOr<ReplayResult> ReplayWindowed(const std::vector<TraceRequest>& trace,
                                            int64_t capacity_bytes, const BlockParts& parts,
                                            bool window_aware, std::string_view policy,
                                            std::vector<int32_t>* per_request_hits = nullptr);

}  // namespace kvrelay::cachestore::sim
