// The CUDA runner's host-side plan against the cache contract, on the CPU: a copy the plan
// describes is applied with memcpy between a host pool and a stand-in for its device mirror
// (plain memory at the same offsets), and the bytes it moved must be exactly the ones
// KvCache::EntryAddress names (a layer strip for on_layer_done, one token's entries for
// decode, whole units for an adopted prefix): never a byte of another layer, token or slot,
// never outside the pool. Block tables, prefill chunks and decode passes are checked value by
// value, freed sliding-window blocks included.

#include "model/cuda/staging_plan.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kv/model_layout.h"
#include "model/kv_cache.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::model::cuda {
namespace {

kv::LayerGroup Attention(std::vector<int32_t> layers, int32_t heads, int32_t head_dim,
                         int32_t window = 0) {
  kv::LayerGroup g;
  g.kind = window > 0 ? kv::LayerKind::kSlidingWindow : kv::LayerKind::kFullAttention;
  g.layer_ids = std::move(layers);
  g.num_kv_heads = heads;
  g.head_dim = head_dim;
  g.window_tokens = window;
  return g;
}

// GQA in bf16 (units of 576 bytes in 768-byte slots: padding between units), a full-attention
// and a sliding-window group with interleaved layers in fp32, and MLA in bf16.
std::vector<kv::ModelLayout> Layouts() {
  kv::LayerGroup mla;
  mla.kind = kv::LayerKind::kMlaLatent;
  mla.layer_ids = {0, 1};
  mla.latent_dim = 8;
  mla.rope_dim = 4;
  std::vector<kv::ModelLayout> out;
  for (auto made :
       {kv::ModelLayout::Create("gqa", kv::DType::kBf16, 4, {Attention({0, 1, 2}, 2, 6)}),
        kv::ModelLayout::Create("mixed", kv::DType::kFp32, 3,
                                {Attention({0, 2}, 1, 4), Attention({1, 3}, 2, 2, 5)}),
        kv::ModelLayout::Create("mla", kv::DType::kBf16, 4, {mla})}) {
    EXPECT_TRUE(made.ok()) << made.status();
    out.push_back(*made);
  }
  return out;
}

int64_t EntryBytes(const kv::ModelLayout& layout, int g) {
  const kv::LayerGroup& grp = layout.groups()[g];
  const int64_t elements = grp.kind == kv::LayerKind::kMlaLatent
                               ? int64_t{grp.latent_dim} + grp.rope_dim
                               : int64_t{grp.num_kv_heads} * grp.head_dim;
  return elements * kv::DTypeBytes(layout.dtype());
}

// Which of a pool's `size` bytes `copies` touch; fails the test on a byte outside the pool or
// a row wider than its pitch (cudaMemcpy2D refuses those).
std::vector<bool> MovedBytes(int64_t size, const std::vector<PoolCopy>& copies) {
  std::vector<bool> moved(static_cast<size_t>(size), false);
  for (const PoolCopy& c : copies) {
    EXPECT_GT(c.width, 0);
    EXPECT_GT(c.height, 0);
    EXPECT_GE(c.offset, 0);
    if (c.height > 1) {
      EXPECT_LE(c.width, c.pitch);
    }
    EXPECT_LE(c.offset + (c.height - 1) * c.pitch + c.width, size) << "copy leaves the pool";
    for (int64_t r = 0; r < c.height; ++r) {
      for (int64_t i = 0; i < c.width; ++i) {
        const int64_t at = c.offset + r * c.pitch + i;
        if (at >= 0 && at < size) moved[static_cast<size_t>(at)] = true;
      }
    }
  }
  return moved;
}

std::vector<bool> Moved(const KvCache& cache, int g, const std::vector<PoolCopy>& copies) {
  return MovedBytes(static_cast<int64_t>(cache.pool(g).size_bytes()), copies);
}

void Mark(const KvCache& cache, int g, const uint8_t* entry, int64_t bytes,
          std::vector<bool>& mask) {
  const int64_t at = entry - static_cast<const uint8_t*>(cache.pool(g).base());
  for (int64_t i = 0; i < bytes; ++i) mask[static_cast<size_t>(at + i)] = true;
}

// Bytes of layer `layer`'s entries in `slot`, for the tokens of the block, per EntryAddress.
void MarkLayer(const KvCache& cache, int32_t layer, kv::SlotId slot, std::vector<bool>& mask) {
  const int g = cache.group_of_layer(layer);
  const bool mla = cache.layout().groups()[g].kind == kv::LayerKind::kMlaLatent;
  for (int32_t t = 0; t < cache.layout().block_tokens(); ++t) {
    for (int kv = 0; kv < (mla ? 1 : 2); ++kv) {
      Mark(cache, g, cache.EntryAddress(layer, slot, t, kv), EntryBytes(cache.layout(), g), mask);
    }
  }
}

// Applies `copies` from a stand-in device image to group g's host pool, as cudaMemcpy2D does.
void Apply(const std::vector<PoolCopy>& copies, const std::vector<uint8_t>& device, uint8_t* host) {
  for (const PoolCopy& c : copies) {
    for (int64_t r = 0; r < c.height; ++r) {
      std::memcpy(host + c.offset + r * c.pitch, device.data() + c.offset + r * c.pitch,
                  static_cast<size_t>(c.width));
    }
  }
}

// Allocates n slots of group g, then frees every other one of a first batch so the ones it
// returns are not all consecutive.
std::vector<kv::SlotId> FragmentedSlots(KvCache& cache, int g, int64_t n) {
  std::vector<kv::SlotId> spacers, slots;
  for (int64_t i = 0; i < 2 * n; ++i) {
    absl::StatusOr<kv::SlotId> s = cache.pool(g).Allocate();
    EXPECT_TRUE(s.ok()) << s.status();
    (i % 3 == 1 ? slots : spacers).push_back(*s);
  }
  while (static_cast<int64_t>(slots.size()) < n) {
    slots.push_back(spacers.back());
    spacers.pop_back();
  }
  for (kv::SlotId s : spacers) EXPECT_TRUE(cache.pool(g).Release(s).ok());
  slots.resize(static_cast<size_t>(n));
  return slots;
}

TEST(SlotRunsTest, SortsDropsFreedAndMerges) {
  EXPECT_EQ(SlotRuns({}), std::vector<SlotRun>{});
  EXPECT_EQ(SlotRuns({-1, -1}), std::vector<SlotRun>{});
  EXPECT_EQ(SlotRuns({7, 3, 4, -1, 5, 9, 4, 10, 0}),
            (std::vector<SlotRun>{{0, 1}, {3, 3}, {7, 1}, {9, 2}}));
}

TEST(PrefillChunksTest, CoverEveryRowOnceInOrder) {
  EXPECT_EQ(PrefillChunks(5, 2), (std::vector<RowRange>{{0, 2}, {2, 2}, {4, 1}}));
  EXPECT_EQ(PrefillChunks(4, 4), (std::vector<RowRange>{{0, 4}}));
  EXPECT_EQ(PrefillChunks(3, 2048), (std::vector<RowRange>{{0, 3}}));
}

class StagingPlanTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    layout_ = Layouts()[GetParam()];
    KV_ASSERT_OK_AND_ASSIGN(cache_, KvCache::Create(layout_, 40));
  }
  kv::ModelLayout layout_;
  std::unique_ptr<KvCache> cache_;
};

