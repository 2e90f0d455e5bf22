#include "model/cuda/cuda_model.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/cuda/cuda_ops.h"
#include "model/numeric.h"
#include "model/rope.h"
#include "platform/cuda/cuda_util.h"

namespace kvrelay::model::cuda {
namespace {

using platform::cuda::CudaStream;
using platform::cuda::DeviceBuffer;
using platform::cuda::DeviceGuard;
using platform::cuda::FromCuda;

absl::Status FromCublas(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  if (s == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": cuBLAS allocation failed"));
  }
  return absl::InternalError(absl::StrCat(what, ": cuBLAS status ", static_cast<int>(s)));
}

#define KV_RETURN_IF_CUBLAS_ERROR(expr)               \
  do {                                                \
    cublasStatus_t kv_cublas_status_ = (expr);        \
    if (kv_cublas_status_ != CUBLAS_STATUS_SUCCESS) { \
      return FromCublas(kv_cublas_status_, #expr);    \
    }                                                 \
  } while (false)

struct Matrix {
  void* data = nullptr;  // fp32 or bf16 per the model's weight dtype (norms: always fp32)
  int64_t rows = 0, cols = 0;
};

struct Layer {
  Matrix input_norm, post_norm;
  Matrix qkv;                                     // GQA: [(heads + 2 kv) * hd, hidden]
  Matrix q, q_a, q_a_norm, q_b, kv_a, kv_a_norm;  // MLA (q when q_lora_rank == 0)
  Matrix kv_b;                                    // MLA, always fp32 (batched per-head GEMMs)
  Matrix o, gate_up, down;                        // gate_up: [2 * intermediate, hidden]
};

}  // namespace

struct CudaModel::Impl {
  ~Impl() {
    if (cublas != nullptr) cublasDestroy(cublas);
  }
  int device = 0;
  Arch arch = Arch::kLlama;
  CudaModelOptions options;
  std::optional<CudaStream> stream;
  cublasHandle_t cublas = nullptr;
  std::vector<DeviceBuffer> buffers;  // every allocation; the structs below point into them
  Matrix embed, final_norm, lm_head;
  std::vector<Layer> layers;
  std::vector<void*> cache;  // per group: num_blocks * BlockBytes(g)
  // Scratch sized for options.max_rows.
  float *h = nullptr, *xn = nullptr, *big = nullptr, *attn = nullptr, *proj = nullptr,
        *mid = nullptr, *score = nullptr, *qcat = nullptr, *olat = nullptr, *contig = nullptr;
  uint16_t* x_bf16 = nullptr;
  int32_t *tokens = nullptr, *tables = nullptr;
  int64_t* positions = nullptr;
  int64_t table_capacity = 0;
  float* logits = nullptr;
  int32_t* greedy_ids = nullptr;  // [max_rows]
  int compute_capability = 0;
  // RoPE as the CPU runner computes it (model/rope.h): inverse frequencies [rope_dim / 2] on the
  // device, the factor on cos and sin, and (dynamic) the first position it cannot serve.
  float* rope_inv_freq = nullptr;
  float rope_attention_factor = 1.0f;
  int64_t rope_max_positions = 0;
  // Logit rows the last Enqueue left in `logits`, until TakeLogits/TakeGreedy; -1: none.
  int64_t pending_logit_rows = -1;

  absl::StatusOr<void*> Alloc(size_t bytes) {
    KV_ASSIGN_OR_RETURN(DeviceBuffer b,
                        DeviceBuffer::Allocate(device, std::max<size_t>(bytes, 256)));
    void* p = b.data();
    buffers.push_back(std::move(b));
    return p;
  }

