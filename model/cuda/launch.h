#pragma once

// Plain-type kernel launchers implemented in kernels.cu. Only cuda_ops.cc includes this: it
// validates arguments and turns cudaError_t into absl::Status. Kept free of Abseil so nvcc
// compiles nothing but kernels.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvrelay::model::cuda::internal {

enum CacheDType : int { kCacheBf16 = 0, kCacheFp16 = 1, kCacheFp32 = 2, kCacheFp8 = 3 };

// See cuda_ops.h PagedLayer (offsets in elements; an fp8 element is one byte).
struct PagedLayerDesc {
  uint8_t* base;
  int64_t slot_stride_bytes;
  int32_t block_tokens;
  int32_t dtype;  // CacheDType
  int64_t k_offset;
  int64_t v_offset;
  int64_t token_stride;
  int64_t head_stride;
  // fp8 attention: byte offsets inside a unit of the layer's K and V scales (head h at + 4 h).
  int64_t k_scale_offset;
  int64_t v_scale_offset;
  // fp8 MLA (mla_latent > 0): latent values, then their tile scales at mla_scale_offset, then
  // the bf16 rope key at mla_rope_offset (bytes inside an entry).
  int32_t mla_latent;
  int64_t mla_scale_offset;
  int64_t mla_rope_offset;
};

struct AttentionDesc {
  const float* q;
  int64_t q_row_stride;
  int32_t heads;
  int32_t group_size;
  int32_t qk_dim;
  int32_t v_dim;
  int64_t window;
  float scale;
  int64_t rows;
  const int64_t* positions;
  const int32_t* block_tables;
  int32_t max_blocks;
  int64_t max_context;
  float* scratch;
  float* out;
};

cudaError_t LaunchRmsNorm(const float* x, int64_t rows, int32_t dim, const float* w, float eps,
                          float* out, int64_t ldx, int64_t ldout, cudaStream_t stream);
cudaError_t LaunchRope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
                       int64_t head_stride, const int64_t* positions, double theta,
                       bool interleaved, const float* inv_freq, float attention_factor,
                       cudaStream_t stream);
cudaError_t LaunchGatedActivation(float* a, const float* b, int64_t rows, int64_t n, int64_t lda,
                                  int64_t ldb, bool gelu_tanh, cudaStream_t stream);
cudaError_t LaunchAddInPlace(float* a, const float* b, int64_t n, cudaStream_t stream);
cudaError_t LaunchConvertToBf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream);
cudaError_t LaunchEmbed(const void* table, bool table_bf16, const int32_t* tokens, int64_t rows,
                        int32_t dim, float scale, float* out, cudaStream_t stream);
cudaError_t LaunchWriteCache(PagedLayerDesc layer, const float* k, const float* v, int64_t ldk,
                             int64_t ldv, int64_t width, int64_t rows, const int64_t* positions,
                             const int32_t* block_tables, int32_t max_blocks, cudaStream_t stream);
cudaError_t LaunchGatherCache(PagedLayerDesc layer, const int32_t* block_table, int64_t begin,
                              int64_t end, int64_t width, float* k_out, float* v_out,
                              cudaStream_t stream);
cudaError_t LaunchPagedAttention(PagedLayerDesc layer, AttentionDesc params, cudaStream_t stream);
cudaError_t LaunchCopyRows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                           int64_t n, cudaStream_t stream);
cudaError_t LaunchFillRandom(void* dst, bool bf16, int64_t n, uint64_t seed, float mean,
                             float stddev, cudaStream_t stream);
cudaError_t LaunchArgmax(const float* logits, int64_t rows, int64_t n, int32_t* out,
                         cudaStream_t stream);

}  // namespace kvrelay::model::cuda::internal
