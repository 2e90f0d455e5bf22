#pragma once

// AttentionModel: what a prefill or decode worker computes with, whichever device runs it. Two
// implementations: ModelRunner (CPU, model/model_runner.h) and the CUDA runner
// (model/cuda/cuda_runner.h). Both keep the same paged-cache contract (model/kv_cache.h):
// the host KvCache's pools are where KV lives for everyone else (the transport reads and writes
// them), block tables and AdoptPrefix work the same, sliding-window freeing gives the same
// results, and on_layer_done(L) fires only once layer L's bytes are in the host pools.
//
// Numerics: KV computed by one implementation is bit-identical to KV computed by another only
// when their numerics_id() is equal. Workers fold numerics_id() into the layout they serve
// (WithNumerics), so blocks and requests can never cross between backends whose bits differ.
//
// Thread safety: implementations are thread-safe; their Prefill/DecodeStep calls may be
// serialised internally.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv/hf_config.h"
#include "model/kv_cache.h"

namespace kvrelay::model {

enum class DeviceKind { kCpu, kCuda };

// The device a model computes on, as workers report it (listening line, /metrics).
struct ComputeDevice {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;     // CUDA device ordinal; 0 on CPU
  std::string name;  // "cpu", or the CUDA device's name ("NVIDIA H200")
  // "cpu" or "cuda:N".
  std::string Label() const;
};

struct PrefillOptions {
  // Called on the calling thread as soon as layer `layer`'s K/V (or MLA latent) for every new
  // token is in the host pool: in each (group, block) unit of that layer's group, the bytes
  // [i * layer_bytes, (i + 1) * layer_bytes) with i = KvCache::index_in_group(layer) and
  // layer_bytes = BlockBytes(group) / group.num_layers(). Lets layer L travel while L+1
  // computes. Called once per layer, in layer order.
  std::function<void(int32_t layer)> on_layer_done;
  // Called on the calling thread before layer `layer` first reads the KV of the tokens the
  // sequence already held (a prefix whose bytes may still be arriving, layer by layer, e.g.
  // read back from disk), once per layer, in layer order. An error stops the prefill and is
  // returned: the sequence keeps its tokens (none is appended) and blocks, so the caller may
  // Rewind it and compute again. A runner that reads the whole prefix before its first layer
  // calls it for every layer first.
  std::function<absl::Status(int32_t layer)> before_layer;
  // Logits for every new token ([n, vocab]) instead of only the last one ([vocab]).
  bool all_logits = false;
};

class AttentionModel {
 public:
  virtual ~AttentionModel() = default;

  virtual const kv::ModelConfig& config() const = 0;
  const kv::ModelLayout& layout() const { return config().layout; }
  virtual ComputeDevice device() const = 0;
  // Empty for the CPU runner (its bits are the reference and do not depend on the CPU's vector
  // width); otherwise a stable id of everything that changes the bits (backend, weight dtype).
  virtual std::string numerics_id() const = 0;

  // Computes `tokens` after whatever `seq` already holds (nothing, or a prefix installed with
  // Sequence::AdoptPrefix, whose bytes are in the host pools), writing their KV into the
  // sequence's blocks (allocated as needed). Returns the logits of the last token, or of all
  // new tokens with options.all_logits. InvalidArgument for no tokens, a token id outside
  // [0, vocab) or a cache of another layout; ResourceExhausted when the pools are full.
  virtual absl::StatusOr<std::vector<float>> Prefill(Sequence& seq,
                                                     absl::Span<const int32_t> tokens,
                                                     const PrefillOptions& options = {}) const = 0;

  // One decode step for a batch: appends tokens[i] to seqs[i] (continuous batching: each
  // sequence at its own length). Returns logits [batch, vocab], row i for seqs[i]. The new
  // tokens' KV is in the host pools when it returns.
  virtual absl::StatusOr<std::vector<float>> DecodeStep(absl::Span<Sequence* const> seqs,
                                                        absl::Span<const int32_t> tokens) const = 0;

  // DecodeStep followed by greedy sampling of each row (lowest index among equal maxima, as
  // model::Greedy). Implementations may sample on the device and return only the ids.
  virtual absl::StatusOr<std::vector<int32_t>> DecodeStepGreedy(
      absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens) const;

  // Takes now what this backend needs for every later call on `cache` (the CUDA runner: the
  // cache's device copy, as large as its pools), so a worker whose cache does not fit fails at
  // start-up, saying why, instead of serving and failing every request. The CPU needs nothing.
  virtual absl::Status PrepareCache(const KvCache& /*cache*/) const { return absl::OkStatus(); }
};

// The input checks every implementation makes, with the same messages (InvalidArgument):
// the sequence's cache is of `config`'s layout (fingerprint, numerics included) and every
// token id is in [0, vocab); a prefill has tokens; a decode batch is non-empty, one token per
// sequence, of distinct non-null sequences.
absl::Status CheckPrefillInput(const Sequence& seq, absl::Span<const int32_t> tokens,
                               const kv::ModelConfig& config);
absl::Status CheckDecodeInput(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                              const kv::ModelConfig& config);

}  // namespace kvrelay::model
