#pragma once

// WorkerSet: the prefill and decode workers a gateway can route to and how each stands. It
// holds the fixed workers (from flags) and the ones discovered in the cache store's registry
// (ListNodes), one circuit breaker per worker, and the two pickers: PickPrefill (longest cached
// prefix or the cost model, then least load) and PickDecode (least load, then the longest held
// prefix). Both skip excluded nodes, open breakers, busy nodes (they refused for capacity a
// moment ago: see CircuitBreaker) and, while anything else is usable, nodes the registry marks
// suspect; a half-open node gets the next request as its probe; a discovered node that has had
// no request yet gets the next one it is least loaded for; a decode node whose link has no
// measured rate yet takes one push at a time until it has one. A busy node is never unhealthy:
// when the pickers find nothing, BusyWait tells overload (refuse for capacity) from sickness.
//
// Called by Gateway (discovery, counts) and by GenerateCall (snapshots, holdings, picks).
//
// Thread-safe. Lock order: `nodes_mu_` before a Node's `mu` (Apply), never the reverse; the
// discovery thread takes `discovery_mu_` alone. The store client, the endpoint factories and
// the clock must outlive the set. Nodes are shared: a request keeps the Snapshot it picked
// from, so a node discovery drops stays valid until that request ends.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cachestore/client/cache_store_client.h"
#include "common/clock.h"
#include "common/dependency_gate.h"
#include "common/metrics.h"
#include "gateway/circuit_breaker.h"
#include "gateway/learned_latency.h"
#include "gateway/worker_endpoints.h"
#include "kv/block_hash.h"
#include "kv/reuse_cost.h"
#include "kvrelay/v1/cachestore.pb.h"

