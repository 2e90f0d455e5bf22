// KvCache's hooks for device backends: process-unique ids, device state destroyed with the
// cache while its pools still exist, and Sequence::host_only_blocks (set by AdoptPrefix, left
// alone by the CPU runner).

#include "model/kv_cache.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "model/model_runner.h"
#include "model/test_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model {
namespace {

// Reads every byte of the pool it was given when destroyed: ASan reports a use after free if
// the cache released its pools first.
class PoolReader final : public CacheDeviceState {
 public:
  PoolReader(const kv::BlockPool& pool, bool* destroyed)
      : base_(static_cast<const uint8_t*>(pool.base())),
        bytes_(pool.size_bytes()),
        destroyed_(destroyed) {}
  ~PoolReader() override {
    volatile uint8_t sum = 0;
    for (size_t i = 0; i < bytes_; ++i) sum = static_cast<uint8_t>(sum + base_[i]);
    (void)sum;
    *destroyed_ = true;
  }

 private:
  const uint8_t* base_;
  size_t bytes_;
  bool* destroyed_;
};

class KvCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestModelOptions o;
    o.seed = 3;
    KV_ASSERT_OK(WriteTestModel(dir_.path(), o));
    KV_ASSERT_OK_AND_ASSIGN(runner_, ModelRunner::Load(dir_.path()));
  }
  testing::TempDir dir_;
  std::unique_ptr<ModelRunner> runner_;
};

TEST_F(KvCacheTest, IdsAreUniqueAndNeverReused) {
  KV_ASSERT_OK_AND_ASSIGN(auto a, KvCache::Create(runner_->layout(), 4));
  const uint64_t first = a->id();
  a.reset();
  // Likely at the same address as the first one; never with its id.
  KV_ASSERT_OK_AND_ASSIGN(auto b, KvCache::Create(runner_->layout(), 4));
  KV_ASSERT_OK_AND_ASSIGN(auto c, KvCache::Create(runner_->layout(), 4));
  EXPECT_NE(b->id(), first);
  EXPECT_NE(c->id(), first);
  EXPECT_NE(b->id(), c->id());
}

TEST_F(KvCacheTest, DeviceStateDiesWithTheCacheBeforeItsPools) {
  KV_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(runner_->layout(), 4));
  EXPECT_EQ(cache->device_state(), nullptr);
  bool destroyed = false;
  cache->set_device_state(std::make_shared<PoolReader>(cache->pool(0), &destroyed));
  std::weak_ptr<CacheDeviceState> held = cache->device_state();
  EXPECT_FALSE(held.expired());
  cache.reset();
  EXPECT_TRUE(destroyed);
  EXPECT_TRUE(held.expired());
}

TEST_F(KvCacheTest, AttachDeviceStateKeepsTheFirstOne) {
  KV_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(runner_->layout(), 4));
  bool first_destroyed = false, second_destroyed = false;
  auto first = std::make_shared<PoolReader>(cache->pool(0), &first_destroyed);
  EXPECT_EQ(cache->AttachDeviceState(first), first);
  {
    auto second = std::make_shared<PoolReader>(cache->pool(0), &second_destroyed);
    // A second backend loses the race: it gets the first state back, the first stays attached.
    EXPECT_EQ(cache->AttachDeviceState(second), first);
  }
  EXPECT_TRUE(second_destroyed);
  EXPECT_FALSE(first_destroyed);
  EXPECT_EQ(cache->device_state(), first);
  first.reset();
  EXPECT_FALSE(first_destroyed);  // the cache holds it
  cache.reset();
  EXPECT_TRUE(first_destroyed);
}

TEST_F(KvCacheTest, AdoptPrefixMarksHostOnlyBlocks) {
  const int64_t bt = runner_->layout().block_tokens();
  KV_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(runner_->layout(), 16));
  std::vector<int32_t> tokens;
  for (int i = 0; i < 3 * bt; ++i) tokens.push_back(i % runner_->config().vocab_size);
  Sequence computed(cache.get());
  KV_ASSERT_OK(runner_->Prefill(computed, tokens).status());
  EXPECT_EQ(computed.host_only_blocks(), 0);  // the CPU computes where KV lives
  std::vector<std::vector<kv::SlotId>> blocks(cache->num_groups());
  for (int g = 0; g < cache->num_groups(); ++g) {
    for (int b = 0; b < 2; ++b) {
      KV_ASSERT_OK(cache->pool(g).AddRef(computed.blocks(g)[b]));
      blocks[g].push_back(computed.blocks(g)[b]);
    }
  }
  Sequence adopted(cache.get());
  KV_ASSERT_OK(adopted.AdoptPrefix(absl::MakeConstSpan(tokens).first(2 * bt), blocks));
  EXPECT_EQ(adopted.host_only_blocks(), 2);
  // The CPU runner reads the host pools directly and leaves the mark alone.
  KV_ASSERT_OK(runner_->Prefill(adopted, absl::MakeConstSpan(tokens).subspan(2 * bt)).status());
  EXPECT_EQ(adopted.host_only_blocks(), 2);
  adopted.MarkUploaded();
  EXPECT_EQ(adopted.host_only_blocks(), 0);
}

}  // namespace
}  // namespace kvrelay::model
