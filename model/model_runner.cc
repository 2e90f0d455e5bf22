#include "model/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "model/attention_cpu.h"
#include "model/cpu_ops.h"
#include "model/numeric.h"
#include "model/safetensors.h"

namespace kvrelay::model {
namespace {

// Grows a workspace vector to n floats (never shrinks) and returns its data. Contents are
// whatever the last call left; every user writes before it reads.
float* Scratch(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

void AddInPlace(float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Load(const std::string& model_dir,
                                                               const RunnerOptions& options) {
  kv::ConfigOptions config_options;
  config_options.block_tokens = options.block_tokens;
  config_options.dtype = options.cache_dtype;
  config_options.kv_dtype = options.kv_cache_dtype;
  KV_ASSIGN_OR_RETURN(kv::ModelConfig config,
                      kv::LoadHfConfig(model_dir + "/config.json", config_options));
  return Load(model_dir, std::move(config), options);
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Load(const std::string& model_dir,
                                                               kv::ModelConfig config,
                                                               const RunnerOptions& options) {
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(config));
  if (arch == Arch::kMamba) {
    return absl::UnimplementedError(
        "model runner: model_type 'mamba' carries a recurrent state, not a KV cache; run it "
        "with MambaRunner (model/mamba_runner.h)");
  }
  KV_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsModel> files, SafetensorsModel::Open(model_dir));
  KV_ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(*files, config));
  return Create(std::move(config), std::move(weights), options);
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(kv::ModelConfig config,
                                                                 ModelWeights weights,
                                                                 const RunnerOptions& options) {
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(config));
  if (arch == Arch::kMamba) {
    return absl::UnimplementedError(
        "model runner: model_type 'mamba' carries a recurrent state, not a KV cache; run it "
        "with MambaRunner (model/mamba_runner.h)");
  }
  if (options.threads < 1 || options.threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("runner: threads must be in [1, 256], got ", options.threads));
  }
  if (options.gemm_tile_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("runner: gemm_tile_tokens must be >= 0, got ", options.gemm_tile_tokens));
  }
  if (static_cast<int32_t>(weights.layers.size()) != config.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("runner: weights hold ", weights.layers.size(),
                                                   " layers, config has ",
                                                   config.num_hidden_layers));
  }
  RunnerOptions opts = options;
  if (opts.gemm_tile_tokens == 0) opts.gemm_tile_tokens = config.layout.block_tokens();
  Activation activation;
  const std::string& act = config.hidden_act;
  if (act == "silu" || act == "swish") {
    activation = Activation::kSilu;
  } else if (act == "gelu_pytorch_tanh" || act == "gelu_new" || act == "gelu_fast") {
    activation = Activation::kGeluTanh;
  } else if (act == "gelu") {
    activation = Activation::kGeluErf;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("config: activation '", act, "' is not implemented"));
  }
  const int32_t rope_dim = arch == Arch::kMla ? config.qk_rope_head_dim : config.head_dim;
  RopeFrequencies rope, rope_local;
  if (arch != Arch::kGpt2) {
    KV_ASSIGN_OR_RETURN(rope, ComputeRopeFrequencies(config.rope_scaling, config.rope_theta,
                                                     rope_dim, config.max_position_embeddings));
  }
  if (arch == Arch::kGemma3) {
    // Gemma 3's local layers use plain RoPE at rope_local_base_freq, whatever rope_scaling says.
    KV_ASSIGN_OR_RETURN(
        rope_local, ComputeRopeFrequencies(
                        kv::RopeScaling{},
                        config.rope_local_theta > 0 ? config.rope_local_theta : config.rope_theta,
                        rope_dim, config.max_position_embeddings));
  }
  SetBlasThreads(opts.threads);
  auto runner = std::unique_ptr<ModelRunner>(
      new ModelRunner(std::move(config), std::move(weights), arch, opts));
  runner->activation_ = activation;
  runner->PackWeights();
  if (runner->options_.batch_invariant_decode) runner->ReleaseUnpackedProjections();
  runner->rope_ = std::move(rope);
  runner->rope_local_ = std::move(rope_local);
  return runner;
}

absl::Status ModelRunner::CheckPositions(int64_t end) const {
  if (arch_ == Arch::kGpt2 && end > config_.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("runner: gpt2 has learned positions for ", config_.max_position_embeddings,
                     " tokens (n_positions); this sequence would reach ", end));
  }
  if (rope_.max_positions > 0 && end > rope_.max_positions) {
    return absl::InvalidArgumentError(
        absl::StrCat("runner: rope_scaling dynamic is served only below max_position_embeddings (",
                     rope_.max_positions, "); this sequence would reach ", end,
                     " tokens (transformers would re-rotate with new frequencies past it)"));
  }
  return absl::OkStatus();
}