namespace kvrelay::gateway {

struct WorkerSetOptions {
  CircuitBreakerOptions breaker;  // one breaker per node, with these settings
  // Bound on a prefill node's Status call (to learn its node id) during a pick, below the
  // request's deadline.
  absl::Duration route_timeout = absl::Milliseconds(500);
  // Route prefill by the prefix each node holds (see GatewayOptions::prefix_routing); off:
  // by load alone.
  bool prefix_routing = true;
  int32_t block_tokens = 16;  // the layout's tokens per block (the cost model's unit)
  // The layout requests are routed for (kv::LayoutFingerprint bytes and its Describe()):
  // workers whose Status reports another are never paired (SameLayout). Empty: no check.
  std::string layout_fingerprint;
  std::string layout_description;
  // The store's gate on the request path (QueryPrefix for holdings): after a lookup the store
  // did not answer, lookups fail fast (routing by load alone) for `store_backoff`, doubling per
  // failed probe up to `store_backoff_max`; the probe is bounded by `store_probe_timeout` too.
  // The max is short so that with an HA store set the gateway reaches a new leader within
  // about a second of its election; a probe costs one request at most the probe timeout.
  absl::Duration store_backoff = absl::Milliseconds(250);
  absl::Duration store_backoff_max = absl::Seconds(1);
  absl::Duration store_probe_timeout = absl::Milliseconds(100);
  // The gate's time; null: the real clock (the gate bounds wall-clock RPC waits, while the
  // WorkerSet's clock, which drives the breakers, may be a test's SimulatedClock). Not owned.
  Clock* store_gate_clock = nullptr;
  // Answers prefix lookups when the WorkerSet has no store client: `kvrelay simulate` asks its
  // in-process CacheStore. Empty: without a client nothing is looked up.
  std::function<kvrelay::v1::QueryPrefixResponse(const std::vector<kv::BlockHash>&)> query_prefix;
  // Where the gate's state and fast failures are exported (optional; not owned), with these
  // labels too (model_name).
  MetricsRegistry* metrics = nullptr;
  MetricLabels metric_labels;
  // Layout bytes of one block (every layer group): the decode picker's transfer term.
  int64_t block_bytes = 0;
  // Bytes per second a worker is assumed to read its disk tier at until it reports the rate it
  // measured (NodeLoad.disk_read_bytes_per_second, with its heartbeats): the prefill picker's
  // cost of a disk-held block (block_bytes / rate, against recomputing it) and Promotions'.
  // Nominal, one NVMe; the workers also recompute blocks whose read would be slower.
  double disk_read_bytes_per_second = 1e9;
  // How fast what the pickers learned about a node (service time, transfer rate) is forgotten
  // while it gets no request: half the distance to the fleet's best per half-life.
  LearnedLatencyOptions learned;
  // Decode Reserve calls are bounded by an adaptive timeout (SRTT + 4 RTTVAR of this gateway's
  // Reserve round trips) within [reserve_timeout_floor, reserve_timeout]: a hung or cut-off
  // decode worker costs a few round trips, not the fixed worst case.
  absl::Duration reserve_timeout_floor = absl::Milliseconds(500);
  absl::Duration reserve_timeout = absl::Seconds(2);
  // After a Promote to a node failed, none goes to it for this long: a hung or slow disk holder
  // costs one request one wait, not every request.
  absl::Duration promote_backoff = absl::Seconds(5);
  // Decode costs within 50% + this of the lowest are a tie: differences a request's own noise
  // makes (a new process's first requests pay connection set-up) must not steer light traffic.
  absl::Duration tie_margin = absl::Milliseconds(50);
};

// Why a picker chose a node (kvrelay:gateway_picks_total{role, reason}).
enum class PickReason : int8_t {
  kProbe,    // its breaker was half-open: this request is the probe
  kCold,     // a new worker's first request
  kLoad,     // the lowest load (and learned service time) won
  kService,  // not the least loaded: the others' measured service time outweighed its load
  kPrefix,   // the prefix it holds outweighed another node's lower cost without it
  kSuspect,  // only nodes the registry marks suspect were usable
};
const char* PickReasonName(PickReason reason);

// Makes endpoints for discovered workers from their gRPC address.
struct WorkerFactories {
  std::function<absl::StatusOr<std::unique_ptr<PrefillEndpoint>>(const std::string&)> make_prefill;
  std::function<absl::StatusOr<std::unique_ptr<DecodeEndpoint>>(const std::string&)> make_decode;
};

class WorkerSet {
 public:
  // One worker as the gateway tracks it.
  class Node {
   public:
    Node(Clock* clock, CircuitBreakerOptions breaker_options, LearnedLatencyOptions learned = {})
        : breaker(clock, breaker_options), service(learned), transfer_seconds_per_mib(learned) {}

    std::unique_ptr<PrefillEndpoint> prefill;  // exactly one of prefill / decode
    std::unique_ptr<DecodeEndpoint> decode;
    CircuitBreaker breaker;
    std::atomic<int32_t> in_flight{0};  // this gateway's requests on the node now
    // Active + queued requests the node last reported to the store (every gateway's, not only
    // this one's); refreshed by each discovery pass.
    std::atomic<int32_t> reported_load{0};
    // Its disk tier's read rate as it measured it (bytes/s; 0: unknown), refreshed likewise.
    std::atomic<double> disk_read_bytes_per_second{0};
    // That rate, or options.disk_read_bytes_per_second (nominal) while unknown.
    double DiskReadRate(double nominal) const {
      const double measured = disk_read_bytes_per_second.load(std::memory_order_relaxed);
      return measured > 0 ? measured : nominal;
    }
    // Prefill nodes: how long a Prefill call takes, and prompt tokens computed per second of it
    // (the cost model's inputs for routing).
    kv::RateMeter prefill_calls;
    kv::RateMeter prefill_tokens;
    // Decode nodes: its own time to a first token (its Reserve, plus its first token once the
    // push is done), penalized by what a failure cost; and seconds per MiB of the pushes into
    // it (a bound on its link: the Prefill call's time over the bytes it pushed). Forgotten
    // while idle (see WorkerSetOptions::learned).
    LearnedLatency service;
    LearnedLatency transfer_seconds_per_mib;
    // Attempts on this decode node, up to the end of their Prefill, that could push enough to
    // measure its link while it has no figure yet (see PickDecode: one such push at a time).
    std::atomic<int32_t> measuring_pushes{0};
    // When Promote calls to this node may resume (unix ns; see WorkerSet::PromoteFailed).
    mutable std::atomic<int64_t> promote_after_ns{0};
    // No transfer figure yet and a push in flight that may give the first one.
    bool LinkBeingMeasured() const {
      return measuring_pushes.load(std::memory_order_relaxed) > 0 &&
             !transfer_seconds_per_mib.Last().has_value();
    }
    // Requests this gateway sent it lately (halving every 5 s): bounds how much more than its
    // share a prefix it holds may win it.
    DecayingCount recent_picks;
    bool discovered = false;  // from the registry (may be dropped), not a fixed address
    // Requests this gateway has sent to the node: a worker that joined (or came back as a new
    // incarnation) and has had none is given the next one it is least loaded for, so prefix
    // affinity never starves a node that holds nothing yet.
    std::atomic<int64_t> picked{0};
    uint64_t incarnation = 0;          // discovered: the registered process
    std::atomic<bool> suspect{false};  // the registry marks it suspect: picked last
    // Whether the node serves the gateway's layout, from its Status: unknown until one answers
    // (the worker refuses another layout's requests itself meanwhile), then fixed for this
    // node (a restarted discovered worker is a new Node).
    enum class LayoutMatch : int8_t { kUnknown, kSame, kOther };
    std::atomic<LayoutMatch> layout{LayoutMatch::kUnknown};
    // No layout Status call before this (wall-clock micros) after one went unanswered.
    std::atomic<int64_t> layout_probe_after_us{0};

