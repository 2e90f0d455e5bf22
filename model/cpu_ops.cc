#include "model/cpu_ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "common/check.h"
#include "kv/fp8.h"
#include "model/numeric.h"

namespace kvrelay::model {
namespace {

// Calls fn(begin, count) for tiles of [0, rows) cut at multiples of tile counted from
// first_position.
template <typename Fn>
void ForEachTile(int64_t rows, int64_t first_position, int64_t tile, Fn fn) {
  if (tile <= 0) {
    if (rows > 0) fn(0, rows);
    return;
  }
  int64_t r = 0;
  while (r < rows) {
    const int64_t pos = first_position + r;
    const int64_t next_boundary = (pos / tile + 1) * tile;
    const int64_t count = std::min(rows - r, next_boundary - pos);
    fn(r, count);
    r += count;
  }
}

// Batch-invariant y = x w^T: blocks of weight rows stay in cache while every x row passes;
// each element is one fixed-order Dot.
void RowwiseLinear(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
                   int64_t ldx, int64_t ldy) {
  constexpr int64_t kBlock = 32;
  const int64_t blocks = (out + kBlock - 1) / kBlock;
  ParallelFor(BlasThreads(), blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * kBlock, o1 = std::min(out, o0 + kBlock);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        float* yr = y + r * ldy;
        for (int64_t o = o0; o < o1; ++o) yr[o] = Dot(xr, w + o * in, in);
      }
    }
  });
}

// Batch-invariant y = x w (w [in, out], row stride ldw): y[r, o] accumulates x[r, i] w[i, o]
// over i in order.
void RowwiseLinearNoTrans(const float* x, int64_t rows, int64_t in, const float* w, int64_t out,
                          float* y, int64_t ldx, int64_t ldw, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * ldy;
    const float* xr = x + r * ldx;
    std::fill(yr, yr + out, 0.0f);
    for (int64_t i = 0; i < in; ++i) {
      const float xi = xr[i];
      const float* wi = w + i * ldw;
      for (int64_t o = 0; o < out; ++o) yr[o] += xi * wi[o];
    }
  }
}

}  // namespace

void Linear(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
            int64_t first_row_position, int64_t tile_rows, int64_t ldx, int64_t ldy) {
  if (ldx == 0) ldx = in;
  if (ldy == 0) ldy = out;
  if (tile_rows == kRowwiseTiles) {
    RowwiseLinear(x, rows, in, w, out, y, ldx, ldy);
    return;
  }
  ForEachTile(rows, first_row_position, tile_rows, [&](int64_t r, int64_t m) {
    if (m == 1) {
      // One row (decode): sgemv streams the weights once instead of packing them.
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(out), static_cast<blasint>(in),
                  1.0f, w, static_cast<blasint>(in), x + r * ldx, 1, 0.0f, y + r * ldy, 1);
      return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m),
                static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, x + r * ldx,
                static_cast<blasint>(ldx), w, static_cast<blasint>(in), 0.0f, y + r * ldy,
                static_cast<blasint>(ldy));
  });
}

void LinearNoTrans(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
                   int64_t first_row_position, int64_t tile_rows, int64_t ldx, int64_t ldw,
                   int64_t ldy) {
  if (tile_rows == kRowwiseTiles) {
    RowwiseLinearNoTrans(x, rows, in, w, out, y, ldx, ldw, ldy);
    return;
  }
  ForEachTile(rows, first_row_position, tile_rows, [&](int64_t r, int64_t m) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(m),
                static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, x + r * ldx,
                static_cast<blasint>(ldx), w, static_cast<blasint>(ldw), 0.0f, y + r * ldy,
                static_cast<blasint>(ldy));
  });
}

void RmsNorm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* out,
             int64_t ldx, int64_t ldout) {
  if (ldx == 0) ldx = dim;
  if (ldout == 0) ldout = dim;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* o = out + r * ldout;
    const float ss = Dot(xr, xr, dim);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * w[i];
  }
}

void ApplyRope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
               int64_t head_stride, const int64_t* positions, absl::Span<const float> inv_freq,
               float attention_factor, RopeStyle style) {
  const int32_t half = dim / 2;
  KV_CHECK(static_cast<int32_t>(inv_freq.size()) == half);
  std::vector<float> cos_v(half), sin_v(half), tmp(dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float pos = static_cast<float>(positions[r]);
    for (int32_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cos_v[i] = std::cos(angle);
      sin_v[i] = std::sin(angle);
      if (attention_factor != 1.0f) {
        cos_v[i] *= attention_factor;
        sin_v[i] *= attention_factor;
      }
    }
    for (int32_t h = 0; h < num_heads; ++h) {
      float* v = x + r * row_stride + h * head_stride;
      for (int32_t i = 0; i < half; ++i) {
        const float a = style == RopeStyle::kHalf ? v[i] : v[2 * i];
        const float b = style == RopeStyle::kHalf ? v[i + half] : v[2 * i + 1];
        tmp[i] = a * cos_v[i] - b * sin_v[i];
        tmp[i + half] = b * cos_v[i] + a * sin_v[i];
      }
      std::memcpy(v, tmp.data(), sizeof(float) * dim);
    }
  }
}

