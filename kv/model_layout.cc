#include "kv/model_layout.h"

#include <algorithm>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "kv/digest.h"
#include "kv/fp8.h"

namespace kvrelay::kv {
namespace {

// Limits match the documentation in proto/kvrelay/v1/common.proto.
constexpr int32_t kMaxLayers = 4096;
constexpr int32_t kMaxKvHeads = 1024;
constexpr int32_t kMaxHeadDim = 4096;
constexpr int32_t kMaxLatentDim = 65536;
constexpr int32_t kMaxRopeDim = 4096;
constexpr int64_t kMaxStateBytes = int64_t{1} << 40;
constexpr size_t kMaxGroups = 64;
constexpr size_t kMaxModelIdBytes = 256;

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [", lo, ", ", hi, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status ValidateGroup(const LayerGroup& g, int index) {
  const std::string prefix = absl::StrCat("groups[", index, "].");
  if (g.layer_ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "layer_ids is empty"));
  }
  switch (g.kind) {
    case LayerKind::kSlidingWindow:
      if (absl::Status s = CheckRange(prefix + "window_tokens", g.window_tokens, 1, 1 << 30);
          !s.ok()) {
        return s;
      }
      [[fallthrough]];
    case LayerKind::kFullAttention:
      if (absl::Status s = CheckRange(prefix + "num_kv_heads", g.num_kv_heads, 1, kMaxKvHeads);
          !s.ok()) {
        return s;
      }
      return CheckRange(prefix + "head_dim", g.head_dim, 1, kMaxHeadDim);
    case LayerKind::kMlaLatent:
      if (absl::Status s = CheckRange(prefix + "latent_dim", g.latent_dim, 1, kMaxLatentDim);
          !s.ok()) {
        return s;
      }
      return CheckRange(prefix + "rope_dim", g.rope_dim, 0, kMaxRopeDim);
    case LayerKind::kSsmState:
      return CheckRange(prefix + "state_bytes", g.state_bytes, 1, kMaxStateBytes);
  }
  return absl::InvalidArgumentError(absl::StrCat(prefix, "kind is not a known LayerKind"));
}

// Names the element format and scale granularity of kv/fp8.h; change it whenever either changes.
constexpr std::string_view kFp8SchemeId =
    "e4m3fn-rne-sat448;attn=pow2/block/layer/kv/head/first-token+7;mla=pow2/token/128";

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

LayoutFingerprint ComputeFingerprint(const std::string& model_id, DType dtype, int32_t block_tokens,
                                     const std::vector<LayerGroup>& groups,
                                     const std::string& numerics_id) {
  internal::ByteWriter w;
  w.Bytes("kvrelay.layout.v1");
  w.LengthPrefixed(model_id);
  w.U32(static_cast<uint32_t>(dtype));
  w.U32(static_cast<uint32_t>(block_tokens));
  w.U32(static_cast<uint32_t>(groups.size()));
  for (const LayerGroup& g : groups) {
    w.U32(static_cast<uint32_t>(g.kind));
    w.U32(static_cast<uint32_t>(g.layer_ids.size()));
    for (int32_t id : g.layer_ids) w.U32(static_cast<uint32_t>(id));
    w.U32(static_cast<uint32_t>(g.num_kv_heads));
    w.U32(static_cast<uint32_t>(g.head_dim));
    w.U32(static_cast<uint32_t>(g.latent_dim));
    w.U32(static_cast<uint32_t>(g.rope_dim));
    w.U32(static_cast<uint32_t>(g.window_tokens));
    w.U64(static_cast<uint64_t>(g.state_bytes));
  }
  // The quantisation scheme (kv/fp8.h): element format and where each scale applies. Only for
  // fp8, so the other layouts keep the fingerprints they always had.
  if (dtype == DType::kFp8) {
    w.Bytes("kv_quant");
    w.LengthPrefixed(kFp8SchemeId);
  }
  // Appended only when set, so the CPU reference layouts keep the fingerprints they always had.
  if (!numerics_id.empty()) {
    w.Bytes("numerics");
    w.LengthPrefixed(numerics_id);
  }
  std::array<uint8_t, 32> digest = internal::Sha256(w.data());
  LayoutFingerprint fp;
  std::copy_n(digest.begin(), fp.bytes.size(), fp.bytes.begin());
  return fp;
}

}  // namespace

