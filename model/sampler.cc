#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvrelay::model {

int32_t Greedy(absl::Span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  return best;
}

double Sampler::NextUniform() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

int32_t Sampler::Sample(absl::Span<const float> logits, float temperature, float top_p) {
  if (!(temperature > 0.0f)) return Greedy(logits);
  const int32_t best = Greedy(logits);
  const double max_logit = logits[best];
  std::vector<double> p(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - max_logit) / temperature);
    sum += p[i];
  }
  if (top_p > 0.0f && top_p < 1.0f) {
    // Nucleus: keep the most likely tokens whose mass reaches top_p (ties by id, so the kept
    // set is deterministic), drop the rest, sample from what is left.
    std::vector<int32_t> order(p.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    std::stable_sort(order.begin(), order.end(),
                     [&p](int32_t a, int32_t b) { return p[a] > p[b]; });
    const double keep_mass = static_cast<double>(top_p) * sum;
    double kept = 0.0;
    size_t k = 0;
    while (k < order.size() && kept < keep_mass) kept += p[order[k++]];
    for (size_t j = k; j < order.size(); ++j) p[order[j]] = 0.0;
    sum = kept;
  }
  const double target = NextUniform() * sum;
  double acc = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    acc += p[i];
    if (target < acc) return static_cast<int32_t>(i);
  }
  return best;  // rounding left target == sum
}

}  // namespace kvrelay::model
