#include "prefill/prefill_worker.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/block_hash.h"
#include "kv/prompt_validation.h"
#include "prefill/prefix_source.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"

namespace kvrelay::prefill {
namespace {

using ::kvrelay::proto::Attribute;

// Bad input from the caller: never the worker's fault, never worth a retry elsewhere.
absl::Status CallerError(absl::Status status) {
  return Attribute(std::move(status), kvrelay::v1::ROLE_CLIENT, "",
                   kvrelay::v1::FAILURE_INVALID_REQUEST);
}

// Frees slots a request took before its sequence adopted them.
void ReleaseSlots(model::KvCache& cache, const std::vector<std::vector<kv::SlotId>>& slots) {
  for (size_t g = 0; g < slots.size(); ++g) {
    for (kv::SlotId s : slots[g]) (void)cache.pool(static_cast<int>(g)).Release(s);
  }
}

}  // namespace

PrefillWorker::PrefillWorker(PrefillWorkerOptions options, MetricsRegistry* metrics)
    : options_(std::move(options)),
      metrics_(metrics),
      model_labels_({{"model_name", options_.model_name}}),
      push_metrics_(metrics_, model_labels_) {
  prefix_query_tokens_ = metrics_->GetCounter(
      "kvrelay:prefix_cache_queries_total",
      "Prefix cache queries, in terms of number of queried tokens (full blocks).", model_labels_);
  prefix_hit_tokens_ = metrics_->GetCounter(
      "kvrelay:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
      model_labels_);
  layers_during_disk_read_ = metrics_->GetCounter(
      "kvrelay:prefill_layers_during_disk_read_total",
      "layers computed while the prefix read back from the disk tier was still being read "
      "(layer-wise promotion)",
      model_labels_);
  computed_tokens_ = metrics_->GetCounter("kvrelay:prefill_computed_tokens_total",
                                          "Prompt tokens computed.", model_labels_);
  pushed_tokens_ = metrics_->GetCounter(
      "kvrelay:prefill_pushed_kv_tokens_total",
      "Prompt tokens whose KV was pushed to decode workers (full blocks the decode worker did not "
      "hold already); kvrelay:prefill_pushed_kv_bytes_total over it is the bytes moved per token.",
      model_labels_);
  prefill_seconds_ =
      metrics_->GetHistogram("kvrelay:prefill_request_seconds", "Whole prefill requests.",
                             LatencyBucketsSeconds(), model_labels_);
  running_ = metrics_->GetGauge("kvrelay:num_requests_running",
                                "Requests being prefilled or pushed.", model_labels_);
  waiting_ = metrics_->GetGauge("kvrelay:num_requests_waiting",
                                "Requests waiting for the model (one forward pass at a time).",
                                model_labels_);
  MetricLabels queue_labels = model_labels_;
  queue_labels["reason"] = "queue";
  refused_queue_ = metrics_->GetCounter(
      "kvrelay:prefill_refused_total",
      "Requests refused at admission (RESOURCE_EXHAUSTED), by reason: queue = their predicted "
      "start was past their deadline.",
      queue_labels);
}

absl::StatusOr<std::unique_ptr<PrefillWorker>> PrefillWorker::Create(PrefillWorkerOptions options,
                                                                     MetricsRegistry* metrics,
                                                                     worker::WorkerCoreDeps deps) {
  auto worker = std::unique_ptr<PrefillWorker>(new PrefillWorker(std::move(options), metrics));
  KV_RETURN_IF_ERROR(worker->Init(std::move(deps)));
  return worker;
}

absl::Status PrefillWorker::Own(absl::Status status, kvrelay::v1::FailureReason reason) const {
  kvrelay::v1::ErrorInfo info;
  info.set_role(kvrelay::v1::ROLE_PREFILL);
  info.set_node_id(core_->node_id);
  info.set_incarnation(core_->incarnation);
  info.set_reason(reason);
  return proto::WithErrorInfo(std::move(status), info);
}

bool PrefillWorker::Drain(absl::Time deadline) {
  draining_.store(true);
  return core_->DrainAndLeave([this] { return calls_.load() == 0; }, deadline);
}

PrefillWorker::~PrefillWorker() {
  kv_metrics_.reset();  // its usage function reads kv_
  // The transport's threads call OnInbound until the handler is replaced (the replacement waits
  // for a running call): before any member it touches is destroyed.
  if (transport_ != nullptr) transport_->SetInboundHandler(nullptr);
}

absl::Status PrefillWorker::Init(worker::WorkerCoreDeps deps) {
  if (options_.core.cachestore_address.empty()) {
    return absl::InvalidArgumentError("--cachestore is required");
  }
  if (deps.metrics == nullptr) {  // the store link's gate
    deps.metrics = metrics_;
    deps.metric_labels = model_labels_;
  }
  KV_ASSIGN_OR_RETURN(
      core_, worker::WorkerCore::Create(
                 options_.core, [this](transfer::InboundEvent e) { OnInbound(std::move(e)); },
                 std::move(deps)));
  runner_ = core_->runner.get();
  mamba_ = core_->mamba.get();
  transport_ = core_->transport.get();
  kv_ = core_->kv.get();
  segment_ = core_->segment.get();
  queue_ = std::make_unique<PrefillQueue>(&prefill_rate_, core_->node_id);
  peers_ = std::make_unique<PeerCache>(transport_);
  KV_ASSIGN_OR_RETURN(puller_,
                      PrefixPuller::Create({.enabled = options_.pull_remote_prefix,
                                            .fetch_timeout = options_.fetch_timeout,
                                            .reprobe_interval = options_.fetch_reprobe_interval},
                                           {.transport = transport_,
                                            .peers = peers_.get(),
                                            .kv = kv_,
                                            .segment = segment_,
                                            .compute_rate = &prefill_rate_,
                                            .metrics = metrics_,
                                            .labels = model_labels_}));
  worker::CacheConfigInfo info;
  info.role = "prefill";
  info.layout = &model_config().layout;
  info.pool_blocks = options_.core.pool_blocks;
  info.cache_slots = segment_ != nullptr ? segment_->num_slots() : 0;
  info.prefix_caching = true;
  info.device = core_->device.Label();
  info.device_name = core_->device.name;
  kv_metrics_ = std::make_unique<worker::KvCacheMetrics>(
      metrics_, model_labels_, info, [kv = kv_] { return worker::FullestPoolUsage(kv->cache()); });
  MeasureComputeRate();
  return absl::OkStatus();
}

void PrefillWorker::MeasureComputeRate() {
  if (runner_ == nullptr) return;  // Mamba: its state is not queued by tokens
  const kv::ModelConfig& config = model_config();
  const int32_t block = config.layout.block_tokens();
  int64_t measured = 4 * int64_t{block};
  if (config.max_position_embeddings > 0) {
    measured = std::min<int64_t>(measured, config.max_position_embeddings - 1);
  }
  if (measured < 1 || config.vocab_size < 1) return;
  std::vector<int32_t> tokens(static_cast<size_t>(measured));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(config.vocab_size));
  }
  absl::MutexLock lock(&compute_mu_);
  // The first pass pays the weights' first touch (a GPU's kernel loading); the second is timed.
  for (int pass = 0; pass < 2; ++pass) {
    const size_t n = pass == 0 ? std::min<size_t>(tokens.size(), block) : tokens.size();
    model::Sequence seq(&kv_->cache());
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<float>> logits =
        runner_->Prefill(seq, absl::MakeConstSpan(tokens.data(), n), model::PrefillOptions());
    if (!logits.ok()) {
      KV_LOG(WARNING) << "prefill node " << core_->node_id
                      << ": could not measure its compute rate at start (" << logits.status()
                      << "); admission admits everything until a request has measured it";
      return;
    }
    if (pass == 1) {
      prefill_rate_.Observe(static_cast<double>(n), absl::ToDoubleSeconds(absl::Now() - start),
                            absl::Now());
    }
  }
  KV_LOG(INFO) << "prefill node " << core_->node_id << ": compute rate at start "
               << static_cast<int64_t>(prefill_rate_.rate()) << " prompt tokens/s ("
               << tokens.size() << " tokens)";
}

