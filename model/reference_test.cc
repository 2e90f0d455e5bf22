// Checks the runner's forward pass against a from-the-definition reference written here in
// double precision: no paging, no cache, MLA computed the textbook way (K and V expanded per
// head from the latent with kv_b_proj, no absorbed projections). The runner uses an fp32 cache
// here so the only difference is float vs double arithmetic.

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "model/model_runner.h"
#include "model/rope.h"
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

Vec Rms(const Vec& x, const std::vector<float>& w, double eps, size_t begin = 0, size_t n = 0) {
  if (n == 0) n = x.size();
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += x[begin + i] * x[begin + i];
  const double inv = 1.0 / std::sqrt(ss / n + eps);
  Vec y(n);
  for (size_t i = 0; i < n; ++i) y[i] = x[begin + i] * inv * w[i];
  return y;
}

// Rotates v[begin, begin + d) at position pos (frequencies from model/rope, which
// model_rope_test checks against the published formulas); interleaved pairs come out as
// (i, i + d/2).
void Rope(Vec& v, size_t begin, int d, int64_t pos, const RopeFrequencies& f, bool interleaved) {
  Vec out(d);
  for (int i = 0; i < d / 2; ++i) {
    const double angle = static_cast<double>(static_cast<float>(pos) * f.inv_freq[i]);
    const double c = std::cos(angle) * f.attention_factor;
    const double s = std::sin(angle) * f.attention_factor;
    const double a = interleaved ? v[begin + 2 * i] : v[begin + i];
    const double b = interleaved ? v[begin + 2 * i + 1] : v[begin + i + d / 2];
    out[i] = a * c - b * s;
    out[i + d / 2] = b * c + a * s;
  }
  for (int i = 0; i < d; ++i) v[begin + i] = out[i];
}

double Activate(const std::string& act, double g) {
  if (act == "gelu") return 0.5 * g * (1 + std::erf(g / std::sqrt(2.0)));
  if (act == "silu") return g / (1 + std::exp(-g));
  return 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
}

double Cap(double x, double cap) { return cap > 0 ? cap * std::tanh(x / cap) : x; }

void AddTo(Vec& x, const std::vector<float>& bias, size_t offset = 0) {
  if (bias.empty()) return;
  for (size_t i = 0; i < x.size(); ++i) x[i] += bias[offset + i];
}