// on_layer_done(L)'s promise: in every unit holding a new token, layer L's strip (and only it)
// came back; run over every layer, the whole of each touched unit, nothing of any other slot.
TEST_P(StagingPlanTest, LayerStripsAreExactlyTheLayersEntries) {
  const int64_t bt = layout_.block_tokens();
  Sequence seq(cache_.get());
  KV_ASSERT_OK(seq.EnsureBlocks(3 * bt + 1));
  // A prefill of [bt + 1, 3 * bt + 1): blocks 1 to 3 hold new tokens, block 0 does not.
  for (int g = 0; g < cache_->num_groups(); ++g) {
    const std::vector<kv::SlotId> touched = TouchedSlots(seq, g, bt + 1, 3 * bt + 1);
    ASSERT_EQ(touched.size(), 3u);
    for (int b = 0; b < 3; ++b) EXPECT_EQ(touched[b], seq.blocks(g)[b + 1]);
    const std::vector<SlotRun> runs = SlotRuns(touched);
    std::vector<bool> all(cache_->pool(g).size_bytes(), false);
    for (int32_t layer : layout_.groups()[g].layer_ids) {
      std::vector<bool> expected(cache_->pool(g).size_bytes(), false);
      for (kv::SlotId s : touched) MarkLayer(*cache_, layer, s, expected);
      const std::vector<bool> moved = Moved(*cache_, g, LayerStripCopies(*cache_, layer, runs));
      EXPECT_EQ(moved, expected) << "group " << g << " layer " << layer;
      for (size_t i = 0; i < all.size(); ++i) all[i] = all[i] || moved[i];
    }
    const int64_t stride = static_cast<int64_t>(cache_->pool(g).slot_stride());
    for (int64_t at = 0; at < static_cast<int64_t>(all.size()); ++at) {
      const kv::SlotId slot = static_cast<kv::SlotId>(at / stride);
      const bool in_unit = at % stride < layout_.BlockBytes(g);
      const bool is_touched = std::find(touched.begin(), touched.end(), slot) != touched.end();
      ASSERT_EQ(all[static_cast<size_t>(at)], in_unit && is_touched)
          << "group " << g << " byte " << at << " of slot " << slot;
    }
  }
}

// Decode's staging: one token's entries of every layer of the group, at any position in the
// block; applied, the host pool holds the device's bytes there and its own everywhere else.
TEST_P(StagingPlanTest, TokenEntryCopyIsExactlyTheTokensEntries) {
  const int64_t bt = layout_.block_tokens();
  for (int g = 0; g < cache_->num_groups(); ++g) {
    KV_ASSERT_OK_AND_ASSIGN(kv::SlotId slot, cache_->pool(g).Allocate());
    kv::BlockPool& pool = cache_->pool(g);
    for (int64_t pos = 5 * bt; pos < 6 * bt; ++pos) {
      const int32_t t = static_cast<int32_t>(pos % bt);
      const std::vector<PoolCopy> copies = TokenEntryCopies(*cache_, g, slot, pos);
      ASSERT_EQ(copies.size(), 1u) << "one 2D copy outside fp8";
      const PoolCopy& copy = copies[0];
      std::vector<bool> expected(pool.size_bytes(), false);
      for (int32_t layer : layout_.groups()[g].layer_ids) {
        const bool mla = layout_.groups()[g].kind == kv::LayerKind::kMlaLatent;
        for (int kv = 0; kv < (mla ? 1 : 2); ++kv) {
          Mark(*cache_, g, cache_->EntryAddress(layer, slot, t, kv), EntryBytes(layout_, g),
               expected);
        }
      }
      EXPECT_EQ(Moved(*cache_, g, {copy}), expected) << "group " << g << " position " << pos;

      std::vector<uint8_t> device(pool.size_bytes());
      for (size_t i = 0; i < device.size(); ++i) device[i] = static_cast<uint8_t>(i * 7 + 1);
      auto* host = static_cast<uint8_t*>(pool.base());
      std::memset(host, 0xEE, pool.size_bytes());
      Apply({copy}, device, host);
      for (size_t i = 0; i < device.size(); ++i) {
        ASSERT_EQ(host[i], expected[i] ? device[i] : 0xEE) << "group " << g << " byte " << i;
      }
    }
  }
}

