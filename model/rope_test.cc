// RoPE frequencies against the published formulas (RoFormer; linear position interpolation;
// dynamic NTK; Llama 3.1's smoothed interpolation; YaRN with DeepSeek's mscale), written here
// independently in double precision, plus spot values of real configs computed with numpy.

#include "model/rope.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/hf_config.h"
#include "tests/testing/status_matchers.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::StatusIs;
using ::testing::HasSubstr;

std::vector<double> Default(double theta, int dim) {
  std::vector<double> f(dim / 2);
  for (int i = 0; i < dim / 2; ++i) f[i] = 1.0 / std::pow(theta, 2.0 * i / dim);
  return f;
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 2e-6 * std::abs(want[i])) << "pair " << i;
  }
}

kv::RopeScaling Scaling(const char* json) {
  std::string config = std::string(R"({"model_type":"llama","hidden_size":256,
      "num_attention_heads":2,"num_hidden_layers":1,"max_position_embeddings":131072,
      "rope_scaling":)") +
                       json + "}";
  absl::StatusOr<kv::ModelConfig> c = kv::ParseHfConfig(config);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? c->rope_scaling : kv::RopeScaling{};
}

TEST(Rope, DefaultIsThetaPower) {
  KV_ASSERT_OK_AND_ASSIGN(RopeFrequencies f, ComputeRopeFrequencies({}, 10000.0, 64, 4096));
  ExpectNear(f.inv_freq, Default(10000.0, 64));
  EXPECT_EQ(f.attention_factor, 1.0f);
  EXPECT_EQ(f.max_positions, 0);
}

TEST(Rope, LinearDividesEveryFrequencyByFactor) {
  kv::RopeScaling s = Scaling(R"({"rope_type":"linear","factor":8.0})");
  EXPECT_EQ(s.type, "linear");
  KV_ASSERT_OK_AND_ASSIGN(RopeFrequencies f, ComputeRopeFrequencies(s, 1e6, 128, 131072));
  std::vector<double> want = Default(1e6, 128);
  for (double& v : want) v /= 8.0;
  ExpectNear(f.inv_freq, want);
  EXPECT_EQ(f.attention_factor, 1.0f);
}

TEST(Rope, DynamicEqualsDefaultBelowMaxPositionsAndIsBoundedThere) {
  // NTK: base' = base * (factor * L / L_max - (factor - 1))^(d / (d - 2)) is base for L <= L_max.
  kv::RopeScaling s = Scaling(R"({"type":"dynamic","factor":2.0})");
  EXPECT_EQ(s.type, "dynamic");
  KV_ASSERT_OK_AND_ASSIGN(RopeFrequencies f, ComputeRopeFrequencies(s, 10000.0, 64, 2048));
  ExpectNear(f.inv_freq, Default(10000.0, 64));
  EXPECT_EQ(f.max_positions, 2048);
}

TEST(Rope, Llama3SmoothsBetweenWavelengthBands) {
  // Llama 3.1 8B: theta 500000, head_dim 128, factor 8, low 1, high 4, original 8192.
  kv::RopeScaling s = Scaling(R"({"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
      "high_freq_factor":4.0,"original_max_position_embeddings":8192})");
  KV_ASSERT_OK_AND_ASSIGN(RopeFrequencies f, ComputeRopeFrequencies(s, 500000.0, 128, 131072));
  std::vector<double> want = Default(500000.0, 128);
  for (double& v : want) {
    const double wavelen = 2 * M_PI / v;
    if (wavelen < 8192.0 / 4) continue;
    if (wavelen > 8192.0 / 1) {
      v /= 8;
      continue;
    }
    const double smooth = (8192.0 / wavelen - 1) / (4 - 1);
    v = (1 - smooth) * v / 8 + smooth * v;
  }
  ExpectNear(f.inv_freq, want);
  // Spot values (numpy, fp32 inv_freq as transformers keeps it).
  EXPECT_FLOAT_EQ(f.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(f.inv_freq[20], 0.016560440883040428f);
  EXPECT_FLOAT_EQ(f.inv_freq[45], 1.2297638932068367e-05f);  // smoothed band
  EXPECT_FLOAT_EQ(f.inv_freq[63], 3.068925877869333e-07f);   // divided by 8
  EXPECT_EQ(f.attention_factor, 1.0f);
}

