#include "prefill/prefill_worker.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/block_hash.h"
#include "kv/prompt_validation.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"
#include "worker/block_fetch.h"

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
  fetched_bytes_ = metrics_->GetCounter("kvrelay:prefill_fetched_kv_bytes_total",
                                        "KV bytes pulled from other nodes' caches.", model_labels_);
  fetched_tokens_ =
      metrics_->GetCounter("kvrelay:prefill_fetched_tokens_total",
                           "Prompt tokens whose KV was pulled from another node.", model_labels_);
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
  mamba_ = core_->mamba.get();
  transport_ = core_->transport.get();
  kv_ = core_->kv.get();
  segment_ = core_->segment.get();
  absl::MutexLock lock(&fetch_mu_);
  KV_ASSIGN_OR_RETURN(fetch_scratch_,
                      transport_->AllocateMemory(static_cast<size_t>(limits::kMaxChainBlocks) *
                                                 worker::CacheSegment::kSlotEntryBytes));
  fetch_quarantine_ = std::make_unique<worker::FetchQuarantine>(&kv_->cache());
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
  return absl::OkStatus();
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

absl::Status PrefillWorker::DecodeFailure(const kvrelay::v1::ReserveResponse& target,
                                          absl::Status s, kvrelay::v1::FailureReason reason) const {
  kvrelay::v1::ErrorInfo info;
  info.set_role(kvrelay::v1::ROLE_DECODE);
  info.set_node_id(target.node_id());
  info.set_incarnation(target.incarnation());
  info.set_address(target.transport().address());
  info.set_reason(reason);
  return proto::WithErrorInfo(std::move(s), info);
}