ModelRunner::ModelRunner(kv::ModelConfig config, ModelWeights weights, Arch arch,
                         RunnerOptions options)
    : config_(std::move(config)), weights_(std::move(weights)), arch_(arch), options_(options) {}

void ModelRunner::PackWeights() {
  const kv::ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size;
  auto pack = [](const std::vector<float>& w, int64_t in) {
    if (w.empty() || in == 0) return PackedWeights();
    return PackedWeights::Pack(w.data(), static_cast<int64_t>(w.size()) / in, in);
  };
  packed_.resize(weights_.layers.size());
  for (size_t l = 0; l < weights_.layers.size(); ++l) {
    const LayerWeights& w = weights_.layers[l];
    PackedLayer& p = packed_[l];
    const int64_t attn_width = arch_ == Arch::kMla ? int64_t{c.num_attention_heads} * c.v_head_dim
                                                   : int64_t{c.num_attention_heads} * c.head_dim;
    p.q = pack(w.q_proj, hidden);
    p.k = pack(w.k_proj, hidden);
    p.v = pack(w.v_proj, hidden);
    p.o = pack(w.o_proj, attn_width);
    p.gate = pack(w.gate_proj, hidden);
    p.up = pack(w.up_proj, hidden);
    p.down = pack(w.down_proj, c.intermediate_size);
    if (arch_ == Arch::kMla) {
      p.q_a = pack(w.q_a_proj, hidden);
      p.q_b = pack(w.q_b_proj, c.q_lora_rank);
      p.kv_a = pack(w.kv_a_proj, hidden);
      // kv_b_proj rows for head h: [W_UK_h (nope rows); W_UV_h (vd rows)], lora wide. The
      // absorbed query multiplies by W_UK_h itself ([nope, lora]), so pack its transpose.
      const int64_t nope = c.qk_nope_head_dim, vd = c.v_head_dim, lora = c.kv_lora_rank;
      std::vector<float> uk_t(static_cast<size_t>(lora * nope));
      for (int32_t h = 0; h < c.num_attention_heads; ++h) {
        const float* w_uk = w.kv_b_proj.data() + int64_t{h} * (nope + vd) * lora;
        for (int64_t i = 0; i < nope; ++i) {
          for (int64_t o = 0; o < lora; ++o) uk_t[o * nope + i] = w_uk[i * lora + o];
        }
        p.uk.push_back(PackedWeights::Pack(uk_t.data(), lora, nope));
        p.uv.push_back(PackedWeights::Pack(w_uk + nope * lora, vd, lora));
      }
    }
  }
}

int64_t ModelRunner::weight_bytes() const {
  int64_t bytes = 0;
  auto add = [&bytes](const std::vector<float>& t) {
    bytes += static_cast<int64_t>(t.capacity() * sizeof(float));
  };
  add(weights_.embed_tokens);
  add(weights_.pos_embed);
  add(weights_.final_norm);
  add(weights_.final_norm_bias);
  add(weights_.lm_head);
  for (const LayerWeights& w : weights_.layers) {
    for (const std::vector<float>* t : {&w.input_norm,      &w.post_attention_norm,
                                        &w.pre_ffn_norm,    &w.post_ffn_norm,
                                        &w.q_proj,          &w.k_proj,
                                        &w.v_proj,          &w.q_norm,
                                        &w.k_norm,          &w.q_a_proj,
                                        &w.q_a_norm,        &w.q_b_proj,
                                        &w.kv_a_proj,       &w.kv_a_norm,
                                        &w.kv_b_proj,       &w.o_proj,
                                        &w.gate_proj,       &w.up_proj,
                                        &w.down_proj,       &w.q_bias,
                                        &w.k_bias,          &w.v_bias,
                                        &w.o_bias,          &w.gate_bias,
                                        &w.up_bias,         &w.down_bias,
                                        &w.input_norm_bias, &w.post_attention_norm_bias,
                                        &w.qkv_proj,        &w.qkv_bias}) {
      add(*t);
    }
  }
  for (const PackedLayer& p : packed_) {
    for (const PackedWeights* t :
         {&p.q, &p.k, &p.v, &p.o, &p.gate, &p.up, &p.down, &p.q_a, &p.q_b, &p.kv_a}) {
      bytes += t->bytes();
    }
    for (const PackedWeights& t : p.uk) bytes += t.bytes();
    for (const PackedWeights& t : p.uv) bytes += t.bytes();
  }
  return bytes;
}

