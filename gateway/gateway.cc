#include "gateway/gateway.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "gateway/request_validation.h"
#include "kv/block_hash.h"
#include "kv/prompt_validation.h"
#include "proto/grpc_status.h"
#include "proto/limits.h"

namespace kvrelay::gateway {
namespace {

absl::Status CallerError(absl::Status status) {
  return proto::Attribute(std::move(status), kvrelay::v1::ROLE_CLIENT, "",
                          kvrelay::v1::FAILURE_INVALID_REQUEST);
}

bool IsOverload(const absl::Status& s) {
  if (!absl::IsResourceExhausted(s)) return false;
  std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(s);
  return !info.has_value() || info->reason() == kvrelay::v1::FAILURE_OVERLOADED;
}

Counter* QuotaRefusals(MetricsRegistry* metrics, MetricLabels labels, const std::string& quota) {
  labels["quota"] = quota;
  return metrics->GetCounter("kvrelay:gateway_quota_refusals_total",
                             "Requests refused by a per-tenant or per-client quota, by quota.",
                             labels);
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
                 Clock* clock)
    : options_(std::move(options)),
      config_(std::move(config)),
      layout_fingerprint_(config_.layout.fingerprint().ToBytes()),
      metrics_(metrics),
      model_labels_({{"model_name", options_.model_name}}),
      clock_(clock),
      instance_id_(absl::StrCat(absl::ToUnixMicros(absl::Now()) % 1000000000)),
      tenant_in_flight_("tenant", "requests in flight", "--max-inflight-per-tenant",
                        options_.max_inflight_per_tenant,
                        QuotaRefusals(metrics_, model_labels_, "inflight_tenant")),
      client_in_flight_("client", "requests in flight", "--max-inflight-per-client",
                        options_.max_inflight_per_client,
                        QuotaRefusals(metrics_, model_labels_, "inflight_client")),
      tenant_reservations_("tenant", "tokens of decode KV reserved",
                           "--max-reserved-tokens-per-tenant",
                           options_.max_reserved_tokens_per_tenant,
                           QuotaRefusals(metrics_, model_labels_, "reserved_tokens_tenant")),
      client_reservations_("client", "tokens of decode KV reserved",
                           "--max-reserved-tokens-per-client",
                           options_.max_reserved_tokens_per_client,
                           QuotaRefusals(metrics_, model_labels_, "reserved_tokens_client")) {
  // Request-level families carry vLLM's names and buckets (see the README's metrics table):
  // the gateway sees each request once, from the client's side.
  ttft_seconds_ = metrics_->GetHistogram("kvrelay:time_to_first_token_seconds",
                                         "Histogram of time to first token in seconds.",
                                         TimeToFirstTokenBucketsSeconds(), model_labels_);
  itl_seconds_ = metrics_->GetHistogram("kvrelay:inter_token_latency_seconds",
                                        "Histogram of inter-token latency in seconds.",
                                        InterTokenLatencyBucketsSeconds(), model_labels_);
  e2e_seconds_ = metrics_->GetHistogram("kvrelay:e2e_request_latency_seconds",
                                        "Histogram of e2e request latency in seconds.",
                                        RequestLatencyBucketsSeconds(), model_labels_);
  prompt_tokens_ = metrics_->GetCounter("kvrelay:prompt_tokens_total",
                                        "Prompt tokens of requests received.", model_labels_);
  generation_tokens_ = metrics_->GetCounter("kvrelay:generation_tokens_total",
                                            "Tokens generated and sent to clients.", model_labels_);
  prefix_hit_tokens_ =
      metrics_->GetCounter("kvrelay:gateway_prefix_hit_tokens_total",
                           "Prompt tokens of served requests whose KV was reused.", model_labels_);
  transferred_bytes_ =
      metrics_->GetCounter("kvrelay:gateway_transferred_kv_bytes_total",
                           "KV bytes moved prefill -> decode for served requests.", model_labels_);
  failovers_ = metrics_->GetCounter("kvrelay:gateway_failovers_total",
                                    "Attempts retried on another worker pair.", model_labels_);
  auto success = [this](const char* finished_reason) {
    MetricLabels labels = model_labels_;
    labels["finished_reason"] = finished_reason;
    return metrics_->GetCounter("kvrelay:request_success_total",
                                "Count of successfully processed requests.", labels);
  };
  success_stop_ = success("stop");
  success_length_ = success("length");
}

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
      kv::LoadHfConfig(options.model_dir + "/config.json", {.block_tokens = options.block_tokens}));
  auto gateway =
      std::unique_ptr<Gateway>(new Gateway(std::move(options), std::move(config), metrics, clock));
  gateway->store_ = std::move(store);
  {
    std::lock_guard<std::mutex> lock(gateway->nodes_mu_);
    for (auto& endpoint : workers.prefill) {
      auto node = std::make_shared<Node>(clock, gateway->options_.breaker);
      node->prefill = std::move(endpoint);
      gateway->prefills_.push_back(std::move(node));  // fixed: never removed
    }
    for (auto& endpoint : workers.decode) {
      auto node = std::make_shared<Node>(clock, gateway->options_.breaker);
      node->decode = std::move(endpoint);
      gateway->decodes_.push_back(std::move(node));
    }
  }
  gateway->factories_.make_prefill = std::move(workers.make_prefill);
  gateway->factories_.make_decode = std::move(workers.make_decode);
  if (discovery) {
    if (absl::Status s = gateway->RefreshFromRegistry(); !s.ok()) {
      KV_LOG(WARNING) << "gateway: first discovery pass failed (will retry): " << s;
    }
    Gateway* g = gateway.get();
    gateway->discovery_ = std::thread([g] { g->DiscoveryLoop(); });
  }
  return gateway;
}

