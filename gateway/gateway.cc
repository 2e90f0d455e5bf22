#include "gateway/gateway.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "gateway/request_validation.h"
#include "proto/grpc_status.h"

namespace kvrelay::gateway {
namespace {

absl::Status CallerError(absl::Status status) {
  return proto::Attribute(std::move(status), kvrelay::v1::ROLE_CLIENT, "",
                          kvrelay::v1::FAILURE_INVALID_REQUEST);
}

GenerateCallOptions CallOptions(const GatewayOptions& options) {
  GenerateCallOptions call;
  call.model_name = options.model_name;
  call.max_attempts = options.max_attempts;
  call.prefill_timeout = options.prefill_timeout;
  call.chunk_timeout = options.chunk_timeout;
  return call;
}

kvrelay::v1::BreakerState BreakerStateOf(CircuitBreaker::State state) {
  switch (state) {
    case CircuitBreaker::State::kClosed:
      return kvrelay::v1::BREAKER_STATE_CLOSED;
    case CircuitBreaker::State::kOpen:
      return kvrelay::v1::BREAKER_STATE_OPEN;
    case CircuitBreaker::State::kHalfOpen:
      return kvrelay::v1::BREAKER_STATE_HALF_OPEN;
  }
  return kvrelay::v1::BREAKER_STATE_UNSPECIFIED;
}

// `n` as this gateway tracks it, then its own Status (bounded by `bound`) into `out`.
void DescribeWorker(WorkerSet::Node& n, absl::Time bound, kvrelay::v1::WorkerStatus* out) {
  const bool prefill = n.prefill != nullptr;
  out->set_role(prefill ? kvrelay::v1::NODE_ROLE_PREFILL : kvrelay::v1::NODE_ROLE_DECODE);
  out->set_node_id(n.NodeId());
  out->set_incarnation(n.incarnation);
  out->set_address(n.address());
  out->set_discovered(n.discovered);
  out->set_breaker(BreakerStateOf(n.breaker.state()));
  out->set_breaker_failures(n.breaker.failures());
  out->set_in_flight(n.in_flight.load(std::memory_order_relaxed));
  out->set_reported_load(n.reported_load.load(std::memory_order_relaxed));
  out->set_picked(n.picked.load(std::memory_order_relaxed));
  out->set_busy(n.breaker.Busy());
  out->set_suspect(n.suspect.load(std::memory_order_relaxed));
  if (prefill) out->set_prefill_tokens_per_second(n.prefill_tokens.rate());
  out->set_service_ms(n.service.Last().value_or(0) * 1000);
  out->set_transfer_ms_per_mib(n.transfer_seconds_per_mib.Last().value_or(0) * 1000);
  absl::Status status;
  std::string node_id;
  uint64_t incarnation = 0;
  if (prefill) {
    absl::StatusOr<kvrelay::v1::PrefillStatusResponse> r = n.prefill->Status(bound);
    status = r.status();
    if (r.ok()) {
      node_id = r->node_id();
      incarnation = r->incarnation();
      *out->mutable_prefill() = *std::move(r);
    }
  } else {
    absl::StatusOr<kvrelay::v1::DecodeStatusResponse> r = n.decode->Status(bound);
    status = r.status();
    if (r.ok()) {
      node_id = r->node_id();
      incarnation = r->incarnation();
      *out->mutable_decode() = *std::move(r);
    }
  }
  out->set_answered(status.ok());
  if (status.ok()) {
    // A fixed worker is known by its address until it answers.
    if (out->node_id().empty()) out->set_node_id(node_id);
    if (out->incarnation() == 0) out->set_incarnation(incarnation);
    return;
  }
  out->set_status_code(static_cast<int32_t>(status.code()));
  out->set_status_error(std::string(status.message()));
  if (std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status)) {
    out->set_status_reason(info->reason());
  }
}

}  // namespace

std::string DeriveTenantSalt(const std::string& secret, const std::string& tenant) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(tenant.data()), tenant.size(), digest, &length);
  return std::string(reinterpret_cast<char*>(digest), 16);
}

