#include "kv/fp8.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace kvrelay::kv {
namespace {

struct Case {
  float x;
  uint8_t code;
  const char* why;
};

// Hand-checked against the E4M3 "fn" definition (bias 7, 3 mantissa bits, no infinities).
constexpr Case kEncodeTable[] = {
    {0.0f, 0x00, "zero"},
    {-0.0f, 0x80, "negative zero keeps its sign"},
    {1.0f, 0x38, "2^0: exponent field 7"},
    {-2.0f, 0xC0, "sign | exponent field 8"},
    {0.1f, 0x1D, "1.6 * 2^-4 rounds to 1.625 * 2^-4"},
    {1.0625f, 0x38, "tie between 1.0 (even) and 1.125: to 1.0"},
    {1.1875f, 0x3A, "tie between 1.125 (odd) and 1.25: to 1.25"},
    {240.0f, 0x77, "1.875 * 2^7"},
    {416.0f, 0x7D, "1.625 * 2^8"},
    {432.0f, 0x7E, "tie between 416 (odd) and 448 (even): to 448"},
    {448.0f, 0x7E, "largest finite"},
    {464.0f, 0x7E, "saturates instead of rounding to the NaN pattern"},
    {1e10f, 0x7E, "saturates"},
    {-448.0f, 0xFE, "negative largest finite"},
    {-1e10f, 0xFE, "negative saturation"},
    {std::numeric_limits<float>::infinity(), 0x7E, "inf saturates"},
    {-std::numeric_limits<float>::infinity(), 0xFE, "-inf saturates"},
    {0.015625f, 0x08, "2^-6: smallest normal"},
    {0.013671875f, 0x07, "7 * 2^-9: largest subnormal"},
    {0.0146484375f, 0x08, "7.5 * 2^-9: tie between 7 (odd) and the normal 2^-6"},
    {0.001953125f, 0x01, "2^-9: smallest subnormal"},
    {0.0009765625f, 0x00, "2^-10: tie between 0 (even) and 2^-9"},
    {0.00146484375f, 0x01, "0.75 * 2^-9 rounds up"},
    {0.0029296875f, 0x02, "1.5 * 2^-9: tie between 1 (odd) and 2"},
    {-0.0029296875f, 0x82, "negative subnormal tie"},
    {1e-30f, 0x00, "far below 2^-10"},
    {1e-40f, 0x00, "a float subnormal"},
};

TEST(Fp8, EncodeMatchesHandCheckedTable) {
  for (const Case& c : kEncodeTable) {
    EXPECT_EQ(EncodeE4M3(c.x), c.code) << c.why << " (x = " << c.x << ")";
  }
}

TEST(Fp8, NanEncodesToTheNanPatternWithItsSign) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(EncodeE4M3(nan), 0x7F);
  EXPECT_EQ(EncodeE4M3(-nan), 0xFF);
  EXPECT_TRUE(std::isnan(DecodeE4M3(0x7F)));
  EXPECT_TRUE(std::isnan(DecodeE4M3(0xFF)));
}