void ApplyRope(float* x, int64_t rows, int32_t num_heads, int32_t dim, int64_t row_stride,
               int64_t head_stride, const int64_t* positions, double theta, RopeStyle style) {
  std::vector<float> inv_freq(dim / 2);
  for (int32_t i = 0; i < dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(1.0 / std::pow(theta, (2.0 * i) / dim));
  }
  ApplyRope(x, rows, num_heads, dim, row_stride, head_stride, positions, inv_freq, 1.0f, style);
}

void SiluMul(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
}

void GeluTanhMul(float* a, const float* b, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = a[i];
    a[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x))) * b[i];
  }
}

void ActivationMul(Activation act, float* a, const float* b, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kInvSqrt2 = 0.7071067811865476f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = a[i];
    float y;
    switch (act) {
      case Activation::kSilu:
        y = x / (1.0f + std::exp(-x));
        break;
      case Activation::kGeluTanh:
        y = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
        break;
      case Activation::kGeluErf:
      default:
        y = 0.5f * x * (1.0f + std::erf(x * kInvSqrt2));
        break;
    }
    a[i] = b != nullptr ? y * b[i] : y;
  }
}

void AddBias(float* x, int64_t rows, int64_t n, const float* bias, int64_t ld) {
  if (ld == 0) ld = n;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) x[r * ld + i] += bias[i];
  }
}

void SoftCap(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

void LayerNorm(const float* x, int64_t rows, int64_t dim, const float* w, const float* b, float eps,
               float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < dim; ++i) sum[i % 8] += xr[i];
    const float mean =
        (((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]))) /
        static_cast<float>(dim);
    float sq[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < dim; ++i) {
      const float d = xr[i] - mean;
      sq[i % 8] += d * d;
    }
    const float var = (((sq[0] + sq[1]) + (sq[2] + sq[3])) + ((sq[4] + sq[5]) + (sq[6] + sq[7]))) /
                      static_cast<float>(dim);
    const float inv = 1.0f / std::sqrt(var + eps);
    for (int64_t i = 0; i < dim; ++i) o[i] = (xr[i] - mean) * inv * w[i] + b[i];
  }
}

void StoreCacheValues(const float* src, int64_t n, kv::DType dtype, uint8_t* dst) {
  switch (dtype) {
    case kv::DType::kFp32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case kv::DType::kBf16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t v = FloatToBf16(src[i]);
        std::memcpy(dst + 2 * i, &v, 2);
      }
      return;
    case kv::DType::kFp16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t v = FloatToFp16(src[i]);
        std::memcpy(dst + 2 * i, &v, 2);
      }
      return;
    case kv::DType::kFp8:
      break;
  }
  KV_CHECK(false && "fp8 cache values go through StoreFp8AttentionHead / StoreFp8MlaEntry");
}

void LoadCacheValues(const uint8_t* src, int64_t n, kv::DType dtype, float* dst) {
  switch (dtype) {
    case kv::DType::kFp32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case kv::DType::kBf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        dst[i] = Bf16ToFloat(v);
      }
      return;
    case kv::DType::kFp16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        dst[i] = Fp16ToFloat(v);
      }
      return;
    case kv::DType::kFp8:
      break;
  }
  KV_CHECK(false && "fp8 cache values go through LoadFp8AttentionHead / LoadFp8MlaEntry");
}

namespace {

float LoadFloat(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof(f));
  return f;
}

void StoreFloat(float f, uint8_t* p) { std::memcpy(p, &f, sizeof(f)); }

}  // namespace

void StoreFp8AttentionHead(const float* src, int32_t n, bool first_in_block, uint8_t* scale,
                           uint8_t* dst) {
  int32_t k;
  if (first_in_block) {
    k = kv::Fp8BlockScaleExp(kv::Fp8FiniteAmax(src, n));
    StoreFloat(kv::Fp8ScaleFromExp(k), scale);
  } else {
    k = kv::Fp8StoredScaleExp(LoadFloat(scale));
  }
  for (int32_t i = 0; i < n; ++i) dst[i] = kv::QuantizeE4M3(src[i], k);
}

void LoadFp8AttentionHead(const uint8_t* src, int32_t n, const uint8_t* scale, float* dst) {
  const float s = LoadFloat(scale);
  for (int32_t i = 0; i < n; ++i) dst[i] = kv::DequantizeE4M3(src[i], s);
}

void StoreFp8MlaEntry(const kv::ModelLayout& layout, int group, const float* src, uint8_t* entry) {
  const kv::LayerGroup& g = layout.groups()[group];
  uint8_t* scales = entry + layout.MlaScaleOffset(group);
  for (int32_t t0 = 0, tile = 0; t0 < g.latent_dim; t0 += kv::kFp8MlaTile, ++tile) {
    const int32_t n = std::min(kv::kFp8MlaTile, g.latent_dim - t0);
    const int32_t k = kv::Fp8TileScaleExp(kv::Fp8FiniteAmax(src + t0, n));
    StoreFloat(kv::Fp8ScaleFromExp(k), scales + int64_t{tile} * kv::kFp8ScaleBytes);
    for (int32_t i = 0; i < n; ++i) entry[t0 + i] = kv::QuantizeE4M3(src[t0 + i], k);
  }
  StoreCacheValues(src + g.latent_dim, g.rope_dim, kv::DType::kBf16,
                   entry + layout.MlaRopeOffset(group));
}

