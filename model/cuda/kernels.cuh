#pragma once

// Device code: framework-free kernels over plain descriptors (launch.h). Every kernel has a
// CPU reference in model/cpu_ops.h; see cuda_ops.h for the pairing and tolerances.

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kv/fp8.h"
#include "model/cuda/launch.h"

namespace kvrelay::model::cuda::internal {

// Same bit manipulation as model/numeric.h, so cache bytes match the CPU's exactly.
__device__ __forceinline__ float Bf16ToFloatDev(uint16_t v) {
  return __uint_as_float(static_cast<uint32_t>(v) << 16);
}
__device__ __forceinline__ uint16_t FloatToBf16Dev(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

__device__ __forceinline__ float LoadEntry(const uint8_t* p, int32_t dtype) {
  if (dtype == kCacheFp32) return *reinterpret_cast<const float*>(p);
  const uint16_t v = *reinterpret_cast<const uint16_t*>(p);
  if (dtype == kCacheBf16) return Bf16ToFloatDev(v);
  return __half2float(__ushort_as_half(v));
}
__device__ __forceinline__ void StoreEntry(uint8_t* p, int32_t dtype, float f) {
  if (dtype == kCacheFp32) {
    *reinterpret_cast<float*>(p) = f;
  } else if (dtype == kCacheBf16) {
    *reinterpret_cast<uint16_t*>(p) = FloatToBf16Dev(f);
  } else {
    *reinterpret_cast<uint16_t*>(p) = __half_as_ushort(__float2half_rn(f));
  }
}
__device__ __forceinline__ int DTypeBytesDev(int32_t dtype) {
  return dtype == kCacheFp32 ? 4 : (dtype == kCacheFp8 ? 1 : 2);
}

// Little-endian byte loads and stores: fp8 scales and the fp8 MLA entry's bf16 rope key sit at
// offsets the layout does not align (kv/model_layout.h), and the CPU writes them with memcpy.
__device__ __forceinline__ float LoadF32Bytes(const uint8_t* p) {
  return __uint_as_float(static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24);
}
__device__ __forceinline__ void StoreF32Bytes(uint8_t* p, float f) {
  const uint32_t b = __float_as_uint(f);
  p[0] = static_cast<uint8_t>(b);
  p[1] = static_cast<uint8_t>(b >> 8);
  p[2] = static_cast<uint8_t>(b >> 16);
  p[3] = static_cast<uint8_t>(b >> 24);
}
__device__ __forceinline__ uint16_t LoadU16Bytes(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | p[1] << 8);
}
__device__ __forceinline__ void StoreU16Bytes(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}

// Value i of a cache entry as fp32. `entry` is the entry's first value (attention: of the head
// the caller reads, or of head 0 when i spans heads), `scale` the byte address of the float32
// scale of the value's (K or V, KV head) for fp8 attention, unused otherwise. fp8 values are
// kv::DequantizeE4M3 with the stored scale, exactly as the CPU's GatherLayer; an fp8 MLA entry
// is latent_dim E4M3 values with one scale per kFp8MlaTile of them, then the rope key in bf16.
__device__ __forceinline__ float LoadCacheValue(const PagedLayerDesc& l, const uint8_t* entry,
                                                const uint8_t* scale, int64_t i) {
  if (l.dtype != kCacheFp8) return LoadEntry(entry + i * DTypeBytesDev(l.dtype), l.dtype);
  if (l.mla_latent == 0) return kv::DequantizeE4M3(entry[i], LoadF32Bytes(scale));
  if (i < l.mla_latent) {
    const uint8_t* tile_scale =
        entry + l.mla_scale_offset + (i / kv::kFp8MlaTile) * kv::kFp8ScaleBytes;
    return kv::DequantizeE4M3(entry[i], LoadF32Bytes(tile_scale));
  }
  return Bf16ToFloatDev(LoadU16Bytes(entry + l.mla_rope_offset + (i - l.mla_latent) * 2));
}

// Block-wide reductions; blockDim.x is a multiple of 32 and <= 1024.
__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// kv::Fp8FiniteAmax(x, n) computed by one whole warp (every lane calls it with the same x, n):
// each lane takes it over its own contiguous chunk, then the warp the max of those. A max of
// non-negative finite floats (or 0) is exact in any order, so the result is Fp8FiniteAmax's.
__device__ __forceinline__ float WarpFiniteAmax(const float* x, int64_t n) {
  const int64_t chunk = (n + 31) / 32;
  const int64_t lo = min(n, static_cast<int64_t>(threadIdx.x & 31) * chunk);
  const int64_t hi = min(n, lo + chunk);
  return WarpMax(kv::Fp8FiniteAmax(x + lo, hi - lo));
}

template <bool kMax>
__device__ float BlockReduce(float v, float* shared /* >= 32 floats */) {
  v = kMax ? WarpMax(v) : WarpSum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // shared may still be read by a previous reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = lane < warps ? shared[lane] : (kMax ? -INFINITY : 0.0f);
  v = kMax ? WarpMax(v) : WarpSum(v);
  return v;  // every thread holds the result
}

// One block per row. x/out rows [dim] with strides ldx/ldout. out may alias x.
__global__ void RmsNormKernel(const float* x, int32_t dim, const float* w, float eps, float* out,
                              int64_t ldx, int64_t ldout) {
  __shared__ float shared[32];
  const float* xr = x + blockIdx.x * ldx;
  float* o = out + blockIdx.x * ldout;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
  ss = BlockReduce<false>(ss, shared);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// One block per row. The row's heads are staged in dynamic shared memory
// (num_heads * dim floats) so the interleaved layout can be rewritten in place.
// inv_freq_table: [dim / 2] precomputed inverse frequencies (rope_scaling), or null for the
// plain 1 / theta^(2i / dim); cos and sin are multiplied by attention_factor (yarn) as the CPU's
// ApplyRope does.
__global__ void RopeKernel(float* x, int32_t num_heads, int32_t dim, int64_t row_stride,
                           int64_t head_stride, const int64_t* positions, double theta,
                           bool interleaved, const float* inv_freq_table, float attention_factor) {
  extern __shared__ float staged[];
  const int32_t half = dim / 2;
  float* row = x + blockIdx.x * row_stride;
  for (int u = threadIdx.x; u < num_heads * dim; u += blockDim.x) {
    staged[u] = row[(u / dim) * head_stride + u % dim];
  }
  __syncthreads();
  const float pos = static_cast<float>(positions[blockIdx.x]);
  for (int u = threadIdx.x; u < num_heads * half; u += blockDim.x) {
    const int h = u / half, i = u % half;
    const float* in = staged + h * dim;
    // Same fp32 inverse frequency as the CPU: rounded from a double-precision power.
    const float inv_freq = inv_freq_table != nullptr
                               ? inv_freq_table[i]
                               : static_cast<float>(1.0 / pow(theta, (2.0 * i) / dim));
    const float angle = pos * inv_freq;
    float c = cosf(angle), s = sinf(angle);
    if (attention_factor != 1.0f) {
      c *= attention_factor;
      s *= attention_factor;
    }
    const float a = interleaved ? in[2 * i] : in[i];
    const float b = interleaved ? in[2 * i + 1] : in[i + half];
    float* v = row + h * head_stride;
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
  }
}

// Rows stride over gridDim.y (at most 65535, below a prefill's max_rows).
__global__ void GatedActivationKernel(float* a, const float* b, int64_t rows, int64_t n,
                                      int64_t lda, int64_t ldb, bool gelu_tanh) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float x = a[r * lda + i];
      float act;
      if (gelu_tanh) {
        act = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
      } else {
        act = x / (1.0f + expf(-x));
      }
      a[r * lda + i] = act * b[r * ldb + i];
    }
  }
}

