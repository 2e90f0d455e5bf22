#include "decode/decode_worker.h"

#include <algorithm>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "decode/request_validation.h"
#include "kv/block_hash.h"
#include "kv/checksum.h"
#include "kv/prompt_validation.h"
#include "kv/secret.h"
#include "model/sampler.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"

namespace kvrelay::decode {
namespace {

using ::kvrelay::proto::Attribute;

constexpr absl::Duration kReleaseGrace = absl::Seconds(30);
constexpr size_t kTokenBytes = 32;  // reservation tokens and the data-plane key: 256 bits
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

// One reservation's own registration of a contiguous run of its slots in one group's pool
// (--memory-key-scope reservation). Destroying it unmaps the run (on RDMA the NIC refuses its
// key from then on) and takes it off the live gauge.
class DecodeWorker::ReservedRun {
 public:
  ReservedRun(int group, kv::SlotId first_slot, int64_t slot_count,
              transfer::MemoryRegionPtr region, Gauge* live)
      : group_(group),
        first_slot_(first_slot),
        slot_count_(slot_count),
        region_(std::move(region)),
        live_(live) {
    live_->Add(1);
  }
  ~ReservedRun() {
    region_.reset();
    live_->Add(-1);
  }
  ReservedRun(const ReservedRun&) = delete;
  ReservedRun& operator=(const ReservedRun&) = delete;

  int group() const { return group_; }
  kv::SlotId first_slot() const { return first_slot_; }
  int64_t slot_count() const { return slot_count_; }
  const transfer::MemoryRegion& region() const { return *region_; }

