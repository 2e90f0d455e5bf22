#pragma once

// FP8 KV-cache numerics, the one definition that the CPU model and the CUDA kernels both
// compile (every function here is header-only and __host__ __device__ under nvcc), so their
// cached bytes agree bit for bit by construction.
//
// Element format: OCP E4M3 "fn" (torch.float8_e4m3fn): 1 sign, 4 exponent bits (bias 7),
// 3 mantissa bits, no infinities, one NaN pattern per sign (S.1111.111), largest finite 448
// (0.1111.110), smallest normal 2^-6, smallest subnormal 2^-9.
//
// EncodeE4M3(x), exactly:
//   - NaN            -> 0x7F with x's sign bit (0x7F or 0xFF).
//   - |x| >= 448     -> ±448 (0x7E / 0xFE): saturating, ±inf included (no overflow to NaN).
//   - otherwise the nearest E4M3 value, ties to even, subnormals included (2^-10 -> 0,
//     3 * 2^-10 -> 2^-8); a result that rounds up to 2^-6 is the normal 0x08.
//   - ±0 and |x| < 2^-10 -> ±0 (the sign is kept).
// DecodeE4M3(q) is exact (every E4M3 value is a float); 0x7F / 0xFF decode to NaN.
//
// Scales are powers of two 2^k with k in [kFp8MinScaleExp, kFp8MaxScaleExp]: quantising is
// EncodeE4M3(x * 2^-k) and dequantising DecodeE4M3(q) * 2^k, both exact multiplications (no
// float subnormal can arise inside that range, so flush-to-zero hardware agrees too). A scale
// is stored as the float32 2^k, little endian, inside the block it belongs to; a stored scale
// of 0 (only a corrupted block could carry one, and checksums refuse those) dequantises every
// value to ±0, NaN codes to NaN.
//
// Two scale rules, one per cache kind (see kv/model_layout.h for where the bytes live):
//   - Attention (GQA/MHA/sliding window): one scale per (block, layer, K or V, KV head), fixed
//     by the block's FIRST token: Fp8BlockScaleExp(amax of that token's head_dim values), which
//     leaves kFp8BlockHeadroomLog2 octaves of headroom above it and never goes below
//     2^kFp8BlockMinScaleExp. Later tokens of the block reuse that scale and saturate beyond
//     448 * scale. Why the first token and not the whole block: a block is written token by
//     token while it fills (decode appends one token at a time), and the bits of a token must
//     not depend on how the writes were chunked (prefill in one pass, prefill then decode on
//     another node, a prefix reused from the cache); a scale fixed at the block's first token is
//     the only block-wide scale that is known before the rest of the block is, without
//     re-quantising values other requests may already have read.
//   - MLA latent (the FlashMLA FP8 layout): one scale per token and per kFp8MlaTile latent
//     values, Fp8TileScaleExp(amax of the tile): the smallest power of two that holds the tile.
// amax is max |x| over the finite values; an amax of 0 (or no finite value) gives k = 0.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KV_FP8_HD __host__ __device__ __forceinline__
#else
#define KV_FP8_HD inline
#endif

namespace kvrelay::kv {

inline constexpr float kFp8Max = 448.0f;
inline constexpr int32_t kFp8MinScaleExp = -117;  // 2^-9 * 2^-117 is still a normal float
inline constexpr int32_t kFp8MaxScaleExp = 119;   // 448 * 2^119 is still finite
inline constexpr int32_t kFp8BlockHeadroomLog2 = 7;
inline constexpr int32_t kFp8BlockMinScaleExp = -4;
inline constexpr int32_t kFp8MlaTile = 128;
inline constexpr int32_t kFp8ScaleBytes = 4;  // float32

KV_FP8_HD uint32_t Fp8FloatBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

KV_FP8_HD float Fp8BitsToFloat(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

KV_FP8_HD uint8_t EncodeE4M3(float x) {
  const uint32_t bits = Fp8FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);   // NaN
  if (abs_bits >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu);  // >= 448, inf too
  const int32_t exp = static_cast<int32_t>(abs_bits >> 23) - 127;
  if (exp < -10) return sign;  // below 2^-10: rounds to zero (2^-10 itself is a tie to 0)
  const uint32_t mantissa = abs_bits & 0x7FFFFFu;
  if (exp >= -6) {
    uint32_t code = (static_cast<uint32_t>(exp + 7) << 3) | (mantissa >> 20);
    const uint32_t rest = mantissa & 0xFFFFFu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1u) != 0)) ++code;
    return static_cast<uint8_t>(sign | code);  // < 448 here, so no carry past 0x7E
  }
  // Subnormal: units of 2^-9, value = (mantissa | 1 << 23) * 2^(exp - 23).
  const uint32_t full = mantissa | 0x800000u;
  const int32_t shift = 14 - exp;  // 21 .. 24
  uint32_t code = full >> shift;
  const uint32_t rest = full & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (code & 1u) != 0)) ++code;  // 8 is the normal 2^-6
  return static_cast<uint8_t>(sign | code);
}