Gateway::~Gateway() {
  {
    std::lock_guard<std::mutex> lock(discovery_mu_);
    stopping_ = true;
  }
  discovery_cv_.notify_all();
  if (discovery_.joinable()) discovery_.join();
}

size_t Gateway::num_prefill() const {
  std::lock_guard<std::mutex> lock(nodes_mu_);
  return prefills_.size();
}

size_t Gateway::num_decode() const {
  std::lock_guard<std::mutex> lock(nodes_mu_);
  return decodes_.size();
}

void Gateway::DiscoveryLoop() {
  std::unique_lock<std::mutex> lock(discovery_mu_);
  while (!stopping_) {
    discovery_cv_.wait_for(lock, absl::ToChronoMilliseconds(options_.discovery_interval));
    if (stopping_) break;
    lock.unlock();
    if (absl::Status s = RefreshFromRegistry(); !s.ok()) {
      KV_LOG(INFO) << "gateway: discovery: " << s;  // the store may be restarting
    }
    lock.lock();
  }
}

absl::Status Gateway::RefreshFromRegistry() {
  KV_ASSIGN_OR_RETURN(kvrelay::v1::ListNodesResponse listed, store_->ListNodes());
  std::lock_guard<std::mutex> lock(nodes_mu_);
  for (bool prefill_role : {true, false}) {
    NodeList& nodes = prefill_role ? prefills_ : decodes_;
    const kvrelay::v1::NodeRole role =
        prefill_role ? kvrelay::v1::NODE_ROLE_PREFILL : kvrelay::v1::NODE_ROLE_DECODE;
    NodeList kept;
    for (auto& n : nodes) {
      for (const auto& info : listed.nodes()) {
        const bool same =
            n->discovered ? info.node_id() == n->NodeId() && info.incarnation() == n->incarnation
                          : info.grpc_address() == n->address();
        if (info.role() == role && same) {
          n->reported_load.store(static_cast<int32_t>(std::min<int64_t>(
                                     info.load().active_requests() + info.load().queued_requests(),
                                     std::numeric_limits<int32_t>::max())),
                                 std::memory_order_relaxed);
        }
      }
      if (!n->discovered) {
        kept.push_back(n);
        continue;
      }
      bool listed_same = false;
      for (const auto& info : listed.nodes()) {
        if (info.role() == role && info.node_id() == n->NodeId() &&
            info.incarnation() == n->incarnation) {
          listed_same = true;
          n->suspect.store(info.state() == kvrelay::v1::NODE_STATE_SUSPECT,
                           std::memory_order_relaxed);
        }
      }

      // Forgotten, or replaced by a new process: in-flight requests keep their reference.
      if (listed_same) kept.push_back(n);
    }
    for (const auto& info : listed.nodes()) {
      if (info.role() != role || info.grpc_address().empty() ||
          info.state() != kvrelay::v1::NODE_STATE_LIVE) {
        continue;
      }
      bool known = false;
      for (const auto& n : kept) {
        if (n->NodeId() == info.node_id() &&
            (!n->discovered || n->incarnation == info.incarnation())) {
          known = true;
        }
        // A fixed worker at the same address is the same worker.
        if (!n->discovered && n->address() == info.grpc_address()) known = true;
      }
      if (known) continue;
      auto node = std::make_shared<Node>(clock_, options_.breaker);
      node->discovered = true;
      node->incarnation = info.incarnation();
      node->SetNodeId(info.node_id());
      if (prefill_role) {
        absl::StatusOr<std::unique_ptr<PrefillEndpoint>> e =
            factories_.make_prefill(info.grpc_address());
        if (!e.ok()) continue;
        node->prefill = *std::move(e);
      } else {
        absl::StatusOr<std::unique_ptr<DecodeEndpoint>> e =
            factories_.make_decode(info.grpc_address());
        if (!e.ok()) continue;
        node->decode = *std::move(e);
      }
      KV_LOG(INFO) << "gateway: discovered " << (prefill_role ? "prefill" : "decode") << " node "
                   << info.node_id() << " at " << info.grpc_address();
      kept.push_back(std::move(node));
    }
    nodes = std::move(kept);
  }
  return absl::OkStatus();
}

