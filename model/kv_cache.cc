#include "model/kv_cache.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"

namespace kvrelay::model {
namespace {

std::atomic<uint64_t> next_cache_id{1};

}  // namespace

KvCache::KvCache(kv::ModelLayout layout)
    : layout_(std::move(layout)), id_(next_cache_id.fetch_add(1, std::memory_order_relaxed)) {}

std::shared_ptr<CacheDeviceState> KvCache::device_state() const {
  absl::MutexLock lock(&device_state_mu_);
  return device_state_;
}

void KvCache::set_device_state(std::shared_ptr<CacheDeviceState> state) const {
  absl::MutexLock lock(&device_state_mu_);
  device_state_ = std::move(state);
}

std::shared_ptr<CacheDeviceState> KvCache::AttachDeviceState(
    std::shared_ptr<CacheDeviceState> state) const {
  absl::MutexLock lock(&device_state_mu_);
  if (device_state_ == nullptr) device_state_ = std::move(state);
  return device_state_;
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const kv::ModelLayout& layout,
                                                         int64_t blocks_per_group) {
  if (blocks_per_group <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv cache: blocks_per_group must be positive, got ", blocks_per_group));
  }
  std::unique_ptr<KvCache> cache(new KvCache(layout));
  for (int g = 0; g < static_cast<int>(layout.groups().size()); ++g) {
    kv::BlockPoolOptions options;
    options.slot_bytes = static_cast<size_t>(layout.BlockBytes(g));
    options.num_slots = blocks_per_group;
    if (options.slot_bytes == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv cache: group ", g, " has no per-token cache (",
                       std::string(kv::LayerKindName(layout.groups()[g].kind)), ")"));
    }
    KV_ASSIGN_OR_RETURN(std::unique_ptr<kv::BlockPool> pool,
                        kv::BlockPool::Create(options, kv::MakeHostMemoryResource(false)));
    cache->pools_.push_back(pool.get());
    cache->owned_pools_.push_back(std::move(pool));
  }
  KV_RETURN_IF_ERROR(cache->Init());
  return cache;
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Wrap(const kv::ModelLayout& layout,
                                                       std::vector<kv::BlockPool*> pools) {
  if (pools.size() != layout.groups().size()) {
    return absl::InvalidArgumentError(absl::StrCat("kv cache: layout has ", layout.groups().size(),
                                                   " groups, got ", pools.size(), " pools"));
  }
  for (size_t g = 0; g < pools.size(); ++g) {
    if (pools[g] == nullptr || pools[g]->memory_kind() == kv::MemoryKind::kDevice ||
        pools[g]->slot_bytes() != static_cast<size_t>(layout.BlockBytes(static_cast<int>(g)))) {
      return absl::InvalidArgumentError(absl::StrCat("kv cache: pool for group ", g,
                                                     " must be host memory with slot_bytes ",
                                                     layout.BlockBytes(static_cast<int>(g))));
    }
  }
  std::unique_ptr<KvCache> cache(new KvCache(layout));
  cache->pools_ = std::move(pools);
  KV_RETURN_IF_ERROR(cache->Init());
  return cache;
}

absl::Status KvCache::Init() {
  layer_group_.assign(layout_.num_layers(), -1);
  layer_index_.assign(layout_.num_layers(), -1);
  for (int g = 0; g < static_cast<int>(layout_.groups().size()); ++g) {
    const kv::LayerGroup& group = layout_.groups()[g];
    for (int i = 0; i < group.num_layers(); ++i) {
      layer_group_[group.layer_ids[i]] = g;
      layer_index_[group.layer_ids[i]] = i;
    }
  }
  for (int32_t l = 0; l < layout_.num_layers(); ++l) {
    if (layer_group_[l] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("kv cache: layer ", l, " is in no group"));
    }
  }
  return absl::OkStatus();
}