Gateway::Gateway(GatewayOptions options, kv::ModelConfig config, MetricsRegistry* metrics,
                 Clock* clock, std::unique_ptr<cachestore::CacheStoreClient> store,
                 WorkerFactories factories)
    : options_(std::move(options)),
      config_(std::move(config)),
      call_options_(CallOptions(options_)),
      metrics_(metrics, options_.model_name),
      store_(std::move(store)),
      workers_(std::make_unique<WorkerSet>(
          WorkerSetOptions{
              .breaker = options_.breaker,
              .route_timeout = options_.route_timeout,
              .prefix_routing = options_.prefix_routing,
              .block_tokens = config_.layout.block_tokens(),
              .layout_fingerprint = config_.layout.fingerprint().ToBytes(),
              .layout_description = config_.layout.Describe(),
              .metrics = metrics,
              .metric_labels = {{"model_name", options_.model_name}},
              .block_bytes = config_.layout.BytesPerToken() * config_.layout.block_tokens(),
              .reserve_timeout_floor =
                  std::min(options_.reserve_timeout_floor, options_.reserve_timeout),
              .reserve_timeout = options_.reserve_timeout},
          clock, store_.get(), std::move(factories))),
      instance_id_(absl::StrCat(absl::ToUnixMicros(absl::Now()) % 1000000000)),
      tenant_in_flight_("tenant", "requests in flight", "--max-inflight-per-tenant",
                        options_.max_inflight_per_tenant,
                        metrics_.QuotaRefusals("inflight_tenant")),
      client_in_flight_("client", "requests in flight", "--max-inflight-per-client",
                        options_.max_inflight_per_client,
                        metrics_.QuotaRefusals("inflight_client")),
      tenant_reservations_("tenant", "tokens of decode KV reserved",
                           "--max-reserved-tokens-per-tenant",
                           options_.max_reserved_tokens_per_tenant,
                           metrics_.QuotaRefusals("reserved_tokens_tenant")),
      client_reservations_("client", "tokens of decode KV reserved",
                           "--max-reserved-tokens-per-client",
                           options_.max_reserved_tokens_per_client,
                           metrics_.QuotaRefusals("reserved_tokens_client")) {}

absl::StatusOr<std::unique_ptr<Gateway>> Gateway::Create(
    GatewayOptions options, Workers workers, std::unique_ptr<cachestore::CacheStoreClient> store,
    MetricsRegistry* metrics, Clock* clock) {
  const bool discovery = store != nullptr && workers.make_prefill && workers.make_decode &&
                         options.discovery_interval > absl::ZeroDuration();
  if (!discovery && (workers.prefill.empty() || workers.decode.empty())) {
    return absl::InvalidArgumentError(
        "at least one prefill and one decode worker is needed (or a cache store to discover "
        "them from)");
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_attempts must be positive, got ", options.max_attempts));
  }
  KV_ASSIGN_OR_RETURN(
      kv::ModelConfig config,
      kv::LoadHfConfig(options.model_dir + "/config.json",
                       {.kv_dtype = options.kv_cache_dtype, .block_tokens = options.block_tokens}));
  const absl::Duration discovery_interval = options.discovery_interval;
  auto gateway = std::unique_ptr<Gateway>(
      new Gateway(std::move(options), std::move(config), metrics, clock, std::move(store),
                  WorkerFactories{.make_prefill = std::move(workers.make_prefill),
                                  .make_decode = std::move(workers.make_decode)}));
  for (auto& endpoint : workers.prefill) gateway->workers_->AddFixed(std::move(endpoint));
  for (auto& endpoint : workers.decode) gateway->workers_->AddFixed(std::move(endpoint));
  if (discovery) {
    if (absl::Status s = gateway->RefreshFromRegistry(); !s.ok()) {
      KV_LOG(WARNING) << "gateway: first discovery pass failed (will retry): " << s;
    }
    gateway->workers_->StartDiscovery(discovery_interval);
  }
  if (gateway->options_.link_canary_interval > absl::ZeroDuration()) {
    Gateway* g = gateway.get();
    gateway->canary_thread_ = std::thread([g] {
      while (!g->stop_canaries_.WaitForNotificationWithTimeout(g->options_.link_canary_interval)) {
        g->RunLinkCanaries();
      }
    });
  }
  return gateway;
}