  // y[rows, out] (ldy) = x[rows, in] (ldx) * w[out, in]^T.
  absl::Status Gemm(const Matrix& w, const float* x, int64_t rows, int64_t ldx, float* y,
                    int64_t ldy) {
    const float one = 1.0f, zero = 0.0f;
    const int m = static_cast<int>(w.rows), n = static_cast<int>(rows),
              k = static_cast<int>(w.cols);
    if (options.weight_dtype == WeightDType::kFp32) {
      KV_RETURN_IF_CUBLAS_ERROR(cublasSgemm(
          cublas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, static_cast<const float*>(w.data), k, x,
          static_cast<int>(ldx), &zero, y, static_cast<int>(ldy)));
      return absl::OkStatus();
    }
    const float* src = x;
    if (ldx != w.cols) {
      KV_RETURN_IF_ERROR(CopyRows(x, ldx, contig, w.cols, rows, w.cols, stream->get()));
      src = contig;
    }
    KV_RETURN_IF_ERROR(ConvertToBf16(src, rows * w.cols, x_bf16, stream->get()));
    KV_RETURN_IF_CUBLAS_ERROR(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w.data,
                                           CUDA_R_16BF, k, x_bf16, CUDA_R_16BF, k, &zero, y,
                                           CUDA_R_32F, static_cast<int>(ldy), CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }
};

CudaModel::CudaModel(kv::ModelConfig config, std::unique_ptr<Impl> impl)
    : config_(std::move(config)), impl_(std::move(impl)) {}

CudaModel::~CudaModel() {
  if (impl_ != nullptr && impl_->stream.has_value()) (void)impl_->stream->Synchronize();
}

void* CudaModel::stream() const { return impl_->stream->get(); }

absl::Status CudaModel::Synchronize() { return impl_->stream->Synchronize(); }

namespace {

// Sets up everything but the weight values; `fill(matrix, name_seed, kind)` provides them.
// kind: 0 linear, 1 norm, 2 embedding. fp32_only: stored fp32 whatever the weight dtype.
struct Builder {
  CudaModel::Impl* impl;
  const kv::ModelConfig& c;
  std::function<absl::Status(Matrix&, const std::vector<float>*, uint64_t, int, bool)> fill;

  absl::Status Make(Matrix& m, int64_t rows, int64_t cols, const std::vector<float>* host,
                    uint64_t seed, int kind, bool fp32_only = false) {
    m.rows = rows;
    m.cols = cols;
    const bool bf16 = !fp32_only && kind != 1 && impl->options.weight_dtype == WeightDType::kBf16;
    KV_ASSIGN_OR_RETURN(m.data, impl->Alloc(static_cast<size_t>(rows * cols) * (bf16 ? 2 : 4)));
    return fill(m, host, seed, kind, bf16);
  }
};

absl::Status Upload(Matrix& m, const std::vector<float>& host, bool bf16, cudaStream_t stream) {
  if (static_cast<int64_t>(host.size()) != m.rows * m.cols) {
    return absl::InvalidArgumentError("cuda model: host tensor size mismatch");
  }
  if (bf16) {
    std::vector<uint16_t> converted(host.size());
    for (size_t i = 0; i < host.size(); ++i) converted[i] = FloatToBf16(host[i]);
    KV_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(m.data, converted.data(), converted.size() * 2,
                                            cudaMemcpyHostToDevice, stream));
    KV_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
  KV_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(m.data, host.data(), host.size() * 4, cudaMemcpyHostToDevice, stream));
  KV_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

std::vector<float> Concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const std::vector<float>* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

}  // namespace

absl::Status CudaModelSupports(const kv::ModelConfig& c) {
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(c));
  if (arch != Arch::kLlama && arch != Arch::kMla) {
    return absl::UnimplementedError(
        absl::StrCat("cuda model: model_type '", c.model_type, "' runs on the CPU backend only"));
  }
  // The CUDA forward pass implements SiLU, no biases and interleaved MLA RoPE; the CPU runner
  // implements the rest.
  if (c.hidden_act != "silu" || c.attention_bias || c.mlp_bias ||
      (arch == Arch::kMla && !c.rope_interleave)) {
    return absl::UnimplementedError(
        absl::StrCat("cuda model: hidden_act '", c.hidden_act,
                     "', biases and non-interleaved MLA RoPE run on the CPU backend only"));
  }
  // Every rope_scaling the CPU computes (InvalidArgument naming the field otherwise).
  return ComputeRopeFrequencies(c.rope_scaling, c.rope_theta,
                                arch == Arch::kMla ? c.qk_rope_head_dim : c.head_dim,
                                c.max_position_embeddings)
      .status();
}

