// model_bench: CPU prefill (and decode) tokens/s of the model runner beside the OpenBLAS sgemm
// FLOP rate measured in the same run, and the fraction of that rate the prefill reaches.
//
//   build-x/bin/model_bench [--threads 2] [--tokens 512] [--reps 3] [--models tiny,mid]
//                           [--tiles 0,256] [--no-decode] [--quick]
//
// Models: tiny-llama (the test preset) and a mid-size Llama (8 layers, hidden 1024,
// intermediate 2816, 16 heads, 4 KV heads, vocab 32000), random weights written by the same
// code as `kvrelay make-test-model`. The baseline is sgemm running the model's own projection
// shapes, one call each over all prompt rows, with the same thread count, measured before and
// after each model's prefill runs. `--tiles` sets RunnerOptions::gemm_tile_tokens (no effect
// since prefill GEMMs are row-invariant; kept to compare against older builds).

#include <cblas.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/flags.h"
#include "model/cpu_ops.h"
#include "model/model_runner.h"
#include "model/sampler.h"
#include "model/test_model.h"

namespace kvrelay::model {
namespace {

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Best-of-reps GFLOP/s of one sgemm shape (x[m, k] * w[n, k]^T, as the runner calls it).
double SgemmGflops(int m, int n, int k, int reps) {
  std::vector<float> a(static_cast<size_t>(m) * k, 0.01f), b(static_cast<size_t>(n) * k, 0.02f),
      c(static_cast<size_t>(m) * n);
  double best = 1e30;
  for (int r = 0; r < reps + 1; ++r) {  // first call warms up
    auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k,
                0.0f, c.data(), n);
    const double s = Seconds(std::chrono::steady_clock::now() - t0);
    if (r > 0) best = std::min(best, s);
  }
  return 2.0 * m * n * k / best / 1e9;
}

// FLOPs of a prefill of n tokens: every linear layer (2 per weight per token), attention
// (QK^T and PV over the causal context) and one LM-head row.
double PrefillFlops(const kv::ModelConfig& c, int64_t n) {
  const double h = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads,
               kvh = c.num_key_value_heads, inter = c.intermediate_size;
  const double linear = h * nh * hd + 2 * h * kvh * hd + nh * hd * h + 3 * h * inter;
  const double ctx_pairs = static_cast<double>(n) * (n + 1) / 2;
  const double attn = 2 * 2 * nh * hd * ctx_pairs;
  return c.num_hidden_layers * (2 * linear * n + attn) + 2 * h * c.vocab_size;
}

// The fair baseline: OpenBLAS sgemm doing one layer's projections at the model's own shapes,
// each as one call over all prompt rows (no tiling), same thread count; FLOP-weighted rate
// (total FLOPs / total time), best of reps. Attention is not in it: the model's attention
// FLOPs are held to the same rate, which only makes the fraction harder to reach.
double ModelShapesSgemmGflops(const kv::ModelConfig& c, int m, int reps) {
  const int hidden = c.hidden_size, q_out = c.num_attention_heads * c.head_dim,
            kv_out = c.num_key_value_heads * c.head_dim, inter = c.intermediate_size;
  struct Shape {
    int n, k;
  };
  const Shape shapes[] = {{q_out, hidden}, {kv_out, hidden}, {kv_out, hidden}, {hidden, q_out},
                          {inter, hidden}, {inter, hidden},  {hidden, inter}};
  int max_k = 0, max_n = 0;
  for (const Shape& s : shapes) {
    max_k = std::max(max_k, s.k);
    max_n = std::max(max_n, s.n);
  }
  std::vector<float> a(static_cast<size_t>(m) * max_k, 0.01f),
      b(static_cast<size_t>(max_n) * max_k, 0.02f), out(static_cast<size_t>(m) * max_n);
  double best = 1e30, flops = 0;
  for (const Shape& s : shapes) flops += 2.0 * m * s.n * s.k;
  for (int r = 0; r < reps + 1; ++r) {  // first pass warms up
    auto t0 = std::chrono::steady_clock::now();
    for (const Shape& s : shapes) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, s.n, s.k, 1.0f, a.data(), s.k,
                  b.data(), s.k, 0.0f, out.data(), s.n);
    }
    const double secs = Seconds(std::chrono::steady_clock::now() - t0);
    if (r > 0) best = std::min(best, secs);
  }
  return flops / best / 1e9;
}