void ModelRunner::ReleaseUnpackedProjections() {
  for (LayerWeights& w : weights_.layers) {
    for (std::vector<float>* unpacked :
         {&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.gate_proj, &w.up_proj, &w.down_proj,
          &w.q_a_proj, &w.q_b_proj, &w.kv_a_proj, &w.kv_b_proj}) {
      std::vector<float>().swap(*unpacked);
    }
  }
}

void ModelRunner::Project(const float* x, int64_t rows, int64_t in, const std::vector<float>& w,
                          const PackedWeights& packed, int64_t out, float* y, int64_t origin,
                          int64_t tile) const {
  if (RowInvariant(tile) && !packed.empty()) {
    KV_DCHECK(packed.in() == in && packed.out() == out);
    PackedLinear(x, rows, packed, y, options_.threads);
    return;
  }
  Linear(x, rows, in, w.data(), out, y, origin, tile);
}

absl::StatusOr<std::vector<float>> ModelRunner::Prefill(Sequence& seq,
                                                        absl::Span<const int32_t> tokens,
                                                        const PrefillOptions& options) const {
  KV_RETURN_IF_ERROR(CheckPrefillInput(seq, tokens, config_));
  const int64_t start = seq.num_tokens();
  const int64_t n = static_cast<int64_t>(tokens.size());
  KV_RETURN_IF_ERROR(CheckPositions(start + n));
  KV_RETURN_IF_ERROR(seq.EnsureBlocks(start + n));
  // Every prefill GEMM is row-invariant (PackedLinear), so rows [start, start + n) computed
  // here are bit-identical to the same rows of one full prefill, wherever it starts.
  const int64_t tile = options_.gemm_tile_tokens;
  std::vector<Row> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i] = Row{&seq, start + i};
  std::vector<int64_t> logit_rows;
  if (options.all_logits) {
    for (int64_t i = 0; i < n; ++i) logit_rows.push_back(i);
  } else {
    logit_rows.push_back(n - 1);
  }
  absl::MutexLock lock(&mu_);
  KV_ASSIGN_OR_RETURN(std::vector<float> logits,
                      Forward(rows, tokens, /*tile_origin=*/0, tile, logit_rows, &options));
  seq.AppendTokens(tokens);
  return logits;
}

absl::StatusOr<std::vector<float>> ModelRunner::DecodeStep(absl::Span<Sequence* const> seqs,
                                                           absl::Span<const int32_t> tokens) const {
  KV_RETURN_IF_ERROR(CheckDecodeInput(seqs, tokens, config_));
  for (Sequence* s : seqs) KV_RETURN_IF_ERROR(CheckPositions(s->num_tokens() + 1));
  for (Sequence* s : seqs) KV_RETURN_IF_ERROR(s->EnsureBlocks(s->num_tokens() + 1));
  std::vector<Row> rows(seqs.size());
  std::vector<int64_t> logit_rows(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    rows[i] = Row{seqs[i], seqs[i]->num_tokens()};
    logit_rows[i] = static_cast<int64_t>(i);
  }
  absl::MutexLock lock(&mu_);
  const int64_t tile = options_.batch_invariant_decode ? kRowwiseTiles : 0;
  KV_ASSIGN_OR_RETURN(std::vector<float> logits,
                      Forward(rows, tokens, 0, tile, logit_rows, /*prefill=*/nullptr));
  for (size_t i = 0; i < seqs.size(); ++i) seqs[i]->AppendTokens(tokens.subspan(i, 1));
  return logits;
}

