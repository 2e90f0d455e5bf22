#pragma once

// Gateway: the front door's logic (served as kvrelay.v1.Gateway by gateway/server/).
//
// Generate validates the request, derives the tenant's block-hash salt from the tenant id and
// a server-side secret (HMAC-SHA256; a client never chooses a salt), then per attempt picks a
// prefill worker (longest cached prefix from the cache store's QueryPrefix, then least load)
// and a decode worker (least load with room) — separate pickers per role, each skipping nodes
// whose circuit breaker is open — and drives Reserve (decode) -> Prefill -> Generate (decode
// stream), forwarding tokens as they come.
//
// Failure handling: every step has its own timeout below the request's deadline (reserve,
// prefill, the wait for each decode chunk), so an unreachable or stopped worker fails the
// attempt quickly. Which node failed is read from the kvrelay.v1.ErrorInfo the failure carries
// (never from message text); that node's breaker opens and the request retries on another
// pair, continuing from the tokens already streamed. The client's own deadline or cancellation
// and invalid input are never counted against a worker. A request every decode worker refuses
// for capacity ends at once with RESOURCE_EXHAUSTED.
//
// Thread-safe. Endpoints, the store client and the clock must outlive the gateway.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "cachestore/client/cache_store_client.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "gateway/circuit_breaker.h"
#include "gateway/quota.h"
#include "gateway/worker_endpoints.h"
#include "kv/hf_config.h"
#include "kv/reuse_cost.h"
#include "kvrelay/v1/gateway.pb.h"

namespace kvrelay::gateway {

struct GatewayOptions {
  std::string model_dir;   // for the model's layout, vocabulary and limits
  std::string model_name;  // what requests must name (empty in a request = this model)
  // Tokens per KV block (--block-tokens): the layout requests are hashed for; the store and
  // the workers must use the same.
  int32_t block_tokens = kv::kDefaultBlockTokens;
  std::string tenant_secret;
  int32_t max_attempts = 3;
  absl::Duration default_deadline = absl::Seconds(120);
  // Per-attempt bounds, each below the request's deadline.
  absl::Duration reserve_timeout = absl::Seconds(2);
  absl::Duration prefill_timeout = absl::Seconds(30);
  absl::Duration chunk_timeout = absl::Seconds(5);         // first token and every gap after it
  absl::Duration route_timeout = absl::Milliseconds(500);  // QueryPrefix / worker Status
  CircuitBreakerOptions breaker;
  // Requests one tenant may have in flight at once (0: no limit); more are refused with
  // RESOURCE_EXHAUSTED naming the tenant, so one tenant cannot take every decode slot.
  int32_t max_inflight_per_tenant = 64;
  // The same per client identity (Generate's `client`: the caller certificate's SPIFFE id, or
  // the bearer token's subject over HTTP), so one client cannot take its whole tenant's share.
  int32_t max_inflight_per_client = 32;
  // Decode KV one tenant / one client may hold reserved at once, in tokens (a reservation books
  // prompt + max_tokens on a decode worker from Reserve until that worker streams the request's
  // tokens; 0: no limit). A request that would exceed it is refused with RESOURCE_EXHAUSTED
  // naming the tenant or client. At 128 KiB of KV per token (Llama 3 8B) the defaults are
  // 128 GiB per tenant and 32 GiB per client.
  int64_t max_reserved_tokens_per_tenant = int64_t{1} << 20;
  int64_t max_reserved_tokens_per_client = int64_t{1} << 18;
  // With a store and endpoint factories: how often the registry is read for workers that
  // joined or left (ListNodes); zero turns discovery off.
  absl::Duration discovery_interval = absl::Seconds(1);
  // Route to the prefill node that holds the prompt's prefix when the cost model
  // (kv::RouteSeconds: its queue vs the compute the others would do) says so. Off: prefill
  // nodes are picked by load alone, and they pull or recompute what others hold.
  bool prefix_routing = true;
};

// HMAC-SHA256(secret, tenant), first 16 bytes.
std::string DeriveTenantSalt(const std::string& secret, const std::string& tenant);

// Receives the response stream (tokens as they come, then one message with the summary).
// Returning false stops generation early (the caller has what it wants, e.g. a stop string);
// the request still ends OK with its summary. A client that went away is reported through
// Generate's `cancelled` callback instead.
using GenerateSink = std::function<bool(const kvrelay::v1::GenerateResponse&)>;

class Gateway {
 public:
  struct Workers {
    // Fixed workers (always kept); may be empty when discovery finds them.
    std::vector<std::unique_ptr<PrefillEndpoint>> prefill;
    std::vector<std::unique_ptr<DecodeEndpoint>> decode;
    // Discovery: endpoints for workers the store's registry lists (by their gRPC address).
    std::function<absl::StatusOr<std::unique_ptr<PrefillEndpoint>>(const std::string&)>
        make_prefill;
    std::function<absl::StatusOr<std::unique_ptr<DecodeEndpoint>>(const std::string&)> make_decode;
  };
  // `store` may be null (no prefix-aware routing, no discovery). `clock` defaults to the real
  // clock.
  static absl::StatusOr<std::unique_ptr<Gateway>> Create(
      GatewayOptions options, Workers workers, std::unique_ptr<cachestore::CacheStoreClient> store,
      MetricsRegistry* metrics, Clock* clock = Clock::Real());

  ~Gateway();

  // `client` is the caller's authenticated identity for the per-client quotas ("" when there
  // is none, e.g. --insecure: only the tenant quotas apply).
  absl::Status Generate(const kvrelay::v1::GenerateRequest& request, absl::Time deadline,
                        const GenerateSink& sink, const std::function<bool()>& cancelled,
                        const std::string& client = "");