uint8_t* KvCache::EntryAddress(int32_t layer, kv::SlotId slot, int32_t token_in_block,
                               int kv) const {
  const int g = layer_group_[layer];
  const int64_t li = layer_index_[layer];
  const kv::LayerGroup& group = layout_.groups()[g];
  const int64_t bt = layout_.block_tokens();
  uint8_t* unit = static_cast<uint8_t*>(pools_[g]->SlotAddress(slot));
  if (group.kind == kv::LayerKind::kMlaLatent) {
    return unit + (li * bt + token_in_block) * layout_.MlaEntryBytes(g);
  }
  // A layer's strip holds K then V, [bt][heads][head_dim] each (then the scales, for fp8).
  const int64_t per_token = int64_t{group.num_kv_heads} * group.head_dim;
  return unit + li * layout_.LayerStripBytes(g) +
         (kv * bt + token_in_block) * per_token * kv::DTypeBytes(layout_.dtype());
}

uint8_t* KvCache::Fp8ScaleAddress(int32_t layer, kv::SlotId slot, int kv, int32_t kv_head) const {
  const int g = layer_group_[layer];
  KV_DCHECK(layout_.IsFp8() && layout_.groups()[g].IsAttention());
  return static_cast<uint8_t*>(pools_[g]->SlotAddress(slot)) +
         layer_index_[layer] * layout_.LayerStripBytes(g) + layout_.Fp8ScaleOffset(g, kv, kv_head);
}

Sequence::Sequence(KvCache* cache) : cache_(cache), blocks_(cache->num_groups()) {}

Sequence::~Sequence() { ReleaseAll(); }

void Sequence::ReleaseAll() {
  for (int g = 0; g < static_cast<int>(blocks_.size()); ++g) {
    for (kv::SlotId slot : blocks_[g]) {
      if (slot >= 0) (void)cache_->pool(g).Release(slot);
    }
    blocks_[g].clear();
  }
  tokens_.clear();
  host_only_blocks_ = 0;
}

absl::Status Sequence::AdoptPrefix(absl::Span<const int32_t> tokens,
                                   std::vector<std::vector<kv::SlotId>> blocks) {
  if (!tokens_.empty()) {
    return absl::FailedPreconditionError("AdoptPrefix: the sequence already holds tokens");
  }
  const kv::ModelLayout& layout = cache_->layout();
  const int64_t bt = layout.block_tokens();
  if (static_cast<int64_t>(tokens.size()) % bt != 0) {
    return absl::InvalidArgumentError(absl::StrCat("AdoptPrefix: prefix of ", tokens.size(),
                                                   " tokens is not a whole number of ", bt,
                                                   "-token blocks"));
  }
  if (blocks.size() != blocks_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("AdoptPrefix: ", blocks.size(),
                                                   " block lists for ", blocks_.size(), " groups"));
  }
  const int64_t n_blocks = static_cast<int64_t>(tokens.size()) / bt;
  for (int g = 0; g < static_cast<int>(blocks.size()); ++g) {
    const kv::LayerGroup& group = layout.groups()[g];
    if (static_cast<int64_t>(blocks[g].size()) != n_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AdoptPrefix: group ", g, " has ", blocks[g].size(), " blocks, prefix needs ", n_blocks));
    }
    // Blocks a later token can still attend to must be present.
    const int64_t first_needed =
        group.kind == kv::LayerKind::kSlidingWindow
            ? std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - group.window_tokens + 1) /
                  bt
            : 0;
    for (int64_t b = 0; b < n_blocks; ++b) {
      const kv::SlotId slot = blocks[g][b];
      if (slot >= cache_->pool(g).num_slots() || (slot < 0 && b >= first_needed)) {
        return absl::InvalidArgumentError(
            absl::StrCat("AdoptPrefix: group ", g, " block ", b, " has bad slot ", slot));
      }
    }
  }
  tokens_.assign(tokens.begin(), tokens.end());
  blocks_ = std::move(blocks);
  host_only_blocks_ = n_blocks;
  return absl::OkStatus();
}

