#include "model/cuda/cuda_runner.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "model/cuda/cuda_ops.h"
#include "model/cuda/staging_plan.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "platform/cuda/cuda_util.h"

namespace kvrelay::model::cuda {
namespace {

using platform::cuda::CudaEvent;
using platform::cuda::CudaStream;
using platform::cuda::DeviceBuffer;
using platform::cuda::DeviceGuard;

std::atomic<uint64_t> next_runner_key{1};

// The device copy of one host KvCache: per group a buffer with the host pool's slots at the
// host pool's stride, so slot s of group g is at the same offset on both sides. The host pools
// are page-locked for as long as the mirror lives (it is the cache's device state, destroyed
// with the cache before its pools), so the staging copies are asynchronous DMA.
class DeviceMirror final : public CacheDeviceState {
 public:
  ~DeviceMirror() override {
    DeviceGuard guard(device);
    for (void* base : registered) {
      const cudaError_t e = cudaHostUnregister(base);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        KV_LOG(WARNING) << "cuda runner: cudaHostUnregister failed: " << cudaGetErrorString(e);
      }
    }
  }

  uint64_t owner = 0;  // key of the runner that made it
  int device = 0;
  std::vector<DeviceBuffer> buffers;           // per group
  std::vector<CudaBatch::DeviceCache> caches;  // per group, into buffers
  std::vector<uint8_t*> host_bases;            // per group: the host pool's slot 0
  std::vector<int64_t> strides;                // per group: bytes between slots (both sides)
  std::vector<void*> registered;               // host pools this mirror page-locked
};

// The CUDA AttentionModel (cuda_runner.h). Thread-safe: Prefill and DecodeStep calls are
// serialised by mu_ (they share the model's activations, both streams and the per-layer
// events); every call has waited for all its device work before it returns, so nothing is in
// flight between calls. The mirrors it makes belong to the caches (KvCache::device_state) and
// may outlive the runner.
class CudaRunner final : public AttentionModel {
 public:
  CudaRunner(kv::ModelConfig config, std::unique_ptr<CudaModel> model, CudaRunnerOptions options,
             std::string numerics_id, std::string device_name, CudaStream copy_stream,
             std::vector<CudaEvent> compute_done, std::vector<CudaEvent> copy_done)
      : config_(std::move(config)),
        model_(std::move(model)),
        options_(options),
        numerics_id_(std::move(numerics_id)),
        device_name_(std::move(device_name)),
        key_(next_runner_key.fetch_add(1, std::memory_order_relaxed)),
        copy_stream_(std::move(copy_stream)),
        compute_done_(std::move(compute_done)),
        copy_done_(std::move(copy_done)) {}

  const kv::ModelConfig& config() const override { return config_; }
  ComputeDevice device() const override {
    return {.kind = DeviceKind::kCuda, .index = options_.device, .name = device_name_};
  }
  std::string numerics_id() const override { return numerics_id_; }

  absl::StatusOr<std::vector<float>> Prefill(Sequence& seq, absl::Span<const int32_t> tokens,
                                             const PrefillOptions& options) const override;
  absl::StatusOr<std::vector<float>> DecodeStep(absl::Span<Sequence* const> seqs,
                                                absl::Span<const int32_t> tokens) const override {
    std::vector<float> logits;
    KV_RETURN_IF_ERROR(Decode(seqs, tokens, &logits, nullptr));
    return logits;
  }
  absl::StatusOr<std::vector<int32_t>> DecodeStepGreedy(
      absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens) const override {
    std::vector<int32_t> ids;
    KV_RETURN_IF_ERROR(Decode(seqs, tokens, nullptr, &ids));
    return ids;
  }

  absl::Status PrepareCache(const KvCache& cache) const override;

  absl::StatusOr<std::vector<uint8_t>> ReadDeviceUnit(const KvCache& cache, int group,
                                                      kv::SlotId slot) const;