namespace {

absl::StatusOr<std::unique_ptr<CudaModel::Impl>> Build(const kv::ModelConfig& c,
                                                       const ModelWeights* weights, uint64_t seed,
                                                       const CudaModelOptions& options) {
  KV_RETURN_IF_ERROR(CudaModelSupports(c));
  if (!HaveDevice()) return absl::FailedPreconditionError("cuda model: no usable CUDA device");
  KV_ASSIGN_OR_RETURN(Arch arch, ArchFor(c));
  if (options.max_rows <= 0 || options.max_context <= 0 || options.num_blocks < 0) {
    return absl::InvalidArgumentError(
        "cuda model: max_rows and max_context must be > 0, num_blocks >= 0");
  }
  auto impl = std::make_unique<CudaModel::Impl>();
  impl->device = options.device;
  impl->arch = arch;
  impl->options = options;
  DeviceGuard guard(options.device);
  int major = 0, minor = 0;
  KV_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, options.device));
  KV_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, options.device));
  impl->compute_capability = major * 10 + minor;
  KV_ASSIGN_OR_RETURN(CudaStream stream, CudaStream::Create(options.device));
  impl->stream.emplace(std::move(stream));
  KV_RETURN_IF_CUBLAS_ERROR(cublasCreate(&impl->cublas));
  KV_RETURN_IF_CUBLAS_ERROR(cublasSetStream(impl->cublas, impl->stream->get()));
  cudaStream_t s = impl->stream->get();

  Builder b{impl.get(), c,
            [&](Matrix& m, const std::vector<float>* host, uint64_t name_seed, int kind,
                bool bf16) -> absl::Status {
              if (host != nullptr) return Upload(m, *host, bf16, s);
              const float stddev = kind == 0   ? 1.0f / std::sqrt(static_cast<float>(m.cols))
                                   : kind == 1 ? 0.05f
                                               : 1.0f;
              return FillRandom(m.data, bf16, m.rows * m.cols, seed * 1000003u + name_seed,
                                kind == 1 ? 1.0f : 0.0f, stddev, s);
            }};
  const ModelWeights* w = weights;
  const int64_t hidden = c.hidden_size, heads = c.num_attention_heads;
  uint64_t id = 1;
  KV_RETURN_IF_ERROR(
      b.Make(impl->embed, c.vocab_size, hidden, w ? &w->embed_tokens : nullptr, id++, 2));
  KV_RETURN_IF_ERROR(b.Make(impl->final_norm, 1, hidden, w ? &w->final_norm : nullptr, id++, 1));
  KV_RETURN_IF_ERROR(
      b.Make(impl->lm_head, c.vocab_size, hidden, w ? &w->output_weights() : nullptr, id++, 0));
  impl->layers.resize(c.num_hidden_layers);
  for (int32_t i = 0; i < c.num_hidden_layers; ++i) {
    Layer& L = impl->layers[i];
    const LayerWeights* lw = w ? &w->layers[i] : nullptr;
    KV_RETURN_IF_ERROR(b.Make(L.input_norm, 1, hidden, lw ? &lw->input_norm : nullptr, id++, 1));
    KV_RETURN_IF_ERROR(
        b.Make(L.post_norm, 1, hidden, lw ? &lw->post_attention_norm : nullptr, id++, 1));
    if (arch == Arch::kMla) {
      const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (c.q_lora_rank > 0) {
        KV_RETURN_IF_ERROR(
            b.Make(L.q_a, c.q_lora_rank, hidden, lw ? &lw->q_a_proj : nullptr, id++, 0));
        KV_RETURN_IF_ERROR(
            b.Make(L.q_a_norm, 1, c.q_lora_rank, lw ? &lw->q_a_norm : nullptr, id++, 1));
        KV_RETURN_IF_ERROR(
            b.Make(L.q_b, heads * qk, c.q_lora_rank, lw ? &lw->q_b_proj : nullptr, id++, 0));
      } else {
        KV_RETURN_IF_ERROR(b.Make(L.q, heads * qk, hidden, lw ? &lw->q_proj : nullptr, id++, 0));
      }
      KV_RETURN_IF_ERROR(b.Make(L.kv_a, c.kv_lora_rank + c.qk_rope_head_dim, hidden,
                                lw ? &lw->kv_a_proj : nullptr, id++, 0));
      KV_RETURN_IF_ERROR(
          b.Make(L.kv_a_norm, 1, c.kv_lora_rank, lw ? &lw->kv_a_norm : nullptr, id++, 1));
      KV_RETURN_IF_ERROR(b.Make(L.kv_b, heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
                                lw ? &lw->kv_b_proj : nullptr, id++, 0,
                                /*fp32_only=*/true));
      KV_RETURN_IF_ERROR(
          b.Make(L.o, hidden, heads * c.v_head_dim, lw ? &lw->o_proj : nullptr, id++, 0));
    } else {
      const int64_t hd = c.head_dim, kvh = c.num_key_value_heads;
      std::vector<float> qkv;
      if (lw) qkv = Concat({&lw->q_proj, &lw->k_proj, &lw->v_proj});
      KV_RETURN_IF_ERROR(
          b.Make(L.qkv, (heads + 2 * kvh) * hd, hidden, lw ? &qkv : nullptr, id++, 0));
      KV_RETURN_IF_ERROR(b.Make(L.o, hidden, heads * hd, lw ? &lw->o_proj : nullptr, id++, 0));
    }
    std::vector<float> gate_up;
    if (lw) gate_up = Concat({&lw->gate_proj, &lw->up_proj});
    KV_RETURN_IF_ERROR(b.Make(L.gate_up, 2 * int64_t{c.intermediate_size}, hidden,
                              lw ? &gate_up : nullptr, id++, 0));
    KV_RETURN_IF_ERROR(
        b.Make(L.down, hidden, c.intermediate_size, lw ? &lw->down_proj : nullptr, id++, 0));
  }
  // Cache pools, one per group, with the CPU pools' unit layout (no slot padding); none when
  // every batch brings its own (num_blocks 0).
  for (int g = 0; options.num_blocks > 0 && g < static_cast<int>(c.layout.groups().size()); ++g) {
    KV_ASSIGN_OR_RETURN(
        void* p, impl->Alloc(static_cast<size_t>(options.num_blocks * c.layout.BlockBytes(g))));
    KV_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(p, 0, static_cast<size_t>(options.num_blocks * c.layout.BlockBytes(g)), s));
    impl->cache.push_back(p);
  }
  // Scratch.
  const int64_t R = options.max_rows;
  const int64_t inter = c.intermediate_size;
  int64_t wide = 2 * inter;  // gate_up output
  int64_t attn_width = heads * c.head_dim;
  if (arch == Arch::kMla) {
    const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    wide = std::max(
        {wide, heads * qk, int64_t{c.kv_lora_rank} + c.qk_rope_head_dim, int64_t{c.q_lora_rank}});
    attn_width = heads * c.v_head_dim;
  } else {
    wide = std::max(wide, (heads + 2 * int64_t{c.num_key_value_heads}) * c.head_dim);
  }
  const int64_t widest_input =
      std::max({hidden, inter, attn_width, int64_t{c.q_lora_rank}, int64_t{c.kv_lora_rank}});
  auto floats = [&](int64_t n) -> absl::StatusOr<float*> {
    KV_ASSIGN_OR_RETURN(void* p, impl->Alloc(static_cast<size_t>(n) * 4));
    return static_cast<float*>(p);
  };
  KV_ASSIGN_OR_RETURN(impl->h, floats(R * hidden));
  KV_ASSIGN_OR_RETURN(impl->xn, floats(R * hidden));
  KV_ASSIGN_OR_RETURN(impl->big, floats(R * wide));
  KV_ASSIGN_OR_RETURN(impl->mid, floats(R * wide));
  KV_ASSIGN_OR_RETURN(impl->attn, floats(R * attn_width));
  KV_ASSIGN_OR_RETURN(impl->proj, floats(R * hidden));
  KV_ASSIGN_OR_RETURN(impl->contig, floats(R * widest_input));
  KV_ASSIGN_OR_RETURN(impl->score, floats(R * heads * options.max_context));
  if (arch == Arch::kMla) {
    const int64_t entry = int64_t{c.kv_lora_rank} + c.qk_rope_head_dim;
    KV_ASSIGN_OR_RETURN(impl->qcat, floats(R * heads * entry));
    KV_ASSIGN_OR_RETURN(impl->olat, floats(R * heads * c.kv_lora_rank));
  }
  KV_ASSIGN_OR_RETURN(void* xb, impl->Alloc(static_cast<size_t>(R * widest_input) * 2));
  impl->x_bf16 = static_cast<uint16_t*>(xb);
  KV_ASSIGN_OR_RETURN(void* tok, impl->Alloc(static_cast<size_t>(R) * 4));
  impl->tokens = static_cast<int32_t*>(tok);
  KV_ASSIGN_OR_RETURN(void* pos, impl->Alloc(static_cast<size_t>(R) * 8));
  impl->positions = static_cast<int64_t*>(pos);
  // Room for one table per layer group per row.
  impl->table_capacity =
      static_cast<int64_t>(c.layout.groups().size()) * R *
      ((options.max_context + c.layout.block_tokens() - 1) / c.layout.block_tokens());
  KV_ASSIGN_OR_RETURN(void* tab, impl->Alloc(static_cast<size_t>(impl->table_capacity) * 4));
  impl->tables = static_cast<int32_t*>(tab);
  KV_ASSIGN_OR_RETURN(impl->logits, floats(R * c.vocab_size));
  KV_ASSIGN_OR_RETURN(RopeFrequencies rope,
                      ComputeRopeFrequencies(c.rope_scaling, c.rope_theta,
                                             arch == Arch::kMla ? c.qk_rope_head_dim : c.head_dim,
                                             c.max_position_embeddings));
  KV_ASSIGN_OR_RETURN(impl->rope_inv_freq, floats(static_cast<int64_t>(rope.inv_freq.size())));
  KV_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(impl->rope_inv_freq, rope.inv_freq.data(),
                                          rope.inv_freq.size() * 4, cudaMemcpyHostToDevice, s));
  impl->rope_attention_factor = rope.attention_factor;
  impl->rope_max_positions = rope.max_positions;
  KV_ASSIGN_OR_RETURN(void* ids, impl->Alloc(static_cast<size_t>(R) * 4));
  impl->greedy_ids = static_cast<int32_t*>(ids);
  KV_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(s));
  return impl;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::Create(const kv::ModelConfig& config,
                                                             const ModelWeights& weights,
                                                             const CudaModelOptions& options) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl, Build(config, &weights, 0, options));
  return std::unique_ptr<CudaModel>(new CudaModel(config, std::move(impl)));
}

