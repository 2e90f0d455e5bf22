// Kernel launches with plain types (launch.h); cuda_ops.cc wraps them in Status.

#include <algorithm>

#include "model/cuda/kernels.cuh"
#include "model/cuda/launch.h"

namespace kvrelay::model::cuda::internal {
namespace {

constexpr int kThreads = 256;

unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

}  // namespace

cudaError_t LaunchRmsNorm(const float* x, int64_t rows, int32_t dim, const float* w, float eps,
                          float* out, int64_t ldx, int64_t ldout, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RmsNormKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, dim, w, eps, out, ldx,
                                                                      ldout);
  return cudaGetLastError();
}

cudaError_t LaunchRope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
                       int64_t head_stride, const int64_t* positions, double theta,
                       bool interleaved, const float* inv_freq, float attention_factor,
                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const size_t shared = sizeof(float) * static_cast<size_t>(num_heads) * dim;
  RopeKernel<<<static_cast<unsigned>(rows), kThreads, shared, stream>>>(
      x, num_heads, dim, row_stride, head_stride, positions, theta, interleaved, inv_freq,
      attention_factor);
  return cudaGetLastError();
}

cudaError_t LaunchGatedActivation(float* a, const float* b, int64_t rows, int64_t n, int64_t lda,
                                  int64_t ldb, bool gelu_tanh, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  // gridDim.y is limited to 65535; the kernel strides over the rest of the rows.
  dim3 grid(std::min<unsigned>(GridFor(n), 1024),
            static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  GatedActivationKernel<<<grid, kThreads, 0, stream>>>(a, b, rows, n, lda, ldb, gelu_tanh);
  return cudaGetLastError();
}

cudaError_t LaunchAddInPlace(float* a, const float* b, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AddKernel<<<GridFor(n), kThreads, 0, stream>>>(a, b, n);
  return cudaGetLastError();
}

cudaError_t LaunchConvertToBf16(const float* src, int64_t n, uint16_t* dst, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ToBf16Kernel<<<GridFor(n), kThreads, 0, stream>>>(src, n, dst);
  return cudaGetLastError();
}

cudaError_t LaunchEmbed(const void* table, bool table_bf16, const int32_t* tokens, int64_t rows,
                        int32_t dim, float scale, float* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  EmbedKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(table, table_bf16, tokens, dim,
                                                                    scale, out);
  return cudaGetLastError();
}

cudaError_t LaunchWriteCache(PagedLayerDesc layer, const float* k, const float* v, int64_t ldk,
                             int64_t ldv, int64_t width, int64_t rows, const int64_t* positions,
                             const int32_t* block_tables, int32_t max_blocks, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(rows);
  if (layer.dtype != kCacheFp8) {
    WriteCacheKernel<<<grid, kThreads, 0, stream>>>(layer, k, v, ldk, ldv, width, positions,
                                                    block_tables, max_blocks);
    return cudaGetLastError();
  }
  if (layer.mla_latent > 0) {
    Fp8MlaWriteKernel<<<grid, kThreads, 0, stream>>>(layer, k, ldk, width, positions, block_tables,
                                                     max_blocks);
    return cudaGetLastError();
  }
  // Two launches on one stream: every block-start row's scales are stored before any row of
  // the same block (in this launch's rows) reads them to quantise.
  Fp8BlockScalesKernel<<<grid, kThreads, 0, stream>>>(layer, k, v, ldk, ldv, width, positions,
                                                      block_tables, max_blocks);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  Fp8WriteValuesKernel<<<grid, kThreads, 0, stream>>>(layer, k, v, ldk, ldv, width, positions,
                                                      block_tables, max_blocks);
  return cudaGetLastError();
}

cudaError_t LaunchGatherCache(PagedLayerDesc layer, const int32_t* block_table, int64_t begin,
                              int64_t end, int64_t width, float* k_out, float* v_out,
                              cudaStream_t stream) {
  if (end <= begin) return cudaSuccess;
  GatherCacheKernel<<<static_cast<unsigned>(end - begin), kThreads, 0, stream>>>(
      layer, block_table, begin, width, k_out, v_out);
  return cudaGetLastError();
}

cudaError_t LaunchPagedAttention(PagedLayerDesc layer, AttentionDesc params, cudaStream_t stream) {
  if (params.rows == 0) return cudaSuccess;
  const size_t shared = sizeof(float) * static_cast<size_t>(params.qk_dim);
  const unsigned blocks = static_cast<unsigned>(params.rows * params.heads);
  PagedAttentionKernel<<<blocks, 128, shared, stream>>>(layer, params);
  return cudaGetLastError();
}

cudaError_t LaunchCopyRows(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                           int64_t n, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  CopyRowsKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(src, lds, dst, ldd, n);
  return cudaGetLastError();
}

cudaError_t LaunchFillRandom(void* dst, bool bf16, int64_t n, uint64_t seed, float mean,
                             float stddev, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillRandomKernel<<<std::min<unsigned>(GridFor(n), 4096), kThreads, 0, stream>>>(
      dst, bf16, n, seed, mean, stddev);
  return cudaGetLastError();
}

cudaError_t LaunchArgmax(const float* logits, int64_t rows, int64_t n, int32_t* out,
                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  // A power of two (the tree reduction halves it), at most ArgmaxKernel's 1024 shared slots.
  ArgmaxKernel<<<static_cast<unsigned>(rows), 1024, 0, stream>>>(logits, n, out);
  return cudaGetLastError();
}

}  // namespace kvrelay::model::cuda::internal
