#include "cli/bench_serve/runner.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <optional>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "proto/grpc_status.h"

namespace kvrelay::cli::bench_serve {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;

namespace {

double SecondsBetween(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }

struct Progress {
  std::atomic<int64_t> done{0};
  std::atomic<int64_t> errors{0};
  std::atomic<int64_t> in_flight{0};
};

void PrintProgress(const RunOptions& options, const Progress& p, int64_t total, absl::Time start,
                   bool tty, bool final_line) {
  const double t = SecondsBetween(start, absl::Now());
  const int64_t done = p.done.load(std::memory_order_relaxed);
  std::fprintf(stderr,
               "%s[bench-serve%s%s] %6.1fs  %lld/%lld done  %.2f req/s  %lld errors  "
               "%lld in flight%s",
               tty ? "\r" : "", options.label.empty() ? "" : " ", options.label.c_str(), t,
               static_cast<long long>(done), static_cast<long long>(total),
               t > 0 ? static_cast<double>(done) / t : 0.0,
               static_cast<long long>(p.errors.load(std::memory_order_relaxed)),
               static_cast<long long>(p.in_flight.load(std::memory_order_relaxed)),
               tty && !final_line ? "   " : "\n");
  std::fflush(stderr);
}

// Sends `w` to gateways[first_gateway % size], and on to the next one while RetryOnNextGateway says
// so and the request's deadline (from its first send) has time left.
RequestRecord SendOne(const std::vector<const GatewayClient*>& gateways, size_t first_gateway,
                      const WorkloadRequest& w, const RunOptions& options, absl::Time start,
                      absl::Time end) {
  RequestRecord r;
  r.index = w.index;
  r.trace_line = w.trace_line;
  r.scheduled_s = w.arrival_s;
  r.prompt_tokens = static_cast<int32_t>(w.prompt.size());
  r.max_tokens = w.max_tokens;
  r.ideal_cached_tokens = w.ideal_cached_tokens;
  GatewayRequest request;
  request.generation = MakeGenerationRequest(w, options.temperature);
  request.model = options.model;
  request.tenant = options.tenant;

  const absl::Time sent = absl::Now();
  r.send_s = SecondsBetween(start, sent);
  if (options.closed_loop) r.scheduled_s = r.send_s;  // no arrival time: never "late"
  absl::Time last = sent;
  bool first = true;
  // Tokens and times are taken here, as they stream, so a request that fails midway still
  // reports what it served (and --verify checks it).
  auto on_tokens = [&](const std::vector<int32_t>& tokens) {
    const absl::Time now = absl::Now();
    if (first) {
      r.ttft_ms = absl::ToDoubleMilliseconds(now - sent);
      first = false;
      // Tokens after the first one in the same message arrived together with it.
      for (size_t i = 1; i < tokens.size(); ++i) r.itl_ms.push_back(0.0);
    } else {
      const double gap =
          absl::ToDoubleMilliseconds(now - last) / static_cast<double>(tokens.size());
      for (size_t i = 0; i < tokens.size(); ++i) r.itl_ms.push_back(gap);
    }
    last = now;
    r.tokens.insert(r.tokens.end(), tokens.begin(), tokens.end());
  };
  const bool capped = end - sent < options.timeout;
  // One deadline for the request, whichever gateways it tries: a retry never extends it.
  const absl::Time deadline = sent + std::min(options.timeout, end - sent);
  absl::StatusOr<gateway::client::GenerationResult> result;
  for (size_t g = first_gateway;; ++g) {
    const size_t index = g % gateways.size();
    r.gateway = gateways[index]->address();
    result = gateways[index]->Generate(
        request, std::max(absl::Milliseconds(1), deadline - absl::Now()), on_tokens);
    if (result.ok() || !RetryOnNextGateway(result.status(), r.tokens.size()) ||
        absl::Now() >= deadline) {
      break;
    }
    ++r.gateway_retries;
    // Every gateway refused it once more: none serves now (one restarting, say). Wait a little
    // rather than spin on refused connections.
    if (static_cast<size_t>(r.gateway_retries) % gateways.size() == 0) {
      absl::SleepFor(std::min(absl::Milliseconds(100), deadline - absl::Now()));
    }
  }
  const absl::Time done = absl::Now();
  r.end_s = SecondsBetween(start, done);
  r.e2e_ms = absl::ToDoubleMilliseconds(done - sent);
  r.output_tokens = static_cast<int32_t>(r.tokens.size());
  if (r.output_tokens >= 2 && r.ttft_ms >= 0) {
    r.tpot_ms = (r.e2e_ms - r.ttft_ms) / (r.output_tokens - 1);
  }
  if (!result.ok()) {
    r.code = result.status().code();
    r.error = std::string(result.status().message());
    if (std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(result.status())) {
      r.error_node_id = info->node_id();
      r.error_address = info->address();
    }
    r.cut = capped && absl::IsDeadlineExceeded(result.status());
    return r;
  }
  r.cached_tokens = result->prefix_hit_tokens;
  r.computed_tokens = result->computed_prompt_tokens;
  r.transferred_bytes = result->transferred_bytes;
  r.fetched_bytes = result->fetched_bytes;
  r.prefix_source = result->prefix_source;
  r.attempts = result->attempts;
  r.prefill_worker = result->prefill_worker;
  r.decode_worker = result->decode_worker;
  return r;
}

}  // namespace

bool RetryOnNextGateway(const absl::Status& status, int64_t tokens_received) {
  if (tokens_received > 0) return false;
  const std::optional<kvrelay::v1::ErrorInfo> info = proto::GetErrorInfo(status);
  // gRPC's own refusal: no gateway decided anything.
  if (!info.has_value()) return absl::IsUnavailable(status) || absl::IsCancelled(status);
  return absl::IsUnavailable(status) && info->role() == kvrelay::v1::ROLE_GATEWAY &&
         info->reason() == kvrelay::v1::FAILURE_DRAINING;
}

gateway::client::GenerationRequest MakeGenerationRequest(const WorkloadRequest& w,
                                                         float temperature) {
  gateway::client::GenerationRequest g;
  g.tokens = w.prompt;
  g.max_tokens = w.max_tokens;
  g.temperature = temperature;
  g.seed = static_cast<uint64_t>(w.index);
  g.eos_token = -1;
  return g;
}

RunResult RunLoad(const std::vector<const GatewayClient*>& gateways,
                  const std::vector<WorkloadRequest>& workload, const RunOptions& options) {
  RunResult result;
  const int64_t total = std::min<int64_t>(static_cast<int64_t>(workload.size()),
                                          std::max<int64_t>(0, options.max_requests));
  result.start = absl::Now();
  const absl::Time end = result.start + options.max_duration;
  std::vector<RequestRecord> records(static_cast<size_t>(total));
  std::vector<char> sent(static_cast<size_t>(total), 0);
  std::atomic<int64_t> next{0};
  std::atomic<bool> stopped{false};
  Progress progress;

  auto worker = [&] {
    while (true) {
      const int64_t i = next.fetch_add(1);
      if (i >= total) return;
      const WorkloadRequest& w = workload[static_cast<size_t>(i)];
      const absl::Time when =
          options.closed_loop ? absl::Now() : result.start + absl::Seconds(w.arrival_s);
      if (when >= end) {
        stopped.store(true);
        return;
      }
      absl::SleepFor(when - absl::Now());
      if (absl::Now() >= end) {
        stopped.store(true);
        return;
      }
      progress.in_flight.fetch_add(1, std::memory_order_relaxed);
      records[static_cast<size_t>(i)] =
          SendOne(gateways, static_cast<size_t>(i), w, options, result.start, end);
      sent[static_cast<size_t>(i)] = 1;
      progress.in_flight.fetch_sub(1, std::memory_order_relaxed);
      if (!records[static_cast<size_t>(i)].ok()) {
        progress.errors.fetch_add(1, std::memory_order_relaxed);
      }
      progress.done.fetch_add(1, std::memory_order_relaxed);
    }
  };

  const bool tty = isatty(STDERR_FILENO) == 1;
  absl::Notification finished;
  std::thread reporter;
  if (options.progress) {
    reporter = std::thread([&] {
      const absl::Duration period = tty ? absl::Seconds(1) : absl::Seconds(5);
      while (!finished.WaitForNotificationWithTimeout(period)) {
        PrintProgress(options, progress, total, result.start, tty, /*final_line=*/false);
      }
    });
  }
  std::vector<std::thread> threads;
  const int32_t n_threads = static_cast<int32_t>(
      std::min<int64_t>(std::max(1, options.concurrency), std::max<int64_t>(total, 1)));
  for (int32_t t = 0; t < n_threads; ++t) threads.emplace_back(worker);
  for (std::thread& t : threads) t.join();
  finished.Notify();
  if (reporter.joinable()) reporter.join();
  if (options.progress) PrintProgress(options, progress, total, result.start, tty, true);

  for (int64_t i = 0; i < total; ++i) {
    if (sent[static_cast<size_t>(i)]) {
      result.records.push_back(std::move(records[static_cast<size_t>(i)]));
    } else {
      ++result.not_sent;
    }
  }
  result.not_sent += static_cast<int64_t>(workload.size()) - total;
  result.stopped_by_duration = stopped.load();
  return result;
}

}  // namespace kvrelay::cli::bench_serve