absl::StatusOr<std::vector<float>> ModelRunner::Forward(const std::vector<Row>& rows,
                                                        absl::Span<const int32_t> tokens,
                                                        int64_t tile_origin, int64_t tile,
                                                        const std::vector<int64_t>& logit_rows,
                                                        const PrefillOptions* prefill) const {
  const kv::ModelConfig& c = config_;
  const int64_t r = static_cast<int64_t>(rows.size());
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const int64_t origin = tile > 0 ? rows[0].position - tile_origin : 0;
  const int64_t attn_width = arch_ == Arch::kMla ? int64_t{c.num_attention_heads} * c.v_head_dim
                                                 : int64_t{c.num_attention_heads} * c.head_dim;

  // h: [r, hidden] residual stream.
  float* h = Scratch(ws_.h, r * hidden);
  float embed_scale = 1.0f;
  if (arch_ == Arch::kGemma3) {
    // Gemma scales embeddings by sqrt(hidden) rounded to the weights' dtype.
    embed_scale = std::sqrt(static_cast<float>(hidden));
    if (c.dtype == kv::DType::kBf16) embed_scale = Bf16ToFloat(FloatToBf16(embed_scale));
    if (c.dtype == kv::DType::kFp16) embed_scale = Fp16ToFloat(FloatToFp16(embed_scale));
  }
  for (int64_t i = 0; i < r; ++i) {
    const float* e = weights_.embed_tokens.data() + int64_t{tokens[i]} * hidden;
    for (int64_t d = 0; d < hidden; ++d) h[i * hidden + d] = e[d] * embed_scale;
    if (arch_ == Arch::kGpt2) {
      const float* p = weights_.pos_embed.data() + rows[i].position * hidden;
      for (int64_t d = 0; d < hidden; ++d) h[i * hidden + d] += p[d];
    }
  }
  const bool gpt2 = arch_ == Arch::kGpt2;
  const float ln_eps = static_cast<float>(c.layer_norm_epsilon);
  float* xn = Scratch(ws_.xn, r * hidden);
  float* attn = Scratch(ws_.attn, r * attn_width);
  float* proj = Scratch(ws_.proj, r * hidden);
  float* gate = Scratch(ws_.gate, r * inter);
  float* up = Scratch(ws_.up, r * inter);
  for (int32_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const LayerWeights& w = weights_.layers[layer];
    const PackedLayer& p = packed_[layer];
    // The held tokens' KV of this layer (a prefix still arriving layer by layer) is read by
    // the attention below, not before.
    if (prefill != nullptr && prefill->before_layer) {
      KV_RETURN_IF_ERROR(prefill->before_layer(layer));
    }
    if (gpt2) {
      LayerNorm(h, r, hidden, w.input_norm.data(), w.input_norm_bias.data(), ln_eps, xn);
    } else {
      RmsNorm(h, r, hidden, w.input_norm.data(), eps, xn);
    }
    if (arch_ == Arch::kMla) {
      MlaAttention(layer, rows, xn, origin, tile, attn);
    } else {
      GqaAttention(layer, rows, xn, origin, tile, attn);
    }
    if (prefill != nullptr && prefill->on_layer_done) prefill->on_layer_done(layer);
    Project(attn, r, attn_width, w.o_proj, p.o, hidden, proj, origin, tile);
    if (!w.o_bias.empty()) AddBias(proj, r, hidden, w.o_bias.data());
    if (arch_ == Arch::kGemma3) {
      RmsNorm(proj, r, hidden, w.post_attention_norm.data(), eps, proj);
      AddInPlace(h, proj, r * hidden);
      RmsNorm(h, r, hidden, w.pre_ffn_norm.data(), eps, xn);
    } else if (gpt2) {
      AddInPlace(h, proj, r * hidden);
      LayerNorm(h, r, hidden, w.post_attention_norm.data(), w.post_attention_norm_bias.data(),
                ln_eps, xn);
    } else {
      AddInPlace(h, proj, r * hidden);
      RmsNorm(h, r, hidden, w.post_attention_norm.data(), eps, xn);
    }
    if (gpt2) {
      // c_fc -> activation -> c_proj, no gate.
      Project(xn, r, hidden, w.up_proj, p.up, inter, up, origin, tile);
      AddBias(up, r, inter, w.up_bias.data());
      ActivationMul(activation_, up, nullptr, r * inter);
      Project(up, r, inter, w.down_proj, p.down, hidden, proj, origin, tile);
      AddBias(proj, r, hidden, w.down_bias.data());
      AddInPlace(h, proj, r * hidden);
      continue;
    }
    Project(xn, r, hidden, w.gate_proj, p.gate, inter, gate, origin, tile);
    Project(xn, r, hidden, w.up_proj, p.up, inter, up, origin, tile);
    if (!w.gate_bias.empty()) {
      AddBias(gate, r, inter, w.gate_bias.data());
      AddBias(up, r, inter, w.up_bias.data());
    }
    ActivationMul(activation_, gate, up, r * inter);
    Project(gate, r, inter, w.down_proj, p.down, hidden, proj, origin, tile);
    if (!w.down_bias.empty()) AddBias(proj, r, hidden, w.down_bias.data());
    if (arch_ == Arch::kGemma3) {
      RmsNorm(proj, r, hidden, w.post_ffn_norm.data(), eps, proj);
    }
    AddInPlace(h, proj, r * hidden);
  }

  // Logits for the requested rows. Rows are gathered first; with all rows requested the
  // tiling matches the rows' positions.
  const int64_t nl = static_cast<int64_t>(logit_rows.size());
  std::vector<float> last(nl * hidden);
  for (int64_t i = 0; i < nl; ++i) {
    if (gpt2) {
      LayerNorm(h + logit_rows[i] * hidden, 1, hidden, weights_.final_norm.data(),
                weights_.final_norm_bias.data(), ln_eps, last.data() + i * hidden);
    } else {
      RmsNorm(h + logit_rows[i] * hidden, 1, hidden, weights_.final_norm.data(), eps,
              last.data() + i * hidden);
    }
  }
  std::vector<float> logits(nl * c.vocab_size);
  // Each logits row is computed alone (one GEMM row per call) so that the logits of a token
  // do not depend on which other rows asked for logits.
  const bool per_row = nl > 1 && tile > 0;
  if (per_row) {
    for (int64_t i = 0; i < nl; ++i) {
      Linear(last.data() + i * hidden, 1, hidden, weights_.output_weights().data(), c.vocab_size,
             logits.data() + i * c.vocab_size);
    }
  } else {
    Linear(last.data(), nl, hidden, weights_.output_weights().data(), c.vocab_size, logits.data(),
           0, tile < 0 ? tile : 0);
  }
  if (c.final_logit_softcapping > 0) {
    SoftCap(logits.data(), static_cast<int64_t>(logits.size()),
            static_cast<float>(c.final_logit_softcapping));
  }
  return logits;
}

