#include "model/cuda/cuda_ops.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/cuda/launch.h"
#include "platform/cuda/cuda_util.h"

namespace kvrelay::model::cuda {
namespace {

using platform::cuda::FromCuda;

absl::Status Check(cudaError_t e, const char* what) {
  return e == cudaSuccess ? absl::OkStatus() : FromCuda(e, what);
}

absl::StatusOr<internal::PagedLayerDesc> Desc(const PagedLayer& l) {
  internal::PagedLayerDesc d{};
  switch (l.dtype) {
    case kv::DType::kBf16:
      d.dtype = internal::kCacheBf16;
      break;
    case kv::DType::kFp16:
      d.dtype = internal::kCacheFp16;
      break;
    case kv::DType::kFp32:
      d.dtype = internal::kCacheFp32;
      break;
    case kv::DType::kFp8:
      d.dtype = internal::kCacheFp8;
      break;
  }
  if (l.base == nullptr || l.block_tokens <= 0 || l.slot_stride_bytes <= 0) {
    return absl::InvalidArgumentError("cuda: paged layer needs a base, block_tokens and stride");
  }
  d.base = l.base;
  d.slot_stride_bytes = l.slot_stride_bytes;
  d.block_tokens = l.block_tokens;
  d.k_offset = l.k_offset;
  d.v_offset = l.v_offset;
  d.token_stride = l.token_stride;
  d.head_stride = l.head_stride;
  d.k_scale_offset = l.k_scale_offset;
  d.v_scale_offset = l.v_scale_offset;
  d.mla_latent = l.mla_latent;
  d.mla_scale_offset = l.mla_scale_offset;
  d.mla_rope_offset = l.mla_rope_offset;
  return d;
}

// fp8 rows: attention values are whole KV heads (each one scale), an MLA row holds the latent.
absl::Status CheckFp8Width(const PagedLayer& l, int64_t width, const char* what) {
  if (l.dtype != kv::DType::kFp8) return absl::OkStatus();
  const bool ok =
      l.mla_latent > 0 ? width >= l.mla_latent : l.head_stride > 0 && width % l.head_stride == 0;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": fp8 width ", width, " is not whole ", l.mla_latent > 0 ? "latent" : "KV heads",
      " (head_stride ", l.head_stride, ", latent ", l.mla_latent, ")"));
}

}  // namespace

bool HaveDevice() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return false;
  }
  return count > 0;
}

absl::Status RmsNorm(const float* x, int64_t rows, int32_t dim, const float* w, float eps,
                     float* out, int64_t ldx, int64_t ldout, cudaStream_t stream) {
  if (dim <= 0 || rows < 0) return absl::InvalidArgumentError("cuda RmsNorm: bad shape");
  return Check(internal::LaunchRmsNorm(x, rows, dim, w, eps, out, ldx == 0 ? dim : ldx,
                                       ldout == 0 ? dim : ldout, stream),
               "RmsNormKernel");
}

absl::Status Rope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
                  int64_t head_stride, const int64_t* positions, double theta, RopeStyle style,
                  cudaStream_t stream, const float* inv_freq, float attention_factor) {
  if (dim <= 0 || dim % 2 != 0 || num_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda Rope: bad dim ", dim));
  }
  // Staged row must fit the 48 KiB of shared memory a launch gets by default.
  if (int64_t{num_heads} * dim > 12288) {
    return absl::InvalidArgumentError(absl::StrCat("cuda Rope: ", num_heads, " heads x ", dim,
                                                   " exceed the 12288-value staging limit"));
  }
  return Check(
      internal::LaunchRope(x, rows, num_heads, dim, row_stride, head_stride, positions, theta,
                           style == RopeStyle::kInterleaved, inv_freq, attention_factor, stream),
      "RopeKernel");
}

absl::Status GatedActivation(float* a, const float* b, int64_t rows, int64_t n, int64_t lda,
                             int64_t ldb, bool gelu_tanh, cudaStream_t stream) {
  return Check(internal::LaunchGatedActivation(a, b, rows, n, lda, ldb, gelu_tanh, stream),
               "GatedActivationKernel");
}

absl::Status AddInPlace(float* a, const float* b, int64_t n, cudaStream_t stream) {
  return Check(internal::LaunchAddInPlace(a, b, n, stream), "AddKernel");
}

absl::Status ConvertToBf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream) {
  return Check(internal::LaunchConvertToBf16(src, n, dst, stream), "ToBf16Kernel");
}

absl::Status Embed(const void* table, bool table_bf16, const int32_t* tokens, int64_t rows,
                   int32_t dim, float scale, float* out, cudaStream_t stream) {
  return Check(internal::LaunchEmbed(table, table_bf16, tokens, rows, dim, scale, out, stream),
               "EmbedKernel");
}

