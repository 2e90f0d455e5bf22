#pragma once

// GatewayMetrics: the gateway's request-level families, registered once per gateway with the
// served model's name as a label. Families carry vLLM's names and buckets where vLLM has one
// (see the README's metrics table): the gateway sees each request once, from the client's side.
//
// Made by Gateway; GenerateCall records each request's figures through it. Thread-safe (the
// registry's objects are). The registry must outlive it.

#include <string>

#include "absl/status/status.h"
#include "common/metrics.h"

namespace kvrelay::gateway {

class GatewayMetrics {
 public:
  GatewayMetrics(MetricsRegistry* registry, const std::string& model_name);

  // kvrelay:gateway_quota_refusals_total{quota}: requests a quota refused.
  Counter* QuotaRefusals(const std::string& quota) const;
  // kvrelay:gateway_worker_failures_total{role, reason}: an attempt failed and `role`'s node
  // was blamed; the reason is the ErrorInfo's, else the status code's name.
  void CountWorkerFailure(const absl::Status& status, const char* role) const;
  // kvrelay:gateway_failures_total{reason}: a request failed with `status` (reason: its code).
  void CountRequestFailure(const absl::Status& status) const;
  // kvrelay:gateway_shed_total{tier, reason}: a request refused for capacity at once. `tier`
  // is what is full ("gateway", "decode", "prefill"), `reason` what of it ("inflight",
  // "slots", "kv_blocks", "queue"; "busy" when the workers were known full without asking).
  // (gateway, inflight), (prefill, busy) and (decode, busy) exist from the start, at zero.
  void CountShed(const std::string& tier, const std::string& reason) const;

  Histogram* const ttft_seconds;
  Histogram* const itl_seconds;
  Histogram* const e2e_seconds;
  Counter* const prompt_tokens;
  Counter* const generation_tokens;
  Counter* const prefix_hit_tokens;
  Counter* const transferred_bytes;
  Counter* const failovers;
  // kvrelay:gateway_disk_promotions_total{outcome}: Promote calls to workers holding a prompt's
  // blocks on disk only (ok, failed); kvrelay:gateway_promoted_blocks_total: blocks they read
  // back into DRAM.
  Counter* const promotions_ok;
  Counter* const promotions_failed;
  Counter* const promoted_blocks;
  Counter* const success_stop;    // finished_reason "stop" (EOS, stop string)
  Counter* const success_length;  // finished_reason "length" (max_tokens)
  // kvrelay:gateway_breaker_opens_total{role}: a worker's breaker opened (or reopened) on a
  // failure blamed on it. Overload never moves it.
  Counter* const breaker_opens_prefill;
  Counter* const breaker_opens_decode;
  // kvrelay:gateway_requests_in_flight: Generate calls past validation and not yet ended. Back
  // to zero whenever the gateway is idle (the soak's leak check reads it).
  Gauge* const requests_in_flight;

 private:
  Counter* ShedCounter(const std::string& tier, const std::string& reason) const;

  MetricsRegistry* const registry_;
  const MetricLabels model_labels_;  // {model_name}: on every family
};

}  // namespace kvrelay::gateway
