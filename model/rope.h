#pragma once

// RoPE frequencies as Hugging Face transformers computes them (modeling_rope_utils
// `_compute_*_parameters`): the inverse frequency of each rotated pair and the attention factor
// that scales cos and sin. Types: default, linear, dynamic, llama3, yarn (DeepSeek's
// mscale / mscale_all_dim included).
//
// dynamic: transformers recomputes the frequencies whenever a forward pass reaches past
// max_position_embeddings, so the keys already cached were rotated with other frequencies than
// the ones it then uses. Below that length dynamic equals default, which is what we compute;
// the runner refuses positions at or past max_position_embeddings for it.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kv/hf_config.h"

namespace kvrelay::model {

struct RopeFrequencies {
  std::vector<float> inv_freq;    // [dim / 2], fp32 as transformers keeps it
  float attention_factor = 1.0f;  // cos and sin are multiplied by it
  int64_t max_positions = 0;      // > 0: positions must stay below (dynamic)
};

// dim: the rotated dimensions (head_dim; MLA: qk_rope_head_dim). max_position_embeddings: the
// config's. InvalidArgument naming the field for a type or value this cannot compute.
absl::StatusOr<RopeFrequencies> ComputeRopeFrequencies(const kv::RopeScaling& scaling, double theta,
                                                       int32_t dim,
                                                       int32_t max_position_embeddings);

// DeepSeek's yarn_get_mscale: 1 for scale <= 1, else 0.1 * mscale * ln(scale) + 1.
double YarnMscale(double scale, double mscale);

// The softmax scale DeepSeek (v2/v3) attention multiplies into 1/sqrt(qk_head_dim): mscale^2 with
// mscale = YarnMscale(factor, mscale_all_dim) when rope_scaling sets mscale_all_dim, else 1.
double MlaSoftmaxScaleFactor(const kv::RopeScaling& scaling);

}  // namespace kvrelay::model