// An adopted prefix on scattered slots, window blocks freed (-1): whole units of exactly the
// live adopted slots go up, no other slot's bytes.
TEST_P(StagingPlanTest, HostOnlyUploadsAreTheAdoptedUnits) {
  const int64_t bt = layout_.block_tokens();
  const int64_t n_blocks = 6;
  std::vector<std::vector<kv::SlotId>> blocks;
  for (int g = 0; g < cache_->num_groups(); ++g) {
    blocks.push_back(FragmentedSlots(*cache_, g, n_blocks));
    if (layout_.groups()[g].kind == kv::LayerKind::kSlidingWindow) {
      // Outside the window of the next token: freed before adoption.
      KV_ASSERT_OK(cache_->pool(g).Release(blocks[g][0]));
      blocks[g][0] = -1;
    }
  }
  const std::vector<std::vector<kv::SlotId>> adopted = blocks;
  Sequence seq(cache_.get());
  KV_ASSERT_OK(seq.AdoptPrefix(std::vector<int32_t>(n_blocks * bt, 1), blocks));
  KV_ASSERT_OK(seq.EnsureBlocks(n_blocks * bt + 1));  // a block past the prefix: not uploaded
  for (int g = 0; g < cache_->num_groups(); ++g) {
    const int64_t stride = static_cast<int64_t>(cache_->pool(g).slot_stride());
    const std::vector<bool> moved = Moved(*cache_, g, HostOnlyUploads(seq, g));
    for (int64_t at = 0; at < static_cast<int64_t>(moved.size()); ++at) {
      const kv::SlotId slot = static_cast<kv::SlotId>(at / stride);
      const bool is_adopted =
          std::find(adopted[g].begin(), adopted[g].end(), slot) != adopted[g].end();
      if (at % stride < layout_.BlockBytes(g)) {
        ASSERT_EQ(moved[static_cast<size_t>(at)], is_adopted)
            << "group " << g << " byte " << at << " of slot " << slot;
      } else if (!is_adopted) {
        ASSERT_FALSE(moved[static_cast<size_t>(at)]) << "padding of slot " << slot;
      }
    }
  }
  seq.MarkUploaded();
  for (int g = 0; g < cache_->num_groups(); ++g) EXPECT_TRUE(HostOnlyUploads(seq, g).empty());
}

