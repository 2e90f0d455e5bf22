#include "prefill/prefill_worker.h"

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/block_hash.h"
#include "kv/prompt_validation.h"
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

// Why a push to a decode worker failed, from the status code alone (never its text): the
// `reason` label of kvrelay:kv_transfer_failures_total.
const char* TransferFailureReason(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
      return "timeout";
    case absl::StatusCode::kUnavailable:
      return "peer_lost";
    case absl::StatusCode::kDataLoss:
      return "corrupt";
    case absl::StatusCode::kCancelled:
      return "cancelled";
    case absl::StatusCode::kPermissionDenied:
      return "refused";
    default:
      return "error";
  }
}

}  // namespace

PrefillWorker::PrefillWorker(PrefillWorkerOptions options, MetricsRegistry* metrics)
    : options_(std::move(options)),
      metrics_(metrics),
      model_labels_({{"model_name", options_.model_name}}) {
  prefix_query_tokens_ = metrics_->GetCounter(
      "kvrelay:prefix_cache_queries_total",
      "Prefix cache queries, in terms of number of queried tokens (full blocks).", model_labels_);
  prefix_hit_tokens_ = metrics_->GetCounter(
      "kvrelay:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
      model_labels_);
  computed_tokens_ = metrics_->GetCounter("kvrelay:prefill_computed_tokens_total",
                                          "Prompt tokens computed.", model_labels_);
  pushed_bytes_ = metrics_->GetCounter("kvrelay:prefill_pushed_kv_bytes_total",
                                       "KV bytes pushed to decode workers.", model_labels_);
  transfer_seconds_ = metrics_->GetHistogram(
      "kvrelay:kv_transfer_time_seconds",
      "Histogram of transfer duration of KV pushes to decode workers (first layer posted to "
      "last layer delivered).",
      KvTransferTimeBucketsSeconds(), model_labels_);
  transfer_bytes_ = metrics_->GetHistogram(
      "kvrelay:kv_transfer_bytes", "Histogram of bytes transferred per KV push to a decode worker.",
      KvTransferBytesBuckets(), model_labels_);
  prefill_seconds_ =
      metrics_->GetHistogram("kvrelay:prefill_request_seconds", "Whole prefill requests.",
                             LatencyBucketsSeconds(), model_labels_);
  running_ = metrics_->GetGauge("kvrelay:num_requests_running",
                                "Requests being prefilled or pushed.", model_labels_);
  waiting_ = metrics_->GetGauge("kvrelay:num_requests_waiting",
                                "Requests waiting for the model (one forward pass at a time).",
                                model_labels_);
}

void PrefillWorker::CountTransferFailure(const char* reason) {
  MetricLabels labels = model_labels_;
  labels["reason"] = reason;
  metrics_
      ->GetCounter("kvrelay:kv_transfer_failures_total",
                   "KV pushes to decode workers that failed, by reason.", labels)
      ->Increment();
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
  KV_ASSIGN_OR_RETURN(
      core_, worker::WorkerCore::Create(
                 options_.core, [this](transfer::InboundEvent e) { OnInbound(std::move(e)); },
                 std::move(deps)));
  runner_ = core_->runner.get();
  transport_ = core_->transport.get();
  kv_ = core_->kv.get();
  segment_ = core_->segment.get();
  worker::CacheConfigInfo info;
  info.role = "prefill";
  info.layout = &runner_->layout();
  info.pool_blocks = options_.core.pool_blocks;
  info.cache_slots = segment_ != nullptr ? segment_->num_slots() : 0;
  info.prefix_caching = true;
  kv_metrics_ = std::make_unique<worker::KvCacheMetrics>(
      metrics_, model_labels_, info, [kv = kv_] { return worker::FullestPoolUsage(kv->cache()); });
  return absl::OkStatus();
}

absl::Status PrefillWorker::Validate(const kvrelay::v1::PrefillRequest& request) const {
  const kv::ModelLayout& layout = runner_->layout();
  if (!options_.model_name.empty() && request.model() != options_.model_name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: this worker serves '", options_.model_name, "', not '", request.model(), "'"));
  }
  KV_RETURN_IF_ERROR(kv::ValidatePrompt(request.tokens(), /*max_tokens=*/-1, runner_->config()));
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
  for (int g = 0; g < target.groups_size(); ++g) {
    const auto& group = target.groups(g);
    if (group.slots_size() != target.full_blocks()) {
      return absl::InvalidArgumentError(
          absl::StrCat("target.groups[", g, "].slots must have full_blocks entries"));
    }
    if (group.block_bytes() != static_cast<uint64_t>(layout.BlockBytes(g))) {
      return absl::InvalidArgumentError(
          absl::StrCat("target.groups[", g, "].block_bytes ", group.block_bytes(), " != layout's ",
                       layout.BlockBytes(g), " (different model or dtype?)"));
    }
  }
  return absl::OkStatus();
}

