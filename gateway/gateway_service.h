#pragma once

// GatewayService: the front door (service kvrelay.v1.Gateway).
//
// Generate validates the request, derives the tenant's block-hash salt from the tenant id and
// a server-side secret (HMAC-SHA256; a client never chooses a salt), routes the request —
// the prefill worker whose node holds the longest cached prefix (cache store QueryPrefix), the
// decode worker with the fewest requests in flight — and drives Reserve (decode) -> Prefill ->
// Generate (decode stream), forwarding tokens as they come. A failed worker is skipped for a
// while; the request is retried on another pair within its deadline, continuing from the
// tokens already streamed (prompt + generated so far, which the cache mostly holds).
//
// Thread-safe.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "kv/hf_config.h"
#include "kvrelay/v1/cachestore.grpc.pb.h"
#include "kvrelay/v1/decode.grpc.pb.h"
#include "kvrelay/v1/gateway.grpc.pb.h"
#include "kvrelay/v1/prefill.grpc.pb.h"

namespace kvrelay::gateway {

struct GatewayOptions {
  std::string cachestore_address;
  std::vector<std::string> prefill_addresses;
  std::vector<std::string> decode_addresses;
  std::string model_dir;   // for the model's layout, vocabulary and limits
  std::string model_name;  // what requests must name (empty in a request = this model)
  std::string tenant_secret;
  int32_t max_attempts = 3;
  absl::Duration default_deadline = absl::Seconds(120);
  absl::Duration worker_backoff = absl::Seconds(5);  // a failed worker is skipped this long
};

// HMAC-SHA256(secret, tenant), first 16 bytes.
std::string DeriveTenantSalt(const std::string& secret, const std::string& tenant);

class GatewayService final : public kvrelay::v1::Gateway::Service {
 public:
  static absl::StatusOr<std::unique_ptr<GatewayService>> Create(GatewayOptions options,
                                                                MetricsRegistry* metrics);

  grpc::Status Generate(grpc::ServerContext* context,
                        const kvrelay::v1::GenerateRequest* request,
                        grpc::ServerWriter<kvrelay::v1::GenerateResponse>* writer) override;

 private:
  struct Worker {
    std::string address;
    std::string node_id;  // prefill only, learned from Status
    std::unique_ptr<kvrelay::v1::Prefill::Stub> prefill;
    std::unique_ptr<kvrelay::v1::Decode::Stub> decode;
    std::atomic<int32_t> in_flight{0};
    absl::Time unhealthy_until ABSL_GUARDED_BY(mu);
    mutable absl::Mutex mu;
  };
  GatewayService(GatewayOptions options, MetricsRegistry* metrics, kv::ModelConfig config);
  absl::Status Validate(const kvrelay::v1::GenerateRequest& request) const;
  Worker* PickPrefill(const std::vector<int32_t>& prompt, const std::string& salt,
                      const std::vector<Worker*>& excluded, absl::Time deadline);
  Worker* PickDecode(const std::vector<Worker*>& excluded);
  static bool Healthy(const Worker& w);
  static void MarkUnhealthy(Worker& w, absl::Duration backoff);

  const GatewayOptions options_;
  MetricsRegistry* metrics_;
  const kv::ModelConfig config_;
  std::unique_ptr<kvrelay::v1::CacheStore::Stub> store_;
  std::vector<std::unique_ptr<Worker>> prefills_;
  std::vector<std::unique_ptr<Worker>> decodes_;
  std::atomic<uint64_t> next_request_{1};
  std::atomic<uint64_t> round_robin_{0};
  const std::string instance_id_;

  Histogram* ttft_seconds_;
  Histogram* tpot_seconds_;
  Counter* prefix_query_tokens_;
  Counter* prefix_hit_tokens_;
  Counter* transferred_bytes_;
};

}  // namespace kvrelay::gateway
