// fp8_kv_accuracy_bench: what FP8 KV (kv_cache_dtype fp8_e4m3, kv/fp8.h) costs in accuracy
// and saves in bytes, against bf16 KV (the baseline), on the CPU model runner, from one run.
//
//   build-bench/bin/fp8_kv_accuracy_bench [--threads 2] [--tokens 2048] [--decode 32]
//                                         [--archs llama,deepseek_v3,gemma3,gpt2] [--quick]
//
// Per architecture: the test model (`kvrelay make-test-model`: the tiny-* preset with random
// bf16 weights, seed 7; gpt2's n_positions raised to fit the prompt) runs twice with the same
// model dtype, once with bf16 KV and once with fp8 KV. The prompt is --tokens deterministic
// pseudo-random token ids. Both prefill it, then decode teacher-forced: each step feeds both
// runs the bf16 run's greedy token, so every step compares the same context. Printed per row:
//   agree        greedy tokens of the fp8 run equal to the bf16 run's, over --decode tokens
//                (the first from the prefill's last row, then one per decode step)
//   max|dlogit|  max |logit_fp8 - logit_bf16| over those --decode logits rows
//   max|logit|   max |logit_bf16| over the same rows, for scale
//   bf16 vs fp32 max|dlogit| of a third run with fp32 KV against the bf16 one, fed the same
//                tokens: what the baseline's own rounding costs, beside fp8's
//   B/token      layout bytes per token (kv::ModelLayout::BytesPerToken, all layers; fp8
//                includes its scales), bf16 / fp8, and their ratio
// Random weights give flatter logits than a trained model, so near-ties make agreement a
// pessimistic figure; max|dlogit| is the direct one.
// A second table compares scale granularities (ours against finer per-token scales and vLLM's
// per-tensor ones) by the relative RMS error of the quantised K/V values themselves; see
// KvQuantisationError. On the test models every granularity gives the same error (their K/V
// are O(1) with no outlier tokens or channels, so the 3-bit mantissa is all that counts); the
// granularities part where values span more octaves than E4M3's normal range, as trained
// models' outlier channels and attention-sink tokens do.

#include <stdlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "common/status_macros.h"
#include "kv/fp8.h"
#include "model/kv_cache.h"
#include "model/model_runner.h"
#include "model/test_model.h"

namespace kvrelay::model {
namespace {

// Deterministic token ids in [0, vocab): SplitMix64.
std::vector<int32_t> PromptTokens(int n, int32_t vocab, uint64_t seed) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  uint64_t x = seed;
  for (int32_t& t : tokens) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    t = static_cast<int32_t>((z ^ (z >> 31)) % static_cast<uint64_t>(vocab));
  }
  return tokens;
}

int32_t Argmax(const std::vector<float>& x, int64_t offset, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i) best = x[offset + i] > x[offset + best] ? i : best;
  return best;
}

struct Row {
  std::string arch;
  int prompt_tokens = 0;
  int agree = 0;
  int decoded = 0;
  double max_delta = 0;
  double max_logit = 0;
  double bf16_vs_fp32_delta = 0;
  int64_t bf16_bytes_per_token = 0;
  int64_t fp8_bytes_per_token = 0;
  double seconds = 0;
  // Relative RMS error of the cached K/V (MLA: latent) values quantised to E4M3 with each
  // scale granularity, indexed by Granularity.
  std::array<double, 4> kv_error{};
};

// Scale granularities compared on the fp32 run's cached values (see the table's header).
enum Granularity { kOurs, kPerToken, kPerTensorAmax, kScaleOne };

// sum (x - q(x))^2 per granularity and sum x^2.
struct ErrorSums {
  std::array<double, 4> err{};
  double ref = 0;
};

// Adds n values quantised with scale[g] (as EncodeE4M3(x / s), DecodeE4M3(q) * s) to e.
void AddQuantisationError(const float* x, int64_t n, const std::array<float, 4>& scale,
                          ErrorSums& e) {
  for (int64_t i = 0; i < n; ++i) {
    e.ref += static_cast<double>(x[i]) * x[i];
    for (int gr = 0; gr < 4; ++gr) {
      const float deq = kv::DecodeE4M3(kv::EncodeE4M3(x[i] / scale[gr])) * scale[gr];
      e.err[gr] += (static_cast<double>(x[i]) - deq) * (static_cast<double>(x[i]) - deq);
    }
  }
}

float Pow2(int32_t k) { return kv::Fp8ScaleFromExp(k); }

