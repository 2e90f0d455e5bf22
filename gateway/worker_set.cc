#include "gateway/worker_set.h"

#include <algorithm>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kv/reuse_cost.h"

namespace kvrelay::gateway {
namespace {

using Node = WorkerSet::Node;

bool Contains(const std::vector<Node*>& nodes, const Node* n) {
  return std::find(nodes.begin(), nodes.end(), n) != nodes.end();
}

kvrelay::v1::NodeRole RoleOf(bool prefill_role) {
  return prefill_role ? kvrelay::v1::NODE_ROLE_PREFILL : kvrelay::v1::NODE_ROLE_DECODE;
}

// Whether `info` is the worker `n` tracks: a discovered node by id and incarnation, a fixed
// one by its address.
bool SameWorker(const Node& n, const kvrelay::v1::NodeInfo& info) {
  return n.discovered ? info.node_id() == n.NodeId() && info.incarnation() == n.incarnation
                      : info.grpc_address() == n.address();
}

DependencyGateOptions StoreGateOptions(const WorkerSetOptions& options,
                                       const cachestore::CacheStoreClient* store) {
  DependencyGateOptions gate;
  gate.name = store != nullptr ? absl::StrCat("the cache store at ", store->current_address())
                               : std::string("the cache store");
  gate.min_cooldown = options.store_backoff;
  gate.max_cooldown = std::max(options.store_backoff, options.store_backoff_max);
  gate.metrics = options.metrics;
  gate.metric_label = "cachestore";
  gate.extra_labels = options.metric_labels;
  return gate;
}

}  // namespace

int32_t WorkerSet::Node::Load() const {
  return std::max(in_flight.load(std::memory_order_relaxed),
                  reported_load.load(std::memory_order_relaxed));
}

std::string WorkerSet::Node::NodeId() const {
  absl::MutexLock lock(&mu_);
  return node_id_;
}

void WorkerSet::Node::SetNodeId(const std::string& id) {
  absl::MutexLock lock(&mu_);
  node_id_ = id;
}

WorkerSet::WorkerSet(WorkerSetOptions options, Clock* clock, cachestore::CacheStoreClient* store,
                     WorkerFactories factories)
    : options_(std::move(options)),
      clock_(clock),
      store_(store),
      factories_(std::move(factories)),
      store_gate_(options_.store_gate_clock != nullptr ? options_.store_gate_clock : Clock::Real(),
                  StoreGateOptions(options_, store)),
      reserve_rtt_(options_.reserve_timeout_floor, options_.reserve_timeout) {
  SetNodeGauges(/*live=*/true);
}

WorkerSet::~WorkerSet() {
  {
    absl::MutexLock lock(&discovery_mu_);
    stopping_ = true;
  }
  if (discovery_.joinable()) discovery_.join();
  // Replaced under the registry's lock: no scrape reads this set after this returns.
  SetNodeGauges(/*live=*/false);
}

void WorkerSet::SetNodeGauges(bool live) {
  if (options_.metrics == nullptr) return;
  for (const bool prefill_role : {true, false}) {
    MetricLabels labels = options_.metric_labels;
    labels["role"] = prefill_role ? "prefill" : "decode";
    // Read at each scrape: a breaker turns half-open by the clock alone, with no call to hook.
    auto count = [this, prefill_role, live](bool open_only) -> std::function<double()> {
      if (!live) return [] { return 0.0; };
      return [this, prefill_role, open_only] {
        const Snapshot nodes = Nodes();
        const NodeList& list = prefill_role ? nodes.prefill : nodes.decode;
        if (!open_only) return static_cast<double>(list.size());
        return static_cast<double>(std::count_if(list.begin(), list.end(), [](const auto& n) {
          return n->breaker.state() != CircuitBreaker::State::kClosed;
        }));
      };
    };
    options_.metrics->AddGaugeFunc(
        "kvrelay:gateway_workers",
        "Workers this gateway routes to (fixed and discovered), by role.", labels,
        count(/*open_only=*/false));
    options_.metrics->AddGaugeFunc(
        "kvrelay:gateway_breakers_open",
        "Workers whose circuit breaker is open or half-open (failed; not sent requests but a "
        "probe), by role.",
        labels, count(/*open_only=*/true));
  }
}

void WorkerSet::AddFixed(std::unique_ptr<PrefillEndpoint> endpoint) {
  auto node = std::make_shared<Node>(clock_, options_.breaker, options_.learned);
  node->prefill = std::move(endpoint);
  absl::MutexLock lock(&nodes_mu_);
  prefills_.push_back(std::move(node));
}

void WorkerSet::AddFixed(std::unique_ptr<DecodeEndpoint> endpoint) {
  auto node = std::make_shared<Node>(clock_, options_.breaker, options_.learned);
  node->decode = std::move(endpoint);
  absl::MutexLock lock(&nodes_mu_);
  decodes_.push_back(std::move(node));
}

bool WorkerSet::CanDiscover() const {
  return store_ != nullptr && factories_.make_prefill && factories_.make_decode;
}

WorkerSet::Snapshot WorkerSet::Nodes() const {
  absl::MutexLock lock(&nodes_mu_);
  return Snapshot{prefills_, decodes_};
}

size_t WorkerSet::num_prefill() const {
  absl::MutexLock lock(&nodes_mu_);
  return prefills_.size();
}

size_t WorkerSet::num_decode() const {
  absl::MutexLock lock(&nodes_mu_);
  return decodes_.size();
}

void WorkerSet::StartDiscovery(absl::Duration interval) {
  discovery_ = std::thread([this, interval] { DiscoveryLoop(interval); });
}

void WorkerSet::DiscoveryLoop(absl::Duration interval) {
  discovery_mu_.Lock();
  while (!stopping_) {
    // Wakes early only to stop.
    discovery_mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval);
    if (stopping_) break;
    discovery_mu_.Unlock();
    if (absl::Status s = Refresh(); !s.ok()) {
      KV_LOG(INFO) << "gateway: discovery: " << s;  // the store may be restarting
    }
    discovery_mu_.Lock();
  }
  discovery_mu_.Unlock();
}