absl::Status Gateway::Validate(const kvrelay::v1::GenerateRequest& request) const {
  return ValidateGenerateRequest(request, options_.model_name, config_);
}

absl::flat_hash_map<std::string, int32_t> Gateway::QueryHoldings(
    const std::vector<kv::BlockHash>& chain) {
  absl::flat_hash_map<std::string, int32_t> held;
  if (store_ == nullptr || chain.empty()) return held;
  // A store that does not answer costs reuse, not the request: after a failure, requests
  // route without it for a second (one probes again after that) instead of each waiting out
  // route_timeout.
  const int64_t now_us = absl::ToUnixMicros(absl::Now());
  if (now_us < skip_query_until_us_.load(std::memory_order_relaxed)) return held;
  absl::StatusOr<kvrelay::v1::QueryPrefixResponse> answer = store_->QueryPrefix(chain);
  if (absl::IsUnavailable(answer.status()) || absl::IsDeadlineExceeded(answer.status())) {
    skip_query_until_us_.store(now_us + absl::ToInt64Microseconds(absl::Seconds(1)),
                               std::memory_order_relaxed);
  }
  if (!answer.ok()) return held;
  for (const auto& node : answer->nodes()) held[node.node_id()] = node.matched();
  return held;
}

Gateway::Node* Gateway::PickPrefill(const NodeList& prefills,
                                    const absl::flat_hash_map<std::string, int32_t>& held,
                                    int64_t full_blocks, const std::vector<Node*>& excluded,
                                    absl::Time deadline, bool* routed) {
  *routed = false;
  // Suspect nodes (the store lost their heartbeats; this gateway may still reach them) are
  // taken only when no other node is usable: a partitioned store must not stop serving.
  bool allow_suspect = false;
  auto usable = [&](Node* n) {
    return std::find(excluded.begin(), excluded.end(), n) == excluded.end() &&
           (allow_suspect || !n->suspect.load(std::memory_order_relaxed)) && n->breaker.Healthy();
  };
  // Node ids, learned from each worker's Status until known (routing matches the store's
  // per-node answer by id).
  for (auto& n : prefills) {
    if (!n->NodeId().empty() || !usable(n.get())) continue;
    absl::StatusOr<kvrelay::v1::PrefillStatusResponse> status =
        n->prefill->Status(std::min(deadline, absl::Now() + options_.route_timeout));
    if (status.ok()) n->SetNodeId(status->node_id());
  }
  std::vector<int32_t> matched(prefills.size(), 0);
  if (options_.prefix_routing) {
    for (size_t i = 0; i < prefills.size(); ++i) {
      auto it = held.find(prefills[i]->NodeId());
      if (it != held.end()) matched[i] = it->second;
    }
  }
  for (auto& n : prefills) {
    if (std::find(excluded.begin(), excluded.end(), n.get()) == excluded.end() &&
        n->breaker.state() == CircuitBreaker::State::kHalfOpen && n->breaker.Allow()) {
      return n.get();  // its probe (see PickDecode)
    }
  }
  // The cost model when every candidate's rates are measured: its queue (requests ahead x its
  // time per request) plus the prompt it does not hold (at its compute rate). Until then:
  // longest prefix first, then the least loaded. Ties rotate; open or busy breakers skipped.
  const int32_t block_tokens = config_.layout.block_tokens();
  const uint64_t rotation = prefill_rotation_.fetch_add(1, std::memory_order_relaxed);
  Node* best = nullptr;
  Node* least_loaded = nullptr;
  for (bool with_suspect : {false, true}) {
    allow_suspect = with_suspect;
    bool measured = true;
    for (auto& n : prefills) {
      if (usable(n.get()) && (n->prefill_calls.rate() == 0 || n->prefill_tokens.rate() == 0)) {
        measured = false;
      }
    }
    double best_cost = std::numeric_limits<double>::infinity();
    int32_t lowest_load = std::numeric_limits<int32_t>::max();
    for (size_t k = 0; k < prefills.size(); ++k) {
      const size_t i = (rotation + k) % prefills.size();
      Node* n = prefills[i].get();
      if (!usable(n)) continue;
      const double cost = !options_.prefix_routing ? static_cast<double>(n->Load())
                          : measured ? kv::RouteSeconds(n->Load(), 1.0 / n->prefill_calls.rate(),
                                                        (full_blocks - matched[i]) * block_tokens,
                                                        n->prefill_tokens.rate())
                                     : -(static_cast<double>(matched[i]) * 1000 - n->Load());
      if (cost < best_cost) {
        best_cost = cost;
        best = n;
      }
      if (n->Load() < lowest_load) {
        lowest_load = n->Load();
        least_loaded = n;
      }
    }
    if (best != nullptr) break;
  }
  if (least_loaded != nullptr && least_loaded->Cold() && best != least_loaded) {
    best = least_loaded;  // a new worker gets its first request (see Node::picked)
  }
  if (best != nullptr) best->picked.fetch_add(1, std::memory_order_relaxed);
  if (best != nullptr && best != least_loaded && best->Load() > least_loaded->Load()) {
    *routed = true;  // the prefix outweighed the load
  } else if (best != nullptr) {
    for (size_t i = 0; i < prefills.size(); ++i) {
      if (prefills[i].get() == best && matched[i] > 0) {
        // Several equally loaded nodes: the holder was taken for its prefix.
        for (size_t j = 0; j < prefills.size(); ++j) {
          if (j != i && matched[j] < matched[i] && usable(prefills[j].get())) *routed = true;
        }
      }
    }
  }
  return best;
}