__global__ void AddKernel(float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    a[i] += b[i];
  }
}

__global__ void ToBf16Kernel(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = FloatToBf16Dev(src[i]);
  }
}

__global__ void EmbedKernel(const void* table, bool table_bf16, const int32_t* tokens, int32_t dim,
                            float scale, float* out) {
  const int64_t row = blockIdx.x;
  const int64_t base = static_cast<int64_t>(tokens[row]) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = table_bf16 ? Bf16ToFloatDev(static_cast<const uint16_t*>(table)[base + i])
                               : static_cast<const float*>(table)[base + i];
    out[row * dim + i] = v * scale;
  }
}

__device__ __forceinline__ uint8_t* UnitPtr(const PagedLayerDesc& l, int32_t slot) {
  return l.base + static_cast<int64_t>(slot) * l.slot_stride_bytes;
}
__device__ __forceinline__ uint8_t* EntryPtr(const PagedLayerDesc& l, int32_t slot, int64_t t,
                                             int64_t offset) {
  return UnitPtr(l, slot) + (offset + t * l.token_stride) * DTypeBytesDev(l.dtype);
}

// One block per row.
__global__ void WriteCacheKernel(PagedLayerDesc l, const float* k, const float* v, int64_t ldk,
                                 int64_t ldv, int64_t width, const int64_t* positions,
                                 const int32_t* block_tables, int32_t max_blocks) {
  const int64_t r = blockIdx.x;
  const int64_t pos = positions[r];
  const int32_t slot = block_tables[r * max_blocks + pos / l.block_tokens];
  const int64_t t = pos % l.block_tokens;
  const int esize = DTypeBytesDev(l.dtype);
  uint8_t* kd = EntryPtr(l, slot, t, l.k_offset);
  uint8_t* vd = EntryPtr(l, slot, t, l.v_offset);
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    StoreEntry(kd + i * esize, l.dtype, k[r * ldk + i]);
    if (v != nullptr) StoreEntry(vd + i * esize, l.dtype, v[r * ldv + i]);
  }
}