 private:
  // Exactly one of logits / ids is set; see DecodeStep / DecodeStepGreedy.
  absl::Status Decode(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                      std::vector<float>* logits, std::vector<int32_t>* ids) const;
  // The mirror of `cache`, made at first sight. FailedPrecondition when another runner
  // mirrors it (its device copy would be stale here).
  // Held by the caller for the whole call, so it cannot be destroyed under its copies.
  absl::StatusOr<std::shared_ptr<DeviceMirror>> MirrorFor(const KvCache& cache) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Enqueues on the compute stream the upload of the blocks AdoptPrefix installed (their
  // bytes are only in the host pools).
  absl::Status UploadHostOnlyBlocks(const Sequence& seq, const DeviceMirror& mirror) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a failed call: lets every enqueued operation finish so nothing is in flight, and
  // latches context_lost_ when the failure was a sticky one.
  void Drain() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK, or the error every call returns once the CUDA context is lost.
  absl::Status CheckContext() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  cudaStream_t compute_stream() const { return static_cast<cudaStream_t>(model_->stream()); }

  const kv::ModelConfig config_;  // layout already WithNumerics(numerics_id_)
  const std::unique_ptr<CudaModel> model_;
  const CudaRunnerOptions options_;
  const std::string numerics_id_;
  const std::string device_name_;
  const uint64_t key_;
  mutable absl::Mutex mu_;        // one forward pass at a time: model_, streams and events
  const CudaStream copy_stream_;  // device -> host staging
  const std::vector<CudaEvent> compute_done_;  // per layer: its kernels finished
  const std::vector<CudaEvent> copy_done_;     // per layer: its staging copies finished
  // A sticky CUDA error (illegal address, launch failure...) seen by Drain: the context cannot
  // compute again, so every later call is refused with it instead of failing somewhere new.
  mutable absl::Status context_lost_ ABSL_GUARDED_BY(mu_);
};

void CudaRunner::Drain() const {
  // Also drops logits an Enqueue left (TakeLogits waits for the compute stream), so the next
  // call starts clean; FailedPrecondition when there were none.
  (void)model_->TakeLogits();
  (void)model_->Synchronize();
  (void)copy_stream_.Synchronize();
  (void)cudaGetLastError();
  // What the clearing above leaves is sticky: the context is lost for good.
  const cudaError_t e = cudaStreamQuery(compute_stream());
  if (e == cudaSuccess || e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return;
  }
  const absl::Status lost = platform::cuda::FromCuda(e, "cudaStreamQuery(after a failed call)");
  context_lost_ = absl::Status(
      lost.code(),
      absl::StrCat("cuda runner: the CUDA context of device ", options_.device, " is lost (",
                   lost.message(), "); every later call fails until the process restarts"));
  KV_LOG(ERROR) << context_lost_;
}

absl::Status CudaRunner::CheckContext() const { return context_lost_; }

absl::StatusOr<std::shared_ptr<DeviceMirror>> CudaRunner::MirrorFor(const KvCache& cache) const {
  // Ours, or FailedPrecondition: its device copy would be stale here.
  auto ours = [&](std::shared_ptr<CacheDeviceState> state)
      -> absl::StatusOr<std::shared_ptr<DeviceMirror>> {
    auto mirror = std::dynamic_pointer_cast<DeviceMirror>(std::move(state));
    if (mirror == nullptr || mirror->owner != key_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda runner: KV cache ", cache.id(), " is already mirrored by another device runner"));
    }
    return mirror;
  };
  if (std::shared_ptr<CacheDeviceState> state = cache.device_state()) return ours(state);
  DeviceGuard guard(options_.device);
  auto mirror = std::make_shared<DeviceMirror>();
  mirror->owner = key_;
  mirror->device = options_.device;
  for (int g = 0; g < cache.num_groups(); ++g) {
    kv::BlockPool& pool = cache.pool(g);
    const size_t bytes = pool.size_bytes();
    KV_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Allocate(options_.device, bytes));
    // Defined bytes everywhere: a staged layer strip of a part-filled block then carries zeros
    // (not stale device memory) past the last token, as a fresh host pool does.
    KV_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(buffer.data(), 0, bytes, compute_stream()));
    mirror->caches.push_back(
        {buffer.data(), pool.num_slots(), static_cast<int64_t>(pool.slot_stride())});
    mirror->buffers.push_back(std::move(buffer));
    mirror->host_bases.push_back(static_cast<uint8_t*>(pool.base()));
    mirror->strides.push_back(static_cast<int64_t>(pool.slot_stride()));
    if (pool.memory_kind() == kv::MemoryKind::kPinnedHost) continue;
    const cudaError_t e = cudaHostRegister(pool.base(), bytes, cudaHostRegisterPortable);
    if (e == cudaSuccess) {
      mirror->registered.push_back(pool.base());
    } else if (e == cudaErrorHostMemoryAlreadyRegistered) {
      // Pinned by its other owner (e.g. a second cache over the same pools), who unpins it.
      (void)cudaGetLastError();
    } else {
      // Copies to pageable memory are still correct, only synchronous (no overlap).
      (void)cudaGetLastError();
      KV_LOG(WARNING) << "cuda runner: cudaHostRegister of KV pool " << g << " (" << bytes
                      << " bytes) failed: " << cudaGetErrorString(e)
                      << "; staging copies run synchronously";
    }
  }
  // Another runner may have attached its mirror meanwhile: then ours is dropped, theirs kept.
  return ours(cache.AttachDeviceState(mirror));
}

