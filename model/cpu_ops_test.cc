#include "model/cpu_ops.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/random_floats.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::RandomFloats;

TEST(LinearTest, MatchesNaiveProductAndTilesAreReproducible) {
  const int64_t rows = 37, in = 48, out = 24;
  const std::vector<float> x = RandomFloats(rows * in, 1), w = RandomFloats(out * in, 2);
  std::vector<float> y(rows * out), tiled(rows * out), again(rows * out);
  Linear(x.data(), rows, in, w.data(), out, y.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double want = 0;
      for (int64_t i = 0; i < in; ++i) want += double{x[r * in + i]} * w[o * in + i];
      EXPECT_NEAR(y[r * out + o], want, 1e-4);
    }
  }
  // Tiles cut at absolute multiples of 16: rows 16.. computed alone equal rows 16.. of a call
  // that started at 0.
  Linear(x.data(), rows, in, w.data(), out, tiled.data(), 0, 16);
  Linear(x.data() + 16 * in, rows - 16, in, w.data(), out, again.data(), 16, 16);
  for (int64_t i = 0; i < (rows - 16) * out; ++i) ASSERT_EQ(again[i], tiled[16 * out + i]);
}

TEST(RmsNormTest, UnitRmsTimesWeight) {
  const std::vector<float> x = RandomFloats(64, 3);
  std::vector<float> w(64, 2.0f), y(64);
  RmsNorm(x.data(), 1, 64, w.data(), 0.0f, y.data());
  double ss = 0;
  for (float v : y) ss += double{v} * v;
  EXPECT_NEAR(std::sqrt(ss / 64), 2.0, 1e-5);
}

TEST(RopeTest, PositionZeroIsIdentityAndNormIsKept) {
  for (RopeStyle style : {RopeStyle::kHalf, RopeStyle::kInterleaved}) {
    std::vector<float> x = RandomFloats(2 * 16, 4);
    const std::vector<float> orig = x;
    const int64_t pos[] = {0, 9};
    ApplyRope(x.data(), 2, 1, 16, 16, 0, pos, 10000.0, style);
    for (int i = 0; i < 16; ++i) {
      // Position 0: no rotation (interleaved also reorders pairs to (i, i + d/2)).
      const float want = style == RopeStyle::kHalf ? orig[i]
                         : i < 8                   ? orig[2 * i]
                                                   : orig[2 * (i - 8) + 1];
      EXPECT_FLOAT_EQ(x[i], want);
    }
    double before = 0, after = 0;
    for (int i = 16; i < 32; ++i) {
      before += double{orig[i]} * orig[i];
      after += double{x[i]} * x[i];
    }
    EXPECT_NEAR(before, after, 1e-5);
  }
}

TEST(RopeTest, ScoresDependOnlyOnRelativePosition) {
  const std::vector<float> q0 = RandomFloats(32, 5), k0 = RandomFloats(32, 6);
  auto score = [&](int64_t pq, int64_t pk) {
    std::vector<float> q = q0, k = k0;
    ApplyRope(q.data(), 1, 1, 32, 32, 0, &pq, 10000.0, RopeStyle::kHalf);
    ApplyRope(k.data(), 1, 1, 32, 32, 0, &pk, 10000.0, RopeStyle::kHalf);
    return Dot(q.data(), k.data(), 32);
  };
  EXPECT_NEAR(score(10, 3), score(107, 100), 1e-4);
}

TEST(AttendTest, MatchesDoublePrecisionSoftmax) {
  const int32_t d = 24;
  const int64_t n = 19;
  const std::vector<float> q = RandomFloats(d, 7), k = RandomFloats(n * d, 8),
                           v = RandomFloats(n * d, 9);
  std::vector<float> out(d), scratch(n);
  AttendOne(q.data(), d, k.data(), d, v.data(), d, d, n, 0.3f, scratch.data(), out.data());
  std::vector<double> p(n);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    double s = 0;
    for (int i = 0; i < d; ++i) s += double{q[i]} * k[j * d + i];
    p[j] = std::exp(0.3 * s);
    sum += p[j];
  }
  for (int i = 0; i < d; ++i) {
    double want = 0;
    for (int64_t j = 0; j < n; ++j) want += p[j] / sum * v[j * d + i];
    EXPECT_NEAR(out[i], want, 1e-5);
  }
}

TEST(ParallelForTest, CoversRangeOnce) {
  std::vector<int> hits(1000, 0);
  ParallelFor(3, 1000, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++hits[i];
  });
  for (int h : hits) ASSERT_EQ(h, 1);
}

}  // namespace
}  // namespace kvrelay::model