// fp8 attention, first pass of a cache write (one block per row): a row at its block's first
// token sets the block's scale of each (K or V, KV head), one warp per pair, from the row's
// own head_dim values (heads head_stride apart, head_stride == head_dim in kNHD).
__global__ void Fp8BlockScalesKernel(PagedLayerDesc l, const float* k, const float* v, int64_t ldk,
                                     int64_t ldv, int64_t width, const int64_t* positions,
                                     const int32_t* block_tables, int32_t max_blocks) {
  const int64_t r = blockIdx.x;
  const int64_t pos = positions[r];
  if (pos % l.block_tokens != 0) return;  // uniform over the block: no warp is split
  uint8_t* unit = UnitPtr(l, block_tables[r * max_blocks + pos / l.block_tokens]);
  const int64_t head_dim = l.head_stride;
  const int64_t heads = width / head_dim;
  const int64_t pairs = (v != nullptr ? 2 : 1) * heads;
  const int lane = threadIdx.x & 31;
  for (int64_t u = threadIdx.x >> 5; u < pairs; u += blockDim.x >> 5) {
    const bool is_v = u >= heads;
    const int64_t h = is_v ? u - heads : u;
    const float* x = (is_v ? v + r * ldv : k + r * ldk) + h * head_dim;
    const float amax = WarpFiniteAmax(x, head_dim);
    if (lane == 0) {
      uint8_t* scale = unit + (is_v ? l.v_scale_offset : l.k_scale_offset) + h * kv::kFp8ScaleBytes;
      StoreF32Bytes(scale, kv::Fp8ScaleFromExp(kv::Fp8BlockScaleExp(amax)));
    }
  }
}

// fp8 attention, second pass (one block per row): every value quantised with its block's
// stored scale, written by the first pass or by the call that wrote the block's first token.
__global__ void Fp8WriteValuesKernel(PagedLayerDesc l, const float* k, const float* v, int64_t ldk,
                                     int64_t ldv, int64_t width, const int64_t* positions,
                                     const int32_t* block_tables, int32_t max_blocks) {
  const int64_t r = blockIdx.x;
  const int64_t pos = positions[r];
  const int32_t slot = block_tables[r * max_blocks + pos / l.block_tokens];
  const int64_t t = pos % l.block_tokens;
  const uint8_t* unit = UnitPtr(l, slot);
  uint8_t* kd = EntryPtr(l, slot, t, l.k_offset);
  uint8_t* vd = EntryPtr(l, slot, t, l.v_offset);
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const int64_t scale_at = (i / l.head_stride) * kv::kFp8ScaleBytes;
    const float ks = LoadF32Bytes(unit + l.k_scale_offset + scale_at);
    kd[i] = kv::QuantizeE4M3(k[r * ldk + i], kv::Fp8StoredScaleExp(ks));
    if (v != nullptr) {
      const float vs = LoadF32Bytes(unit + l.v_scale_offset + scale_at);
      vd[i] = kv::QuantizeE4M3(v[r * ldv + i], kv::Fp8StoredScaleExp(vs));
    }
  }
}