    // What the pickers rank by: this gateway's own count reacts at once, the reported one sees
    // the other gateways' traffic.
    int32_t Load() const;
    bool Cold() const { return discovered && picked.load(std::memory_order_relaxed) == 0; }
    const std::string& address() const {
      return prefill != nullptr ? prefill->address() : decode->address();
    }
    // Learned from the registry, Status or Reserve ("" until then).
    std::string NodeId() const;
    void SetNodeId(const std::string& id);

   private:
    mutable absl::Mutex mu_;
    std::string node_id_ ABSL_GUARDED_BY(mu_);
  };
  using NodeList = std::vector<std::shared_ptr<Node>>;
  struct Snapshot {
    NodeList prefill;
    NodeList decode;
  };

  // `store` may be null (no holdings, no discovery). `clock` drives the breakers.
  WorkerSet(WorkerSetOptions options, Clock* clock, cachestore::CacheStoreClient* store,
            WorkerFactories factories);
  ~WorkerSet();  // stops and joins the discovery thread
  WorkerSet(const WorkerSet&) = delete;
  WorkerSet& operator=(const WorkerSet&) = delete;

  // Fixed workers: always kept, whatever the registry says.
  void AddFixed(std::unique_ptr<PrefillEndpoint> endpoint);
  void AddFixed(std::unique_ptr<DecodeEndpoint> endpoint);

  // True with a store and both factories: the registry can add workers.
  bool CanDiscover() const;
  // One discovery pass: ListNodes from the store, then Apply. Errors are the store's;
  // FailedPrecondition without CanDiscover().
  absl::Status Refresh();
  // Applies one registry listing: adds workers it lists live (endpoints from the factories; a
  // factory error skips that worker until the next pass), refreshes reported loads, marks
  // suspect ones, drops discovered ones it no longer lists (or lists as a new incarnation).
  void Apply(const kvrelay::v1::ListNodesResponse& listed);
  // Calls Refresh every `interval` on a thread of its own until destruction (errors logged).
  // REQUIRES: CanDiscover(); called at most once.
  void StartDiscovery(absl::Duration interval);

  Snapshot Nodes() const;
  size_t num_prefill() const;
  size_t num_decode() const;

