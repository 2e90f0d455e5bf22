#include "common/metrics.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/check.h"

namespace kvrelay {
namespace {

std::string FormatValue(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.9g", v);
}

std::string EscapeLabel(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

std::string LabelText(const MetricLabels& labels, const std::string& extra_key = "",
                      const std::string& extra_value = "") {
  if (labels.empty() && extra_key.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    absl::StrAppend(&out, first ? "" : ",", k, "=\"", EscapeLabel(v), "\"");
    first = false;
  }
  if (!extra_key.empty()) {
    absl::StrAppend(&out, first ? "" : ",", extra_key, "=\"", extra_value, "\"");
  }
  out += "}";
  return out;
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  double cur = sum_.load(std::memory_order_relaxed);
  while (!sum_.compare_exchange_weak(cur, cur + value, std::memory_order_relaxed)) {
  }
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    running += buckets_[i].load(std::memory_order_relaxed);
    out[i] = running;
  }
  return out;
}

uint64_t Histogram::count() const { return CumulativeCounts().back(); }

std::vector<double> LatencyBucketsSeconds() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
          0.25,   0.5,     1,      2.5,   5,      10,    25,   50,    100};
}

std::vector<double> TimeToFirstTokenBucketsSeconds() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> InterTokenLatencyBucketsSeconds() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
          0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> RequestLatencyBucketsSeconds() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

std::vector<double> KvTransferTimeBucketsSeconds() {
  return {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0};
}

std::vector<double> KvTransferBytesBuckets() {
  std::vector<double> out;
  for (int shift = 11; shift <= 33; shift += 2) out.push_back(std::ldexp(1.0, shift));
  return out;
}

MetricsRegistry::Family& MetricsRegistry::GetFamily(const std::string& name, Type type,
                                                    const std::string& help) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.type = type;
    it->second.help = help;
  }
  // One name, one type: a mismatch is a programming error in our own registration code.
  KV_CHECK(it->second.type == type);
  return it->second;
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = GetFamily(name, Type::kCounter, help).counters[labels];
  if (slot == nullptr) slot = std::make_unique<Counter>();
  return slot.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = GetFamily(name, Type::kGauge, help).gauges[labels];
  if (slot == nullptr) slot = std::make_unique<Gauge>();
  return slot.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         const std::vector<double>& upper_bounds,
                                         const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = GetFamily(name, Type::kHistogram, help).histograms[labels];
  if (slot == nullptr) slot = std::make_unique<Histogram>(upper_bounds);
  return slot.get();
}

void MetricsRegistry::AddCounterFunc(const std::string& name, const std::string& help,
                                     const MetricLabels& labels, std::function<double()> read) {
  absl::MutexLock lock(&mu_);
  GetFamily(name, Type::kCounter, help).funcs[labels] = std::move(read);
}

void MetricsRegistry::AddGaugeFunc(const std::string& name, const std::string& help,
                                   const MetricLabels& labels, std::function<double()> read) {
  absl::MutexLock lock(&mu_);
  GetFamily(name, Type::kGauge, help).funcs[labels] = std::move(read);
}

std::string MetricsRegistry::RenderText() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, family] : families_) {
    const char* type = family.type == Type::kCounter ? "counter"
                       : family.type == Type::kGauge ? "gauge"
                                                     : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", family.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, c] : family.counters) {
      absl::StrAppend(&out, name, LabelText(labels), " ", FormatValue(c->value()), "\n");
    }
    for (const auto& [labels, g] : family.gauges) {
      absl::StrAppend(&out, name, LabelText(labels), " ", FormatValue(g->value()), "\n");
    }
    for (const auto& [labels, read] : family.funcs) {
      absl::StrAppend(&out, name, LabelText(labels), " ", FormatValue(read()), "\n");
    }
    for (const auto& [labels, h] : family.histograms) {
      std::vector<uint64_t> counts = h->CumulativeCounts();
      for (size_t i = 0; i < h->upper_bounds().size(); ++i) {
        absl::StrAppend(&out, name, "_bucket",
                        LabelText(labels, "le", FormatValue(h->upper_bounds()[i])), " ", counts[i],
                        "\n");
      }
      absl::StrAppend(&out, name, "_bucket", LabelText(labels, "le", "+Inf"), " ", counts.back(),
                      "\n");
      absl::StrAppend(&out, name, "_sum", LabelText(labels), " ", FormatValue(h->sum()), "\n");
      absl::StrAppend(&out, name, "_count", LabelText(labels), " ", counts.back(), "\n");
    }
  }
  return out;
}

}  // namespace kvrelay
