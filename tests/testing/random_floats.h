#pragma once

// Deterministic pseudo-random floats in [-1, 1) for kernel tests (a 32-bit LCG, so every test
// that uses a seed sees the same values on every machine).

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

}  // namespace kvrelay::testing