KV_FP8_HD float DecodeE4M3(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const uint32_t exp = (q >> 3) & 0xFu;
  const uint32_t mantissa = q & 0x7u;
  if (exp == 0xFu && mantissa == 0x7u) return Fp8BitsToFloat(sign | 0x7FC00000u);
  if (exp == 0) {
    return Fp8BitsToFloat(sign | Fp8FloatBits(static_cast<float>(mantissa) * 0.001953125f));
  }
  return Fp8BitsToFloat(sign | ((exp - 7 + 127) << 23) | (mantissa << 20));
}

// 2^k as a float, k within [kFp8MinScaleExp, kFp8MaxScaleExp].
KV_FP8_HD float Fp8ScaleFromExp(int32_t k) {
  return Fp8BitsToFloat(static_cast<uint32_t>(k + 127) << 23);
}

KV_FP8_HD int32_t Fp8ClampScaleExp(int32_t k) {
  return k < kFp8MinScaleExp ? kFp8MinScaleExp : (k > kFp8MaxScaleExp ? kFp8MaxScaleExp : k);
}

// The k of a stored attention scale 2^k, which later tokens of the block quantise with: its
// exponent bits, clamped (so even a damaged scale, which checksums refuse anyway, quantises
// within range). The CPU and CUDA writers both read it this way.
KV_FP8_HD int32_t Fp8StoredScaleExp(float scale) {
  return Fp8ClampScaleExp(static_cast<int32_t>((Fp8FloatBits(scale) >> 23) & 0xFFu) - 127);
}

// Smallest k with 448 * 2^k >= amax * 2^headroom_log2, clamped; 0 when amax is 0 or not
// finite (callers pass the max over finite values, so that only happens for all-zero input).
KV_FP8_HD int32_t Fp8ScaleExpFor(float amax, int32_t headroom_log2) {
  const uint32_t bits = Fp8FloatBits(amax) & 0x7FFFFFFFu;
  if (bits == 0 || bits >= 0x7F800000u) return 0;
  // amax = m * 2^e with 1 <= m < 2 (float subnormals count as 2^-127: they clamp anyway);
  // 448 = 1.75 * 2^8, so 448 * 2^k >= m * 2^e  <=>  k >= e - 8 (+1 when m > 1.75).
  const int32_t e = static_cast<int32_t>(bits >> 23) - 127 + headroom_log2;
  const int32_t k = e - 8 + ((bits & 0x7FFFFFu) > 0x600000u ? 1 : 0);
  return Fp8ClampScaleExp(k);
}

KV_FP8_HD int32_t Fp8BlockScaleExp(float first_token_amax) {
  const int32_t k = Fp8ScaleExpFor(first_token_amax, kFp8BlockHeadroomLog2);
  return k < kFp8BlockMinScaleExp ? kFp8BlockMinScaleExp : k;
}

KV_FP8_HD int32_t Fp8TileScaleExp(float tile_amax) { return Fp8ScaleExpFor(tile_amax, 0); }

// max |x| over the finite values of x[0 .. n-1] (0 when there is none).
KV_FP8_HD float Fp8FiniteAmax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = Fp8FloatBits(x[i]) & 0x7FFFFFFFu;
    if (b < 0x7F800000u) {
      const float a = Fp8BitsToFloat(b);
      if (a > amax) amax = a;
    }
  }
  return amax;
}

// Quantise with scale 2^k (x * 2^-k is exact inside the clamped range).
KV_FP8_HD uint8_t QuantizeE4M3(float x, int32_t k) { return EncodeE4M3(x * Fp8ScaleFromExp(-k)); }

// Dequantise with a stored scale (the float32 2^k; any float is applied as stored).
KV_FP8_HD float DequantizeE4M3(uint8_t q, float scale) { return DecodeE4M3(q) * scale; }

}  // namespace kvrelay::kv