// The canary thread first; then the worker set (declared after what it uses) stops its
// discovery thread.
Gateway::~Gateway() {
  stop_canaries_.Notify();
  if (canary_thread_.joinable()) canary_thread_.join();
}

GenerateCallDeps Gateway::CallDeps(Clock* request_clock) {
  return GenerateCallDeps{.workers = workers_.get(),
                          .metrics = &metrics_,
                          .tenant_reservations = &tenant_reservations_,
                          .client_reservations = &client_reservations_,
                          .layout = &config_.layout,
                          .clock = request_clock};
}

int Gateway::RunLinkCanaries() {
  const WorkerSet::Snapshot nodes = workers_->Nodes();
  const std::optional<double> best = WorkerSet::BestTransfer(nodes.decode);
  if (!best.has_value()) return 0;
  // Unique blocks (so all of them are pushed) of about 128 KiB in all: enough to tell a link's
  // rate from the compute, little for the prefill worker.
  const kv::ModelLayout& layout = config_.layout;
  const int64_t block_bytes = std::max<int64_t>(1, layout.BytesPerToken() * layout.block_tokens());
  const int64_t blocks = std::clamp<int64_t>(((128 << 10) + block_bytes - 1) / block_bytes, 2, 16);
  const double canary_mib = static_cast<double>(blocks * block_bytes) / (1 << 20);
  int ran = 0;
  for (const auto& decode : nodes.decode) {
    const std::optional<double> last = decode->transfer_seconds_per_mib.Last();
    // Slow enough to lose picks: twice the best, and slower by more than the pickers' tie
    // margin on the canary's own push (noise on a fast link is not worth a request).
    if (!last.has_value() || *last < 2 * *best || (*last - *best) * canary_mib < 0.05 ||
        !decode->breaker.Healthy() || decode->breaker.Draining()) {
      continue;
    }
    WorkerSet::Node* prefill = nullptr;
    for (const auto& p : nodes.prefill) {
      if (!p->breaker.Healthy() || p->breaker.Busy() || p->breaker.Draining()) continue;
      if (prefill == nullptr || p->Load() < prefill->Load()) prefill = p.get();
    }
    if (prefill == nullptr) return ran;
    const uint64_t n = next_canary_.fetch_add(1);
    kvrelay::v1::GenerateRequest request;
    request.set_model(options_.model_name);
    request.set_tenant("kvrelay-link-canary");
    request.set_max_tokens(1);
    // Distinct from every other canary's and from client prompts (another tenant's salt).
    absl::BitGen random;
    for (int64_t i = 0; i <= blocks * layout.block_tokens(); ++i) {
      request.add_tokens(absl::Uniform<int32_t>(random, 0, config_.vocab_size));
    }
    Clock* const request_clock = Clock::Real();
    const absl::Time start = request_clock->Now();
    GenerateCall call(
        call_options_, CallDeps(request_clock),
        GenerateCallRequest{
            .request = &request,
            .tenant_salt = DeriveTenantSalt(options_.tenant_secret, request.tenant()),
            .request_id_prefix = absl::StrCat("gw", instance_id_, "-canary-", n),
            .start = start,
            .deadline = start + options_.reserve_timeout + absl::Seconds(2)},
        [](const kvrelay::v1::GenerateResponse&) { return true; }, [] { return false; });
    const absl::Status s = call.Canary(prefill, decode.get());
    ++ran;
    KV_LOG(DEBUG) << "gateway: link canary to decode node " << decode->address() << " via "
                  << prefill->address() << ": " << s << "; push time now "
                  << decode->transfer_seconds_per_mib.Last().value_or(0) << " s/MiB (best " << *best
                  << ")";
  }
  return ran;
}

size_t Gateway::num_prefill() const { return workers_->num_prefill(); }

size_t Gateway::num_decode() const { return workers_->num_decode(); }

absl::Status Gateway::RefreshFromRegistry() { return workers_->Refresh(); }