PagedLayer MakePagedLayer(const kv::ModelLayout& layout, int group, int32_t index_in_group,
                          void* base, int64_t slot_stride_bytes) {
  const kv::LayerGroup& g = layout.groups()[group];
  PagedLayer l;
  l.base = static_cast<uint8_t*>(base);
  l.slot_stride_bytes = slot_stride_bytes;
  l.block_tokens = layout.block_tokens();
  l.dtype = layout.dtype();
  const int64_t bt = layout.block_tokens();
  if (g.kind == kv::LayerKind::kMlaLatent) {
    // Elements per entry; for fp8 an element is one byte of the FlashMLA entry (latent E4M3,
    // tile scales, bf16 rope: MlaEntryBytes).
    const int64_t entry = layout.MlaEntryBytes(group) / kv::DTypeBytes(layout.dtype());
    l.k_offset = l.v_offset = index_in_group * bt * entry;
    l.token_stride = entry;
    l.head_stride = 0;
    if (layout.IsFp8()) {
      l.mla_latent = g.latent_dim;
      l.mla_scale_offset = layout.MlaScaleOffset(group);
      l.mla_rope_offset = layout.MlaRopeOffset(group);
    }
  } else {
    // fp8: s.layer is the strip's bytes (values, then scales) and every element one byte.
    const kv::BlockStrides s = layout.Strides(group);
    l.k_offset = index_in_group * s.layer;
    l.v_offset = index_in_group * s.layer + s.kv;
    l.token_stride = s.token;
    l.head_stride = s.head;
    if (layout.IsFp8()) {
      l.k_scale_offset = index_in_group * s.layer + layout.Fp8ScaleOffset(group, 0, 0);
      l.v_scale_offset = index_in_group * s.layer + layout.Fp8ScaleOffset(group, 1, 0);
    }
  }
  return l;
}

absl::Status WriteCache(const PagedLayer& layer, const float* k, const float* v, int64_t ldk,
                        int64_t ldv, int64_t width, int64_t rows, const int64_t* positions,
                        const int32_t* block_tables, int32_t max_blocks, cudaStream_t stream) {
  absl::StatusOr<internal::PagedLayerDesc> d = Desc(layer);
  if (!d.ok()) return d.status();
  KV_RETURN_IF_ERROR(CheckFp8Width(layer, width, "cuda WriteCache"));
  return Check(internal::LaunchWriteCache(*d, k, v, ldk, ldv, width, rows, positions, block_tables,
                                          max_blocks, stream),
               "WriteCacheKernel");
}

absl::Status GatherCache(const PagedLayer& layer, const int32_t* block_table, int64_t begin,
                         int64_t end, int64_t width, float* k_out, float* v_out,
                         cudaStream_t stream) {
  absl::StatusOr<internal::PagedLayerDesc> d = Desc(layer);
  if (!d.ok()) return d.status();
  KV_RETURN_IF_ERROR(CheckFp8Width(layer, width, "cuda GatherCache"));
  return Check(
      internal::LaunchGatherCache(*d, block_table, begin, end, width, k_out, v_out, stream),
      "GatherCacheKernel");
}

absl::Status PagedAttention(const PagedLayer& layer, const AttentionParams& p,
                            cudaStream_t stream) {
  absl::StatusOr<internal::PagedLayerDesc> d = Desc(layer);
  if (!d.ok()) return d.status();
  if (p.heads <= 0 || p.group_size <= 0 || p.heads % p.group_size != 0 || p.qk_dim <= 0 ||
      p.v_dim <= 0 || p.max_context <= 0 || p.scratch == nullptr) {
    return absl::InvalidArgumentError("cuda PagedAttention: bad parameters");
  }
  // The query (dynamic) and the kernel's 32-float reduction buffer (static) share the 48 KiB
  // of shared memory a launch gets by default.
  if (p.qk_dim > 12288 - 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda PagedAttention: qk_dim ", p.qk_dim, " exceeds 12256"));
  }
  internal::AttentionDesc a{p.q,           p.q_row_stride, p.heads,        p.group_size,
                            p.qk_dim,      p.v_dim,        p.window,       p.scale,
                            p.rows,        p.positions,    p.block_tables, p.max_blocks,
                            p.max_context, p.scratch,      p.out};
  return Check(internal::LaunchPagedAttention(*d, a, stream), "PagedAttentionKernel");
}

absl::Status CopyRows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                      int64_t n, cudaStream_t stream) {
  return Check(internal::LaunchCopyRows(src, lds, dst, ldd, rows, n, stream), "CopyRowsKernel");
}

absl::Status FillRandom(void* dst, bool bf16, int64_t n, uint64_t seed, float mean, float stddev,
                        cudaStream_t stream) {
  return Check(internal::LaunchFillRandom(dst, bf16, n, seed, mean, stddev, stream),
               "FillRandomKernel");
}

absl::Status ArgmaxRows(const float* logits, int64_t rows, int64_t n, int32_t* out,
                        cudaStream_t stream) {
  if (rows < 0 || n <= 0 || n > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("cuda ArgmaxRows: bad shape ", rows, " x ", n));
  }
  if (rows > 0 && (logits == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError("cuda ArgmaxRows: null pointer");
  }
  return Check(internal::LaunchArgmax(logits, rows, n, out, stream), "ArgmaxKernel");
}

}  // namespace kvrelay::model::cuda