// fp8 MLA (one block per row): per kFp8MlaTile latent values one warp computes the tile's
// scale, stores it in the entry and quantises the tile with it; the rope key goes in as bf16.
// Each entry holds its own scales, so rows are independent.
__global__ void Fp8MlaWriteKernel(PagedLayerDesc l, const float* x, int64_t ldx, int64_t width,
                                  const int64_t* positions, const int32_t* block_tables,
                                  int32_t max_blocks) {
  const int64_t r = blockIdx.x;
  const int64_t pos = positions[r];
  const int32_t slot = block_tables[r * max_blocks + pos / l.block_tokens];
  uint8_t* entry = EntryPtr(l, slot, pos % l.block_tokens, l.k_offset);
  const float* xr = x + r * ldx;
  const int64_t latent = l.mla_latent;
  const int64_t tiles = (latent + kv::kFp8MlaTile - 1) / kv::kFp8MlaTile;
  const int lane = threadIdx.x & 31;
  for (int64_t tile = threadIdx.x >> 5; tile < tiles; tile += blockDim.x >> 5) {
    const int64_t begin = tile * kv::kFp8MlaTile;
    const int64_t n = min(static_cast<int64_t>(kv::kFp8MlaTile), latent - begin);
    const int32_t k = kv::Fp8TileScaleExp(WarpFiniteAmax(xr + begin, n));
    if (lane == 0) {
      StoreF32Bytes(entry + l.mla_scale_offset + tile * kv::kFp8ScaleBytes, kv::Fp8ScaleFromExp(k));
    }
    for (int64_t i = lane; i < n; i += 32) entry[begin + i] = kv::QuantizeE4M3(xr[begin + i], k);
  }
  for (int64_t i = threadIdx.x; i < width - latent; i += blockDim.x) {
    StoreU16Bytes(entry + l.mla_rope_offset + 2 * i, FloatToBf16Dev(xr[latent + i]));
  }
}

// One block per position. fp8 attention: value i belongs to KV head i / head_stride.
__global__ void GatherCacheKernel(PagedLayerDesc l, const int32_t* block_table, int64_t begin,
                                  int64_t width, float* k_out, float* v_out) {
  const int64_t p = begin + blockIdx.x;
  const int32_t slot = block_table[p / l.block_tokens];
  const int64_t t = p % l.block_tokens;
  const uint8_t* unit = UnitPtr(l, slot);
  const uint8_t* ks = EntryPtr(l, slot, t, l.k_offset);
  const uint8_t* vs = EntryPtr(l, slot, t, l.v_offset);
  const bool fp8_heads = l.dtype == kCacheFp8 && l.mla_latent == 0;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const int64_t scale_at = fp8_heads ? (i / l.head_stride) * kv::kFp8ScaleBytes : 0;
    k_out[blockIdx.x * width + i] = LoadCacheValue(l, ks, unit + l.k_scale_offset + scale_at, i);
    if (v_out != nullptr) {
      v_out[blockIdx.x * width + i] = LoadCacheValue(l, vs, unit + l.v_scale_offset + scale_at, i);
    }
  }
}