  // One discovery pass (the discovery thread calls it every discovery_interval): adds workers
  // the registry lists live, marks suspect ones, drops discovered ones it no longer lists.
  absl::Status RefreshFromRegistry();
  // Known workers by role (fixed + discovered), for tests and /metrics.
  size_t num_prefill() const;
  size_t num_decode() const;

  const kv::ModelConfig& config() const { return config_; }

 private:
  // One worker as the gateway tracks it.
  struct Node {
    Node(Clock* clock, CircuitBreakerOptions breaker_options) : breaker(clock, breaker_options) {}
    std::unique_ptr<PrefillEndpoint> prefill;  // exactly one of prefill / decode
    std::unique_ptr<DecodeEndpoint> decode;
    CircuitBreaker breaker;
    std::atomic<int32_t> in_flight{0};
    // Active + queued requests the node last reported to the store (every gateway's, not only
    // this one's); refreshed by each discovery pass.
    std::atomic<int32_t> reported_load{0};
    // What the pickers rank by: this gateway's own count reacts at once, the reported one sees
    // the other gateways' traffic.
    int32_t Load() const {
      return std::max(in_flight.load(std::memory_order_relaxed),
                      reported_load.load(std::memory_order_relaxed));
    }
    // Prefill nodes: how long a Prefill call takes, and prompt tokens computed per second of it
    // (the cost model's inputs for routing).
    kv::RateMeter prefill_calls;
    kv::RateMeter prefill_tokens;
    bool discovered = false;  // from the registry (may be dropped), not a fixed address
    // Requests this gateway has sent to the node: a worker that joined (or came back as a new
    // incarnation) and has had none is given the next one it is least loaded for, so prefix
    // affinity never starves a node that holds nothing yet.
    std::atomic<int64_t> picked{0};
    bool Cold() const { return discovered && picked.load(std::memory_order_relaxed) == 0; }
    uint64_t incarnation = 0;          // discovered: the registered process
    std::atomic<bool> suspect{false};  // the registry marks it suspect: picked last
    mutable std::mutex mu;
    std::string node_id ABSL_GUARDED_BY(mu);  // learned from Status / Reserve
    const std::string& address() const {
      return prefill != nullptr ? prefill->address() : decode->address();
    }
    std::string NodeId() const {
      std::lock_guard<std::mutex> lock(mu);
      return node_id;
    }
    void SetNodeId(const std::string& id) {
      std::lock_guard<std::mutex> lock(mu);
      node_id = id;
    }
  };
  enum class Blame { kNone, kPrefill, kDecode };

  Gateway(GatewayOptions options, kv::ModelConfig config, MetricsRegistry* metrics, Clock* clock);
  absl::Status Validate(const kvrelay::v1::GenerateRequest& request) const;
  using NodeList = std::vector<std::shared_ptr<Node>>;
  // Leading blocks of `chain` each node holds (node id -> blocks), from the store; empty when
  // the store is unknown, skipped after a failure, or did not answer.
  absl::flat_hash_map<std::string, int32_t> QueryHoldings(const std::vector<kv::BlockHash>& chain);
  // `routed` is set when the prefix, not the load alone, decided the pick.
  Node* PickPrefill(const NodeList& prefills, const absl::flat_hash_map<std::string, int32_t>& held,
                    int64_t full_blocks, const std::vector<Node*>& excluded, absl::Time deadline,
                    bool* routed);
  // The least loaded decode node; among those within one request of it, the one holding the
  // longest prefix (it is not sent again).
  Node* PickDecode(const NodeList& decodes, const absl::flat_hash_map<std::string, int32_t>& held,
                   const std::vector<Node*>& excluded);
  void DiscoveryLoop();
  // Which node a failed step is attributed to, from its ErrorInfo (the node called when the
  // failure carries none). kNone for the caller's own deadline, cancellation or bad input.
  Blame Attribute(const absl::Status& status, Blame called, absl::Time deadline) const;
  void CountFailure(const absl::Status& status, const char* role);

  const GatewayOptions options_;
  const kv::ModelConfig config_;
  const std::string layout_fingerprint_;
  MetricsRegistry* metrics_;
  const MetricLabels model_labels_;  // {model_name}: on every family the gateway exports
  Clock* const clock_;
  std::unique_ptr<cachestore::CacheStoreClient> store_;
  Workers factories_;            // make_prefill / make_decode only
  mutable std::mutex nodes_mu_;  // guards the two lists (not the nodes)
  NodeList prefills_ ABSL_GUARDED_BY(nodes_mu_);
  NodeList decodes_ ABSL_GUARDED_BY(nodes_mu_);
  std::mutex discovery_mu_;
  std::condition_variable discovery_cv_;
  bool stopping_ ABSL_GUARDED_BY(discovery_mu_) = false;
  std::atomic<int64_t> skip_query_until_us_{0};  // QueryPrefix skipped until (unix micros)
  std::thread discovery_;
  std::atomic<uint64_t> next_request_{1};
  // One rotation per role, so ties are broken independently for each picker.
  std::atomic<uint64_t> prefill_rotation_{0};
  std::atomic<uint64_t> decode_rotation_{0};
  const std::string instance_id_;
  QuotaTable tenant_in_flight_;
  QuotaTable client_in_flight_;
  QuotaTable tenant_reservations_;
  QuotaTable client_reservations_;

  Histogram* ttft_seconds_;
  Histogram* itl_seconds_;
  Histogram* e2e_seconds_;
  Counter* prompt_tokens_;
  Counter* generation_tokens_;
  Counter* prefix_hit_tokens_;
  Counter* transferred_bytes_;
  Counter* failovers_;
  Counter* success_stop_;
  Counter* success_length_;
};

}  // namespace kvrelay::gateway
