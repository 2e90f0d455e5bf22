#pragma once

// Deterministic pseudo-random floats in [-1, 1) for kernel tests, and token ids for model tests
// (a 32-bit LCG, so every test that uses a seed sees the same values on every machine).

#include <cstdint>
#include <vector>

namespace kvrelay::testing {

inline std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t x = seed;
  for (float& f : v) {
    x = x * 1664525u + 1013904223u;
    f = static_cast<float>((x >> 8) & 0xffff) / 32768.0f - 1.0f;
  }
  return v;
}

// n token ids in [0, vocab).
inline std::vector<int32_t> RandomTokens(int n, int32_t vocab, uint32_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  uint32_t x = seed * 2654435761u + 1;
  for (int32_t& token : t) {
    x = x * 1664525u + 1013904223u;
    token = static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(vocab));
  }
  return t;
}

}  // namespace kvrelay::testing