void ModelRunner::WriteCache(int32_t layer, const std::vector<Row>& rows, const float* k,
                             const float* v, int64_t width) const {
  KvCache& cache = rows[0].seq->cache();
  const int64_t bt = layout().block_tokens();
  const kv::DType dtype = layout().dtype();
  const int group = cache.group_of_layer(layer);
  for (size_t i = 0; i < rows.size(); ++i) {
    KvCache& row_cache = rows[i].seq->cache();
    const int64_t pos = rows[i].position;
    const kv::SlotId slot = rows[i].seq->blocks(group)[pos / bt];
    const int32_t t = static_cast<int32_t>(pos % bt);
    if (dtype == kv::DType::kFp8) {
      WriteFp8Row(row_cache, layer, slot, t, k + i * width, v == nullptr ? nullptr : v + i * width);
      continue;
    }
    StoreCacheValues(k + i * width, width, dtype, row_cache.EntryAddress(layer, slot, t, 0));
    if (v != nullptr) {
      StoreCacheValues(v + i * width, width, dtype, row_cache.EntryAddress(layer, slot, t, 1));
    }
  }
}

void ModelRunner::WriteFp8Row(KvCache& cache, int32_t layer, kv::SlotId slot,
                              int32_t token_in_block, const float* k, const float* v) const {
  const int group = cache.group_of_layer(layer);
  const kv::LayerGroup& g = layout().groups()[group];
  if (g.kind == kv::LayerKind::kMlaLatent) {
    StoreFp8MlaEntry(layout(), group, k, cache.EntryAddress(layer, slot, token_in_block, 0));
    return;
  }
  // The block's first token fixes each head's scale; rows are written in position order, so
  // every later token of the block finds it stored (kv/fp8.h says why the first token).
  const bool first = token_in_block == 0;
  for (int kv = 0; kv < 2; ++kv) {
    const float* src = kv == 0 ? k : v;
    uint8_t* dst = cache.EntryAddress(layer, slot, token_in_block, kv);
    for (int32_t h = 0; h < g.num_kv_heads; ++h) {
      StoreFp8AttentionHead(src + int64_t{h} * g.head_dim, g.head_dim, first,
                            cache.Fp8ScaleAddress(layer, slot, kv, h),
                            dst + int64_t{h} * g.head_dim);
    }
  }
}

