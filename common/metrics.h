#pragma once

// Prometheus metrics: counters, gauges and histograms rendered in the text exposition format
// (version 0.0.4) by MetricsRegistry::RenderText(), the one renderer every server's /metrics
// uses (served by HttpServer through ServiceHost).
//
// Thread-safe. Metric objects are owned by the registry and live as long as it does; updates
// are lock-free (relaxed atomics: a scrape may see one metric a moment ahead of another).
// Components that already keep their own atomics (the cache store's counters) register them as
// function metrics, read at each scrape, instead of mirroring them.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvrelay {

using MetricLabels = std::map<std::string, std::string>;

class Counter {
 public:
  void Increment(double by = 1) {
    double cur = value_.load(std::memory_order_relaxed);
    while (!value_.compare_exchange_weak(cur, cur + by, std::memory_order_relaxed)) {
    }
  }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double by) {
    double cur = value_.load(std::memory_order_relaxed);
    while (!value_.compare_exchange_weak(cur, cur + by, std::memory_order_relaxed)) {
    }
  }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double value);
  const std::vector<double>& upper_bounds() const { return bounds_; }
  // Cumulative counts per bound, then +Inf; sum.
  std::vector<uint64_t> CumulativeCounts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const;

 private:
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1 (+Inf)
  std::atomic<double> sum_{0};
};

// Bucket helpers: latency in seconds from 100 us to ~100 s.
std::vector<double> LatencyBucketsSeconds();

// vLLM's bucket boundaries (vllm/v1/metrics/loggers.py and the NIXL connector's metrics), so
// dashboards and recording rules written for `vllm:` families read kvrelay's unchanged.
// vllm:time_to_first_token_seconds: 1 ms .. 2560 s.
std::vector<double> TimeToFirstTokenBucketsSeconds();
// vllm:inter_token_latency_seconds: 10 ms .. 80 s.
std::vector<double> InterTokenLatencyBucketsSeconds();
// vllm:e2e_request_latency_seconds (and the request_*_time_seconds family): 0.3 s .. 7680 s.
std::vector<double> RequestLatencyBucketsSeconds();
// vllm:nixl_xfer_time_seconds: 5 ms .. 5 s.
std::vector<double> KvTransferTimeBucketsSeconds();
// vllm:nixl_bytes_transferred: 2 KiB .. 8 GiB, x4 per bucket.
std::vector<double> KvTransferBytesBuckets();

class MetricsRegistry {
 public:
  // The same (name, labels) returns the same object. Names follow Prometheus rules
  // ([a-zA-Z_:][a-zA-Z0-9_:]*); help is the family's # HELP line (first registration wins).
  Counter* GetCounter(const std::string& name, const std::string& help,
                      const MetricLabels& labels = {}) ABSL_LOCKS_EXCLUDED(mu_);
  Gauge* GetGauge(const std::string& name, const std::string& help, const MetricLabels& labels = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          const std::vector<double>& upper_bounds, const MetricLabels& labels = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // A counter or gauge whose value `read` returns at each scrape (like Prometheus' CounterFunc /
  // GaugeFunc). `read` runs under the registry's lock: it must be cheap, thread-safe and must
  // not call back into this registry. The same (name, labels) again replaces the function.
  void AddCounterFunc(const std::string& name, const std::string& help, const MetricLabels& labels,
                      std::function<double()> read) ABSL_LOCKS_EXCLUDED(mu_);
  void AddGaugeFunc(const std::string& name, const std::string& help, const MetricLabels& labels,
                    std::function<double()> read) ABSL_LOCKS_EXCLUDED(mu_);
  std::string RenderText() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::map<MetricLabels, std::unique_ptr<Counter>> counters;
    std::map<MetricLabels, std::unique_ptr<Gauge>> gauges;
    std::map<MetricLabels, std::unique_ptr<Histogram>> histograms;
    std::map<MetricLabels, std::function<double()>> funcs;  // counter or gauge, as `type`
  };
  Family& GetFamily(const std::string& name, Type type, const std::string& help)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Family> families_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvrelay
