// gpu_model_bench: prefill and decode tokens/s of the CUDA forward pass (model/cuda) for a
// Llama-3-8B-shaped layer stack and one DeepSeek-V3-shaped MLA layer, random bf16 weights,
// beside the cuBLAS bf16 GEMM rate measured in the same run (and the fraction prefill reaches).
// Then the serving path (CudaRunner: the same forward pass plus layer-wise staging of every KV
// byte into page-locked host pools) for the Llama shape: prefill tokens/s against the time
// cuBLAS alone needs for the same GEMM shapes, decode tokens/s (device argmax), and the staging
// copy pattern's bandwidth against one contiguous cudaMemcpy into cudaHostAlloc memory.
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
#include "model/cuda/cuda_runner.h"
#include "model/kv_cache.h"
#include "platform/cuda/cuda_util.h"

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

// Seconds cuBLAS alone needs for one prefill's GEMMs at the model's shapes (every layer's
// qkv, o, gate_up and down, bf16 inputs and weights, fp32 output, as CudaModel calls them; the
// LM head for one row), best of 3, timed with CUDA events. Llama-shaped configs only.
absl::StatusOr<double> GemmOnlyPrefillSeconds(const kv::ModelConfig& c, int rows) {
  const int hidden = c.hidden_size, inter = c.intermediate_size;
  const int attn = c.num_attention_heads * c.head_dim;
  const int qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
  struct Shape {
    int out, in, rows;
  };
  const Shape shapes[] = {{qkv, hidden, rows},
                          {hidden, attn, rows},
                          {2 * inter, hidden, rows},
                          {hidden, inter, rows},
                          {static_cast<int>(c.vocab_size), hidden, 1}};
  int64_t widest_in = 0, widest_out = 0, largest_w = 0;
  for (const Shape& s : shapes) {
    widest_in = std::max<int64_t>(widest_in, s.in);
    widest_out = std::max<int64_t>(widest_out, s.out);
    largest_w = std::max<int64_t>(largest_w, int64_t{s.out} * s.in);
  }
  void *w = nullptr, *x = nullptr, *y = nullptr;
  KV_RETURN_IF_CUDA_ERROR(cudaMalloc(&w, 2 * largest_w));
  KV_RETURN_IF_CUDA_ERROR(cudaMalloc(&x, 2 * widest_in * rows));
  KV_RETURN_IF_CUDA_ERROR(cudaMalloc(&y, 4 * widest_out * rows));
  KV_RETURN_IF_CUDA_ERROR(cudaMemset(w, 0, 2 * largest_w));
  KV_RETURN_IF_CUDA_ERROR(cudaMemset(x, 0, 2 * widest_in * rows));
  cublasHandle_t h = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  double best = 1e30;
  bool ok = cublasCreate(&h) == CUBLAS_STATUS_SUCCESS && cudaEventCreate(&start) == cudaSuccess &&
            cudaEventCreate(&stop) == cudaSuccess;
  const float one = 1, zero = 0;
  for (int r = 0; ok && r < 4; ++r) {
    ok = cudaEventRecord(start) == cudaSuccess;
    for (int32_t l = 0; ok && l < c.num_hidden_layers; ++l) {
      for (const Shape& s : shapes) {
        if (s.rows == 1 && l + 1 < c.num_hidden_layers) continue;  // LM head once
        ok =
            ok && cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.out, s.rows, s.in, &one, w,
                               CUDA_R_16BF, s.in, x, CUDA_R_16BF, s.in, &zero, y, CUDA_R_32F, s.out,
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
      }
    }
    float ms = 0;
    ok = ok && cudaEventRecord(stop) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess &&
         cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
    if (ok && r > 0) best = std::min(best, ms / 1e3);  // the first run warms cuBLAS up
  }
  if (h != nullptr) cublasDestroy(h);
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  cudaFree(w);
  cudaFree(x);
  cudaFree(y);
  if (!ok) return absl::InternalError("cuBLAS GEMM baseline failed");
  return best;
}

