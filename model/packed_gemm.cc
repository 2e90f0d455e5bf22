#include "model/packed_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "model/cpu_isa.h"
#include "model/cpu_ops.h"

namespace kvrelay::model {
namespace {

constexpr int64_t kCols = PackedWeights::kPanelColumns;
// Rows per micro-tile: 8 rows x 2 zmm = 16 accumulators, enough independent FMA chains to hide
// the FMA latency with registers left for the weight vectors.
constexpr int64_t kMicroRows = 8;
// Cache blocking: a [kRowBlock, kDepthBlock] slice of x (256 KiB) stays in L2 while every
// panel's [kDepthBlock, 32] slice (32 KiB) passes through L1. Blocking changes only where a
// partial sum is parked (in y, exactly), never the order of the FMAs.
constexpr int64_t kRowBlock = 256;
constexpr int64_t kDepthBlock = 256;

struct Tile {
  const float* x;  // packed rows: element (i, k) at x[k * kMicroRows + i]
  const float* w;  // [kc][kCols] panel slice
  int64_t kc;
  float* y;  // [m, cols] at row stride ldy
  int64_t ldy;
  int64_t cols;  // valid columns, 1..kCols
  bool first;    // first depth block: start from 0 instead of y
};

using Isa = CpuIsa;

// The portable tile, columns innermost so that GCC vectorises it where FMA is available (the
// AVX2 clone below: four ymm FMAs per panel row); std::fma keeps every element's chain the
// same exact FMAs either way.
template <int kRows>
[[gnu::always_inline]] inline void PortableTileBody(const Tile& t) {
  float acc[kRows][kCols];
  for (int i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < kCols; ++j) {
      acc[i][j] = t.first || j >= t.cols ? 0.0f : t.y[i * t.ldy + j];
    }
  }
  for (int64_t k = 0; k < t.kc; ++k) {
    const float* w = t.w + k * kCols;
    const float* x = t.x + k * kMicroRows;
    for (int i = 0; i < kRows; ++i) {
      const float a = x[i];
      for (int64_t j = 0; j < kCols; ++j) acc[i][j] = std::fma(a, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < t.cols; ++j) t.y[i * t.ldy + j] = acc[i][j];
  }
}

template <int kRows>
void PortableTile(const Tile& t) {
  PortableTileBody<kRows>(t);
}

template <int kRows>
__attribute__((target("avx2,fma"))) void Avx2Tile(const Tile& t) {
  PortableTileBody<kRows>(t);
}

#define KVRELAY_TILE_SWITCH(fn, t, m) \
  switch (m) {                        \
    case 8:                           \
      return fn<8>(t);                \
    case 7:                           \
      return fn<7>(t);                \
    case 6:                           \
      return fn<6>(t);                \
    case 5:                           \
      return fn<5>(t);                \
    case 4:                           \
      return fn<4>(t);                \
    case 3:                           \
      return fn<3>(t);                \
    case 2:                           \
      return fn<2>(t);                \
    default:                          \
      return fn<1>(t);                \
  }

void PortableTileRows(const Tile& t, int64_t m) { KVRELAY_TILE_SWITCH(PortableTile, t, m) }
void Avx2TileRows(const Tile& t, int64_t m) { KVRELAY_TILE_SWITCH(Avx2Tile, t, m) }

template <int kRows>
__attribute__((target("avx512f"))) void Avx512Tile(const Tile& t) {
  static_assert(kCols == 32, "two zmm vectors per panel row");
  const __mmask16 mask0 =
      t.cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << t.cols) - 1);
  const int64_t rest = t.cols - 16;
  const __mmask16 mask1 = rest >= 16 ? static_cast<__mmask16>(0xFFFF)
                          : rest > 0 ? static_cast<__mmask16>((1u << rest) - 1)
                                     : static_cast<__mmask16>(0);
  __m512 acc0[kRows], acc1[kRows];
  for (int i = 0; i < kRows; ++i) {
    if (t.first) {
      acc0[i] = _mm512_setzero_ps();
      acc1[i] = _mm512_setzero_ps();
    } else {
      acc0[i] = _mm512_maskz_loadu_ps(mask0, t.y + i * t.ldy);
      acc1[i] = _mm512_maskz_loadu_ps(mask1, t.y + i * t.ldy + 16);
    }
  }
  const float* w = t.w;
  const float* x = t.x;
  for (int64_t k = 0; k < t.kc; ++k, w += kCols, x += kMicroRows) {
    const __m512 w0 = _mm512_loadu_ps(w);
    const __m512 w1 = _mm512_loadu_ps(w + 16);
    for (int i = 0; i < kRows; ++i) {
      const __m512 a = _mm512_set1_ps(x[i]);
      acc0[i] = _mm512_fmadd_ps(a, w0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(a, w1, acc1[i]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    _mm512_mask_storeu_ps(t.y + i * t.ldy, mask0, acc0[i]);
    _mm512_mask_storeu_ps(t.y + i * t.ldy + 16, mask1, acc1[i]);
  }
}

__attribute__((target("avx512f"))) void Avx512TileRows(const Tile& t, int64_t m) {
  switch (m) {
    case 8:
      return Avx512Tile<8>(t);
    case 7:
      return Avx512Tile<7>(t);
    case 6:
      return Avx512Tile<6>(t);
    case 5:
      return Avx512Tile<5>(t);
    case 4:
      return Avx512Tile<4>(t);
    case 3:
      return Avx512Tile<3>(t);
    case 2:
      return Avx512Tile<2>(t);
    default:
      return Avx512Tile<1>(t);
  }
}

// Rows [r0, r1) x panels [p0, p1) of y.
void RunBlock(Isa isa, const float* x, int64_t ldx, const PackedWeights& w, float* y, int64_t ldy,
              int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
  const int64_t in = w.in();
  // x's [rows, depth] block copied into micro-tile order (tile, k, row): the kernel's broadcasts
  // then read one contiguous stream instead of 8 rows whose addresses (4 KiB apart for
  // in = 1024) all fall into the same L1 set.
  std::vector<float> x_block(static_cast<size_t>(kRowBlock * kDepthBlock));
  for (int64_t rb = r0; rb < r1; rb += kRowBlock) {
    const int64_t rb_end = std::min(r1, rb + kRowBlock);
    for (int64_t kb = 0; kb < in; kb += kDepthBlock) {
      const int64_t kc = std::min(in - kb, kDepthBlock);
      for (int64_t i = rb; i < rb_end; i += kMicroRows) {
        float* dst = x_block.data() + (i - rb) * kc;
        const int64_t m = std::min(kMicroRows, rb_end - i);
        for (int64_t ii = 0; ii < m; ++ii) {
          const float* src = x + (i + ii) * ldx + kb;
          for (int64_t k = 0; k < kc; ++k) dst[k * kMicroRows + ii] = src[k];
        }
      }
      for (int64_t p = p0; p < p1; ++p) {
        Tile t;
        t.w = w.panel(p) + kb * kCols;
        t.kc = kc;
        t.ldy = ldy;
        t.cols = std::min(kCols, w.out() - p * kCols);
        t.first = kb == 0;
        for (int64_t i = rb; i < rb_end; i += kMicroRows) {
          const int64_t m = std::min(kMicroRows, rb_end - i);
          t.x = x_block.data() + (i - rb) * kc;
          t.y = y + i * ldy + p * kCols;
          switch (isa) {
            case Isa::kAvx512:
              Avx512TileRows(t, m);
              break;
            case Isa::kAvx2:
              Avx2TileRows(t, m);
              break;
            case Isa::kPortable:
              PortableTileRows(t, m);
              break;
          }
        }
      }
    }
  }
}

void Run(Isa isa, const float* x, int64_t rows, const PackedWeights& w, float* y, int threads,
         int64_t ldx, int64_t ldy) {
  if (ldx == 0) ldx = w.in();
  if (ldy == 0) ldy = w.out();
  if (rows <= 0 || w.empty()) return;
  if (w.in() == 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill(y + r * ldy, y + r * ldy + w.out(), 0.0f);
    return;
  }
  const int64_t panels = w.panels();
  if (panels >= threads && rows < threads * kRowBlock) {
    // Few rows: threads split output columns.
    ParallelFor(threads, panels,
                [&](int64_t p0, int64_t p1) { RunBlock(isa, x, ldx, w, y, ldy, 0, rows, p0, p1); });
  } else {
    // Threads split rows: each copies only its own x blocks, and the weights (read by both)
    // stay in the shared L3.
    const int64_t tiles = (rows + kMicroRows - 1) / kMicroRows;
    ParallelFor(threads, tiles, [&](int64_t t0, int64_t t1) {
      RunBlock(isa, x, ldx, w, y, ldy, t0 * kMicroRows, std::min(rows, t1 * kMicroRows), 0, panels);
    });
  }
}

}  // namespace

PackedWeights PackedWeights::Pack(const float* w, int64_t out, int64_t in, int64_t ldw) {
  KV_CHECK(out >= 0 && in >= 0);
  if (ldw == 0) ldw = in;
  PackedWeights packed;
  packed.out_ = out;
  packed.in_ = in;
  packed.data_.assign(static_cast<size_t>(packed.panels() * in * kCols), 0.0f);
  for (int64_t p = 0; p < packed.panels(); ++p) {
    float* dst = packed.data_.data() + p * in * kCols;
    const int64_t cols = std::min(kCols, out - p * kCols);
    for (int64_t j = 0; j < cols; ++j) {
      const float* src = w + (p * kCols + j) * ldw;
      for (int64_t k = 0; k < in; ++k) dst[k * kCols + j] = src[k];
    }
  }
  return packed;
}

void PackedLinear(const float* x, int64_t rows, const PackedWeights& w, float* y, int threads,
                  int64_t ldx, int64_t ldy) {
  Run(BestCpuIsa(), x, rows, w, y, threads, ldx, ldy);
}

void PackedLinearForTest(PackedKernel kernel, const float* x, int64_t rows, const PackedWeights& w,
                         float* y, int threads, int64_t ldx, int64_t ldy) {
  Isa isa = Isa::kPortable;
  if (kernel == PackedKernel::kAuto) isa = BestCpuIsa();
  if (kernel == PackedKernel::kAvx2)
    isa = BestCpuIsa() == Isa::kPortable ? Isa::kPortable : Isa::kAvx2;
  Run(isa, x, rows, w, y, threads, ldx, ldy);
}

const char* PackedGemmKernelName() {
  switch (BestCpuIsa()) {
    case Isa::kAvx512:
      return "AVX-512";
    case Isa::kAvx2:
      return "AVX2+FMA";
    case Isa::kPortable:
      break;
  }
  return "portable";
}

}  // namespace kvrelay::model