absl::Status PrefillWorker::Validate(const kvrelay::v1::PrefillRequest& request) const {
  const kv::ModelLayout& layout = model_config().layout;
  if (!options_.model_name.empty() && request.model() != options_.model_name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: this worker serves '", options_.model_name, "', not '", request.model(), "'"));
  }
  KV_RETURN_IF_ERROR(kv::ValidatePrompt(request.tokens(), /*max_tokens=*/-1, model_config()));
  const int n = request.tokens_size();
  if (request.tenant_salt().size() > limits::kMaxTenantSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tenant_salt is over ", limits::kMaxTenantSaltBytes, " bytes"));
  }
  const kvrelay::v1::ReserveResponse& target = request.target();
  if (target.reservation_token().size() > transfer::kMaxCredentialBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("target.reservation_token is over ", transfer::kMaxCredentialBytes, " bytes"));
  }
  if (target.data_plane_key().size() > transfer::kMaxPeerKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("target.data_plane_key is over ", transfer::kMaxPeerKeyBytes, " bytes"));
  }
  if (target.block_tokens() != layout.block_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("target.block_tokens ", target.block_tokens(),
                                                   " != this model's ", layout.block_tokens()));
  }
  if (target.full_blocks() < 0 || int64_t{target.full_blocks()} * layout.block_tokens() > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("target.full_blocks ", target.full_blocks(), " exceeds the prompt"));
  }
  if (target.groups_size() != static_cast<int>(layout.groups().size())) {
    return absl::InvalidArgumentError(absl::StrCat("target.groups has ", target.groups_size(),
                                                   " entries, the layout ",
                                                   layout.groups().size()));
  }
  if (target.held_blocks() < 0 || target.held_blocks() > target.full_blocks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("target.held_blocks ", target.held_blocks(), " is outside [0, full_blocks]"));
  }
  for (int g = 0; g < target.groups_size(); ++g) {
    const auto& group = target.groups(g);
    for (int b = 0; b < target.held_blocks() && b < group.slots_size(); ++b) {
      if (group.slots(b) >= 0) {
        return absl::InvalidArgumentError(absl::StrCat("target.groups[", g, "].slots[", b,
                                                       "]: a held block has no slot to push into"));
      }
    }
    if (group.slots_size() != target.full_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("target.groups[", g, "].slots must have full_blocks entries"));
    }
    if (group.runs_size() > group.slots_size()) {
      return absl::InvalidArgumentError(absl::StrCat("target.groups[", g, "].runs has ",
                                                     group.runs_size(), " entries, more than ",
                                                     "its slots"));
    }
    for (int i = 0; i < group.runs_size(); ++i) {
      const kvrelay::v1::SlotRun& run = group.runs(i);
      if (run.first_slot() < 0 || run.slot_count() < 1 || run.slot_count() > group.slots_size() ||
          run.memory_key().size() > transfer::kMaxExportedRegionBytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "target.groups[", g, "].runs[", i, "]: want first_slot >= 0, slot_count in [1, ",
            group.slots_size(), "] and a memory_key of at most ", transfer::kMaxExportedRegionBytes,
            " bytes"));
      }
    }
    if (group.block_bytes() != static_cast<uint64_t>(layout.BlockBytes(g))) {
      return absl::InvalidArgumentError(
          absl::StrCat("target.groups[", g, "].block_bytes ", group.block_bytes(), " != layout's ",
                       layout.BlockBytes(g), " (different model or dtype?)"));
    }
  }
  return absl::OkStatus();
}

