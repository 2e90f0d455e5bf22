#pragma once

// The engine-state families both workers export under vLLM's names (README, "Metrics"):
// kvrelay:cache_config_info (a gauge fixed at 1 whose labels describe the KV cache and the
// device the model computes on, like vllm:cache_config_info) and kvrelay:kv_cache_usage_perc (0..1,
// like vllm:kv_cache_usage_perc).
//
// Thread-safe. KvCacheMetrics must not outlive `metrics`; whatever `usage` reads must outlive
// the KvCacheMetrics (its destructor replaces the function before returning).

#include <cstdint>
#include <functional>
#include <string>

#include "common/metrics.h"
#include "kv/model_layout.h"
#include "model/kv_cache.h"

namespace kvrelay::worker {

struct CacheConfigInfo {
  std::string role;                         // "prefill" or "decode"
  const kv::ModelLayout* layout = nullptr;  // not owned; read during construction only
  int64_t pool_blocks = 0;                  // request KV blocks per layer group
  int64_t cache_slots = 0;                  // whole-block slots offered to the store (0: none)
  bool prefix_caching = false;              // whether this worker reuses cached prefixes
  std::string device = "cpu";               // where the model computes: "cpu" or "cuda:N"
  std::string device_name = "cpu";          // "cpu" or the CUDA device's name
};

class KvCacheMetrics {
 public:
  // `usage` returns the share of the KV cache in use, read at each scrape under the registry's
  // lock: cheap, thread-safe, never calling into `metrics`.
  KvCacheMetrics(MetricsRegistry* metrics, MetricLabels model_labels, const CacheConfigInfo& info,
                 std::function<double()> usage);
  ~KvCacheMetrics();
  KvCacheMetrics(const KvCacheMetrics&) = delete;
  KvCacheMetrics& operator=(const KvCacheMetrics&) = delete;

 private:
  MetricsRegistry* const metrics_;
  const MetricLabels model_labels_;
};

// Slots in use over slots in all, in the fullest layer group of `cache` (the one that runs out
// first); 0 for a cache without slots.
double FullestPoolUsage(const model::KvCache& cache);

}  // namespace kvrelay::worker