int32_t DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
    case DType::kFp16:
      return 2;
    case DType::kFp8:
      return 1;
    case DType::kFp32:
      return 4;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
    case DType::kFp8:
      return "fp8_e4m3";
    case DType::kFp32:
      return "fp32";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(absl::string_view(name.data(), name.size()));
  if (lower == "bf16" || lower == "bfloat16") return DType::kBf16;
  if (lower == "fp16" || lower == "float16" || lower == "half") return DType::kFp16;
  if (lower == "fp8" || lower == "fp8_e4m3" || lower == "float8_e4m3fn" || lower == "float8_e4m3" ||
      lower == "e4m3") {
    return DType::kFp8;
  }
  if (lower == "fp32" || lower == "float32" || lower == "float") return DType::kFp32;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", std::string(name),
                                                 "' (expected bf16, fp16, fp8_e4m3 or fp32)"));
}

std::string_view LayerKindName(LayerKind kind) {
  switch (kind) {
    case LayerKind::kFullAttention:
      return "full_attention";
    case LayerKind::kMlaLatent:
      return "mla_latent";
    case LayerKind::kSlidingWindow:
      return "sliding_window";
    case LayerKind::kSsmState:
      return "ssm_state";
  }
  return "unknown";
}

std::string LayoutFingerprint::ToHex() const { return absl::BytesToHexString(ToBytes()); }

std::string LayoutFingerprint::ToBytes() const {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

absl::StatusOr<ModelLayout> ModelLayout::Create(std::string model_id, DType dtype,
                                                int32_t block_tokens,
                                                std::vector<LayerGroup> groups) {
  if (model_id.empty() || model_id.size() > kMaxModelIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("model_id must be 1-", kMaxModelIdBytes, " bytes, got ", model_id.size()));
  }
  if (DTypeBytes(dtype) == 0) return absl::InvalidArgumentError("dtype is not a known DType");
  if (absl::Status s = CheckRange("block_tokens", block_tokens, 1, kMaxBlockTokens); !s.ok()) {
    return s;
  }
  if (groups.empty() || groups.size() > kMaxGroups) {
    return absl::InvalidArgumentError(
        absl::StrCat("groups must have 1-", kMaxGroups, " entries, got ", groups.size()));
  }
  std::set<int32_t> seen;
  for (size_t i = 0; i < groups.size(); ++i) {
    LayerGroup& g = groups[i];
    if (absl::Status s = ValidateGroup(g, static_cast<int>(i)); !s.ok()) return s;
    if (dtype == DType::kFp8 && g.kind == LayerKind::kSsmState) {
      return absl::InvalidArgumentError(absl::StrCat(
          "groups[", i, "]: an fp8_e4m3 KV cache applies to attention and MLA caches; a ",
          std::string(LayerKindName(g.kind)),
          " group keeps its recurrent state in the model's dtype"));
    }
    std::sort(g.layer_ids.begin(), g.layer_ids.end());
    for (int32_t id : g.layer_ids) {
      if (id < 0 || id >= kMaxLayers) {
        return absl::InvalidArgumentError(absl::StrCat("groups[", i, "].layer_ids: layer ", id,
                                                       " out of range [0, ", kMaxLayers, ")"));
      }
      if (!seen.insert(id).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("groups[", i, "].layer_ids: layer ", id, " is in two groups"));
      }
    }
  }
  const int32_t num_layers = static_cast<int32_t>(seen.size());
  if (*seen.rbegin() != num_layers - 1) {
    return absl::InvalidArgumentError(absl::StrCat("layer_ids must cover 0..", num_layers - 1,
                                                   " without gaps, got max ", *seen.rbegin()));
  }
  ModelLayout layout;
  layout.fingerprint_ =
      ComputeFingerprint(model_id, dtype, block_tokens, groups, /*numerics_id=*/"");
  layout.model_id_ = std::move(model_id);
  layout.dtype_ = dtype;
  layout.block_tokens_ = block_tokens;
  layout.groups_ = std::move(groups);
  layout.num_layers_ = num_layers;
  return layout;
}

