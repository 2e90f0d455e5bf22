#pragma once

// CUDA launchers for the model's kernels. Each mirrors a CPU function in model/cpu_ops.h (the
// reference) and cuda_ops_test.cc checks it against that function with the tolerance stated
// here. All activations are fp32; cache entries bf16, fp16, fp32 or FP8 E4M3 with their scales
// (kv/fp8.h, kv/model_layout.h) as the layout says.
// Launchers validate their arguments and return Status; errors of the launch itself come back
// from cudaGetLastError. Every pointer is a device pointer unless named *_host.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kv/model_layout.h"
#include "model/cpu_ops.h"

namespace kvrelay::model::cuda {

// True when a CUDA device is usable (any CUDA error counts as "no").
bool HaveDevice();

// out[r, :] = x[r, :] * rsqrt(mean(x^2) + eps) * w. Reference RmsNorm; tolerance 1e-5 relative
// (different summation order).
absl::Status RmsNorm(const float* x, int64_t rows, int32_t dim, const float* w, float eps,
                     float* out, int64_t ldx, int64_t ldout, cudaStream_t stream);

// In-place RoPE; positions [rows] int64 on the device. Reference ApplyRope (same fp32 angle
// computation); tolerance 2e-6 absolute per unit of |x| (device sinf/cosf vs glibc).
// inv_freq: [dim / 2] on the device (RopeFrequencies::inv_freq, any rope_scaling) or null for
// plain RoPE at theta; cos and sin are scaled by attention_factor.
absl::Status Rope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
                  int64_t head_stride, const int64_t* positions, double theta, RopeStyle style,
                  cudaStream_t stream, const float* inv_freq = nullptr,
                  float attention_factor = 1.0f);

// a[r, i] = act(a[r, i]) * b[r, i] for i < n, rows with strides lda/ldb; act = silu or
// gelu_tanh. Reference SiluMul / GeluTanhMul; tolerance 1e-6 relative.
absl::Status GatedActivation(float* a, const float* b, int64_t rows, int64_t n, int64_t lda,
                             int64_t ldb, bool gelu_tanh, cudaStream_t stream);

// a[i] += b[i].
absl::Status AddInPlace(float* a, const float* b, int64_t n, cudaStream_t stream);

// fp32 -> bf16 (round to nearest even) for GEMM inputs; bit-exact with FloatToBf16.
absl::Status ConvertToBf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream);

// out[r, :] = table[tokens[r], :] * scale; table fp32 (bf16 when table_bf16).
absl::Status Embed(const void* table, bool table_bf16, const int32_t* tokens, int64_t rows,
                   int32_t dim, float scale, float* out, cudaStream_t stream);

// Where one layer's entries sit inside a paged pool of (group, block) units:
//   entry(slot, t) = base + slot * slot_stride_bytes + (offset + t * token_stride) * dtype bytes
// with offset = K's (or V's) element offset of the layer inside the unit (kv/model_layout.h).
// fp8 counts one byte per element, so offsets and strides are bytes, and an MLA "element" of
// the entry stride is a byte of the whole FlashMLA entry (latent, scales, bf16 rope).
struct PagedLayer {
  uint8_t* base = nullptr;
  int64_t slot_stride_bytes = 0;
  int32_t block_tokens = 0;
  kv::DType dtype = kv::DType::kBf16;
  int64_t k_offset = 0;      // elements
  int64_t v_offset = 0;      // elements (MLA: same as k_offset; values are the latent part)
  int64_t token_stride = 0;  // elements between tokens of a block
  int64_t head_stride = 0;   // elements between KV heads (MLA: 0)
  // fp8 attention only: byte offset inside the unit of this layer's float32 K scales, one per
  // KV head 4 bytes apart (Fp8ScaleOffset), and of its V scales. 0 otherwise.
  int64_t k_scale_offset = 0;
  int64_t v_scale_offset = 0;
  // fp8 MLA only: latent_dim, and where an entry's float32 tile scales and bf16 rope key start
  // inside it (MlaScaleOffset, MlaRopeOffset). 0 otherwise.
  int32_t mla_latent = 0;
  int64_t mla_scale_offset = 0;
  int64_t mla_rope_offset = 0;
};
// The PagedLayer of model layer `layer` in a pool laid out as `layout` says.
PagedLayer MakePagedLayer(const kv::ModelLayout& layout, int group, int32_t index_in_group,
                          void* base, int64_t slot_stride_bytes);