struct Figures {
  double model_shapes_sgemm_gflops = 0;  // the better of before and after the prefill runs
  double prefill_tokens_per_s = 0;
  double prefill_gflops = 0;
  double decode_tokens_per_s = 0;
};

Figures Measure(const std::string& dir, int threads, int tokens, int reps, int tile) {
  RunnerOptions options;
  options.threads = threads;
  options.gemm_tile_tokens = tile;
  auto runner = ModelRunner::Load(dir, options);
  if (!runner.ok()) {
    std::fprintf(stderr, "load %s: %s\n", dir.c_str(), runner.status().ToString().c_str());
    std::exit(1);
  }
  const kv::ModelConfig& c = (*runner)->config();
  const int64_t blocks = (tokens + 64) / c.layout.block_tokens() + 2;
  auto cache = KvCache::Create((*runner)->layout(), blocks * 2);
  if (!cache.ok()) std::exit(1);
  std::vector<int32_t> prompt(tokens);
  for (int i = 0; i < tokens; ++i) prompt[i] = (i * 7919 + 13) % c.vocab_size;
  Figures f;
  const double baseline_before = ModelShapesSgemmGflops(c, tokens, reps);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    Sequence seq(cache->get());
    auto t0 = std::chrono::steady_clock::now();
    auto logits = (*runner)->Prefill(seq, prompt);
    const double s = Seconds(std::chrono::steady_clock::now() - t0);
    if (!logits.ok()) {
      std::fprintf(stderr, "prefill: %s\n", logits.status().ToString().c_str());
      std::exit(1);
    }
    best = std::min(best, s);
    if (r == reps - 1) {
      // Decode 32 tokens greedily after the prompt.
      int32_t next = Greedy(*logits);
      const int steps = 32;
      auto d0 = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) {
        Sequence* batch[] = {&seq};
        auto out = (*runner)->DecodeStep(batch, {next});
        if (!out.ok()) std::exit(1);
        next = Greedy(*out);
      }
      f.decode_tokens_per_s = steps / Seconds(std::chrono::steady_clock::now() - d0);
    }
  }
  f.model_shapes_sgemm_gflops = std::max(baseline_before, ModelShapesSgemmGflops(c, tokens, reps));
  f.prefill_tokens_per_s = tokens / best;
  f.prefill_gflops = PrefillFlops(c, tokens) / best / 1e9;
  return f;
}

// Decode tokens/s for `batch` sequences of a 64-token prompt each, 16 steps, best of reps.
double BatchedDecodeTokensPerS(const std::string& dir, int threads, int batch, bool invariant,
                               int reps) {
  RunnerOptions options;
  options.threads = threads;
  options.batch_invariant_decode = invariant;
  auto runner = ModelRunner::Load(dir, options);
  if (!runner.ok()) {
    std::fprintf(stderr, "load %s: %s\n", dir.c_str(), runner.status().ToString().c_str());
    std::exit(1);
  }
  const kv::ModelConfig& c = (*runner)->config();
  const int prompt_tokens = 64, steps = 16;
  auto cache = KvCache::Create((*runner)->layout(),
                               batch * ((prompt_tokens + steps) / c.layout.block_tokens() + 2));
  if (!cache.ok()) std::exit(1);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    std::vector<std::unique_ptr<Sequence>> seqs;
    std::vector<Sequence*> ptrs;
    std::vector<int32_t> next;
    for (int b = 0; b < batch; ++b) {
      seqs.push_back(std::make_unique<Sequence>(cache->get()));
      std::vector<int32_t> prompt(prompt_tokens);
      for (int i = 0; i < prompt_tokens; ++i) prompt[i] = (i * 7919 + 13 * b + 1) % c.vocab_size;
      auto logits = (*runner)->Prefill(*seqs.back(), prompt);
      if (!logits.ok()) std::exit(1);
      ptrs.push_back(seqs.back().get());
      next.push_back(Greedy(*logits));
    }
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) {
      auto out = (*runner)->DecodeStep(ptrs, next);
      if (!out.ok()) std::exit(1);
      for (int b = 0; b < batch; ++b) {
        next[b] = Greedy(
            absl::MakeConstSpan(*out).subspan(static_cast<size_t>(b) * c.vocab_size, c.vocab_size));
      }
    }
    best = std::min(best, Seconds(std::chrono::steady_clock::now() - t0));
  }
  return batch * steps / best;
}

