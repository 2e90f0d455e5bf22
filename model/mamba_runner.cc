#include "model/mamba_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/cpu_ops.h"
#include "model/safetensors.h"

namespace kvrelay::model {
namespace {

// Rounds values to the dtype and back (bf16/fp16; fp32 unchanged).
void RoundTo(kv::DType dtype, float* v, int64_t n) {
  if (dtype == kv::DType::kFp32) return;
  std::vector<uint8_t> tmp(static_cast<size_t>(n) * kv::DTypeBytes(dtype));
  StoreCacheValues(v, n, dtype, tmp.data());
  LoadCacheValues(tmp.data(), n, dtype, v);
}

float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

MambaSequence::MambaSequence(const kv::ModelLayout& layout) : layout_(layout) {
  // state_bytes = intermediate * (conv_kernel + state_size) * dtype; the split is recovered by
  // the runner from its config, so keep one flat fp32 buffer per part sized by the runner on
  // first use.
}

std::vector<uint8_t> MambaSequence::SerializeState() const {
  const kv::DType dtype = layout_.dtype();
  const int64_t esize = kv::DTypeBytes(dtype);
  const kv::LayerGroup& g = layout_.groups()[0];
  std::vector<uint8_t> out(static_cast<size_t>(layout_.BlockBytes(0)), 0);
  if (conv_.empty()) return out;  // zero state
  const int64_t layers = g.num_layers();
  const int64_t conv_n = static_cast<int64_t>(conv_.size()) / layers;
  const int64_t ssm_n = static_cast<int64_t>(ssm_.size()) / layers;
  for (int64_t l = 0; l < layers; ++l) {
    uint8_t* dst = out.data() + l * g.state_bytes;
    StoreCacheValues(conv_.data() + l * conv_n, conv_n, dtype, dst);
    StoreCacheValues(ssm_.data() + l * ssm_n, ssm_n, dtype, dst + conv_n * esize);
  }
  return out;
}

absl::Status MambaSequence::Restore(absl::Span<const uint8_t> state, int64_t num_tokens) {
  if (static_cast<int64_t>(state.size()) != layout_.BlockBytes(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mamba: state has ", state.size(), " bytes, the layout's is ", layout_.BlockBytes(0)));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("mamba: num_tokens ", num_tokens, " < 0"));
  }
  // Parsed lazily by the runner (it knows the conv/ssm split); keep the bytes.
  pending_.assign(state.begin(), state.end());
  conv_.clear();
  ssm_.clear();
  num_tokens_ = num_tokens;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MambaRunner>> MambaRunner::Load(const std::string& model_dir,
                                                               const RunnerOptions& options) {
  kv::ConfigOptions config_options;
  config_options.block_tokens = options.block_tokens;
  config_options.dtype = options.cache_dtype;
  // LoadHfConfig refuses fp8 for a recurrent state, naming kv_cache_dtype.
  config_options.kv_dtype = options.kv_cache_dtype;
  KV_ASSIGN_OR_RETURN(kv::ModelConfig config,
                      kv::LoadHfConfig(model_dir + "/config.json", config_options));
  return Load(model_dir, std::move(config), options);
}

absl::StatusOr<std::unique_ptr<MambaRunner>> MambaRunner::Load(const std::string& model_dir,
                                                               kv::ModelConfig config,
                                                               const RunnerOptions& options) {
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(config));
  if (arch != Arch::kMamba) {
    return absl::InvalidArgumentError(
        absl::StrCat("mamba runner: model_type is '", config.model_type, "', not mamba"));
  }
  KV_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsModel> files, SafetensorsModel::Open(model_dir));
  KV_ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(*files, config));
  return Create(std::move(config), std::move(weights), options);
}

absl::StatusOr<std::unique_ptr<MambaRunner>> MambaRunner::Create(kv::ModelConfig config,
                                                                 ModelWeights weights,
                                                                 const RunnerOptions& options) {
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(config));
  if (arch != Arch::kMamba) {
    return absl::InvalidArgumentError("mamba runner: not a mamba config");
  }
  if (options.threads < 1 || options.threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("runner: threads must be in [1, 256], got ", options.threads));
  }
  if (config.layout.dtype() == kv::DType::kFp8) {
    return absl::UnimplementedError(
        "mamba runner: kv_cache_dtype fp8_e4m3 is for attention KV caches; a Mamba recurrent "
        "state has no fp8 form (use bf16, fp16 or fp32)");
  }
  if (static_cast<int32_t>(weights.layers.size()) != config.num_hidden_layers) {
    return absl::InvalidArgumentError("mamba runner: weights and config disagree on layers");
  }
  // A = -exp(A_log), once.
  for (LayerWeights& l : weights.layers) {
    for (float& a : l.a_log) a = -std::exp(a);
  }
  SetBlasThreads(options.threads);
  auto runner =
      std::unique_ptr<MambaRunner>(new MambaRunner(std::move(config), std::move(weights), options));
  const kv::ModelConfig& c = runner->config_;
  for (LayerWeights& l : runner->weights_.layers) {
    PackedLayer p;
    p.in = PackedWeights::Pack(l.in_proj.data(), 2 * c.intermediate_size, c.hidden_size);
    p.x = PackedWeights::Pack(l.x_proj.data(), c.time_step_rank + 2 * c.ssm_state_size,
                              c.intermediate_size);
    p.dt = PackedWeights::Pack(l.dt_proj.data(), c.intermediate_size, c.time_step_rank);
    p.out = PackedWeights::Pack(l.o_proj.data(), c.hidden_size, c.intermediate_size);
    for (std::vector<float>* unpacked : {&l.in_proj, &l.x_proj, &l.dt_proj, &l.o_proj}) {
      std::vector<float>().swap(*unpacked);
    }
    runner->packed_.push_back(std::move(p));
  }
  return runner;
}

