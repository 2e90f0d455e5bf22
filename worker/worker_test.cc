#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/presets.h"
#include "model/kv_cache.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"
#include "transfer/inproc/in_process_transport.h"
#include "worker/kv_memory.h"
#include "worker/worker_core.h"

namespace kvrelay::worker {
namespace {

kv::ModelLayout Layout(const char* preset) { return kv::LoadPreset(preset)->layout; }

TEST(BlockWanted, SlidingWindowKeepsOnlyWhatTheFirstQuerySees) {
  kv::ModelLayout layout = Layout("tiny-gemma3");  // window 32, blocks of 16
  const kv::LayerGroup& global = layout.groups()[0];
  const kv::LayerGroup& local = layout.groups()[1];
  ASSERT_EQ(local.kind, kv::LayerKind::kSlidingWindow);
  // First query at position 288: keys 257..288 are visible; block 16 (256..271) holds some,
  // block 15 (240..255) none.
  EXPECT_TRUE(BlockWanted(local, 16, 17, 288));
  EXPECT_TRUE(BlockWanted(local, 16, 16, 288));
  EXPECT_FALSE(BlockWanted(local, 16, 15, 288));
  EXPECT_FALSE(BlockWanted(local, 16, 0, 288));
  for (int64_t b = 0; b < 18; ++b) EXPECT_TRUE(BlockWanted(global, 16, b, 288));
}

// Mamba: only the state after the last pushed block is wanted; the cache's SSM slots are one
// whole state each, and a layer's slice is that layer's state.
TEST(BlockWanted, SsmStateWantsOnlyTheLastPushedBlock) {
  kv::ModelLayout layout = Layout("tiny-mamba");
  const kv::LayerGroup& ssm = layout.groups()[0];
  ASSERT_EQ(ssm.kind, kv::LayerKind::kSsmState);
  for (int64_t b = 0; b < 17; ++b) EXPECT_EQ(BlockWanted(ssm, 16, b, 288), b == 17) << b;
  EXPECT_TRUE(BlockWanted(ssm, 16, 17, 288));
  KV_ASSERT_OK_AND_ASSIGN(auto transport, transfer::MakeInProcessTransport());
  KV_ASSERT_OK_AND_ASSIGN(auto kv, RegisteredKvCache::Create(layout, 4, transport.get()));
  EXPECT_EQ(kv->cache().pool(0).slot_bytes(), static_cast<size_t>(layout.BlockBytes(0)));
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    const LayerSlice slice = SliceOfLayer(layout, kv->cache(), layer);
    EXPECT_EQ(slice.offset_in_unit, static_cast<uint64_t>(layer * ssm.state_bytes));
    EXPECT_EQ(slice.length, static_cast<uint64_t>(ssm.state_bytes));
  }
}

TEST(CacheSegment, StoresAndLoadsWholeBlocksAcrossGroups) {
  kv::ModelLayout layout = Layout("tiny-gemma3");
  KV_ASSERT_OK_AND_ASSIGN(auto transport, transfer::MakeInProcessTransport());
  KV_ASSERT_OK_AND_ASSIGN(auto kv, RegisteredKvCache::Create(layout, 8, transport.get()));
  KV_ASSERT_OK_AND_ASSIGN(auto segment, CacheSegment::Create(layout, 4, transport.get()));
  EXPECT_EQ(segment->block_bytes(),
            static_cast<uint64_t>(layout.BlockBytes(0) + layout.BlockBytes(1)));

  model::Sequence seq(&kv->cache());
  KV_ASSERT_OK(seq.EnsureBlocks(32));  // two blocks per group
  for (int g = 0; g < 2; ++g) {
    for (int b = 0; b < 2; ++b) {
      std::memset(kv->cache().pool(g).SlotAddress(seq.blocks(g)[b]), 10 * g + b + 1,
                  static_cast<size_t>(layout.BlockBytes(g)));
    }
  }
  KV_ASSERT_OK(segment->StoreBlock(seq, 1, 3));
  EXPECT_EQ(segment->GroupUnit(3, 0)[0], 2);
  EXPECT_EQ(segment->GroupUnit(3, 1)[layout.BlockBytes(1) - 1], 12);

  std::vector<std::vector<kv::SlotId>> loaded;
  KV_ASSERT_OK(segment->LoadBlock(3, kv->cache(), loaded));
  ASSERT_EQ(loaded.size(), 2u);
  for (int g = 0; g < 2; ++g) {
    const uint8_t* p = static_cast<uint8_t*>(kv->cache().pool(g).SlotAddress(loaded[g][0]));
    EXPECT_EQ(p[0], 10 * g + 2);
    EXPECT_EQ(std::memcmp(p, segment->GroupUnit(3, g), static_cast<size_t>(layout.BlockBytes(g))),
              0);
    KV_ASSERT_OK(kv->cache().pool(g).Release(loaded[g][0]));
  }
  EXPECT_THAT(segment->StoreBlock(seq, 5, 0),
              testing::StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(segment->StoreBlock(seq, 0, 9),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(MemoryKeyScope, ParsesItsThreeNamesAndRefusesOthers) {
  for (MemoryKeyScope scope :
       {MemoryKeyScope::kAuto, MemoryKeyScope::kReservation, MemoryKeyScope::kPool}) {
    KV_ASSERT_OK_AND_ASSIGN(MemoryKeyScope parsed, ParseMemoryKeyScope(MemoryKeyScopeName(scope)));
    EXPECT_EQ(parsed, scope);
  }
  EXPECT_THAT(
      ParseMemoryKeyScope("connection"),
      testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("'connection'")));
}

// A private pool (memory keys per reservation) needs a transport with private regions.
TEST(MemoryKeyScope, PrivatePoolsNeedPrivateRegions) {
  kv::ModelLayout layout = Layout("tiny-gemma3");
  KV_ASSERT_OK_AND_ASSIGN(auto transport, transfer::MakeInProcessTransport());
  EXPECT_FALSE(transport->capabilities().private_regions);
  EXPECT_THAT(RegisteredKvCache::Create(layout, 8, transport.get(), /*private_memory=*/true),
              testing::StatusIs(absl::StatusCode::kUnimplemented));
}

TEST(SliceOfLayer, LayersAreContiguousInsideAUnit) {
  kv::ModelLayout layout = Layout("tiny-llama");
  KV_ASSERT_OK_AND_ASSIGN(auto cache, model::KvCache::Create(layout, 2));
  uint64_t expected_offset = 0;
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    LayerSlice s = SliceOfLayer(layout, *cache, layer);
    EXPECT_EQ(s.offset_in_unit, expected_offset);
    expected_offset += s.length;
  }
  EXPECT_EQ(expected_offset, static_cast<uint64_t>(layout.BlockBytes(0)));
}

// Every preset's stage plan is accepted by the disk tier (each block byte in exactly one stage)
// and cuts by whole layers in order: a layer's stage is never before an earlier layer's.
TEST(PlanDiskStages, EveryPresetIsCutIntoLayerStagesTheTierAccepts) {
  KV_ASSERT_OK_AND_ASSIGN(auto transport, transfer::MakeInProcessTransport());
  for (const std::string& name : kv::PresetNames()) {
    absl::StatusOr<kv::ModelConfig> config = kv::LoadPreset(name);
    ASSERT_TRUE(config.ok()) << name;
    const kv::ModelLayout& layout = config->layout;
    if (layout.BlockBytes(0) > (int64_t{64} << 20)) continue;  // keep the pools small
    KV_ASSERT_OK_AND_ASSIGN(auto cache, model::KvCache::Create(layout, 1));
    KV_ASSERT_OK_AND_ASSIGN(auto segment, CacheSegment::Create(layout, 1, transport.get()));
    const DiskStagePlan plan = PlanDiskStages(*segment, *cache, kDiskStages);
    EXPECT_EQ(plan.stages.size(),
              static_cast<size_t>(std::min<int32_t>(kDiskStages, layout.num_layers())))
        << name;
    ASSERT_EQ(plan.stage_of_layer.size(), static_cast<size_t>(layout.num_layers())) << name;
    EXPECT_EQ(plan.stage_of_layer.front(), 0) << name;
    EXPECT_EQ(plan.stage_of_layer.back(), static_cast<int>(plan.stages.size()) - 1) << name;
    for (size_t l = 1; l < plan.stage_of_layer.size(); ++l) {
      EXPECT_LE(plan.stage_of_layer[l - 1], plan.stage_of_layer[l]) << name << " layer " << l;
    }
    testing::TempDir dir;
    kv::DiskTierOptions tier;
    tier.directory = dir.path();
    tier.block_bytes = segment->block_bytes();
    tier.capacity_bytes = 2 * (kv::DiskTier::kHeaderBytes + segment->block_bytes() + 4096);
    tier.layout = layout.fingerprint();
    tier.stages = plan.stages;
    tier.preallocate = false;
    EXPECT_TRUE(kv::DiskTier::Open(tier).ok()) << name << ": " << kv::DiskTier::Open(tier).status();
  }
}

}  // namespace
}  // namespace kvrelay::worker