absl::Status CudaRunner::PrepareCache(const KvCache& cache) const {
  absl::MutexLock lock(&mu_);
  KV_RETURN_IF_ERROR(CheckContext());
  DeviceGuard guard(options_.device);
  size_t bytes = 0;
  for (int g = 0; g < cache.num_groups(); ++g) bytes += cache.pool(g).size_bytes();
  absl::StatusOr<std::shared_ptr<DeviceMirror>> mirror = MirrorFor(cache);
  absl::Status status = mirror.status();
  // The mirror's zero fill is asynchronous: its failure would otherwise surface at a request.
  if (status.ok()) {
    if (const cudaError_t e = cudaStreamSynchronize(compute_stream()); e != cudaSuccess) {
      status = platform::cuda::FromCuda(e, "cudaStreamSynchronize after the zero fill");
    }
  }
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat("cuda runner: the device copy of KV cache ", cache.id(), " (",
                                   bytes, " bytes over ", cache.num_groups(),
                                   " pools) on cuda:", options_.device, ": ", status.message()));
}

absl::Status CudaRunner::UploadHostOnlyBlocks(const Sequence& seq,
                                              const DeviceMirror& mirror) const {
  if (seq.host_only_blocks() == 0) return absl::OkStatus();
  for (int g = 0; g < seq.cache().num_groups(); ++g) {
    for (const PoolCopy& c : HostOnlyUploads(seq, g)) {
      KV_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
          static_cast<uint8_t*>(mirror.caches[g].base) + c.offset, mirror.host_bases[g] + c.offset,
          static_cast<size_t>(c.width), cudaMemcpyHostToDevice, compute_stream()));
    }
  }
  return absl::OkStatus();
}

// Enqueues `copy` from group g's host pool to its device mirror on `stream`.
absl::Status CopyToDevice(const DeviceMirror& mirror, int g, const PoolCopy& copy,
                          cudaStream_t stream, const char* what) {
  return platform::cuda::FromCuda(
      cudaMemcpy2DAsync(static_cast<uint8_t*>(mirror.caches[g].base) + copy.offset,
                        static_cast<size_t>(copy.pitch), mirror.host_bases[g] + copy.offset,
                        static_cast<size_t>(copy.pitch), static_cast<size_t>(copy.width),
                        static_cast<size_t>(copy.height), cudaMemcpyHostToDevice, stream),
      what);
}

// Enqueues `copy` from group g's device mirror to its host pool on `stream`.
absl::Status CopyToHost(const DeviceMirror& mirror, int g, const PoolCopy& copy,
                        cudaStream_t stream, const char* what) {
  return platform::cuda::FromCuda(
      cudaMemcpy2DAsync(mirror.host_bases[g] + copy.offset, static_cast<size_t>(copy.pitch),
                        static_cast<const uint8_t*>(mirror.caches[g].base) + copy.offset,
                        static_cast<size_t>(copy.pitch), static_cast<size_t>(copy.width),
                        static_cast<size_t>(copy.height), cudaMemcpyDeviceToHost, stream),
      what);
}