TEST(Fp8, DecodeMatchesHandCheckedValues) {
  EXPECT_EQ(DecodeE4M3(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(DecodeE4M3(0x80)));
  EXPECT_EQ(DecodeE4M3(0x01), 0.001953125f);
  EXPECT_EQ(DecodeE4M3(0x07), 0.013671875f);
  EXPECT_EQ(DecodeE4M3(0x08), 0.015625f);
  EXPECT_EQ(DecodeE4M3(0x1D), 0.1015625f);
  EXPECT_EQ(DecodeE4M3(0x38), 1.0f);
  EXPECT_EQ(DecodeE4M3(0x7E), 448.0f);
  EXPECT_EQ(DecodeE4M3(0xFE), -448.0f);
  EXPECT_EQ(DecodeE4M3(0x4C), 6.0f);
}

TEST(Fp8, EveryCodeRoundTripsAndCodesAreOrdered) {
  float previous = -1.0f;
  for (int code = 0; code < 0x7F; ++code) {
    const float v = DecodeE4M3(static_cast<uint8_t>(code));
    EXPECT_EQ(EncodeE4M3(v), code);
    EXPECT_EQ(EncodeE4M3(-v), code | 0x80);
    EXPECT_GT(v, previous) << code;  // positive codes increase with the value
    previous = v;
  }
}

TEST(Fp8, ScaleExponentIsTheSmallestThatHoldsTheAmax) {
  EXPECT_EQ(Fp8ScaleExpFor(448.0f, 0), 0);
  EXPECT_EQ(Fp8ScaleExpFor(449.0f, 0), 1);
  EXPECT_EQ(Fp8ScaleExpFor(1.0f, 0), -8);   // 448 * 2^-8 = 1.75 >= 1
  EXPECT_EQ(Fp8ScaleExpFor(1.75f, 0), -8);  // exactly 448 * 2^-8
  EXPECT_EQ(Fp8ScaleExpFor(1.76f, 0), -7);
  EXPECT_EQ(Fp8ScaleExpFor(0.0f, 0), 0);
  EXPECT_EQ(Fp8ScaleExpFor(1e38f, 0), kFp8MaxScaleExp - 1);  // 1e38 < 448 * 2^118
  EXPECT_EQ(Fp8ScaleExpFor(1e-40f, 0), kFp8MinScaleExp);     // clamped
  // Attention blocks: 7 octaves above the first token's amax, never below 2^-4.
  EXPECT_EQ(Fp8BlockScaleExp(1.0f), -1);  // 448 / 2 = 224 >= 128
  EXPECT_EQ(Fp8BlockScaleExp(0.001f), kFp8BlockMinScaleExp);
  EXPECT_EQ(Fp8BlockScaleExp(0.0f), 0);
  EXPECT_EQ(Fp8TileScaleExp(3.5f), -7);  // 448 * 2^-7 = 3.5
  EXPECT_EQ(Fp8ScaleFromExp(-1), 0.5f);
  EXPECT_EQ(Fp8ScaleFromExp(kFp8MinScaleExp), std::ldexp(1.0f, kFp8MinScaleExp));
}

TEST(Fp8, StoredScaleGivesItsExponentBack) {
  for (int32_t k = kFp8MinScaleExp; k <= kFp8MaxScaleExp; ++k) {
    EXPECT_EQ(Fp8StoredScaleExp(Fp8ScaleFromExp(k)), k);
  }
  // A damaged scale (checksums refuse such blocks anyway) still quantises within range.
  EXPECT_EQ(Fp8StoredScaleExp(0.0f), kFp8MinScaleExp);
  EXPECT_EQ(Fp8StoredScaleExp(std::numeric_limits<float>::infinity()), kFp8MaxScaleExp);
}

TEST(Fp8, QuantizeWithScaleIsExactOnRepresentableValues) {
  EXPECT_EQ(QuantizeE4M3(3.0f, -1), 0x4C);  // 3 / 0.5 = 6
  EXPECT_EQ(DequantizeE4M3(0x4C, Fp8ScaleFromExp(-1)), 3.0f);
  EXPECT_EQ(QuantizeE4M3(1000.0f, 0), 0x7E);    // saturates at 448 * scale
  EXPECT_EQ(DequantizeE4M3(0x38, 0.0f), 0.0f);  // a zero scale gives zeros
  EXPECT_TRUE(std::isnan(DequantizeE4M3(0x7F, 0.0f)));
  // Tile rule: the tile's amax itself always fits.
  const float tile[4] = {0.3f, -2.9f, std::numeric_limits<float>::quiet_NaN(), 1.0f};
  const float amax = Fp8FiniteAmax(tile, 4);
  EXPECT_EQ(amax, 2.9f);
  const int32_t k = Fp8TileScaleExp(amax);
  EXPECT_NE(QuantizeE4M3(-2.9f, k), 0xFE);
  EXPECT_NEAR(DequantizeE4M3(QuantizeE4M3(-2.9f, k), Fp8ScaleFromExp(k)), -2.9f, 2.9f / 16);
}

}  // namespace
}  // namespace kvrelay::kv