absl::Status WorkerSet::Refresh() {
  if (!CanDiscover()) {
    return absl::FailedPreconditionError("worker discovery needs a cache store and factories");
  }
  KV_ASSIGN_OR_RETURN(kvrelay::v1::ListNodesResponse listed, store_->ListNodes());
  Apply(listed);
  return absl::OkStatus();
}

void WorkerSet::Apply(const kvrelay::v1::ListNodesResponse& listed) {
  absl::MutexLock lock(&nodes_mu_);
  prefills_ = ApplyRole(prefills_, listed, /*prefill_role=*/true);
  decodes_ = ApplyRole(decodes_, listed, /*prefill_role=*/false);
}

WorkerSet::NodeList WorkerSet::ApplyRole(const NodeList& nodes,
                                         const kvrelay::v1::ListNodesResponse& listed,
                                         bool prefill_role) {
  const kvrelay::v1::NodeRole role = RoleOf(prefill_role);
  NodeList kept;
  for (const auto& n : nodes) {
    bool listed_same = false;
    for (const auto& info : listed.nodes()) {
      if (info.role() != role || !SameWorker(*n, info)) continue;
      listed_same = true;
      n->reported_load.store(static_cast<int32_t>(std::min<int64_t>(
                                 info.load().active_requests() + info.load().queued_requests(),
                                 std::numeric_limits<int32_t>::max())),
                             std::memory_order_relaxed);
      n->disk_read_bytes_per_second.store(
          static_cast<double>(info.load().disk_read_bytes_per_second()), std::memory_order_relaxed);
      if (n->discovered) {
        const bool suspect = info.state() == kvrelay::v1::NODE_STATE_SUSPECT;
        // Heartbeating again after the store lost it (a pause or a partition that ended): an
        // open breaker probes at once instead of waiting out its (doubled) cool-down.
        if (n->suspect.exchange(suspect, std::memory_order_relaxed) && !suspect) {
          n->breaker.ProbeNow();
        }
      }
    }
    // Fixed nodes stay; a discovered one forgotten or replaced by a new process goes
    // (in-flight requests keep their reference).
    if (!n->discovered || listed_same) kept.push_back(n);
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
    if (std::shared_ptr<Node> node = MakeDiscovered(info, prefill_role)) {
      kept.push_back(std::move(node));
    }
  }
  return kept;
}