  struct PrefixHoldings {
    absl::flat_hash_map<std::string, int32_t> held;  // node id -> leading blocks it holds
    absl::flat_hash_map<std::string, int32_t> disk;  // of `held`, only on a node's disk tier
    // The store did not answer (timed out or unreachable), or its gate fails calls fast after
    // that: the request's prefill skips its own lookup, so a hung store costs a request one
    // wait (the gateway's), not one per process on its path.
    bool store_unreachable = false;
  };
  // Leading blocks of `chain` each node holds, from the store's QueryPrefix, bounded by
  // min(`deadline`, now + route_timeout); none without a store, for an empty chain, when the
  // store did not answer, and at once while the store's gate is open after that (a store that
  // does not answer costs reuse, not requests or latency).
  PrefixHoldings Holdings(const std::vector<kv::BlockHash>& chain,
                          absl::Time deadline = absl::InfiniteFuture());
  const DependencyGate& store_gate() const { return store_gate_; }

  // `nodes` without those known to serve another layout than options.layout_fingerprint
  // (every node when that is empty). Asks each node of unknown layout whose breaker is healthy
  // for its Status, bounded by route_timeout and `deadline`; one that does not answer is kept
  // (unknown: the worker refuses another layout's request itself) and not asked again for a
  // second. Logs each node found serving another layout once, naming both layouts, and counts
  // it in kvrelay:gateway_layout_mismatch_total{role}.
  NodeList SameLayout(const NodeList& nodes, absl::Time deadline);

  // A prefill node for a prompt of `full_blocks` whole blocks, of which `held` says who holds
  // how many, or null when none is usable. Learns unknown node ids with Status calls bounded
  // by route_timeout and `deadline`. `*routed` is set when the prefix, not the load alone,
  // decided the pick.
  // `disk` (optional): of `held`, the blocks each node holds only on its disk tier; with measured
  // rates each costs a read at the node's measured disk read rate (options.
  // disk_read_bytes_per_second until it reported one) instead of nothing.
  Node* PickPrefill(const NodeList& prefills, const absl::flat_hash_map<std::string, int32_t>& held,
                    int64_t full_blocks, const std::vector<Node*>& excluded, absl::Time deadline,
                    bool* routed, const absl::flat_hash_map<std::string, int32_t>* disk = nullptr);
  // Of the nodes of `nodes` not excluded and not open, the busy ones' shortest PredictedWait
  // (at least one microsecond); nullopt when none of them is busy. A picker that found nothing
  // while this has a value: every usable node is at capacity.
  static std::optional<absl::Duration> BusyWait(const NodeList& nodes,
                                                const std::vector<Node*>& excluded);
  // Whether a picker could return one of `nodes` now: one not excluded, not busy or draining,
  // and closed or due a half-open probe (suspect ones included). Takes no probe.
  static bool AnyPickable(const NodeList& nodes, const std::vector<Node*>& excluded);
  // The decode node with the lowest predicted cost: (load + 1) x its learned service time,
  // plus the push of the `full_blocks` blocks it does not hold at its learned transfer rate
  // (figures a node has not learned yet, or forgot, are the fleet's best). Costs within 50%
  // + tie_margin of the lowest are a tie (measurement noise must not send all light traffic to
  // one node): among them the longest held prefix wins, unless its holder already got more
  // than 1.1x its share of recent requests (+1) under sustained traffic (8 or more recent
  // requests per node), then they rotate. A new worker gets its
  // first request. Null when none is usable. `*reason` (optional) says why.
  // `disk` (optional): of `held`, the blocks each node holds only on its disk tier, which a
  // decode worker does not read back: they cost a push like blocks it does not hold.
  Node* PickDecode(const NodeList& decodes, const absl::flat_hash_map<std::string, int32_t>& held,
                   int64_t full_blocks, const std::vector<Node*>& excluded,
                   PickReason* reason = nullptr,
                   const absl::flat_hash_map<std::string, int32_t>* disk = nullptr);
  // A Promote to send before a request's Reserve: `node` reads the prompt's blocks it holds on
  // its disk tier only, from chain index `first` on, back into its DRAM segment.
  struct Promotion {
    Node* node = nullptr;
    int64_t first = 0;
  };
  // Where reading a prompt's disk-held blocks back pays, at most one Promotion per node:
  //  - the node (not `prefill`) whose held prefix runs furthest past the prefill node's and
  //    holds some of it on disk only, from the prefill node's end: once in DRAM the prefill
  //    worker pulls them (or recomputes them, by its own cost model). Only when reading them at
  //    the holder's measured disk rate (nominal until known) is faster than `prefill` computing
  //    them at its learned rate (or no rate is learned yet);
  //  - `decode`, when it holds blocks on disk only: its Reserve then finds them in DRAM, and
  //    they are not pushed.
  // Nodes whose last Promote failed less than promote_backoff ago are skipped.
  std::vector<Promotion> Promotions(const Snapshot& nodes,
                                    const absl::flat_hash_map<std::string, int32_t>& held,
                                    const absl::flat_hash_map<std::string, int32_t>& disk,
                                    Node* prefill, Node* decode, int64_t full_blocks) const;
  // A Promote to `node` failed (it did not answer in time, or refused): none is sent to it for
  // options.promote_backoff.
  void PromoteFailed(Node* node) const;

