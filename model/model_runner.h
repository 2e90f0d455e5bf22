#pragma once

// ModelRunner: the CPU forward pass of a decoder-only model (GQA, MLA, sliding window) over a
// paged KV cache. Weights are read from a Hugging Face model directory (config.json +
// safetensors) and upcast to fp32. Prefill and (batch-invariant) decode GEMMs run PackedLinear
// over the projections packed at load, which replace the loaded copies; attention
// (AttendQueries) is threaded.
//
//   KV_ASSIGN_OR_RETURN(auto runner, ModelRunner::Load(dir, {.threads = 2}));
//   KV_ASSIGN_OR_RETURN(auto cache, KvCache::Create(runner->layout(), /*blocks_per_group=*/256));
//   Sequence seq(cache.get());
//   KV_ASSIGN_OR_RETURN(std::vector<float> logits, runner->Prefill(seq, prompt));
//   int32_t next = Greedy(logits);
//   KV_ASSIGN_OR_RETURN(logits, runner->DecodeStep({&seq}, {next}));
//
// Determinism: prefill results are bit for bit reproducible and independent of how a prompt is
// split. Every prefill GEMM runs PackedLinear (model/packed_gemm.h) and attention runs
// AttendQueries (model/attention_cpu.h), both row-invariant by construction: a row's result
// does not depend on how many rows share the call, how threads split it or the CPU's vector
// width (AVX-512 or the portable loops).
// A prefill that starts from cached prefix blocks, continues a chunked prefill or starts in
// the middle of a block therefore computes exactly what one full prefill computes, with no row
// recomputed. (Before, OpenBLAS calls were cut into row tiles at multiples of gemm_tile_tokens
// and a start inside a tile recomputed the tile's cached rows.)
// Decode is batch-invariant by default (RunnerOptions::batch_invariant_decode): every GEMM of a
// decode step is the same row-invariant PackedLinear, so a sequence's logits do not depend on
// which other sequences share the step.
//
// Thread safety: thread-safe. Prefill/DecodeStep calls on one runner are serialised by an
// internal mutex (they share an activation workspace and OpenBLAS's process-wide threads);
// everything else is immutable after creation.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv/hf_config.h"
#include "model/attention_model.h"
#include "model/cpu_ops.h"
#include "model/kv_cache.h"
#include "model/packed_gemm.h"
#include "model/rope.h"
#include "model/weights.h"

