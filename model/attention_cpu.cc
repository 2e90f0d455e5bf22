#include "model/attention_cpu.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "model/cpu_isa.h"

namespace kvrelay::model {
namespace {

constexpr int64_t kQueriesPerBlock = 4;

float PairwiseSum16(const float* p) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = p[2 * i] + p[2 * i + 1];
  for (int i = 0; i < 4; ++i) s4[i] = s8[2 * i] + s8[2 * i + 1];
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

// exp(x) for x <= 0 (softmax weights), the same operations in both kernels: x = n ln2 + r
// (Cody-Waite, two FMAs), Cephes' degree-6 polynomial for e^r by FMAs, times 2^n (exact scaling,
// rounded once if subnormal). About 1 ulp; 0 below -87.33 (where e^x < FLT_MIN).
constexpr float kExpLowest = -87.33654f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpC[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                            4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};

float ExpPortable(float x) {
  if (x < kExpLowest) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(-n, kLn2Hi, x);
  r = std::fma(-n, kLn2Lo, r);
  float p = kExpC[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpC[i]);
  const float y = std::fma(p, r * r, r) + 1.0f;
  return std::ldexp(y, static_cast<int>(n));
}

__attribute__((target("avx512f"))) __m512 Exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLowest), _CMP_GE_OQ);
  // The _mask_ forms with an explicit source: GCC 12's unmasked ones trip
  // -Wmaybe-uninitialized on their internal _mm512_undefined_ps().
  const __m512 zero = _mm512_setzero_ps();
  const __m512 n = _mm512_mask_roundscale_ps(zero, 0xFFFF, _mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 neg_n = _mm512_sub_ps(zero, n);
  __m512 r = _mm512_fmadd_ps(neg_n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fmadd_ps(neg_n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpC[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_mask_scalef_ps(zero, live, y, n);
}

float SoftcapAndMax(const AttentionQuery& query, int64_t u_first, float softcap, float* row) {
  float max_score = -INFINITY;
  for (int64_t j = query.first; j <= query.last; ++j) {
    float s = row[j - u_first];
    if (softcap > 0) s = softcap * std::tanh(s / softcap);
    row[j - u_first] = s;
    max_score = std::max(max_score, s);
  }
  return max_score;
}

void ZeroOutside(const AttentionQuery& query, int64_t u_first, int64_t u_last, float* row) {
  for (int64_t j = u_first; j < query.first; ++j) row[j - u_first] = 0.0f;
  for (int64_t j = query.last + 1; j <= u_last; ++j) row[j - u_first] = 0.0f;
}

// row[j - u_first] holds query's scaled score for key j in [u_first, u_last]. Leaves exp
// weights for [first, last] and 0 elsewhere in [u_first, u_last]; returns 1 / sum of weights.
float SoftmaxRow(const AttentionQuery& query, int64_t u_first, int64_t u_last, float softcap,
                 float* row) {
  const float max_score = SoftcapAndMax(query, u_first, softcap, row);
  float partial[16] = {};
  for (int64_t j = query.first; j <= query.last; ++j) {
    const float e = ExpPortable(row[j - u_first] - max_score);
    row[j - u_first] = e;
    partial[(j - query.first) & 15] += e;
  }
  ZeroOutside(query, u_first, u_last, row);
  return 1.0f / PairwiseSum16(partial);
}

// SoftmaxRow with 16 keys per vector: lane l holds keys first + l (mod 16), as the partial
// sums do, so the result is the same bits.
__attribute__((target("avx512f"))) float Avx512SoftmaxRow(const AttentionQuery& query,
                                                          int64_t u_first, int64_t u_last,
                                                          float softcap, float* row) {
  const float max_score = SoftcapAndMax(query, u_first, softcap, row);
  const __m512 mx = _mm512_set1_ps(max_score);
  __m512 partial = _mm512_setzero_ps();
  float* r = row + (query.first - u_first);
  const int64_t n = query.last - query.first + 1;
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t left = n - j;
    const __mmask16 m =
        left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, r + j), mx));
    partial = _mm512_add_ps(partial, _mm512_maskz_mov_ps(m, e));
    _mm512_mask_storeu_ps(r + j, m, e);
  }
  float lanes[16];
  _mm512_storeu_ps(lanes, partial);
  ZeroOutside(query, u_first, u_last, row);
  return 1.0f / PairwiseSum16(lanes);
}

