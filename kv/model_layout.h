#pragma once

// ModelLayout: the exact shape of a model's KV cache (or recurrent state), which every other
// module uses to size pools, blocks, transfers and hashes. No I/O, no threads.
//
// A layout is a dtype, a block size in tokens and a list of layer groups; each group holds the
// model layers (by index) that share one cache shape:
//   kFullAttention  MHA/GQA/MQA: K and V, num_kv_heads x head_dim each, per token per layer
//   kMlaLatent      DeepSeek MLA: one joint (latent_dim + rope_dim) entry per token per layer
//   kSlidingWindow  like full attention, but only the last window_tokens tokens are kept
//   kSsmState       Mamba: state_bytes per sequence per layer, nothing per token
//
// Block unit: the bytes of one block of block_tokens tokens for all layers of one group, stored
// contiguously and exactly BlockBytes(group) long, so it can be transferred as one segment.
// Element order inside a unit (kNHD, the default):
//   attention: [num_layers, 2 (K then V), block_tokens, num_kv_heads, head_dim]
//   MLA:       [num_layers, block_tokens, latent_dim + rope_dim]   (latent first, then rope key)
//   SSM:       [num_layers, state_bytes] raw bytes (the state after the block's last token)
// kHND swaps the token and head axes of attention units.
//
// FP8 KV (DType::kFp8, kv_cache_dtype fp8_e4m3; numerics in kv/fp8.h). Scales live inside the
// block unit, so they are checksummed, moved, cached and verified with the values:
//   attention: per layer, a strip of LayerStripBytes(g) bytes:
//                [2 (K, V), block_tokens, num_kv_heads, head_dim] E4M3 bytes (kNHD as above),
//                then [2 (K, V), num_kv_heads] float32 scales (one per block, layer, K/V, head)
//   MLA (the FlashMLA FP8 layout): per token and layer an entry of MlaEntryBytes(g) bytes:
//                [latent_dim] E4M3 bytes, [ceil(latent_dim / 128)] float32 scales (one per
//                128 latent values), [rope_dim] bf16 rope key: DeepSeek V3 656 instead of 1,152
//   SSM: no fp8 (a recurrent state is not a KV cache; Create refuses it).
// The fingerprint digests the dtype and this scale layout, so an FP8 block can never be read
// as another dtype or with another scale granularity.
//
// Thread-safe: immutable after Create().

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvrelay::kv {

// Tokens per block a layout may have: [1, kMaxBlockTokens].
inline constexpr int32_t kMaxBlockTokens = 65536;

enum class DType { kBf16, kFp16, kFp8, kFp32 };

int32_t DTypeBytes(DType dtype);
std::string_view DTypeName(DType dtype);  // "bf16", "fp16", "fp8_e4m3", "fp32"
// Accepts our names and Hugging Face / vLLM spellings ("bfloat16", "float16", "float32",
// "fp8", "float8_e4m3fn", ...). InvalidArgument naming the value otherwise.
absl::StatusOr<DType> ParseDType(std::string_view name);

enum class LayerKind { kFullAttention, kMlaLatent, kSlidingWindow, kSsmState };
std::string_view LayerKindName(LayerKind kind);  // "full_attention", "mla_latent", ...

enum class BlockOrder { kNHD, kHND };

struct LayerGroup {
  LayerKind kind = LayerKind::kFullAttention;
  // Model layer indices in this group, ascending. num_layers() == layer_ids.size().
  std::vector<int32_t> layer_ids;
  int32_t num_kv_heads = 0;   // attention kinds: MQA = 1
  int32_t head_dim = 0;       // attention kinds
  int32_t latent_dim = 0;     // MLA: kv_lora_rank (DeepSeek V3: 512)
  int32_t rope_dim = 0;       // MLA: qk_rope_head_dim (DeepSeek V3: 64)
  int32_t window_tokens = 0;  // sliding window only
  int64_t state_bytes = 0;    // SSM only: per sequence per layer

  int32_t num_layers() const { return static_cast<int32_t>(layer_ids.size()); }
  bool IsAttention() const {
    return kind == LayerKind::kFullAttention || kind == LayerKind::kSlidingWindow;
  }
};

// Element strides (not bytes) inside one block unit of an attention group. For fp8 an element
// is one byte and `layer` spans the whole strip, scales included.
struct BlockStrides {
  int64_t layer = 0;
  int64_t kv = 0;  // K -> V
  int64_t token = 0;
  int64_t head = 0;
};

// 128-bit digest of everything that makes cached bytes reusable: model id, dtype, block size
// and every group's shape. Part of every block hash.
struct LayoutFingerprint {
  std::array<uint8_t, 16> bytes{};
  std::string ToHex() const;
  // The 16 bytes as they travel in every `layout_fingerprint` field of the wire protocol.
  std::string ToBytes() const;
  friend bool operator==(const LayoutFingerprint&, const LayoutFingerprint&) = default;
};

class ModelLayout {
 public:
  // Validates: model_id non-empty, block_tokens > 0, at least one group, every group's fields
  // positive for its kind, no layer index in two groups, layer ids in [0, num_layers).
  // InvalidArgument naming the bad field otherwise.
  // An empty layout (no groups); only useful as a placeholder to assign to.
  ModelLayout() = default;

  static absl::StatusOr<ModelLayout> Create(std::string model_id, DType dtype, int32_t block_tokens,
                                            std::vector<LayerGroup> groups);

  const std::string& model_id() const { return model_id_; }
  DType dtype() const { return dtype_; }
  int32_t block_tokens() const { return block_tokens_; }
  const std::vector<LayerGroup>& groups() const { return groups_; }
  int32_t num_layers() const { return num_layers_; }

  // Same layout with another dtype or block size (re-validated, new fingerprint).
  absl::StatusOr<ModelLayout> WithDType(DType dtype) const;
  absl::StatusOr<ModelLayout> WithBlockTokens(int32_t block_tokens) const;
  // Same layout computed by a backend whose bits differ from the CPU reference's (see
  // model::AttentionModel::numerics_id): the fingerprint then digests the id too, so blocks and
  // requests never cross between backends. Empty: the reference (fingerprint as Create gives).
  ModelLayout WithNumerics(std::string numerics_id) const;
  const std::string& numerics_id() const { return numerics_id_; }

  // Bytes one token adds to one group (all its layers); 0 for SSM groups.
  int64_t GroupBytesPerToken(int group) const;
  // Bytes added per token before any window is full: sum over all non-SSM groups.
  int64_t BytesPerToken() const;
  // Exact bytes for one sequence of n tokens: windows capped at window_tokens, SSM state
  // constant (0 when n == 0). REQUIRES: n >= 0.
  int64_t BytesForTokens(int64_t n) const;
  int64_t GroupBytesForTokens(int group, int64_t n) const;
  // Bytes of one (group, block) unit.
  int64_t BlockBytes(int group) const;
  // Blocks a group must hold for a sequence of n tokens: all of them for full attention and
  // MLA; for sliding windows the blocks the window touches plus one spare [TRT
  // kSWAExtraBlock], never more than the sequence has; 1 for SSM (0 when n == 0).
  int64_t BlocksNeeded(int group, int64_t n) const;
  // Strides of an attention group's block unit. REQUIRES: groups()[group].IsAttention().
  BlockStrides Strides(int group, BlockOrder order = BlockOrder::kNHD) const;

  bool IsFp8() const { return dtype_ == DType::kFp8; }
  // Attention: bytes of one layer's part of a block unit (K, V and, for fp8, their scales).
  int64_t LayerStripBytes(int group) const;
  // fp8 attention: byte offset inside a layer strip of the float32 scale of (K or V, kv head).
  int64_t Fp8ScaleOffset(int group, int kv, int32_t kv_head) const;
  // MLA: bytes of one token's entry for one layer; where its float32 tile scales (fp8 only)
  // and its rope key start inside it.
  int64_t MlaEntryBytes(int group) const;
  int64_t MlaScaleOffset(int group) const;
  int64_t MlaRopeOffset(int group) const;

  const LayoutFingerprint& fingerprint() const { return fingerprint_; }
  // For people (error messages, logs): "model llama-1a2b3c4d, KV fp8_e4m3, 16-token blocks,
  // fingerprint 0123456789abcdef", with the numerics id when set. Never parsed.
  std::string Describe() const;

 private:
  std::string model_id_;
  DType dtype_ = DType::kBf16;
  int32_t block_tokens_ = 0;
  std::vector<LayerGroup> groups_;
  int32_t num_layers_ = 0;
  std::string numerics_id_;
  LayoutFingerprint fingerprint_;
};

// "<own.Describe()>, not the <what> layout <other_description>" for the refusal of a
// request (or target) routed for another layout; `other_description` comes from the wire
// (layout_description, untrusted): cut to 256 bytes, "(not described)" when empty.
std::string LayoutMismatch(const ModelLayout& own, std::string_view what,
                           std::string_view other_description);

}  // namespace kvrelay::kv
