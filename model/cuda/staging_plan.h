#pragma once

// Host-side planning of the CUDA runner (cuda_runner.cc), kept free of CUDA so the CPU tests
// (staging_plan_test.cc) check it against the cache contract (KvCache::EntryAddress,
// PrefillOptions::on_layer_done) on machines without a GPU: which bytes move between a host
// KvCache pool and its device mirror, the block tables a CudaBatch carries, how a prefill is
// chunked and a decode batch split into forward passes.
//
// The device mirror keeps every slot at the host pool's offset (slot * pool.slot_stride()), so
// one PoolCopy describes both sides of a copy.

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kv/pool/block_pool.h"
#include "model/kv_cache.h"

namespace kvrelay::model::cuda {

// Bytes [offset + r * pitch, offset + r * pitch + width) for r in [0, height), relative to the
// base of one group's pool (host) and of its mirror (device): a cudaMemcpy2DAsync with this
// pitch on both sides (a plain copy when height is 1).
struct PoolCopy {
  int64_t offset = 0;
  int64_t pitch = 0;
  int64_t width = 0;
  int64_t height = 0;
  friend bool operator==(const PoolCopy&, const PoolCopy&) = default;
};

// Consecutive slots: one contiguous range on both sides.
struct SlotRun {
  kv::SlotId first = 0;
  int64_t count = 0;
  friend bool operator==(const SlotRun&, const SlotRun&) = default;
};

// `slots` sorted, each once, -1 (freed window blocks) dropped, consecutive ones merged.
std::vector<SlotRun> SlotRuns(std::vector<kv::SlotId> slots);

// Slots of group `group` holding positions [begin, end) of `seq` (live ones only).
// REQUIRES: 0 <= begin < end and seq holds blocks for positions < end.
std::vector<kv::SlotId> TouchedSlots(const Sequence& seq, int group, int64_t begin, int64_t end);

// The slots of seq's blocks [0, host_only_blocks()) of group `group`, as runs.
std::vector<SlotRun> HostOnlyRuns(const Sequence& seq, int group);
// The uploads of those blocks: whole units (the bytes AdoptPrefix installed), one copy per
// slot run.
std::vector<PoolCopy> HostOnlyUploads(const Sequence& seq, int group);

// Layer `layer`'s strip [i * layer_bytes, (i + 1) * layer_bytes) of every unit in `runs` of
// the layer's group (i = index_in_group, layer_bytes = BlockBytes / num_layers): what
// on_layer_done(layer) promises is in the host pool. One 2D copy (pitch slot_stride) per run.
std::vector<PoolCopy> LayerStripCopies(const KvCache& cache, int32_t layer,
                                       absl::Span<const SlotRun> runs);

// The entries of the token at `position` of every layer of group `group` (K and V, or the MLA
// entry) in unit `slot`, what a decode step wrote there: one 2D copy, one row per (layer, K/V)
// plane (an fp8 MLA entry holds its scales and rope key). fp8 attention: one 2D copy for the
// K rows and one for the V rows (the scales at the end of each layer strip break the planes'
// even spacing), and at a block's first token (position % block_tokens == 0) a third for the
// scales that token set, every layer's.
// REQUIRES: an attention or MLA group, slot >= 0.
std::vector<PoolCopy> TokenEntryCopies(const KvCache& cache, int group, kv::SlotId slot,
                                       int64_t position);
// The same for units of `layout` slot_stride_bytes apart (what the KvCache overload passes).
std::vector<PoolCopy> TokenEntryCopies(const kv::ModelLayout& layout, int group,
                                       int64_t slot_stride_bytes, kv::SlotId slot,
                                       int64_t position);

// Prefill chunks: [begin, begin + rows) row ranges of at most max_rows, covering [0, n).
struct RowRange {
  int64_t begin = 0;
  int64_t rows = 0;
  friend bool operator==(const RowRange&, const RowRange&) = default;
};
std::vector<RowRange> PrefillChunks(int64_t n, int64_t max_rows);

// The block tables of a CudaBatch with table_groups == number of groups: for each group g and
// row r, tables[(g * rows.size() + r) * max_blocks + b] is rows[r]'s slot for block b of group
// g, -1 past the end of its table (or where a window block was freed).
std::vector<int32_t> BlockTables(absl::Span<const Sequence* const> rows, int32_t max_blocks);

// Decode: the batch's entries split into forward passes, each over one cache (a forward runs
// over one set of device pools) and at most max_rows rows, every entry in exactly one, entries
// in batch order within a pass, passes in order of their first entry.
std::vector<std::vector<size_t>> DecodePasses(absl::Span<Sequence* const> seqs, int64_t max_rows);

}  // namespace kvrelay::model::cuda
