#include "gateway/gateway_metrics.h"

#include <optional>
#include <utility>

#include "proto/grpc_status.h"

namespace kvrelay::gateway {
namespace {

Counter* Success(MetricsRegistry* registry, MetricLabels labels, const char* finished_reason) {
  labels["finished_reason"] = finished_reason;
  return registry->GetCounter("kvrelay:request_success_total",
                              "Count of successfully processed requests.", labels);
}

Counter* BreakerOpens(MetricsRegistry* registry, MetricLabels labels, const char* role) {
  labels["role"] = role;
  return registry->GetCounter("kvrelay:gateway_breaker_opens_total",
                              "Worker circuit breakers opened by failures blamed on the worker "
                              "(never by overload), by role.",
                              labels);
}

Counter* Promotions(MetricsRegistry* registry, const std::string& model_name, const char* outcome) {
  return registry->GetCounter(
      "kvrelay:gateway_disk_promotions_total",
      "Promote calls to workers holding a prompt's blocks on their disk tier only, by outcome.",
      {{"model_name", model_name}, {"outcome", outcome}});
}

}  // namespace

GatewayMetrics::GatewayMetrics(MetricsRegistry* registry, const std::string& model_name)
    : ttft_seconds(registry->GetHistogram(
          "kvrelay:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
          TimeToFirstTokenBucketsSeconds(), {{"model_name", model_name}})),
      itl_seconds(registry->GetHistogram(
          "kvrelay:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
          InterTokenLatencyBucketsSeconds(), {{"model_name", model_name}})),
      e2e_seconds(registry->GetHistogram(
          "kvrelay:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
          RequestLatencyBucketsSeconds(), {{"model_name", model_name}})),
      prompt_tokens(registry->GetCounter("kvrelay:prompt_tokens_total",
                                         "Prompt tokens of requests received.",
                                         {{"model_name", model_name}})),
      generation_tokens(registry->GetCounter("kvrelay:generation_tokens_total",
                                             "Tokens generated and sent to clients.",
                                             {{"model_name", model_name}})),
      prefix_hit_tokens(registry->GetCounter(
          "kvrelay:gateway_prefix_hit_tokens_total",
          "Prompt tokens of served requests whose KV was reused.", {{"model_name", model_name}})),
      transferred_bytes(registry->GetCounter(
          "kvrelay:gateway_transferred_kv_bytes_total",
          "KV bytes moved prefill -> decode for served requests.", {{"model_name", model_name}})),
      failovers(registry->GetCounter("kvrelay:gateway_failovers_total",
                                     "Attempts retried on another worker pair.",
                                     {{"model_name", model_name}})),
      promotions_ok(Promotions(registry, model_name, "ok")),
      promotions_failed(Promotions(registry, model_name, "failed")),
      promoted_blocks(registry->GetCounter(
          "kvrelay:gateway_promoted_blocks_total",
          "Blocks workers read back from their disk tier into DRAM at this gateway's Promote.",
          {{"model_name", model_name}})),
      success_stop(Success(registry, {{"model_name", model_name}}, "stop")),
      success_length(Success(registry, {{"model_name", model_name}}, "length")),
      breaker_opens_prefill(BreakerOpens(registry, {{"model_name", model_name}}, "prefill")),
      breaker_opens_decode(BreakerOpens(registry, {{"model_name", model_name}}, "decode")),
      requests_in_flight(registry->GetGauge("kvrelay:gateway_requests_in_flight",
                                            "Generate requests in flight at the gateway.",
                                            {{"model_name", model_name}})),
      registry_(registry),
      model_labels_({{"model_name", model_name}}) {
  // Registered at zero so a shed-rate query has a series before the first refusal (an alert
  // on an absent series never fires, a dashboard shows "no data").
  constexpr std::pair<const char*, const char*> kShedAtStart[] = {
      {"gateway", "inflight"}, {"prefill", "busy"}, {"decode", "busy"}};
  for (const auto& [tier, reason] : kShedAtStart) ShedCounter(tier, reason);
}

Counter* GatewayMetrics::QuotaRefusals(const std::string& quota) const {
  MetricLabels labels = model_labels_;
  labels["quota"] = quota;
  return registry_->GetCounter("kvrelay:gateway_quota_refusals_total",
                               "Requests refused by a per-tenant or per-client quota, by quota.",
                               labels);
}

void GatewayMetrics::CountWorkerFailure(const absl::Status& status, const char* role) const {
  std::string reason = std::string(absl::StatusCodeToString(status.code()));
  if (std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status)) {
    reason = kvrelay::v1::FailureReason_Name(info->reason());
  }
  MetricLabels labels = model_labels_;
  labels["role"] = role;
  labels["reason"] = std::move(reason);
  registry_
      ->GetCounter("kvrelay:gateway_worker_failures_total",
                   "Failed attempts attributed to a worker, by role and reason.", labels)
      ->Increment();
}

void GatewayMetrics::CountRequestFailure(const absl::Status& status) const {
  MetricLabels labels = model_labels_;
  labels["reason"] = std::string(absl::StatusCodeToString(status.code()));
  registry_->GetCounter("kvrelay:gateway_failures_total", "Failed requests by status code.", labels)
      ->Increment();
}

Counter* GatewayMetrics::ShedCounter(const std::string& tier, const std::string& reason) const {
  MetricLabels labels = model_labels_;
  labels["tier"] = tier;
  labels["reason"] = reason;
  return registry_->GetCounter(
      "kvrelay:gateway_shed_total",
      "Requests refused at once for capacity (RESOURCE_EXHAUSTED, HTTP 429), by the "
      "tier that is full and what of it.",
      labels);
}

void GatewayMetrics::CountShed(const std::string& tier, const std::string& reason) const {
  ShedCounter(tier, reason)->Increment();
}

}  // namespace kvrelay::gateway
