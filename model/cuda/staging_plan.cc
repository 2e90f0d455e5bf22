#include "model/cuda/staging_plan.h"

#include <algorithm>

#include "common/check.h"

namespace kvrelay::model::cuda {

std::vector<SlotRun> SlotRuns(std::vector<kv::SlotId> slots) {
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  std::vector<SlotRun> runs;
  for (kv::SlotId s : slots) {
    if (s < 0) continue;
    if (!runs.empty() && runs.back().first + runs.back().count == s) {
      ++runs.back().count;
    } else {
      runs.push_back({s, 1});
    }
  }
  return runs;
}

std::vector<kv::SlotId> TouchedSlots(const Sequence& seq, int group, int64_t begin, int64_t end) {
  const int64_t bt = seq.cache().layout().block_tokens();
  const std::vector<kv::SlotId>& table = seq.blocks(group);
  KV_CHECK(begin >= 0 && begin < end && (end - 1) / bt < static_cast<int64_t>(table.size()));
  std::vector<kv::SlotId> slots;
  for (int64_t b = begin / bt; b <= (end - 1) / bt; ++b) {
    if (table[b] >= 0) slots.push_back(table[b]);
  }
  return slots;
}

std::vector<SlotRun> HostOnlyRuns(const Sequence& seq, int group) {
  const std::vector<kv::SlotId>& table = seq.blocks(group);
  const int64_t n = std::min<int64_t>(seq.host_only_blocks(), static_cast<int64_t>(table.size()));
  return SlotRuns(std::vector<kv::SlotId>(table.begin(), table.begin() + n));
}

std::vector<PoolCopy> HostOnlyUploads(const Sequence& seq, int group) {
  const int64_t stride = static_cast<int64_t>(seq.cache().pool(group).slot_stride());
  std::vector<PoolCopy> copies;
  for (const SlotRun& run : HostOnlyRuns(seq, group)) {
    copies.push_back({int64_t{run.first} * stride, run.count * stride, run.count * stride, 1});
  }
  return copies;
}

std::vector<PoolCopy> LayerStripCopies(const KvCache& cache, int32_t layer,
                                       absl::Span<const SlotRun> runs) {
  const int g = cache.group_of_layer(layer);
  const kv::ModelLayout& layout = cache.layout();
  const int64_t layer_bytes = layout.BlockBytes(g) / layout.groups()[g].num_layers();
  const int64_t strip = int64_t{cache.index_in_group(layer)} * layer_bytes;
  const int64_t stride = static_cast<int64_t>(cache.pool(g).slot_stride());
  std::vector<PoolCopy> copies;
  for (const SlotRun& run : runs) {
    copies.push_back({int64_t{run.first} * stride + strip, stride, layer_bytes, run.count});
  }
  return copies;
}

std::vector<PoolCopy> TokenEntryCopies(const KvCache& cache, int group, kv::SlotId slot,
                                       int64_t position) {
  return TokenEntryCopies(cache.layout(), group,
                          static_cast<int64_t>(cache.pool(group).slot_stride()), slot, position);
}

std::vector<PoolCopy> TokenEntryCopies(const kv::ModelLayout& layout, int group,
                                       int64_t slot_stride_bytes, kv::SlotId slot,
                                       int64_t position) {
  const kv::LayerGroup& grp = layout.groups()[group];
  KV_CHECK(grp.kind != kv::LayerKind::kSsmState && slot >= 0);
  const int64_t bt = layout.block_tokens();
  const int64_t t = position % bt;
  const int64_t unit = int64_t{slot} * slot_stride_bytes;
  const int64_t layers = grp.num_layers();
  if (grp.kind == kv::LayerKind::kMlaLatent) {
    // Per layer a plane of block_tokens entries (fp8: latent, tile scales, bf16 rope each).
    const int64_t entry = layout.MlaEntryBytes(group);
    return {{unit + t * entry, bt * entry, entry, layers}};
  }
  const int64_t entry = int64_t{grp.num_kv_heads} * grp.head_dim * kv::DTypeBytes(layout.dtype());
  const int64_t plane = bt * entry;
  if (!layout.IsFp8()) {
    // kNHD: a layer's K and V planes, then the next layer's, back to back (kv/model_layout.h).
    return {{unit + t * entry, plane, entry, 2 * layers}};
  }
  // fp8: each layer strip is its K plane, its V plane, then its scales.
  const int64_t strip = layout.LayerStripBytes(group);
  std::vector<PoolCopy> copies = {{unit + t * entry, strip, entry, layers},
                                  {unit + plane + t * entry, strip, entry, layers}};
  if (t == 0) {
    const int64_t scales = layout.Fp8ScaleOffset(group, 0, 0);
    copies.push_back({unit + scales, strip, strip - scales, layers});
  }
  return copies;
}

std::vector<RowRange> PrefillChunks(int64_t n, int64_t max_rows) {
  KV_CHECK(n > 0 && max_rows > 0);
  std::vector<RowRange> chunks;
  for (int64_t begin = 0; begin < n; begin += max_rows) {
    chunks.push_back({begin, std::min(max_rows, n - begin)});
  }
  return chunks;
}

std::vector<int32_t> BlockTables(absl::Span<const Sequence* const> rows, int32_t max_blocks) {
  KV_CHECK(!rows.empty() && max_blocks > 0);
  const int num_groups = rows[0]->cache().num_groups();
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<int32_t> tables(static_cast<size_t>(num_groups * n * max_blocks), -1);
  for (int g = 0; g < num_groups; ++g) {
    for (int64_t r = 0; r < n; ++r) {
      const std::vector<kv::SlotId>& table = rows[r]->blocks(g);
      const int64_t used = std::min<int64_t>(max_blocks, static_cast<int64_t>(table.size()));
      std::copy(table.begin(), table.begin() + used,
                tables.begin() + (int64_t{g} * n + r) * max_blocks);
    }
  }
  return tables;
}

std::vector<std::vector<size_t>> DecodePasses(absl::Span<Sequence* const> seqs, int64_t max_rows) {
  KV_CHECK(max_rows > 0);
  std::vector<std::vector<size_t>> passes;
  std::vector<bool> placed(seqs.size(), false);
  for (size_t first = 0; first < seqs.size(); ++first) {
    if (placed[first]) continue;
    const KvCache* cache = &seqs[first]->cache();
    std::vector<size_t> members;
    for (size_t i = first; i < seqs.size() && static_cast<int64_t>(members.size()) < max_rows;
         ++i) {
      if (!placed[i] && &seqs[i]->cache() == cache) {
        members.push_back(i);
        placed[i] = true;
      }
    }
    passes.push_back(std::move(members));
  }
  return passes;
}

}  // namespace kvrelay::model::cuda