void ModelRunner::CacheAttention(int32_t layer, const std::vector<Row>& rows, const float* q,
                                 int32_t qk_dim, int32_t v_dim, float scale, float softcap,
                                 float* out) const {
  const int32_t heads = config_.num_attention_heads;
  const int64_t bt = layout().block_tokens();
  const int group = rows[0].seq->cache().group_of_layer(layer);
  const kv::LayerGroup& g = layout().groups()[group];
  const int32_t index = rows[0].seq->cache().index_in_group(layer);
  const bool mla = g.kind == kv::LayerKind::kMlaLatent;
  const int64_t window = g.kind == kv::LayerKind::kSlidingWindow ? g.window_tokens : 0;
  const int32_t kv_heads = mla ? 1 : g.num_kv_heads;
  const int64_t kv_width = mla ? g.latent_dim + g.rope_dim : int64_t{kv_heads} * g.head_dim;
  const int32_t group_size = heads / kv_heads;

  // Rows of one sequence are consecutive (prefill) or single (decode): handle runs.
  size_t run_begin = 0;
  while (run_begin < rows.size()) {
    size_t run_end = run_begin + 1;
    while (run_end < rows.size() && rows[run_end].seq == rows[run_begin].seq) ++run_end;
    const Sequence& seq = *rows[run_begin].seq;
    int64_t lo = INT64_MAX, hi = 0;
    for (size_t i = run_begin; i < run_end; ++i) {
      const int64_t p = rows[i].position;
      lo = std::min(lo, window > 0 ? std::max<int64_t>(0, p - window + 1) : 0);
      hi = std::max(hi, p + 1);
    }
    std::vector<const uint8_t*> units(seq.blocks(group).size(), nullptr);
    for (int64_t b = lo / bt; b * bt < hi; ++b) {
      units[b] =
          static_cast<const uint8_t*>(seq.cache().pool(group).SlotAddress(seq.blocks(group)[b]));
    }
    float* k_buf = Scratch(ws_.k_buf, (hi - lo) * kv_width);
    float* v_buf = mla ? nullptr : Scratch(ws_.v_buf, (hi - lo) * kv_width);
    GatherLayer(layout(), group, index, units, lo, hi, k_buf, mla ? nullptr : v_buf);
    const float* v_base = mla ? k_buf : v_buf;
    // Keys transposed per KV head, [kv_heads][qk_dim][stride], so AttendQueries scores 16
    // keys per vector; the padding past the context is zeroed (loaded, never used).
    const int64_t n_ctx = hi - lo;
    const int64_t stride = n_ctx + kAttentionKeyPadding;
    float* keys_t = Scratch(ws_.k_t, kv_heads * int64_t{qk_dim} * stride);
    for (int32_t kh = 0; kh < kv_heads; ++kh) {
      const float* src = k_buf + (mla ? 0 : int64_t{kh} * g.head_dim);
      for (int32_t d = 0; d < qk_dim; ++d) {
        float* dst = keys_t + (int64_t{kh} * qk_dim + d) * stride;
        for (int64_t j = 0; j < n_ctx; ++j) dst[j] = src[j * kv_width + d];
        std::fill(dst + n_ctx, dst + stride, 0.0f);
      }
    }
    // Queries grouped by KV head, row-major then head, in blocks of four: a GQA row's heads
    // share a block; with one query head per KV head, four consecutive rows do.
    const int64_t run_rows = static_cast<int64_t>(run_end - run_begin);
    const int64_t per_kv_head = run_rows * group_size;
    std::vector<AttentionQuery> queries(static_cast<size_t>(kv_heads * per_kv_head));
    for (int32_t kh = 0; kh < kv_heads; ++kh) {
      for (int64_t ri = 0; ri < run_rows; ++ri) {
        const size_t i = run_begin + static_cast<size_t>(ri);
        const int64_t p = rows[i].position;
        const int64_t first = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
        for (int32_t hg = 0; hg < group_size; ++hg) {
          const int64_t head = int64_t{kh} * group_size + hg;
          queries[kh * per_kv_head + ri * group_size + hg] =
              AttentionQuery{q + (i * heads + head) * int64_t{qk_dim},
                             out + (i * heads + head) * int64_t{v_dim}, first - lo, p - lo};
        }
      }
    }
    const int64_t blocks_per_kv_head = (per_kv_head + 3) / 4;
    const int64_t blocks = kv_heads * blocks_per_kv_head;
    ParallelFor(options_.threads, blocks, [&](int64_t ub, int64_t ue) {
      std::vector<float> scratch(static_cast<size_t>(4 * stride));
      for (int64_t u = ub; u < ue; ++u) {
        // Causal blocks grow with the row: interleave short and long ones so each thread's
        // contiguous share of units carries about the same work.
        const int64_t b = u % 2 == 0 ? u / 2 : blocks - 1 - u / 2;
        const int64_t kh = b / blocks_per_kv_head;
        const int64_t first_query = (b % blocks_per_kv_head) * 4;
        const int64_t count = std::min<int64_t>(4, per_kv_head - first_query);
        const int64_t v_offset = mla ? 0 : kh * g.head_dim;
        AttendQueries(queries.data() + kh * per_kv_head + first_query, count, qk_dim,
                      keys_t + kh * int64_t{qk_dim} * stride, stride, v_base + v_offset, kv_width,
                      v_dim, scale, softcap, scratch.data());
      }
    });
    run_begin = run_end;
  }
}