  // The bound for the next Reserve call, and a Reserve round trip to learn it from.
  absl::Duration ReserveTimeout() const { return reserve_rtt_.Timeout(); }
  void ObserveReserve(absl::Duration round_trip) { reserve_rtt_.Observe(round_trip); }
  // The fleet's best learned service time and transfer seconds per MiB among `decodes` (the
  // prior everything forgets toward); nullopt where none has learned one.
  static std::optional<double> BestService(const NodeList& decodes);
  static std::optional<double> BestTransfer(const NodeList& decodes);

 private:
  // kvrelay:gateway_workers{role} and kvrelay:gateway_breakers_open{role} in options.metrics,
  // read from this set while `live`, zero after (the destructor).
  void SetNodeGauges(bool live);
  void DiscoveryLoop(absl::Duration interval);
  // Apply for one role: the nodes of `nodes` to keep, plus the new ones `listed` brings.
  NodeList ApplyRole(const NodeList& nodes, const kvrelay::v1::ListNodesResponse& listed,
                     bool prefill_role);
  // A node for a newly listed worker, or null when its endpoint cannot be made.
  std::shared_ptr<Node> MakeDiscovered(const kvrelay::v1::NodeInfo& info, bool prefill_role);
  void LearnNodeIds(const NodeList& prefills, const std::vector<Node*>& excluded,
                    absl::Time deadline);
  // SameLayout's Status call for one node of unknown layout.
  void LearnLayout(Node& n, absl::Time deadline);
  // The first node in `nodes` (not excluded) whose breaker is half-open and lets this request
  // be its probe.
  static Node* TakeProbe(const NodeList& nodes, const std::vector<Node*>& excluded);
  // Counts a pick in kvrelay:gateway_picks_total{role, reason} and logs it at debug level.
  void CountPick(const char* role, const Node& node, PickReason reason);
  // PickPrefill's ranking once ids are known and no probe is due.
  Node* RankPrefill(const NodeList& prefills, const std::vector<int32_t>& matched,
                    const std::vector<int32_t>& on_disk, int64_t full_blocks,
                    const std::vector<Node*>& excluded, bool* routed);

  const WorkerSetOptions options_;
  Clock* const clock_;
  cachestore::CacheStoreClient* const store_;
  const WorkerFactories factories_;
  mutable absl::Mutex nodes_mu_;  // guards the two lists (not the nodes)
  NodeList prefills_ ABSL_GUARDED_BY(nodes_mu_);
  NodeList decodes_ ABSL_GUARDED_BY(nodes_mu_);
  DependencyGate store_gate_;  // QueryPrefix on the request path
  // One rotation per role, so ties are broken independently for each picker.
  std::atomic<uint64_t> prefill_rotation_{0};
  std::atomic<uint64_t> decode_rotation_{0};
  AdaptiveTimeout reserve_rtt_;
  absl::Mutex discovery_mu_;
  bool stopping_ ABSL_GUARDED_BY(discovery_mu_) = false;
  std::thread discovery_;  // last: joined before anything it touches goes
};

}  // namespace kvrelay::gateway