struct RunnerResult {
  double prefill_tps = 0, decode_tps = 0;
  int64_t staged_bytes = 0;  // KV bytes one prefill stages to the host pools
  std::string error;
};

// The serving path: CudaRunner prefill (layer-wise staging, on_layer_done counted) and
// DecodeStepGreedy over a batch, into host KvCache pools the runner page-locks.
RunnerResult RunRunner(const kv::ModelConfig& c, int prompt, int batch, int steps) {
  RunnerResult res;
  CudaRunnerOptions o;
  o.block_tokens = c.layout.block_tokens();
  o.max_rows = std::max(prompt, batch);
  o.max_context = prompt + steps;
  auto runner = CreateRandomCudaRunner(c, 1, o);
  if (!runner.ok()) {
    res.error = runner.status().ToString();
    return res;
  }
  const int64_t bt = c.layout.block_tokens();
  const int64_t blocks_per_seq = (prompt + steps + bt - 1) / bt;
  auto cache = KvCache::Create((*runner)->layout(), (batch + 1) * blocks_per_seq);
  if (!cache.ok()) {
    res.error = cache.status().ToString();
    return res;
  }
  std::vector<int32_t> tokens;
  for (int i = 0; i < prompt; ++i) tokens.push_back((i * 7919 + 1) % c.vocab_size);
  int32_t reported = 0;
  PrefillOptions po;
  po.on_layer_done = [&reported](int32_t) { ++reported; };
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {  // the first also makes the device mirror
    Sequence seq(cache->get());
    const double t0 = Now();
    auto out = (*runner)->Prefill(seq, tokens, po);
    if (!out.ok()) {
      res.error = out.status().ToString();
      return res;
    }
    if (r > 0) best = std::min(best, Now() - t0);
  }
  if (reported != 3 * c.num_hidden_layers) {
    res.error = "on_layer_done was not called once per layer";
    return res;
  }
  res.prefill_tps = prompt / best;
  res.staged_bytes = ((prompt + bt - 1) / bt) * c.layout.BlockBytes(0);
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<Sequence*> batch_seqs;
  for (int s = 0; s < batch; ++s) {
    seqs.push_back(std::make_unique<Sequence>(cache->get()));
    auto out = (*runner)->Prefill(*seqs.back(), tokens);
    if (!out.ok()) {
      res.error = out.status().ToString();
      return res;
    }
    batch_seqs.push_back(seqs.back().get());
  }
  std::vector<int32_t> next(batch, 1);
  const double t0 = Now();
  for (int step = 0; step < steps; ++step) {
    auto ids = (*runner)->DecodeStepGreedy(batch_seqs, next);
    if (!ids.ok()) {
      res.error = ids.status().ToString();
      return res;
    }
    next = *ids;
  }
  res.decode_tps = static_cast<double>(batch) * steps / (Now() - t0);
  return res;
}

