#include "decode/decode_worker.h"

#include <algorithm>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "decode/request_validation.h"
#include "kv/block_hash.h"
#include "kv/prompt_validation.h"
#include "kv/secret.h"
#include "model/sampler.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"

namespace kvrelay::decode {
namespace {

using ::kvrelay::proto::Attribute;

constexpr size_t kTokenBytes = 32;  // the data-plane key: 256 bits
constexpr size_t kMaxClaimBytes = 256 << 10;

// A push or Generate that does not hold the reservation: the caller's doing.
absl::Status Denied(const std::string& message) {
  return Attribute(absl::PermissionDeniedError(message), kvrelay::v1::ROLE_CLIENT, "",
                   kvrelay::v1::FAILURE_UNAUTHORIZED);
}

// Bad input from the caller: never the worker's fault, never worth a retry elsewhere.
absl::Status Invalid(const std::string& message) {
  return Attribute(absl::InvalidArgumentError(message), kvrelay::v1::ROLE_CLIENT, "",
                   kvrelay::v1::FAILURE_INVALID_REQUEST);
}

absl::Status CheckRequestId(const std::string& id) { return ValidateRequestId(id); }

}  // namespace

// One request's sequence as the scheduler runs it, with what the model needs.
struct DecodeWorker::Active : BatchSequence {
  Active(int32_t max_tokens, int32_t eos_token) : BatchSequence(max_tokens, eos_token) {}