int Main(int argc, char** argv) {
  int32_t threads = 2, tokens = 512, reps = 3;
  FlagSet flags("model_bench", "CPU prefill tokens/s beside the OpenBLAS sgemm FLOP rate.");
  flags.AddInt32("threads", &threads, "attention + OpenBLAS threads");
  flags.AddInt32("tokens", &tokens, "prompt length");
  flags.AddInt32("reps", &reps, "repetitions (best is reported)");
  bool quick = false;
  flags.AddBool("quick", &quick, "the tiny model only (CI runs it so the benchmark keeps working)");
  std::string models = "tiny,mid";
  flags.AddString("models", &models, "comma-separated: tiny, mid");
  std::string tiles = "0,256";
  flags.AddString("tiles", &tiles, "comma-separated gemm_tile_tokens values (0: the block size)");
  bool no_decode = false;
  flags.AddBool("no-decode", &no_decode, "skip the batched decode table");
  absl::Status parsed = flags.Parse(ArgsFrom(argc, argv, 1));
  if (!parsed.ok() || threads < 1 || tokens < 1 || reps < 1) {
    std::fprintf(stderr, "model_bench: %s\n%s", std::string(parsed.message()).c_str(),
                 flags.Usage().c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("%s", flags.Usage().c_str());
    return 0;
  }
  char tmpl[] = "/tmp/model_bench.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  const std::string root = tmpl;

  struct ModelCase {
    const char* name;
    TestModelOptions options;
  };
  TestModelOptions tiny;
  tiny.arch = "llama";
  TestModelOptions mid = tiny;
  mid.layers = 8;
  mid.hidden = 1024;
  mid.intermediate = 2816;
  mid.heads = 16;
  mid.kv_heads = 4;
  mid.vocab = 32000;
  const ModelCase cases[] = {{"tiny-llama (4L, h256)", tiny}, {"mid-llama (8L, h1024)", mid}};

  SetBlasThreads(threads);
  // Baseline: the sgemm rate of this machine at the runner's largest GEMM shapes.
  const double sgemm_tiny = SgemmGflops(tokens, 512, 256, reps);
  const double sgemm_mid = SgemmGflops(tokens, 2816, 1024, reps);
  const double sgemm_mid_tile16 = [&] {
    // The same GEMM issued as 16-row tiles, as the block-tiled prefill does.
    std::vector<float> a(static_cast<size_t>(tokens) * 1024, 0.01f), b(2816 * 1024, 0.02f),
        c(static_cast<size_t>(tokens) * 2816);
    double best = 1e30;
    for (int r = 0; r < reps + 1; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      for (int row = 0; row < tokens; row += 16) {
        const int m = std::min(16, tokens - row);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, 2816, 1024, 1.0f,
                    a.data() + static_cast<size_t>(row) * 1024, 1024, b.data(), 1024, 0.0f,
                    c.data() + static_cast<size_t>(row) * 2816, 2816);
      }
      const double s = Seconds(std::chrono::steady_clock::now() - t0);
      if (r > 0) best = std::min(best, s);
    }
    return 2.0 * tokens * 2816 * 1024 / best / 1e9;
  }();
  std::printf("model_bench: %d threads, %d-token prompt, best of %d\n", threads, tokens, reps);
  std::printf("baseline OpenBLAS sgemm [%d x 256] x [256 x 512]:    %8.1f GFLOP/s\n", tokens,
              sgemm_tiny);
  std::printf(
      "baseline OpenBLAS sgemm [%d x 1024] x [1024 x 2816]: %8.1f GFLOP/s "
      "(as 16-row tiles: %.1f)\n",
      tokens, sgemm_mid, sgemm_mid_tile16);
  std::printf("%-24s %-10s %14s %12s %17s %16s %16s %14s\n", "model", "gemm tile", "prefill tok/s",
              "GFLOP/s", "model-shape sgemm", "of that rate*", "of best shape**", "decode tok/s");
  auto wanted = [&](const ModelCase& mc) {
    const std::string key = mc.options.layers ? "mid" : "tiny";
    if (quick && key != "tiny") return false;
    for (absl::string_view m : absl::StrSplit(models, ',')) {
      if (m == key) return true;
    }
    return false;
  };
  for (const ModelCase& mc : cases) {
    if (!wanted(mc)) continue;
    const std::string dir = root + "/" + (mc.options.layers ? "mid" : "tiny");
    absl::Status written = WriteTestModel(dir, mc.options);
    if (!written.ok()) {
      std::fprintf(stderr, "make model: %s\n", written.ToString().c_str());
      return 1;
    }
    for (absl::string_view tile_text : absl::StrSplit(tiles, ',')) {
      int tile = 0;
      if (!absl::SimpleAtoi(tile_text, &tile) || tile < 0) {
        std::fprintf(stderr, "model_bench: --tiles: not a tile size: %s\n",
                     std::string(tile_text).c_str());
        return 2;
      }
      // The machine may be shared: measure the baseline right before and after this model's
      // run and take the better, so a load spike cannot inflate the fraction.
      auto baseline_now = [&] {
        return mc.options.layers ? SgemmGflops(tokens, 2816, 1024, reps)
                                 : SgemmGflops(tokens, 512, 256, reps);
      };
      const double before = baseline_now();
      const Figures f = Measure(dir, threads, tokens, reps, tile);
      const double baseline =
          std::max({before, baseline_now(), mc.options.layers ? sgemm_mid : sgemm_tiny});
      std::printf("%-24s %-10s %14.0f %12.1f %17.1f %15.1f%% %15.1f%% %14.1f\n", mc.name,
                  tile == 0 ? std::string("16 (block)").c_str() : std::to_string(tile).c_str(),
                  f.prefill_tokens_per_s, f.prefill_gflops, f.model_shapes_sgemm_gflops,
                  100.0 * f.prefill_gflops / f.model_shapes_sgemm_gflops,
                  100.0 * f.prefill_gflops / baseline, f.decode_tokens_per_s);
    }
  }
  std::printf(
      "* the prefill's FLOP rate (projections, attention, LM head) / OpenBLAS sgemm running the\n"
      "  model's projection shapes, one call each over all prompt rows, same threads, measured\n"
      "  before and after the prefill runs (the better taken)\n"
      "** / the best sgemm rate seen at the largest shape (the figure this table used to print)\n");
  // Batch-invariant decode (each row alone, fixed reduction order) against one sgemm per
  // batch, measured alternately in this run.
  std::printf("\n%-24s %6s %22s %18s %8s\n", "decode model", "batch", "batch-invariant tok/s",
              "batched sgemm tok/s", "ratio");
  for (const ModelCase& mc : cases) {
    if (no_decode || !wanted(mc)) continue;  // only the models written above
    const std::string dir = root + "/" + (mc.options.layers ? "mid" : "tiny");
    for (int batch : {1, 8, 32}) {
      const double invariant = BatchedDecodeTokensPerS(dir, threads, batch, true, reps);
      const double batched = BatchedDecodeTokensPerS(dir, threads, batch, false, reps);
      std::printf("%-24s %6d %22.1f %18.1f %8.2f\n", mc.name, batch, invariant, batched,
                  invariant / batched);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  return 0;
}

}  // namespace
}  // namespace kvrelay::model

int main(int argc, char** argv) { return kvrelay::model::Main(argc, argv); }