absl::StatusOr<std::unique_ptr<CudaModel>> CudaModel::CreateRandom(
    const kv::ModelConfig& config, uint64_t seed, const CudaModelOptions& options) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Impl> impl, Build(config, nullptr, seed, options));
  return std::unique_ptr<CudaModel>(new CudaModel(config, std::move(impl)));
}

absl::StatusOr<std::vector<uint8_t>> CudaModel::ReadBlock(int group, int32_t slot) {
  if (group < 0 || group >= static_cast<int>(impl_->cache.size()) || slot < 0 ||
      slot >= impl_->options.num_blocks) {
    return absl::InvalidArgumentError("cuda model: bad group or slot");
  }
  const int64_t bytes = config_.layout.BlockBytes(group);
  std::vector<uint8_t> out(static_cast<size_t>(bytes));
  KV_RETURN_IF_ERROR(Synchronize());
  KV_RETURN_IF_CUDA_ERROR(cudaMemcpy(out.data(),
                                     static_cast<uint8_t*>(impl_->cache[group]) + slot * bytes,
                                     static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
  return out;
}

int CudaModel::device() const { return impl_->device; }

int CudaModel::compute_capability() const { return impl_->compute_capability; }

absl::StatusOr<std::vector<float>> CudaModel::Forward(const CudaBatch& batch) {
  KV_RETURN_IF_ERROR(Enqueue(batch));
  return TakeLogits();
}

absl::StatusOr<std::vector<float>> CudaModel::TakeLogits() {
  Impl& m = *impl_;
  if (m.pending_logit_rows < 0) return absl::FailedPreconditionError("cuda model: no Enqueue");
  const int64_t nl = std::exchange(m.pending_logit_rows, -1);
  DeviceGuard guard(m.device);
  std::vector<float> out(static_cast<size_t>(nl * config_.vocab_size));
  if (nl > 0) {
    KV_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(out.data(), m.logits, out.size() * 4,
                                            cudaMemcpyDeviceToHost, m.stream->get()));
  }
  KV_RETURN_IF_ERROR(Synchronize());
  return out;
}

absl::StatusOr<std::vector<int32_t>> CudaModel::TakeGreedy() {
  Impl& m = *impl_;
  if (m.pending_logit_rows < 0) return absl::FailedPreconditionError("cuda model: no Enqueue");
  const int64_t nl = std::exchange(m.pending_logit_rows, -1);
  DeviceGuard guard(m.device);
  std::vector<int32_t> ids(static_cast<size_t>(nl));
  if (nl > 0) {
    KV_RETURN_IF_ERROR(ArgmaxRows(m.logits, nl, config_.vocab_size, m.greedy_ids, m.stream->get()));
    KV_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(ids.data(), m.greedy_ids, ids.size() * 4,
                                            cudaMemcpyDeviceToHost, m.stream->get()));
  }
  KV_RETURN_IF_ERROR(Synchronize());
  return ids;
}