struct Block {
  const AttentionQuery* queries;
  int64_t count;
  int32_t qk_dim;
  const float* keys_t;
  int64_t stride;
  const float* values;
  int64_t v_stride;
  int32_t v_dim;
  float scale;
  float softcap;
  float* scratch;  // [count][stride]
  int64_t u_first;
  int64_t u_last;
};

using Isa = CpuIsa;

// The portable kernel with keys (scores) and value dimensions (output) innermost so GCC
// vectorises it where FMA is available (the AVX2 clone below); std::fma keeps each element's
// chain the definition's either way.
[[gnu::always_inline]] inline void PortableBlockBody(const Block& b) {
  for (int64_t qi = 0; qi < b.count; ++qi) {
    const AttentionQuery& query = b.queries[qi];
    float* row = b.scratch + qi * b.stride;
    for (int64_t j0 = query.first; j0 <= query.last; j0 += 16) {
      float acc[16] = {};
      // Reads keys up to j0 + 15 <= last + 15, inside the row's padding.
      for (int32_t d = 0; d < b.qk_dim; ++d) {
        const float qd = query.q[d];
        const float* kt = b.keys_t + d * b.stride + j0;
        for (int l = 0; l < 16; ++l) acc[l] = std::fma(qd, kt[l], acc[l]);
      }
      const int64_t keys = std::min<int64_t>(16, query.last - j0 + 1);
      for (int64_t l = 0; l < keys; ++l) row[j0 + l - b.u_first] = acc[l] * b.scale;
    }
    const float inv = SoftmaxRow(query, b.u_first, b.u_last, b.softcap, row);
    for (int32_t d0 = 0; d0 < b.v_dim; d0 += 64) {
      const int32_t dims = std::min(64, b.v_dim - d0);
      float acc[64] = {};
      for (int64_t j = query.first; j <= query.last; ++j) {
        const float p = row[j - b.u_first];
        const float* v = b.values + j * b.v_stride + d0;
        for (int32_t l = 0; l < dims; ++l) acc[l] = std::fma(p, v[l], acc[l]);
      }
      for (int32_t l = 0; l < dims; ++l) query.out[d0 + l] = acc[l] * inv;
    }
  }
}

void PortableBlock(const Block& b) { PortableBlockBody(b); }
__attribute__((target("avx2,fma"))) void Avx2Block(const Block& b) { PortableBlockBody(b); }