PushContext PrefillWorker::push_context() {
  return {.transport = transport_,
          .peers = peers_.get(),
          .verdicts = &verdicts_,
          .metrics = &push_metrics_,
          .transfer_timeout = options_.transfer_timeout};
}

void PrefillWorker::OnInbound(transfer::InboundEvent event) {
  // The only inbound traffic a prefill worker expects: verdicts on its push claims.
  verdicts_.OnInbound(event);
}

absl::Status PrefillWorker::CheckRequest(const kvrelay::v1::PrefillRequest& request) const {
  // The layout (model, dtype, block size, groups) the caller hashed for, this worker's and the
  // target's must be one and the same, or blocks would be read as another layout's.
  const std::string own_fingerprint = model_config().layout.fingerprint().ToBytes();
  if (request.layout_fingerprint() != own_fingerprint) {
    return Own(
        absl::FailedPreconditionError(absl::StrCat(
            "layout_fingerprint: prefill node ", core_->node_id, " serves ",
            kv::LayoutMismatch(model_config().layout, "request's", request.layout_description()))),
        kvrelay::v1::FAILURE_IDENTITY);
  }
  if (request.target().layout_fingerprint() != own_fingerprint) {
    return Attribute(
        absl::FailedPreconditionError(absl::StrCat(
            "target.layout_fingerprint: prefill node ", core_->node_id, " serves ",
            kv::LayoutMismatch(model_config().layout,
                               absl::StrCat("target decode node ",
                                            request.target().node_id().substr(0, 128), "'s"),
                               request.target().layout_description()))),
        kvrelay::v1::ROLE_DECODE, request.target().node_id(), kvrelay::v1::FAILURE_IDENTITY,
        request.target().transport().address());
  }
  // After the layouts: a target of another layout fails the shape checks too, but the layouts
  // say why.
  if (absl::Status s = Validate(request); !s.ok()) return CallerError(std::move(s));
  return absl::OkStatus();
}