std::shared_ptr<WorkerSet::Node> WorkerSet::MakeDiscovered(const kvrelay::v1::NodeInfo& info,
                                                           bool prefill_role) {
  auto node = std::make_shared<Node>(clock_, options_.breaker, options_.learned);
  node->discovered = true;
  node->incarnation = info.incarnation();
  node->SetNodeId(info.node_id());
  if (prefill_role) {
    absl::StatusOr<std::unique_ptr<PrefillEndpoint>> e =
        factories_.make_prefill(info.grpc_address());
    if (!e.ok()) return nullptr;
    node->prefill = *std::move(e);
  } else {
    absl::StatusOr<std::unique_ptr<DecodeEndpoint>> e = factories_.make_decode(info.grpc_address());
    if (!e.ok()) return nullptr;
    node->decode = *std::move(e);
  }
  KV_LOG(INFO) << "gateway: discovered " << (prefill_role ? "prefill" : "decode") << " node "
               << info.node_id() << " at " << info.grpc_address();
  return node;
}

WorkerSet::PrefixHoldings WorkerSet::Holdings(const std::vector<kv::BlockHash>& chain,
                                              absl::Time deadline) {
  PrefixHoldings holdings;
  auto fill = [&holdings](const kvrelay::v1::QueryPrefixResponse& answer) {
    for (const auto& node : answer.nodes()) {
      holdings.held[node.node_id()] = node.matched();
      if (node.disk_blocks() > 0) holdings.disk[node.node_id()] = node.disk_blocks();
    }
  };
  if (chain.empty()) return holdings;
  if (store_ == nullptr) {
    if (options_.query_prefix) fill(options_.query_prefix(chain));
    return holdings;
  }
  // After the store did not answer, requests route by load alone at once (one probes after
  // the cool-down) instead of each waiting out its timeout.
  // Wall-clock time, as every RPC's deadline.
  absl::StatusOr<DependencyGate::BoundCall> gated = store_gate_.AdmitCall(
      deadline, absl::Now() + options_.route_timeout, options_.store_probe_timeout);
  if (!gated.ok()) {
    holdings.store_unreachable = true;
    return holdings;
  }
  cachestore::CallOptions call;
  call.deadline = gated->deadline;
  absl::StatusOr<kvrelay::v1::QueryPrefixResponse> answer = store_->QueryPrefix(chain, call);
  gated->Done(answer.status());
  if (!answer.ok()) {
    holdings.store_unreachable = DependencyGate::DidNotAnswer(answer.status(), gated->caller_bound);
    return holdings;
  }
  fill(*answer);
  return holdings;
}

WorkerSet::NodeList WorkerSet::SameLayout(const NodeList& nodes, absl::Time deadline) {
  if (options_.layout_fingerprint.empty()) return nodes;
  NodeList same;
  same.reserve(nodes.size());
  for (const auto& n : nodes) {
    if (n->layout.load(std::memory_order_relaxed) == Node::LayoutMatch::kUnknown)
      LearnLayout(*n, deadline);
    if (n->layout.load(std::memory_order_relaxed) != Node::LayoutMatch::kOther) same.push_back(n);
  }
  return same;
}