 private:
  const int group_;
  const kv::SlotId first_slot_;
  const int64_t slot_count_;
  transfer::MemoryRegionPtr region_;
  Gauge* const live_;
};

struct DecodeWorker::Reservation {
  std::string request_id;
  uint64_t tag = 0;
  std::string token;  // kTokenBytes from the CSPRNG; never logged
  int32_t prompt_tokens = 0;
  int32_t full_blocks = 0;
  std::vector<std::vector<kv::SlotId>> slots;  // [group][block], -1 = not wanted
  // Leading blocks loaded from this worker's cache segment at Reserve (slots [0, held) of every
  // group hold them; nobody pushes into them), and the hashes the gateway named for them.
  int32_t held_blocks = 0;
  std::vector<kv::BlockHash> held_hashes;
  int32_t expected_layers = 0;
  absl::Time expires;
  std::vector<int64_t> budget;  // booked blocks per group; moves to the Active on Generate
  // Guarded by DecodeWorker::mu_.
  int32_t layers_received = 0;
  int64_t bytes_received = 0;
  absl::Status transfer_status;
  bool claimed = false;
  bool released = false;
  absl::Time released_at;
  // Set by an allowed PushClaim: only this data-plane peer's blocks count.
  bool push_claimed = false;
  transfer::PeerId pusher = 0;
  // --memory-key-scope reservation: the registrations of this reservation's pushed slots.
  ReservedRuns runs;
};

struct DecodeWorker::Active {
  std::string request_id;
  std::unique_ptr<model::Sequence> seq;  // for Mamba an empty stand-in; the state is `mamba`
  std::unique_ptr<model::MambaSequence> mamba;
  std::vector<int32_t> tail;  // prompt tokens the scheduler computes before decoding
  int32_t max_tokens = 0;
  float temperature = 0;
  float top_p = 1.0f;
  std::unique_ptr<model::Sampler> sampler;
  int32_t eos_token = -1;
  std::string tenant_salt;
  int32_t pushed_blocks = 0;
  int32_t held_blocks = 0;      // of the pushed ones, already in the cache segment
  std::vector<int64_t> budget;  // returned when the sequence ends
  // Scheduler-only.
  int32_t generated = 0;
  int32_t last_token = -1;
  // The stream's view.
  absl::Mutex mu;
  std::vector<int32_t> out ABSL_GUARDED_BY(mu);
  bool done ABSL_GUARDED_BY(mu) = false;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
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
}

void DecodeWorker::PublishLoad() {
  int32_t reserved = 0;
  for (const auto& [tag, r] : reservations_) reserved += !r->claimed && !r->released;
  running_gauge_->Set(running_count_);
  waiting_gauge_->Set(reserved + static_cast<int32_t>(pending_.size()));
  double booked = 0;
  for (int g = 0; g < kv_->cache().num_groups(); ++g) {
    const int64_t slots = kv_->cache().pool(g).num_slots();
    if (slots > 0) booked = std::max(booked, static_cast<double>(booked_[g]) / slots);
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

absl::Status DecodeWorker::CheckLayoutFingerprint(const std::string& fingerprint) const {
  const kv::LayoutFingerprint& own = model_config().layout.fingerprint();
  if (fingerprint == own.ToBytes()) return absl::OkStatus();
  return Own(absl::FailedPreconditionError(
                 absl::StrCat("layout_fingerprint: decode node ", core_->node_id, " serves layout ",
                              own.ToHex(), ", the request was routed for another")),
             kvrelay::v1::FAILURE_IDENTITY);
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

void DecodeWorker::ReturnBudget(const std::vector<int64_t>& budget) {
  for (size_t g = 0; g < budget.size() && g < booked_.size(); ++g) booked_[g] -= budget[g];
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
  KV_ASSIGN_OR_RETURN(
      core_, worker::WorkerCore::Create(
                 core_options, [this](transfer::InboundEvent e) { OnInbound(std::move(e)); },
                 std::move(deps)));
  runner_ = core_->runner.get();
  mamba_ = core_->mamba.get();
  {
    absl::MutexLock lock(&mu_);
    booked_.assign(model_config().layout.groups().size(), 0);
  }
  kv_ = core_->kv.get();
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
  scheduler_ = std::thread([this] { SchedulerLoop(); });
  return absl::OkStatus();
}

DecodeWorker::~DecodeWorker() {
  // No more inbound events (see ~PrefillWorker): they touch reservations_ and mu_.
  if (core_ != nullptr && core_->transport != nullptr) core_->transport->SetInboundHandler(nullptr);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (scheduler_.joinable()) scheduler_.join();
  // Reservations hold slots of kv_; free them before the cache goes.
  ReservedRuns ended;
  absl::MutexLock lock(&mu_);
  for (auto& [tag, r] : reservations_) ReleaseReservationSlots(*r, ended);
  reservations_.clear();
}

const std::string& DecodeWorker::transport_address() const { return core_->transport_address; }

void DecodeWorker::Drain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

void DecodeWorker::ReleaseReservationSlots(Reservation& r, ReservedRuns& ended) {
  for (std::unique_ptr<ReservedRun>& run : r.runs) ended.push_back(std::move(run));
  r.runs.clear();
  for (size_t g = 0; g < r.slots.size(); ++g) {
    for (kv::SlotId s : r.slots[g]) {
      if (s >= 0) (void)kv_->cache().pool(static_cast<int>(g)).Release(s);
    }
    r.slots[g].clear();
  }
}

absl::Status DecodeWorker::AuthorizeBlocks(const Reservation& r,
                                           const transfer::InboundEvent& event) const {
  if (!kv::SecretEquals(r.token, event.credential)) {
    return absl::PermissionDeniedError("wrong reservation token");
  }
  if (!r.push_claimed || r.pusher != event.peer) {
    return absl::PermissionDeniedError("blocks from a peer that did not claim the reservation");
  }
  for (const transfer::ReceivedBlock& b : event.blocks) {
    bool inside = false;
    for (size_t g = 0; g < r.slots.size() && !inside; ++g) {
      const uint64_t stride = kv_->cache().pool(static_cast<int>(g)).slot_stride();
      // The block's offset in the group's pool: the pool's own region (pool scope), or one of
      // this reservation's runs (reservation scope; the pool's region is then private).
      std::optional<uint64_t> pool_offset;
      if (core_->memory_key_scope == worker::MemoryKeyScope::kPool) {
        if (kv_->region(static_cast<int>(g)).id() == b.region) pool_offset = b.offset;
      } else {
        for (const std::unique_ptr<ReservedRun>& run : r.runs) {
          if (run->group() == static_cast<int>(g) && run->region().id() == b.region &&
              b.offset < static_cast<uint64_t>(run->slot_count()) * stride) {
            pool_offset = static_cast<uint64_t>(run->first_slot()) * stride + b.offset;
          }
        }
      }
      if (!pool_offset.has_value()) continue;
      const uint64_t slot = *pool_offset / stride;
      const uint64_t within = *pool_offset % stride;
      if (b.length > stride - within) continue;
      for (size_t b = static_cast<size_t>(r.held_blocks); b < r.slots[g].size(); ++b) {
        const kv::SlotId s = r.slots[g][b];
        if (s >= 0 && static_cast<uint64_t>(s) == slot) {
          inside = true;
          break;
        }
      }
    }
    if (!inside) {
      return absl::PermissionDeniedError(absl::StrCat("block [", b.offset, ", +", b.length,
                                                      ") of region ", b.region,
                                                      " is outside the reservation's slots"));
    }
  }
  return absl::OkStatus();
}

void DecodeWorker::OnPushClaim(const transfer::InboundEvent& event) {
  kvrelay::v1::PushClaim claim;
  absl::Status verdict;
  bool expired = false;
  if (event.message.size() > kMaxClaimBytes ||
      !claim.ParseFromArray(event.message.data(), static_cast<int>(event.message.size()))) {
    verdict = absl::InvalidArgumentError("malformed push claim");
  } else {
    verdict = [&]() -> absl::Status {
      absl::MutexLock lock(&mu_);
      auto it = reservations_.find(worker::RequestTag(claim.request_id()));
      // One answer for "no such reservation" and "wrong token": a claim learns nothing.
      if (it == reservations_.end() || it->second->request_id != claim.request_id() ||
          !kv::SecretEquals(it->second->token, claim.reservation_token())) {
        return absl::PermissionDeniedError(absl::StrCat(
            "no live reservation of request '",
            claim.request_id().substr(0, limits::kMaxRequestIdBytes), "' has this token"));
      }
      Reservation& r = *it->second;
      if (r.released || (!r.claimed && core_->clock->Now() > r.expires)) {
        expired = true;
        return absl::PermissionDeniedError(absl::StrCat("the reservation of request '",
                                                        r.request_id, "' expired or was released"));
      }
      if (r.push_claimed) {
        return absl::PermissionDeniedError(
            absl::StrCat("the reservation of request '", r.request_id, "' was already claimed"));
      }
      if (claim.groups_size() != static_cast<int>(r.slots.size())) {
        return absl::PermissionDeniedError("claim names another number of layer groups");
      }
      for (int g = 0; g < claim.groups_size(); ++g) {
        const kvrelay::v1::GroupTarget& target = claim.groups(g);
        if (target.region_id() != kv_->region(g).id() ||
            target.slot_stride_bytes() != kv_->cache().pool(g).slot_stride() ||
            target.slots_size() != static_cast<int>(r.slots[g].size())) {
          return absl::PermissionDeniedError(
              absl::StrCat("claim group ", g, " is not the reservation's region or slot count"));
        }
        for (int b = 0; b < target.slots_size(); ++b) {
          if (target.slots(b) >= 0 && (b < r.held_blocks || target.slots(b) != r.slots[g][b])) {
            return absl::PermissionDeniedError(absl::StrCat("claim group ", g, " block ", b,
                                                            ": slot ", target.slots(b),
                                                            " is not the reservation's"));
          }
        }
      }
      r.push_claimed = true;
      r.pusher = event.peer;
      return absl::OkStatus();
    }();
  }
  if (!verdict.ok()) {
    refused_pushes_->Increment();
    KV_LOG(WARNING) << "data plane: push claim from peer " << event.peer
                    << " refused: " << verdict.message();
  }
  kvrelay::v1::PushVerdict answer;
  answer.set_code(static_cast<int32_t>(verdict.code()));
  answer.set_message(std::string(verdict.message()).substr(0, 1024));
  if (!verdict.ok()) {
    answer.set_reason(expired ? kvrelay::v1::FAILURE_EXPIRED : kvrelay::v1::FAILURE_UNAUTHORIZED);
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
  absl::MutexLock lock(&mu_);
  auto it = reservations_.find(event.tag);
  if (it == reservations_.end()) {
    KV_LOG(WARNING) << "blocks for an unknown request tag " << event.tag << " ignored";
    return;
  }
  Reservation& r = *it->second;
  if (absl::Status allowed = AuthorizeBlocks(r, event); !allowed.ok()) {
    refused_pushes_->Increment();
    KV_LOG(WARNING) << "data plane: blocks from peer " << event.peer << " for request '"
                    << r.request_id << "' refused: " << allowed.message();
    // The holder of the token wrote outside its slots: its reservation is not used. Without
    // the token (or from another peer), the reservation is not the sender's to spoil.
    if (r.push_claimed && r.pusher == event.peer && r.transfer_status.ok()) {
      r.transfer_status = allowed;
    }
    return;
  }
  r.layers_received += std::max(
      0, std::min(event.layers.end, model_config().layout.num_layers()) - event.layers.begin);
  for (const transfer::ReceivedBlock& b : event.blocks) r.bytes_received += b.length;
  if (!event.status.ok() && r.transfer_status.ok()) r.transfer_status = event.status;
}

absl::StatusOr<kvrelay::v1::ReserveResponse> DecodeWorker::Reserve(
    const kvrelay::v1::ReserveRequest& request) {
  const kv::ModelLayout& layout = model_config().layout;
  if (absl::Status s = ValidateReserveRequest(request, options_.model_name, layout); !s.ok()) {
    if (absl::IsFailedPrecondition(s)) {
      return Own(absl::FailedPreconditionError(
                     absl::StrCat("decode node ", core_->node_id, ": ", s.message())),
                 kvrelay::v1::FAILURE_IDENTITY);
    }
    return Invalid(std::string(s.message()));
  }
  Clock* clock = core_->clock;
  auto r = std::make_shared<Reservation>();
  KV_ASSIGN_OR_RETURN(r->token, kv::RandomSecret(kTokenBytes));
  r->request_id = request.request_id();
  r->tag = worker::RequestTag(r->request_id);
  r->prompt_tokens = request.prompt_tokens();
  // The last prompt token is always computed here: its logits give the first output token.
  r->full_blocks = (r->prompt_tokens - 1) / layout.block_tokens();
  r->expected_layers = r->full_blocks > 0 ? layout.num_layers() : 0;
  r->expires = clock->Now() + options_.reservation_ttl;
  r->budget = BlockBudget(int64_t{request.prompt_tokens()} + request.max_tokens());
  const int64_t first_query = static_cast<int64_t>(r->full_blocks) * layout.block_tokens();
  r->slots.resize(layout.groups().size());
  if (request.chain_packed().size() % 16 != 0 ||
      request.chain_packed().size() / 16 > static_cast<size_t>(limits::kMaxChainBlocks)) {
    return Invalid(absl::StrCat("chain_packed: want a multiple of 16 bytes, at most ",
                                limits::kMaxChainBlocks, " hashes; got ",
                                request.chain_packed().size(), " bytes"));
  }
  for (size_t i = 0;
       i * 16 < request.chain_packed().size() && static_cast<int64_t>(i) < r->full_blocks; ++i) {
    r->held_hashes.push_back(kv::BlockHash::FromBytes(absl::MakeConstSpan(
        reinterpret_cast<const uint8_t*>(request.chain_packed().data()) + i * 16, 16)));
  }
  // Leading blocks this worker kept from earlier requests: copied out of the segment now (the
  // store's policy may evict them later), never pushed again. Before mu_: the copies must not
  // hold up other requests. Slots not handed to the reservation are released on return.
  std::vector<std::vector<kv::SlotId>> held_slots;
  absl::Cleanup release_unused_held = [&] {
    for (size_t g = 0; g < held_slots.size(); ++g) {
      for (kv::SlotId s : held_slots[g]) (void)kv_->cache().pool(static_cast<int>(g)).Release(s);
    }
  };
  worker::StoreLink* store = store_.load(std::memory_order_acquire);
  if (store != nullptr && !r->held_hashes.empty()) {
    r->held_blocks =
        static_cast<int32_t>(store->LoadHeldPrefix(r->held_hashes, kv_->cache(), held_slots));
  }
  r->held_hashes.resize(static_cast<size_t>(r->held_blocks));
  if (r->held_blocks >= r->full_blocks) r->expected_layers = 0;

  ReservedRuns ended;  // swept reservations' registrations: unmapped once mu_ is released
  absl::StatusOr<kvrelay::v1::ReserveResponse> reserved =
      [&]() -> absl::StatusOr<kvrelay::v1::ReserveResponse> {
    absl::MutexLock lock(&mu_);
    if (draining_) {
      return Own(
          absl::UnavailableError(absl::StrCat("decode node ", core_->node_id, " is draining")),
          kvrelay::v1::FAILURE_DRAINING);
    }
    // Sweep expired or released reservations whose pushes can no longer land.
    const absl::Time now = clock->Now();
    for (auto it = reservations_.begin(); it != reservations_.end();) {
      Reservation& old = *it->second;
      const bool expired = !old.claimed && now > old.expires;
      const bool released_and_quiet = old.released && (old.layers_received >= old.expected_layers ||
                                                       now > old.released_at + kReleaseGrace);
      if ((expired && !old.released) || released_and_quiet) {
        ReleaseReservationSlots(old, ended);
        ReturnBudget(old.budget);
        old.budget.clear();
        reservations_.erase(it++);
      } else {
        ++it;
      }
    }
    if (reservations_.contains(r->tag)) {
      return Invalid(absl::StrCat("request_id '", r->request_id, "' is already reserved"));
    }
    // Admission: book everything the request can ever hold, or refuse now. Admitted requests
    // then never run out of KV mid-stream.
    for (size_t g = 0; g < layout.groups().size(); ++g) {
      const int64_t capacity = kv_->cache().pool(static_cast<int>(g)).num_slots();
      if (booked_[g] + r->budget[g] > capacity) {
        refused_overloaded_->Increment();
        return Own(absl::ResourceExhaustedError(absl::StrCat(
                       "decode node ", core_->node_id, ": KV capacity: the request needs ",
                       r->budget[g], " blocks of group ", g, ", ", capacity - booked_[g], " of ",
                       capacity, " are free")),
                   kvrelay::v1::FAILURE_OVERLOADED);
      }
    }
    for (size_t g = 0; g < layout.groups().size(); ++g) {
      std::vector<int64_t> wanted;
      for (int64_t b = r->held_blocks; b < r->full_blocks; ++b) {
        if (worker::BlockWanted(layout.groups()[g], layout.block_tokens(), b, first_query)) {
          wanted.push_back(b);
        }
      }
      absl::StatusOr<std::vector<kv::SlotId>> slots =
          kv_->cache().pool(static_cast<int>(g)).AllocateMany(static_cast<int64_t>(wanted.size()));
      if (!slots.ok()) {
        ReleaseReservationSlots(*r, ended);
        return Own(
            absl::ResourceExhaustedError(absl::StrCat(
                "decode node ", core_->node_id, ": KV pool full: ", slots.status().message())),
            kvrelay::v1::FAILURE_OVERLOADED);
      }
      r->slots[g].assign(static_cast<size_t>(r->full_blocks), -1);
      for (size_t i = 0; i < wanted.size(); ++i) r->slots[g][wanted[i]] = (*slots)[i];
      for (int64_t b = 0; b < r->held_blocks; ++b) {
        const kv::SlotId held = held_slots[g][b];
        if (worker::BlockWanted(layout.groups()[g], layout.block_tokens(), b, first_query)) {
          r->slots[g][b] = held;
        } else {
          (void)kv_->cache().pool(static_cast<int>(g)).Release(held);  // outside the window
        }
      }
      if (g < held_slots.size()) held_slots[g].clear();
    }
    for (size_t g = 0; g < layout.groups().size(); ++g) booked_[g] += r->budget[g];
    kvrelay::v1::ReserveResponse response;
    response.mutable_transport()->set_kind(core_->transport_kind);
    response.mutable_transport()->set_address(core_->transport_address);
    response.set_full_blocks(r->full_blocks);
    response.set_block_tokens(layout.block_tokens());
    response.set_ttl_ms(absl::ToInt64Milliseconds(options_.reservation_ttl));
    response.set_layout_fingerprint(layout.fingerprint().ToBytes());
    response.set_node_id(core_->node_id);
    response.set_incarnation(core_->incarnation);
    response.set_reservation_token(r->token);
    response.set_data_plane_key(data_plane_key_);
    for (size_t g = 0; g < layout.groups().size(); ++g) {
      kvrelay::v1::GroupTarget* target = response.add_groups();
      const kv::BlockPool& pool = kv_->cache().pool(static_cast<int>(g));
      target->set_region_id(kv_->region(static_cast<int>(g)).id());
      target->set_slot_stride_bytes(pool.slot_stride());
      target->set_block_bytes(static_cast<uint64_t>(layout.BlockBytes(static_cast<int>(g))));
      for (int64_t b = 0; b < r->full_blocks; ++b) {
        target->add_slots(b < r->held_blocks ? -1 : r->slots[g][b]);
      }
    }
    response.set_held_blocks(r->held_blocks);
    held_blocks_->Increment(r->held_blocks);
    reservations_[r->tag] = r;
    PublishLoad();
    return response;
  }();
  ended.clear();
  if (!reserved.ok() || core_->memory_key_scope != worker::MemoryKeyScope::kReservation) {
    return reserved;
  }
  if (absl::Status keyed = RegisterReservationRuns(r, *reserved); !keyed.ok()) {
    {
      absl::MutexLock lock(&mu_);
      auto it = reservations_.find(r->tag);
      if (it != reservations_.end() && it->second == r) {
        ReleaseReservationSlots(*r, ended);
        ReturnBudget(r->budget);
        r->budget.clear();
        reservations_.erase(it);
        PublishLoad();
      }
    }
    return Own(absl::ResourceExhaustedError(
                   absl::StrCat("decode node ", core_->node_id,
                                ": cannot register the reservation's slots: ", keyed.message())),
               kvrelay::v1::FAILURE_OVERLOADED);
  }
  return reserved;
}

absl::Status DecodeWorker::RegisterReservationRuns(const std::shared_ptr<Reservation>& r,
                                                   kvrelay::v1::ReserveResponse& response) {
  ReservedRuns runs;
  std::vector<std::vector<kv::SlotId>> pushed;
  {
    absl::MutexLock lock(&mu_);
    for (size_t g = 0; g < r->slots.size(); ++g) {
      pushed.emplace_back();
      for (size_t b = static_cast<size_t>(r->held_blocks); b < r->slots[g].size(); ++b) {
        if (r->slots[g][b] >= 0) pushed.back().push_back(r->slots[g][b]);
      }
    }
  }
  for (size_t g = 0; g < pushed.size(); ++g) {
    std::vector<kv::SlotId>& slots = pushed[g];
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
  absl::MutexLock lock(&mu_);
  auto it = reservations_.find(r->tag);
  // Released or swept meanwhile: `runs` is unmapped on return, outside mu_ (declared first).
  if (it == reservations_.end() || it->second != r || r->released) {
    return absl::OkStatus();
  }
  r->runs = std::move(runs);
  return absl::OkStatus();
}

absl::Status DecodeWorker::Release(const std::string& request_id,
                                   const std::string& reservation_token) {
  if (absl::Status s = CheckRequestId(request_id); !s.ok())
    return Invalid(std::string(s.message()));
  ReservedRuns ended;  // unmapped once mu_ is released
  absl::MutexLock lock(&mu_);
  auto it = reservations_.find(worker::RequestTag(request_id));
  if (it != reservations_.end() && !it->second->claimed && !it->second->released) {
    if (!kv::SecretEquals(it->second->token, reservation_token)) {
      return Denied(absl::StrCat("reservation_token: request '", request_id,
                                 "' is reserved, and this is not its token"));
    }
    // Slots stay quarantined until the push finished or the grace period passed, so a late
    // write can never land in a slot that belongs to someone else.
    it->second->released = true;
    it->second->released_at = core_->clock->Now();
    // Its own registrations go now unless a claimed push may still be writing (an RDMA write
    // into an unmapped key fails and takes the pusher's whole connection down with it); then
    // with the slots, once quiet.
    Reservation& r = *it->second;
    if (!r.push_claimed || r.layers_received >= r.expected_layers) {
      for (std::unique_ptr<ReservedRun>& run : r.runs) ended.push_back(std::move(run));
      r.runs.clear();
    }
    PublishLoad();
  }
  return absl::OkStatus();
}

absl::Status DecodeWorker::Generate(const kvrelay::v1::DecodeRequest& request, absl::Time deadline,
                                    const ChunkWriter& write,
                                    const std::function<bool()>& cancelled) {
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
  if (absl::Status s = CheckLayoutFingerprint(request.layout_fingerprint()); !s.ok()) return s;
  const kv::ModelLayout& layout = model_config().layout;
  std::vector<int32_t> tokens(request.tokens().begin(), request.tokens().end());

  // Wait for the pushed prefix, bounded by the caller's deadline and transfer_wait.
  std::shared_ptr<Reservation> r;
  std::vector<int64_t> budget;
  // The reservation's own registrations end with the wait (its push is terminal, or its time
  // is up and the NIC should refuse the rest); unmapped outside mu_ (declared before the locks).
  ReservedRuns ended;
  const absl::Time wait_deadline = std::min(absl::Now() + options_.transfer_wait, deadline);
  {
    absl::MutexLock lock(&mu_);
    if (draining_) {
      return Own(
          absl::UnavailableError(absl::StrCat("decode node ", core_->node_id, " is draining")),
          kvrelay::v1::FAILURE_DRAINING);
    }
    auto it = reservations_.find(worker::RequestTag(request.request_id()));
    if (it != reservations_.end() && !it->second->released) {
      if (!kv::SecretEquals(it->second->token, request.reservation_token())) {
        refused_pushes_->Increment();
        return Denied(absl::StrCat("reservation_token: request '", request.request_id(),
                                   "' is reserved, and this is not its token"));
      }
      r = it->second;
      if (r->claimed) return Invalid("request_id: this request is already generating");
      if (r->prompt_tokens != static_cast<int32_t>(tokens.size())) {
        return Invalid(absl::StrCat("tokens: reserved for ", r->prompt_tokens,
                                    " prompt tokens, got ", tokens.size()));
      }
      r->claimed = true;
      budget = std::move(r->budget);
      r->budget.clear();
      auto arrived = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return r->layers_received >= r->expected_layers || !r->transfer_status.ok();
      };
      mu_.AwaitWithDeadline(absl::Condition(&arrived), wait_deadline);
      for (std::unique_ptr<ReservedRun>& run : r->runs) ended.push_back(std::move(run));
      r->runs.clear();
      reservations_.erase(it->first);
    }
    // Admission for a request that did not reserve (or whose reservation lapsed), and the bound
    // on requests waiting for a batch slot.
    const bool queue_full = running_count_ + static_cast<int32_t>(pending_.size()) >=
                            options_.max_batch + options_.max_queued;
    bool fits = !budget.empty();
    if (budget.empty()) {
      std::vector<int64_t> need = BlockBudget(int64_t{request.max_tokens()} + tokens.size());
      fits = true;
      for (size_t g = 0; g < need.size(); ++g) {
        if (booked_[g] + need[g] > kv_->cache().pool(static_cast<int>(g)).num_slots()) {
          fits = false;
        }
      }
      if (fits) {
        for (size_t g = 0; g < need.size(); ++g) booked_[g] += need[g];
        budget = std::move(need);
      }
    }
    if (!fits || queue_full) {
      if (r != nullptr) ReleaseReservationSlots(*r, ended);
      ReturnBudget(budget);
      PublishLoad();
      refused_overloaded_->Increment();
      return Own(absl::ResourceExhaustedError(absl::StrCat(
                     "decode node ", core_->node_id, ": ",
                     queue_full ? "the batch and its queue are full" : "no KV capacity left")),
                 kvrelay::v1::FAILURE_OVERLOADED);
    }
  }

  auto active = std::make_shared<Active>();
  active->request_id = request.request_id();
  active->seq = std::make_unique<model::Sequence>(&kv_->cache());
  if (mamba_ != nullptr) active->mamba = std::make_unique<model::MambaSequence>(layout);
  active->max_tokens = request.max_tokens();
  active->temperature = temperature;
  active->top_p = top_p > 0 ? top_p : 1.0f;
  active->sampler = std::make_unique<model::Sampler>(request.sampling().seed());
  active->eos_token = request.eos_token() >= 0 && request.eos_token() < model_config().vocab_size
                          ? request.eos_token()
                          : -1;
  active->tenant_salt = request.tenant_salt();
  active->budget = std::move(budget);
  int64_t received_bytes = 0;
  bool use_pushed = false;
  if (r != nullptr) {
    absl::MutexLock lock(&mu_);
    received_bytes = r->bytes_received;
    // Held blocks count only if they are this prompt's: the hashes the gateway named at Reserve
    // must be the prompt's own (tokens, tenant, layout).
    bool held_ok = true;
    if (r->held_blocks > 0) {
      const std::vector<kv::BlockHash> own =
          kv::HashChain(layout.fingerprint(), request.tenant_salt(),
                        absl::MakeConstSpan(tokens).subspan(
                            0, static_cast<size_t>(r->held_blocks) * layout.block_tokens()),
                        layout.block_tokens());
      held_ok = own == r->held_hashes;
      if (!held_ok) {
        KV_LOG(WARNING) << request.request_id()
                        << ": the prefix named at Reserve is not this prompt's; recomputing";
      }
    }
    use_pushed = r->full_blocks > 0 && held_ok && r->layers_received >= r->expected_layers &&
                 r->transfer_status.ok() &&
                 request.pushed_tokens() == r->full_blocks * layout.block_tokens();
    if (r->full_blocks > 0 && !use_pushed) {
      recomputed_requests_->Increment();
      KV_LOG(WARNING) << request.request_id() << ": pushed KV unusable ("
                      << (r->transfer_status.ok() ? "incomplete" : r->transfer_status.ToString())
                      << "); computing the prompt here";
    }
  }
  if (use_pushed) {
    const int64_t prefix_tokens = int64_t{r->full_blocks} * layout.block_tokens();
    std::vector<std::vector<kv::SlotId>> slots = std::move(r->slots);
    r->slots.clear();
    absl::Status adopted;
    if (mamba_ != nullptr) {
      absl::StatusOr<std::unique_ptr<model::MambaSequence>> state =
          AdoptPushedState(std::move(slots), prefix_tokens);
      adopted = state.status();
      if (state.ok()) active->mamba = *std::move(state);
    } else {
      adopted = active->seq->AdoptPrefix(
          absl::MakeConstSpan(tokens).subspan(0, static_cast<size_t>(prefix_tokens)),
          std::move(slots));
    }
    if (!adopted.ok()) {
      absl::MutexLock lock(&mu_);
      ReturnBudget(active->budget);
      return Own(adopted, kvrelay::v1::FAILURE_COMPUTE);
    }
    active->tail.assign(tokens.begin() + prefix_tokens, tokens.end());
    active->pushed_blocks = r->full_blocks;
    active->held_blocks = r->held_blocks;
    received_bytes_->Increment(static_cast<double>(received_bytes));
  } else {
    if (r != nullptr) {
      absl::MutexLock lock(&mu_);
      ReleaseReservationSlots(*r, ended);
    }
    active->tail = tokens;
  }
  const int32_t computed_tokens = static_cast<int32_t>(active->tail.size());
  {
    absl::MutexLock lock(&mu_);
    pending_.push_back(active);
    ++active_count_;
    PublishLoad();
  }

  // Stream tokens as the scheduler produces them, until done, cancelled or the deadline.
  absl::Status final_status;
  bool deadline_passed = false;
  while (true) {
    std::vector<int32_t> batch;
    bool done = false;
    {
      absl::MutexLock lock(&active->mu);
      auto ready = [&active]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(active->mu) {
        return !active->out.empty() || active->done;
      };
      active->mu.AwaitWithDeadline(absl::Condition(&ready),
                                   std::min(deadline, absl::Now() + absl::Milliseconds(100)));
      batch.swap(active->out);
      done = active->done;
      final_status = active->status;
      if (cancelled && cancelled()) active->cancelled = true;
      if (!done && absl::Now() >= deadline) {
        deadline_passed = true;
        active->cancelled = true;
      }
      if (active->cancelled && batch.empty()) break;
    }
    if (!batch.empty() || done) {
      kvrelay::v1::DecodeChunk chunk;
      for (int32_t t : batch) chunk.add_tokens(t);
      if (done && final_status.ok()) {
        chunk.set_done(true);
        chunk.set_received_bytes(received_bytes);
        chunk.set_computed_tokens(computed_tokens);
      }
      if ((!batch.empty() || chunk.done()) && !write(chunk)) {
        absl::MutexLock lock(&active->mu);
        active->cancelled = true;
        break;
      }
    }
    if (done) break;
    absl::MutexLock lock(&active->mu);
    if (active->cancelled) break;
  }
  if (deadline_passed) {
    return Attribute(absl::DeadlineExceededError("the request's deadline passed while decoding"),
                     kvrelay::v1::ROLE_CLIENT, "", kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  {
    absl::MutexLock lock(&active->mu);
    if (active->cancelled) {
      return Attribute(absl::CancelledError("client went away"), kvrelay::v1::ROLE_CLIENT, "",
                       kvrelay::v1::FAILURE_CALLER_DEADLINE);
    }
  }
  if (!final_status.ok()) return Own(final_status, kvrelay::v1::FAILURE_COMPUTE);
  return absl::OkStatus();
}

void DecodeWorker::SchedulerLoop() {
  std::vector<std::shared_ptr<Active>> running;
  auto finish = [this](const std::shared_ptr<Active>& a, absl::Status status) {
    worker::StoreLink* store = store_.load(std::memory_order_acquire);
    // Mamba commits nothing from here: decode rounds the state after every step, so a
    // checkpoint taken here would not be the prefill's bit for bit (model/README.md).
    if (status.ok() && store != nullptr && a->mamba == nullptr) {
      // Multi-turn reuse: keep every full block of the sequence in the cache segment — the
      // ones received (a copy beside the prefill node's) and the ones computed here — so a
      // later turn routed here receives only what is new.
      const kv::ModelLayout& layout = model_config().layout;
      std::vector<kv::BlockHash> chain = kv::HashChain(layout.fingerprint(), a->tenant_salt,
                                                       a->seq->tokens(), layout.block_tokens());
      absl::StatusOr<int32_t> committed =
          store->CommitBlocks(chain, a->held_blocks, static_cast<int64_t>(chain.size()), *a->seq,
                              /*deadline=*/absl::InfiniteFuture(), /*keep_copies=*/true);
      if (!committed.ok()) KV_LOG(WARNING) << a->request_id << ": commit: " << committed.status();
    }
    a->seq.reset();  // frees the slots
    a->mamba.reset();
    {
      absl::MutexLock lock(&mu_);
      ReturnBudget(a->budget);
      a->budget.clear();
      PublishLoad();
    }
    absl::MutexLock lock(&a->mu);
    a->done = true;
    a->status = std::move(status);
  };
  auto emit = [this](Active& a, int32_t token) {
    a.last_token = token;
    ++a.generated;
    generated_tokens_->Increment();
    absl::MutexLock lock(&a.mu);
    a.out.push_back(token);
  };
  auto finished = [](const Active& a) {
    return a.generated >= a.max_tokens || (a.eos_token >= 0 && a.last_token == a.eos_token);
  };
  auto is_cancelled = [](Active& a) {
    absl::MutexLock lock(&a.mu);
    return a.cancelled;
  };

  while (true) {
    std::vector<std::shared_ptr<Active>> admitted;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this, &running]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !pending_.empty() || !running.empty();
      };
      mu_.Await(absl::Condition(&has_work));
      if (stopping_) break;
      while (!pending_.empty() &&
             static_cast<int32_t>(running.size() + admitted.size()) < options_.max_batch) {
        admitted.push_back(std::move(pending_.front()));
        pending_.pop_front();
      }
    }
    for (auto& a : admitted) {
      absl::StatusOr<std::vector<float>> logits = a->mamba != nullptr
                                                      ? mamba_->Prefill(*a->mamba, a->tail)
                                                      : runner_->Prefill(*a->seq, a->tail);
      if (!logits.ok()) {
        finish(a, logits.status());
        continue;
      }
      emit(*a, a->sampler->Sample(*logits, a->temperature, a->top_p));
      if (finished(*a)) {
        finish(a, absl::OkStatus());
      } else {
        running.push_back(a);
      }
    }
    // Drop sequences whose client went away.
    for (auto& a : running) {
      if (is_cancelled(*a)) finish(a, absl::CancelledError("client went away"));
    }
    running.erase(
        std::remove_if(running.begin(), running.end(),
                       [](const std::shared_ptr<Active>& a) { return a->seq == nullptr; }),
        running.end());
    if (!running.empty()) {
      std::vector<model::Sequence*> seqs;
      std::vector<model::MambaSequence*> states;
      std::vector<int32_t> last;
      for (auto& a : running) {
        seqs.push_back(a->seq.get());
        states.push_back(a->mamba.get());
        last.push_back(a->last_token);
      }
      // Greedy sequences need no logits on the host: a batch of only those asks the model for
      // token ids (Sampler::Sample at temperature 0 is Greedy, so the tokens are the same).
      const bool all_greedy =
          mamba_ == nullptr &&
          std::all_of(running.begin(), running.end(),
                      [](const std::shared_ptr<Active>& a) { return !(a->temperature > 0.0f); });
      const absl::Time start = absl::Now();
      absl::StatusOr<std::vector<float>> logits;
      absl::StatusOr<std::vector<int32_t>> greedy;
      if (all_greedy) {
        greedy = runner_->DecodeStepGreedy(seqs, last);
        if (greedy.ok() && greedy->size() != running.size()) {
          greedy = absl::InternalError(absl::StrCat("DecodeStepGreedy returned ", greedy->size(),
                                                    " tokens for ", running.size(), " sequences"));
        }
      } else {
        logits =
            mamba_ != nullptr ? mamba_->DecodeStep(states, last) : runner_->DecodeStep(seqs, last);
      }
      step_seconds_->Observe(absl::ToDoubleSeconds(absl::Now() - start));
      const absl::Status step = all_greedy ? greedy.status() : logits.status();
      if (!step.ok()) {
        for (auto& a : running) finish(a, step);
        running.clear();
      } else {
        const size_t vocab = all_greedy ? 0 : logits->size() / running.size();
        for (size_t i = 0; i < running.size(); ++i) {
          Active& a = *running[i];
          emit(a, all_greedy
                      ? (*greedy)[i]
                      : a.sampler->Sample(absl::MakeConstSpan(logits->data() + i * vocab, vocab),
                                          a.temperature, a.top_p));
          if (finished(a)) finish(running[i], absl::OkStatus());
        }
        running.erase(
            std::remove_if(running.begin(), running.end(),
                           [](const std::shared_ptr<Active>& a) { return a->seq == nullptr; }),
            running.end());
      }
    }
    {
      absl::MutexLock lock(&mu_);
      running_count_ = static_cast<int32_t>(running.size());
      active_count_ = static_cast<int32_t>(running.size() + pending_.size());
      active_gauge_->Set(active_count_);
      PublishLoad();
    }
  }
  for (auto& a : running) finish(a, absl::UnavailableError("decode worker stopping"));
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

kvrelay::v1::DecodeStatusResponse DecodeWorker::Describe() {
  kvrelay::v1::DecodeStatusResponse response;
  absl::MutexLock lock(&mu_);
  response.set_model(options_.model_name);
  response.set_node_id(core_->node_id);
  response.set_incarnation(core_->incarnation);
  response.set_layout_fingerprint(model_config().layout.fingerprint().ToBytes());
  response.set_active_requests(active_count_);
  response.set_queued_requests(static_cast<int32_t>(pending_.size()));
  response.set_max_queued(options_.max_queued);
  response.set_reserved_requests(static_cast<int32_t>(reservations_.size()));
  // Capacity as admission sees it: blocks not booked, in the tightest group.
  int64_t free_slots = INT64_MAX, total = 0;
  for (int g = 0; g < kv_->cache().num_groups(); ++g) {
    const int64_t slots = kv_->cache().pool(g).num_slots();
    free_slots = std::min(free_slots, slots - booked_[g]);
    total = slots;
  }
  response.set_free_slots(free_slots);
  response.set_total_slots(total);
  return response;
}

}  // namespace kvrelay::decode