// One block per (row, head); dynamic shared memory holds the query (qk_dim floats).
__global__ void PagedAttentionKernel(PagedLayerDesc l, AttentionDesc p) {
  extern __shared__ float q_shared[];
  __shared__ float reduce[32];
  const int64_t row = blockIdx.x / p.heads;
  const int32_t head = static_cast<int32_t>(blockIdx.x % p.heads);
  const int64_t pos = p.positions[row];
  const int64_t first = p.window > 0 ? max(static_cast<int64_t>(0), pos - p.window + 1) : 0;
  const int64_t n = pos - first + 1;
  const float* q = p.q + row * p.q_row_stride + static_cast<int64_t>(head) * p.qk_dim;
  for (int i = threadIdx.x; i < p.qk_dim; i += blockDim.x) q_shared[i] = q[i];
  __syncthreads();
  const int64_t kv_head = head / p.group_size;
  const int32_t* table = p.block_tables + row * p.max_blocks;
  float* scores = p.scratch + static_cast<int64_t>(blockIdx.x) * p.max_context;
  // fp8 attention: this KV head's scale sits at the same offset in every unit.
  const int64_t head_scale = kv_head * kv::kFp8ScaleBytes;

  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const int64_t t = first + j;
    const int32_t slot = table[t / l.block_tokens];
    const uint8_t* key =
        EntryPtr(l, slot, t % l.block_tokens, l.k_offset + kv_head * l.head_stride);
    const uint8_t* key_scale = UnitPtr(l, slot) + l.k_scale_offset + head_scale;
    float dot = 0.0f;
    for (int i = 0; i < p.qk_dim; ++i) dot += q_shared[i] * LoadCacheValue(l, key, key_scale, i);
    dot *= p.scale;
    scores[j] = dot;
    local_max = fmaxf(local_max, dot);
  }
  const float m = BlockReduce<true>(local_max, reduce);
  float local_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float e = expf(scores[j] - m);
    scores[j] = e;
    local_sum += e;
  }
  const float sum = BlockReduce<false>(local_sum, reduce);  // also a barrier for scores[]
  const float inv = 1.0f / sum;
  float* out = p.out + (row * p.heads + head) * static_cast<int64_t>(p.v_dim);
  for (int d = threadIdx.x; d < p.v_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = first + j;
      const int32_t slot = table[t / l.block_tokens];
      const uint8_t* value =
          EntryPtr(l, slot, t % l.block_tokens, l.v_offset + kv_head * l.head_stride);
      const uint8_t* value_scale = UnitPtr(l, slot) + l.v_scale_offset + head_scale;
      acc += scores[j] * LoadCacheValue(l, value, value_scale, d);
    }
    out[d] = acc * inv;
  }
}

__global__ void CopyRowsKernel(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t n) {
  const int64_t r = blockIdx.x;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[r * ldd + i] = src[r * lds + i];
}

// One block per row of logits [rows, n]: out[r] = the argmax of row r with model::Greedy's
// sequential rule (best = 0; best = i when x[i] > x[best]): a NaN never wins, except that a
// NaN at index 0 is never beaten; among equal maxima the lowest index. blockDim.x <= 1024.
__global__ void ArgmaxKernel(const float* logits, int64_t n, int32_t* out) {
  __shared__ float best_value[1024];
  __shared__ int64_t best_index[1024];
  const float* x = logits + blockIdx.x * n;
  float v = -INFINITY;
  int64_t at = -1;  // -1: no candidate seen (only NaNs, or nothing)
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float xi = x[i];
    // Indices rise within a thread, so a strict > keeps the lowest index among equals.
    if (!isnan(xi) && (at < 0 || xi > v)) {
      v = xi;
      at = i;
    }
  }
  best_value[threadIdx.x] = v;
  best_index[threadIdx.x] = at;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      const float ov = best_value[threadIdx.x + stride];
      const int64_t oi = best_index[threadIdx.x + stride];
      const float mv = best_value[threadIdx.x];
      const int64_t mi = best_index[threadIdx.x];
      if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) {
        best_value[threadIdx.x] = ov;
        best_index[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int64_t winner = isnan(x[0]) || best_index[0] < 0 ? 0 : best_index[0];
    out[blockIdx.x] = static_cast<int32_t>(winner);
  }
}

__device__ __forceinline__ uint64_t SplitMixDev(uint64_t x) {
  uint64_t z = x + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void FillRandomKernel(void* dst, bool bf16, int64_t n, uint64_t seed, float mean,
                                 float stddev) {
  const float half_width = 1.7320508f * stddev;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = SplitMixDev(seed ^ (static_cast<uint64_t>(i) * 0xd1342543de82ef95ull));
    const float u = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    const float v = mean + (2.0f * u - 1.0f) * half_width;
    if (bf16) {
      static_cast<uint16_t*>(dst)[i] = FloatToBf16Dev(v);
    } else {
      static_cast<float*>(dst)[i] = v;
    }
  }
}

}  // namespace kvrelay::model::cuda::internal
