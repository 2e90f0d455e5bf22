#pragma once

// Paged KV cache: one kv::BlockPool per layer group of a ModelLayout, each slot exactly one
// (group, block) unit of layout.BlockBytes(g) bytes in the element order kv/model_layout.h
// documents (kNHD):
//   attention: [num_layers_in_group, 2 (K, V), block_tokens, num_kv_heads, head_dim]
//   MLA:       [num_layers_in_group, block_tokens, latent_dim + rope_dim]
// (fp8: each layer's attention strip ends with its float32 scales, and an MLA entry is
// [latent E4M3, tile scales, rope bf16]; the layout's LayerStripBytes / MlaEntryBytes say how
// long each is, and EntryAddress / Fp8ScaleAddress point into them.)
//   SSM:       [num_layers_in_group, state_bytes]: one recurrent state per slot (what the
//              workers move and checkpoint for Mamba; MambaRunner keeps its own copy, so no
//              Sequence ever holds such a slot through Prefill/DecodeStep)
// A Sequence is one request's block table per group, holding one reference on every slot in
// it; slot -1 marks a sliding-window block that was freed.
//
// Thread safety: KvCache is thread-safe (BlockPool is). A Sequence is not; one thread at a time.
// Lifetimes: the KvCache must outlive every Sequence made on it.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv/model_layout.h"
#include "kv/pool/block_pool.h"

namespace kvrelay::model {

// What a device backend keeps per KvCache (see KvCache::device_state()).
class CacheDeviceState {
 public:
  virtual ~CacheDeviceState() = default;
};

class KvCache {
 public:
  // One host-memory pool per group with `blocks_per_group` slots each. Any KV dtype, fp8
  // included (kv/fp8.h: the scales live inside the block units).
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const kv::ModelLayout& layout,
                                                         int64_t blocks_per_group);
  // Uses pools made elsewhere (e.g. registered with a transport); one per group, each with
  // slot_bytes == layout.BlockBytes(g). Pools must outlive the cache.
  static absl::StatusOr<std::unique_ptr<KvCache>> Wrap(const kv::ModelLayout& layout,
                                                       std::vector<kv::BlockPool*> pools);

  const kv::ModelLayout& layout() const { return layout_; }
  kv::BlockPool& pool(int group) const { return *pools_[group]; }
  int num_groups() const { return static_cast<int>(pools_.size()); }
  // Group of a model layer and its index inside the group.
  int group_of_layer(int32_t layer) const { return layer_group_[layer]; }
  int index_in_group(int32_t layer) const { return layer_index_[layer]; }

  // Address of layer `layer`'s part of a block unit: attention K (kv = 0) or V (kv = 1) at
  // token `t` of the block (num_kv_heads * head_dim values of the KV dtype; fp8: one byte
  // each), or the MLA entry (kv ignored; layout().MlaEntryBytes(g) bytes, fp8: latent E4M3,
  // then tile scales at MlaScaleOffset, rope bf16 at MlaRopeOffset). REQUIRES: not an SSM group.
  uint8_t* EntryAddress(int32_t layer, kv::SlotId slot, int32_t token_in_block, int kv) const;
  // fp8 attention: address of the float32 scale of (block `slot`, `layer`, K or V, kv head),
  // at Fp8ScaleOffset inside the layer's strip. REQUIRES: layout().IsFp8() and an attention
  // group.
  uint8_t* Fp8ScaleAddress(int32_t layer, kv::SlotId slot, int kv, int32_t kv_head) const;

  // Process-unique and never reused (unlike an address), so a device backend can tell caches
  // apart.
  uint64_t id() const { return id_; }
  // State a device backend keeps for this cache (the CUDA runner's device mirror and its
  // registration of the pools' host memory), destroyed with the cache, before its own pools.
  // Null until attached. Thread-safe.
  std::shared_ptr<CacheDeviceState> device_state() const ABSL_LOCKS_EXCLUDED(device_state_mu_);
  void set_device_state(std::shared_ptr<CacheDeviceState> state) const
      ABSL_LOCKS_EXCLUDED(device_state_mu_);
  // Attaches `state` only when none is attached yet and returns the one attached afterwards
  // (`state`, or the one that was there), so backends racing to attach agree on one state and
  // none is replaced (destroyed) while another uses it. Thread-safe.
  std::shared_ptr<CacheDeviceState> AttachDeviceState(std::shared_ptr<CacheDeviceState> state) const
      ABSL_LOCKS_EXCLUDED(device_state_mu_);

 private:
  KvCache(kv::ModelLayout layout);
  absl::Status Init();

  kv::ModelLayout layout_;
  uint64_t id_;
  std::vector<std::unique_ptr<kv::BlockPool>> owned_pools_;
  std::vector<kv::BlockPool*> pools_;
  std::vector<int> layer_group_;
  std::vector<int> layer_index_;
  // Declared last: released before the pools it may refer to.
  mutable absl::Mutex device_state_mu_;
  mutable std::shared_ptr<CacheDeviceState> device_state_ ABSL_GUARDED_BY(device_state_mu_);
};

class Sequence {
 public:
  explicit Sequence(KvCache* cache);  // not owned
  ~Sequence();                        // releases every slot
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  KvCache& cache() const { return *cache_; }
  // Tokens whose KV is in the cache (positions 0 .. num_tokens-1).
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Block table of one group: slot per block index, -1 where a window block was freed.
  const std::vector<kv::SlotId>& blocks(int group) const { return blocks_[group]; }

  // Installs a prefix that is already in this cache's pools (e.g. received from another
  // worker): `tokens` (a whole number of blocks) and, per group, one slot per block; slots of
  // sliding-window blocks outside the window may be -1. Takes over one reference per slot
  // (the caller allocated or AddRef'd them). REQUIRES: the sequence is empty.
  absl::Status AdoptPrefix(absl::Span<const int32_t> tokens,
                           std::vector<std::vector<kv::SlotId>> blocks);
  // Blocks [0, host_only_blocks()) of every group were installed by AdoptPrefix and so far
  // exist only in the host pools; a device backend uploads them before reading them and then
  // calls MarkUploaded(). Always 0 for sequences the CPU computes from scratch.
  int64_t host_only_blocks() const { return host_only_blocks_; }
  void MarkUploaded() { host_only_blocks_ = 0; }

  // Frees sliding-window blocks that no later token can attend to (every token in them is
  // older than the window as seen from position num_tokens()). Returns how many were freed.
  int64_t FreeBlocksOutsideWindow();
  // Number of live (non -1) slots in a group.
  int64_t LiveBlocks(int group) const;

  // Used by the runner: makes sure blocks exist for positions < end_tokens (allocating from
  // the pools, all or nothing), then appends `tokens`.
  absl::Status EnsureBlocks(int64_t end_tokens);
  void AppendTokens(absl::Span<const int32_t> tokens);
  // Forgets the tokens from position `tokens` on (a whole number of blocks) but keeps their
  // blocks, whose slots the next Prefill writes again (a prefix whose bytes could not all be
  // read is computed instead). FailedPrecondition when a block a later token attends to was
  // freed, InvalidArgument for a position past the end or inside a block.
  absl::Status Rewind(int64_t tokens);

 private:
  void ReleaseAll();

  KvCache* cache_;
  std::vector<int32_t> tokens_;
  std::vector<std::vector<kv::SlotId>> blocks_;
  int64_t host_only_blocks_ = 0;
};

}  // namespace kvrelay::model
