// Checks the runner's forward pass against a from-the-definition reference written here in
// double precision: no paging, no cache, MLA computed the textbook way (K and V expanded per
// head from the latent with kv_b_proj, no absorbed projections). The runner uses an fp32 cache
// here so the only difference is float vs double arithmetic.

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "model/model_runner.h"
#include "model/safetensors.h"
#include "model/test_model.h"
#include "model/weights.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/test_env.h"

namespace kvrelay::model {
namespace {

using Vec = std::vector<double>;

Vec MatVec(const std::vector<float>& w, int64_t out, int64_t in, const Vec& x,
           int64_t row_offset = 0) {
  Vec y(out, 0.0);
  for (int64_t o = 0; o < out; ++o) {
    double s = 0;
    for (int64_t i = 0; i < in; ++i) s += double{w[(row_offset + o) * in + i]} * x[i];
    y[o] = s;
  }
  return y;
}

Vec Rms(const Vec& x, const std::vector<float>& w, double eps, size_t begin = 0,
        size_t n = 0) {
  if (n == 0) n = x.size();
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += x[begin + i] * x[begin + i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  Vec y(n);
  for (size_t i = 0; i < n; ++i) y[i] = x[begin + i] * inv * w[i];
  return y;
}

// Rotates v[begin, begin + d) at position pos; interleaved pairs come out as (i, i + d/2).
void Rope(Vec& v, size_t begin, int d, int64_t pos, double theta, bool interleaved) {
  Vec out(d);
  for (int i = 0; i < d / 2; ++i) {
    const double inv_freq = static_cast<float>(1.0 / std::pow(theta, 2.0 * i / d));
    const double angle = static_cast<double>(static_cast<float>(pos) * static_cast<float>(inv_freq));
    const double a = interleaved ? v[begin + 2 * i] : v[begin + i];
    const double b = interleaved ? v[begin + 2 * i + 1] : v[begin + i + d / 2];
    out[i] = a * std::cos(angle) - b * std::sin(angle);
    out[i + d / 2] = b * std::cos(angle) + a * std::sin(angle);
  }
  for (int i = 0; i < d; ++i) v[begin + i] = out[i];
}

// Logits of the last token.
Vec ReferenceLogits(const kv::ModelConfig& c, const ModelWeights& w, Arch arch,
                    const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t hidden = c.hidden_size;
  const double eps = c.rms_norm_eps;
  const int heads = c.num_attention_heads;
  std::vector<Vec> h(n, Vec(hidden));
  double embed_scale = 1.0;
  if (arch == Arch::kGemma3) embed_scale = 16.0;  // sqrt(256), exact in bf16
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t d = 0; d < hidden; ++d) {
      h[t][d] = w.embed_tokens[int64_t{tokens[t]} * hidden + d] * embed_scale;
    }
  }
  // Which layers slide: read from the layout's groups.
  std::vector<int> window(c.num_hidden_layers, 0);
  for (const kv::LayerGroup& g : c.layout.groups()) {
    for (int32_t l : g.layer_ids) {
      if (g.kind == kv::LayerKind::kSlidingWindow) window[l] = g.window_tokens;
    }
  }
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const LayerWeights& lw = w.layers[layer];
    std::vector<Vec> x(n), attn(n);
    for (int64_t t = 0; t < n; ++t) x[t] = Rms(h[t], lw.input_norm, eps);
    // Per token, per head: q, k, v (k/v per head; GQA maps heads to kv heads).
    int qk_dim, v_dim;
    std::vector<std::vector<Vec>> q(n), k(n), v(n);
    double scale;
    if (arch == Arch::kMla) {
      const int nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, lora = c.kv_lora_rank;
      const int vd = c.v_head_dim;
      qk_dim = nope + rope;
      v_dim = vd;
      scale = 1.0 / std::sqrt(static_cast<double>(qk_dim));
      for (int64_t t = 0; t < n; ++t) {
        Vec qa = MatVec(lw.q_a_proj, c.q_lora_rank, hidden, x[t]);
        Vec qall = MatVec(lw.q_b_proj, heads * qk_dim, c.q_lora_rank, Rms(qa, lw.q_a_norm, eps));
        Vec kva = MatVec(lw.kv_a_proj, lora + rope, hidden, x[t]);
        Vec latent = Rms(kva, lw.kv_a_norm, eps, 0, lora);
        Rope(kva, lora, rope, t, c.rope_theta, true);
        Vec kv = MatVec(lw.kv_b_proj, heads * (nope + vd), lora, latent);
        for (int hh = 0; hh < heads; ++hh) {
          Vec qh(qall.begin() + hh * qk_dim, qall.begin() + (hh + 1) * qk_dim);
          Rope(qh, nope, rope, t, c.rope_theta, true);
          Vec kh(qk_dim), vh(vd);
          for (int i = 0; i < nope; ++i) kh[i] = kv[hh * (nope + vd) + i];
          for (int i = 0; i < rope; ++i) kh[nope + i] = kva[lora + i];
          for (int i = 0; i < vd; ++i) vh[i] = kv[hh * (nope + vd) + nope + i];
          q[t].push_back(qh);
          k[t].push_back(kh);
          v[t].push_back(vh);
        }
      }
    } else {
      const int hd = c.head_dim, kvh = c.num_key_value_heads;
      qk_dim = v_dim = hd;
      scale = arch == Arch::kGemma3 ? 1.0 / std::sqrt(c.query_pre_attn_scalar)
                                    : 1.0 / std::sqrt(static_cast<double>(hd));
      const double theta =
          arch == Arch::kGemma3 && window[layer] > 0 ? c.rope_local_theta : c.rope_theta;
      for (int64_t t = 0; t < n; ++t) {
        Vec qall = MatVec(lw.q_proj, int64_t{heads} * hd, hidden, x[t]);
        Vec kall = MatVec(lw.k_proj, int64_t{kvh} * hd, hidden, x[t]);
        Vec vall = MatVec(lw.v_proj, int64_t{kvh} * hd, hidden, x[t]);
        for (int hh = 0; hh < heads; ++hh) {
          const int g = hh / (heads / kvh);
          Vec qh(qall.begin() + hh * hd, qall.begin() + (hh + 1) * hd);
          Vec kh(kall.begin() + g * hd, kall.begin() + (g + 1) * hd);
          Vec vh(vall.begin() + g * hd, vall.begin() + (g + 1) * hd);
          if (arch == Arch::kGemma3) {
            qh = Rms(qh, lw.q_norm, eps);
            kh = Rms(kh, lw.k_norm, eps);
          }
          Rope(qh, 0, hd, t, theta, false);
          Rope(kh, 0, hd, t, theta, false);
          q[t].push_back(qh);
          k[t].push_back(kh);
          v[t].push_back(vh);
        }
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      attn[t].assign(int64_t{heads} * v_dim, 0.0);
      const int64_t first = window[layer] > 0 ? std::max<int64_t>(0, t - window[layer] + 1) : 0;
      for (int hh = 0; hh < heads; ++hh) {
        Vec s;
        double mx = -1e300;
        for (int64_t j = first; j <= t; ++j) {
          double dot = 0;
          for (int i = 0; i < qk_dim; ++i) dot += q[t][hh][i] * k[j][hh][i];
          s.push_back(dot * scale);
          mx = std::max(mx, s.back());
        }
        double sum = 0;
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int64_t j = first; j <= t; ++j) {
          for (int i = 0; i < v_dim; ++i) {
            attn[t][hh * v_dim + i] += s[j - first] / sum * v[j][hh][i];
          }
        }
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      Vec o = MatVec(lw.o_proj, hidden, int64_t{heads} * v_dim, attn[t]);
      Vec mlp_in;
      if (arch == Arch::kGemma3) {
        o = Rms(o, lw.post_attention_norm, eps);
        for (int64_t d = 0; d < hidden; ++d) h[t][d] += o[d];
        mlp_in = Rms(h[t], lw.pre_ffn_norm, eps);
      } else {
        for (int64_t d = 0; d < hidden; ++d) h[t][d] += o[d];
        mlp_in = Rms(h[t], lw.post_attention_norm, eps);
      }
      Vec gate = MatVec(lw.gate_proj, c.intermediate_size, hidden, mlp_in);
      Vec up = MatVec(lw.up_proj, c.intermediate_size, hidden, mlp_in);
      for (int64_t i = 0; i < c.intermediate_size; ++i) {
        const double g = gate[i];
        const double act = arch == Arch::kGemma3
                               ? 0.5 * g *
                                     (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
                               : g / (1 + std::exp(-g));
        gate[i] = act * up[i];
      }
      Vec down = MatVec(lw.down_proj, hidden, c.intermediate_size, gate);
      if (arch == Arch::kGemma3) down = Rms(down, lw.post_ffn_norm, eps);
      for (int64_t d = 0; d < hidden; ++d) h[t][d] += down[d];
    }
  }
  return MatVec(w.output_weights(), c.vocab_size, hidden, Rms(h[n - 1], w.final_norm, eps));
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, RunnerMatchesDefinition) {
  testing::TempDir dir;
  TestModelOptions o;
  o.arch = GetParam();
  o.seed = 21;
  o.layers = 2;
  if (o.arch == "gemma3") o.sliding_window = 8;  // make the window bite within 20 tokens
  ASSERT_TRUE(WriteTestModel(dir.path(), o).ok());
  kv::ConfigOptions config_options;
  config_options.dtype = kv::DType::kFp32;
  config_options.block_tokens = 4;
  KV_ASSERT_OK_AND_ASSIGN(kv::ModelConfig config,
                          kv::LoadHfConfig(dir.File("config.json"), config_options));
  KV_ASSERT_OK_AND_ASSIGN(auto files, SafetensorsModel::Open(dir.path()));
  KV_ASSERT_OK_AND_ASSIGN(ModelWeights weights, LoadWeights(*files, config));
  KV_ASSERT_OK_AND_ASSIGN(Arch arch, ArchFor(config));
  std::vector<int32_t> tokens;
  for (int i = 0; i < 20; ++i) tokens.push_back((i * 37 + 11) % config.vocab_size);
  const Vec want = ReferenceLogits(config, weights, arch, tokens);

  KV_ASSERT_OK_AND_ASSIGN(auto runner, ModelRunner::Create(config, std::move(weights)));
  KV_ASSERT_OK_AND_ASSIGN(auto cache, KvCache::Create(runner->layout(), 8));
  Sequence seq(cache.get());
  KV_ASSERT_OK_AND_ASSIGN(std::vector<float> got, runner->Prefill(seq, tokens));
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  EXPECT_GT(scale, 0.1);
  EXPECT_LE(diff / scale, 1e-4) << "max abs diff " << diff << " of " << scale;
}

INSTANTIATE_TEST_SUITE_P(Archs, ReferenceTest,
                         ::testing::Values("llama", "deepseek_v3", "gemma3"));

}  // namespace
}  // namespace kvrelay::model