absl::Status PrefillWorker::ClaimFailure(const kvrelay::v1::ReserveResponse& target,
                                         absl::Status claimed) {
  CountTransferFailure(absl::IsPermissionDenied(claimed) ? "refused"
                                                         : TransferFailureReason(claimed));
  std::optional<kvrelay::v1::ErrorInfo> why = proto::GetErrorInfo(claimed);
  if (absl::IsPermissionDenied(claimed) && why.has_value() &&
      why->reason() == kvrelay::v1::FAILURE_EXPIRED) {
    return DecodeFailure(
        target,
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
  return DecodeFailure(
      target,
      absl::Status(claimed.code(), absl::StrCat("data plane: push claim to decode node ",
                                                target.node_id(), ": ", claimed.message())),
      kvrelay::v1::FAILURE_TRANSFER);
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
  absl::StatusOr<worker::PrefixMatch> match =
      store->MatchPrefix(chain, options_.lease_ttl, deadline);
  if (!match.ok()) {
    KV_LOG(WARNING) << request.request_id() << ": MatchPrefix failed (" << match.status()
                    << "); computing everything";
    match = worker::PrefixMatch{};
  }
  return std::make_unique<PrefixLookup>(std::move(chain), *std::move(match), store);
}

absl::StatusOr<transfer::PeerId> PrefillWorker::ConnectDecode(
    const kvrelay::v1::ReserveResponse& target, absl::Time deadline) {
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
    return DecodeFailure(
        target,
        absl::Status(
            connected.status().code(),
            absl::StrCat("data plane: cannot reach decode node ", target.node_id(), " at ",
                         target.transport().address(), ": ", connected.status().message())),
        kvrelay::v1::FAILURE_UNREACHABLE);
  }
  return connected;
}

absl::Status PrefillWorker::PushFailure(const kvrelay::v1::ReserveResponse& target,
                                        absl::Status failed, absl::Time deadline) {
  CountTransferFailure(TransferFailureReason(failed));
  // The caller's own deadline is not the decode worker's fault.
  if (absl::IsDeadlineExceeded(failed) && absl::Now() >= deadline) {
    return Attribute(
        absl::DeadlineExceededError(absl::StrCat(
            "the request's deadline passed while pushing to decode node ", target.node_id())),
        kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  return DecodeFailure(
      target,
      absl::Status(failed.code(),
                   absl::StrCat("data plane: push to decode node ", target.node_id(), " at ",
                                target.transport().address(), " failed: ", failed.message())),
      absl::IsDataLoss(failed) ? kvrelay::v1::FAILURE_CORRUPT : kvrelay::v1::FAILURE_TRANSFER);
}

transfer::TransferBatch PrefillWorker::PushBatch(transfer::PeerId peer,
                                                 const kvrelay::v1::PrefillRequest& request) const {
  transfer::TransferBatch batch;
  batch.peer = peer;
  batch.direction = transfer::Direction::kPut;
  batch.tag = worker::RequestTag(request.request_id());
  batch.credential = request.target().reservation_token();
  return batch;
}

absl::StatusOr<transfer::BlockTransfer> PrefillWorker::PushSlice(
    const kvrelay::v1::ReserveResponse& target, int g, int64_t local_slot, int64_t remote_slot,
    int32_t layer) const {
  const worker::LayerSlice slice = worker::SliceOfLayer(kv_->cache().layout(), kv_->cache(), layer);
  const auto& group_target = target.groups(g);
  absl::StatusOr<std::pair<transfer::RegionId, int64_t>> where =
      TargetSlot(group_target, remote_slot);
  if (!where.ok()) return CallerError(where.status());
  transfer::BlockTransfer t;
  t.local = &kv_->region(g);
  t.local_offset =
      static_cast<uint64_t>(local_slot) * kv_->cache().pool(g).slot_stride() + slice.offset_in_unit;
  t.remote_region = where->first;
  t.remote_offset = static_cast<uint64_t>(where->second) * group_target.slot_stride_bytes() +
                    slice.offset_in_unit;
  t.length = slice.length;
  t.layer = layer;
  return t;
}

absl::StatusOr<transfer::TransferPlan> PrefillWorker::PrepareClaimed(
    const transfer::TransferBatch& batch, const kvrelay::v1::PrefillRequest& request,
    absl::Time deadline) {
  KV_ASSIGN_OR_RETURN(transfer::TransferPlan plan, transport_->Prepare(batch));
  // A caller naming another request's slots gets PERMISSION_DENIED here.
  if (absl::Status claimed = ClaimPush(batch.peer, request,
                                       std::min(deadline, absl::Now() + options_.transfer_timeout));
      !claimed.ok()) {
    return ClaimFailure(request.target(), std::move(claimed));
  }
  return plan;
}

absl::Status PrefillWorker::ImportTargetKeys(transfer::PeerId peer,
                                             const kvrelay::v1::ReserveResponse& target,
                                             std::vector<transfer::RegionId>& imported) {
  for (int g = 0; g < target.groups_size(); ++g) {
    for (int i = 0; i < target.groups(g).runs_size(); ++i) {
      const kvrelay::v1::SlotRun& run = target.groups(g).runs(i);
      absl::StatusOr<transfer::RegionId> id = transport_->ImportRegion(peer, run.memory_key());
      if (id.ok() && *id != run.region_id()) {
        (void)transport_->ForgetRegion(peer, *id);
        id = absl::InvalidArgumentError(
            absl::StrCat("the key is of region ", *id, ", not ", run.region_id()));
      }
      if (!id.ok()) {
        CountTransferFailure("refused");
        return DecodeFailure(
            target,
            absl::Status(
                id.status().code(),
                absl::StrCat("target.groups[", g, "].runs[", i, "].memory_key of decode node ",
                             target.node_id(), ": ", id.status().message())),
            kvrelay::v1::FAILURE_TRANSFER);
      }
      imported.push_back(*id);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<transfer::RegionId, int64_t>> PrefillWorker::TargetSlot(
    const kvrelay::v1::GroupTarget& group, int64_t slot) {
  if (group.runs_size() == 0) return std::make_pair(group.region_id(), slot);
  for (const kvrelay::v1::SlotRun& run : group.runs()) {
    if (slot >= run.first_slot() && slot - run.first_slot() < run.slot_count()) {
      return std::make_pair(run.region_id(), slot - run.first_slot());
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("target: slot ", slot, " is in none of its group's runs"));
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
  const std::string own_fingerprint = model_config().layout.fingerprint().ToBytes();
  if (request.layout_fingerprint() != own_fingerprint) {
    return Own(
        absl::FailedPreconditionError(absl::StrCat(
            "layout_fingerprint: prefill node ", core_->node_id, " serves layout ",
            model_config().layout.fingerprint().ToHex(), ", the request was routed for another")),
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
  if (mamba_ != nullptr) return RunMamba(request, deadline, start);

  const kv::ModelLayout& layout = runner_->layout();
  const int32_t block_tokens = layout.block_tokens();
  const kvrelay::v1::ReserveResponse& target = request.target();
  const int64_t full_blocks = target.full_blocks();
  const int64_t full_tokens = full_blocks * block_tokens;
  std::vector<int32_t> tokens(request.tokens().begin(), request.tokens().end());
  kvrelay::v1::PrefillResponse response;
  response.set_pushed_tokens(static_cast<int32_t>(full_tokens));
  response.set_prefix_source("none");
  if (full_blocks == 0) return response;  // the decode worker computes short prompts itself
  if (target.held_blocks() >= full_blocks) {
    // The decode worker holds every full block: nothing to compute or push.
    response.set_prefix_source("decode");
    response.set_prefix_hit_tokens(static_cast<int32_t>(full_tokens));
    prefix_query_tokens_->Increment(static_cast<double>(full_tokens));
    prefix_hit_tokens_->Increment(static_cast<double>(full_tokens));
    return response;
  }

  // 1. Which leading blocks are cached here.
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PrefixLookup> lookup,
                      LookUpPrefix(request, layout, tokens, full_tokens, deadline));
  const worker::PrefixMatch& match = lookup->match;
  const std::vector<kv::BlockHash>& chain = lookup->chain;
  int64_t hit_blocks = 0;
  while (hit_blocks < static_cast<int64_t>(match.local_slots.size()) &&
         match.local_slots[hit_blocks] >= 0) {
    ++hit_blocks;
  }
  // Counted with the query, so hits / queries is the lookups' hit rate (as vLLM's).
  prefix_hit_tokens_->Increment(static_cast<double>(hit_blocks * block_tokens));

  // 2. The request's sequence: reused blocks copied in, slots for the rest allocated now so the
  //    whole transfer plan can be prepared before computing.
  model::Sequence seq(&kv_->cache());
  std::vector<std::vector<kv::SlotId>> slots;
  auto release_slots = [&] {
    for (size_t g = 0; g < slots.size(); ++g) {
      for (kv::SlotId s : slots[g]) (void)kv_->cache().pool(static_cast<int>(g)).Release(s);
    }
  };
  for (int64_t b = 0; b < hit_blocks; ++b) {
    absl::Status loaded = segment_->LoadBlock(match.local_slots[b], kv_->cache(), slots);
    if (!loaded.ok()) {
      release_slots();
      return loaded;
    }
  }
  // Blocks held on other nodes after ours: pulled, or recomputed when that is cheaper.
  const PulledPrefix pulled = PullHeldElsewhere(match, chain, hit_blocks, full_blocks,
                                                request.request_id(), deadline, slots);
  const int64_t reused_blocks = hit_blocks + pulled.blocks;
  if (reused_blocks > 0) {
    absl::Status adopted = seq.AdoptPrefix(
        absl::MakeConstSpan(tokens).subspan(0, static_cast<size_t>(reused_blocks * block_tokens)),
        std::move(slots));
    if (!adopted.ok()) {
      release_slots();
      return Own(adopted, kvrelay::v1::FAILURE_COMPUTE);
    }
  }
  KV_RETURN_IF_ERROR(seq.EnsureBlocks(full_tokens));
  response.set_prefix_source(pulled.blocks > 0                                ? "pulled"
                             : pulled.attempted || match.matched > hit_blocks ? "recomputed"
                             : hit_blocks > 0                                 ? "local"
                                                                              : "none");
  response.set_fetched_bytes(static_cast<int64_t>(pulled.bytes));
  response.set_fetched_tokens(static_cast<int32_t>(pulled.blocks * block_tokens));
  response.set_estimated_pull_ms(pulled.decision.pull_seconds * 1e3);
  response.set_estimated_recompute_ms(pulled.decision.recompute_seconds * 1e3);

  // 3. One slice per (group, wanted block, layer), posted layer by layer.
  KV_ASSIGN_OR_RETURN(const transfer::PeerId peer, ConnectDecode(target, deadline));
  // Memory keys per reservation: the target's slots are reachable only through its runs' own
  // keys, imported for this push and dropped once its transfers are terminal (the handles,
  // declared later, are destroyed first).
  std::vector<transfer::RegionId> imported;
  absl::Cleanup forget_imported = [&] {
    for (transfer::RegionId id : imported) (void)transport_->ForgetRegion(peer, id);
  };
  KV_RETURN_IF_ERROR(ImportTargetKeys(peer, target, imported));
  transfer::TransferBatch batch = PushBatch(peer, request);
  for (int32_t layer = 0; layer < layout.num_layers(); ++layer) {
    const int g = kv_->cache().group_of_layer(layer);
    for (int64_t b = 0; b < full_blocks; ++b) {
      const int64_t remote_slot = target.groups(g).slots(static_cast<int>(b));
      if (remote_slot < 0) continue;
      KV_ASSIGN_OR_RETURN(transfer::BlockTransfer t,
                          PushSlice(target, g, seq.blocks(g)[b], remote_slot, layer));
      batch.blocks.push_back(t);
    }
  }
  KV_ASSIGN_OR_RETURN(transfer::TransferPlan plan, PrepareClaimed(batch, request, deadline));
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
  const int64_t compute_from = reused_blocks * block_tokens;
  if (compute_from < full_tokens) {
    model::PrefillOptions prefill_options;
    prefill_options.on_layer_done = post_layer;
    running_->Add(-1);
    waiting_->Add(1);
    absl::MutexLock lock(&compute_mu_);
    const absl::Time compute_start = absl::Now();
    waiting_->Add(-1);
    running_->Add(1);
    absl::StatusOr<std::vector<float>> logits = runner_->Prefill(
        seq,
        absl::MakeConstSpan(tokens).subspan(static_cast<size_t>(compute_from),
                                            static_cast<size_t>(full_tokens - compute_from)),
        prefill_options);
    if (!logits.ok()) return Own(logits.status(), kvrelay::v1::FAILURE_COMPUTE);
    // Layer-wise posting overlaps the pushes with compute, so this is compute time.
    prefill_rate_.Observe(static_cast<double>(full_tokens - compute_from),
                          absl::ToDoubleSeconds(absl::Now() - compute_start), absl::Now());
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
  if (!transfer_status.ok()) return PushFailure(target, std::move(transfer_status), deadline);
  pushed_bytes_->Increment(static_cast<double>(pushed));
  if (first_post != absl::InfiniteFuture()) {
    transfer_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - first_post));
    transfer_bytes_->Observe(static_cast<double>(pushed));
  }

  // 5. Publish the blocks computed here for later requests, and keep a copy of those pulled or
  //    recomputed although held elsewhere (the next request for them here is local).
  absl::StatusOr<int32_t> committed =
      lookup->store().CommitBlocks(chain, hit_blocks, full_blocks, seq, deadline,
                                   /*keep_copies=*/true);
  if (!committed.ok()) {
    KV_LOG(WARNING) << request.request_id() << ": commit failed: " << committed.status();
  }
  computed_tokens_->Increment(static_cast<double>(full_tokens - compute_from));
  prefill_seconds_->Observe(absl::ToDoubleSeconds(clock->Now() - start));
  response.set_prefix_hit_tokens(static_cast<int32_t>(reused_blocks * block_tokens));
  response.set_computed_tokens(static_cast<int32_t>(full_tokens - compute_from));
  response.set_pushed_bytes(pushed);
  response.set_committed_blocks(committed.ok() ? *committed : 0);
  return response;
}

MetricLabels PrefillWorker::WithModel(MetricLabels labels) const {
  labels.insert(model_labels_.begin(), model_labels_.end());
  return labels;
}

kv::RateMeter& PrefillWorker::LinkMeter(const std::string& address) {
  absl::MutexLock lock(&meters_mu_);
  std::unique_ptr<kv::RateMeter>& meter = link_meters_[address];
  if (meter == nullptr) meter = std::make_unique<kv::RateMeter>();
  return *meter;
}

PrefillWorker::PulledPrefix PrefillWorker::PullHeldElsewhere(
    const worker::PrefixMatch& match, const std::vector<kv::BlockHash>& chain, int64_t first,
    int64_t wanted_end, const std::string& request_id, absl::Time deadline,
    std::vector<std::vector<kv::SlotId>>& slots) {
  PulledPrefix out;
  const int64_t end = std::min<int64_t>(match.matched, wanted_end);
  if (!options_.pull_remote_prefix || first >= end ||
      first >= static_cast<int64_t>(match.remote.size()) || match.remote[first].empty()) {
    return out;
  }
  // One holder: the first readable replica of the first missing block, for as long a run of
  // blocks as it holds.
  const worker::RemoteReplica& holder = match.remote[first][0];
  std::vector<int64_t> holder_slots;
  for (int64_t b = first; b < end && b < static_cast<int64_t>(match.remote.size()); ++b) {
    auto it = std::find_if(
        match.remote[b].begin(), match.remote[b].end(), [&](const worker::RemoteReplica& r) {
          return r.node_id == holder.node_id && r.transport_address == holder.transport_address;
        });
    if (it == match.remote[b].end()) break;
    holder_slots.push_back(it->slot);
  }
  const kv::ModelLayout& layout = runner_->layout();
  const int64_t run = static_cast<int64_t>(holder_slots.size());
  const uint64_t block_bytes = segment_->block_bytes();
  kv::RateMeter& link = LinkMeter(holder.transport_address);
  const absl::Time now = absl::Now();
  // The link's rate is measured over whole pulls, so it already includes their latency.
  out.decision = kv::ChoosePullOrRecompute({.bytes = block_bytes * static_cast<uint64_t>(run),
                                            .tokens = run * layout.block_tokens(),
                                            .link_bytes_per_second = link.rate(),
                                            .prefill_tokens_per_second = prefill_rate_.rate()});
  // A link judged slow is measured again now and then: it may have become fast.
  const bool reprobe = now - link.last_observed() > options_.fetch_reprobe_interval;
  // The cost model's inputs, as it saw them.
  metrics_
      ->GetGauge("kvrelay:prefill_link_bytes_per_second",
                 "Measured pull rate from each holder (0 until measured).",
                 WithModel({{"holder", holder.node_id}}))
      ->Set(link.rate());
  metrics_
      ->GetGauge("kvrelay:prefill_compute_tokens_per_second",
                 "Measured prompt tokens per second of compute on this node.", model_labels_)
      ->Set(prefill_rate_.rate());
  metrics_
      ->GetCounter("kvrelay:prefill_reuse_decisions_total",
                   "Prefixes held on another node, by what the cost model chose.",
                   WithModel({{"choice", kv::ReuseChoiceName(out.decision.choice)}}))
      ->Increment();
  if (out.decision.choice == kv::ReuseChoice::kRecompute) {
    if (!reprobe) return out;
    // A re-probe reads a quarter of the run: enough to measure the link past a burst allowance,
    // without betting the whole request on it.
    holder_slots.resize(std::max<size_t>(1, holder_slots.size() / 4));
  }
  out.attempted = true;
  const absl::Time fetch_deadline = std::min(deadline, now + options_.fetch_timeout);
  auto failed = [&](absl::string_view why) {
    metrics_
        ->GetCounter("kvrelay:prefill_fetch_failures_total",
                     "Pulls from other nodes that did not deliver every block, by reason.",
                     WithModel({{"reason", std::string(why)}}))
        ->Increment();
  };
  absl::StatusOr<transfer::PeerId> peer =
      PeerFor(holder.transport_address, holder.data_plane_key, fetch_deadline);
  if (!peer.ok()) {
    KV_LOG(WARNING) << request_id << ": cannot reach holder " << holder.node_id << " at "
                    << holder.transport_address << " (" << peer.status() << "); recomputing";
    failed("unreachable");
    return out;
  }
  absl::StatusOr<transfer::PeerStatus> peer_status = transport_->GetPeerStatus(*peer);
  if (!peer_status.ok() || peer_status->incarnation != holder.transport_incarnation) {
    // Another process answers at the holder's address: its memory is not the holder's.
    KV_LOG(WARNING) << request_id << ": the process at " << holder.transport_address
                    << " is not the incarnation the store named for " << holder.node_id;
    failed("identity");
    return out;
  }
  absl::MutexLock lock(&fetch_mu_);
  worker::FetchedPrefix fetched = worker::FetchBlocks(
      *transport_, *peer, holder, holder_slots,
      absl::MakeConstSpan(chain).subspan(static_cast<size_t>(first), holder_slots.size()), layout,
      *kv_, fetch_scratch_, *fetch_quarantine_, worker::RequestTag(request_id), fetch_deadline,
      slots);
  if (fetched.wire_bytes > 0 && fetched.status.ok()) {
    link.Observe(static_cast<double>(fetched.wire_bytes), absl::ToDoubleSeconds(fetched.elapsed),
                 absl::Now());
  } else if (!fetched.status.ok()) {
    // A pull that failed or ran out of time says the link is at most this fast.
    link.ObserveCeiling(static_cast<double>(block_bytes * holder_slots.size()),
                        std::max(1e-3, absl::ToDoubleSeconds(fetched.elapsed)), absl::Now());
    KV_LOG(WARNING) << request_id << ": pulled " << fetched.intact << " of " << holder_slots.size()
                    << " blocks from " << holder.node_id << " (" << fetched.status
                    << "); recomputing the rest";
    failed(absl::IsDataLoss(fetched.status)           ? "corrupt"
           : absl::IsNotFound(fetched.status)         ? "moved"
           : absl::IsDeadlineExceeded(fetched.status) ? "timeout"
                                                      : "transfer");
  }
  out.blocks = fetched.intact;
  out.bytes = fetched.kv_bytes;
  fetched_bytes_->Increment(static_cast<double>(fetched.kv_bytes));
  fetched_tokens_->Increment(static_cast<double>(fetched.intact * layout.block_tokens()));
  return out;
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
  response.set_layout_fingerprint(model_config().layout.fingerprint().ToBytes());
  return response;
}

}  // namespace kvrelay::prefill