TEST(Rope, YarnDeepSeekV3) {
  // DeepSeek V3: qk_rope_head_dim 64, theta 10000, factor 40, original 4096, max 163840,
  // beta 32/1, mscale = mscale_all_dim = 1.
  kv::RopeScaling s = Scaling(R"({"type":"yarn","factor":40,"beta_fast":32,"beta_slow":1,
      "mscale":1.0,"mscale_all_dim":1.0,"original_max_position_embeddings":4096})");
  KV_ASSERT_OK_AND_ASSIGN(RopeFrequencies f, ComputeRopeFrequencies(s, 10000.0, 64, 163840));
  // YaRN: ramp r_i = clamp((i - low) / (high - low), 0, 1) over the correction range
  // [floor(d ln(L / (2 pi 32)) / (2 ln b)), ceil(d ln(L / (2 pi)) / (2 ln b))] = [10, 23];
  // inv_freq_i = (1 - r_i) * base_i + r_i * base_i / factor.
  const std::vector<double> base = Default(10000.0, 64);
  const double low = std::floor(64 * std::log(4096 / (32 * 2 * M_PI)) / (2 * std::log(10000.0)));
  const double high = std::ceil(64 * std::log(4096 / (1 * 2 * M_PI)) / (2 * std::log(10000.0)));
  EXPECT_EQ(low, 10);
  EXPECT_EQ(high, 23);
  std::vector<double> want(32);
  for (int i = 0; i < 32; ++i) {
    const double r = std::clamp((i - low) / (high - low), 0.0, 1.0);
    want[i] = (1 - r) * base[i] + r * base[i] / 40;
  }
  ExpectNear(f.inv_freq, want);
  EXPECT_FLOAT_EQ(f.inv_freq[5], 0.23713739216327667f);
  EXPECT_FLOAT_EQ(f.inv_freq[12], 0.026879360899329185f);
  EXPECT_FLOAT_EQ(f.inv_freq[31], 3.3338035336782923e-06f);
  // mscale / mscale_all_dim = 1: cos and sin unscaled; the softmax scale gets mscale^2 with
  // mscale = 0.1 ln(40) + 1.
  EXPECT_FLOAT_EQ(f.attention_factor, 1.0f);
  EXPECT_NEAR(MlaSoftmaxScaleFactor(s), std::pow(0.1 * std::log(40.0) + 1, 2), 1e-12);
  EXPECT_NEAR(MlaSoftmaxScaleFactor(s), 1.8738542070926265, 1e-12);
}

TEST(Rope, YarnAttentionFactor) {
  // Without mscale: 0.1 ln(factor) + 1 on cos and sin.
  kv::RopeScaling plain = Scaling(R"({"rope_type":"yarn","factor":4.0})");
  KV_ASSERT_OK_AND_ASSIGN(RopeFrequencies f, ComputeRopeFrequencies(plain, 10000.0, 64, 32768));
  EXPECT_FLOAT_EQ(f.attention_factor, static_cast<float>(0.1 * std::log(4.0) + 1));
  EXPECT_EQ(MlaSoftmaxScaleFactor(plain), 1.0);
  // mscale 0.707, mscale_all_dim 1: the ratio of the two.
  kv::RopeScaling ratio = Scaling(R"({"rope_type":"yarn","factor":4.0,"mscale":0.707,
      "mscale_all_dim":1.0})");
  KV_ASSERT_OK_AND_ASSIGN(f, ComputeRopeFrequencies(ratio, 10000.0, 64, 32768));
  EXPECT_FLOAT_EQ(f.attention_factor, static_cast<float>((0.1 * 0.707 * std::log(4.0) + 1) /
                                                         (0.1 * std::log(4.0) + 1)));
  // An explicit attention_factor wins.
  kv::RopeScaling given = Scaling(R"({"rope_type":"yarn","factor":4.0,"attention_factor":0.5})");
  KV_ASSERT_OK_AND_ASSIGN(f, ComputeRopeFrequencies(given, 10000.0, 64, 32768));
  EXPECT_FLOAT_EQ(f.attention_factor, 0.5f);
  // truncate false: the correction range is not rounded.
  kv::RopeScaling untruncated = Scaling(R"({"rope_type":"yarn","factor":4.0,"truncate":false})");
  KV_ASSERT_OK_AND_ASSIGN(f, ComputeRopeFrequencies(untruncated, 10000.0, 64, 32768));
  const double low = 64 * std::log(32768 / (32 * 2 * M_PI)) / (2 * std::log(10000.0));
  const double high = 64 * std::log(32768 / (2 * M_PI)) / (2 * std::log(10000.0));
  const std::vector<double> base = Default(10000.0, 64);
  for (int i = 0; i < 32; ++i) {
    const double r = std::clamp((i - low) / (high - low), 0.0, 1.0);
    EXPECT_NEAR(f.inv_freq[i], (1 - r) * base[i] + r * base[i] / 4, 2e-6 * base[i]) << i;
  }
}

TEST(Rope, YarnFactorDisagreeingWithLengthsIsRefused) {
  kv::RopeScaling s = Scaling(R"({"rope_type":"yarn","factor":4.0,
      "original_max_position_embeddings":4096})");
  EXPECT_THAT(ComputeRopeFrequencies(s, 10000.0, 64, 131072).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rope_scaling.factor")));
}

TEST(Rope, UnknownTypeIsRefused) {
  kv::RopeScaling s;
  s.type = "longrope";
  EXPECT_THAT(ComputeRopeFrequencies(s, 10000.0, 64, 4096).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("longrope")));
}

}  // namespace
}  // namespace kvrelay::model