void WorkerSet::LearnLayout(Node& n, absl::Time deadline) {
  const int64_t now_us = absl::ToUnixMicros(absl::Now());
  if (n.layout_probe_after_us.load(std::memory_order_relaxed) > now_us ||
      n.suspect.load(std::memory_order_relaxed) || !n.breaker.Healthy()) {
    return;
  }
  const absl::Time until = std::min(deadline, absl::Now() + options_.route_timeout);
  std::string fingerprint, description, node_id;
  // Both roles' Status answers carry the same three fields.
  auto take = [&](const auto& status) {
    if (!status.ok()) return;
    fingerprint = status->layout_fingerprint();
    description = status->layout_description();
    node_id = status->node_id();
  };
  if (n.prefill != nullptr) {
    take(n.prefill->Status(until));
  } else {
    take(n.decode->Status(until));
  }
  if (fingerprint.empty()) {  // no answer (or a worker too old to say): ask again later
    n.layout_probe_after_us.store(now_us + absl::ToInt64Microseconds(absl::Seconds(1)),
                                  std::memory_order_relaxed);
    return;
  }
  if (n.NodeId().empty()) n.SetNodeId(node_id);
  const bool same = fingerprint == options_.layout_fingerprint;
  Node::LayoutMatch expected = Node::LayoutMatch::kUnknown;
  if (!n.layout.compare_exchange_strong(
          expected, same ? Node::LayoutMatch::kSame : Node::LayoutMatch::kOther) ||
      same) {
    return;
  }
  const char* role = n.prefill != nullptr ? "prefill" : "decode";
  KV_LOG(WARNING) << "gateway: not pairing " << role << " worker " << node_id << " at "
                  << n.address() << ": it serves "
                  << (description.empty() ? std::string("(not described)")
                                          : description.substr(0, 256))
                  << ", this gateway routes for " << options_.layout_description
                  << " (KV is never exchanged between layouts)";
  if (options_.metrics != nullptr) {
    MetricLabels labels = options_.metric_labels;
    labels["role"] = role;
    options_.metrics
        ->GetCounter("kvrelay:gateway_layout_mismatch_total",
                     "workers found serving another KV layout (model, dtype, block size) than "
                     "this gateway's, never paired",
                     labels)
        ->Increment();
  }
}

Node* WorkerSet::TakeProbe(const NodeList& nodes, const std::vector<Node*>& excluded) {
  // A node whose breaker just turned half-open gets this request as its probe, so a node that
  // came back rejoins on the next request instead of waiting for every other node to fail.
  for (const auto& n : nodes) {
    if (!Contains(excluded, n.get()) && n->breaker.state() == CircuitBreaker::State::kHalfOpen &&
        n->breaker.Allow()) {
      return n.get();
    }
  }
  return nullptr;
}

void WorkerSet::LearnNodeIds(const NodeList& prefills, const std::vector<Node*>& excluded,
                             absl::Time deadline) {
  // Routing matches the store's per-node answer by id; a fixed worker's id comes from its
  // Status. The call's deadline is wall-clock time, as every RPC's.
  for (const auto& n : prefills) {
    if (!n->NodeId().empty() || Contains(excluded, n.get()) ||
        n->suspect.load(std::memory_order_relaxed) || !n->breaker.Healthy()) {
      continue;
    }
    absl::StatusOr<kvrelay::v1::PrefillStatusResponse> status =
        n->prefill->Status(std::min(deadline, absl::Now() + options_.route_timeout));
    if (status.ok()) n->SetNodeId(status->node_id());
  }
}

