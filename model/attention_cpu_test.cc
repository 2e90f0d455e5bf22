#include "model/attention_cpu.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/random_floats.h"

namespace kvrelay::model {
namespace {

using ::kvrelay::testing::RandomFloats;

struct Case {
  int32_t qk_dim, v_dim;
  float softcap;
};

class AttendQueriesTest : public ::testing::TestWithParam<Case> {};

// Llama-like 64/64, GPT-2's 32, MLA's latent keys (80 wide, 64-value latent), a v_dim that is
// not a multiple of 16, Gemma's soft-capping.
INSTANTIATE_TEST_SUITE_P(Dims, AttendQueriesTest,
                         ::testing::Values(Case{64, 64, 0}, Case{32, 32, 0}, Case{80, 64, 0},
                                           Case{24, 40, 0}, Case{64, 64, 50.0f}));

TEST_P(AttendQueriesTest, QueriesAreIndependentOfTheirBlockAndKernel) {
  const Case c = GetParam();
  const int64_t n = 150, stride = n + kAttentionKeyPadding, v_stride = c.v_dim + 8;
  const std::vector<float> keys = RandomFloats(n * c.qk_dim, 1);
  std::vector<float> keys_t(c.qk_dim * stride, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    for (int32_t d = 0; d < c.qk_dim; ++d) keys_t[d * stride + j] = keys[j * c.qk_dim + d];
  }
  const std::vector<float> values = RandomFloats(n * v_stride, 2);
  // Causal rows (a prefill), a sliding window, a decode row, a single key.
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, 100}, {0, 101}, {0, 102}, {0, 103}, {0, 149}, {40, 120}, {41, 121}, {77, 77}, {0, 0}};
  const int64_t count = static_cast<int64_t>(ranges.size());
  const std::vector<float> q = RandomFloats(count * c.qk_dim, 3);
  const float scale = 0.125f;
  std::vector<float> scratch(4 * stride);

  auto run = [&](AttentionKernel kernel, int64_t block) {
    std::vector<float> out(count * c.v_dim, -1.0f);
    std::vector<AttentionQuery> queries;
    for (int64_t i = 0; i < count; ++i) {
      queries.push_back(
          {q.data() + i * c.qk_dim, out.data() + i * c.v_dim, ranges[i].first, ranges[i].second});
    }
    for (int64_t i = 0; i < count; i += block) {
      AttendQueriesForTest(kernel, queries.data() + i, std::min(block, count - i), c.qk_dim,
                           keys_t.data(), stride, values.data(), v_stride, c.v_dim, scale,
                           c.softcap, scratch.data());
    }
    return out;
  };
  const std::vector<float> want = run(AttentionKernel::kPortable, 1);
  for (AttentionKernel kernel :
       {AttentionKernel::kAuto, AttentionKernel::kAvx2, AttentionKernel::kPortable}) {
    for (int64_t block : {1, 2, 3, 4, 9}) {
      const std::vector<float> got = run(kernel, block);
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
          << "kernel " << static_cast<int>(kernel) << " block " << block;
    }
  }
  // And it is attention: against a double-precision softmax.
  for (int64_t i = 0; i < count; ++i) {
    const auto [first, last] = ranges[i];
    std::vector<double> s;
    double mx = -1e300;
    for (int64_t j = first; j <= last; ++j) {
      double dot = 0;
      for (int32_t d = 0; d < c.qk_dim; ++d)
        dot += double{q[i * c.qk_dim + d]} * keys[j * c.qk_dim + d];
      dot *= scale;
      if (c.softcap > 0) dot = c.softcap * std::tanh(dot / c.softcap);
      s.push_back(dot);
      mx = std::max(mx, dot);
    }
    double sum = 0;
    for (double& x : s) sum += (x = std::exp(x - mx));
    for (int32_t d = 0; d < c.v_dim; ++d) {
      double o = 0;
      for (int64_t j = first; j <= last; ++j) o += s[j - first] * values[j * v_stride + d];
      EXPECT_NEAR(want[i * c.v_dim + d], o / sum, 1e-5) << "query " << i << " d " << d;
    }
  }
}

}  // namespace
}  // namespace kvrelay::model