MambaRunner::MambaRunner(kv::ModelConfig config, ModelWeights weights, RunnerOptions options)
    : config_(std::move(config)), weights_(std::move(weights)), options_(options) {}

absl::Status MambaRunner::Check(const MambaSequence& seq, absl::Span<const int32_t> tokens) const {
  if (!(seq.layout().fingerprint() == layout().fingerprint())) {
    return absl::InvalidArgumentError(absl::StrCat("mamba: sequence has layout ",
                                                   seq.layout().model_id(), ", model's is ",
                                                   layout().model_id()));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("mamba: token ", i, " is ", tokens[i],
                                                     ", outside [0, ", config_.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> MambaRunner::Prefill(MambaSequence& seq,
                                                        absl::Span<const int32_t> tokens,
                                                        const MambaPrefillOptions& options) const {
  if (tokens.empty()) return absl::InvalidArgumentError("mamba prefill: no tokens");
  KV_RETURN_IF_ERROR(Check(seq, tokens));
  std::vector<std::vector<uint8_t>> checkpoints;
  std::vector<float> logits;
  const int64_t start = seq.num_tokens();
  {
    absl::MutexLock lock(&mu_);
    MambaSequence* one[] = {&seq};
    logits = Forward(one, /*decode=*/false, tokens, options.all_logits, &checkpoints);
  }
  if (options.on_checkpoint) {
    const int64_t bt = layout().block_tokens();
    int64_t b = start / bt;  // first boundary crossed: after token (b + 1) * bt - 1
    for (const std::vector<uint8_t>& c : checkpoints) options.on_checkpoint(b++, c);
  }
  return logits;
}

absl::StatusOr<std::vector<float>> MambaRunner::DecodeStep(absl::Span<MambaSequence* const> seqs,
                                                           absl::Span<const int32_t> tokens) const {
  if (seqs.empty()) return absl::InvalidArgumentError("mamba decode: empty batch");
  if (seqs.size() != tokens.size()) {
    return absl::InvalidArgumentError("mamba decode: sequences and tokens differ in number");
  }
  absl::flat_hash_set<const MambaSequence*> seen;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i] == nullptr || !seen.insert(seqs[i]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("mamba decode: batch entry ", i, " is null or repeats a sequence"));
    }
    KV_RETURN_IF_ERROR(Check(*seqs[i], tokens.subspan(i, 1)));
  }
  absl::MutexLock lock(&mu_);
  return Forward(seqs, /*decode=*/true, tokens, /*all_logits=*/true, nullptr);
}