absl::StatusOr<kvrelay::v1::PrefillResponse> PrefillWorker::Run(
    const kvrelay::v1::PrefillRequest& request, absl::Time deadline) {
  calls_.fetch_add(1);
  absl::Cleanup counted = [this] { calls_.fetch_sub(1); };
  if (draining_.load()) {
    return Own(
        absl::UnavailableError(absl::StrCat("prefill node ", core_->node_id, " is draining")),
        kvrelay::v1::FAILURE_DRAINING);
  }
  KV_RETURN_IF_ERROR(CheckRequest(request));
  // Admission: what cannot start before its deadline behind the tokens queued here is refused
  // now, before any lookup or lease (an upper bound: a reused prefix is computed faster).
  const int64_t to_compute = std::max<int64_t>(
      0, int64_t{request.target().full_blocks() - request.target().held_blocks()} *
             model_config().layout.block_tokens());
  absl::Duration may_wait = deadline - absl::Now();
  if (options_.max_queue_wait > absl::ZeroDuration()) {
    may_wait = std::min(may_wait, options_.max_queue_wait);
  }
  absl::StatusOr<PrefillQueue::Ticket> queued = queue_->Admit(to_compute, may_wait);
  if (!queued.ok()) {
    refused_queue_->Increment();
    return queued.status();
  }
  const absl::Time start = core_->clock->Now();
  running_->Add(1);
  absl::Cleanup not_running = [this] { running_->Add(-1); };
  if (mamba_ != nullptr) return RunMamba(request, deadline, start);
  return RunKv(request, deadline, start);
}

absl::StatusOr<kvrelay::v1::PrefillResponse> PrefillWorker::RunKv(
    const kvrelay::v1::PrefillRequest& request, absl::Time deadline, absl::Time start) {
  const kv::ModelLayout& layout = model_config().layout;
  const int32_t block_tokens = layout.block_tokens();
  const int64_t full_blocks = request.target().full_blocks();
  const int64_t full_tokens = full_blocks * block_tokens;
  kvrelay::v1::PrefillResponse response;
  response.set_pushed_tokens(static_cast<int32_t>(full_tokens));
  response.set_prefix_source("none");
  if (full_blocks == 0) return response;  // the decode worker computes short prompts itself
  if (request.target().held_blocks() >= full_blocks) {
    return HeldByDecode(std::move(response), full_tokens);
  }
  const std::vector<int32_t> all_tokens(request.tokens().begin(), request.tokens().end());
  const auto tokens = absl::MakeConstSpan(all_tokens).subspan(0, static_cast<size_t>(full_tokens));

  // 1. Which leading blocks are cached here, or elsewhere.
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PrefixLookup> lookup,
                      LookUpPrefix(request, layout, all_tokens, full_tokens, deadline));
  // 2. The request's sequence: reused blocks copied or pulled in, slots for the rest allocated
  //    now so the whole transfer plan can be prepared before computing. Declared before the
  //    push: its slots stay allocated until the push's transfers are terminal.
  model::Sequence seq(&kv_->cache());
  KV_ASSIGN_OR_RETURN(ReusedPrefix reused, ReusePrefix(request, *lookup, tokens, deadline, seq));
  KV_RETURN_IF_ERROR(seq.EnsureBlocks(full_tokens));

  // 3. One slice per (group, wanted block, layer), claimed before anything is written.
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PushSession> push, PlanKvPush(request, seq, deadline));
  // 4. Compute the rest; each finished layer goes on the wire while the next computes.
  int64_t compute_from = reused.blocks() * block_tokens;
  bool disk_failed = false;
  absl::Status computed = ComputeAndPush(seq, tokens, compute_from, *push, reused.disk_read.get(),
                                         deadline, &disk_failed);
  if (disk_failed && absl::Now() < deadline) {
    // A stage of the disk read failed verification or I/O: its blocks, and those pulled after
    // them, are computed here instead (the same slots; nothing was posted yet).
    KV_LOG(WARNING) << request.request_id() << ": disk tier read failed (" << computed
                    << "); recomputing " << reused.blocks() - reused.hit_blocks << " blocks";
    reused.disk_read.reset();
    reused.disk_blocks = 0;
    reused.pulled = PulledPrefix{.attempted = reused.pulled.attempted};
    compute_from = reused.hit_blocks * block_tokens;
    computed = seq.Rewind(compute_from);
    disk_failed = false;
    if (computed.ok()) {
      computed = ComputeAndPush(seq, tokens, compute_from, *push, nullptr, deadline, &disk_failed);
    }
  }
  KV_RETURN_IF_ERROR(computed);
  reused.disk_read.reset();
  prefix_hit_tokens_->Increment(static_cast<double>(reused.disk_blocks * block_tokens));
  const PulledPrefix& pulled = reused.pulled;
  response.set_prefix_source(PrefixSourceName({.matched = lookup->match.matched,
                                               .hit_blocks = reused.hit_blocks,
                                               .disk_blocks = reused.disk_blocks,
                                               .pulled_blocks = pulled.blocks,
                                               .pull_attempted = pulled.attempted}));
  response.set_fetched_bytes(static_cast<int64_t>(pulled.bytes));
  response.set_fetched_tokens(static_cast<int32_t>(pulled.blocks * block_tokens));
  response.set_estimated_pull_ms(pulled.decision.pull_seconds * 1e3);
  response.set_estimated_recompute_ms(pulled.decision.recompute_seconds * 1e3);
  KV_ASSIGN_OR_RETURN(const int64_t pushed, push->Finish());
  pushed_tokens_->Increment(
      static_cast<double>((full_blocks - request.target().held_blocks()) * block_tokens));

  // 5. Publish the blocks computed here for later requests, and keep a copy of those pulled or
  //    recomputed although held elsewhere (the next request for them here is local).
  //    Not when the gateway found the store not answering (the commit would wait for it
  //    before this request's answer), nor for a link canary's synthetic prompt.
  const int32_t committed =
      request.skip_store_lookup()
          ? 0
          : CommitKv(request.request_id(), *lookup, reused.hit_blocks, full_blocks, seq);

  // 6. Respond.
  computed_tokens_->Increment(static_cast<double>(full_tokens - compute_from));
  prefill_seconds_->Observe(absl::ToDoubleSeconds(core_->clock->Now() - start));
  response.set_prefix_hit_tokens(static_cast<int32_t>(compute_from));
  response.set_computed_tokens(static_cast<int32_t>(full_tokens - compute_from));
  response.set_pushed_bytes(pushed);
  response.set_committed_blocks(committed);
  return response;
}