void LoadFp8MlaEntry(const kv::ModelLayout& layout, int group, const uint8_t* entry, float* dst) {
  const kv::LayerGroup& g = layout.groups()[group];
  const uint8_t* scales = entry + layout.MlaScaleOffset(group);
  for (int32_t t0 = 0, tile = 0; t0 < g.latent_dim; t0 += kv::kFp8MlaTile, ++tile) {
    const int32_t n = std::min(kv::kFp8MlaTile, g.latent_dim - t0);
    const float s = LoadFloat(scales + int64_t{tile} * kv::kFp8ScaleBytes);
    for (int32_t i = 0; i < n; ++i) dst[t0 + i] = kv::DequantizeE4M3(entry[t0 + i], s);
  }
  LoadCacheValues(entry + layout.MlaRopeOffset(group), g.rope_dim, kv::DType::kBf16,
                  dst + g.latent_dim);
}

float Dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += a[i + k] * b[i + k];
  }
  for (int k = 0; i < n; ++i, ++k) acc[k] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void AttendOne(const float* q, int32_t qk_dim, const float* k, int64_t k_stride, const float* v,
               int64_t v_stride, int32_t v_dim, int64_t n_ctx, float scale, float* scratch,
               float* out, float softcap) {
  float max_score = -INFINITY;
  for (int64_t j = 0; j < n_ctx; ++j) {
    scratch[j] = Dot(q, k + j * k_stride, qk_dim) * scale;
    if (softcap > 0) scratch[j] = softcap * std::tanh(scratch[j] / softcap);
    max_score = std::max(max_score, scratch[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n_ctx; ++j) {
    scratch[j] = std::exp(scratch[j] - max_score);
    sum += scratch[j];
  }
  std::fill(out, out + v_dim, 0.0f);
  for (int64_t j = 0; j < n_ctx; ++j) {
    const float p = scratch[j];
    const float* vj = v + j * v_stride;
    for (int32_t d = 0; d < v_dim; ++d) out[d] += p * vj[d];
  }
  const float inv = 1.0f / sum;
  for (int32_t d = 0; d < v_dim; ++d) out[d] *= inv;
}

void GatherLayer(const kv::ModelLayout& layout, int group, int32_t index_in_group,
                 const std::vector<const uint8_t*>& block_units, int64_t begin, int64_t end,
                 float* k_out, float* v_out) {
  const kv::LayerGroup& g = layout.groups()[group];
  const int64_t bt = layout.block_tokens();
  const kv::DType dtype = layout.dtype();
  const int64_t esize = kv::DTypeBytes(dtype);
  if (g.kind == kv::LayerKind::kMlaLatent) {
    const int64_t entry_bytes = layout.MlaEntryBytes(group);
    const int64_t entry = g.latent_dim + g.rope_dim;
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* src = block_units[p / bt] + (index_in_group * bt + p % bt) * entry_bytes;
      float* dst = k_out + (p - begin) * entry;
      if (layout.IsFp8()) {
        LoadFp8MlaEntry(layout, group, src, dst);
      } else {
        LoadCacheValues(src, entry, dtype, dst);
      }
    }
    return;
  }
  const int64_t per_token = int64_t{g.num_kv_heads} * g.head_dim;
  for (int64_t p = begin; p < end; ++p) {
    // The layer's strip: K then V, [bt][heads][head_dim] each, then (fp8) the scales.
    const uint8_t* strip = block_units[p / bt] + index_in_group * layout.LayerStripBytes(group);
    for (int kv = 0; kv < 2; ++kv) {
      const uint8_t* src = strip + (kv * bt + p % bt) * per_token * esize;
      float* dst = (kv == 0 ? k_out : v_out) + (p - begin) * per_token;
      if (!layout.IsFp8()) {
        LoadCacheValues(src, per_token, dtype, dst);
        continue;
      }
      for (int32_t h = 0; h < g.num_kv_heads; ++h) {
        LoadFp8AttentionHead(src + int64_t{h} * g.head_dim, g.head_dim,
                             strip + layout.Fp8ScaleOffset(group, kv, h),
                             dst + int64_t{h} * g.head_dim);
      }
    }
  }
}

void ParallelFor(int threads, int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  if (threads <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) {
    const int64_t b = n * t / threads;
    const int64_t e = n * (t + 1) / threads;
    workers.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(0, n / threads);
  for (std::thread& w : workers) w.join();
}

void SetBlasThreads(int threads) { openblas_set_num_threads(std::max(1, threads)); }
int BlasThreads() { return openblas_get_num_threads(); }

}  // namespace kvrelay::model
