#pragma once

// CPU building blocks of the forward pass, fp32 throughout. They are also the reference the
// CUDA kernels (model/cuda) are checked against. Every function computes each output element
// in a fixed order, so results do not depend on how callers split work across threads.

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/types/span.h"
#include "kv/model_layout.h"

namespace kvrelay::model {

// tile_rows value selecting the batch-invariant kernel: every output element is
// Dot(x row, w row) (fixed reduction order), so a row's result does not depend on how many
// other rows share the call. Used for decode; threads split output columns only.
inline constexpr int64_t kRowwiseTiles = -1;

// y[rows, out] = x[rows, in] * w[out, in]^T through OpenBLAS cblas_sgemm, issued in row tiles
// whose boundaries fall on multiples of `tile_rows` counted from `first_row_position` (0 for
// "one call"). OpenBLAS results for a row depend on the call's row count, so fixing the tiles
// by absolute position makes a row's result independent of where a prefill started.
// lda/ldy default to in/out.
void Linear(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
            int64_t first_row_position = 0, int64_t tile_rows = 0, int64_t ldx = 0,
            int64_t ldy = 0);
// y[rows, out] = x[rows, in] * w[in, out] (w not transposed), same tiling.
void LinearNoTrans(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
                   int64_t first_row_position, int64_t tile_rows, int64_t ldx, int64_t ldw,
                   int64_t ldy);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. out may alias x. x row stride ldx.
void RmsNorm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* out,
             int64_t ldx = 0, int64_t ldout = 0);

enum class RopeStyle {
  kHalf,         // Llama/Gemma: pairs (i, i + d/2)
  kInterleaved,  // DeepSeek: pairs (2i, 2i + 1), written out as (i, i + d/2) like HF does
};
// Rotates `num_heads` vectors of `dim` values per row in place: row r's head h starts at
// x + r * row_stride + h * head_stride, position positions[r]. Pair i turns by
// positions[r] * inv_freq[i] (fp32 product, as transformers computes it) and cos/sin are
// multiplied by attention_factor (YaRN).
void ApplyRope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
               int64_t head_stride, const int64_t* positions, absl::Span<const float> inv_freq,
               float attention_factor, RopeStyle style);
// Default RoPE: inv_freq[i] = 1 / theta^(2i / dim).
void ApplyRope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
               int64_t head_stride, const int64_t* positions, double theta, RopeStyle style);

// a[i] = silu(a[i]) * b[i]   (SwiGLU)
void SiluMul(float* a, const float* b, int64_t n);
// a[i] = gelu_tanh(a[i]) * b[i]   (Gemma's GeGLU)
void GeluTanhMul(float* a, const float* b, int64_t n);

// MLP activations by their transformers names: silu/swish, gelu_pytorch_tanh/gelu_new/gelu_fast
// (tanh approximation), gelu (erf).
enum class Activation { kSilu, kGeluTanh, kGeluErf };
// a[i] = act(a[i]) * b[i] (gated MLP), or a[i] = act(a[i]) with b == nullptr.
void ActivationMul(Activation act, float* a, const float* b, int64_t n);

// x[r, :] += bias for every row (ld: row stride, 0 = n).
void AddBias(float* x, int64_t rows, int64_t n, const float* bias, int64_t ld = 0);
// x -> cap * tanh(x / cap) (Gemma's soft-capping).
void SoftCap(float* x, int64_t n, float cap);

// out[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w + b (torch LayerNorm, biased variance).
// out may alias x.
void LayerNorm(const float* x, int64_t rows, int64_t dim, const float* w, const float* b, float eps,
               float* out);

// fp32 <-> cache dtype (bf16, fp16 or fp32). fp8 values need their scales: see below.
void StoreCacheValues(const float* src, int64_t n, kv::DType dtype, uint8_t* dst);
void LoadCacheValues(const uint8_t* src, int64_t n, kv::DType dtype, float* dst);

// fp8 attention (kv/fp8.h, the block rule), one (token, K or V, kv head): quantises src[0..n)
// (n = head_dim) into n E4M3 bytes at dst with the scale of the head's block. first_in_block:
// the token is the block's first, so the scale comes from its own values
// (Fp8BlockScaleExp(Fp8FiniteAmax)) and is stored as the float32 2^k at `scale`; otherwise the
// scale already stored there is read and used. So a token's bytes depend on its values and its
// block's first token only, never on how the writes were batched.
void StoreFp8AttentionHead(const float* src, int32_t n, bool first_in_block, uint8_t* scale,
                           uint8_t* dst);
// The stored float32 scale at `scale` applied to n E4M3 bytes.
void LoadFp8AttentionHead(const uint8_t* src, int32_t n, const uint8_t* scale, float* dst);
// fp8 MLA (the FlashMLA layout), one token's entry of an MLA group: src is [latent + rope] fp32;
// the latent goes in tiles of kFp8MlaTile values, each with its own Fp8TileScaleExp scale, the
// rope key as bf16, at the layout's MlaScaleOffset / MlaRopeOffset. Load is the inverse
// (dequantised latent, then rope), [latent + rope] fp32.
void StoreFp8MlaEntry(const kv::ModelLayout& layout, int group, const float* src, uint8_t* entry);
void LoadFp8MlaEntry(const kv::ModelLayout& layout, int group, const uint8_t* entry, float* dst);

// Fixed-order dot product (8 partial sums, combined the same way every time).
float Dot(const float* a, const float* b, int64_t n);

// Attention of one query vector over n_ctx contiguous fp32 keys/values:
//   s_j = scale * dot(q, k_j) (qk_dim values), soft-capped when softcap > 0,
//   p = softmax(s), out = sum_j p_j v_j (v_dim).
// k_j = k + j * k_stride, v_j = v + j * v_stride. scratch holds n_ctx floats.
void AttendOne(const float* q, int32_t qk_dim, const float* k, int64_t k_stride, const float* v,
               int64_t v_stride, int32_t v_dim, int64_t n_ctx, float scale, float* scratch,
               float* out, float softcap = 0.0f);

// Gathers positions [begin, end) of one layer from paged block units into contiguous fp32:
//   attention groups: k_out/v_out [end - begin, num_kv_heads * head_dim]
//   MLA groups:       k_out [end - begin, latent + rope]  (v_out unused)
// fp8 values come back dequantised with their stored scales.
// block_units[b] points at block b's unit (for any b whose tokens are read).
void GatherLayer(const kv::ModelLayout& layout, int group, int32_t index_in_group,
                 const std::vector<const uint8_t*>& block_units, int64_t begin, int64_t end,
                 float* k_out, float* v_out);

// Runs fn(begin, end) over [0, n) split into `threads` contiguous parts (the caller's thread
// takes the first). Output must not depend on the split; ours never does.
void ParallelFor(int threads, int64_t n, const std::function<void(int64_t, int64_t)>& fn);

// Sets OpenBLAS's thread count (process-wide).
void SetBlasThreads(int threads);
int BlasThreads();

}  // namespace kvrelay::model