kvrelay::v1::PrefillResponse PrefillWorker::HeldByDecode(kvrelay::v1::PrefillResponse response,
                                                         int64_t full_tokens) {
  response.set_prefix_source("decode");
  response.set_prefix_hit_tokens(static_cast<int32_t>(full_tokens));
  prefix_query_tokens_->Increment(static_cast<double>(full_tokens));
  prefix_hit_tokens_->Increment(static_cast<double>(full_tokens));
  return response;
}

absl::StatusOr<std::unique_ptr<PrefillWorker::PrefixLookup>> PrefillWorker::LookUpPrefix(
    const kvrelay::v1::PrefillRequest& request, const kv::ModelLayout& layout,
    absl::Span<const int32_t> tokens, int64_t full_tokens, absl::Time deadline) {
  std::vector<kv::BlockHash> chain =
      kv::HashChain(layout.fingerprint(), request.tenant_salt(),
                    tokens.subspan(0, static_cast<size_t>(full_tokens)), layout.block_tokens());
  prefix_query_tokens_->Increment(static_cast<double>(full_tokens));
  worker::StoreLink* store = store_.load(std::memory_order_acquire);
  if (store == nullptr) {
    return Own(absl::UnavailableError(absl::StrCat("prefill node ", core_->node_id,
                                                   " is not registered with the cache store yet")),
               kvrelay::v1::FAILURE_UNREACHABLE);
  }
  if (request.skip_store_lookup()) {
    // The gateway waited for the store on this request already and got no answer: waiting
    // again here would double what a hung store costs the request.
    KV_LOG(DEBUG) << request.request_id() << ": the store did not answer the gateway; no lookup";
    return std::make_unique<PrefixLookup>(std::move(chain), worker::PrefixMatch{}, store, deadline);
  }
  absl::StatusOr<worker::PrefixMatch> match =
      store->MatchPrefix(chain, options_.lease_ttl, deadline);
  if (!match.ok()) {
    KV_LOG(WARNING) << request.request_id() << ": MatchPrefix failed (" << match.status()
                    << "); computing everything";
    match = worker::PrefixMatch{};
  }
  return std::make_unique<PrefixLookup>(std::move(chain), *std::move(match), store, deadline);
}