// Writes rows of K (and V unless v == nullptr) into the cache: row r goes to block table
// entry block_tables[r * max_blocks + pos[r] / block_tokens] at token pos[r] % block_tokens.
// width values per row (num_kv_heads * head_dim, or latent + rope). Bit-exact with
// StoreCacheValues at KvCache::EntryAddress.
// fp8 (kv/fp8.h, the same functions compiled for the device, so the bytes equal the CPU's):
//   attention: a row at a block's first token (pos % block_tokens == 0) sets the block's scale
//     of each (K or V, KV head) to Fp8BlockScaleExp(Fp8FiniteAmax of its head_dim values) and
//     stores the float32 2^k; every row then quantises with its block's stored scale. A first
//     pass writes the scales of the launch's block-start rows, a second the values, so rows
//     of one block in one launch (a prefill) see their first token's scale; a block whose first
//     token an earlier call wrote keeps the scale stored then.
//   MLA: per row and 128-value latent tile Fp8TileScaleExp(tile amax), stored in the entry;
//     the rope key as bf16.
// REQUIRES for fp8 attention: width == num_kv_heads * head_dim (heads head_stride apart).
absl::Status WriteCache(const PagedLayer& layer, const float* k, const float* v, int64_t ldk,
                        int64_t ldv, int64_t width, int64_t rows, const int64_t* positions,
                        const int32_t* block_tables, int32_t max_blocks, cudaStream_t stream);

// Gathers positions [begin, end) of one sequence (block_table [max_blocks]) into contiguous
// fp32 rows of `width`: K into k_out, V into v_out (unless null). Bit-exact with GatherLayer
// (fp8: DequantizeE4M3 with the stored scale; the MLA rope key from bf16).
absl::Status GatherCache(const PagedLayer& layer, const int32_t* block_table, int64_t begin,
                         int64_t end, int64_t width, float* k_out, float* v_out,
                         cudaStream_t stream);

// Causal attention over the paged cache, one (row, head) per thread block:
//   q [rows, heads, qk_dim] at q + r * q_row_stride + h * qk_dim,
//   out [rows, heads, v_dim] contiguous,
//   key j of head h = qk_dim values at entry(j) + K offset + (h / group_size) * head_stride,
//   value j = v_dim values at the V offset likewise, positions first..pos[r] with
//   first = window > 0 ? max(0, pos - window + 1) : 0.
// scratch: rows * heads * max_context floats. Reference: GatherLayer + AttendOne; tolerance
// 2e-5 relative to max |out| (expf and summation order differ).
struct AttentionParams {
  const float* q = nullptr;
  int64_t q_row_stride = 0;
  int32_t heads = 0;
  int32_t group_size = 1;  // query heads per KV head (MLA: heads)
  int32_t qk_dim = 0;
  int32_t v_dim = 0;
  int64_t window = 0;
  float scale = 1.0f;
  int64_t rows = 0;
  const int64_t* positions = nullptr;
  const int32_t* block_tables = nullptr;  // [rows, max_blocks]
  int32_t max_blocks = 0;
  int64_t max_context = 0;
  float* scratch = nullptr;
  float* out = nullptr;
};
absl::Status PagedAttention(const PagedLayer& layer, const AttentionParams& params,
                            cudaStream_t stream);

// Copies rows: dst[r * ldd + i] = src[r * lds + i] for i < n (used to place q_pe beside the
// absorbed MLA query).
absl::Status CopyRows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                      int64_t n, cudaStream_t stream);

// out[r] = Greedy(logits[r, :n]) for each of `rows` rows (int32 ids on the device): lowest
// index among equal maxima, NaN as model::Greedy treats it. Bit-exact with Greedy.
absl::Status ArgmaxRows(const float* logits, int64_t rows, int64_t n, int32_t* out,
                        cudaStream_t stream);

// Fills n values (fp32, or bf16 when bf16) with mean + uniform noise of the given standard
// deviation, from a SplitMix64 stream keyed by (seed, index): deterministic random weights.
absl::Status FillRandom(void* dst, bool bf16, int64_t n, uint64_t seed, float mean, float stddev,
                        cudaStream_t stream);

}  // namespace kvrelay::model::cuda