// Per group and row, the row's own table, -1 past its end and where a window block was freed.
TEST_P(StagingPlanTest, BlockTablesPerGroupAndRow) {
  const int64_t bt = layout_.block_tokens();
  Sequence a(cache_.get()), b(cache_.get());
  KV_ASSERT_OK(a.EnsureBlocks(4 * bt));
  a.AppendTokens(std::vector<int32_t>(4 * bt, 1));
  a.FreeBlocksOutsideWindow();
  KV_ASSERT_OK(b.EnsureBlocks(bt + 1));
  const int32_t max_blocks = 5;
  const std::vector<const Sequence*> rows = {&a, &b, &a};
  const std::vector<int32_t> tables = BlockTables(rows, max_blocks);
  ASSERT_EQ(tables.size(), static_cast<size_t>(cache_->num_groups()) * rows.size() * max_blocks);
  for (int g = 0; g < cache_->num_groups(); ++g) {
    for (size_t r = 0; r < rows.size(); ++r) {
      const std::vector<kv::SlotId>& own = rows[r]->blocks(g);
      for (int32_t blk = 0; blk < max_blocks; ++blk) {
        const int32_t want = blk < static_cast<int32_t>(own.size()) ? own[blk] : -1;
        EXPECT_EQ(tables[(g * rows.size() + r) * max_blocks + blk], want)
            << "group " << g << " row " << r << " block " << blk;
      }
    }
    if (layout_.groups()[g].kind == kv::LayerKind::kSlidingWindow) {
      EXPECT_EQ(tables[(g * rows.size()) * max_blocks], -1) << "freed window block";
      // A prefill after the freeing touches only live blocks.
      KV_ASSERT_OK(a.EnsureBlocks(4 * bt + 2));
      for (kv::SlotId s : TouchedSlots(a, g, 4 * bt, 4 * bt + 2)) EXPECT_GE(s, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, StagingPlanTest, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return Layouts()[info.param].model_id();
                         });

// fp8 decode staging, from kv/model_layout.h's byte offsets (no KvCache: the layout alone
// places the bytes): K and V rows of the token in every layer strip and, at a block's first
// token only, every strip's scales, never a byte of another token or slot. Units in slots with
// padding between them; MLA entries carry their scales and rope key with them.
TEST(Fp8TokenEntryCopiesTest, TheTokensValuesAndItsBlocksScalesAtTheFirstToken) {
  kv::LayerGroup attention = Attention({0, 1, 2}, 2, 6);
  kv::LayerGroup mla;
  mla.kind = kv::LayerKind::kMlaLatent;
  mla.layer_ids = {0, 1};
  mla.latent_dim = 130;
  mla.rope_dim = 4;
  for (const kv::LayerGroup& g : {attention, mla}) {
    KV_ASSERT_OK_AND_ASSIGN(kv::ModelLayout layout,
                            kv::ModelLayout::Create("fp8", kv::DType::kFp8, 4, {g}));
    const int64_t bt = 4, stride = layout.BlockBytes(0) + 24, slots = 3, slot = 1;
    for (int64_t pos = 8; pos < 12; ++pos) {
      const int64_t t = pos % bt;
      std::vector<bool> expected(static_cast<size_t>(slots * stride), false);
      auto mark = [&](int64_t at, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
          expected[static_cast<size_t>(slot * stride + at + i)] = true;
      };
      for (int64_t li = 0; li < g.num_layers(); ++li) {
        if (g.kind == kv::LayerKind::kMlaLatent) {
          const int64_t entry = layout.MlaEntryBytes(0);
          EXPECT_EQ(entry, 130 + 2 * 4 + 4 * 2);
          mark((li * bt + t) * entry, entry);
          continue;
        }
        const int64_t strip = layout.LayerStripBytes(0), values = 2 * 6;  // bytes per token
        EXPECT_EQ(strip, 2 * bt * values + 2 * 2 * 4);
        mark(li * strip + t * values, values);               // K
        mark(li * strip + (bt + t) * values, values);        // V
        if (t == 0) mark(li * strip + 2 * bt * values, 16);  // K and V scales, 2 heads each
      }
      const std::vector<PoolCopy> copies = TokenEntryCopies(layout, 0, stride, slot, pos);
      EXPECT_EQ(MovedBytes(slots * stride, copies), expected)
          << kv::LayerKindName(g.kind) << " position " << pos;
    }
  }
}

// Every entry in exactly one pass, each pass one cache and at most max_rows rows, batch order
// inside a pass.
TEST(DecodePassesTest, OneCachePerPassAtMostMaxRows) {
  const std::vector<kv::ModelLayout> layouts = Layouts();
  KV_ASSERT_OK_AND_ASSIGN(auto c1, KvCache::Create(layouts[0], 8));
  KV_ASSERT_OK_AND_ASSIGN(auto c2, KvCache::Create(layouts[0], 8));
  Sequence a(c1.get()), b(c2.get()), c(c1.get()), d(c1.get()), e(c2.get());
  std::vector<Sequence*> seqs = {&a, &b, &c, &d, &e};
  EXPECT_EQ(DecodePasses(seqs, 2), (std::vector<std::vector<size_t>>{{0, 2}, {1, 4}, {3}}));
  EXPECT_EQ(DecodePasses(seqs, 8), (std::vector<std::vector<size_t>>{{0, 2, 3}, {1, 4}}));
  EXPECT_EQ(DecodePasses(seqs, 1), (std::vector<std::vector<size_t>>{{0}, {1}, {2}, {3}, {4}}));
}

}  // namespace
}  // namespace kvrelay::model::cuda