absl::StatusOr<PrefillWorker::ReusedPrefix> PrefillWorker::ReusePrefix(
    const kvrelay::v1::PrefillRequest& request, const PrefixLookup& lookup,
    absl::Span<const int32_t> tokens, absl::Time deadline, model::Sequence& seq) {
  const worker::PrefixMatch& match = lookup.match;
  const int32_t block_tokens = kv_->cache().layout().block_tokens();
  const int64_t full_blocks = static_cast<int64_t>(tokens.size()) / block_tokens;
  ReusedPrefix reused;
  while (reused.hit_blocks < static_cast<int64_t>(match.local_slots.size()) &&
         match.local_slots[reused.hit_blocks] >= 0) {
    ++reused.hit_blocks;
  }
  // Counted with the query, so hits / queries is the lookups' hit rate (as vLLM's).
  prefix_hit_tokens_->Increment(static_cast<double>(reused.hit_blocks * block_tokens));
  std::vector<std::vector<kv::SlotId>> slots;
  for (int64_t b = 0; b < reused.hit_blocks; ++b) {
    absl::Status loaded = segment_->LoadBlock(match.local_slots[b], kv_->cache(), slots);
    if (!loaded.ok()) {
      ReleaseSlots(kv_->cache(), slots);
      return loaded;
    }
  }
  // Blocks on this node's disk after those in its DRAM: read back (promoted) layer stage by
  // layer stage while the rest goes on, each stage verified before it is used.
  reused.disk_blocks = PromoteFromDisk(lookup.chain, reused.hit_blocks, full_blocks,
                                       request.request_id(), deadline, slots, reused.disk_read);
  // Blocks held on other nodes after ours: pulled, or recomputed when that is cheaper.
  reused.pulled = puller_->Pull(match, lookup.chain, reused.hit_blocks + reused.disk_blocks,
                                full_blocks, request.request_id(), deadline, slots);
  if (reused.blocks() > 0) {
    // A copy: on failure the slots are still ours to release (after the disk read stopped
    // writing into them).
    absl::Status adopted = seq.AdoptPrefix(
        tokens.subspan(0, static_cast<size_t>(reused.blocks() * block_tokens)), slots);
    if (!adopted.ok()) {
      reused.disk_read.reset();
      ReleaseSlots(kv_->cache(), slots);
      return Own(adopted, kvrelay::v1::FAILURE_COMPUTE);
    }
  }
  return reused;
}

int64_t PrefillWorker::PromoteFromDisk(const std::vector<kv::BlockHash>& chain, int64_t first,
                                       int64_t wanted_end, const std::string& request_id,
                                       absl::Time deadline,
                                       std::vector<std::vector<kv::SlotId>>& slots,
                                       std::unique_ptr<worker::DiskCache::StagedRead>& read) {
  worker::DiskCache* disk = core_->disk.get();
  if (disk == nullptr || segment_ == nullptr || first >= wanted_end) return 0;
  const int64_t run = std::min(
      disk->HeldRun(absl::MakeConstSpan(chain).subspan(0, wanted_end), first), wanted_end - first);
  if (run <= 0) return 0;
  const int32_t block_tokens = kv_->cache().layout().block_tokens();
  // An SSD slower than this node's compute is not read: its blocks are recomputed.
  const kv::PullOrRecompute decision = worker::ChooseDiskOrRecompute(
      static_cast<uint64_t>(run) * segment_->block_bytes(), run * block_tokens,
      disk->read_bytes_per_second(), prefill_rate_.rate());
  if (decision.choice == kv::ReuseChoice::kRecompute) {
    KV_LOG(INFO) << request_id << ": " << run << " blocks on disk recomputed (read "
                 << decision.pull_seconds * 1e3 << " ms vs compute "
                 << decision.recompute_seconds * 1e3 << " ms)";
    return 0;
  }
  // The tier thread writes each stage straight into the request's KV slots: no staging copy.
  model::KvCache& cache = kv_->cache();
  std::vector<std::vector<kv::SlotId>> disk_slots;
  std::vector<std::vector<kv::DiskTier::Destination>> places;
  for (int64_t b = 0; b < run; ++b) {
    absl::StatusOr<std::vector<kv::DiskTier::Destination>> block =
        worker::AllocateBlockDestinations(*segment_, cache, disk_slots);
    if (!block.ok()) break;  // the pool is full: fewer blocks are read, the rest computed
    places.push_back(*std::move(block));
  }
  const size_t allocated = places.size();
  absl::StatusOr<std::unique_ptr<worker::DiskCache::StagedRead>> started =
      disk->ReadStaged(absl::MakeConstSpan(chain).subspan(static_cast<size_t>(first), allocated),
                       std::move(places), deadline);
  const int64_t reading = started.ok() ? (*started)->blocks() : 0;
  if (!started.ok()) {
    KV_LOG(WARNING) << request_id << ": disk tier read not started (" << started.status()
                    << "); recomputing";
  }
  // Slots of blocks not being read (no longer listed, or no read at all) go back now.
  for (size_t g = 0; g < disk_slots.size(); ++g) {
    for (size_t b = static_cast<size_t>(reading); b < disk_slots[g].size(); ++b) {
      cache.pool(static_cast<int>(g)).Release(disk_slots[g][b]).IgnoreError();
    }
    disk_slots[g].resize(static_cast<size_t>(reading));
  }
  if (reading == 0) return 0;
  slots.resize(disk_slots.size());
  for (size_t g = 0; g < disk_slots.size(); ++g) {
    slots[g].insert(slots[g].end(), disk_slots[g].begin(), disk_slots[g].end());
  }
  read = *std::move(started);
  return reading;
}