void ModelRunner::GqaAttention(int32_t layer, const std::vector<Row>& rows, const float* xn,
                               int64_t origin, int64_t tile, float* out) const {
  const kv::ModelConfig& c = config_;
  const LayerWeights& w = weights_.layers[layer];
  const PackedLayer& p = packed_[layer];
  const int64_t r = static_cast<int64_t>(rows.size());
  const int64_t hidden = c.hidden_size;
  const int32_t heads = c.num_attention_heads;
  const int32_t kv_heads = c.num_key_value_heads;
  const int32_t hd = c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  float* q = Scratch(ws_.q, r * heads * hd);
  float* k = Scratch(ws_.k, r * kv_heads * hd);
  float* v = Scratch(ws_.v, r * kv_heads * hd);
  Project(xn, r, hidden, w.q_proj, p.q, int64_t{heads} * hd, q, origin, tile);
  Project(xn, r, hidden, w.k_proj, p.k, int64_t{kv_heads} * hd, k, origin, tile);
  Project(xn, r, hidden, w.v_proj, p.v, int64_t{kv_heads} * hd, v, origin, tile);
  if (!w.q_bias.empty()) {
    AddBias(q, r, int64_t{heads} * hd, w.q_bias.data());
    AddBias(k, r, int64_t{kv_heads} * hd, w.k_bias.data());
    AddBias(v, r, int64_t{kv_heads} * hd, w.v_bias.data());
  }
  const int group = rows[0].seq->cache().group_of_layer(layer);
  const bool sliding = layout().groups()[group].kind == kv::LayerKind::kSlidingWindow;
  const RopeFrequencies* rope = &rope_;
  float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float softcap = 0.0f;
  if (arch_ == Arch::kGemma3) {
    RmsNorm(q, r * heads, hd, w.q_norm.data(), eps, q);
    RmsNorm(k, r * kv_heads, hd, w.k_norm.data(), eps, k);
    if (sliding) rope = &rope_local_;
    scale = static_cast<float>(std::pow(c.query_pre_attn_scalar, -0.5));
    softcap = static_cast<float>(c.attn_logit_softcapping);
  }
  if (arch_ == Arch::kGpt2) {
    // Learned positions, no RoPE. scale_attn_weights: / sqrt(head_dim);
    // scale_attn_by_inverse_layer_idx: / (layer + 1) as well.
    double s = c.scale_attn_weights ? std::pow(static_cast<double>(hd), -0.5) : 1.0;
    if (c.scale_attn_by_inverse_layer_idx) s /= (layer + 1);
    scale = static_cast<float>(s);
  } else {
    std::vector<int64_t> positions(r);
    for (int64_t i = 0; i < r; ++i) positions[i] = rows[i].position;
    ApplyRope(q, r, heads, hd, int64_t{heads} * hd, hd, positions.data(), rope->inv_freq,
              rope->attention_factor, RopeStyle::kHalf);
    ApplyRope(k, r, kv_heads, hd, int64_t{kv_heads} * hd, hd, positions.data(), rope->inv_freq,
              rope->attention_factor, RopeStyle::kHalf);
  }
  WriteCache(layer, rows, k, v, int64_t{kv_heads} * hd);
  CacheAttention(layer, rows, q, hd, hd, scale, softcap, out);
}