// Logits of the last token.
Vec ReferenceLogits(const kv::ModelConfig& c, const ModelWeights& w, Arch arch,
                    const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t hidden = c.hidden_size;
  const double eps = c.rms_norm_eps;
  const int heads = c.num_attention_heads;
  const int rope_dim = arch == Arch::kMla ? c.qk_rope_head_dim : c.head_dim;
  const RopeFrequencies rope_global =
      *ComputeRopeFrequencies(c.rope_scaling, c.rope_theta, rope_dim, c.max_position_embeddings);
  const RopeFrequencies rope_local =
      *ComputeRopeFrequencies({}, c.rope_local_theta > 0 ? c.rope_local_theta : c.rope_theta,
                              rope_dim, c.max_position_embeddings);
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
      // DeepSeek: softmax scale times mscale^2 (YaRN, mscale_all_dim); q_a/kv_a norms at 1e-6.
      double mscale = 1.0;
      if (c.rope_scaling.type != "default" && c.rope_scaling.mscale_all_dim != 0) {
        mscale = 0.1 * c.rope_scaling.mscale_all_dim * std::log(c.rope_scaling.factor) + 1;
      }
      scale = mscale * mscale / std::sqrt(static_cast<double>(qk_dim));
      const bool interleaved = c.rope_interleave;
      for (int64_t t = 0; t < n; ++t) {
        Vec qa = MatVec(lw.q_a_proj, c.q_lora_rank, hidden, x[t]);
        Vec qall = MatVec(lw.q_b_proj, heads * qk_dim, c.q_lora_rank, Rms(qa, lw.q_a_norm, 1e-6));
        Vec kva = MatVec(lw.kv_a_proj, lora + rope, hidden, x[t]);
        Vec latent = Rms(kva, lw.kv_a_norm, 1e-6, 0, lora);
        Rope(kva, lora, rope, t, rope_global, interleaved);
        Vec kv = MatVec(lw.kv_b_proj, heads * (nope + vd), lora, latent);
        for (int hh = 0; hh < heads; ++hh) {
          Vec qh(qall.begin() + hh * qk_dim, qall.begin() + (hh + 1) * qk_dim);
          Rope(qh, nope, rope, t, rope_global, interleaved);
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
      const RopeFrequencies& rf =
          arch == Arch::kGemma3 && window[layer] > 0 ? rope_local : rope_global;
      for (int64_t t = 0; t < n; ++t) {
        Vec qall = MatVec(lw.q_proj, int64_t{heads} * hd, hidden, x[t]);
        Vec kall = MatVec(lw.k_proj, int64_t{kvh} * hd, hidden, x[t]);
        Vec vall = MatVec(lw.v_proj, int64_t{kvh} * hd, hidden, x[t]);
        AddTo(qall, lw.q_bias);
        AddTo(kall, lw.k_bias);
        AddTo(vall, lw.v_bias);
        for (int hh = 0; hh < heads; ++hh) {
          const int g = hh / (heads / kvh);
          Vec qh(qall.begin() + hh * hd, qall.begin() + (hh + 1) * hd);
          Vec kh(kall.begin() + g * hd, kall.begin() + (g + 1) * hd);
          Vec vh(vall.begin() + g * hd, vall.begin() + (g + 1) * hd);
          if (arch == Arch::kGemma3) {
            qh = Rms(qh, lw.q_norm, eps);
            kh = Rms(kh, lw.k_norm, eps);
          }
          Rope(qh, 0, hd, t, rf, false);
          Rope(kh, 0, hd, t, rf, false);
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
          s.push_back(Cap(dot * scale, c.attn_logit_softcapping));
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
      AddTo(o, lw.o_bias);
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
      AddTo(gate, lw.gate_bias);
      AddTo(up, lw.up_bias);
      for (int64_t i = 0; i < c.intermediate_size; ++i) {
        gate[i] = Activate(c.hidden_act, gate[i]) * up[i];
      }
      Vec down = MatVec(lw.down_proj, hidden, c.intermediate_size, gate);
      AddTo(down, lw.down_bias);
      if (arch == Arch::kGemma3) down = Rms(down, lw.post_ffn_norm, eps);
      for (int64_t d = 0; d < hidden; ++d) h[t][d] += down[d];
    }
  }
  Vec logits = MatVec(w.output_weights(), c.vocab_size, hidden, Rms(h[n - 1], w.final_norm, eps));
  for (double& l : logits) l = Cap(l, c.final_logit_softcapping);
  return logits;
}

// GPT-2 as transformers' GPT2Model computes it: wte + wpe, pre-LayerNorm blocks, MHA without
// RoPE, gelu_new MLP, ln_f, LM head tied to wte. Weights here are already [out, in] (the
// loader transposed the Conv1D [in, out] checkpoint tensors and split c_attn).
Vec LayerNormRef(const Vec& x, const std::vector<float>& w, const std::vector<float>& b,
                 double eps) {
  double mean = 0, var = 0;
  for (double v : x) mean += v / x.size();
  for (double v : x) var += (v - mean) * (v - mean) / x.size();
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = (x[i] - mean) / std::sqrt(var + eps) * w[i] + b[i];
  return y;
}

Vec Gpt2ReferenceLogits(const kv::ModelConfig& c, const ModelWeights& w,
                        const std::vector<int32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size()), d = c.hidden_size;
  const int heads = c.num_attention_heads, hd = c.head_dim;
  const double eps = c.layer_norm_epsilon;
  std::vector<Vec> h(n, Vec(d));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < d; ++i) {
      h[t][i] = double{w.embed_tokens[tokens[t] * d + i]} + w.pos_embed[t * d + i];
    }
  }
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const LayerWeights& l = w.layers[layer];
    std::vector<Vec> q(n), k(n), v(n);
    for (int64_t t = 0; t < n; ++t) {
      const Vec x = LayerNormRef(h[t], l.input_norm, l.input_norm_bias, eps);
      q[t] = MatVec(l.q_proj, d, d, x);
      k[t] = MatVec(l.k_proj, d, d, x);
      v[t] = MatVec(l.v_proj, d, d, x);
      AddTo(q[t], l.q_bias);
      AddTo(k[t], l.k_bias);
      AddTo(v[t], l.v_bias);
    }
    double scale = c.scale_attn_weights ? 1.0 / std::sqrt(static_cast<double>(hd)) : 1.0;
    if (c.scale_attn_by_inverse_layer_idx) scale /= layer + 1;
    for (int64_t t = 0; t < n; ++t) {
      Vec attn(d, 0.0);
      for (int hh = 0; hh < heads; ++hh) {
        Vec s(t + 1);
        double mx = -1e300;
        for (int64_t j = 0; j <= t; ++j) {
          double dot = 0;
          for (int i = 0; i < hd; ++i) dot += q[t][hh * hd + i] * k[j][hh * hd + i];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (double& e : s) sum += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= t; ++j) {
          for (int i = 0; i < hd; ++i) attn[hh * hd + i] += s[j] / sum * v[j][hh * hd + i];
        }
      }
      Vec o = MatVec(l.o_proj, d, d, attn);
      AddTo(o, l.o_bias);
      for (int64_t i = 0; i < d; ++i) h[t][i] += o[i];
      const Vec x2 = LayerNormRef(h[t], l.post_attention_norm, l.post_attention_norm_bias, eps);
      Vec up = MatVec(l.up_proj, c.intermediate_size, d, x2);
      AddTo(up, l.up_bias);
      for (double& u : up) u = Activate(c.hidden_act == "gelu" ? "gelu" : "gelu_new", u);
      Vec down = MatVec(l.down_proj, d, c.intermediate_size, up);
      AddTo(down, l.down_bias);
      for (int64_t i = 0; i < d; ++i) h[t][i] += down[i];
    }
  }
  return MatVec(w.embed_tokens, c.vocab_size, d,
                LayerNormRef(h[n - 1], w.final_norm, w.final_norm_bias, eps));
}