// Each decoded token's entries, back to the host pools on `stream` (after every layer): per
// (row, group) 2D copies of the token's row in each layer's K and V (or MLA) plane and, for fp8
// at a block's first token, the scales it set (TokenEntryCopies). Rows before their append.
absl::Status CopyDecodedEntriesToHost(const DeviceMirror& mirror,
                                      absl::Span<const Sequence* const> rows, cudaStream_t stream) {
  for (const Sequence* s : rows) {
    const int64_t pos = s->num_tokens();
    const int64_t bt = s->cache().layout().block_tokens();
    for (int g = 0; g < s->cache().num_groups(); ++g) {
      for (const PoolCopy& c : TokenEntryCopies(s->cache(), g, s->blocks(g)[pos / bt], pos)) {
        KV_RETURN_IF_ERROR(CopyToHost(mirror, g, c, stream, "cudaMemcpy2DAsync(decode entries)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> CudaRunner::Prefill(Sequence& seq,
                                                       absl::Span<const int32_t> tokens,
                                                       const PrefillOptions& options) const {
  KV_RETURN_IF_ERROR(CheckPrefillInput(seq, tokens, config_));
  const int64_t start = seq.num_tokens();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t end = start + n;
  if (end > options_.max_context) {
    return absl::InvalidArgumentError(absl::StrCat("prefill: the sequence would reach ", end,
                                                   " tokens, the CUDA runner's max_context is ",
                                                   options_.max_context));
  }
  KV_RETURN_IF_ERROR(seq.EnsureBlocks(end));
  const KvCache& cache = seq.cache();
  const kv::ModelLayout& lay = cache.layout();
  const int num_groups = cache.num_groups();
  const int64_t bt = lay.block_tokens();
  const int32_t max_blocks = static_cast<int32_t>((end + bt - 1) / bt);
  absl::MutexLock lock(&mu_);
  KV_RETURN_IF_ERROR(CheckContext());
  DeviceGuard guard(options_.device);
  KV_ASSIGN_OR_RETURN(std::shared_ptr<DeviceMirror> mirror, MirrorFor(cache));
  // The held prefix goes to the device whole before the first layer, or, when its bytes may
  // still be arriving (options.before_layer: a disk read in stages), layer by layer: layer L's
  // strips are uploaded on the compute stream right before its kernels, once before_layer(L)
  // says they are in the host pool, while the device computes the layers before it.
  absl::Status status;
  std::vector<std::vector<SlotRun>> held_runs(num_groups);
  if (options.before_layer) {
    for (int g = 0; g < num_groups; ++g) held_runs[g] = HostOnlyRuns(seq, g);
  } else {
    status = UploadHostOnlyBlocks(seq, *mirror);
  }
  auto upload_layer = [&](int32_t layer) -> absl::Status {
    KV_RETURN_IF_ERROR(options.before_layer(layer));
    const int g = cache.group_of_layer(layer);
    for (const PoolCopy& c : LayerStripCopies(cache, layer, held_runs[g])) {
      KV_RETURN_IF_ERROR(CopyToDevice(*mirror, g, c, compute_stream(),
                                      "cudaMemcpy2DAsync(held prefix layer strips)"));
    }
    return absl::OkStatus();
  };

  // Per group, the units holding a new token: each gets every layer's strip back.
  std::vector<std::vector<SlotRun>> touched(num_groups);
  for (int g = 0; g < num_groups; ++g) touched[g] = SlotRuns(TouchedSlots(seq, g, start, end));
  int32_t next_report = 0;  // layers before it were reported to on_layer_done
  // Called once the last chunk's layer `layer` is enqueued: earlier chunks are ahead of it on
  // the compute stream, so its event covers every new token's entries of that layer.
  auto stage_layer = [&](int32_t layer) -> absl::Status {
    const int g = cache.group_of_layer(layer);
    KV_RETURN_IF_ERROR(compute_done_[layer].Record(compute_stream()));
    KV_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(copy_stream_.get(), compute_done_[layer].get(), 0));
    for (const PoolCopy& c : LayerStripCopies(cache, layer, touched[g])) {
      KV_RETURN_IF_ERROR(
          CopyToHost(*mirror, g, c, copy_stream_.get(), "cudaMemcpy2DAsync(prefill layer strips)"));
    }
    KV_RETURN_IF_ERROR(copy_done_[layer].Record(copy_stream_.get()));
    // Report, in order, every layer whose copy has already landed; the rest at the end.
    while (next_report <= layer) {
      const cudaError_t q = cudaEventQuery(copy_done_[next_report].get());
      if (q == cudaErrorNotReady) {
        // Not an error, but the runtime records it as the last error: left there, the next
        // kernel launch's cudaGetLastError() would fail the forward pass with it.
        (void)cudaGetLastError();
        break;
      }
      if (q != cudaSuccess) return platform::cuda::FromCuda(q, "cudaEventQuery(copy_done)");
      if (options.on_layer_done) options.on_layer_done(next_report);
      ++next_report;
    }
    return absl::OkStatus();
  };

  // Reports, in order, the layers not reported yet, each as soon as its copy has landed (while
  // the GPU still computes later layers).
  auto report_rest = [&]() -> absl::Status {
    while (next_report < config_.num_hidden_layers) {
      KV_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(copy_done_[next_report].get()));
      if (options.on_layer_done) options.on_layer_done(next_report);
      ++next_report;
    }
    return absl::OkStatus();
  };

  std::vector<float> logits;
  // Chunks of at most max_rows tokens; the last one stages and reports the layers.
  const std::vector<RowRange> chunks = PrefillChunks(n, options_.max_rows);
  for (size_t c = 0; status.ok() && c < chunks.size(); ++c) {
    const int64_t chunk = chunks[c].begin, rows = chunks[c].rows;
    const bool last = c + 1 == chunks.size();
    CudaBatch batch;
    batch.max_blocks = max_blocks;
    batch.table_groups = num_groups;
    batch.caches = mirror->caches;
    batch.tokens.assign(tokens.begin() + chunk, tokens.begin() + chunk + rows);
    for (int64_t i = 0; i < rows; ++i) batch.positions.push_back(start + chunk + i);
    batch.block_tables =
        BlockTables(std::vector<const Sequence*>(static_cast<size_t>(rows), &seq), max_blocks);
    if (options.all_logits) {
      for (int64_t i = 0; i < rows; ++i) batch.logit_rows.push_back(i);
    } else if (last) {
      batch.logit_rows.push_back(rows - 1);
    }
    status =
        model_->Enqueue(batch, last ? LayerHook(stage_layer) : LayerHook(),
                        c == 0 && options.before_layer ? LayerHook(upload_layer) : LayerHook());
    if (status.ok() && last) status = report_rest();
    if (!status.ok()) break;
    // Waits for this chunk's logits: the copy stream keeps running.
    absl::StatusOr<std::vector<float>> chunk_logits = model_->TakeLogits();
    if (!chunk_logits.ok()) {
      status = chunk_logits.status();
      break;
    }
    logits.insert(logits.end(), chunk_logits->begin(), chunk_logits->end());
  }
  if (!status.ok()) {
    Drain();
    return status;
  }
  seq.MarkUploaded();
  seq.AppendTokens(tokens);
  return logits;
}

absl::Status CudaRunner::Decode(absl::Span<Sequence* const> seqs, absl::Span<const int32_t> tokens,
                                std::vector<float>* logits, std::vector<int32_t>* ids) const {
  KV_RETURN_IF_ERROR(CheckDecodeInput(seqs, tokens, config_));
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (seqs[i]->num_tokens() + 1 > options_.max_context) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode: batch entry ", i, " would reach ", seqs[i]->num_tokens() + 1,
                       " tokens, the CUDA runner's max_context is ", options_.max_context));
    }
  }
  for (Sequence* s : seqs) KV_RETURN_IF_ERROR(s->EnsureBlocks(s->num_tokens() + 1));
  const int64_t vocab = config_.vocab_size;
  const size_t batch_size = seqs.size();
  if (logits != nullptr) logits->assign(batch_size * vocab, 0.0f);
  if (ids != nullptr) ids->assign(batch_size, 0);

  absl::MutexLock lock(&mu_);
  KV_RETURN_IF_ERROR(CheckContext());
  DeviceGuard guard(options_.device);
  absl::Status status;
  // One forward per cache (a batch runs over one set of device pools), at most max_rows rows.
  for (const std::vector<size_t>& members : DecodePasses(seqs, options_.max_rows)) {
    const KvCache& cache = seqs[members[0]]->cache();
    absl::StatusOr<std::shared_ptr<DeviceMirror>> mirror_or = MirrorFor(cache);
    if (!mirror_or.ok()) {
      status = mirror_or.status();
      break;
    }
    const std::shared_ptr<DeviceMirror> mirror = *std::move(mirror_or);
    const int num_groups = cache.num_groups();
    const int64_t bt = cache.layout().block_tokens();
    const int64_t rows = static_cast<int64_t>(members.size());
    int32_t max_blocks = 1;
    for (size_t i : members) {
      status.Update(UploadHostOnlyBlocks(*seqs[i], *mirror));
      max_blocks =
          std::max<int32_t>(max_blocks, static_cast<int32_t>(seqs[i]->num_tokens() / bt + 1));
    }
    if (!status.ok()) break;
    CudaBatch batch;
    batch.max_blocks = max_blocks;
    batch.table_groups = num_groups;
    batch.caches = mirror->caches;
    std::vector<const Sequence*> row_seqs;
    for (int64_t r = 0; r < rows; ++r) {
      const Sequence& s = *seqs[members[r]];
      row_seqs.push_back(&s);
      batch.tokens.push_back(tokens[members[r]]);
      batch.positions.push_back(s.num_tokens());
      batch.logit_rows.push_back(r);
    }
    batch.block_tables = BlockTables(row_seqs, max_blocks);
    status = model_->Enqueue(batch);
    if (!status.ok()) break;
    status = CopyDecodedEntriesToHost(*mirror, row_seqs, compute_stream());
    if (!status.ok()) break;
    // Waits for the stream: logits (or ids) and the staged entries.
    if (logits != nullptr) {
      absl::StatusOr<std::vector<float>> got = model_->TakeLogits();
      if (!got.ok()) {
        status = got.status();
        break;
      }
      for (int64_t r = 0; r < rows; ++r) {
        std::copy(got->begin() + r * vocab, got->begin() + (r + 1) * vocab,
                  logits->begin() + members[r] * vocab);
      }
    } else {
      absl::StatusOr<std::vector<int32_t>> got = model_->TakeGreedy();
      if (!got.ok()) {
        status = got.status();
        break;
      }
      for (int64_t r = 0; r < rows; ++r) (*ids)[members[r]] = (*got)[r];
    }
  }
  if (!status.ok()) {
    Drain();
    return status;
  }
  for (size_t i = 0; i < batch_size; ++i) {
    seqs[i]->MarkUploaded();
    seqs[i]->AppendTokens(tokens.subspan(i, 1));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> CudaRunner::ReadDeviceUnit(const KvCache& cache, int group,
                                                                kv::SlotId slot) const {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<CacheDeviceState> state = cache.device_state();
  auto* mirror = dynamic_cast<DeviceMirror*>(state.get());
  if (mirror == nullptr || mirror->owner != key_) {
    return absl::NotFoundError("cuda runner: this runner holds no mirror of that cache");
  }
  if (group < 0 || group >= cache.num_groups() || slot < 0 ||
      slot >= mirror->caches[group].num_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda runner: no unit at group ", group, " slot ", slot));
  }
  DeviceGuard guard(options_.device);
  const int64_t bytes = cache.layout().BlockBytes(group);
  std::vector<uint8_t> out(static_cast<size_t>(bytes));
  KV_RETURN_IF_ERROR(model_->Synchronize());
  KV_RETURN_IF_CUDA_ERROR(cudaMemcpy(
      out.data(),
      static_cast<const uint8_t*>(mirror->caches[group].base) + slot * mirror->strides[group],
      static_cast<size_t>(bytes), cudaMemcpyDeviceToHost));
  return out;
}

absl::StatusOr<std::string> NumericsId(const CudaRunnerOptions& options, int compute_capability) {
  int sms = 0;
  KV_RETURN_IF_CUDA_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options.device));
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError("cuda runner: cublasGetProperty failed");
  }
  // cuBLAS promises the same bits for the same shapes, library version, architecture and SM
  // count; the weight dtype decides the GEMM inputs' rounding.
  return absl::StrCat("cuda-", options.weight_dtype == WeightDType::kBf16 ? "bf16w" : "fp32w",
                      "-sm", compute_capability, "-", sms, "sms-cublas", major, ".", minor, ".",
                      patch);
}