Gateway::Node* Gateway::PickDecode(const NodeList& decodes,
                                   const absl::flat_hash_map<std::string, int32_t>& held,
                                   const std::vector<Node*>& excluded) {
  auto is_excluded = [&](Node* n) {
    return std::find(excluded.begin(), excluded.end(), n) != excluded.end();
  };
  // A node whose breaker just turned half-open gets this request as its probe, so a node that
  // came back rejoins on the next request instead of waiting for every other node to fail.
  for (auto& n : decodes) {
    if (!is_excluded(n.get()) && n->breaker.state() == CircuitBreaker::State::kHalfOpen &&
        n->breaker.Allow()) {
      return n.get();
    }
  }
  const uint64_t rotation = decode_rotation_.fetch_add(1, std::memory_order_relaxed);
  Node* best = nullptr;
  // Suspect nodes only when nothing else is usable (see PickPrefill).
  for (bool with_suspect : {false, true}) {
    std::vector<Node*> candidates;
    int32_t lowest_load = std::numeric_limits<int32_t>::max();
    for (size_t k = 0; k < decodes.size(); ++k) {
      Node* n = decodes[(rotation + k) % decodes.size()].get();
      if (is_excluded(n) || (!with_suspect && n->suspect.load(std::memory_order_relaxed)) ||
          !n->breaker.Healthy()) {
        continue;
      }
      candidates.push_back(n);
      lowest_load = std::min(lowest_load, n->Load());
    }
    // Within one request of the least loaded, the longest held prefix wins (then rotation):
    // it saves the push without piling a shared prefix's requests on one node.
    int32_t best_held = -1;
    Node* cold = nullptr;
    for (Node* n : candidates) {
      if (cold == nullptr && n->Cold() && n->Load() <= lowest_load) cold = n;
    }
    for (Node* n : candidates) {
      if (n->Load() > lowest_load + 1) continue;
      auto it = held.find(n->NodeId());
      const int32_t blocks = it == held.end() ? 0 : it->second;
      if (blocks > best_held || (blocks == best_held && n->Load() < best->Load())) {
        best_held = blocks;
        best = n;
      }
    }
    // A new worker gets its first request (see Node::picked).
    if (cold != nullptr) best = cold;
    if (best != nullptr) break;
  }
  if (best != nullptr) best->picked.fetch_add(1, std::memory_order_relaxed);
  return best;
}

