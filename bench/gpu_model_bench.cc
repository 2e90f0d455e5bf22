// gpu_model_bench: prefill and decode tokens/s of the CUDA forward pass (model/cuda) for a
// Llama-3-8B-shaped layer stack and one DeepSeek-V3-shaped MLA layer, random bf16 weights,
// beside the cuBLAS bf16 GEMM rate measured in the same run (and the fraction prefill reaches).
// Run by bench/gpu_check.sh on a GPU machine; exits 1 with a message when there is no GPU.
//
//   gpu_model_bench [--prompt 1024] [--batch 32] [--steps 32] [--layers 32]

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/flags.h"
#include "common/status_macros.h"
#include "kv/hf_config.h"
#include "kv/presets.h"
#include "model/cuda/cuda_model.h"
#include "model/cuda/cuda_ops.h"

namespace kvrelay::model::cuda {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// TFLOP/s of one bf16 GEMM [m x k] x [k x n] with fp32 output, best of 5.
double CublasBf16Tflops(int m, int n, int k) {
  void *a = nullptr, *b = nullptr, *c = nullptr;
  if (cudaMalloc(&a, size_t{2} * m * k) != cudaSuccess ||
      cudaMalloc(&b, size_t{2} * n * k) != cudaSuccess ||
      cudaMalloc(&c, size_t{4} * m * n) != cudaSuccess) {
    return 0;
  }
  cudaMemset(a, 0, size_t{2} * m * k);
  cudaMemset(b, 0, size_t{2} * n * k);
  cublasHandle_t h;
  cublasCreate(&h);
  const float one = 1, zero = 0;
  double best = 1e30;
  for (int r = 0; r < 6; ++r) {
    cudaDeviceSynchronize();
    const double t0 = Now();
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, k, a, CUDA_R_16BF, k,
                 &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaDeviceSynchronize();
    if (r > 0) best = std::min(best, Now() - t0);
  }
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * m * n * k / best / 1e12;
}

absl::StatusOr<kv::ModelConfig> Shape(const char* preset, int layers) {
  KV_ASSIGN_OR_RETURN(std::string text, kv::PresetConfigJson(preset));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  j["num_hidden_layers"] = layers;
  kv::ConfigOptions o;
  o.model_id = preset;
  return kv::ParseHfConfig(j.dump(), o);
}

// Linear-layer FLOPs per token (2 per weight) plus the LM head for `logit_rows` tokens.
double LinearFlopsPerToken(const kv::ModelConfig& c) {
  const double h = c.hidden_size, nh = c.num_attention_heads, inter = c.intermediate_size;
  double attn;
  if (c.kv_lora_rank > 0) {
    const double qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    attn = (c.q_lora_rank > 0 ? h * c.q_lora_rank + c.q_lora_rank * nh * qk : h * nh * qk) +
           h * (c.kv_lora_rank + c.qk_rope_head_dim) +
           nh * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank + nh * c.v_head_dim * h;
  } else {
    attn = h * (nh + 2.0 * c.num_key_value_heads) * c.head_dim + nh * c.head_dim * h;
  }
  return 2.0 * c.num_hidden_layers * (attn + 3 * h * inter);
}

struct Result {
  double prefill_tps = 0, prefill_tflops = 0, decode_tps = 0;
  std::string error;
};

Result Run(const kv::ModelConfig& c, int prompt, int batch, int steps) {
  Result res;
  const int64_t bt = c.layout.block_tokens();
  const int64_t ctx = prompt + steps;
  const int32_t max_blocks = static_cast<int32_t>((ctx + bt - 1) / bt);
  CudaModelOptions o;
  o.weight_dtype = WeightDType::kBf16;
  o.num_blocks = int64_t{batch} * max_blocks;
  o.max_rows = std::max(prompt, batch);
  o.max_context = ctx;
  auto model = CudaModel::CreateRandom(c, 1, o);
  if (!model.ok()) {
    res.error = model.status().ToString();
    return res;
  }
  // Prefill: sequence 0 (slots 0..max_blocks-1), whole prompt in one Forward.
  CudaBatch p;
  p.max_blocks = max_blocks;
  for (int i = 0; i < prompt; ++i) {
    p.tokens.push_back((i * 7919 + 1) % c.vocab_size);
    p.positions.push_back(i);
    for (int32_t b = 0; b < max_blocks; ++b) p.block_tables.push_back(b);
  }
  p.logit_rows = {prompt - 1};
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const double t0 = Now();
    auto out = (*model)->Forward(p);
    if (!out.ok()) {
      res.error = out.status().ToString();
      return res;
    }
    best = std::min(best, Now() - t0);
  }
  res.prefill_tps = prompt / best;
  const double attn_flops =
      4.0 * c.num_hidden_layers * c.num_attention_heads *
      (c.kv_lora_rank > 0 ? (2.0 * c.kv_lora_rank + c.qk_rope_head_dim) : 2.0 * c.head_dim) / 2 *
      prompt * (prompt + 1) / 2;
  res.prefill_tflops =
      (LinearFlopsPerToken(c) * prompt + attn_flops + 2.0 * c.hidden_size * c.vocab_size) / best /
      1e12;
  // Decode: `batch` sequences whose caches hold `prompt` tokens (sequence s in slots
  // s * max_blocks ..), one token each per step.
  CudaBatch d;
  d.max_blocks = max_blocks;
  for (int s = 0; s < batch; ++s) {
    d.tokens.push_back(s + 1);
    d.positions.push_back(prompt);
    for (int32_t b = 0; b < max_blocks; ++b) d.block_tables.push_back(s * max_blocks + b);
    d.logit_rows.push_back(s);
  }
  const double t0 = Now();
  for (int step = 0; step < steps; ++step) {
    for (int s = 0; s < batch; ++s) d.positions[s] = prompt + step;
    auto out = (*model)->Forward(d);
    if (!out.ok()) {
      res.error = out.status().ToString();
      return res;
    }
  }
  res.decode_tps = static_cast<double>(batch) * steps / (Now() - t0);
  return res;
}