// Max |x| over every token's values of one (layer, K|V): a per-tensor scale calibrated on this
// very prompt (vLLM's calibrated k_scale / v_scale are amax / 448 over a calibration set).
float TensorAmax(const Sequence& seq, int32_t layer, int kv, int64_t n_tokens, int64_t width) {
  const KvCache& cache = seq.cache();
  const int64_t bt = cache.layout().block_tokens();
  const int g = cache.group_of_layer(layer);
  float amax = 0;
  for (int64_t p = 0; p < n_tokens; ++p) {
    const float* x = reinterpret_cast<const float*>(
        cache.EntryAddress(layer, seq.blocks(g)[p / bt], static_cast<int32_t>(p % bt), kv));
    amax = std::max(amax, kv::Fp8FiniteAmax(x, width));
  }
  return amax;
}

// Quantisation error of the values an fp32-KV run cached, per scale granularity:
//   ours         attention: per (block, layer, K|V, head), fixed by the block's first token
//                (Fp8BlockScaleExp); MLA: per token per 128 latent values (Fp8TileScaleExp)
//   per token    per (token, head) / per 128 latent values, no headroom (the finest dynamic one)
//   tensor amax  one float scale amax / 448 per (layer, K|V) (vLLM, calibrated)
//   scale 1.0    vLLM's default when no scales are calibrated
// MLA's rope key stays bf16 in the layout, so only the latent is counted.
std::array<double, 4> KvQuantisationError(const Sequence& seq, int64_t n_tokens) {
  const KvCache& cache = seq.cache();
  const kv::ModelLayout& layout = cache.layout();
  const int64_t bt = layout.block_tokens();
  ErrorSums e;
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    const int g = cache.group_of_layer(layer);
    const kv::LayerGroup& group = layout.groups()[g];
    const bool mla = group.kind == kv::LayerKind::kMlaLatent;
    const int32_t heads = mla ? 1 : group.num_kv_heads;
    const int32_t dim = mla ? group.latent_dim : group.head_dim;
    const int32_t piece = mla ? kv::kFp8MlaTile : dim;  // values per own scale
    for (int kv = 0; kv < (mla ? 1 : 2); ++kv) {
      const float amax = TensorAmax(seq, layer, kv, n_tokens, int64_t{heads} * dim);
      std::vector<int32_t> block_k(heads, 0);
      for (int64_t p = 0; p < n_tokens; ++p) {
        const float* x = reinterpret_cast<const float*>(
            cache.EntryAddress(layer, seq.blocks(g)[p / bt], static_cast<int32_t>(p % bt), kv));
        for (int32_t h = 0; h < heads; ++h) {
          const float* xh = x + int64_t{h} * dim;
          if (!mla && p % bt == 0) block_k[h] = kv::Fp8BlockScaleExp(kv::Fp8FiniteAmax(xh, dim));
          for (int32_t t0 = 0; t0 < dim; t0 += piece) {
            const int32_t n = std::min(piece, dim - t0);
            const float fine = Pow2(kv::Fp8TileScaleExp(kv::Fp8FiniteAmax(xh + t0, n)));
            const std::array<float, 4> scale = {mla ? fine : Pow2(block_k[h]), fine,
                                                amax > 0 ? amax / kv::kFp8Max : 1.0f, 1.0f};
            AddQuantisationError(xh + t0, n, scale, e);
          }
        }
      }
    }
  }
  std::array<double, 4> rel{};
  for (int gr = 0; gr < 4; ++gr) rel[gr] = e.ref > 0 ? std::sqrt(e.err[gr] / e.ref) : 0;
  return rel;
}

// Trained models' K/V are not the test models' unit Gaussians: heads differ in magnitude by
// orders of magnitude, a few channels carry outliers, and attention-sink tokens are far larger
// than the rest. A synthetic tensor with those three traits (8 heads of 128 values, head h at
// 2^(2h - 8), channels 0-3 x16, token 0 x64 in every head, 512 tokens), quantised per
// granularity; each head's softmax is its own, so what counts is the worst head's relative RMS
// error (and the mean over heads).
struct OutlierError {
  std::array<double, 4> worst_head{};
  std::array<double, 4> mean_head{};
};

OutlierError SyntheticOutlierError(int32_t block_tokens) {
  constexpr int32_t kHeads = 8, kDim = 128, kTokens = 512;
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(kTokens) * kHeads * kDim);
  float amax = 0;
  for (int32_t p = 0; p < kTokens; ++p) {
    for (int32_t h = 0; h < kHeads; ++h) {
      for (int32_t d = 0; d < kDim; ++d) {
        float v = normal(rng) * std::ldexp(1.0f, 2 * h - 8);
        if (d < 4) v *= 16;
        if (p == 0) v *= 64;
        x[(static_cast<size_t>(p) * kHeads + h) * kDim + d] = v;
        amax = std::max(amax, std::abs(v));
      }
    }
  }
  OutlierError out;
  for (int32_t h = 0; h < kHeads; ++h) {
    ErrorSums e;
    int32_t block_k = 0;
    for (int32_t p = 0; p < kTokens; ++p) {
      const float* xh = &x[(static_cast<size_t>(p) * kHeads + h) * kDim];
      if (p % block_tokens == 0) block_k = kv::Fp8BlockScaleExp(kv::Fp8FiniteAmax(xh, kDim));
      const float fine = Pow2(kv::Fp8TileScaleExp(kv::Fp8FiniteAmax(xh, kDim)));
      AddQuantisationError(xh, kDim, {Pow2(block_k), fine, amax / kv::kFp8Max, 1.0f}, e);
    }
    for (int gr = 0; gr < 4; ++gr) {
      const double rel = std::sqrt(e.err[gr] / e.ref);
      out.worst_head[gr] = std::max(out.worst_head[gr], rel);
      out.mean_head[gr] += rel / kHeads;
    }
  }
  return out;
}