namespace kvrelay::model {

struct RunnerOptions {
  int32_t threads = 1;  // attention threads; also sets OpenBLAS's (process-wide) count
  int32_t block_tokens = kv::kDefaultBlockTokens;  // tokens per cache block
  std::optional<kv::DType> cache_dtype;  // default: the config's torch_dtype (bf16, fp16, fp32)
  // The KV cache's dtype when it differs from the model's (cache_dtype above): kFp8 stores
  // E4M3 values with their scales inside the blocks (kv/fp8.h). Default: the model's dtype.
  // Only Load(dir, options) reads it; a parsed config already carries its layout.
  std::optional<kv::DType> kv_cache_dtype;
  // No effect on results or speed any more: prefill GEMMs are row-invariant (see the
  // determinism note above); kept so callers that set it still build. Must be >= 0.
  int32_t gemm_tile_tokens = 0;
  // Decode computes every row with the row-invariant PackedLinear, as prefill does: a sequence's
  // logits are bit-identical whatever other sequences share its step, and the projections are
  // held once (packed). false: one sgemm per batch over a second, unpacked fp32 copy of the
  // projections (faster at large batches; a row's rounding then depends on the batch).
  bool batch_invariant_decode = true;
};

class ModelRunner : public AttentionModel {
 public:
  // Reads <dir>/config.json and its safetensors. InvalidArgument naming a missing or misshapen
  // tensor or a bad config field; Unimplemented for model types the runner does not run.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Load(const std::string& model_dir,
                                                           const RunnerOptions& options = {});
  // As Load, with <dir>/config.json already parsed into `config` (its layout's block_tokens
  // wins over options.block_tokens): a worker parses it once.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Load(const std::string& model_dir,
                                                           kv::ModelConfig config,
                                                           const RunnerOptions& options);
  // REQUIRES: weights came from LoadWeights(.., config) (shapes already checked).
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(kv::ModelConfig config,
                                                             ModelWeights weights,
                                                             const RunnerOptions& options = {});

  const kv::ModelConfig& config() const override { return config_; }
  ComputeDevice device() const override {
    return {.kind = DeviceKind::kCpu, .index = 0, .name = "cpu"};
  }
  std::string numerics_id() const override { return {}; }
  Arch arch() const { return arch_; }
  const RunnerOptions& options() const { return options_; }
  // Bytes of weights this runner holds: the loaded fp32 tensors plus the packed projections.
  int64_t weight_bytes() const;

  // Computes `tokens` after whatever `seq` already holds (nothing, or a prefix installed with
  // Sequence::AdoptPrefix), writing their KV into the sequence's blocks (allocated as needed).
  // Returns the logits of the last token, or of all new tokens with options.all_logits.
  // InvalidArgument for no tokens, a token id outside [0, vocab) or a cache of another layout;
  // ResourceExhausted when the pools are full.
  absl::StatusOr<std::vector<float>> Prefill(Sequence& seq, absl::Span<const int32_t> tokens,
                                             const PrefillOptions& options = {}) const override;

  // One decode step for a batch: appends tokens[i] to seqs[i] (continuous batching: each
  // sequence at its own length, possibly in different caches of this layout). Returns logits
  // [batch, vocab], row i for seqs[i].
  absl::StatusOr<std::vector<float>> DecodeStep(absl::Span<Sequence* const> seqs,
                                                absl::Span<const int32_t> tokens) const override;

 private:
  struct Row {
    Sequence* seq;
    int64_t position;
  };
  ModelRunner(kv::ModelConfig config, ModelWeights weights, Arch arch, RunnerOptions options);
  // Refuses positions a dynamic-NTK RoPE cannot serve (see model/rope.h).
  absl::Status CheckPositions(int64_t end) const;

  // The whole forward pass for `rows` (tokens[i] at rows[i]). GEMMs are tiled by position from
  // tile_origin when tile > 0. logit_rows: which rows get logits (in order). `prefill` (null
  // for decode steps): its before_layer and on_layer_done hooks; before_layer's error stops the
  // pass and is returned.
  absl::StatusOr<std::vector<float>> Forward(const std::vector<Row>& rows,
                                             absl::Span<const int32_t> tokens, int64_t tile_origin,
                                             int64_t tile, const std::vector<int64_t>& logit_rows,
                                             const PrefillOptions* prefill) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void GqaAttention(int32_t layer, const std::vector<Row>& rows, const float* xn,
                    int64_t tile_origin, int64_t tile, float* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MlaAttention(int32_t layer, const std::vector<Row>& rows, const float* xn,
                    int64_t tile_origin, int64_t tile, float* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Attention over the cache for rows grouped by sequence; q is [rows, heads, qk_dim],
  // out [rows, heads, v_dim].
  void CacheAttention(int32_t layer, const std::vector<Row>& rows, const float* q, int32_t qk_dim,
                      int32_t v_dim, float scale, float softcap, float* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WriteCache(int32_t layer, const std::vector<Row>& rows, const float* k, const float* v,
                  int64_t width) const;
  // fp8: quantises one row's K and V (or its MLA entry, v null) into (slot, token_in_block).
  void WriteFp8Row(KvCache& cache, int32_t layer, kv::SlotId slot, int32_t token_in_block,
                   const float* k, const float* v) const;

  // A layer's projection weights packed for PackedLinear (empty where the architecture has no
  // such weight). Prefill and batch-invariant decode run on these alone, so with
  // batch_invariant_decode the unpacked copies are released after packing (each projection is
  // held once); batched-sgemm decode keeps them.
  struct PackedLayer {
    PackedWeights q, k, v, o, gate, up, down;
    PackedWeights q_a, q_b, kv_a;  // MLA (q_proj goes to q when q_lora_rank is 0)
    // MLA per head: W_UK_h^T [lora, nope] (the absorbed query) and W_UV_h [v_head_dim, lora].
    std::vector<PackedWeights> uk, uv;
  };
  void PackWeights();
  void ReleaseUnpackedProjections();
  // Prefill (tile > 0) and batch-invariant decode (kRowwiseTiles): every GEMM row computed alone
  // in a fixed order, which PackedLinear does whatever the tile or batch.
  static bool RowInvariant(int64_t tile) { return tile > 0 || tile == kRowwiseTiles; }
  // y = x * w^T for `rows` rows: row-invariant calls run PackedLinear over `packed` in one
  // call; batched-sgemm decode (tile 0) goes to Linear over `w`.
  void Project(const float* x, int64_t rows, int64_t in, const std::vector<float>& w,
               const PackedWeights& packed, int64_t out, float* y, int64_t origin,
               int64_t tile) const;

  // Activations reused across calls (one call at a time), so a prefill does not fault in fresh
  // pages for every layer.
  struct Workspace {
    std::vector<float> h, xn, attn, proj, gate, up, q, k, v, qa, kva, qcat, olat, k_buf, v_buf, k_t;
  };

  kv::ModelConfig config_;
  ModelWeights weights_;
  std::vector<PackedLayer> packed_;  // one per layer, constant after Create
  mutable absl::Mutex mu_;
  mutable Workspace ws_ ABSL_GUARDED_BY(mu_);
  Arch arch_;
  RunnerOptions options_;
  Activation activation_ = Activation::kSilu;
  RopeFrequencies rope_;        // every RoPE layer (gemma3: global layers)
  RopeFrequencies rope_local_;  // gemma3 sliding-window layers
};

}  // namespace kvrelay::model