Gateway::Blame Gateway::Attribute(const absl::Status& status, Blame called,
                                  absl::Time deadline) const {
  if (status.ok()) return Blame::kNone;
  // The caller's own deadline or cancellation is never a worker's fault.
  if ((absl::IsDeadlineExceeded(status) || absl::IsCancelled(status)) && absl::Now() >= deadline) {
    return Blame::kNone;
  }
  if (std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status)) {
    switch (info->role()) {
      case kvrelay::v1::ROLE_CLIENT:
        return Blame::kNone;
      case kvrelay::v1::ROLE_PREFILL:
        return Blame::kPrefill;
      case kvrelay::v1::ROLE_DECODE:
        return Blame::kDecode;
      default:
        break;
    }
  }
  // No detail (the call did not reach kvrelay code: connection refused, per-attempt timeout):
  // the node that was called.
  if (absl::IsInvalidArgument(status)) return Blame::kNone;
  return called;
}

void Gateway::CountFailure(const absl::Status& status, const char* role) {
  std::string reason = std::string(absl::StatusCodeToString(status.code()));
  if (std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status)) {
    reason = kvrelay::v1::FailureReason_Name(info->reason());
  }
  MetricLabels labels = model_labels_;
  labels["role"] = role;
  labels["reason"] = std::move(reason);
  metrics_
      ->GetCounter("kvrelay:gateway_worker_failures_total",
                   "Failed attempts attributed to a worker, by role and reason.", labels)
      ->Increment();
}

