#include "sim/simulation.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "gateway/gateway_metrics.h"
#include "gateway/generate_call.h"
#include "gateway/quota.h"
#include "nlohmann/json.hpp"
#include "sim/scheduler.h"

namespace kvrelay::sim {

namespace {

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

Percentiles Summarize(std::vector<double> v) {
  Percentiles p;
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&v](double q) {
    return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
  };
  p.p50 = at(0.5);
  p.p90 = at(0.9);
  p.p99 = at(0.99);
  double sum = 0;
  for (double x : v) sum += x;
  p.mean = sum / static_cast<double>(v.size());
  return p;
}

nlohmann::json ToJson(const Percentiles& p) {
  return {{"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}, {"mean", p.mean}};
}

}  // namespace

std::vector<int32_t> TracePromptTokens(const cachestore::sim::TraceRequest& request,
                                       int32_t population, int32_t trace_block_tokens) {
  std::vector<int32_t> tokens;
  const int64_t n = static_cast<int64_t>(request.hash_ids.size());
  const int64_t length =
      request.input_length > 0
          ? std::max<int64_t>(1, (request.input_length * trace_block_tokens + 511) / 512)
          : n * int64_t{trace_block_tokens};
  tokens.reserve(static_cast<size_t>(length));
  for (int64_t k = 0; k < n && static_cast<int64_t>(tokens.size()) < length; ++k) {
    const uint64_t block = Mix(request.hash_ids[static_cast<size_t>(k)] * 1000003ull +
                               static_cast<uint64_t>(population));
    for (int32_t i = 0; i < trace_block_tokens && static_cast<int64_t>(tokens.size()) < length;
         ++i) {
      tokens.push_back(1 + static_cast<int32_t>(Mix(block + static_cast<uint64_t>(i)) % 31999));
    }
  }
  return tokens;
}

absl::StatusOr<SimReport> Simulate(const std::vector<cachestore::sim::TraceRequest>& full_trace,
                                   const ClusterSpec& cluster_spec, const TrafficSpec& traffic,
                                   const HardwareProfile& profile, const kv::ModelLayout& layout) {
  if (traffic.trace_offset < 0 || traffic.tokens_per_hash_id < 1 ||
      traffic.trace_offset >= static_cast<int64_t>(full_trace.size())) {
    return absl::InvalidArgumentError(absl::StrCat("trace offset must be in [0, ",
                                                   full_trace.size(), ") and tokens per id >= 1"));
  }
  const std::vector<cachestore::sim::TraceRequest> trace(full_trace.begin() + traffic.trace_offset,
                                                         full_trace.end());
  if (traffic.time_scale <= 0 || traffic.populations < 1) {
    return absl::InvalidArgumentError("time scale must be > 0 and populations >= 1");
  }
  const absl::Time wall_start = absl::Now();
  SimulatedClock clock;
  Scheduler scheduler(&clock);
  KV_ASSIGN_OR_RETURN(std::unique_ptr<SimCluster> cluster,
                      SimCluster::Create(cluster_spec, profile, layout, &scheduler));
  MetricsRegistry metrics;
  gateway::GatewayMetrics gateway_metrics(&metrics, "sim");
  gateway::QuotaTable tenants("tenant", "KV tokens reserved", "--tenant-kv-tokens", 0, nullptr);
  gateway::QuotaTable clients("client", "KV tokens reserved", "--client-kv-tokens", 0, nullptr);
  const gateway::GenerateCallDeps deps{
      .workers = &cluster->workers(),
      .metrics = &gateway_metrics,
      .tenant_reservations = &tenants,
      .client_reservations = &clients,
      .layout = &layout,
      .clock = cluster_spec.gateway_clock != nullptr ? cluster_spec.gateway_clock : &clock};
  gateway::GenerateCallOptions options;
  options.model_name = "sim";

  // Arrivals in time order; populations are time-shifted copies with their own block ids.
  struct Arrival {
    absl::Duration at;
    size_t index;
    int32_t population;
  };
  std::vector<Arrival> arrivals;
  int64_t first_ms = trace.front().timestamp_ms;
  for (const auto& r : trace) first_ms = std::min(first_ms, r.timestamp_ms);
  for (int32_t pop = 0; pop < traffic.populations; ++pop) {
    // Each population starts at a different point of the first second, so copies do not
    // arrive in lockstep.
    const absl::Duration shift =
        absl::Microseconds(static_cast<int64_t>(Mix(static_cast<uint64_t>(pop) + 7) % 1000000));
    for (size_t i = 0; i < trace.size(); ++i) {
      const double ms = static_cast<double>(std::max<int64_t>(0, trace[i].timestamp_ms - first_ms));
      arrivals.push_back(
          {absl::Milliseconds(ms * traffic.time_scale) + (pop > 0 ? shift : absl::ZeroDuration()),
           i, pop});
    }
  }
  std::stable_sort(arrivals.begin(), arrivals.end(),
                   [](const Arrival& a, const Arrival& b) { return a.at < b.at; });
  if (traffic.max_requests > 0 && static_cast<int64_t>(arrivals.size()) > traffic.max_requests) {
    arrivals.resize(static_cast<size_t>(traffic.max_requests));
  }

  SimReport report;
  report.requests = static_cast<int64_t>(arrivals.size());
  report.records.resize(arrivals.size());
  int64_t pending = report.requests;  // not yet finished
  const absl::Time start = clock.Now();
  absl::Time last_end = start;
  for (size_t k = 0; k < arrivals.size(); ++k) {
    const Arrival a = arrivals[k];
    scheduler.Spawn(start + a.at, [&, a, k] {
      const cachestore::sim::TraceRequest& tr = trace[a.index];
      RequestRecord& rec = report.records[k];
      rec.arrival_s = absl::ToDoubleSeconds(a.at);
      kvrelay::v1::GenerateRequest request;
      for (int32_t t : TracePromptTokens(tr, a.population, traffic.tokens_per_hash_id)) {
        request.add_tokens(t);
      }
      request.set_model("sim");
      request.set_max_tokens(static_cast<int32_t>(std::clamp<int64_t>(
          tr.output_length > 0 ? tr.output_length : 1, 1, traffic.max_output_tokens)));
      rec.prompt_tokens = request.tokens_size();
      const absl::Time begun = clock.Now();
      absl::Time first_token = absl::InfinitePast();
      absl::Time last_token = begun;
      gateway::GenerateCallRequest call_request{.request = &request,
                                                .tenant_salt = "",
                                                .client = "",
                                                .request_id_prefix = absl::StrCat("r", k),
                                                .start = begun,
                                                .deadline = begun + traffic.timeout};
      const gateway::GenerateSink sink = [&](const kvrelay::v1::GenerateResponse& response) {
        if (response.tokens_size() > 0) {
          if (first_token == absl::InfinitePast()) first_token = clock.Now();
          last_token = clock.Now();
          rec.generated += response.tokens_size();
        }
        if (response.has_summary()) {
          const auto& s = response.summary();
          rec.hit_tokens = s.prefix_hit_tokens();
          rec.attempts = s.attempts();
          rec.pushed_bytes = s.transferred_bytes();
          rec.fetched_bytes = s.fetched_bytes();
          rec.prefill = s.prefill_worker();
          rec.decode = s.decode_worker();
          rec.prefix_source = s.prefix_source();
        }
        return true;
      };
      const std::function<bool()> cancelled = [] { return false; };
      gateway::GenerateCall call(options, deps, std::move(call_request), sink, cancelled);
      const absl::Status status = call.Run();
      rec.ok = status.ok();
      rec.code = absl::StatusCodeToString(status.code());
      const absl::Time end = clock.Now();
      rec.e2e_ms = absl::ToDoubleMilliseconds(end - begun);
      if (first_token != absl::InfinitePast()) {
        rec.ttft_ms = absl::ToDoubleMilliseconds(first_token - begun);
        if (rec.generated > 1) {
          rec.tpot_ms = absl::ToDoubleMilliseconds(last_token - first_token) / (rec.generated - 1);
        }
      }
      last_end = std::max(last_end, end);
      --pending;
    });
  }
  cluster->StartHousekeeping([&pending] { return pending > 0; });
  scheduler.Run();

  // The report.
  std::vector<double> ttft, tpot, e2e;
  int64_t prompt = 0, hit = 0, good = 0;
  for (const RequestRecord& r : report.records) {
    if (r.ok) {
      ++report.ok;
      ttft.push_back(r.ttft_ms);
      if (r.tpot_ms >= 0) tpot.push_back(r.tpot_ms);
      e2e.push_back(r.e2e_ms);
      prompt += r.prompt_tokens;
      hit += r.hit_tokens;
      report.pushed_bytes += static_cast<uint64_t>(r.pushed_bytes);
      report.fetched_bytes += static_cast<uint64_t>(r.fetched_bytes);
      if (r.ttft_ms <= absl::ToDoubleMilliseconds(traffic.slo_ttft) &&
          (r.tpot_ms < 0 || r.tpot_ms <= absl::ToDoubleMilliseconds(traffic.slo_tpot))) {
        ++good;
      }
    } else if (r.code == absl::StatusCodeToString(absl::StatusCode::kResourceExhausted)) {
      ++report.refused;
    } else {
      ++report.failed;
    }
  }
  report.duration_s = std::max(1e-9, absl::ToDoubleSeconds(last_end - start));
  const double span = std::max(1e-9, absl::ToDoubleSeconds(arrivals.back().at));
  report.offered_rps = static_cast<double>(report.requests) / span;
  report.goodput_rps = static_cast<double>(good) / report.duration_s;
  report.ttft_ms = Summarize(ttft);
  report.tpot_ms = Summarize(tpot);
  report.e2e_ms = Summarize(e2e);
  report.hit_rate = prompt > 0 ? static_cast<double>(hit) / static_cast<double>(prompt) : 0;
  report.store_calls_per_s = static_cast<double>(cluster->store_calls()) / report.duration_s;
  report.store_blocks_per_s = static_cast<double>(cluster->store_blocks()) / report.duration_s;
  report.nodes = cluster->Usage();
  int64_t disk_blocks_read = 0;
  for (const NodeUsage& n : report.nodes) disk_blocks_read += n.disk_blocks_read;
  report.disk_hit_rate = prompt > 0
                             ? static_cast<double>(disk_blocks_read * layout.block_tokens()) /
                                   static_cast<double>(prompt)
                             : 0;
  report.promoted_blocks = cluster->promoted_blocks();
  for (const NodeUsage& n : report.nodes) {
    const double busy = absl::ToDoubleSeconds(n.busy) / report.duration_s;
    const double link = absl::ToDoubleSeconds(n.link_busy) / report.duration_s;
    if (busy > report.bottleneck_utilisation) {
      report.bottleneck_utilisation = busy;
      report.bottleneck =
          absl::StrCat(n.prefill ? "prefill compute" : "decode steps", " (", n.node_id, ")");
    }
    if (link > report.bottleneck_utilisation) {
      report.bottleneck_utilisation = link;
      report.bottleneck = absl::StrCat("link (", n.node_id, ")");
    }
  }
  report.events = scheduler.events();
  report.peak_processes = scheduler.peak_processes();
  report.wall_s = absl::ToDoubleSeconds(absl::Now() - wall_start);
  return report;
}

std::string SimReport::ToJson() const {
  nlohmann::json nodes_json = nlohmann::json::array();
  for (const NodeUsage& n : nodes) {
    nodes_json.push_back({{"node", n.node_id},
                          {"role", n.prefill ? "prefill" : "decode"},
                          {"utilisation", absl::ToDoubleSeconds(n.busy) / duration_s},
                          {"link_utilisation", absl::ToDoubleSeconds(n.link_busy) / duration_s},
                          {"queued_s", absl::ToDoubleSeconds(n.queued)},
                          {"requests", n.requests},
                          {"refused", n.refused},
                          {"bytes_out", n.bytes_out},
                          {"bytes_pulled", n.bytes_pulled},
                          {"disk_blocks_read", n.disk_blocks_read},
                          {"peak_batch", n.peak_batch}});
  }
  nlohmann::json j = {{"requests", requests},
                      {"ok", ok},
                      {"refused", refused},
                      {"failed", failed},
                      {"duration_s", duration_s},
                      {"offered_rps", offered_rps},
                      {"goodput_rps", goodput_rps},
                      {"ttft_ms", sim::ToJson(ttft_ms)},
                      {"tpot_ms", sim::ToJson(tpot_ms)},
                      {"e2e_ms", sim::ToJson(e2e_ms)},
                      {"hit_rate", hit_rate},
                      {"disk_hit_rate", disk_hit_rate},
                      {"promoted_blocks", promoted_blocks},
                      {"pushed_bytes", pushed_bytes},
                      {"fetched_bytes", fetched_bytes},
                      {"store_calls_per_s", store_calls_per_s},
                      {"store_blocks_per_s", store_blocks_per_s},
                      {"bottleneck", bottleneck},
                      {"bottleneck_utilisation", bottleneck_utilisation},
                      {"nodes", nodes_json},
                      {"simulation",
                       {{"events", events},
                        {"peak_processes", peak_processes},
                        {"wall_s", wall_s},
                        {"events_per_s", wall_s > 0 ? events / wall_s : 0}}}};
  return j.dump(2);
}

std::string SimReport::RecordsCsv() const {
  std::string out =
      "arrival_s,ok,code,ttft_ms,tpot_ms,e2e_ms,prompt_tokens,hit_tokens,generated,attempts,"
      "pushed_bytes,fetched_bytes,prefill,decode,prefix_source\n";
  for (const RequestRecord& r : records) {
    absl::StrAppendFormat(&out, "%.6f,%d,%s,%.3f,%.3f,%.3f,%d,%d,%d,%d,%d,%d,%s,%s,%s\n",
                          r.arrival_s, r.ok ? 1 : 0, r.code, r.ttft_ms, r.tpot_ms, r.e2e_ms,
                          r.prompt_tokens, r.hit_tokens, r.generated, r.attempts, r.pushed_bytes,
                          r.fetched_bytes, r.prefill, r.decode, r.prefix_source);
  }
  return out;
}

std::string SimReport::Summary() const {
  return absl::StrFormat(
      "requests %d: %d ok, %d refused, %d failed over %.1f s simulated (offered %.2f req/s)\n"
      "goodput %.2f req/s; TTFT p50/p90/p99 %.1f/%.1f/%.1f ms; TPOT p50/p99 %.2f/%.2f ms\n"
      "prefix hit rate %.3f (own disk %.3f, %d blocks promoted); pushed %.2f GiB, pulled %.2f GiB; "
      "store calls %.0f/s (%.0f blocks/s)\n"
      "busiest: %s at %.2f\n"
      "simulation: %d events in %.2f s wall (%.0f events/s), at most %d requests in flight\n",
      requests, ok, refused, failed, duration_s, offered_rps, goodput_rps, ttft_ms.p50, ttft_ms.p90,
      ttft_ms.p99, tpot_ms.p50, tpot_ms.p99, hit_rate, disk_hit_rate, promoted_blocks,
      static_cast<double>(pushed_bytes) / (1 << 30), static_cast<double>(fetched_bytes) / (1 << 30),
      store_calls_per_s, store_blocks_per_s, bottleneck, bottleneck_utilisation, events, wall_s,
      wall_s > 0 ? static_cast<double>(events) / wall_s : 0.0, peak_processes);
}

}  // namespace kvrelay::sim