absl::StatusOr<std::unique_ptr<PushSession>> PrefillWorker::PlanKvPush(
    const kvrelay::v1::PrefillRequest& request, const model::Sequence& seq, absl::Time deadline) {
  const kvrelay::v1::ReserveResponse& target = request.target();
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PushSession> push,
                      PushSession::Open(push_context(), request.request_id(), target, deadline));
  const model::KvCache& cache = kv_->cache();
  for (int32_t layer = 0; layer < cache.layout().num_layers(); ++layer) {
    const int g = cache.group_of_layer(layer);
    const worker::LayerSlice slice = worker::SliceOfLayer(cache.layout(), cache, layer);
    for (int64_t b = 0; b < target.full_blocks(); ++b) {
      const int64_t remote_slot = target.groups(g).slots(static_cast<int>(b));
      if (remote_slot < 0) continue;  // not wanted, or held by the decode worker
      KV_RETURN_IF_ERROR(push->AddSlice(
          {.group = g,
           .local = &kv_->region(g),
           .local_offset = static_cast<uint64_t>(seq.blocks(g)[b]) * cache.pool(g).slot_stride() +
                           slice.offset_in_unit,
           .remote_slot = remote_slot,
           .offset_in_unit = slice.offset_in_unit,
           .length = slice.length,
           .layer = layer}));
    }
  }
  KV_RETURN_IF_ERROR(push->Claim());
  return push;
}