void ModelRunner::MlaAttention(int32_t layer, const std::vector<Row>& rows, const float* xn,
                               int64_t origin, int64_t tile, float* out) const {
  const kv::ModelConfig& c = config_;
  const LayerWeights& w = weights_.layers[layer];
  const PackedLayer& p = packed_[layer];
  const int64_t r = static_cast<int64_t>(rows.size());
  const int64_t hidden = c.hidden_size;
  const int32_t heads = c.num_attention_heads;
  const int32_t nope = c.qk_nope_head_dim;
  const int32_t rope = c.qk_rope_head_dim;
  const int32_t lora = c.kv_lora_rank;
  const int32_t vd = c.v_head_dim;
  const int64_t qk = nope + rope;
  const int64_t entry = lora + rope;
  // transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps (1e-6),
  // not rms_norm_eps.
  constexpr float kLoraNormEps = 1e-6f;
  const RopeStyle style = c.rope_interleave ? RopeStyle::kInterleaved : RopeStyle::kHalf;

  // Query: [r, heads, nope + rope].
  float* q = Scratch(ws_.q, r * heads * qk);
  if (c.q_lora_rank > 0) {
    float* qa = Scratch(ws_.qa, r * c.q_lora_rank);
    Project(xn, r, hidden, w.q_a_proj, p.q_a, c.q_lora_rank, qa, origin, tile);
    RmsNorm(qa, r, c.q_lora_rank, w.q_a_norm.data(), kLoraNormEps, qa);
    Project(qa, r, c.q_lora_rank, w.q_b_proj, p.q_b, heads * qk, q, origin, tile);
  } else {
    Project(xn, r, hidden, w.q_proj, p.q, heads * qk, q, origin, tile);
  }
  // Compressed KV: [r, lora + rope] = [kv_a_layernorm(latent), rope key] - the cache entry.
  float* kva = Scratch(ws_.kva, r * entry);
  Project(xn, r, hidden, w.kv_a_proj, p.kv_a, entry, kva, origin, tile);
  RmsNorm(kva, r, lora, w.kv_a_norm.data(), kLoraNormEps, kva, entry, entry);
  std::vector<int64_t> positions(r);
  for (int64_t i = 0; i < r; ++i) positions[i] = rows[i].position;
  ApplyRope(kva + lora, r, 1, rope, entry, 0, positions.data(), rope_.inv_freq,
            rope_.attention_factor, style);
  ApplyRope(q + nope, r, heads, rope, heads * qk, qk, positions.data(), rope_.inv_freq,
            rope_.attention_factor, style);
  WriteCache(layer, rows, kva, nullptr, entry);

  // Absorbed query per head: [q_nope * W_UK_h, q_pe], [r, heads, lora + rope]. kv_b_proj rows
  // for head h are [W_UK_h (nope rows); W_UV_h (vd rows)], each row lora wide.
  float* qcat = Scratch(ws_.qcat, r * heads * entry);
  for (int32_t h = 0; h < heads; ++h) {
    if (RowInvariant(tile)) {
      PackedLinear(q + h * qk, r, p.uk[h], qcat + h * entry, options_.threads, heads * qk,
                   heads * entry);
    } else {
      const float* w_uk = w.kv_b_proj.data() + int64_t{h} * (nope + vd) * lora;
      LinearNoTrans(q + h * qk, r, nope, w_uk, lora, qcat + h * entry, origin, tile, heads * qk,
                    lora, heads * entry);
    }
    for (int64_t i = 0; i < r; ++i) {
      std::memcpy(qcat + (i * heads + h) * entry + lora, q + (i * heads + h) * qk + nope,
                  sizeof(float) * rope);
    }
  }
  // Attention in latent space: keys are whole entries, values their latent part.
  float* olat = Scratch(ws_.olat, r * heads * lora);
  // DeepSeek: qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim.
  const float scale = static_cast<float>(std::pow(static_cast<double>(qk), -0.5) *
                                         MlaSoftmaxScaleFactor(c.rope_scaling));
  CacheAttention(layer, rows, qcat, static_cast<int32_t>(entry), lora, scale, 0.0f, olat);
  // W_UV applied after attention: out[:, h] = olat_h * W_UV_h^T.
  for (int32_t h = 0; h < heads; ++h) {
    if (RowInvariant(tile)) {
      PackedLinear(olat + h * lora, r, p.uv[h], out + h * vd, options_.threads,
                   int64_t{heads} * lora, int64_t{heads} * vd);
    } else {
      const float* w_uv = w.kv_b_proj.data() + (int64_t{h} * (nope + vd) + nope) * lora;
      Linear(olat + h * lora, r, lora, w_uv, vd, out + h * vd, origin, tile, int64_t{heads} * lora,
             int64_t{heads} * vd);
    }
  }
}

}  // namespace kvrelay::model
