#pragma once

// Token selection from logits: greedy (argmax, lowest id on ties) and seeded temperature
// sampling (softmax(logits / T), drawn with a SplitMix64 stream: same seed, same tokens).

#include <cstdint>

#include "absl/types/span.h"

namespace kvrelay::model {

int32_t Greedy(absl::Span<const float> logits);

// Not thread-safe; one per sequence.
class Sampler {
 public:
  explicit Sampler(uint64_t seed) : state_(seed) {}
  // temperature <= 0 is greedy; top_p in (0, 1) samples from the smallest set of most likely
  // tokens whose probability reaches top_p (1 or 0: all tokens). REQUIRES: !logits.empty().
  int32_t Sample(absl::Span<const float> logits, float temperature, float top_p = 1.0f);

 private:
  double NextUniform();  // [0, 1)
  uint64_t state_;
};

}  // namespace kvrelay::model