std::vector<float> MambaRunner::Forward(absl::Span<MambaSequence* const> seqs, bool decode,
                                        absl::Span<const int32_t> tokens, bool all_logits,
                                        std::vector<std::vector<uint8_t>>* checkpoints) const {
  const kv::ModelConfig& c = config_;
  const kv::DType dtype = layout().dtype();
  const int64_t esize = kv::DTypeBytes(dtype);
  const int64_t r = static_cast<int64_t>(tokens.size());
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size;
  const int64_t k_conv = c.conv_kernel, n_state = c.ssm_state_size, rank = c.time_step_rank;
  const int64_t layers = c.num_hidden_layers;
  const int64_t bt = layout().block_tokens();
  const int64_t state_bytes = layout().groups()[0].state_bytes;
  const float eps = static_cast<float>(c.layer_norm_epsilon);
  const int64_t start = decode ? 0 : seqs[0]->num_tokens();
  const int threads = options_.threads;

  // Materialise every sequence's state in fp32 (zero, or parsed from a restored checkpoint).
  for (MambaSequence* s : seqs) {
    if (!s->conv_.empty()) continue;
    s->conv_.assign(static_cast<size_t>(layers * inter * k_conv), 0.0f);
    s->ssm_.assign(static_cast<size_t>(layers * inter * n_state), 0.0f);
    if (!s->pending_.empty()) {
      for (int64_t l = 0; l < layers; ++l) {
        const uint8_t* src = s->pending_.data() + l * state_bytes;
        LoadCacheValues(src, inter * k_conv, dtype, s->conv_.data() + l * inter * k_conv);
        LoadCacheValues(src + inter * k_conv * esize, inter * n_state, dtype,
                        s->ssm_.data() + l * inter * n_state);
      }
      s->pending_.clear();
    }
  }
  // Boundaries this prefill crosses: after positions p with (p + 1) % bt == 0.
  std::vector<int64_t> boundary_rows;
  if (!decode) {
    for (int64_t i = 0; i < r; ++i) {
      if ((start + i + 1) % bt == 0) boundary_rows.push_back(i);
    }
    checkpoints->assign(boundary_rows.size(),
                        std::vector<uint8_t>(static_cast<size_t>(layout().BlockBytes(0))));
  }
  auto seq_of = [&](int64_t row) { return decode ? seqs[row] : seqs[0]; };

  std::vector<float> h(r * hidden), xn(r * hidden), proj(r * 2 * inter), xc(r * inter),
      params(r * (rank + 2 * n_state)), dt(r * inter), y(r * inter), out(r * hidden);
  for (int64_t i = 0; i < r; ++i) {
    std::memcpy(h.data() + i * hidden, weights_.embed_tokens.data() + int64_t{tokens[i]} * hidden,
                sizeof(float) * hidden);
  }
  for (int64_t l = 0; l < layers; ++l) {
    const LayerWeights& w = weights_.layers[l];
    const PackedLayer& p = packed_[l];
    RmsNorm(h.data(), r, hidden, w.input_norm.data(), eps, xn.data());
    PackedLinear(xn.data(), r, p.in, proj.data(), threads);
    if (!w.in_proj_bias.empty()) AddBias(proj.data(), r, 2 * inter, w.in_proj_bias.data());
    // Causal depthwise conv over the running window (newest input last), then SiLU.
    size_t next_boundary = 0;
    for (int64_t i = 0; i < r; ++i) {
      float* window = seq_of(i)->conv_.data() + l * inter * k_conv;
      const float* x = proj.data() + i * 2 * inter;
      for (int64_t ch = 0; ch < inter; ++ch) {
        float* wnd = window + ch * k_conv;
        std::memmove(wnd, wnd + 1, sizeof(float) * (k_conv - 1));
        wnd[k_conv - 1] = x[ch];
        const float* cw = w.conv_weight.data() + ch * k_conv;
        float acc = 0.0f;
        for (int64_t j = 0; j < k_conv; ++j) acc += wnd[j] * cw[j];
        if (!w.conv_bias.empty()) acc += w.conv_bias[ch];
        xc[i * inter + ch] = Silu(acc);
      }
      if (!decode && next_boundary < boundary_rows.size() && boundary_rows[next_boundary] == i) {
        RoundTo(dtype, window, inter * k_conv);
        StoreCacheValues(window, inter * k_conv, dtype,
                         (*checkpoints)[next_boundary].data() + l * state_bytes);
        ++next_boundary;
      }
    }
    // [dt | B | C] and the step size.
    PackedLinear(xc.data(), r, p.x, params.data(), threads);
    PackedLinear(params.data(), r, p.dt, dt.data(), threads, rank + 2 * n_state, inter);
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t ch = 0; ch < inter; ++ch) {
        dt[i * inter + ch] = Softplus(dt[i * inter + ch] + w.dt_bias[ch]);
      }
    }
    // Selective scan, token by token.
    next_boundary = 0;
    for (int64_t i = 0; i < r; ++i) {
      float* state = seq_of(i)->ssm_.data() + l * inter * n_state;
      const float* bv = params.data() + i * (rank + 2 * n_state) + rank;
      const float* cv = bv + n_state;
      for (int64_t ch = 0; ch < inter; ++ch) {
        const float d = dt[i * inter + ch];
        const float x = xc[i * inter + ch];
        float* st = state + ch * n_state;
        const float* a = w.a_log.data() + ch * n_state;  // holds A = -exp(A_log)
        float acc = 0.0f;
        for (int64_t n = 0; n < n_state; ++n) {
          st[n] = std::exp(a[n] * d) * st[n] + (d * bv[n]) * x;
          acc += st[n] * cv[n];
        }
        const float z = proj[i * 2 * inter + inter + ch];
        y[i * inter + ch] = (acc + x * w.d_skip[ch]) * Silu(z);
      }
      if (!decode && next_boundary < boundary_rows.size() && boundary_rows[next_boundary] == i) {
        RoundTo(dtype, state, inter * n_state);
        StoreCacheValues(
            state, inter * n_state, dtype,
            (*checkpoints)[next_boundary].data() + l * state_bytes + inter * k_conv * esize);
        ++next_boundary;
      }
    }
    PackedLinear(y.data(), r, p.out, out.data(), threads);
    if (!w.o_bias.empty()) AddBias(out.data(), r, hidden, w.o_bias.data());
    for (int64_t i = 0; i < r * hidden; ++i) h[i] += out[i];
  }
  // End of call: the state is rounded to the dtype (transformers' cache write).
  for (MambaSequence* s : seqs) {
    RoundTo(dtype, s->conv_.data(), static_cast<int64_t>(s->conv_.size()));
    RoundTo(dtype, s->ssm_.data(), static_cast<int64_t>(s->ssm_.size()));
    s->num_tokens_ += decode ? 1 : r;
  }
  // Logits: each requested row alone (its result must not depend on which rows asked).
  const int64_t first = all_logits ? 0 : r - 1;
  const int64_t nl = r - first;
  std::vector<float> normed(nl * hidden), logits(nl * c.vocab_size);
  RmsNorm(h.data() + first * hidden, nl, hidden, weights_.final_norm.data(), eps, normed.data());
  Linear(normed.data(), nl, hidden, weights_.output_weights().data(), c.vocab_size, logits.data(),
         0, kRowwiseTiles);
  return logits;
}

}  // namespace kvrelay::model