absl::StatusOr<ModelLayout> ModelLayout::WithDType(DType dtype) const {
  KV_ASSIGN_OR_RETURN(ModelLayout layout, Create(model_id_, dtype, block_tokens_, groups_));
  return layout.WithNumerics(numerics_id_);
}

absl::StatusOr<ModelLayout> ModelLayout::WithBlockTokens(int32_t block_tokens) const {
  KV_ASSIGN_OR_RETURN(ModelLayout layout, Create(model_id_, dtype_, block_tokens, groups_));
  return layout.WithNumerics(numerics_id_);
}

ModelLayout ModelLayout::WithNumerics(std::string numerics_id) const {
  ModelLayout layout = *this;
  layout.numerics_id_ = std::move(numerics_id);
  layout.fingerprint_ =
      ComputeFingerprint(model_id_, dtype_, block_tokens_, groups_, layout.numerics_id_);
  return layout;
}

int64_t ModelLayout::GroupBytesPerToken(int group) const {
  const LayerGroup& g = groups_[group];
  switch (g.kind) {
    case LayerKind::kFullAttention:
    case LayerKind::kSlidingWindow:
      // fp8: the block's scales spread over its tokens (exact whenever block_tokens divides
      // 8 * num_kv_heads, as for every seed model at 16 tokens per block).
      if (IsFp8()) return CeilDiv(BlockBytes(group), block_tokens_);
      return int64_t{2} * g.num_kv_heads * g.head_dim * DTypeBytes(dtype_) * g.num_layers();
    case LayerKind::kMlaLatent:
      return MlaEntryBytes(group) * g.num_layers();
    case LayerKind::kSsmState:
      return 0;
  }
  return 0;
}

int64_t ModelLayout::BytesPerToken() const {
  int64_t total = 0;
  for (size_t i = 0; i < groups_.size(); ++i) total += GroupBytesPerToken(static_cast<int>(i));
  return total;
}

int64_t ModelLayout::GroupBytesForTokens(int group, int64_t n) const {
  KV_DCHECK(n >= 0);
  if (n <= 0) return 0;
  const LayerGroup& g = groups_[group];
  switch (g.kind) {
    case LayerKind::kFullAttention:
    case LayerKind::kSlidingWindow: {
      const int64_t kept =
          g.kind == LayerKind::kSlidingWindow ? std::min<int64_t>(n, g.window_tokens) : n;
      if (!IsFp8()) return kept * GroupBytesPerToken(group);
      // Values per token kept, scales per block those tokens fill.
      const int64_t scales = int64_t{2} * g.num_kv_heads * kFp8ScaleBytes * g.num_layers();
      return kept * int64_t{2} * g.num_kv_heads * g.head_dim * g.num_layers() +
             CeilDiv(kept, block_tokens_) * scales;
    }
    case LayerKind::kMlaLatent:
      return n * GroupBytesPerToken(group);
    case LayerKind::kSsmState:
      return g.state_bytes * g.num_layers();
  }
  return 0;
}

int64_t ModelLayout::BytesForTokens(int64_t n) const {
  int64_t total = 0;
  for (size_t i = 0; i < groups_.size(); ++i) total += GroupBytesForTokens(static_cast<int>(i), n);
  return total;
}

int64_t ModelLayout::BlockBytes(int group) const {
  const LayerGroup& g = groups_[group];
  switch (g.kind) {
    case LayerKind::kFullAttention:
    case LayerKind::kSlidingWindow:
      return LayerStripBytes(group) * g.num_layers();
    case LayerKind::kMlaLatent:
      return int64_t{block_tokens_} * MlaEntryBytes(group) * g.num_layers();
    case LayerKind::kSsmState:
      return g.state_bytes * g.num_layers();
  }
  return 0;
}