template <int kQ>
__attribute__((target("avx512f"))) void Avx512Scores(const Block& b) {
  const float* q[kQ];
  for (int i = 0; i < kQ; ++i) q[i] = b.queries[i].q;
  const __m512 scale = _mm512_set1_ps(b.scale);
  for (int64_t j0 = b.u_first; j0 <= b.u_last; j0 += 64) {
    __m512 acc[kQ][4];
    for (int i = 0; i < kQ; ++i) {
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    }
    const float* kt = b.keys_t + j0;
    for (int32_t d = 0; d < b.qk_dim; ++d, kt += b.stride) {
      const __m512 k0 = _mm512_loadu_ps(kt);
      const __m512 k1 = _mm512_loadu_ps(kt + 16);
      const __m512 k2 = _mm512_loadu_ps(kt + 32);
      const __m512 k3 = _mm512_loadu_ps(kt + 48);
      for (int i = 0; i < kQ; ++i) {
        const __m512 a = _mm512_set1_ps(q[i][d]);
        acc[i][0] = _mm512_fmadd_ps(a, k0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(a, k1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(a, k2, acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(a, k3, acc[i][3]);
      }
    }
    for (int i = 0; i < kQ; ++i) {
      float* row = b.scratch + i * b.stride + (j0 - b.u_first);
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(row + 16 * c, _mm512_mul_ps(acc[i][c], scale));
    }
  }
}

template <int kQ>
__attribute__((target("avx512f"))) void Avx512Values(const Block& b, const float* inv) {
  for (int32_t d0 = 0; d0 < b.v_dim; d0 += 64) {
    __mmask16 mask[4];
    for (int c = 0; c < 4; ++c) {
      const int32_t left = b.v_dim - d0 - 16 * c;
      mask[c] = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                : left > 0 ? static_cast<__mmask16>((1u << left) - 1)
                           : static_cast<__mmask16>(0);
    }
    __m512 acc[kQ][4];
    for (int i = 0; i < kQ; ++i) {
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    }
    for (int64_t j = b.u_first; j <= b.u_last; ++j) {
      const float* v = b.values + j * b.v_stride + d0;
      const __m512 v0 = _mm512_maskz_loadu_ps(mask[0], v);
      const __m512 v1 = _mm512_maskz_loadu_ps(mask[1], v + 16);
      const __m512 v2 = _mm512_maskz_loadu_ps(mask[2], v + 32);
      const __m512 v3 = _mm512_maskz_loadu_ps(mask[3], v + 48);
      for (int i = 0; i < kQ; ++i) {
        const __m512 p = _mm512_set1_ps(b.scratch[i * b.stride + (j - b.u_first)]);
        acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(p, v2, acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(p, v3, acc[i][3]);
      }
    }
    for (int i = 0; i < kQ; ++i) {
      const __m512 s = _mm512_set1_ps(inv[i]);
      float* out = b.queries[i].out + d0;
      for (int c = 0; c < 4; ++c) {
        _mm512_mask_storeu_ps(out + 16 * c, mask[c], _mm512_mul_ps(acc[i][c], s));
      }
    }
  }
}

template <int kQ>
void Avx512Block(const Block& b) {
  Avx512Scores<kQ>(b);
  float inv[kQ];
  for (int i = 0; i < kQ; ++i) {
    inv[i] =
        Avx512SoftmaxRow(b.queries[i], b.u_first, b.u_last, b.softcap, b.scratch + i * b.stride);
  }
  Avx512Values<kQ>(b, inv);
}

void Run(Isa isa, const AttentionQuery* queries, int64_t count, int32_t qk_dim, const float* keys_t,
         int64_t keys_t_stride, const float* values, int64_t v_stride, int32_t v_dim, float scale,
         float softcap, float* scratch) {
  for (int64_t q0 = 0; q0 < count; q0 += kQueriesPerBlock) {
    Block b;
    b.queries = queries + q0;
    b.count = std::min(kQueriesPerBlock, count - q0);
    b.qk_dim = qk_dim;
    b.keys_t = keys_t;
    b.stride = keys_t_stride;
    b.values = values;
    b.v_stride = v_stride;
    b.v_dim = v_dim;
    b.scale = scale;
    b.softcap = softcap;
    b.scratch = scratch;
    b.u_first = b.queries[0].first;
    b.u_last = b.queries[0].last;
    for (int64_t i = 1; i < b.count; ++i) {
      b.u_first = std::min(b.u_first, b.queries[i].first);
      b.u_last = std::max(b.u_last, b.queries[i].last);
    }
    if (isa == Isa::kPortable) {
      PortableBlock(b);
      continue;
    }
    if (isa == Isa::kAvx2) {
      Avx2Block(b);
      continue;
    }
    switch (b.count) {
      case 4:
        Avx512Block<4>(b);
        break;
      case 3:
        Avx512Block<3>(b);
        break;
      case 2:
        Avx512Block<2>(b);
        break;
      default:
        Avx512Block<1>(b);
        break;
    }
  }
}

}  // namespace

void AttendQueries(const AttentionQuery* queries, int64_t count, int32_t qk_dim,
                   const float* keys_t, int64_t keys_t_stride, const float* values,
                   int64_t v_stride, int32_t v_dim, float scale, float softcap, float* scratch) {
  Run(BestCpuIsa(), queries, count, qk_dim, keys_t, keys_t_stride, values, v_stride, v_dim, scale,
      softcap, scratch);
}

void AttendQueriesForTest(AttentionKernel kernel, const AttentionQuery* queries, int64_t count,
                          int32_t qk_dim, const float* keys_t, int64_t keys_t_stride,
                          const float* values, int64_t v_stride, int32_t v_dim, float scale,
                          float softcap, float* scratch) {
  Isa isa = Isa::kPortable;
  if (kernel == AttentionKernel::kAuto) isa = BestCpuIsa();
  if (kernel == AttentionKernel::kAvx2 && BestCpuIsa() != Isa::kPortable) isa = Isa::kAvx2;
  Run(isa, queries, count, qk_dim, keys_t, keys_t_stride, values, v_stride, v_dim, scale, softcap,
      scratch);
}

}  // namespace kvrelay::model
