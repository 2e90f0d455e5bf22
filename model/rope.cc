#include "model/rope.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvrelay::model {
namespace {

// base^(2i / dim) in fp32 as torch computes `base ** (arange(0, dim, 2).float() / dim)`: the
// exponent is rounded to fp32 first.
std::vector<double> PosFreqs(double theta, int32_t dim) {
  std::vector<double> f(dim / 2);
  for (int32_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    f[i] = std::pow(theta, static_cast<double>(exponent));
  }
  return f;
}

}  // namespace

double YarnMscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

double MlaSoftmaxScaleFactor(const kv::RopeScaling& s) {
  if (s.type == "default" || s.mscale_all_dim == 0.0) return 1.0;
  const double m = YarnMscale(s.factor, s.mscale_all_dim);
  return m * m;
}

absl::StatusOr<RopeFrequencies> ComputeRopeFrequencies(const kv::RopeScaling& s, double theta,
                                                       int32_t dim,
                                                       int32_t max_position_embeddings) {
  if (dim <= 0 || dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("rope: dimension must be even, got ", dim));
  }
  if (!(theta > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: rope_theta must be positive, got ", theta));
  }
  const int32_t half = dim / 2;
  const std::vector<double> pos_freqs = PosFreqs(theta, dim);
  std::vector<double> inv(half);
  for (int32_t i = 0; i < half; ++i) inv[i] = static_cast<float>(1.0 / pos_freqs[i]);
  RopeFrequencies out;
  if (s.type == "default") {
    // nothing to scale
  } else if (s.type == "linear") {
    for (double& f : inv) f /= s.factor;
  } else if (s.type == "dynamic") {
    if (max_position_embeddings <= 0) {
      return absl::InvalidArgumentError("rope: rope_scaling dynamic needs max_position_embeddings");
    }
    out.max_positions = max_position_embeddings;  // default frequencies below it
  } else if (s.type == "llama3") {
    const double old_len = s.original_max_position_embeddings;
    const double low_wavelen = old_len / s.low_freq_factor;
    const double high_wavelen = old_len / s.high_freq_factor;
    for (double& f : inv) {
      const double wavelen = 2 * M_PI / f;
      if (wavelen < high_wavelen) continue;  // high frequency: unchanged
      if (wavelen > low_wavelen) {
        f = f / s.factor;  // low frequency: interpolated
        continue;
      }
      const double smooth =
          (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      f = (1 - smooth) * f / s.factor + smooth * f;
    }
  } else if (s.type == "yarn") {
    double factor = s.factor;
    int32_t original = max_position_embeddings;
    if (s.original_max_position_embeddings > 0) {
      original = s.original_max_position_embeddings;
      // transformers uses max_position_embeddings / original for the attention factor when
      // the original length is given (DeepSeek V3: 163840 / 4096 == factor 40); versions
      // differ when the two disagree, so refuse that.
      if (max_position_embeddings > 0 &&
          std::abs(static_cast<double>(max_position_embeddings) / original - factor) >
              1e-9 * factor) {
        return absl::InvalidArgumentError(
            absl::StrCat("rope: rope_scaling.factor = ", factor,
                         " disagrees with max_position_embeddings / "
                         "rope_scaling.original_max_position_embeddings = ",
                         max_position_embeddings, " / ", original));
      }
    }
    if (original <= 0) {
      return absl::InvalidArgumentError(
          "rope: rope_scaling yarn needs max_position_embeddings or "
          "original_max_position_embeddings");
    }
    if (s.attention_factor.has_value()) {
      out.attention_factor = static_cast<float>(*s.attention_factor);
    } else if (s.mscale != 0 && s.mscale_all_dim != 0) {
      out.attention_factor =
          static_cast<float>(YarnMscale(factor, s.mscale) / YarnMscale(factor, s.mscale_all_dim));
    } else {
      out.attention_factor = static_cast<float>(YarnMscale(factor, 1.0));
    }
    auto correction_dim = [&](double rotations) {
      return dim * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(theta));
    };
    double low = correction_dim(s.beta_fast);
    double high = correction_dim(s.beta_slow);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;
    for (int32_t i = 0; i < half; ++i) {
      // torch computes the ramp in fp32.
      const float ramp = std::clamp(static_cast<float>((i - low) / (high - low)), 0.0f, 1.0f);
      const double extrapolation = 1.0f - ramp;
      const double interp = static_cast<float>(1.0 / (factor * pos_freqs[i]));
      inv[i] = interp * (1 - extrapolation) + inv[i] * extrapolation;
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: rope_scaling.rope_type = \"", s.type, "\" is not implemented"));
  }
  out.inv_freq.resize(half);
  for (int32_t i = 0; i < half; ++i) out.inv_freq[i] = static_cast<float>(inv[i]);
  return out;
}

}  // namespace kvrelay::model