int64_t ModelLayout::BlocksNeeded(int group, int64_t n) const {
  if (n <= 0) return 0;
  const LayerGroup& g = groups_[group];
  const int64_t all_blocks = (n + block_tokens_ - 1) / block_tokens_;
  switch (g.kind) {
    case LayerKind::kFullAttention:
    case LayerKind::kMlaLatent:
      return all_blocks;
    case LayerKind::kSlidingWindow: {
      // A window of w tokens ending anywhere touches at most ceil((w - 1) / b) + 1 blocks;
      // one spare lets the next block be written before the oldest is freed.
      const int64_t window_blocks = (g.window_tokens - 1 + block_tokens_ - 1) / block_tokens_ + 1;
      return std::min(all_blocks, window_blocks + 1);
    }
    case LayerKind::kSsmState:
      return 1;
  }
  return 0;
}

BlockStrides ModelLayout::Strides(int group, BlockOrder order) const {
  const LayerGroup& g = groups_[group];
  KV_DCHECK(g.IsAttention());
  BlockStrides s;
  const int64_t per_kv = int64_t{block_tokens_} * g.num_kv_heads * g.head_dim;
  s.layer = IsFp8() ? LayerStripBytes(group) : 2 * per_kv;  // fp8: one byte per element
  s.kv = per_kv;
  if (order == BlockOrder::kNHD) {
    s.token = int64_t{g.num_kv_heads} * g.head_dim;
    s.head = g.head_dim;
  } else {
    s.head = int64_t{block_tokens_} * g.head_dim;
    s.token = g.head_dim;
  }
  return s;
}

std::string ModelLayout::Describe() const {
  return absl::StrCat("model ", model_id_, ", KV ", std::string(DTypeName(dtype_)), ", ",
                      block_tokens_, "-token blocks",
                      numerics_id_.empty() ? "" : absl::StrCat(", numerics ", numerics_id_),
                      ", fingerprint ", fingerprint_.ToHex().substr(0, 16));
}

std::string LayoutMismatch(const ModelLayout& own, std::string_view what,
                           std::string_view other_description) {
  std::string other =
      other_description.empty() ? "(not described)" : std::string(other_description.substr(0, 256));
  return absl::StrCat(own.Describe(), "; not the ", std::string(what), " layout ", other,
                      ": KV is never exchanged between layouts");
}

int64_t ModelLayout::LayerStripBytes(int group) const {
  const LayerGroup& g = groups_[group];
  KV_DCHECK(g.IsAttention());
  const int64_t values = int64_t{2} * block_tokens_ * g.num_kv_heads * g.head_dim;
  if (!IsFp8()) return values * DTypeBytes(dtype_);
  return values + int64_t{2} * g.num_kv_heads * kFp8ScaleBytes;
}

int64_t ModelLayout::Fp8ScaleOffset(int group, int kv, int32_t kv_head) const {
  const LayerGroup& g = groups_[group];
  KV_DCHECK(IsFp8() && g.IsAttention());
  const int64_t values = int64_t{2} * block_tokens_ * g.num_kv_heads * g.head_dim;
  return values + (int64_t{kv} * g.num_kv_heads + kv_head) * kFp8ScaleBytes;
}

int64_t ModelLayout::MlaEntryBytes(int group) const {
  const LayerGroup& g = groups_[group];
  KV_DCHECK(g.kind == LayerKind::kMlaLatent);
  if (!IsFp8()) return int64_t{g.latent_dim + g.rope_dim} * DTypeBytes(dtype_);
  return MlaRopeOffset(group) + int64_t{g.rope_dim} * DTypeBytes(DType::kBf16);
}

int64_t ModelLayout::MlaScaleOffset(int group) const {
  const LayerGroup& g = groups_[group];
  KV_DCHECK(IsFp8() && g.kind == LayerKind::kMlaLatent);
  return g.latent_dim;
}

int64_t ModelLayout::MlaRopeOffset(int group) const {
  const LayerGroup& g = groups_[group];
  KV_DCHECK(g.kind == LayerKind::kMlaLatent);
  if (!IsFp8()) return int64_t{g.latent_dim} * DTypeBytes(dtype_);
  return g.latent_dim + CeilDiv(g.latent_dim, kFp8MlaTile) * kFp8ScaleBytes;
}

}  // namespace kvrelay::kv