  std::string request_id;
  std::unique_ptr<model::Sequence> seq;  // for Mamba an empty stand-in; the state is `mamba`
  std::unique_ptr<model::MambaSequence> mamba;
  std::vector<int32_t> tail;  // prompt tokens the scheduler computes before decoding
  float temperature = 0;
  float top_p = 1.0f;
  std::unique_ptr<model::Sampler> sampler;
  std::string tenant_salt;
  int32_t pushed_blocks = 0;
  int32_t held_blocks = 0;      // of the pushed ones, already in the cache segment
  std::vector<int64_t> budget;  // returned when the sequence ends
  // The request's: bounds the end-of-stream commit (the store link bounds it further by
  // --store-request-timeout).
  absl::Time deadline = absl::InfiniteFuture();
  // Set by Retire (before the stream sees done) when the sequence's commit was queued:
  // notified once it ended and the slots are free.
  std::shared_ptr<absl::Notification> commit_done;
  // When the sequence joined the batch (its prefill): its residency is measured from here.
  absl::Time joined = absl::InfinitePast();
};

DecodeWorker::DecodeWorker(DecodeWorkerOptions options, MetricsRegistry* metrics)
    : options_(std::move(options)), metrics_(metrics) {
  const MetricLabels model = {{"model_name", options_.model_name}};
  auto with_reason = [&model](const char* reason) {
    MetricLabels labels = model;
    labels["reason"] = reason;
    return labels;
  };
  generated_tokens_ =
      metrics_->GetCounter("kvrelay:decode_generated_tokens_total", "Tokens generated.", model);
  received_bytes_ = metrics_->GetCounter("kvrelay:decode_received_kv_bytes_total",
                                         "KV bytes received from prefill workers.", model);
  recomputed_requests_ =
      metrics_->GetCounter("kvrelay:decode_failures_total",
                           "Requests whose pushed KV was unusable and was recomputed, by reason.",
                           with_reason("transfer"));
  active_gauge_ = metrics_->GetGauge("kvrelay:decode_active_sequences",
                                     "Sequences decoding or queued for the batch.", model);
  step_seconds_ =
      metrics_->GetHistogram("kvrelay:decode_step_seconds", "Time of one batched decode step.",
                             LatencyBucketsSeconds(), model);
  reservation_regions_ = metrics_->GetGauge(
      "kvrelay:decode_reservation_memory_regions",
      "Memory registrations of live reservations (--memory-key-scope reservation): one per "
      "contiguous run of a reservation's slots, unmapped when it ends.",
      model);
  reservation_regions_total_ = metrics_->GetCounter(
      "kvrelay:decode_reservation_memory_regions_total",
      "Memory registrations made for reservations (--memory-key-scope reservation).", model);
  held_blocks_ = metrics_->GetCounter(
      "kvrelay:decode_held_blocks_total",
      "Leading prompt blocks found in this worker's own cache at Reserve (not pushed again).",
      model);
  refused_overloaded_ =
      metrics_->GetCounter("kvrelay:decode_refused_total",
                           "Requests refused at admission, by reason.", with_reason("capacity"));
  refused_queue_ =
      metrics_->GetCounter("kvrelay:decode_refused_total",
                           "Requests refused at admission, by reason.", with_reason("queue"));
  refused_pushes_ = metrics_->GetCounter(
      "kvrelay:decode_refused_pushes_total",
      "Data-plane claims and block deliveries refused: wrong or expired reservation token, "
      "another peer's reservation, or slots outside the reservation.",
      model);
  running_gauge_ = metrics_->GetGauge("kvrelay:num_requests_running",
                                      "Requests in the continuous batch.", model);
  waiting_gauge_ = metrics_->GetGauge(
      "kvrelay:num_requests_waiting",
      "Requests waiting: reserved while their KV is pushed, or queued for a batch slot.", model);
  reservations_gauge_ = metrics_->GetGauge(
      "kvrelay:decode_reservations",
      "Reservations holding KV bookings: pushes under way, and released or lapsed ones until "
      "the next sweep (at most a second later; released ones while their push may still write).",
      model);
  commits_skipped_ = metrics_->GetCounter(
      "kvrelay:decode_commits_skipped_total",
      "Finished sequences whose blocks were not kept for reuse: max_batch commits were "
      "waiting for the store already.",
      model);
}

void DecodeWorker::PublishLoad() {
  absl::MutexLock lock(&publish_mu_);
  const ReservationLoad load = table_->Load();
  const BatchScheduler::Counts counts = scheduler_->counts();
  running_gauge_->Set(counts.running);
  waiting_gauge_->Set(load.waiting + counts.queued);
  reservations_gauge_->Set(load.reservations);
  double booked = 0;
  for (size_t g = 0; g < load.capacity.size(); ++g) {
    if (load.capacity[g] > 0) {
      booked = std::max(booked, static_cast<double>(load.booked[g]) / load.capacity[g]);
    }
  }
  usage_perc_.store(booked, std::memory_order_relaxed);
}

absl::Status DecodeWorker::Own(absl::Status status, kvrelay::v1::FailureReason reason) const {
  kvrelay::v1::ErrorInfo info;
  info.set_role(kvrelay::v1::ROLE_DECODE);
  info.set_node_id(core_->node_id);
  info.set_incarnation(core_->incarnation);
  info.set_address(core_->transport_address);
  info.set_reason(reason);
  return proto::WithErrorInfo(std::move(status), info);
}

absl::Status DecodeWorker::CheckLayoutFingerprint(const std::string& fingerprint,
                                                  const std::string& description) const {
  const kv::ModelLayout& own = model_config().layout;
  if (fingerprint == own.fingerprint().ToBytes()) return absl::OkStatus();
  return Own(absl::FailedPreconditionError(
                 absl::StrCat("layout_fingerprint: decode node ", core_->node_id, " serves ",
                              kv::LayoutMismatch(own, "request's", description))),
             kvrelay::v1::FAILURE_IDENTITY);
}

absl::Status DecodeWorker::CheckNotDraining() const {
  if (!draining_.load()) return absl::OkStatus();
  return Own(absl::UnavailableError(absl::StrCat("decode node ", core_->node_id, " is draining")),
             kvrelay::v1::FAILURE_DRAINING);
}

std::vector<int64_t> DecodeWorker::BlockBudget(int64_t tokens) const {
  const kv::ModelLayout& layout = model_config().layout;
  std::vector<int64_t> budget(layout.groups().size());
  for (size_t g = 0; g < budget.size(); ++g) {
    budget[g] = layout.BlocksNeeded(static_cast<int>(g), tokens);
    // A sliding window briefly holds one block more while the next is written.
    if (layout.groups()[g].kind == kv::LayerKind::kSlidingWindow) ++budget[g];
  }
  return budget;
}

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(DecodeWorkerOptions options,
                                                                   MetricsRegistry* metrics,
                                                                   worker::WorkerCoreDeps deps) {
  auto worker = std::unique_ptr<DecodeWorker>(new DecodeWorker(std::move(options), metrics));
  KV_RETURN_IF_ERROR(worker->Init(std::move(deps)));
  return worker;
}

absl::Status DecodeWorker::Init(worker::WorkerCoreDeps deps) {
  KV_ASSIGN_OR_RETURN(data_plane_key_, kv::RandomSecret(kTokenBytes));
  worker::WorkerCoreOptions core_options = options_.core;
  core_options.transport_accept_key = data_plane_key_;
  // OnInbound runs on the transport's thread from now on; it reaches table_ only through
  // inbound events for reservations, and there are none before table_ exists.
  if (deps.metrics == nullptr) {  // the store link's gate
    deps.metrics = metrics_;
    deps.metric_labels = {{"model_name", options_.model_name}};
  }
  KV_ASSIGN_OR_RETURN(
      core_, worker::WorkerCore::Create(
                 core_options, [this](transfer::InboundEvent e) { OnInbound(std::move(e)); },
                 std::move(deps)));
  runner_ = core_->runner.get();
  mamba_ = core_->mamba.get();
  kv_ = core_->kv.get();
  std::vector<SlotGroup> groups;
  for (int g = 0; g < kv_->cache().num_groups(); ++g) {
    groups.push_back(SlotGroup{.pool = &kv_->cache().pool(g), .region_id = kv_->region(g).id()});
  }
  table_ = std::make_unique<ReservationTable>(
      std::move(groups), core_->clock,
      ReservationTableOptions{
          .ttl = options_.reservation_ttl,
          .num_layers = model_config().layout.num_layers(),
          .per_reservation_keys = core_->memory_key_scope == worker::MemoryKeyScope::kReservation,
          .tag_of = worker::RequestTag,
          .capacity_refusals = refused_overloaded_});
  worker::CacheConfigInfo info;
  info.role = "decode";
  info.layout = &model_config().layout;
  info.pool_blocks = options_.core.pool_blocks;
  info.cache_slots = core_->segment != nullptr ? core_->segment->num_slots() : 0;
  info.device = core_->device.Label();
  info.device_name = core_->device.name;
  kv_metrics_ = std::make_unique<worker::KvCacheMetrics>(
      metrics_, MetricLabels{{"model_name", options_.model_name}}, info,
      [usage = &usage_perc_] { return usage->load(std::memory_order_relaxed); });
  admission_ = std::make_unique<DecodeAdmission>(
      DecodeAdmissionOptions{.max_batch = options_.max_batch, .max_queued = options_.max_queued},
      core_->node_id);
  scheduler_ = std::make_unique<BatchScheduler>(
      BatchSchedulerOptions{.max_batch = options_.max_batch, .max_queued = options_.max_queued},
      static_cast<BatchModel*>(this));
  scheduler_->Start();
  commit_thread_ = std::thread([this] { CommitLoop(); });
  return absl::OkStatus();
}

DecodeWorker::~DecodeWorker() {
  // No more inbound events (see ~PrefillWorker): they reach the table.
  if (core_ != nullptr && core_->transport != nullptr) core_->transport->SetInboundHandler(nullptr);
  // Sequences still running or queued end (UNAVAILABLE) and return their slots and bookings.
  if (scheduler_ != nullptr) scheduler_->Stop();
  // Then the commits they queued (before the table and the KV cache their jobs hold go).
  StopCommits();
  // Reservations hold slots of kv_; free them (and unmap their runs) before the cache goes.
  scheduler_.reset();
  table_.reset();
}

const std::string& DecodeWorker::transport_address() const { return core_->transport_address; }

bool DecodeWorker::Drain(absl::Time deadline) {
  draining_.store(true);
  return core_->DrainAndLeave(
      [this] {
        const BatchScheduler::Counts counts = scheduler_->counts();
        return calls_.load() == 0 && table_->Load().waiting == 0 && counts.active == 0 &&
               counts.queued == 0;
      },
      deadline);
}

void DecodeWorker::OnPushClaim(const transfer::InboundEvent& event) {
  kvrelay::v1::PushClaim claim;
  ClaimVerdict verdict;
  if (event.message.size() > kMaxClaimBytes ||
      !claim.ParseFromArray(event.message.data(), static_cast<int>(event.message.size()))) {
    verdict.status = absl::InvalidArgumentError("malformed push claim");
  } else {
    verdict = table_->Claim(claim, event.peer);
  }
  if (!verdict.status.ok()) {
    refused_pushes_->Increment();
    KV_LOG(WARNING) << "data plane: push claim from peer " << event.peer
                    << " refused: " << verdict.status.message();
  }
  kvrelay::v1::PushVerdict answer;
  answer.set_code(static_cast<int32_t>(verdict.status.code()));
  answer.set_message(std::string(verdict.status.message()).substr(0, 1024));
  if (!verdict.status.ok()) {
    answer.set_reason(verdict.expired ? kvrelay::v1::FAILURE_EXPIRED
                                      : kvrelay::v1::FAILURE_UNAUTHORIZED);
  }
  absl::Status sent =
      core_->transport->SendControl(event.peer, event.tag, answer.SerializeAsString());
  if (!sent.ok()) KV_LOG(WARNING) << "data plane: cannot answer a push claim: " << sent;
}

void DecodeWorker::OnInbound(transfer::InboundEvent event) {
  if (event.kind == transfer::InboundEvent::Kind::kControl) {
    OnPushClaim(event);
    return;
  }
  if (event.kind != transfer::InboundEvent::Kind::kBlocks) return;
  absl::Status delivered = table_->Deliver(event);
  if (absl::IsNotFound(delivered)) {
    KV_LOG(WARNING) << delivered.message() << " ignored";
  } else if (!delivered.ok()) {
    refused_pushes_->Increment();
    KV_LOG(WARNING) << "data plane: blocks from peer " << event.peer
                    << " refused: " << delivered.message();
  }
}

absl::StatusOr<ReservationRequest> DecodeWorker::PlanReservation(
    const kvrelay::v1::ReserveRequest& request) {
  const kv::ModelLayout& layout = model_config().layout;
  if (request.chain_packed().size() % 16 != 0 ||
      request.chain_packed().size() / 16 > static_cast<size_t>(limits::kMaxChainBlocks)) {
    return Invalid(absl::StrCat("chain_packed: want a multiple of 16 bytes, at most ",
                                limits::kMaxChainBlocks, " hashes; got ",
                                request.chain_packed().size(), " bytes"));
  }
  constexpr int64_t kMaxRequestBudgetMs = 3600 * 1000;
  if (request.request_budget_ms() < 0 || request.request_budget_ms() > kMaxRequestBudgetMs) {
    return Invalid(absl::StrCat("request_budget_ms: want [0, ", kMaxRequestBudgetMs, "], got ",
                                request.request_budget_ms()));
  }
  ReservationRequest r;
  r.request_id = request.request_id();
  r.prompt_tokens = request.prompt_tokens();
  if (request.request_budget_ms() > 0) {
    r.lifetime = absl::Milliseconds(request.request_budget_ms());
  }
  // The last prompt token is always computed here: its logits give the first output token.
  r.full_blocks = (r.prompt_tokens - 1) / layout.block_tokens();
  r.expected_layers = r.full_blocks > 0 ? layout.num_layers() : 0;
  r.budget = BlockBudget(int64_t{request.prompt_tokens()} + request.max_tokens());
  const int64_t first_query = static_cast<int64_t>(r.full_blocks) * layout.block_tokens();
  r.wanted = [&layout, first_query](int group, int64_t block) {
    return worker::BlockWanted(layout.groups()[group], layout.block_tokens(), block, first_query);
  };
  for (size_t i = 0;
       i * 16 < request.chain_packed().size() && static_cast<int64_t>(i) < r.full_blocks; ++i) {
    r.held_hashes.push_back(kv::BlockHash::FromBytes(absl::MakeConstSpan(
        reinterpret_cast<const uint8_t*>(request.chain_packed().data()) + i * 16, 16)));
  }
  // Leading blocks this worker kept from earlier requests: copied out of the segment now (the
  // store's policy may evict them later), never pushed again. Outside the table's lock: the
  // copies must not hold up other requests. The table releases what it does not keep.
  worker::StoreLink* store = store_.load(std::memory_order_acquire);
  if (store != nullptr && !r.held_hashes.empty()) {
    r.held_blocks =
        static_cast<int32_t>(store->LoadHeldPrefix(r.held_hashes, kv_->cache(), r.held_slots));
  }
  r.held_hashes.resize(static_cast<size_t>(r.held_blocks));
  if (r.held_blocks >= r.full_blocks) r.expected_layers = 0;
  return r;
}

kvrelay::v1::ReserveResponse DecodeWorker::DescribeGrant(int32_t full_blocks, int32_t held_blocks,
                                                         const ReservationGrant& grant) const {
  const kv::ModelLayout& layout = model_config().layout;
  kvrelay::v1::ReserveResponse response;
  response.mutable_transport()->set_kind(core_->transport_kind);
  response.mutable_transport()->set_address(core_->transport_address);
  response.set_full_blocks(full_blocks);
  response.set_block_tokens(layout.block_tokens());
  response.set_ttl_ms(absl::ToInt64Milliseconds(options_.reservation_ttl));
  response.set_layout_fingerprint(layout.fingerprint().ToBytes());
  response.set_layout_description(layout.Describe());
  response.set_node_id(core_->node_id);
  response.set_incarnation(core_->incarnation);
  response.set_reservation_token(grant.token);
  response.set_data_plane_key(data_plane_key_);
  for (size_t g = 0; g < layout.groups().size(); ++g) {
    kvrelay::v1::GroupTarget* target = response.add_groups();
    const kv::BlockPool& pool = kv_->cache().pool(static_cast<int>(g));
    target->set_region_id(kv_->region(static_cast<int>(g)).id());
    target->set_slot_stride_bytes(pool.slot_stride());
    target->set_block_bytes(static_cast<uint64_t>(layout.BlockBytes(static_cast<int>(g))));
    for (int64_t b = 0; b < full_blocks; ++b) {
      target->add_slots(b < held_blocks ? -1 : grant.slots[g][b]);
    }
  }
  response.set_held_blocks(held_blocks);
  return response;
}

absl::Status DecodeWorker::AdmitReserve(absl::Time deadline) {
  // Ahead of this request: every sequence running or queued, and every reservation whose
  // push is under way (it becomes a sequence at its Generate).
  const int32_t waiting = table_->Load().waiting;
  const int32_t ahead = scheduler_->counts().active + waiting;
  absl::Duration may_wait = deadline - absl::Now();
  if (options_.max_queue_wait > absl::ZeroDuration()) {
    may_wait = std::min(may_wait, options_.max_queue_wait);
  }
  absl::Status admitted = admission_->Check(ahead, may_wait);
  if (!admitted.ok()) {
    refused_queue_->Increment();
    PublishLoad();
  }
  return admitted;
}

absl::StatusOr<kvrelay::v1::ReserveResponse> DecodeWorker::Reserve(
    const kvrelay::v1::ReserveRequest& request, absl::Time deadline) {
  calls_.fetch_add(1);
  absl::Cleanup counted = [this] { calls_.fetch_sub(1); };
  const kv::ModelLayout& layout = model_config().layout;
  if (absl::Status s = ValidateReserveRequest(request, options_.model_name, layout); !s.ok()) {
    if (absl::IsFailedPrecondition(s)) {
      return Own(absl::FailedPreconditionError(
                     absl::StrCat("decode node ", core_->node_id, ": ", s.message())),
                 kvrelay::v1::FAILURE_IDENTITY);
    }
    return Invalid(std::string(s.message()));
  }
  KV_ASSIGN_OR_RETURN(ReservationRequest planned, PlanReservation(request));
  if (absl::Status s = CheckNotDraining(); !s.ok()) {
    table_->FreeSlots(planned.held_slots);
    return s;
  }
  if (absl::Status s = AdmitReserve(deadline); !s.ok()) {
    table_->FreeSlots(planned.held_slots);
    return s;
  }
  const int32_t full_blocks = planned.full_blocks;
  const int32_t held_blocks = planned.held_blocks;
  absl::StatusOr<ReservationGrant> grant = table_->Book(std::move(planned));
  if (absl::IsAlreadyExists(grant.status())) return Invalid(std::string(grant.status().message()));
  if (absl::IsResourceExhausted(grant.status())) {
    // KV frees when a running sequence ends: about one departure from now.
    return proto::Overloaded(
        absl::StrCat("decode node ", core_->node_id, ": ", grant.status().message()),
        kvrelay::v1::ROLE_DECODE, core_->node_id, "kv_blocks",
        absl::ToInt64Milliseconds(admission_->NextDeparture(scheduler_->counts().running)));
  }
  KV_RETURN_IF_ERROR(grant.status());
  // The caller gave up while this call waited (a stopped process, a slow queue): nobody will
  // take or release the reservation, so it ends here instead of at its lapse.
  if (absl::Now() > deadline) {
    table_->Cancel(request.request_id(), grant->token);
    PublishLoad();
    return Own(absl::DeadlineExceededError(absl::StrCat(
                   "decode node ", core_->node_id, ": the caller's deadline passed at Reserve")),
               kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  held_blocks_->Increment(held_blocks);
  PublishLoad();
  kvrelay::v1::ReserveResponse response = DescribeGrant(full_blocks, held_blocks, *grant);
  if (core_->memory_key_scope != worker::MemoryKeyScope::kReservation) return response;
  if (absl::Status keyed =
          RegisterReservationRuns(request.request_id(), held_blocks, *grant, response);
      !keyed.ok()) {
    table_->Cancel(request.request_id(), grant->token);
    PublishLoad();
    return Own(absl::ResourceExhaustedError(
                   absl::StrCat("decode node ", core_->node_id,
                                ": cannot register the reservation's slots: ", keyed.message())),
               kvrelay::v1::FAILURE_OVERLOADED);
  }
  return response;
}

absl::Status DecodeWorker::RegisterReservationRuns(const std::string& request_id,
                                                   int32_t held_blocks,
                                                   const ReservationGrant& grant,
                                                   kvrelay::v1::ReserveResponse& response) {
  ReservedRuns runs;
  for (size_t g = 0; g < grant.slots.size(); ++g) {
    std::vector<kv::SlotId> slots;
    for (size_t b = static_cast<size_t>(held_blocks); b < grant.slots[g].size(); ++b) {
      if (grant.slots[g][b] >= 0) slots.push_back(grant.slots[g][b]);
    }
    std::sort(slots.begin(), slots.end());
    const transfer::MemoryRegion& pool = kv_->region(static_cast<int>(g));
    const uint64_t stride = kv_->cache().pool(static_cast<int>(g)).slot_stride();
    for (size_t i = 0; i < slots.size();) {
      size_t j = i + 1;
      while (j < slots.size() && slots[j] == slots[j - 1] + 1) ++j;
      const kv::SlotId first = slots[i];
      const int64_t count = static_cast<int64_t>(j - i);
      KV_ASSIGN_OR_RETURN(
          transfer::MemoryRegionPtr region,
          core_->transport->RegisterPrivateMemory(
              transfer::MemorySpan{pool.data() + static_cast<uint64_t>(first) * stride,
                                   static_cast<size_t>(count) * stride},
              transfer::MemoryKind::kHost));
      KV_ASSIGN_OR_RETURN(std::string key, core_->transport->ExportRegion(*region));
      kvrelay::v1::SlotRun* out = response.mutable_groups(static_cast<int>(g))->add_runs();
      out->set_region_id(region->id());
      out->set_first_slot(first);
      out->set_slot_count(count);
      out->set_memory_key(std::move(key));
      runs.push_back(std::make_unique<ReservedRun>(static_cast<int>(g), first, count,
                                                   std::move(region), reservation_regions_));
      reservation_regions_total_->Increment();
      i = j;
    }
  }
  table_->AttachRuns(request_id, grant.token, std::move(runs));
  return absl::OkStatus();
}

absl::Status DecodeWorker::Release(const std::string& request_id,
                                   const std::string& reservation_token) {
  if (absl::Status s = CheckRequestId(request_id); !s.ok()) {
    return Invalid(std::string(s.message()));
  }
  if (absl::Status s = table_->Release(request_id, reservation_token); !s.ok()) {
    return Denied(std::string(s.message()));
  }
  PublishLoad();
  return absl::OkStatus();
}

absl::Status DecodeWorker::CheckDecodeRequest(const kvrelay::v1::DecodeRequest& request) const {
  if (absl::Status s = CheckRequestId(request.request_id()); !s.ok()) {
    return Invalid(std::string(s.message()));
  }
  if (absl::Status s = kv::ValidatePrompt(request.tokens(), request.max_tokens(), model_config());
      !s.ok()) {
    return Invalid(std::string(s.message()));
  }
  const float temperature = request.sampling().temperature();
  if (!(temperature >= 0 && temperature <= limits::kMaxTemperature)) {
    return Invalid(
        absl::StrCat("sampling.temperature must be in [0, ", limits::kMaxTemperature, "]"));
  }
  const float top_p = request.sampling().top_p();
  if (!(top_p >= 0 && top_p <= 1)) return Invalid("sampling.top_p must be in (0, 1]");
  if (request.tenant_salt().size() > limits::kMaxTenantSaltBytes) {
    return Invalid(absl::StrCat("tenant_salt is over ", limits::kMaxTenantSaltBytes, " bytes"));
  }
  return CheckLayoutFingerprint(request.layout_fingerprint(), request.layout_description());
}

absl::StatusOr<DecodeWorker::Admission> DecodeWorker::Admit(
    const kvrelay::v1::DecodeRequest& request, absl::Time deadline) {
  // A request reserved before the drain began is admitted work: it finishes here.
  if (request.reservation_token().empty()) KV_RETURN_IF_ERROR(CheckNotDraining());
  // Wait for the pushed prefix, bounded by the caller's deadline and transfer_wait.
  const absl::Time wait_deadline = std::min(absl::Now() + options_.transfer_wait, deadline);
  absl::StatusOr<std::optional<TakenReservation>> taken = table_->Take(
      request.request_id(), request.reservation_token(), request.tokens_size(), wait_deadline);
  if (absl::IsPermissionDenied(taken.status())) {
    refused_pushes_->Increment();
    return Denied(std::string(taken.status().message()));
  }
  if (!taken.ok()) return Invalid(std::string(taken.status().message()));
  Admission admission;
  admission.push = *std::move(taken);
  if (admission.push.has_value()) admission.budget = std::move(admission.push->budget);
  // Admission for a request that did not reserve (or whose reservation lapsed), and the bound
  // on requests waiting for a batch slot.
  const bool queue_full = scheduler_->Full();
  bool fits = !admission.budget.empty();
  if (admission.budget.empty()) {
    std::vector<int64_t> need = BlockBudget(int64_t{request.max_tokens()} + request.tokens_size());
    fits = table_->TryBook(need);
    if (fits) admission.budget = std::move(need);
  }
  if (fits && !queue_full) return admission;
  if (admission.push.has_value()) table_->FreeSlots(admission.push->slots);
  if (fits) table_->Unbook(admission.budget);
  PublishLoad();
  refused_overloaded_->Increment();
  return proto::Overloaded(
      absl::StrCat("decode node ", core_->node_id, ": ",
                   queue_full ? "the batch and its queue are full" : "no KV capacity left"),
      kvrelay::v1::ROLE_DECODE, core_->node_id, queue_full ? "queue" : "kv_blocks",
      absl::ToInt64Milliseconds(admission_->NextDeparture(scheduler_->counts().running)));
}

std::shared_ptr<DecodeWorker::Active> DecodeWorker::NewSequence(
    const kvrelay::v1::DecodeRequest& request, std::vector<int64_t> budget) const {
  const int32_t eos_token =
      request.eos_token() >= 0 && request.eos_token() < model_config().vocab_size
          ? request.eos_token()
          : -1;
  auto active = std::make_shared<Active>(request.max_tokens(), eos_token);
  active->request_id = request.request_id();
  active->seq = std::make_unique<model::Sequence>(&kv_->cache());
  if (mamba_ != nullptr) {
    active->mamba = std::make_unique<model::MambaSequence>(model_config().layout);
  }
  active->temperature = request.sampling().temperature();
  const float top_p = request.sampling().top_p();
  active->top_p = top_p > 0 ? top_p : 1.0f;
  active->sampler = std::make_unique<model::Sampler>(request.sampling().seed());
  active->tenant_salt = request.tenant_salt();
  active->budget = std::move(budget);
  return active;
}

bool DecodeWorker::PushUsable(const kvrelay::v1::DecodeRequest& request,
                              const std::vector<int32_t>& tokens, const TakenReservation& push) {
  const kv::ModelLayout& layout = model_config().layout;
  // Held blocks count only if they are this prompt's: the hashes the gateway named at Reserve
  // must be the prompt's own (tokens, tenant, layout).
  bool held_ok = true;
  if (push.held_blocks > 0) {
    const std::vector<kv::BlockHash> own =
        kv::HashChain(layout.fingerprint(), request.tenant_salt(),
                      absl::MakeConstSpan(tokens).subspan(
                          0, static_cast<size_t>(push.held_blocks) * layout.block_tokens()),
                      layout.block_tokens());
    held_ok = own == push.held_hashes;
    if (!held_ok) {
      KV_LOG(WARNING) << request.request_id()
                      << ": the prefix named at Reserve is not this prompt's; recomputing";
    }
  }
  const bool usable = push.full_blocks > 0 && held_ok && push.complete &&
                      push.transfer_status.ok() &&
                      request.pushed_tokens() == push.full_blocks * layout.block_tokens();
  if (push.full_blocks > 0 && !usable) {
    recomputed_requests_->Increment();
    KV_LOG(WARNING) << request.request_id() << ": pushed KV unusable ("
                    << (push.transfer_status.ok() ? "incomplete" : push.transfer_status.ToString())
                    << "); computing the prompt here";
  }
  return usable;
}

absl::StatusOr<int64_t> DecodeWorker::AttachPrefix(const kvrelay::v1::DecodeRequest& request,
                                                   const std::vector<int32_t>& tokens,
                                                   std::optional<TakenReservation> push,
                                                   Active& active) {
  if (!push.has_value() || !PushUsable(request, tokens, *push)) {
    if (push.has_value()) table_->FreeSlots(push->slots);
    active.tail = tokens;
    return push.has_value() ? push->bytes_received : 0;
  }
  const int64_t prefix_tokens = int64_t{push->full_blocks} * model_config().layout.block_tokens();
  absl::Status adopted;
  if (mamba_ != nullptr) {
    absl::StatusOr<std::unique_ptr<model::MambaSequence>> state =
        AdoptPushedState(std::move(push->slots), prefix_tokens);
    adopted = state.status();
    if (state.ok()) active.mamba = *std::move(state);
  } else {
    adopted = active.seq->AdoptPrefix(
        absl::MakeConstSpan(tokens).subspan(0, static_cast<size_t>(prefix_tokens)),
        std::move(push->slots));
  }
  if (!adopted.ok()) {
    table_->Unbook(active.budget);
    active.budget.clear();
    return Own(adopted, kvrelay::v1::FAILURE_COMPUTE);
  }
  active.tail.assign(tokens.begin() + prefix_tokens, tokens.end());
  active.pushed_blocks = push->full_blocks;
  active.held_blocks = push->held_blocks;
  received_bytes_->Increment(static_cast<double>(push->bytes_received));
  return push->bytes_received;
}

absl::Status DecodeWorker::Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                                    const ChunkWriter& write,
                                    const std::function<bool()>& cancelled) {
  calls_.fetch_add(1);
  absl::Cleanup counted = [this] { calls_.fetch_sub(1); };
  KV_RETURN_IF_ERROR(CheckDecodeRequest(request));
  const std::vector<int32_t> tokens(request.tokens().begin(), request.tokens().end());
  KV_ASSIGN_OR_RETURN(Admission admission, Admit(request, deadline));
  std::shared_ptr<Active> active = NewSequence(request, std::move(admission.budget));
  active->deadline = deadline;
  KV_ASSIGN_OR_RETURN(const int64_t received_bytes,
                      AttachPrefix(request, tokens, std::move(admission.push), *active));
  const int32_t computed_tokens = static_cast<int32_t>(active->tail.size());
  scheduler_->Submit(active);
  PublishLoad();
  return StreamTokens(*active, deadline, write, cancelled, received_bytes, computed_tokens);
}

absl::Status DecodeWorker::StreamTokens(Active& active, absl::Time deadline,
                                        const ChunkWriter& write,
                                        const std::function<bool()>& cancelled,
                                        int64_t received_bytes, int32_t computed_tokens) {
  bool deadline_passed = false;
  bool stopped = false;  // by the client (gone, or its deadline): the scheduler drops the sequence
  absl::Status final_status;
  while (true) {
    // Wake at least every 100 ms to notice a cancelled client.
    BatchSequence::Output out =
        active.Await(std::min(deadline, absl::Now() + absl::Milliseconds(100)));
    final_status = out.status;
    if (cancelled && cancelled()) stopped = true;
    if (!out.done && absl::Now() >= deadline) {
      deadline_passed = true;
      stopped = true;
    }
    if (stopped) active.Cancel();
    if (stopped && out.tokens.empty()) break;
    kvrelay::v1::DecodeChunk chunk;
    for (int32_t t : out.tokens) chunk.add_tokens(t);
    if (out.done && final_status.ok() && active.commit_done != nullptr) {
      // The last tokens go now; done follows the commit, so a next turn sent after it finds
      // this one's blocks. The commit is bounded by the deadline (and the store's per-call
      // limit); past the deadline the stream ends done anyway: every token was sent.
      if (!out.tokens.empty() && !write(chunk)) {
        stopped = true;
        break;
      }
      chunk.clear_tokens();
      active.commit_done->WaitForNotificationWithDeadline(deadline);
    }
    if (out.done && final_status.ok()) {
      chunk.set_done(true);
      chunk.set_received_bytes(received_bytes);
      chunk.set_computed_tokens(computed_tokens);
    }
    if ((!out.tokens.empty() || chunk.done()) && !write(chunk)) {
      stopped = true;
      active.Cancel();
      break;
    }
    if (out.done || stopped) break;
  }
  if (deadline_passed) {
    return Attribute(absl::DeadlineExceededError("the request's deadline passed while decoding"),
                     kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  if (stopped) {
    return Attribute(absl::CancelledError("client went away"), kvrelay::v1::ROLE_CLIENT, "",
                     kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  if (!final_status.ok()) return Own(final_status, kvrelay::v1::FAILURE_COMPUTE);
  return absl::OkStatus();
}

absl::StatusOr<int32_t> DecodeWorker::Prefill(BatchSequence& seq) {
  // Every sequence this worker submits is an Active.
  Active& a = static_cast<Active&>(seq);
  a.joined = absl::Now();
  absl::StatusOr<std::vector<float>> logits =
      a.mamba != nullptr ? mamba_->Prefill(*a.mamba, a.tail) : runner_->Prefill(*a.seq, a.tail);
  if (!logits.ok()) return logits.status();
  generated_tokens_->Increment();
  return a.sampler->Sample(*logits, a.temperature, a.top_p);
}

absl::StatusOr<std::vector<int32_t>> DecodeWorker::Step(absl::Span<BatchSequence* const> batch) {
  std::vector<Active*> running;
  std::vector<model::Sequence*> seqs;
  std::vector<model::MambaSequence*> states;
  std::vector<int32_t> last;
  for (BatchSequence* seq : batch) {
    running.push_back(static_cast<Active*>(seq));  // every sequence submitted is an Active
    seqs.push_back(running.back()->seq.get());
    states.push_back(running.back()->mamba.get());
    last.push_back(seq->last_token());
  }
  // Greedy sequences need no logits on the host: a batch of only those asks the model for
  // token ids (Sampler::Sample at temperature 0 is Greedy, so the tokens are the same).
  const bool all_greedy =
      mamba_ == nullptr && std::all_of(running.begin(), running.end(),
                                       [](const Active* a) { return !(a->temperature > 0.0f); });
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<float>> logits;
  absl::StatusOr<std::vector<int32_t>> tokens;
  if (all_greedy) {
    tokens = runner_->DecodeStepGreedy(seqs, last);
  } else {
    logits = mamba_ != nullptr ? mamba_->DecodeStep(states, last) : runner_->DecodeStep(seqs, last);
  }
  step_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - start));
  if (all_greedy) {
    if (tokens.ok() && tokens->size() != running.size()) {
      return absl::InternalError(absl::StrCat("DecodeStepGreedy returned ", tokens->size(),
                                              " tokens for ", running.size(), " sequences"));
    }
  } else if (logits.ok()) {
    // logits: [sequence][vocab], row-major.
    const size_t vocab = logits->size() / running.size();
    tokens.emplace();
    for (size_t i = 0; i < running.size(); ++i) {
      Active& a = *running[i];
      tokens->push_back(a.sampler->Sample(absl::MakeConstSpan(logits->data() + i * vocab, vocab),
                                          a.temperature, a.top_p));
    }
  } else {
    return logits.status();
  }
  if (tokens.ok()) generated_tokens_->Increment(static_cast<double>(tokens->size()));
  return tokens;
}

void DecodeWorker::CommitSequence(const CommitJob& job, worker::StoreLink& store) const {
  // Keep every full block of the sequence in the cache segment — the ones received (a copy
  // beside the prefill node's) and the ones computed here — so a later turn routed here
  // receives only what is new.
  const kv::ModelLayout& layout = model_config().layout;
  std::vector<kv::BlockHash> chain = kv::HashChain(layout.fingerprint(), job.tenant_salt,
                                                   job.seq->tokens(), layout.block_tokens());
  absl::StatusOr<int32_t> committed =
      store.CommitBlocks(chain, job.held_blocks, static_cast<int64_t>(chain.size()), *job.seq,
                         job.deadline, /*keep_copies=*/true);
  if (!committed.ok()) KV_LOG(WARNING) << job.request_id << ": commit: " << committed.status();
}

bool DecodeWorker::CommitQueueHasRoom() {
  absl::MutexLock lock(&commit_mu_);
  return static_cast<int32_t>(commits_.size()) < options_.max_batch;
}

void DecodeWorker::QueueCommit(CommitJob job) {
  {
    absl::MutexLock lock(&commit_mu_);
    if (!stop_commits_) {
      commits_.push_back(std::move(job));
      return;
    }
  }
  EndCommit(job);
}

void DecodeWorker::CommitLoop() {
  constexpr absl::Duration kSweepInterval = absl::Seconds(1);
  absl::Time next_sweep = absl::Now() + kSweepInterval;
  while (true) {
    std::optional<CommitJob> job;
    {
      absl::MutexLock lock(&commit_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_) {
        return stop_commits_ || !commits_.empty();
      };
      commit_mu_.AwaitWithDeadline(absl::Condition(&ready), next_sweep);
      if (stop_commits_) return;
      if (!commits_.empty()) {
        job = std::move(commits_.front());
        commits_.pop_front();
      }
    }
    if (job.has_value()) {
      if (worker::StoreLink* store = store_.load(std::memory_order_acquire); store != nullptr) {
        CommitSequence(*job, *store);
      }
      EndCommit(*job);
    }
    if (absl::Now() >= next_sweep) {
      table_->Sweep();
      PublishLoad();
      next_sweep = absl::Now() + kSweepInterval;
    }
  }
}

void DecodeWorker::EndCommit(CommitJob& job) {
  job.seq.reset();  // frees the slots
  table_->Unbook(job.budget);
  job.budget.clear();
  PublishLoad();
  if (job.done != nullptr) job.done->Notify();
}

void DecodeWorker::StopCommits() {
  std::deque<CommitJob> left;
  {
    absl::MutexLock lock(&commit_mu_);
    stop_commits_ = true;
  }
  if (commit_thread_.joinable()) commit_thread_.join();
  {
    absl::MutexLock lock(&commit_mu_);
    left.swap(commits_);
  }
  for (CommitJob& job : left) EndCommit(job);
}

void DecodeWorker::Retire(BatchSequence& seq, const absl::Status& status) {
  Active& a = static_cast<Active&>(seq);  // every sequence submitted is an Active
  // What admission predicts waits from: how long a sequence holds its place in the batch.
  if (status.ok() && a.joined != absl::InfinitePast()) {
    admission_->ObserveResidency(absl::Now() - a.joined);
  }
  // Mamba commits nothing from here: decode rounds the state after every step, so a
  // checkpoint taken here would not be the prefill's bit for bit (model/README.md).
  const bool commits =
      status.ok() && a.mamba == nullptr && store_.load(std::memory_order_acquire) != nullptr;
  if (commits && CommitQueueHasRoom()) {
    a.commit_done = std::make_shared<absl::Notification>();
    // The commit thread frees the slots and the booking.
    QueueCommit(CommitJob{.request_id = a.request_id,
                          .tenant_salt = a.tenant_salt,
                          .seq = std::move(a.seq),
                          .held_blocks = a.held_blocks,
                          .deadline = a.deadline,
                          .budget = std::move(a.budget),
                          .done = a.commit_done});
    return;
  }
  if (commits) commits_skipped_->Increment();
  a.seq.reset();  // frees the slots
  a.mamba.reset();
  table_->Unbook(a.budget);
  a.budget.clear();
  PublishLoad();
}

void DecodeWorker::OnIteration() {
  active_gauge_->Set(scheduler_->counts().active);
  PublishLoad();
}

absl::StatusOr<std::unique_ptr<model::MambaSequence>> DecodeWorker::AdoptPushedState(
    std::vector<std::vector<kv::SlotId>> slots, int64_t prefix_tokens) {
  const kv::ModelLayout& layout = model_config().layout;
  kv::BlockPool& pool = kv_->cache().pool(0);
  auto release = [&pool, &slots] {
    for (auto& group : slots) {
      for (kv::SlotId s : group) {
        if (s >= 0) (void)pool.Release(s);
      }
    }
  };
  const int64_t last_block = prefix_tokens / layout.block_tokens() - 1;
  if (slots.size() != 1 || last_block < 0 || static_cast<int64_t>(slots[0].size()) <= last_block ||
      slots[0][last_block] < 0) {
    release();
    return absl::InternalError("mamba: the reservation holds no slot for the pushed state");
  }
  auto seq = std::make_unique<model::MambaSequence>(layout);
  absl::Status restored = seq->Restore(
      absl::MakeConstSpan(static_cast<const uint8_t*>(pool.SlotAddress(slots[0][last_block])),
                          static_cast<size_t>(layout.BlockBytes(0))),
      prefix_tokens);
  release();  // Restore copied the bytes
  if (!restored.ok()) return restored;
  return seq;
}

absl::Status DecodeWorker::ConnectStore(const std::string& grpc_address) {
  KV_RETURN_IF_ERROR(core_->ConnectStore(grpc_address, [this] {
    kvrelay::v1::DecodeStatusResponse status = Describe();
    kvrelay::v1::NodeLoad load;
    load.set_active_requests(status.active_requests());
    load.set_queued_requests(status.queued_requests());
    load.set_free_kv_blocks(std::max<int64_t>(0, status.free_slots()));
    load.set_total_kv_blocks(status.total_slots());
    return load;
  }));
  store_.store(core_->store.get(), std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<kvrelay::v1::PromoteResponse> DecodeWorker::Promote(
    const kvrelay::v1::PromoteRequest& request, absl::Time deadline) {
  return core_->Promote(request, kvrelay::v1::ROLE_DECODE, deadline);
}

kvrelay::v1::DecodeStatusResponse DecodeWorker::Describe() {
  const ReservationLoad load = table_->Load();
  const BatchScheduler::Counts counts = scheduler_->counts();
  kvrelay::v1::DecodeStatusResponse response;
  response.set_model(options_.model_name);
  response.set_node_id(core_->node_id);
  response.set_incarnation(core_->incarnation);
  response.set_layout_fingerprint(model_config().layout.fingerprint().ToBytes());
  response.set_layout_description(model_config().layout.Describe());
  response.set_active_requests(counts.active);
  response.set_queued_requests(counts.queued);
  response.set_max_queued(options_.max_queued);
  response.set_reserved_requests(load.reservations);
  response.set_draining(draining_.load());
  // Capacity as admission sees it: blocks not booked, in the tightest group.
  int64_t free_slots = INT64_MAX, total = 0;
  for (size_t g = 0; g < load.capacity.size(); ++g) {
    free_slots = std::min(free_slots, load.capacity[g] - load.booked[g]);
    total = load.capacity[g];
  }
  response.set_free_slots(free_slots);
  response.set_total_slots(total);
  return response;
}

}  // namespace kvrelay::decode