int64_t Sequence::FreeBlocksOutsideWindow() {
  const kv::ModelLayout& layout = cache_->layout();
  const int64_t bt = layout.block_tokens();
  int64_t freed = 0;
  for (int g = 0; g < static_cast<int>(blocks_.size()); ++g) {
    const kv::LayerGroup& group = layout.groups()[g];
    if (group.kind != kv::LayerKind::kSlidingWindow) continue;
    // The next token (position num_tokens) attends to positions >= num_tokens - window + 1.
    const int64_t oldest_needed = num_tokens() - group.window_tokens + 1;
    if (oldest_needed <= 0) continue;
    const int64_t whole_blocks = oldest_needed / bt;  // blocks ending before oldest_needed
    for (int64_t b = 0; b < whole_blocks && b < static_cast<int64_t>(blocks_[g].size()); ++b) {
      if (blocks_[g][b] >= 0) {
        (void)cache_->pool(g).Release(blocks_[g][b]);
        blocks_[g][b] = -1;
        ++freed;
      }
    }
  }
  return freed;
}

int64_t Sequence::LiveBlocks(int group) const {
  int64_t n = 0;
  for (kv::SlotId s : blocks_[group]) n += s >= 0 ? 1 : 0;
  return n;
}

absl::Status Sequence::EnsureBlocks(int64_t end_tokens) {
  const int64_t bt = cache_->layout().block_tokens();
  const int64_t needed = (end_tokens + bt - 1) / bt;
  std::vector<std::vector<kv::SlotId>> fresh(blocks_.size());
  for (int g = 0; g < static_cast<int>(blocks_.size()); ++g) {
    const int64_t missing = needed - static_cast<int64_t>(blocks_[g].size());
    if (missing <= 0) continue;
    absl::StatusOr<std::vector<kv::SlotId>> slots = cache_->pool(g).AllocateMany(missing);
    if (!slots.ok()) {
      for (int h = 0; h < g; ++h) {
        for (kv::SlotId s : fresh[h]) (void)cache_->pool(h).Release(s);
      }
      return absl::ResourceExhaustedError(absl::StrCat("kv cache: group ", g, " needs ", missing,
                                                       " more blocks: ", slots.status().message()));
    }
    fresh[g] = *std::move(slots);
  }
  for (int g = 0; g < static_cast<int>(blocks_.size()); ++g) {
    blocks_[g].insert(blocks_[g].end(), fresh[g].begin(), fresh[g].end());
  }
  return absl::OkStatus();
}

void Sequence::AppendTokens(absl::Span<const int32_t> tokens) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
}

absl::Status Sequence::Rewind(int64_t tokens) {
  const int64_t bt = cache_->layout().block_tokens();
  if (tokens < 0 || tokens > num_tokens() || tokens % bt != 0) {
    return absl::InvalidArgumentError(absl::StrCat("Rewind to ", tokens, " of ", num_tokens(),
                                                   " tokens (", bt, "-token blocks)"));
  }
  // Window blocks freed so far were freed for a later position: one the rewound sequence
  // attends to again is gone.
  for (const std::vector<kv::SlotId>& group : blocks_) {
    for (size_t b = static_cast<size_t>(tokens / bt); b < group.size(); ++b) {
      if (group[b] < 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("Rewind to ", tokens, " tokens: block ", b, " was freed"));
      }
    }
  }
  for (int g = 0; g < static_cast<int>(blocks_.size()); ++g) {
    const kv::LayerGroup& group = cache_->layout().groups()[g];
    if (group.kind != kv::LayerKind::kSlidingWindow) continue;
    const int64_t oldest = std::max<int64_t>(0, tokens - group.window_tokens + 1) / bt;
    for (int64_t b = oldest; b < tokens / bt; ++b) {
      if (blocks_[g][b] < 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("Rewind to ", tokens, " tokens: window block ", b, " was freed"));
      }
    }
  }
  tokens_.resize(static_cast<size_t>(tokens));
  host_only_blocks_ = std::min(host_only_blocks_, tokens / bt);
  return absl::OkStatus();
}

}  // namespace kvrelay::model
