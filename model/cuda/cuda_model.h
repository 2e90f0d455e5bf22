#pragma once

// CudaModel: the forward pass of a Llama-style (GQA, optionally sliding-window) or
// DeepSeek-style (MLA, absorbed projections) model on one GPU: cuBLAS GEMMs (fp32, or bf16
// weights and inputs with fp32 accumulation) and the kernels of cuda_ops.h over a paged cache
// in device memory with the same unit layout as the CPU pools (kv/model_layout.h).
// cuda_model_test.cc checks its logits against the CPU ModelRunner; bench/gpu_model_bench
// times it. Gemma 3 specifics (q/k norms, sandwich norms, GeGLU) run on CPU only.
//
// Not thread-safe: one Forward at a time. Owns its device memory, cuBLAS handle and stream.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kv/hf_config.h"
#include "model/weights.h"

namespace kvrelay::model::cuda {

enum class WeightDType { kFp32, kBf16 };

struct CudaModelOptions {
  WeightDType weight_dtype = WeightDType::kBf16;
  int64_t num_blocks = 64;     // cache blocks per layer group; 0: none (batches bring caches)
  int64_t max_rows = 256;      // tokens per Forward (prefill length or decode batch)
  int64_t max_context = 4096;  // longest sequence
  int device = 0;
};

// One Forward call: row i is token tokens[i] at positions[i] of the sequence whose block
// table (slot per block index) is block_tables[i * max_blocks .. +max_blocks), the same for
// every layer group when table_groups is 1; with table_groups == number of layer groups,
// group g's tables follow at block_tables[g * rows * max_blocks ..]. Slot -1 is allowed only
// for sliding-window blocks no row attends to.
struct CudaBatch {
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;
  std::vector<int32_t> block_tables;
  int32_t max_blocks = 0;
  int32_t table_groups = 1;
  std::vector<int64_t> logit_rows;  // rows whose logits come back, in order
  // Device caches to run over instead of the model's own, one per layer group: base address,
  // slots and the distance between slots (each unit laid out as kv/model_layout.h says).
  // Empty: the model's own cache (CudaModelOptions::num_blocks units per group).
  struct DeviceCache {
    void* base = nullptr;
    int64_t num_slots = 0;
    int64_t slot_stride_bytes = 0;
  };
  std::vector<DeviceCache> caches;
};

// Called on the host right after layer `layer`'s kernels (its cache write included) are
// enqueued on stream(), in layer order; an error stops the forward pass and is returned.
using LayerHook = std::function<absl::Status(int32_t layer)>;

// OK when the CUDA forward pass implements this config (Llama-style GQA or DeepSeek-style MLA
// with SiLU, no biases, interleaved MLA RoPE, any rope_scaling model/rope.h computes); otherwise
// Unimplemented (InvalidArgument for a rope_scaling the CPU refuses too) naming what
// it does not run. Touches no device, so it can refuse on machines without one.
absl::Status CudaModelSupports(const kv::ModelConfig& config);

class CudaModel {
 public:
  // Uploads weights loaded on the host (LoadWeights). FailedPrecondition without a device;
  // Unimplemented for Gemma 3.
  static absl::StatusOr<std::unique_ptr<CudaModel>> Create(const kv::ModelConfig& config,
                                                           const ModelWeights& weights,
                                                           const CudaModelOptions& options);
  // Random weights drawn on the device (for benchmarks of real-size shapes).
  static absl::StatusOr<std::unique_ptr<CudaModel>> CreateRandom(const kv::ModelConfig& config,
                                                                 uint64_t seed,
                                                                 const CudaModelOptions& options);
  ~CudaModel();

  // Runs the batch and returns logits [logit_rows.size(), vocab] (empty when none asked).
  absl::StatusOr<std::vector<float>> Forward(const CudaBatch& batch);

  // Forward in two halves, so the caller can act between layers and before the final wait:
  // Enqueue validates the batch and enqueues every kernel (final logits into device memory),
  // calling after_layer as it goes; then exactly one of TakeLogits (logits [logit_rows, vocab])
  // or TakeGreedy (per logit row the argmax id, lowest id among equal maxima, as
  // model::Greedy, computed on the device; only the ids are copied back) waits for the stream.
  // before_layer is called before any kernel of a layer is enqueued (the caller may enqueue
  // copies that layer reads on stream() first).
  absl::Status Enqueue(const CudaBatch& batch, const LayerHook& after_layer = nullptr,
                       const LayerHook& before_layer = nullptr);
  absl::StatusOr<std::vector<float>> TakeLogits();
  absl::StatusOr<std::vector<int32_t>> TakeGreedy();

  // The device and its compute capability (major * 10 + minor), as the model was created on.
  int device() const;
  int compute_capability() const;
  // Copies one cache unit (group, slot) to the host, BlockBytes(group) bytes.
  absl::StatusOr<std::vector<uint8_t>> ReadBlock(int group, int32_t slot);
  absl::Status Synchronize();
  // The stream every launch goes to (for cudaEvent timing).
  void* stream() const;
  const kv::ModelConfig& config() const { return config_; }

  struct Impl;  // opaque: device state, defined in cuda_model.cc

 private:
  CudaModel(kv::ModelConfig config, std::unique_ptr<Impl> impl);
  kv::ModelConfig config_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrelay::model::cuda