int Main(int argc, char** argv) {
  int32_t prompt = 1024, batch = 32, steps = 32, layers = 32;
  FlagSet flags("gpu_model_bench", "CUDA prefill/decode tokens/s for real-size model shapes.");
  flags.AddInt32("prompt", &prompt, "prefill length");
  flags.AddInt32("batch", &batch, "decode batch (sequences)");
  flags.AddInt32("steps", &steps, "decode steps");
  flags.AddInt32("layers", &layers, "layers of the Llama-3-8B-shaped stack");
  absl::Status parsed = flags.Parse(ArgsFrom(argc, argv, 1));
  if (!parsed.ok() || prompt < 1 || batch < 1 || steps < 1 || layers < 1) {
    std::fprintf(stderr, "gpu_model_bench: bad flags\n%s", flags.Usage().c_str());
    return 2;
  }
  if (!HaveDevice()) {
    std::fprintf(stderr, "gpu_model_bench: no usable CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double gemm = CublasBf16Tflops(prompt, 14336, 4096);
  std::printf("device: %s; cuBLAS bf16 GEMM [%d x 4096] x [4096 x 14336]: %.1f TFLOP/s\n",
              prop.name, prompt, gemm);
  std::printf("%-36s %16s %14s %14s %22s\n", "model (random bf16 weights)", "prefill tok/s",
              "TFLOP/s", "of GEMM rate", "decode tok/s");
  struct Case {
    const char* label;
    const char* preset;
    int layers;
  };
  const std::string llama_label = "llama3-8b shape, " + std::to_string(layers) + " layers";
  const Case cases[] = {{llama_label.c_str(), "llama3-8b", layers},
                        {"deepseek-v3 MLA shape, 1 layer", "deepseek-v3", 1}};
  int rc = 0;
  for (const Case& k : cases) {
    absl::StatusOr<kv::ModelConfig> c = Shape(k.preset, k.layers);
    if (!c.ok()) {
      std::fprintf(stderr, "%s: %s\n", k.preset, c.status().ToString().c_str());
      return 1;
    }
    const Result r = Run(*c, prompt, batch, steps);
    if (!r.error.empty()) {
      std::printf("%-36s error: %s\n", k.label, r.error.c_str());
      rc = 1;
      continue;
    }
    char decode[64];
    std::snprintf(decode, sizeof(decode), "%.0f (batch %d)", r.decode_tps, batch);
    std::printf("%-36s %16.0f %14.1f %13.1f%% %22s\n", k.label, r.prefill_tps, r.prefill_tflops,
                100.0 * r.prefill_tflops / gemm, decode);
  }
  return rc;
}

}  // namespace
}  // namespace kvrelay::model::cuda

int main(int argc, char** argv) { return kvrelay::model::cuda::Main(argc, argv); }