absl::Status CheckOptions(const CudaRunnerOptions& options) {
  if (options.block_tokens <= 0 || options.max_rows <= 0 || options.max_context <= 0 ||
      options.device < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda runner: block_tokens, max_rows and max_context must be positive and device >= 0, "
        "got ",
        options.block_tokens, ", ", options.max_rows, ", ", options.max_context, ", ",
        options.device));
  }
  return absl::OkStatus();
}

// Refusals that need no device come first, so they read the same on every machine; then
// FailedPrecondition naming CUDA's reason when the device is not usable.
absl::StatusOr<std::string> CheckConfigAndDevice(const kv::ModelConfig& config,
                                                 const CudaRunnerOptions& options) {
  KV_RETURN_IF_ERROR(CudaModelSupports(config));
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cuda runner: no usable CUDA device: ", cudaGetErrorString(e)));
  }
  if (options.device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda runner: device ", options.device, " requested, ", count, " present"));
  }
  cudaDeviceProp props{};
  KV_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&props, options.device));
  return std::string(props.name);
}

CudaModelOptions ModelOptions(const CudaRunnerOptions& options) {
  CudaModelOptions model_options;
  model_options.weight_dtype = options.weight_dtype;
  model_options.num_blocks = 0;  // every batch runs over a cache's device mirror
  model_options.max_rows = options.max_rows;
  model_options.max_context = options.max_context;
  model_options.device = options.device;
  return model_options;
}