// The model loaded with one KV dtype, its cache (room for the whole run) and the sequence.
// Declared in creation order: the sequence is released before its cache.
struct Run {
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<Sequence> seq;
};

absl::StatusOr<Run> StartRun(const std::string& dir, std::optional<kv::DType> kv_dtype,
                             int32_t threads, int64_t total_tokens) {
  Run run;
  RunnerOptions options;
  options.threads = threads;
  options.kv_cache_dtype = kv_dtype;
  KV_ASSIGN_OR_RETURN(run.runner, ModelRunner::Load(dir, options));
  const int64_t bt = run.runner->layout().block_tokens();
  KV_ASSIGN_OR_RETURN(run.cache, KvCache::Create(run.runner->layout(), total_tokens / bt + 2));
  run.seq = std::make_unique<Sequence>(run.cache.get());
  return run;
}

absl::StatusOr<Row> Measure(const std::string& root, const std::string& arch, int32_t threads,
                            int tokens, int decode) {
  const auto t0 = std::chrono::steady_clock::now();
  TestModelOptions o;
  o.arch = arch;
  o.seed = 7;
  // gpt2's preset stops at 1,024 positions; the others' (4,096) already hold the prompt.
  if (arch == "gpt2") o.config_patch = absl::StrCat(R"({"n_positions": )", tokens + decode, "}");
  const std::string dir = root + "/" + arch;
  KV_RETURN_IF_ERROR(WriteTestModel(dir, o));
  KV_ASSIGN_OR_RETURN(Run bf16, StartRun(dir, std::nullopt, threads, tokens + decode));
  KV_ASSIGN_OR_RETURN(Run fp8, StartRun(dir, kv::DType::kFp8, threads, tokens + decode));
  KV_ASSIGN_OR_RETURN(Run fp32, StartRun(dir, kv::DType::kFp32, threads, tokens + decode));
  const int32_t vocab = bf16.runner->config().vocab_size;
  const std::vector<int32_t> prompt = PromptTokens(tokens, vocab, 2026);

  Row row;
  row.arch = arch;
  row.prompt_tokens = tokens;
  row.decoded = decode;
  row.bf16_bytes_per_token = bf16.runner->layout().BytesPerToken();
  row.fp8_bytes_per_token = fp8.runner->layout().BytesPerToken();
  KV_ASSIGN_OR_RETURN(std::vector<float> l16, bf16.runner->Prefill(*bf16.seq, prompt));
  KV_ASSIGN_OR_RETURN(std::vector<float> l8, fp8.runner->Prefill(*fp8.seq, prompt));
  KV_ASSIGN_OR_RETURN(std::vector<float> l32, fp32.runner->Prefill(*fp32.seq, prompt));
  for (int step = 0; step < decode; ++step) {
    for (int32_t i = 0; i < vocab; ++i) {
      row.max_delta = std::max(row.max_delta, std::abs(static_cast<double>(l8[i]) - l16[i]));
      row.max_logit = std::max(row.max_logit, std::abs(static_cast<double>(l16[i])));
      row.bf16_vs_fp32_delta =
          std::max(row.bf16_vs_fp32_delta, std::abs(static_cast<double>(l16[i]) - l32[i]));
    }
    const int32_t next = Argmax(l16, 0, vocab);
    row.agree += Argmax(l8, 0, vocab) == next ? 1 : 0;
    if (step + 1 == decode) break;
    Sequence* b16[] = {bf16.seq.get()};
    Sequence* b8[] = {fp8.seq.get()};
    Sequence* b32[] = {fp32.seq.get()};
    KV_ASSIGN_OR_RETURN(l16, bf16.runner->DecodeStep(b16, {next}));
    KV_ASSIGN_OR_RETURN(l8, fp8.runner->DecodeStep(b8, {next}));
    KV_ASSIGN_OR_RETURN(l32, fp32.runner->DecodeStep(b32, {next}));
  }
  row.kv_error = KvQuantisationError(*fp32.seq, fp32.seq->num_tokens());
  row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return row;
}

