#pragma once

// MambaRunner: the CPU forward pass of Mamba-1 (model_type "mamba", the layout of
// state-spaces/mamba-*-hf) as transformers' MambaMixer computes it: per layer RMSNorm ->
// in_proj -> [x | z]; x -> causal depthwise conv1d (+ bias) -> SiLU -> x_proj -> [dt | B | C];
// dt -> dt_proj (+ bias) -> softplus; selective scan h = exp(A dt) h + dt B x, y = C.h + D x;
// y * SiLU(z) -> out_proj -> residual. Final RMSNorm, LM head (tied by default).
//
// A sequence carries no KV cache but a fixed-size recurrent state: per layer the conv window
// (the last conv_kernel inputs of the conv, [intermediate, conv_kernel], newest last) and the
// SSM state [intermediate, state_size], in the layout's dtype - exactly the layout's one SSM
// block unit, kv::ModelLayout::BlockBytes(0) == num_layers * state_bytes, whatever the length.
//
// State rounding and checkpoints: the state is held in fp32 between tokens inside one call and
// rounded to the layout dtype at every block boundary (after token b * block_tokens - 1) and at
// the end of every call. transformers rounds to the model dtype at the end of every forward
// call, so this is transformers' result when called block by block. Because of it, the state
// at a block boundary - a checkpoint - is exactly what a later computation starting from that
// checkpoint resumes with, and (every projection is the row-invariant PackedLinear, as in
// ModelRunner) a prefill resumed from a checkpoint is bit-identical to the full prefill. Decode
// runs the same GEMMs, so it is batch-invariant too; the projections are held once, packed.
//
// Serving (what the workers do with it; see model/README.md):
//   prefill: Restore() the deepest checkpoint whose chained block hash matches, Prefill() the
//     rest with on_checkpoint publishing each new boundary's state under its block's hash, and
//     send state() (constant size) to the decode worker with the token count.
//   decode:  Restore(state, tokens) and DecodeStep() batches.
//
// Thread safety: thread-safe (immutable after creation; calls serialised internally). A
// MambaSequence is single-threaded.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv/hf_config.h"
#include "model/model_runner.h"
#include "model/packed_gemm.h"
#include "model/weights.h"

namespace kvrelay::model {

// One sequence's recurrent state and length.
class MambaSequence {
 public:
  explicit MambaSequence(const kv::ModelLayout& layout);  // empty sequence, zero state

  int64_t num_tokens() const { return num_tokens_; }
  // The state as layout.BlockBytes(0) bytes: per layer conv [intermediate, conv_kernel] then
  // ssm [intermediate, state_size], layout dtype.
  std::vector<uint8_t> SerializeState() const;
  // Replaces the state with `state` (a checkpoint or a transferred state) after `num_tokens`
  // tokens. InvalidArgument when the size is not BlockBytes(0) or num_tokens < 0.
  absl::Status Restore(absl::Span<const uint8_t> state, int64_t num_tokens);

  const kv::ModelLayout& layout() const { return layout_; }

 private:
  friend class MambaRunner;
  kv::ModelLayout layout_;
  int64_t num_tokens_ = 0;
  // fp32, values always representable in the layout dtype between calls.
  std::vector<float> conv_;       // [layers, intermediate, conv_kernel]
  std::vector<float> ssm_;        // [layers, intermediate, state_size]
  std::vector<uint8_t> pending_;  // a restored state not yet parsed by the runner
};

struct MambaPrefillOptions {
  // Called after the prefill for every block boundary it crossed: block index b (0-based) and
  // the state after token (b + 1) * block_tokens - 1, BlockBytes(0) bytes - what the cache keeps
  // under block b's chained hash.
  std::function<void(int64_t block, absl::Span<const uint8_t> state)> on_checkpoint;
  bool all_logits = false;  // logits of every new token, [n, vocab]
};

class MambaRunner {
 public:
  static absl::StatusOr<std::unique_ptr<MambaRunner>> Load(const std::string& model_dir,
                                                           const RunnerOptions& options = {});
  // As Load, with <dir>/config.json already parsed into `config`.
  static absl::StatusOr<std::unique_ptr<MambaRunner>> Load(const std::string& model_dir,
                                                           kv::ModelConfig config,
                                                           const RunnerOptions& options);
  static absl::StatusOr<std::unique_ptr<MambaRunner>> Create(kv::ModelConfig config,
                                                             ModelWeights weights,
                                                             const RunnerOptions& options = {});

  const kv::ModelConfig& config() const { return config_; }
  const kv::ModelLayout& layout() const { return config_.layout; }

  // Computes `tokens` after the sequence's state; returns the last token's logits (or all).
  // InvalidArgument for no tokens, an id outside the vocabulary or another layout's sequence.
  absl::StatusOr<std::vector<float>> Prefill(MambaSequence& seq, absl::Span<const int32_t> tokens,
                                             const MambaPrefillOptions& options = {}) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // One token per sequence; logits [batch, vocab]. Batch-invariant: a row's logits do not
  // depend on the other rows.
  absl::StatusOr<std::vector<float>> DecodeStep(absl::Span<MambaSequence* const> seqs,
                                                absl::Span<const int32_t> tokens) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  MambaRunner(kv::ModelConfig config, ModelWeights weights, RunnerOptions options);
  absl::Status Check(const MambaSequence& seq, absl::Span<const int32_t> tokens) const;
  // rows: tokens of one sequence (prefill, positions start..) or one token of each sequence
  // (decode). Writes checkpoints into `checkpoints` ([boundaries, BlockBytes]) for prefill.
  std::vector<float> Forward(absl::Span<MambaSequence* const> seqs, bool decode,
                             absl::Span<const int32_t> tokens, bool all_logits,
                             std::vector<std::vector<uint8_t>>* checkpoints) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A layer's in_proj, x_proj, dt_proj and out_proj packed for PackedLinear; the loaded copies
  // are released after packing.
  struct PackedLayer {
    PackedWeights in, x, dt, out;
  };

  kv::ModelConfig config_;
  ModelWeights weights_;
  std::vector<PackedLayer> packed_;  // one per layer, constant after Create
  RunnerOptions options_;
  // One Forward at a time (the calls are serialised, as the header says).
  mutable absl::Mutex mu_;
};

}  // namespace kvrelay::model