absl::StatusOr<std::unique_ptr<AttentionModel>> MakeRunner(kv::ModelConfig config,
                                                           std::unique_ptr<CudaModel> model,
                                                           const CudaRunnerOptions& options,
                                                           std::string device_name) {
  KV_ASSIGN_OR_RETURN(std::string numerics, NumericsId(options, model->compute_capability()));
  KV_ASSIGN_OR_RETURN(CudaStream copy_stream, CudaStream::Create(options.device));
  std::vector<CudaEvent> compute_done, copy_done;
  for (int32_t l = 0; l < config.num_hidden_layers; ++l) {
    KV_ASSIGN_OR_RETURN(CudaEvent a, CudaEvent::Create(options.device));
    KV_ASSIGN_OR_RETURN(CudaEvent b, CudaEvent::Create(options.device));
    compute_done.push_back(std::move(a));
    copy_done.push_back(std::move(b));
  }
  config.layout = config.layout.WithNumerics(numerics);
  KV_LOG(INFO) << "cuda runner: " << config.model_type << " on cuda:" << options.device << " ("
               << device_name << "), numerics " << numerics;
  return std::unique_ptr<AttentionModel>(new CudaRunner(
      std::move(config), std::move(model), options, std::move(numerics), std::move(device_name),
      std::move(copy_stream), std::move(compute_done), std::move(copy_done)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionModel>> LoadCudaRunner(const std::string& model_dir,
                                                               const CudaRunnerOptions& options) {
  KV_RETURN_IF_ERROR(CheckOptions(options));
  kv::ConfigOptions config_options;
  config_options.block_tokens = options.block_tokens;
  KV_ASSIGN_OR_RETURN(kv::ModelConfig config,
                      kv::LoadHfConfig(model_dir + "/config.json", config_options));
  return LoadCudaRunner(model_dir, std::move(config), options);
}

absl::StatusOr<std::unique_ptr<AttentionModel>> LoadCudaRunner(const std::string& model_dir,
                                                               kv::ModelConfig config,
                                                               const CudaRunnerOptions& options) {
  KV_RETURN_IF_ERROR(CheckOptions(options));
  if (config.layout.block_tokens() != options.block_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda runner: the config's layout has ", config.layout.block_tokens(),
                     "-token blocks, options say ", options.block_tokens));
  }
  KV_ASSIGN_OR_RETURN(std::string device_name, CheckConfigAndDevice(config, options));
  KV_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsModel> files, SafetensorsModel::Open(model_dir));
  KV_ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(*files, config));
  KV_ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model,
                      CudaModel::Create(config, weights, ModelOptions(options)));
  return MakeRunner(std::move(config), std::move(model), options, std::move(device_name));
}

absl::StatusOr<std::unique_ptr<AttentionModel>> CreateRandomCudaRunner(
    const kv::ModelConfig& config, uint64_t seed, const CudaRunnerOptions& options) {
  KV_RETURN_IF_ERROR(CheckOptions(options));
  if (config.layout.block_tokens() != options.block_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda runner: the config's layout has ", config.layout.block_tokens(),
                     "-token blocks, options say ", options.block_tokens));
  }
  KV_ASSIGN_OR_RETURN(std::string device_name, CheckConfigAndDevice(config, options));
  KV_ASSIGN_OR_RETURN(std::unique_ptr<CudaModel> model,
                      CudaModel::CreateRandom(config, seed, ModelOptions(options)));
  return MakeRunner(config, std::move(model), options, std::move(device_name));
}

absl::StatusOr<std::vector<uint8_t>> ReadDeviceUnitForTest(const AttentionModel& model,
                                                           const KvCache& cache, int group,
                                                           kv::SlotId slot) {
  const auto* runner = dynamic_cast<const CudaRunner*>(&model);
  if (runner == nullptr) return absl::InvalidArgumentError("not a CUDA runner");
  return runner->ReadDeviceUnit(cache, group, slot);
}

}  // namespace kvrelay::model::cuda
