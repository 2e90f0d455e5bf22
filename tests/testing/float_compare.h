#pragma once

// How far one float vector is from a reference, for model and kernel tests that compare logits
// or activations within a tolerance.

#include <algorithm>
#include <cmath>
#include <cstddef>

#include "absl/types/span.h"

namespace kvrelay::testing {

// max |a - b| / max |b| (the reference's largest magnitude, at least 1e-30): the relative error
// of a logits vector. REQUIRES: a.size() == b.size().
inline double MaxRelativeError(absl::Span<const float> a, absl::Span<const float> b) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

}  // namespace kvrelay::testing
