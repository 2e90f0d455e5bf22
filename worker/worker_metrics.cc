#include "worker/worker_metrics.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvrelay::worker {
namespace {

constexpr char kUsageName[] = "kvrelay:kv_cache_usage_perc";
constexpr char kUsageHelp[] = "KV-cache usage. 1 means 100 percent usage.";

}  // namespace

KvCacheMetrics::KvCacheMetrics(MetricsRegistry* metrics, MetricLabels model_labels,
                               const CacheConfigInfo& info, std::function<double()> usage)
    : metrics_(metrics), model_labels_(std::move(model_labels)) {
  // vLLM's label names where the meaning is the same (block_size in tokens, cache_dtype,
  // num_gpu_blocks: the request pool's blocks, wherever that pool lives), ours beside them.
  MetricLabels labels = model_labels_;
  labels["role"] = info.role;
  labels["block_size"] = absl::StrCat(info.layout->block_tokens());
  labels["cache_dtype"] = std::string(kv::DTypeName(info.layout->dtype()));
  labels["num_gpu_blocks"] = absl::StrCat(info.pool_blocks);
  labels["num_cache_slots"] = absl::StrCat(info.cache_slots);
  labels["enable_prefix_caching"] = info.prefix_caching ? "True" : "False";
  labels["kv_bytes_per_token"] = absl::StrCat(info.layout->BytesPerToken());
  labels["layout_fingerprint"] = info.layout->fingerprint().ToHex();
  // Which backend computed the KV (its numerics are in layout_fingerprint too).
  labels["device"] = info.device;
  labels["device_name"] = info.device_name;
  metrics_
      ->GetGauge("kvrelay:cache_config_info", "Information of the worker's KV cache config.",
                 labels)
      ->Set(1);
  // The layout's figure as a number (the info labels above are strings PromQL cannot divide
  // by): dashboards set the KV bytes a request moved per token against it.
  MetricLabels role_labels = model_labels_;
  role_labels["role"] = info.role;
  metrics_
      ->GetGauge("kvrelay:kv_bytes_per_token",
                 "KV bytes per token of the worker's layout (all layers, K and V, scales "
                 "included): the least a token's KV takes in memory and on the wire.",
                 role_labels)
      ->Set(static_cast<double>(info.layout->BytesPerToken()));
  metrics_->AddGaugeFunc(kUsageName, kUsageHelp, model_labels_, std::move(usage));
}

KvCacheMetrics::~KvCacheMetrics() {
  // Replaced under the registry's lock: no scrape runs the old function after this returns.
  metrics_->AddGaugeFunc(kUsageName, kUsageHelp, model_labels_, [] { return 0.0; });
}

double FullestPoolUsage(const model::KvCache& cache) {
  double fullest = 0;
  for (int g = 0; g < cache.num_groups(); ++g) {
    const kv::BlockPool& pool = cache.pool(g);
    if (pool.num_slots() <= 0) continue;
    fullest = std::max(fullest, static_cast<double>(pool.num_slots() - pool.free_slots()) /
                                    static_cast<double>(pool.num_slots()));
  }
  return fullest;
}

}  // namespace kvrelay::worker