absl::Status CudaModel::Enqueue(const CudaBatch& batch, const LayerHook& after_layer,
                                const LayerHook& before_layer) {
  Impl& m = *impl_;
  const kv::ModelConfig& c = config_;
  const int num_groups = static_cast<int>(c.layout.groups().size());
  const int64_t R = static_cast<int64_t>(batch.tokens.size());
  if (m.pending_logit_rows >= 0) {
    return absl::FailedPreconditionError(
        "cuda forward: the previous batch's logits were not taken");
  }
  if (batch.table_groups != 1 && batch.table_groups != num_groups) {
    return absl::InvalidArgumentError(absl::StrCat("cuda forward: table_groups must be 1 or ",
                                                   num_groups, ", got ", batch.table_groups));
  }
  if (R == 0 || R > m.options.max_rows || batch.positions.size() != batch.tokens.size() ||
      batch.max_blocks <= 0 ||
      static_cast<int64_t>(batch.block_tables.size()) !=
          batch.table_groups * R * batch.max_blocks ||
      static_cast<int64_t>(batch.block_tables.size()) > m.table_capacity) {
    return absl::InvalidArgumentError(absl::StrCat("cuda forward: bad batch of ", R, " rows"));
  }
  // Per group: where its units live and how many there are.
  std::vector<CudaBatch::DeviceCache> caches;
  if (batch.caches.empty()) {
    if (m.cache.empty()) return absl::InvalidArgumentError("cuda forward: no cache given");
    for (int g = 0; g < num_groups; ++g) {
      caches.push_back({m.cache[g], m.options.num_blocks, c.layout.BlockBytes(g)});
    }
  } else {
    if (static_cast<int>(batch.caches.size()) != num_groups) {
      return absl::InvalidArgumentError(absl::StrCat("cuda forward: ", batch.caches.size(),
                                                     " caches for ", num_groups, " groups"));
    }
    for (int g = 0; g < num_groups; ++g) {
      const CudaBatch::DeviceCache& dc = batch.caches[g];
      if (dc.base == nullptr || dc.num_slots <= 0 ||
          dc.slot_stride_bytes < c.layout.BlockBytes(g)) {
        return absl::InvalidArgumentError(
            absl::StrCat("cuda forward: cache of group ", g,
                         " needs a base, slots and a stride >= ", c.layout.BlockBytes(g)));
      }
    }
    caches = batch.caches;
  }
  const int64_t bt = c.layout.block_tokens();
  for (int64_t i = 0; i < R; ++i) {
    const int64_t p = batch.positions[i];
    if (batch.tokens[i] < 0 || batch.tokens[i] >= c.vocab_size || p < 0 ||
        p >= m.options.max_context || p / bt >= batch.max_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("cuda forward: row ", i, " out of range"));
    }
    if (m.rope_max_positions > 0 && p >= m.rope_max_positions) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda forward: rope_scaling dynamic is served only below max_position_embeddings (",
          m.rope_max_positions, "); row ", i, " is at position ", p));
    }
    for (int t = 0; t < batch.table_groups; ++t) {
      // The groups this table serves: the first block their windows reach, their least slots.
      int64_t first = p, slots = std::numeric_limits<int64_t>::max();
      for (int g = 0; g < num_groups; ++g) {
        if (batch.table_groups > 1 && g != t) continue;
        const kv::LayerGroup& grp = c.layout.groups()[g];
        first = std::min(first, grp.kind == kv::LayerKind::kSlidingWindow
                                    ? std::max<int64_t>(0, p - grp.window_tokens + 1)
                                    : int64_t{0});
        slots = std::min(slots, caches[g].num_slots);
      }
      const int32_t* table = batch.block_tables.data() + (int64_t{t} * R + i) * batch.max_blocks;
      for (int64_t b = first / bt; b <= p / bt; ++b) {
        if (table[b] < 0 || table[b] >= slots) {
          return absl::InvalidArgumentError(absl::StrCat("cuda forward: row ", i, " table ", t,
                                                         " block ", b, " has slot ", table[b]));
        }
      }
    }
  }
  for (int64_t r : batch.logit_rows) {
    if (r < 0 || r >= R) return absl::InvalidArgumentError("cuda forward: bad logit row");
  }
  if (static_cast<int64_t>(batch.logit_rows.size()) > m.options.max_rows) {
    return absl::InvalidArgumentError("cuda forward: more logit rows than max_rows");
  }
  DeviceGuard guard(m.device);
  // Every launch below reports cudaGetLastError(), the thread's last error: drop one an earlier
  // failed call on this thread left (a cudaMalloc out of memory, a refused cudaHostRegister),
  // already reported by that call, so it is not blamed on this batch's first kernel. A sticky
  // error (the context is lost) is not cleared by this and still fails every call.
  (void)cudaGetLastError();
  cudaStream_t s = m.stream->get();
  KV_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(m.tokens, batch.tokens.data(), R * 4, cudaMemcpyHostToDevice, s));
  KV_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(m.positions, batch.positions.data(), R * 8, cudaMemcpyHostToDevice, s));
  KV_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(m.tables, batch.block_tables.data(),
                                          batch.block_tables.size() * 4, cudaMemcpyHostToDevice,
                                          s));
  const int64_t hidden = c.hidden_size;
  const int32_t heads = c.num_attention_heads;
  const float eps = static_cast<float>(c.rms_norm_eps);
  constexpr float kLoraNormEps = 1e-6f;  // transformers: q_a/kv_a layernorms use the default eps
  KV_RETURN_IF_ERROR(Embed(m.embed.data, m.options.weight_dtype == WeightDType::kBf16, m.tokens, R,
                           static_cast<int32_t>(hidden), 1.0f, m.h, s));
  // Layer -> (group, index in group).
  std::vector<int> group_of(c.num_hidden_layers), index_of(c.num_hidden_layers);
  for (int g = 0; g < static_cast<int>(c.layout.groups().size()); ++g) {
    const kv::LayerGroup& grp = c.layout.groups()[g];
    for (int i = 0; i < grp.num_layers(); ++i) {
      group_of[grp.layer_ids[i]] = g;
      index_of[grp.layer_ids[i]] = i;
    }
  }
  AttentionParams ap;
  ap.rows = R;
  ap.positions = m.positions;
  ap.max_blocks = batch.max_blocks;
  ap.max_context = m.options.max_context;
  ap.scratch = m.score;
  ap.heads = heads;
  int64_t attn_width = 0;
  for (int32_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    if (before_layer) KV_RETURN_IF_ERROR(before_layer(layer));
    const Layer& L = m.layers[layer];
    const int g = group_of[layer];
    const kv::LayerGroup& grp = c.layout.groups()[g];
    const PagedLayer paged =
        MakePagedLayer(c.layout, g, index_of[layer], caches[g].base, caches[g].slot_stride_bytes);
    // This group's tables: [R, max_blocks].
    const int32_t* tables =
        m.tables + (batch.table_groups > 1 ? int64_t{g} * R * batch.max_blocks : 0);
    ap.block_tables = tables;
    KV_RETURN_IF_ERROR(RmsNorm(m.h, R, static_cast<int32_t>(hidden),
                               static_cast<const float*>(L.input_norm.data), eps, m.xn, hidden,
                               hidden, s));
    if (m.arch == Arch::kMla) {
      const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, lora = c.kv_lora_rank,
                    vd = c.v_head_dim, qk = nope + rope, entry = lora + rope;
      float* q = m.big;
      if (c.q_lora_rank > 0) {
        KV_RETURN_IF_ERROR(m.Gemm(L.q_a, m.xn, R, hidden, m.mid, c.q_lora_rank));
        KV_RETURN_IF_ERROR(RmsNorm(m.mid, R, c.q_lora_rank,
                                   static_cast<const float*>(L.q_a_norm.data), kLoraNormEps, m.mid,
                                   c.q_lora_rank, c.q_lora_rank, s));
        KV_RETURN_IF_ERROR(m.Gemm(L.q_b, m.mid, R, c.q_lora_rank, q, heads * qk));
      } else {
        KV_RETURN_IF_ERROR(m.Gemm(L.q, m.xn, R, hidden, q, heads * qk));
      }
      float* kva = m.mid;  // [R, entry]
      KV_RETURN_IF_ERROR(m.Gemm(L.kv_a, m.xn, R, hidden, kva, entry));
      KV_RETURN_IF_ERROR(RmsNorm(kva, R, static_cast<int32_t>(lora),
                                 static_cast<const float*>(L.kv_a_norm.data), kLoraNormEps, kva,
                                 entry, entry, s));
      KV_RETURN_IF_ERROR(Rope(kva + lora, R, 1, static_cast<int32_t>(rope), entry, 0, m.positions,
                              c.rope_theta, RopeStyle::kInterleaved, s, m.rope_inv_freq,
                              m.rope_attention_factor));
      KV_RETURN_IF_ERROR(Rope(q + nope, R, heads, static_cast<int32_t>(rope), heads * qk, qk,
                              m.positions, c.rope_theta, RopeStyle::kInterleaved, s,
                              m.rope_inv_freq, m.rope_attention_factor));
      KV_RETURN_IF_ERROR(WriteCache(paged, kva, nullptr, entry, entry, entry, R, m.positions,
                                    tables, batch.max_blocks, s));
      // Absorbed query: qcat[r, h, :lora] = q_nope[r, h] * W_UK_h; qcat[r, h, lora:] = q_pe.
      const float one = 1.0f, zero = 0.0f;
      const float* kv_b = static_cast<const float*>(L.kv_b.data);
      KV_RETURN_IF_CUBLAS_ERROR(cublasSgemmStridedBatched(
          m.cublas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(lora), static_cast<int>(R),
          static_cast<int>(nope), &one, kv_b, static_cast<int>(lora), (nope + vd) * lora, q,
          static_cast<int>(heads * qk), qk, &zero, m.qcat, static_cast<int>(heads * entry), entry,
          heads));
      KV_RETURN_IF_ERROR(CopyRows(q + nope, qk, m.qcat + lora, entry, R * heads, rope, s));
      ap.q = m.qcat;
      ap.q_row_stride = heads * entry;
      ap.group_size = heads;
      ap.qk_dim = static_cast<int32_t>(entry);
      ap.v_dim = static_cast<int32_t>(lora);
      ap.window = 0;
      // As the CPU runner: DeepSeek's yarn mscale_all_dim folds into the softmax scale.
      ap.scale = static_cast<float>(std::pow(static_cast<double>(qk), -0.5) *
                                    MlaSoftmaxScaleFactor(c.rope_scaling));
      ap.out = m.olat;
      KV_RETURN_IF_ERROR(PagedAttention(paged, ap, s));
      // out[r, h, :] = olat[r, h] * W_UV_h^T.
      KV_RETURN_IF_CUBLAS_ERROR(cublasSgemmStridedBatched(
          m.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(vd), static_cast<int>(R),
          static_cast<int>(lora), &one, kv_b + nope * lora, static_cast<int>(lora),
          (nope + vd) * lora, m.olat, static_cast<int>(heads * lora), lora, &zero, m.attn,
          static_cast<int>(heads * vd), vd, heads));
      attn_width = heads * vd;
    } else {
      const int64_t hd = c.head_dim, kvh = c.num_key_value_heads;
      const int64_t width = (heads + 2 * kvh) * hd;
      float* qkv = m.big;
      KV_RETURN_IF_ERROR(m.Gemm(L.qkv, m.xn, R, hidden, qkv, width));
      KV_RETURN_IF_ERROR(Rope(qkv, R, heads, static_cast<int32_t>(hd), width, hd, m.positions,
                              c.rope_theta, RopeStyle::kHalf, s, m.rope_inv_freq,
                              m.rope_attention_factor));
      KV_RETURN_IF_ERROR(Rope(qkv + heads * hd, R, static_cast<int32_t>(kvh),
                              static_cast<int32_t>(hd), width, hd, m.positions, c.rope_theta,
                              RopeStyle::kHalf, s, m.rope_inv_freq, m.rope_attention_factor));
      KV_RETURN_IF_ERROR(WriteCache(paged, qkv + heads * hd, qkv + (heads + kvh) * hd, width, width,
                                    kvh * hd, R, m.positions, tables, batch.max_blocks, s));
      ap.q = qkv;
      ap.q_row_stride = width;
      ap.group_size = static_cast<int32_t>(heads / kvh);
      ap.qk_dim = ap.v_dim = static_cast<int32_t>(hd);
      ap.window = grp.kind == kv::LayerKind::kSlidingWindow ? grp.window_tokens : 0;
      ap.scale = 1.0f / std::sqrt(static_cast<float>(hd));
      ap.out = m.attn;
      KV_RETURN_IF_ERROR(PagedAttention(paged, ap, s));
      attn_width = heads * hd;
    }
    KV_RETURN_IF_ERROR(m.Gemm(L.o, m.attn, R, attn_width, m.proj, hidden));
    KV_RETURN_IF_ERROR(AddInPlace(m.h, m.proj, R * hidden, s));
    KV_RETURN_IF_ERROR(RmsNorm(m.h, R, static_cast<int32_t>(hidden),
                               static_cast<const float*>(L.post_norm.data), eps, m.xn, hidden,
                               hidden, s));
    const int64_t inter = c.intermediate_size;
    KV_RETURN_IF_ERROR(m.Gemm(L.gate_up, m.xn, R, hidden, m.big, 2 * inter));
    KV_RETURN_IF_ERROR(
        GatedActivation(m.big, m.big + inter, R, inter, 2 * inter, 2 * inter, false, s));
    KV_RETURN_IF_ERROR(m.Gemm(L.down, m.big, R, 2 * inter, m.proj, hidden));
    KV_RETURN_IF_ERROR(AddInPlace(m.h, m.proj, R * hidden, s));
    if (after_layer) KV_RETURN_IF_ERROR(after_layer(layer));
  }
  const int64_t nl = static_cast<int64_t>(batch.logit_rows.size());
  for (int64_t i = 0; i < nl; ++i) {
    KV_RETURN_IF_ERROR(RmsNorm(m.h + batch.logit_rows[i] * hidden, 1, static_cast<int32_t>(hidden),
                               static_cast<const float*>(m.final_norm.data), eps, m.xn + i * hidden,
                               hidden, hidden, s));
  }
  if (nl > 0) KV_RETURN_IF_ERROR(m.Gemm(m.lm_head, m.xn, nl, hidden, m.logits, c.vocab_size));
  m.pending_logit_rows = nl;
  return absl::OkStatus();
}

}  // namespace kvrelay::model::cuda