int Main(int argc, char** argv) {
  int32_t threads = 2, tokens = 2048, decode = 32;
  std::string archs = "llama,deepseek_v3,gemma3,gpt2";
  bool quick = false;
  FlagSet flags("fp8_kv_accuracy_bench",
                "FP8 KV against bf16 KV: greedy agreement, max |logit delta|, bytes per token.");
  flags.AddInt32("threads", &threads, "attention + OpenBLAS threads");
  flags.AddInt32("tokens", &tokens, "prompt length");
  flags.AddInt32("decode", &decode, "greedy tokens compared (prefill's last row + decode steps)");
  flags.AddString("archs", &archs, "comma-separated test architectures");
  flags.AddBool("quick", &quick,
                "64-token prompt, 4 tokens (CI runs it so the bench keeps working)");
  absl::Status parsed = flags.Parse(ArgsFrom(argc, argv, 1));
  if (!parsed.ok() || threads < 1 || tokens < 1 || decode < 1) {
    std::fprintf(stderr, "fp8_kv_accuracy_bench: %s\n%s", std::string(parsed.message()).c_str(),
                 flags.Usage().c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  if (quick) {
    tokens = 64;
    decode = 4;
  }
  char tmpl[] = "/tmp/fp8_kv_accuracy_bench.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::string root = tmpl;

  std::printf(
      "fp8_kv_accuracy_bench: fp8_e4m3 KV (ours) vs bf16 KV (baseline), bf16 weights, "
      "%d-token prompt, %d teacher-forced greedy tokens, %d threads\n",
      tokens, decode, threads);
  std::printf("%-12s %7s %9s %12s %11s %13s %11s %10s %7s %8s\n", "arch", "prompt", "agree",
              "max|dlogit|", "max|logit|", "bf16-vs-fp32", "bf16 B/tok", "fp8 B/tok", "ratio",
              "seconds");
  int exit_code = 0;
  std::vector<Row> rows;
  for (absl::string_view arch : absl::StrSplit(archs, ',', absl::SkipEmpty())) {
    absl::StatusOr<Row> row = Measure(root, std::string(arch), threads, tokens, decode);
    if (!row.ok()) {
      std::fprintf(stderr, "%s: %s\n", std::string(arch).c_str(), row.status().ToString().c_str());
      exit_code = 1;
      continue;
    }
    std::printf(
        "%-12s %7d %4d/%-4d %12.4g %11.4g %13.4g %11lld %10lld %7.3f %8.1f\n", row->arch.c_str(),
        row->prompt_tokens, row->agree, row->decoded, row->max_delta, row->max_logit,
        row->bf16_vs_fp32_delta, static_cast<long long>(row->bf16_bytes_per_token),
        static_cast<long long>(row->fp8_bytes_per_token),
        static_cast<double>(row->fp8_bytes_per_token) / row->bf16_bytes_per_token, row->seconds);
    std::fflush(stdout);
    rows.push_back(*std::move(row));
  }
  std::printf(
      "\nE4M3 relative RMS error of the cached K/V values (MLA: latent) by scale granularity, on "
      "the fp32-KV run's cache\n%-12s %10s %10s %12s %10s\n",
      "arch", "ours", "per token", "tensor amax", "scale 1.0");
  for (const Row& row : rows) {
    std::printf("%-12s %10.4f %10.4f %12.4f %10.4f\n", row.arch.c_str(), row.kv_error[kOurs],
                row.kv_error[kPerToken], row.kv_error[kPerTensorAmax], row.kv_error[kScaleOne]);
  }
  const OutlierError outliers = SyntheticOutlierError(kv::kDefaultBlockTokens);
  std::printf(
      "\nThe same on a synthetic K with trained models' traits (heads 2^-8..2^6 apart, outlier "
      "channels x16, a sink token x64)\n%-12s %10s %10s %12s %10s\n",
      "per head", "ours", "per token", "tensor amax", "scale 1.0");
  std::printf("%-12s %10.4f %10.4f %12.4f %10.4f\n", "worst", outliers.worst_head[kOurs],
              outliers.worst_head[kPerToken], outliers.worst_head[kPerTensorAmax],
              outliers.worst_head[kScaleOne]);
  std::printf("%-12s %10.4f %10.4f %12.4f %10.4f\n", "mean", outliers.mean_head[kOurs],
              outliers.mean_head[kPerToken], outliers.mean_head[kPerTensorAmax],
              outliers.mean_head[kScaleOne]);
  std::error_code ignored;
  std::filesystem::remove_all(root, ignored);
  return exit_code;
}

}  // namespace
}  // namespace kvrelay::model

int main(int argc, char** argv) { return kvrelay::model::Main(argc, argv); }