absl::Status Gateway::Generate(const kvrelay::v1::GenerateRequest& request, absl::Time deadline,
                               const GenerateSink& sink, const std::function<bool()>& cancelled,
                               const std::string& client) {
  if (absl::Status s = Validate(request); !s.ok()) return CallerError(std::move(s));
  KV_ASSIGN_OR_RETURN(QuotaTable::Lease tenant_slot, tenant_in_flight_.Take(request.tenant()));
  KV_ASSIGN_OR_RETURN(QuotaTable::Lease client_slot, client_in_flight_.Take(client));
  const absl::Time start = absl::Now();
  deadline = std::min(deadline, start + options_.default_deadline);
  const std::string salt = DeriveTenantSalt(options_.tenant_secret, request.tenant());
  const std::vector<int32_t> prompt(request.tokens().begin(), request.tokens().end());
  const int32_t eos = request.has_eos_token() ? request.eos_token() : -1;
  prompt_tokens_->Increment(static_cast<double>(prompt.size()));

  std::vector<int32_t> generated;
  kvrelay::v1::GenerateSummary summary;
  summary.set_prompt_tokens(static_cast<int32_t>(prompt.size()));
  absl::Time first_token_time = absl::InfiniteFuture();
  absl::Time last_token_time = absl::InfiniteFuture();
  std::vector<Node*> failed_prefill, failed_decode;
  NodeList keep_alive;  // nodes discovery may drop stay valid while this request names them
  absl::Status last_error =
      proto::Attribute(absl::UnavailableError("no usable worker pair"), kvrelay::v1::ROLE_GATEWAY,
                       "", kvrelay::v1::FAILURE_UNREACHABLE);
  int32_t failures = 0, attempts = 0, overloaded = 0;
  bool done = false;
  bool client_gone = false;
  bool stop_requested = false;

  auto finished_generating = [&] {
    return static_cast<int32_t>(generated.size()) >= request.max_tokens() ||
           (eos >= 0 && !generated.empty() && generated.back() == eos);
  };
  auto blame_node = [&](Blame blame, Node* p, Node* d, const absl::Status& s) {
    if (blame == Blame::kPrefill) {
      p->breaker.RecordFailure();
      failed_prefill.push_back(p);
      CountFailure(s, "prefill");
    } else if (blame == Blame::kDecode) {
      d->breaker.RecordFailure();
      failed_decode.push_back(d);
      CountFailure(s, "decode");
    }
  };

  while (!done && failures < options_.max_attempts && absl::Now() < deadline) {
    if (cancelled && cancelled()) {
      client_gone = true;
      break;
    }
    std::vector<int32_t> tokens = prompt;
    tokens.insert(tokens.end(), generated.begin(), generated.end());
    const int32_t remaining = request.max_tokens() - static_cast<int32_t>(generated.size());
    NodeList prefills, decodes;
    {
      std::lock_guard<std::mutex> lock(nodes_mu_);
      prefills = prefills_;
      decodes = decodes_;
    }
    keep_alive.insert(keep_alive.end(), prefills.begin(), prefills.end());
    keep_alive.insert(keep_alive.end(), decodes.begin(), decodes.end());
    // Who holds the prompt's leading blocks (prefill and decode nodes alike).
    const int32_t block_tokens = config_.layout.block_tokens();
    const int64_t full_blocks = (static_cast<int64_t>(tokens.size()) - 1) / block_tokens;
    std::vector<kv::BlockHash> chain;
    if (full_blocks > 0) {
      chain = kv::HashChain(config_.layout.fingerprint(), salt,
                            absl::MakeConstSpan(tokens).subspan(0, full_blocks * block_tokens),
                            block_tokens);
    }
    const absl::flat_hash_map<std::string, int32_t> held = QueryHoldings(chain);
    Node* d = PickDecode(decodes, held, failed_decode);
    if (d == nullptr) {
      if (overloaded > 0) {
        last_error = proto::Attribute(
            absl::ResourceExhaustedError(absl::StrCat("every decode worker is at capacity (",
                                                      overloaded, " refused); retry later")),
            kvrelay::v1::ROLE_GATEWAY, "", kvrelay::v1::FAILURE_OVERLOADED);
      } else {
        last_error =
            proto::Attribute(absl::UnavailableError(absl::StrCat(
                                 "no healthy decode worker (", decodes.size(), " known, ",
                                 failed_decode.size(), " failed for this request)")),
                             kvrelay::v1::ROLE_GATEWAY, "", kvrelay::v1::FAILURE_UNREACHABLE);
      }
      break;
    }
    bool routed = false;
    Node* p = PickPrefill(prefills, held, full_blocks, failed_prefill, deadline, &routed);
    if (p == nullptr) {
      last_error =
          proto::Attribute(absl::UnavailableError(absl::StrCat(
                               "no healthy prefill worker (", prefills.size(), " known, ",
                               failed_prefill.size(), " failed for this request)")),
                           kvrelay::v1::ROLE_GATEWAY, "", kvrelay::v1::FAILURE_UNREACHABLE);
      break;
    }
    ++attempts;
    if (attempts > 1) failovers_->Increment();
    const std::string request_id =
        absl::StrCat("gw", instance_id_, "-", next_request_.fetch_add(1), "-", attempts);
    p->in_flight.fetch_add(1, std::memory_order_relaxed);
    d->in_flight.fetch_add(1, std::memory_order_relaxed);
    struct InFlight {
      Node* p;
      Node* d;
      ~InFlight() {
        p->in_flight.fetch_sub(1, std::memory_order_relaxed);
        d->in_flight.fetch_sub(1, std::memory_order_relaxed);
      }
    } in_flight{p, d};

    // 1. Reserve on decode. What it books (prompt + remaining tokens) counts against the
    // tenant's and the client's reserved-KV quotas until the decode worker streams (or the
    // attempt ends).
    const int64_t reserved_tokens = static_cast<int64_t>(tokens.size()) + remaining;
    KV_ASSIGN_OR_RETURN(QuotaTable::Lease tenant_reservation,
                        tenant_reservations_.Take(request.tenant(), reserved_tokens));
    KV_ASSIGN_OR_RETURN(QuotaTable::Lease client_reservation,
                        client_reservations_.Take(client, reserved_tokens));
    kvrelay::v1::ReserveRequest reserve;
    reserve.set_request_id(request_id);
    reserve.set_model(options_.model_name);
    reserve.set_prompt_tokens(static_cast<int32_t>(tokens.size()));
    reserve.set_max_tokens(remaining);
    reserve.set_layout_fingerprint(layout_fingerprint_);
    std::string* packed = reserve.mutable_chain_packed();
    packed->reserve(chain.size() * 16);
    for (const kv::BlockHash& h : chain) {
      const auto bytes = h.ToBytes();
      packed->append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    }
    absl::StatusOr<kvrelay::v1::ReserveResponse> target =
        d->decode->Reserve(reserve, std::min(deadline, absl::Now() + options_.reserve_timeout));
    if (!target.ok()) {
      last_error = target.status();
      if (IsOverload(target.status())) {
        d->breaker.RecordBusy();
        failed_decode.push_back(d);
        ++overloaded;
        continue;
      }
      const Blame blame = Attribute(target.status(), Blame::kDecode, deadline);
      if (blame == Blame::kNone) return target.status();
      blame_node(blame, p, d, target.status());
      ++failures;
      continue;
    }
    d->SetNodeId(target->node_id());

    // 2. Prefill pushes into the reserved slots.
    kvrelay::v1::PrefillRequest prefill;
    prefill.set_request_id(request_id);
    prefill.set_model(options_.model_name);
    *prefill.mutable_tokens() = {tokens.begin(), tokens.end()};
    prefill.set_tenant_salt(salt);
    prefill.set_layout_fingerprint(layout_fingerprint_);
    *prefill.mutable_target() = *target;
    const absl::Time prefill_start = absl::Now();
    absl::StatusOr<kvrelay::v1::PrefillResponse> prefilled =
        p->prefill->Prefill(prefill, std::min(deadline, absl::Now() + options_.prefill_timeout));
    if (prefilled.ok()) {
      const double seconds = absl::ToDoubleSeconds(absl::Now() - prefill_start);
      p->prefill_calls.Observe(1, seconds, absl::Now());
      if (prefilled->computed_tokens() > 0) {
        p->prefill_tokens.Observe(prefilled->computed_tokens(), seconds, absl::Now());
      }
    }
    std::optional<kvrelay::v1::ErrorInfo> prefill_error =
        prefilled.ok() ? std::nullopt : proto::GetErrorInfo(prefilled.status());
    if (prefill_error.has_value() && prefill_error->reason() == kvrelay::v1::FAILURE_CORRUPT) {
      // The decode worker refused corrupted KV (checksums); it computes the prompt itself.
      KV_LOG(WARNING) << "request " << request_id << ": pushed KV was corrupted ("
                      << prefilled.status() << "); the decode worker recomputes it";
      CountFailure(prefilled.status(), "decode");
      prefilled = kvrelay::v1::PrefillResponse();
    }
    if (!prefilled.ok()) {
      d->decode->Release(request_id, target->reservation_token(), absl::Now() + absl::Seconds(1));
      last_error = prefilled.status();
      const Blame blame = Attribute(prefilled.status(), Blame::kPrefill, deadline);
      if (blame == Blame::kNone) return prefilled.status();
      blame_node(blame, p, d, prefilled.status());
      ++failures;
      continue;
    }
    p->breaker.RecordSuccess();
    if (summary.prefill_worker().empty()) {
      summary.set_prefix_hit_tokens(prefilled->prefix_hit_tokens());
    }
    summary.set_transferred_bytes(summary.transferred_bytes() + prefilled->pushed_bytes());
    summary.set_fetched_bytes(summary.fetched_bytes() + prefilled->fetched_bytes());
    summary.set_prefill_worker(p->address());
    summary.set_decode_worker(d->address());
    summary.set_prefix_source(
        routed && prefilled->prefix_source() == "local" ? "routed" : prefilled->prefix_source());
    summary.set_decode_held_blocks(target->held_blocks());

    // 3. Decode streams the tokens.
    kvrelay::v1::DecodeRequest decode;
    decode.set_request_id(request_id);
    *decode.mutable_tokens() = {tokens.begin(), tokens.end()};
    decode.set_max_tokens(remaining);
    *decode.mutable_sampling() = request.sampling();
    decode.set_pushed_tokens(prefilled->pushed_tokens());
    decode.set_eos_token(eos);
    decode.set_tenant_salt(salt);
    decode.set_layout_fingerprint(layout_fingerprint_);
    decode.set_reservation_token(target->reservation_token());
    int32_t computed_here = prefilled->computed_tokens();
    bool stream_done = false;
    absl::Status s = d->decode->Generate(
        decode, deadline, options_.chunk_timeout, [&](const kvrelay::v1::DecodeChunk& chunk) {
          // Streaming: the decode worker has claimed the reservation.
          tenant_reservation.Return();
          client_reservation.Return();
          if (chunk.tokens_size() > 0) {
            const absl::Time now = absl::Now();
            if (first_token_time == absl::InfiniteFuture()) {
              first_token_time = now;
              ttft_seconds_->Observe(absl::ToDoubleSeconds(first_token_time - start));
            } else {
              // One observation per arrival, as vLLM's per iteration (also across failovers).
              itl_seconds_->Observe(absl::ToDoubleSeconds(now - last_token_time));
            }
            last_token_time = now;
            generation_tokens_->Increment(chunk.tokens_size());
            kvrelay::v1::GenerateResponse out;
            for (int32_t t : chunk.tokens()) {
              out.add_tokens(t);
              generated.push_back(t);
            }
            if (!sink(out)) {
              stop_requested = true;  // the caller has what it wants (e.g. a stop string)
              return false;
            }
          }
          if (chunk.done()) {
            computed_here += chunk.computed_tokens();
            stream_done = true;
          }
          return !(cancelled && cancelled());
        });
    summary.set_computed_prompt_tokens(summary.computed_prompt_tokens() + computed_here);
    if (cancelled && cancelled()) {
      client_gone = true;
      break;
    }
    if (stop_requested) {
      done = true;
      break;
    }
    if (s.ok() && stream_done) {
      d->breaker.RecordSuccess();
      done = true;
      break;
    }
    if (s.ok()) s = absl::UnavailableError("the decode stream ended early");
    last_error = s;
    if (finished_generating()) {
      done = true;  // every token arrived; only the closing message was lost
      break;
    }
    const Blame blame = Attribute(s, Blame::kDecode, deadline);
    if (blame == Blame::kNone) return s;
    KV_LOG(WARNING) << "request " << request_id << " fails over after " << generated.size()
                    << " tokens: " << s;
    blame_node(blame, p, d, s);
    ++failures;
  }
  if (client_gone) {
    return proto::Attribute(absl::CancelledError("client went away"), kvrelay::v1::ROLE_CLIENT, "",
                            kvrelay::v1::FAILURE_CALLER_DEADLINE);
  }
  if (!done) {
    if (absl::Now() >= deadline && last_error.ok()) {
      last_error = absl::DeadlineExceededError("the request's deadline passed");
    }
    MetricLabels labels = model_labels_;
    labels["reason"] = std::string(absl::StatusCodeToString(last_error.code()));
    metrics_
        ->GetCounter("kvrelay:gateway_failures_total", "Failed requests by status code.", labels)
        ->Increment();
    return last_error;
  }
  const absl::Time end = absl::Now();
  summary.set_attempts(attempts);
  summary.set_generated_tokens(static_cast<int32_t>(generated.size()));
  summary.set_ttft_ms(absl::ToDoubleMilliseconds(first_token_time - start));
  summary.set_total_ms(absl::ToDoubleMilliseconds(end - start));
  e2e_seconds_->Observe(absl::ToDoubleSeconds(end - start));
  // "length" when max_tokens ended it, as vLLM's FinishReason; EOS and stop strings are "stop".
  (!stop_requested && static_cast<int32_t>(generated.size()) >= request.max_tokens()
       ? success_length_
       : success_stop_)
      ->Increment();
  prefix_hit_tokens_->Increment(summary.prefix_hit_tokens());
  transferred_bytes_->Increment(static_cast<double>(summary.transferred_bytes()));
  kvrelay::v1::GenerateResponse last;
  *last.mutable_summary() = summary;
  sink(last);
  return absl::OkStatus();
}

}  // namespace kvrelay::gateway