struct Variant {
  std::string name;
  std::string arch;
  std::string config_patch;  // JSON merged into the test model's config
};

class ReferenceTest : public ::testing::TestWithParam<Variant> {};

TEST_P(ReferenceTest, RunnerMatchesDefinition) {
  testing::TempDir dir;
  TestModelOptions o;
  o.arch = GetParam().arch;
  o.config_patch = GetParam().config_patch;
  o.seed = 21;
  o.layers = 2;
  if (o.arch == "gemma3") o.sliding_window = 8;  // make the window bite within 20 tokens
  KV_ASSERT_OK(WriteTestModel(dir.path(), o));
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
  const Vec want = arch == Arch::kGpt2 ? Gpt2ReferenceLogits(config, weights, tokens)
                                       : ReferenceLogits(config, weights, arch, tokens);

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

INSTANTIATE_TEST_SUITE_P(
    Archs, ReferenceTest,
    ::testing::Values(
        Variant{"llama", "llama", ""},
        Variant{"llama_linear", "llama", R"({"rope_scaling":{"rope_type":"linear","factor":4.0}})"},
        Variant{"llama_yarn", "llama",
                R"({"rope_scaling":{"rope_type":"yarn","factor":4.0,
                    "original_max_position_embeddings":1024}})"},
        Variant{"llama_dynamic_biases_gelu", "llama",
                R"({"rope_scaling":{"rope_type":"dynamic","factor":2.0,
                    "original_max_position_embeddings":null},"attention_bias":true,
                    "mlp_bias":true,"hidden_act":"gelu"})"},
        Variant{"deepseek_v3", "deepseek_v3", ""},
        Variant{"deepseek_v3_rotate_half", "deepseek_v3", R"({"rope_interleave":false})"},
        Variant{"deepseek_v3_yarn_no_mscale", "deepseek_v3",
                R"({"rope_scaling":{"type":"yarn","factor":4.0,"mscale":null,
                    "mscale_all_dim":null,"original_max_position_embeddings":1024}})"},
        // q_a/kv_a_layernorm keep eps 1e-6 whatever rms_norm_eps says.
        Variant{"deepseek_v3_norm_eps", "deepseek_v3", R"({"rms_norm_eps":0.01})"},
        Variant{"gemma3", "gemma3", ""}, Variant{"gpt2", "gpt2", ""},
        Variant{"gpt2_inverse_layer_scale", "gpt2",
                R"({"scale_attn_by_inverse_layer_idx":true,"layer_norm_epsilon":0.01})"},
        Variant{"gemma3_softcap_bias", "gemma3",
                R"({"attn_logit_softcapping":2.0,"final_logit_softcapping":3.0,
                    "attention_bias":true})"}),
    [](const ::testing::TestParamInfo<Variant>& info) { return info.param.name; });

}  // namespace
}  // namespace kvrelay::model