absl::StatusOr<kvrelay::v1::GatewayStatusResponse> Gateway::Status(absl::Time deadline) {
  const absl::Time now = absl::Now();
  if (deadline <= now) return absl::DeadlineExceededError("the status deadline has passed");
  const absl::Time bound = std::min(now + options_.route_timeout, now + (deadline - now) / 2);
  kvrelay::v1::GatewayStatusResponse response;
  response.set_model(options_.model_name);
  WorkerSet::Snapshot nodes = workers_->Nodes();
  WorkerSet::NodeList all = std::move(nodes.prefill);
  all.insert(all.end(), nodes.decode.begin(), nodes.decode.end());
  for (size_t i = 0; i < all.size(); ++i) response.add_workers();
  {
    // One thread per worker: a paused worker costs the bound once, not once per worker.
    std::vector<std::thread> askers;
    askers.reserve(all.size());
    for (size_t i = 0; i < all.size(); ++i) {
      askers.emplace_back([&all, &response, bound, i] {
        DescribeWorker(*all[i], bound, response.mutable_workers(static_cast<int>(i)));
      });
    }
    if (store_ != nullptr) {
      response.set_store_address(store_->current_address());
      const cachestore::CallOptions call{.deadline = bound};
      absl::Status store_status;
      absl::StatusOr<kvrelay::v1::ListNodesResponse> listed = store_->ListNodes(call);
      if (listed.ok()) {
        *response.mutable_registry() = *std::move(listed);
        absl::StatusOr<kvrelay::v1::StatsResponse> stats = store_->Stats(call);
        if (stats.ok()) {
          *response.mutable_store() = *std::move(stats);
        } else {
          store_status = stats.status();
        }
      } else {
        store_status = listed.status();
      }
      response.set_store_code(static_cast<int32_t>(store_status.code()));
      response.set_store_error(std::string(store_status.message()));
    }
    for (std::thread& t : askers) t.join();
  }
  return response;
}

absl::Status Gateway::Generate(const kvrelay::v1::GenerateRequest& request, absl::Time deadline,
                               const GenerateSink& sink, const std::function<bool()>& cancelled,
                               const std::string& client) {
  if (absl::Status s = ValidateGenerateRequest(request, options_.model_name, config_); !s.ok()) {
    return CallerError(std::move(s));
  }
  // The gateway's own cap first: a refusal costs nothing but this check (relaxed: the count
  // orders nothing else).
  const int32_t in_flight = in_flight_.fetch_add(1, std::memory_order_relaxed) + 1;
  metrics_.requests_in_flight->Add(1);
  absl::Cleanup leave = [this] {
    in_flight_.fetch_sub(1, std::memory_order_relaxed);
    metrics_.requests_in_flight->Add(-1);
  };
  if (options_.max_inflight > 0 && in_flight > options_.max_inflight) {
    metrics_.CountShed("gateway", "inflight");
    absl::Status refused =
        proto::Overloaded(absl::StrCat("the gateway has ", options_.max_inflight,
                                       " requests in flight (--max-inflight); retry later"),
                          kvrelay::v1::ROLE_GATEWAY, "", "inflight", /*retry_after_ms=*/0);
    metrics_.CountRequestFailure(refused);
    return refused;
  }
  KV_ASSIGN_OR_RETURN(QuotaTable::Lease tenant_slot, tenant_in_flight_.Take(request.tenant()));
  KV_ASSIGN_OR_RETURN(QuotaTable::Lease client_slot, client_in_flight_.Take(client));
  // Request time is wall-clock time: the deadline comes from the RPC, and the workers' calls
  // take absolute deadlines too. The injected clock drives policy (breakers) only.
  Clock* const request_clock = Clock::Real();
  const absl::Time start = request_clock->Now();
  metrics_.prompt_tokens->Increment(static_cast<double>(request.tokens_size()));
  GenerateCall call(
      call_options_, CallDeps(request_clock),
      GenerateCallRequest{
          .request = &request,
          .tenant_salt = DeriveTenantSalt(options_.tenant_secret, request.tenant()),
          .client = client,
          .request_id_prefix = absl::StrCat("gw", instance_id_, "-", next_request_.fetch_add(1)),
          .start = start,
          .deadline = std::min(deadline, start + options_.default_deadline)},
      sink, cancelled);
  return call.Run();
}

}  // namespace kvrelay::gateway