void PrefillWorker::OnInbound(transfer::InboundEvent event) {
  if (event.kind == transfer::InboundEvent::Kind::kPeerDown) {
    absl::MutexLock lock(&verdicts_mu_);
    for (auto& [key, verdict] : verdicts_) {
      if (key.first == event.peer && !verdict.has_value()) {
        verdict = absl::UnavailableError(
            absl::StrCat("data plane: the decode worker went away: ", event.status.message()));
      }
    }
    return;
  }
  if (event.kind != transfer::InboundEvent::Kind::kControl) return;
  kvrelay::v1::PushVerdict answer;
  absl::Status verdict;
  if (!answer.ParseFromString(event.message) || answer.code() < 0 || answer.code() > 16) {
    verdict = absl::InternalError("data plane: malformed push verdict from the decode worker");
  } else {
    verdict = absl::Status(static_cast<absl::StatusCode>(answer.code()),
                           absl::StrCat("decode worker: ", answer.message()));
    // The reason travels as the status's ErrorInfo (read back by Run).
    if (!verdict.ok()) {
      kvrelay::v1::ErrorInfo info;
      info.set_role(kvrelay::v1::ROLE_DECODE);
      info.set_reason(answer.reason());
      verdict = proto::WithErrorInfo(std::move(verdict), info);
    }
  }
  absl::MutexLock lock(&verdicts_mu_);
  auto it = verdicts_.find({event.peer, event.tag});
  if (it != verdicts_.end() && !it->second.has_value()) it->second = std::move(verdict);
}

absl::Status PrefillWorker::ClaimPush(transfer::PeerId peer,
                                      const kvrelay::v1::PrefillRequest& request,
                                      absl::Time deadline) {
  const uint64_t tag = worker::RequestTag(request.request_id());
  const std::pair<transfer::PeerId, uint64_t> key{peer, tag};
  {
    absl::MutexLock lock(&verdicts_mu_);
    if (!verdicts_.try_emplace(key, std::nullopt).second) {
      return absl::AlreadyExistsError(absl::StrCat("request '", request.request_id(),
                                                   "' is already pushing to this decode worker"));
    }
  }
  kvrelay::v1::PushClaim claim;
  claim.set_request_id(request.request_id());
  claim.set_reservation_token(request.target().reservation_token());
  *claim.mutable_groups() = request.target().groups();
  absl::Status sent = transport_->SendControl(peer, tag, claim.SerializeAsString());
  absl::MutexLock lock(&verdicts_mu_);
  if (sent.ok()) {
    auto arrived = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(verdicts_mu_) {
      return verdicts_[key].has_value();
    };
    if (!verdicts_mu_.AwaitWithDeadline(absl::Condition(&arrived), deadline)) {
      sent = absl::DeadlineExceededError("data plane: no answer to the push claim in time");
    } else {
      sent = *verdicts_[key];
    }
  }
  verdicts_.erase(key);
  return sent;
}

absl::StatusOr<transfer::PeerId> PrefillWorker::PeerFor(const std::string& address,
                                                        const std::string& key,
                                                        absl::Time deadline) {
  {
    absl::MutexLock lock(&peers_mu_);
    auto it = peers_.find(address);
    if (it != peers_.end()) {
      // A peer that went away is dropped and reconnected.
      if (transport_->RemoteRegions(it->second).ok()) return it->second;
      peers_.erase(it);
    }
  }
  KV_ASSIGN_OR_RETURN(transfer::PeerId peer,
                      transport_->Connect(address, deadline, {.peer_key = key}));
  absl::MutexLock lock(&peers_mu_);
  peers_[address] = peer;
  return peer;
}