Node* WorkerSet::PickPrefill(const NodeList& prefills,
                             const absl::flat_hash_map<std::string, int32_t>& held,
                             int64_t full_blocks, const std::vector<Node*>& excluded,
                             absl::Time deadline, bool* routed,
                             const absl::flat_hash_map<std::string, int32_t>* disk) {
  *routed = false;
  LearnNodeIds(prefills, excluded, deadline);
  std::vector<int32_t> matched(prefills.size(), 0);
  std::vector<int32_t> on_disk(prefills.size(), 0);
  if (options_.prefix_routing) {
    for (size_t i = 0; i < prefills.size(); ++i) {
      auto it = held.find(prefills[i]->NodeId());
      if (it != held.end()) matched[i] = it->second;
      if (disk == nullptr) continue;
      auto d = disk->find(prefills[i]->NodeId());
      if (d != disk->end()) on_disk[i] = std::min(d->second, matched[i]);
    }
  }
  if (Node* probe = TakeProbe(prefills, excluded)) {
    CountPick("prefill", *probe, PickReason::kProbe);
    return probe;
  }
  return RankPrefill(prefills, matched, on_disk, full_blocks, excluded, routed);
}

Node* WorkerSet::RankPrefill(const NodeList& prefills, const std::vector<int32_t>& matched,
                             const std::vector<int32_t>& on_disk, int64_t full_blocks,
                             const std::vector<Node*>& excluded, bool* routed) {
  // Suspect nodes (the store lost their heartbeats; this gateway may still reach them) are
  // taken only when no other node is usable: a partitioned store must not stop serving.
  bool allow_suspect = false;
  auto usable = [&](Node* n) {
    return !Contains(excluded, n) &&
           (allow_suspect || !n->suspect.load(std::memory_order_relaxed)) && n->breaker.Healthy() &&
           !n->breaker.Busy();
  };
  // The cost model when every candidate's rates are measured: its queue (requests ahead x its
  // time per request) plus the prompt it does not hold (at its compute rate). Until then:
  // longest prefix first, then the least loaded. Ties rotate; open or busy breakers skipped.
  const uint64_t rotation = prefill_rotation_.fetch_add(1, std::memory_order_relaxed);
  // Rates a node has not refreshed for a while are forgotten toward the fleet's best (see
  // WorkerSetOptions::learned): a node measured slow once is not ranked by it forever.
  const absl::Time now = clock_->Now();
  double best_call_rate = 0, best_token_rate = 0;
  for (const auto& n : prefills) {
    best_call_rate = std::max(best_call_rate, n->prefill_calls.rate());
    best_token_rate = std::max(best_token_rate, n->prefill_tokens.rate());
  }
  auto seconds_per_call = [&](const Node& n) {
    return Forget(1.0 / n.prefill_calls.rate(), 1.0 / best_call_rate,
                  now - n.prefill_calls.last_observed(), options_.learned.half_life);
  };
  auto tokens_per_second = [&](const Node& n) {
    return Forget(n.prefill_tokens.rate(), best_token_rate, now - n.prefill_tokens.last_observed(),
                  options_.learned.half_life);
  };
  Node* best = nullptr;
  Node* least_loaded = nullptr;
  bool only_suspect = false;
  for (bool with_suspect : {false, true}) {
    only_suspect = with_suspect;
    allow_suspect = with_suspect;
    bool measured = true;
    for (const auto& n : prefills) {
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
      // A block held only on the node's disk costs its read there, at the rate the node
      // measured (nominal until it has).
      const double disk_rate = n->DiskReadRate(options_.disk_read_bytes_per_second);
      const double disk_seconds = disk_rate > 0
                                      ? static_cast<double>(on_disk[i]) *
                                            static_cast<double>(options_.block_bytes) / disk_rate
                                      : 0;
      const double cost = !options_.prefix_routing ? static_cast<double>(n->Load())
                          : measured
                              ? kv::RouteSeconds(n->Load(), seconds_per_call(*n),
                                                 (full_blocks - matched[i]) * options_.block_tokens,
                                                 tokens_per_second(*n)) +
                                    disk_seconds
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
  bool cold = false;
  if (least_loaded != nullptr && least_loaded->Cold() && best != least_loaded) {
    best = least_loaded;  // a new worker gets its first request (see Node::picked)
    cold = true;
  }
  if (best == nullptr) return nullptr;
  best->picked.fetch_add(1, std::memory_order_relaxed);
  if (!cold && best != least_loaded && best->Load() > least_loaded->Load()) {
    *routed = true;  // the prefix outweighed the load
  }
  for (size_t i = 0; i < prefills.size() && !cold && !*routed; ++i) {
    if (prefills[i].get() != best || matched[i] == 0) continue;
    // Several equally loaded nodes: the holder was taken for its prefix.
    for (size_t j = 0; j < prefills.size(); ++j) {
      if (j != i && matched[j] < matched[i] && usable(prefills[j].get())) *routed = true;
    }
  }
  CountPick("prefill", *best,
            cold           ? PickReason::kCold
            : only_suspect ? PickReason::kSuspect
            : *routed      ? PickReason::kPrefix
                           : PickReason::kLoad);
  return best;
}

std::optional<absl::Duration> WorkerSet::BusyWait(const NodeList& nodes,
                                                  const std::vector<Node*>& excluded) {
  std::optional<absl::Duration> wait;
  for (const auto& n : nodes) {
    if (Contains(excluded, n.get()) || !n->breaker.Healthy() || !n->breaker.Busy()) continue;
    const absl::Duration w = std::max(n->breaker.PredictedWait(), absl::Microseconds(1));
    wait = wait.has_value() ? std::min(*wait, w) : w;
  }
  return wait;
}

bool WorkerSet::AnyPickable(const NodeList& nodes, const std::vector<Node*>& excluded) {
  for (const auto& n : nodes) {
    if (!Contains(excluded, n.get()) && !n->breaker.Busy() && !n->breaker.Draining() &&
        n->breaker.state() != CircuitBreaker::State::kOpen) {
      return true;
    }
  }
  return false;
}

const char* PickReasonName(PickReason reason) {
  switch (reason) {
    case PickReason::kProbe:
      return "probe";
    case PickReason::kCold:
      return "cold";
    case PickReason::kLoad:
      return "load";
    case PickReason::kService:
      return "service";
    case PickReason::kPrefix:
      return "prefix";
    case PickReason::kSuspect:
      return "suspect";
  }
  return "?";
}

void WorkerSet::CountPick(const char* role, const Node& node, PickReason reason) {
  KV_LOG(DEBUG) << "gateway: " << role << " pick " << node.address() << " ("
                << PickReasonName(reason) << ", load " << node.Load() << ")";
  if (options_.metrics == nullptr) return;
  MetricLabels labels = options_.metric_labels;
  labels["role"] = role;
  labels["reason"] = PickReasonName(reason);
  options_.metrics
      ->GetCounter("kvrelay:gateway_picks_total",
                   "workers picked by this gateway, by why: probe (half-open breaker), cold (a "
                   "new worker's first request), load, service (measured time outweighed load), "
                   "prefix (the held prefix outweighed the cost), suspect (nothing else usable)",
                   labels)
      ->Increment();
}

namespace {

// The lowest of `decodes`' learned figures (the fleet's best, which the others forget toward).
std::optional<double> Best(const WorkerSet::NodeList& decodes,
                           LearnedLatency WorkerSet::Node::*figure) {
  std::optional<double> best;
  for (const auto& n : decodes) {
    if (std::optional<double> v = ((*n).*figure).Last()) best = std::min(best.value_or(*v), *v);
  }
  return best;
}

}  // namespace

std::optional<double> WorkerSet::BestService(const NodeList& decodes) {
  return Best(decodes, &Node::service);
}
std::optional<double> WorkerSet::BestTransfer(const NodeList& decodes) {
  return Best(decodes, &Node::transfer_seconds_per_mib);
}

Node* WorkerSet::PickDecode(const NodeList& decodes,
                            const absl::flat_hash_map<std::string, int32_t>& held,
                            int64_t full_blocks, const std::vector<Node*>& excluded,
                            PickReason* reason,
                            const absl::flat_hash_map<std::string, int32_t>* disk) {
  PickReason why = PickReason::kLoad;
  Node* best = TakeProbe(decodes, excluded);
  if (best != nullptr) why = PickReason::kProbe;
  const absl::Time now = clock_->Now();
  // Until some node has a figure, a nominal 50 ms per request: the load alone decides, and a
  // held prefix breaks ties.
  const double service_prior = BestService(decodes).value_or(0.05);
  const double transfer_prior = BestTransfer(decodes).value_or(0.0);
  const double mib_per_block = static_cast<double>(options_.block_bytes) / (1 << 20);
  const uint64_t rotation = decode_rotation_.fetch_add(1, std::memory_order_relaxed);
  // Suspect nodes only when nothing else is usable (see RankPrefill).
  for (bool with_suspect : {false, true}) {
    if (best != nullptr) break;
    struct Candidate {
      Node* node;
      int32_t held;
      double cost;       // with what it holds
      double cost_cold;  // as if it held nothing
      double recent;     // its recent picks (read once: each read takes its lock)
    };
    std::vector<Candidate> candidates;
    int32_t lowest_load = std::numeric_limits<int32_t>::max();
    for (size_t k = 0; k < decodes.size(); ++k) {
      Node* n = decodes[(rotation + k) % decodes.size()].get();
      if (Contains(excluded, n) || (!with_suspect && n->suspect.load(std::memory_order_relaxed)) ||
          !n->breaker.Healthy() || n->breaker.Busy()) {
        continue;
      }
      auto it = held.find(n->NodeId());
      int32_t blocks =
          it == held.end() ? 0 : static_cast<int32_t>(std::min<int64_t>(it->second, full_blocks));
      if (disk != nullptr) {
        // A decode worker reads no disk: what it holds only there is pushed like the rest.
        if (auto d = disk->find(n->NodeId()); d != disk->end()) {
          blocks = std::max(0, blocks - d->second);
        }
      }
      const double queue = (n->Load() + 1) * n->service.Value(now, service_prior);
      const double per_block =
          mib_per_block * n->transfer_seconds_per_mib.Value(now, transfer_prior);
      candidates.push_back({n, blocks, queue + (full_blocks - blocks) * per_block,
                            queue + full_blocks * per_block, n->recent_picks.Value(now)});
    }
    // A link is measured by one push before it takes more: until a node's first push is
    // measured, its unknown link looks as fast as the fleet's best, and a burst would pile on
    // a slow one (seconds each at 5 Mbit). Only while another node is usable.
    if (std::any_of(candidates.begin(), candidates.end(),
                    [](const Candidate& c) { return !c.node->LinkBeingMeasured(); })) {
      std::erase_if(candidates, [](const Candidate& c) { return c.node->LinkBeingMeasured(); });
    }
    for (const Candidate& c : candidates) lowest_load = std::min(lowest_load, c.node->Load());
    // A new worker gets its first request (see Node::picked).
    for (const Candidate& c : candidates) {
      if (c.node->Cold() && c.node->Load() <= lowest_load) {
        best = c.node;
        why = PickReason::kCold;
        break;
      }
    }
    if (best != nullptr || candidates.empty()) continue;
    // Ties: costs within 50% + tie_margin of the lowest. The lowest without any held prefix tells
    // a prefix win.
    double lowest = std::numeric_limits<double>::infinity();
    double lowest_cold = std::numeric_limits<double>::infinity();
    double recent_total = 0;
    for (const Candidate& c : candidates) {
      lowest = std::min(lowest, c.cost);
      lowest_cold = std::min(lowest_cold, c.cost_cold);
      recent_total += c.recent;
    }
    const double margin = absl::ToDoubleSeconds(options_.tie_margin);
    auto tied = [margin](double cost, double low) { return cost <= low * 1.5 + margin; };
    // A holder past 1.1x its share of recent requests (+1) wins no more by its prefix: with n
    // nodes the least picked keeps at least (n - 1.1 (n - 1)) of its share (bounded loads).
    // Only under sustained traffic (8 recent requests per node or more, about 1.2 a second
    // each): a burst of requests in a row (a conversation's turns) keeps its affinity.
    const double fair = recent_total / static_cast<double>(candidates.size());
    const double share_bound = fair >= 8 ? 1.1 * fair + 1 : std::numeric_limits<double>::infinity();
    auto prefix_rank = [&](const Candidate& c) { return c.recent <= share_bound ? c.held : 0; };
    const Candidate* chosen = nullptr;
    for (const Candidate& c : candidates) {  // in rotation order: the first of equals wins
      if (!tied(c.cost, lowest)) continue;
      if (chosen == nullptr || prefix_rank(c) > prefix_rank(*chosen)) chosen = &c;
    }
    best = chosen->node;
    if (with_suspect) {
      why = PickReason::kSuspect;
    } else if (prefix_rank(*chosen) > 0 || !tied(chosen->cost_cold, lowest_cold)) {
      why = PickReason::kPrefix;
    } else if (chosen->node->Load() > lowest_load) {
      why = PickReason::kService;
    }
  }
  if (best == nullptr) return nullptr;
  best->picked.fetch_add(1, std::memory_order_relaxed);
  best->recent_picks.Add(now);
  CountPick("decode", *best, why);
  if (reason != nullptr) *reason = why;
  return best;
}

std::vector<WorkerSet::Promotion> WorkerSet::Promotions(
    const Snapshot& nodes, const absl::flat_hash_map<std::string, int32_t>& held,
    const absl::flat_hash_map<std::string, int32_t>& disk, Node* prefill, Node* decode,
    int64_t full_blocks) const {
  std::vector<Promotion> out;
  if (disk.empty()) return out;
  const int64_t now_ns = absl::ToUnixNanos(clock_->Now());
  auto count = [](const absl::flat_hash_map<std::string, int32_t>& m, const std::string& id) {
    auto it = m.find(id);
    return it == m.end() ? int64_t{0} : int64_t{it->second};
  };
  auto promotable = [&](const Node* n) {
    return !n->NodeId().empty() && count(disk, n->NodeId()) > 0 &&
           n->promote_after_ns.load(std::memory_order_relaxed) <= now_ns;
  };
  const int64_t prefill_held =
      prefill == nullptr ? 0 : std::min(count(held, prefill->NodeId()), full_blocks);
  Node* holder = nullptr;
  int64_t holder_held = prefill_held;
  for (const NodeList* list : {&nodes.prefill, &nodes.decode}) {
    for (const auto& n : *list) {
      if (n.get() == prefill || !promotable(n.get())) continue;
      const int64_t h = std::min(count(held, n->NodeId()), full_blocks);
      if (h > holder_held) {
        holder = n.get();
        holder_held = h;
      }
    }
  }
  if (holder != nullptr && prefill != nullptr) {
    const double rate = prefill->prefill_tokens.rate();
    const double blocks = static_cast<double>(holder_held - prefill_held);
    const double disk_rate = holder->DiskReadRate(options_.disk_read_bytes_per_second);
    const double read_seconds =
        disk_rate > 0 ? blocks * static_cast<double>(options_.block_bytes) / disk_rate : 0;
    if (rate > 0 && read_seconds >= blocks * options_.block_tokens / rate) holder = nullptr;
  }
  if (holder != nullptr) out.push_back({holder, holder == decode ? 0 : prefill_held});
  if (decode != nullptr && decode != holder && promotable(decode)) out.push_back({decode, 0});
  return out;
}

void WorkerSet::PromoteFailed(Node* node) const {
  node->promote_after_ns.store(absl::ToUnixNanos(clock_->Now() + options_.promote_backoff),
                               std::memory_order_relaxed);
}

}  // namespace kvrelay::gateway