// GB/s of the runner's staging copy pattern for `blocks` units of `block_bytes` (per layer one
// cudaMemcpy2DAsync of a layer strip from every unit, on a copy stream, into cudaHostRegister'd
// memory) and of one contiguous cudaMemcpyAsync of the same bytes into cudaHostAlloc memory,
// best of 5 each, timed with CUDA events.
struct StagingResult {
  double staged_gbps = 0, memcpy_gbps = 0;
  std::string error;
};
StagingResult MeasureStaging(int64_t blocks, int64_t block_bytes, int32_t layers) {
  StagingResult res;
  const size_t bytes = static_cast<size_t>(blocks * block_bytes);
  const int64_t layer_bytes = block_bytes / layers;
  void *device = nullptr, *pinned = nullptr;
  std::vector<uint8_t> registered(bytes);
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  bool ok = cudaMalloc(&device, bytes) == cudaSuccess &&
            cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault) == cudaSuccess &&
            cudaHostRegister(registered.data(), bytes, cudaHostRegisterPortable) == cudaSuccess &&
            cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
            cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess &&
            cudaMemset(device, 1, bytes) == cudaSuccess;
  auto time = [&](bool staged) {
    double best = 1e30;
    for (int r = 0; ok && r < 6; ++r) {
      ok = cudaEventRecord(start, stream) == cudaSuccess;
      if (staged) {
        for (int32_t l = 0; ok && l < layers; ++l) {
          ok =
              cudaMemcpy2DAsync(registered.data() + l * layer_bytes, block_bytes,
                                static_cast<uint8_t*>(device) + l * layer_bytes, block_bytes,
                                layer_bytes, blocks, cudaMemcpyDeviceToHost, stream) == cudaSuccess;
        }
      } else {
        ok = ok &&
             cudaMemcpyAsync(pinned, device, bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess;
      }
      float ms = 0;
      ok = ok && cudaEventRecord(stop, stream) == cudaSuccess &&
           cudaEventSynchronize(stop) == cudaSuccess &&
           cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
      if (ok && r > 0) best = std::min(best, ms / 1e3);
    }
    return static_cast<double>(bytes) / best / 1e9;
  };
  if (ok) res.memcpy_gbps = time(false);
  if (ok) res.staged_gbps = time(true);
  if (!ok) res.error = cudaGetErrorString(cudaGetLastError());
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  cudaHostUnregister(registered.data());
  (void)cudaGetLastError();
  cudaFreeHost(pinned);
  cudaFree(device);
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

  // The serving path, Llama shape.
  absl::StatusOr<kv::ModelConfig> llama = Shape("llama3-8b", layers);
  if (!llama.ok()) {
    std::fprintf(stderr, "llama3-8b: %s\n", llama.status().ToString().c_str());
    return 1;
  }
  std::printf("\nserving path (CudaRunner, KV staged layer by layer into host pools), %s:\n",
              llama_label.c_str());
  absl::StatusOr<double> gemm_only = GemmOnlyPrefillSeconds(*llama, prompt);
  const RunnerResult rr = RunRunner(*llama, prompt, batch, steps);
  if (!gemm_only.ok() || !rr.error.empty()) {
    std::printf("  error: %s\n",
                !gemm_only.ok() ? gemm_only.status().ToString().c_str() : rr.error.c_str());
    return 1;
  }
  const double gemm_only_tps = prompt / *gemm_only;
  std::printf("  %-58s %12.0f tok/s\n", "cuBLAS alone, the same GEMM shapes (baseline)",
              gemm_only_tps);
  std::printf("  %-58s %12.0f tok/s   ratio %.2f (target >= 0.50)\n", "prefill, staging included",
              rr.prefill_tps, rr.prefill_tps / gemm_only_tps);
  std::printf("  %-58s %12.0f tok/s   (batch %d, device argmax)\n", "decode", rr.decode_tps, batch);
  const int64_t bt = llama->layout.block_tokens();
  const StagingResult st =
      MeasureStaging((prompt + bt - 1) / bt, llama->layout.BlockBytes(0), layers);
  if (!st.error.empty()) {
    std::printf("  staging error: %s\n", st.error.c_str());
    return 1;
  }
  std::printf("  %-58s %12.1f GB/s\n", "cudaMemcpy D2H into cudaHostAlloc memory (baseline)",
              st.memcpy_gbps);
  std::printf("  %-58s %12.1f GB/s   ratio %.2f (target >= 0.80)\n",
              "staging pattern (per-layer 2D copies, registered pools)", st.staged_gbps,
              st.staged_gbps / st.memcpy_gbps);
  std::printf("  KV staged per prefill: %.1f MiB\n", rr.staged_bytes / 1048576.0);
  return rc;
}

}  // namespace
}  // namespace kvrelay::model::cuda

int main(int argc, char** argv) { return kvrelay::model::cuda::Main(argc, argv); }