absl::Status PrefillWorker::ComputeAndPush(model::Sequence& seq, absl::Span<const int32_t> tokens,
                                           int64_t compute_from, PushSession& push,
                                           worker::DiskCache::StagedRead* disk_read,
                                           absl::Time deadline, bool* disk_failed) {
  const int64_t end = static_cast<int64_t>(tokens.size());
  const int32_t num_layers = kv_->cache().layout().num_layers();
  const std::vector<int>& stage_of_layer = core_->disk_stages.stage_of_layer;
  const int last_stage = disk_read == nullptr ? 0 : stage_of_layer.back();
  // Waits for the disk read to reach `stage`; a failure is the disk's (structured, for the
  // caller), not the compute's.
  absl::Duration disk_wait;
  auto wait_for = [&](int stage) -> absl::Status {
    const absl::Time waiting = absl::Now();
    absl::Status read = disk_read->WaitForStage(stage, deadline);
    disk_wait += absl::Now() - waiting;
    if (!read.ok()) *disk_failed = true;
    return read;
  };
  if (compute_from >= end) {
    // Everything was reused: the whole push goes at once, once every byte of it verified.
    if (disk_read != nullptr) KV_RETURN_IF_ERROR(wait_for(last_stage));
    for (int32_t layer = 0; layer < num_layers; ++layer) {
      push.Post(transfer::LayerRange::One(layer));
    }
    return absl::OkStatus();
  }
  // Layers computed while the disk read goes on are posted only once all of it verified: a
  // stage that fails later makes the caller compute the read blocks again, and no byte that
  // might be computed again may be on the wire already.
  std::vector<int32_t> unposted;
  bool read_verified = disk_read == nullptr;
  model::PrefillOptions prefill_options;
  prefill_options.on_layer_done = [&](int32_t layer) {
    if (!read_verified) {
      unposted.push_back(layer);
      return;
    }
    push.Post(transfer::LayerRange::One(layer));
  };
  if (disk_read != nullptr) {
    prefill_options.before_layer = [&](int32_t layer) -> absl::Status {
      const int stage = stage_of_layer[static_cast<size_t>(layer)];
      KV_RETURN_IF_ERROR(wait_for(stage));
      // This layer computes while later ones are still being read.
      if (disk_read->stages_done() <= last_stage) layers_during_disk_read_->Increment();
      if (stage == last_stage && !read_verified) {
        read_verified = true;
        for (int32_t done : unposted) push.Post(transfer::LayerRange::One(done));
        unposted.clear();
      }
      return absl::OkStatus();
    };
    // The first stage is waited for before taking the compute: another request computes
    // meanwhile.
    KV_RETURN_IF_ERROR(wait_for(0));
  }
  running_->Add(-1);
  waiting_->Add(1);
  absl::MutexLock lock(&compute_mu_);
  const absl::Time compute_start = absl::Now();
  const absl::Duration waited_before = disk_wait;
  waiting_->Add(-1);
  running_->Add(1);
  absl::StatusOr<std::vector<float>> logits =
      runner_->Prefill(seq, tokens.subspan(static_cast<size_t>(compute_from)), prefill_options);
  if (!logits.ok()) {
    return *disk_failed ? logits.status() : Own(logits.status(), kvrelay::v1::FAILURE_COMPUTE);
  }
  if (!read_verified) {
    // Only if a runner skipped before_layer: never post unverified bytes.
    KV_RETURN_IF_ERROR(wait_for(last_stage));
    for (int32_t done : unposted) push.Post(transfer::LayerRange::One(done));
  }
  // Layer-wise posting overlaps the pushes with compute, so this is compute time (less what
  // it waited for the disk).
  prefill_rate_.Observe(
      static_cast<double>(end - compute_from),
      absl::ToDoubleSeconds(absl::Now() - compute_start - (disk_wait - waited_before)),
      absl::Now());
  return absl::OkStatus();
}

int32_t PrefillWorker::CommitKv(const std::string& request_id, const PrefixLookup& lookup,
                                int64_t first, int64_t last, const model::Sequence& seq) {
  absl::StatusOr<int32_t> committed =
      lookup.store().CommitBlocks(lookup.chain, first, last, seq, lookup.deadline,
                                  /*keep_copies=*/true);
  if (!committed.ok()) {
    KV_LOG(WARNING) << request_id << ": commit failed: " << committed.status();
    return 0;
  }
  return *committed;
}

absl::Status PrefillWorker::ConnectStore(const std::string& grpc_address) {
  KV_RETURN_IF_ERROR(core_->ConnectStore(grpc_address, [this] {
    kvrelay::v1::NodeLoad load;
    load.set_active_requests(static_cast<int64_t>(running_->value() + waiting_->value()));
    return load;
  }));
  store_.store(core_->store.get(), std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<kvrelay::v1::PromoteResponse> PrefillWorker::Promote(
    const kvrelay::v1::PromoteRequest& request, absl::Time deadline) {
  return core_->Promote(request, kvrelay::v1::ROLE_PREFILL, deadline);
}

kvrelay::v1::PrefillStatusResponse PrefillWorker::Describe() const {
  kvrelay::v1::PrefillStatusResponse response;
  response.set_model(options_.model_name);
  response.set_node_id(core_->node_id);
  response.set_incarnation(core_->incarnation);
  response.set_active_requests(static_cast<int32_t>(running_->value() + waiting_->value()));
  response.set_computed_tokens_total(static_cast<int64_t>(computed_tokens_->value()));
  response.set_prefix_hit_tokens_total(static_cast<int64_t>(prefix_hit_tokens_->value()));
  response.set_layout_fingerprint(model_config().layout.fingerprint().ToBytes());
  response.set_layout_description(model_config().layout.Describe());
  response.set_draining(draining_.load());
  if (puller_ != nullptr) {
    for (const auto& [holder, rate] : puller_->LinkRates()) {
      kvrelay::v1::LinkRate* link = response.add_link_rates();
      link->set_holder_address(holder);
      link->set_bytes_per_second(rate);
    }
  }
  response.set_compute_tokens_per_second(prefill_rate_.rate());
  return response;
}

}  // namespace kvrelay::prefill
