#pragma once

// Gateway: the front door's logic (served as kvrelay.v1.Gateway by gateway/server/).
//
// Generate validates the request, admits it against the per-tenant and per-client quotas,
// derives the tenant's block-hash salt from the tenant id and a server-side secret
// (HMAC-SHA256; a client never chooses a salt), then hands it to a GenerateCall: attempts on
// prefill/decode pairs the WorkerSet picks (prefix-aware prefill routing from the cache
// store's QueryPrefix, least-load decode, circuit breakers), with failover to another pair
// that continues from the tokens already streamed. See gateway/generate_call.h for the
// failure handling and gateway/worker_set.h for routing and discovery.
//
// Thread-safe. Endpoints, the store client and the clock must outlive the gateway.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "cachestore/client/cache_store_client.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "gateway/circuit_breaker.h"
#include "gateway/gateway_metrics.h"
#include "gateway/generate_call.h"
#include "gateway/quota.h"
#include "gateway/worker_endpoints.h"
#include "gateway/worker_set.h"
#include "kv/hf_config.h"
#include "kvrelay/v1/gateway.pb.h"

namespace kvrelay::gateway {

struct GatewayOptions {
  std::string model_dir;   // for the model's layout, vocabulary and limits
  std::string model_name;  // what requests must name (empty in a request = this model)
  // Tokens per KV block (--block-tokens): the layout requests are hashed for; the store and
  // the workers must use the same.
  int32_t block_tokens = kv::kDefaultBlockTokens;
  // KV dtype (--kv-cache-dtype; empty: the model's): with the model and block size, the layout
  // whose fingerprint requests carry; workers of another layout are not paired.
  std::optional<kv::DType> kv_cache_dtype;
  std::string tenant_secret;
  int32_t max_attempts = 3;
  absl::Duration default_deadline = absl::Seconds(120);
  // Per-attempt bounds, each below the request's deadline.
  absl::Duration reserve_timeout = absl::Seconds(2);
  // The adaptive Reserve timeout's lower bound (WorkerSetOptions::reserve_timeout_floor);
  // reserve_timeout is its upper bound.
  absl::Duration reserve_timeout_floor = absl::Milliseconds(500);
  absl::Duration prefill_timeout = absl::Seconds(30);
  absl::Duration chunk_timeout = absl::Seconds(5);         // first token and every gap after it
  absl::Duration route_timeout = absl::Milliseconds(500);  // QueryPrefix / worker Status
  CircuitBreakerOptions breaker;
  // Requests this gateway has in flight at once, all tenants together (--max-inflight; 0: no
  // limit). More are refused at once with RESOURCE_EXHAUSTED (ROLE_GATEWAY,
  // FAILURE_OVERLOADED, "inflight"): a request beyond it would only queue behind the workers'
  // own admission and hold a server thread meanwhile.
  int32_t max_inflight = 1024;
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
  // Link canaries (--link-canary-interval; zero: off): this often, every decode worker whose
  // learned push time per MiB is at least twice the fleet's best (and more than 50 ms slower
  // on the canary's push) gets a synthetic request
  // (Reserve, a Prefill on the least loaded prefill worker that pushes a few unique blocks,
  // Release; nothing generated or kept), and its push is measured as a request's. A worker
  // whose link is slow stays known as slow without a client request finding out again, and
  // one whose link recovered gets its traffic back.
  absl::Duration link_canary_interval = absl::ZeroDuration();
};

// HMAC-SHA256(secret, tenant), first 16 bytes.
std::string DeriveTenantSalt(const std::string& secret, const std::string& tenant);

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
  // One round of link canaries (the canary thread runs one every link_canary_interval): one
  // for each decode worker whose learned push time per MiB is slow (see
  // link_canary_interval), one at a time, each bounded by reserve_timeout + 2 s. Returns how
  // many ran.
  int RunLinkCanaries();
  // The cluster as this gateway sees it (Gateway/Status, `kvrelay status`): each worker with
  // its breaker, loads and its own Status, then the store's registry and stats. Every call it
  // makes (the workers' in parallel) is bounded by min(route_timeout, half of what is left
  // before `deadline`), so a worker or store that does not answer is reported as such in
  // time; it fails only with DEADLINE_EXCEEDED when `deadline` has passed.
  absl::StatusOr<kvrelay::v1::GatewayStatusResponse> Status(absl::Time deadline);
  // Known workers by role (fixed + discovered), for tests and /metrics.
  size_t num_prefill() const;
  size_t num_decode() const;

  const kv::ModelConfig& config() const { return config_; }

 private:
  Gateway(GatewayOptions options, kv::ModelConfig config, MetricsRegistry* metrics, Clock* clock,
          std::unique_ptr<cachestore::CacheStoreClient> store, WorkerFactories factories);

  // What a GenerateCall (a request's, or a link canary's) borrows from this gateway.
  GenerateCallDeps CallDeps(Clock* request_clock);

  const GatewayOptions options_;
  const kv::ModelConfig config_;
  const GenerateCallOptions call_options_;
  // Before the quotas: their refusal counters come from it.
  const GatewayMetrics metrics_;
  std::unique_ptr<cachestore::CacheStoreClient> store_;  // before workers_, which uses it
  std::unique_ptr<WorkerSet> workers_;
  const std::string instance_id_;  // in request ids: tells this process's apart from others'
  std::atomic<uint64_t> next_request_{1};
  std::atomic<int32_t> in_flight_{0};  // Generate calls past validation (max_inflight)
  QuotaTable tenant_in_flight_;
  QuotaTable client_in_flight_;
  QuotaTable tenant_reservations_;
  QuotaTable client_reservations_;
  // The synthetic requests of link canaries: unique tokens, one per canary.
  std::atomic<uint64_t> next_canary_{1};
  absl::Notification stop_canaries_;
  std::thread canary_thread_;  // runs while link_canary_interval > 0; joined first
};

}  // namespace kvrelay::gateway
