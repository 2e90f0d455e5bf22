#include "model/packed_gemm.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/random_floats.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::RandomFloats;

// The definition, straight from the unpacked weights: one FMA chain per element, k in order.
std::vector<float> Definition(const std::vector<float>& x, int64_t rows, int64_t in,
                              const std::vector<float>& w, int64_t out) {
  std::vector<float> y(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      float acc = 0.0f;
      for (int64_t k = 0; k < in; ++k) acc = std::fma(x[r * in + k], w[o * in + k], acc);
      y[r * out + o] = acc;
    }
  }
  return y;
}

struct Shape {
  int64_t rows, in, out;
};

class PackedGemmTest : public ::testing::TestWithParam<Shape> {};

// Edge columns (out not a multiple of 32), depth not a multiple of the 256 block, rows not a
// multiple of the 8-row micro-tile, one row, one column; 800 rows: threads split rows.
INSTANTIATE_TEST_SUITE_P(Shapes, PackedGemmTest,
                         ::testing::Values(Shape{37, 48, 24}, Shape{1, 1024, 256},
                                           Shape{19, 300, 70}, Shape{64, 513, 33}, Shape{9, 7, 1},
                                           Shape{300, 256, 96}, Shape{800, 300, 40}));

TEST_P(PackedGemmTest, EveryKernelAndThreadCountGivesTheDefinitionsBits) {
  const Shape s = GetParam();
  const std::vector<float> x = RandomFloats(s.rows * s.in, 1), w = RandomFloats(s.out * s.in, 2);
  const std::vector<float> want = Definition(x, s.rows, s.in, w, s.out);
  const PackedWeights packed = PackedWeights::Pack(w.data(), s.out, s.in);
  for (PackedKernel kernel : {PackedKernel::kAuto, PackedKernel::kAvx2, PackedKernel::kPortable}) {
    for (int threads : {1, 2, 3}) {
      std::vector<float> y(s.rows * s.out, -7.0f);
      PackedLinearForTest(kernel, x.data(), s.rows, packed, y.data(), threads);
      ASSERT_EQ(std::memcmp(y.data(), want.data(), y.size() * sizeof(float)), 0)
          << "kernel " << static_cast<int>(kernel) << " threads " << threads;
    }
  }
}

TEST_P(PackedGemmTest, RowsComputedInAnySplitAreBitIdentical) {
  const Shape s = GetParam();
  const std::vector<float> x = RandomFloats(s.rows * s.in, 3), w = RandomFloats(s.out * s.in, 4);
  const PackedWeights packed = PackedWeights::Pack(w.data(), s.out, s.in);
  std::vector<float> whole(s.rows * s.out);
  PackedLinear(x.data(), s.rows, packed, whole.data(), 2);
  for (int64_t start : {int64_t{1}, s.rows / 3, s.rows - 1}) {
    if (start <= 0 || start >= s.rows) continue;
    std::vector<float> tail((s.rows - start) * s.out);
    PackedLinear(x.data() + start * s.in, s.rows - start, packed, tail.data(), 2);
    ASSERT_EQ(std::memcmp(tail.data(), whole.data() + start * s.out, tail.size() * sizeof(float)),
              0)
        << "rows from " << start;
  }
}

TEST(PackedGemmStridesTest, ReadsAndWritesStridedRowsOnly) {
  const int64_t rows = 13, in = 40, out = 50, ldx = 64, ldy = 80, ldw = 48;
  const std::vector<float> x = RandomFloats(rows * ldx, 5), w = RandomFloats(out * ldw, 6);
  std::vector<float> dense_x(rows * in), dense_w(out * in);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&dense_x[r * in], &x[r * ldx], in * 4);
  for (int64_t o = 0; o < out; ++o) std::memcpy(&dense_w[o * in], &w[o * ldw], in * 4);
  const std::vector<float> want = Definition(dense_x, rows, in, dense_w, out);
  const PackedWeights packed = PackedWeights::Pack(w.data(), out, in, ldw);
  std::vector<float> y(rows * ldy, 5.0f);
  PackedLinear(x.data(), rows, packed, y.data(), 2, ldx, ldy);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < ldy; ++o) {
      if (o < out) {
        ASSERT_EQ(y[r * ldy + o], want[r * out + o]) << r << "," << o;
      } else {
        ASSERT_EQ(y[r * ldy + o], 5.0f) << "wrote past the row's " << out << " columns";
      }
    }
  }
}

TEST(PackedGemmStridesTest, ReportsTheKernelItRuns) {
  // Informational: which kernel the bit-identity tests above compared with the portable one.
  std::printf("PackedLinear kernel on this CPU: %s\n", PackedGemmKernelName());
}

}  // namespace
}  // namespace kvrelay::model