absl::StatusOr<kvrelay::v1::PrefillResponse> PrefillWorker::Run(
    const kvrelay::v1::PrefillRequest& request, absl::Time deadline) {
  if (absl::Status s = Validate(request); !s.ok()) return CallerError(std::move(s));
  // The layout (model, dtype, block size, groups) the caller hashed for, this worker's and the
  // target's must be one and the same, or blocks would be read as another layout's.
  const std::string own_fingerprint = runner_->layout().fingerprint().ToBytes();
  if (request.layout_fingerprint() != own_fingerprint) {
    return Own(
        absl::FailedPreconditionError(absl::StrCat(
            "layout_fingerprint: prefill node ", core_->node_id, " serves layout ",
            runner_->layout().fingerprint().ToHex(), ", the request was routed for another")),
        kvrelay::v1::FAILURE_IDENTITY);
  }
  if (request.target().layout_fingerprint() != own_fingerprint) {
    return Attribute(absl::FailedPreconditionError(absl::StrCat(
                         "target.layout_fingerprint: decode node ", request.target().node_id(),
                         " serves another layout than prefill node ", core_->node_id)),
                     kvrelay::v1::ROLE_DECODE, request.target().node_id(),
                     kvrelay::v1::FAILURE_IDENTITY, request.target().transport().address());
  }
  Clock* clock = core_->clock;
  const absl::Time start = clock->Now();
  running_->Add(1);
  absl::Cleanup not_running = [this] { running_->Add(-1); };

  const kv::ModelLayout& layout = runner_->layout();
  const int32_t block_tokens = layout.block_tokens();
  const kvrelay::v1::ReserveResponse& target = request.target();
  const int64_t full_blocks = target.full_blocks();
  const int64_t full_tokens = full_blocks * block_tokens;
  std::vector<int32_t> tokens(request.tokens().begin(), request.tokens().end());
  kvrelay::v1::PrefillResponse response;
  response.set_pushed_tokens(static_cast<int32_t>(full_tokens));
  if (full_blocks == 0) return response;  // the decode worker computes short prompts itself

  // 1. Which leading blocks are cached here.
  std::vector<kv::BlockHash> chain = kv::HashChain(
      layout.fingerprint(), request.tenant_salt(),
      absl::MakeConstSpan(tokens).subspan(0, static_cast<size_t>(full_tokens)), block_tokens);
  prefix_query_tokens_->Increment(static_cast<double>(full_tokens));
  worker::StoreLink* store = store_.load(std::memory_order_acquire);
  if (store == nullptr) {
    return Own(absl::UnavailableError(absl::StrCat("prefill node ", core_->node_id,
                                                   " is not registered with the cache store yet")),
               kvrelay::v1::FAILURE_UNREACHABLE);
  }
  absl::StatusOr<worker::PrefixMatch> match = store->MatchPrefix(chain, options_.lease_ttl);
  // A store outage costs reuse, not the request: everything is computed instead.
  if (!match.ok()) {
    KV_LOG(WARNING) << request.request_id() << ": MatchPrefix failed (" << match.status()
                    << "); computing everything";
    match = worker::PrefixMatch{};
  }
  struct LeaseGuard {
    worker::StoreLink* store;
    uint64_t id;
    ~LeaseGuard() { store->ReleaseLease(id); }
  } lease{store, match->lease_id};
  int64_t hit_blocks = 0;
  while (hit_blocks < static_cast<int64_t>(match->local_slots.size()) &&
         match->local_slots[hit_blocks] >= 0) {
    ++hit_blocks;
  }
  // Counted with the query, so hits / queries is the lookups' hit rate (as vLLM's).
  prefix_hit_tokens_->Increment(static_cast<double>(hit_blocks * block_tokens));

  // 2. The request's sequence: reused blocks copied in, slots for the rest allocated now so the
  //    whole transfer plan can be prepared before computing.
  model::Sequence seq(&kv_->cache());
  if (hit_blocks > 0) {
    std::vector<std::vector<kv::SlotId>> slots;
    for (int64_t b = 0; b < hit_blocks; ++b) {
      absl::Status loaded = segment_->LoadBlock(match->local_slots[b], kv_->cache(), slots);
      if (!loaded.ok()) {
        for (size_t g = 0; g < slots.size(); ++g) {
          for (kv::SlotId s : slots[g]) (void)kv_->cache().pool(static_cast<int>(g)).Release(s);
        }
        return loaded;
      }
    }
    KV_RETURN_IF_ERROR(seq.AdoptPrefix(
        absl::MakeConstSpan(tokens).subspan(0, static_cast<size_t>(hit_blocks * block_tokens)),
        std::move(slots)));
  }
  KV_RETURN_IF_ERROR(seq.EnsureBlocks(full_tokens));

  // 3. One slice per (group, wanted block, layer), posted layer by layer.
  auto decode_failed = [&](absl::Status s, kvrelay::v1::FailureReason reason) {
    kvrelay::v1::ErrorInfo info;
    info.set_role(kvrelay::v1::ROLE_DECODE);
    info.set_node_id(target.node_id());
    info.set_incarnation(target.incarnation());
    info.set_address(target.transport().address());
    info.set_reason(reason);
    return proto::WithErrorInfo(std::move(s), info);
  };
  absl::StatusOr<transfer::PeerId> connected =
      PeerFor(target.transport().address(), target.data_plane_key(), deadline);
  if (absl::IsPermissionDenied(connected.status())) {
    return Attribute(absl::PermissionDeniedError(
                         absl::StrCat("target.data_plane_key: decode node ", target.node_id(),
                                      " at ", target.transport().address(), " refused it")),
                     kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_UNAUTHORIZED);
  }
  if (!connected.ok()) {
    CountTransferFailure("unreachable");
    return decode_failed(
        absl::Status(
            connected.status().code(),
            absl::StrCat("data plane: cannot reach decode node ", target.node_id(), " at ",
                         target.transport().address(), ": ", connected.status().message())),
        kvrelay::v1::FAILURE_UNREACHABLE);
  }
  const transfer::PeerId peer = *connected;
  transfer::TransferBatch batch;
  batch.peer = peer;
  batch.direction = transfer::Direction::kPut;
  batch.tag = worker::RequestTag(request.request_id());
  batch.credential = target.reservation_token();
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    const int g = kv_->cache().group_of_layer(layer);
    const worker::LayerSlice slice = worker::SliceOfLayer(layout, kv_->cache(), layer);
    const auto& group_target = target.groups(g);
    const kv::BlockPool& pool = kv_->cache().pool(g);
    for (int64_t b = 0; b < full_blocks; ++b) {
      const int64_t remote_slot = group_target.slots(static_cast<int>(b));
      if (remote_slot < 0) continue;
      transfer::BlockTransfer t;
      t.local = &kv_->region(g);
      t.local_offset =
          static_cast<uint64_t>(seq.blocks(g)[b]) * pool.slot_stride() + slice.offset_in_unit;
      t.remote_region = group_target.region_id();
      t.remote_offset = static_cast<uint64_t>(remote_slot) * group_target.slot_stride_bytes() +
                        slice.offset_in_unit;
      t.length = slice.length;
      t.layer = layer;
      batch.blocks.push_back(t);
    }
  }
  KV_ASSIGN_OR_RETURN(transfer::TransferPlan plan, transport_->Prepare(batch));
  // Nothing is written before the decode worker agreed that these slots are this
  // reservation's (a caller naming another request's slots gets PERMISSION_DENIED here).
  if (absl::Status claimed =
          ClaimPush(peer, request, std::min(deadline, absl::Now() + options_.transfer_timeout));
      !claimed.ok()) {
    CountTransferFailure(absl::IsPermissionDenied(claimed) ? "refused"
                                                           : TransferFailureReason(claimed));
    std::optional<kvrelay::v1::ErrorInfo> why = proto::GetErrorInfo(claimed);
    if (absl::IsPermissionDenied(claimed) && why.has_value() &&
        why->reason() == kvrelay::v1::FAILURE_EXPIRED) {
      // A reservation that lapsed before the push: the pair's timing, worth a retry elsewhere.
      return decode_failed(
          absl::PermissionDeniedError(absl::StrCat("target: decode node ", target.node_id(),
                                                   " refused the push: ", claimed.message())),
          kvrelay::v1::FAILURE_EXPIRED);
    }
    if (absl::IsPermissionDenied(claimed)) {
      return Attribute(
          absl::PermissionDeniedError(absl::StrCat("target: decode node ", target.node_id(),
                                                   " refused the push: ", claimed.message())),
          kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_UNAUTHORIZED);
    }
    return decode_failed(
        absl::Status(claimed.code(), absl::StrCat("data plane: push claim to decode node ",
                                                  target.node_id(), ": ", claimed.message())),
        kvrelay::v1::FAILURE_TRANSFER);
  }
  std::vector<transfer::TransferHandlePtr> handles;
  absl::Status post_status;
  absl::Time first_post = absl::InfiniteFuture();
  transfer::PostOptions post_options;
  post_options.deadline = std::min(deadline, absl::Now() + options_.transfer_timeout);
  auto post_layer = [&](int32_t layer) {
    if (!post_status.ok()) return;
    if (first_post == absl::InfiniteFuture()) first_post = absl::Now();
    absl::StatusOr<transfer::TransferHandlePtr> h =
        transport_->Post(plan, transfer::LayerRange::One(layer), post_options);
    if (h.ok()) {
      handles.push_back(*std::move(h));
    } else {
      post_status = h.status();
    }
  };

  // 4. Compute the rest; each finished layer goes on the wire while the next computes.
  const int64_t compute_from = hit_blocks * block_tokens;
  if (compute_from < full_tokens) {
    model::PrefillOptions prefill_options;
    prefill_options.on_layer_done = post_layer;
    running_->Add(-1);
    waiting_->Add(1);
    absl::MutexLock lock(&compute_mu_);
    waiting_->Add(-1);
    running_->Add(1);
    absl::StatusOr<std::vector<float>> logits = runner_->Prefill(
        seq,
        absl::MakeConstSpan(tokens).subspan(static_cast<size_t>(compute_from),
                                            static_cast<size_t>(full_tokens - compute_from)),
        prefill_options);
    if (!logits.ok()) return Own(logits.status(), kvrelay::v1::FAILURE_COMPUTE);
  } else {
    for (int32_t layer = 0; layer < layout.num_layers(); ++layer) post_layer(layer);
  }
  int64_t pushed = 0;
  absl::Status transfer_status = post_status;
  for (const auto& h : handles) {
    absl::Status s = h->Wait(deadline);
    if (!s.ok() && transfer_status.ok()) transfer_status = s;
    pushed += h->bytes();
  }
  if (!transfer_status.ok()) {
    CountTransferFailure(TransferFailureReason(transfer_status));
    // The caller's own deadline is not the decode worker's fault.
    if (absl::IsDeadlineExceeded(transfer_status) && absl::Now() >= deadline) {
      return Attribute(absl::DeadlineExceededError(
                           absl::StrCat("the request's deadline passed while pushing to decode "
                                        "node ",
                                        target.node_id())),
                       kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_CALLER_DEADLINE);
    }
    return decode_failed(
        absl::Status(
            transfer_status.code(),
            absl::StrCat("data plane: push to decode node ", target.node_id(), " at ",
                         target.transport().address(), " failed: ", transfer_status.message())),
        absl::IsDataLoss(transfer_status) ? kvrelay::v1::FAILURE_CORRUPT
                                          : kvrelay::v1::FAILURE_TRANSFER);
  }
  pushed_bytes_->Increment(static_cast<double>(pushed));
  if (first_post != absl::InfiniteFuture()) {
    transfer_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - first_post));
    transfer_bytes_->Observe(static_cast<double>(pushed));
  }

  // 5. Publish the blocks computed here for later requests.
  absl::StatusOr<int32_t> committed = store->CommitBlocks(chain, hit_blocks, full_blocks, seq);
  if (!committed.ok()) {
    KV_LOG(WARNING) << request.request_id() << ": commit failed: " << committed.status();
  }
  computed_tokens_->Increment(static_cast<double>(full_tokens - compute_from));
  prefill_seconds_->Observe(absl::ToDoubleSeconds(clock->Now() - start));
  response.set_prefix_hit_tokens(static_cast<int32_t>(hit_blocks * block_tokens));
  response.set_computed_tokens(static_cast<int32_t>(full_tokens - compute_from));
  response.set_pushed_bytes(pushed);
  response.set_committed_blocks(committed.ok() ? *committed : 0);
  return response;
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

kvrelay::v1::PrefillStatusResponse PrefillWorker::Describe() const {
  kvrelay::v1::PrefillStatusResponse response;
  response.set_model(options_.model_name);
  response.set_node_id(core_->node_id);
  response.set_incarnation(core_->incarnation);
  response.set_active_requests(static_cast<int32_t>(running_->value() + waiting_->value()));
  response.set_computed_tokens_total(static_cast<int64_t>(computed_tokens_->value()));
  response.set_prefix_hit_tokens_total(static_cast<int64_t>(prefix_hit_tokens_->value()));
  response.set_layout_fingerprint(runner_->layout().fingerprint().ToBytes());
  return response;
}

}  // namespace kvrelay::prefill
