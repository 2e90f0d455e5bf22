#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "cli/bench_serve/command.h"
#include "cli/bench_serve/fault_contract.h"
#include "cli/bench_serve/report.h"
#include "cli/bench_serve/runner.h"
#include "cli/bench_serve/stats.h"
#include "cli/bench_serve/trace.h"
#include "cli/bench_serve/verify.h"
#include "cli/bench_serve/workload.h"
#include "cli/up/health_check.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "common/server/server_flags.h"
#include "gateway/client/gateway_client.h"
#include "kv/hf_config.h"

namespace kvrelay::cli::bench_serve {
using ::kvrelay::gateway::client::GatewayClient;
using ::kvrelay::gateway::client::GatewayRequest;
using ::kvrelay::gateway::client::GenerationResult;

namespace {

int UsageError(const std::string& message) { return ::kvrelay::UsageError("bench-serve", message); }

absl::StatusOr<std::vector<double>> ParseRates(const std::string& text) {
  std::vector<double> rates;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    double r = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(part), &r) || !(r > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sweep-rates: want positive numbers like 0.5,1,2, got '", part, "'"));
    }
    rates.push_back(r);
  }
  return rates;
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return absl::OkStatus();
  }
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Waits until the gateway reports SERVING and has answered one request (on a tenant of its own,
// so the run's prefix cache starts cold). Workers register lazily, so health alone is not enough.
// With TLS the tenant is the credential's, so the warm-up runs as the run's own tenant (its
// 8-token prompt fills no KV block, so nothing of it is cached).
absl::Status WaitReady(const std::string& gateway, const GatewayClient& client,
                       const server::SecurityOptions& security, const std::string& model,
                       int32_t vocab, absl::Duration wait) {
  const absl::Time deadline = absl::Now() + wait;
  absl::Status last = absl::DeadlineExceededError("no attempt");
  while (absl::Now() < deadline) {
    last = up::CheckServing(gateway, absl::Seconds(2), security);
    if (last.ok()) {
      GatewayRequest warmup;
      warmup.model = model;
      warmup.tenant = security.insecure ? "bench-serve-warmup" : "";
      for (int32_t i = 0; i < 8; ++i) warmup.generation.tokens.push_back((i * 37 + 11) % vocab);
      warmup.generation.max_tokens = 2;
      absl::StatusOr<GenerationResult> r =
          client.Generate(warmup, std::min(absl::Seconds(30), deadline - absl::Now()));
      if (r.ok()) return absl::OkStatus();
      last = r.status();
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("gateway ", gateway, " not ready within --wait-ready: ", last.ToString()));
}

// The rate that takes an overload sweep to `multiple` x saturation (the peak goodput so far),
// or nullopt when its last rate already offers that much. Tokens are not verified yet, so the
// peak counts every request that met the SLO; a wrong token fails the run anyway.
std::optional<double> NextOverloadRate(const std::vector<RunReport>& runs, const Slo& slo,
                                       double multiple) {
  double peak = 0, last_rate = 0;
  for (const RunReport& run : runs) {
    peak = std::max(peak, Summarize(run.records, slo).goodput);
    last_rate = run.rate.value_or(0);
  }
  if (peak <= 0 || last_rate >= multiple * peak) return std::nullopt;
  // 5% above the multiple, in whole requests/s: the peak itself moves a little from run to run.
  return std::max(last_rate + 1, std::ceil(multiple * peak * 1.05));
}

}  // namespace

int RunBenchServeCommand(const std::vector<std::string>& args) {
  std::string gateway, trace_path, model_dir, model_name, slo_text, sweep_text, arrival = "poisson";
  std::string json_path, csv_path, plot_path, events_path, start_file, python = "/usr/bin/python3";
  std::string tenant = "bench", contract_text, token_file;
  server::SecurityOptions security;
  double time_scale = 1.0, rate = 0, shared_prefix_ratio = 0, temperature = 0;
  double sweep_past_saturation = 0;
  int32_t tokens_per_hash_id = 512, trace_block_tokens = 512, vocab = 0, block_tokens = 16;
  int32_t max_output_tokens = 64, input_tokens = 256, output_tokens = 16, prefix_groups = 4;
  int32_t concurrency = 32, verify_threads = 1, sweep_extra_rates = 3;
  int64_t max_prompt_tokens = 0, num_requests = 100, max_requests = 1000, seed = 0;
  int64_t verify_sample = 0, trace_offset = 0;
  bool verify = false, quiet = false;
  absl::Duration max_duration = absl::Minutes(10), timeout = absl::Seconds(60);
  absl::Duration wait_ready = absl::ZeroDuration(), sweep_duration = absl::ZeroDuration();
  FlagSet flags("bench-serve",
                "Drives a gateway with a Mooncake-format trace (replayed at its timestamps, or "
                "scaled) or a synthetic workload, and reports TTFT/TPOT/ITL/E2E percentiles, "
                "throughput, goodput against --slo, prefix hit rate vs the ideal, errors by "
                "status code, what each fault cost and, with --verify, wrong tokens. Always "
                "bounded by --max-requests and --max-duration.");
  flags.AddString("gateway", &gateway,
                  "gateway HOST:PORT[,HOST:PORT...] (required; requests go round-robin)");
  flags.AddString("trace", &trace_path,
                  "Mooncake JSON-lines trace (timestamp, input_length, output_length, hash_ids); "
                  "without it the workload is synthetic");
  flags.AddDouble("time-scale", &time_scale, "trace timestamps x this (0.1 = ten times faster)");
  flags.AddInt32("tokens-per-hash-id", &tokens_per_hash_id,
                 "prompt tokens per trace block id (the trace's own: 512; smaller for CPU models); "
                 "synthetic prompts use the model's KV block unless this is given");
  flags.AddInt64("trace-offset", &trace_offset,
                 "skip this many requests (in timestamp order) at the trace's start");
  flags.AddInt32("trace-block-tokens", &trace_block_tokens, "tokens per block id in the trace");
  flags.AddDouble("rate", &rate,
                  "requests/s: synthetic arrival rate (0 = closed loop at --concurrency); with "
                  "--trace, rescales the trace's arrivals to this mean rate (0 = its own)");
  flags.AddString("arrival", &arrival, "synthetic arrivals: poisson or fixed");
  flags.AddString("sweep-rates", &sweep_text,
                  "comma-separated rates: run the workload once per rate (TTFT vs rate plot)");
  flags.AddDuration("sweep-duration", &sweep_duration,
                    "synthetic sweep: each rate sends for this long (rate x duration requests, "
                    "instead of --num-requests), so every rate is measured over the same "
                    "window; a fixed count at a high rate is a short burst whose drain "
                    "dominates");
  flags.AddDouble("sweep-past-saturation", &sweep_past_saturation,
                  "after --sweep-rates, add rates until the last one offers at least this many "
                  "times the peak goodput measured (saturation), so an overload sweep reaches "
                  "its multiple on a fast machine too (0 = the listed rates only)");
  flags.AddInt32("sweep-extra-rates", &sweep_extra_rates,
                 "--sweep-past-saturation adds at most this many rates");
  flags.AddInt64("num-requests", &num_requests, "synthetic: number of requests");
  flags.AddInt32("input-tokens", &input_tokens, "synthetic: prompt tokens per request");
  flags.AddInt32("output-tokens", &output_tokens, "synthetic: tokens generated per request");
  flags.AddDouble("shared-prefix-ratio", &shared_prefix_ratio,
                  "synthetic: fraction of each prompt shared with its prefix group, 0-1");
  flags.AddInt32("prefix-groups", &prefix_groups, "synthetic: distinct shared prefixes");
  flags.AddString("model", &model_dir,
                  "model directory the cluster serves: vocab, context length and KV block size "
                  "for prompts, and the reference for --verify");
  flags.AddString("model-name", &model_name, "model name sent to the gateway ('' = its only one)");
  flags.AddInt32("vocab", &vocab, "token ids are drawn from [0, vocab) (default: --model's)");
  flags.AddInt32("block-tokens", &block_tokens,
                 "KV block of the served model, for the ideal hit rate (default: --model's)");
  flags.AddInt64("max-prompt-tokens", &max_prompt_tokens,
                 "longer prompts are cut at a block id (default: --model's context minus "
                 "--max-output-tokens, else 4096)");
  flags.AddInt32("max-output-tokens", &max_output_tokens, "cap on a trace's output_length");
  flags.AddInt32("concurrency", &concurrency, "requests in flight at most (client threads)");
  flags.AddInt64("max-requests", &max_requests, "send at most this many requests (per rate)");
  flags.AddDuration("max-duration", &max_duration,
                    "stop sending after this, and cut requests still running (per rate)");
  flags.AddDuration("timeout", &timeout, "deadline of each request");
  flags.AddString("slo", &slo_text, "goodput SLO, e.g. ttft=2s,tpot=100ms,e2e=10s");
  flags.AddBool("verify", &verify,
                "compare streamed tokens with the co-located reference (needs --model)");
  flags.AddInt64("verify-sample", &verify_sample, "verify this many requests, spread (0 = all)");
  flags.AddInt32("verify-threads", &verify_threads, "compute threads of the reference");
  flags.AddDouble("temperature", &temperature, "sampling temperature (seed = request index)");
  flags.AddString("tenant", &tenant,
                  "tenant of the requests (with --insecure; with TLS it may only repeat the "
                  "client certificate's or --token-file's tenant, which is the default)");
  flags.AddString("token-file", &token_file,
                  "file holding a bearer token (JWT, `kvrelay token`) sent with every request");
  server::AddSecurityFlags(flags, security);
  flags.AddInt64("seed", &seed, "seed of prompt tokens and synthetic arrivals");
  flags.AddString("json", &json_path, "write the JSON report here ('-' = stdout, no table)");
  flags.AddString("csv", &csv_path, "write one CSV row per request here");
  flags.AddString("plot", &plot_path, "write a PNG plot here");
  flags.AddString("python", &python, "python with matplotlib, for --plot");
  flags.AddString("fault-contract", &contract_text,
                  "check the fault contract against --events and exit 4 when it is broken: "
                  "'serve-again=5s,hits-again=5s,deadline-slack=1s,ttft-factor=2,ttft-floor=750ms,"
                  "fair-share=0.5' (any subset; 'default' for these values): failures at most "
                  "those in flight on the faulted node, a node that is back serves (the store: "
                  "with prefix hits) within serve-again, p99 TTFT of the requests sent while a "
                  "fault is active within ttft-factor x the fault-free p99 + ttft-floor, a worker "
                  "back gets at least fair-share of its fair share in the serve-again window "
                  "after that, no request outlives --timeout, a duplicate node id is refused; a "
                  "clause the run gave no evidence for is reported as not judged");
  flags.AddString("events", &events_path,
                  "fault events file, read after the run: '<start unix s> <end unix s|-> label' "
                  "per line (scripts/cluster writes it)");
  flags.AddString("start-file", &start_file,
                  "write the run's start (unix seconds) here when the load begins");
  flags.AddDuration("wait-ready", &wait_ready,
                    "first wait up to this for the gateway to serve one request (0 = don't)");
  flags.AddBool("quiet", &quiet, "no progress line");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (gateway.empty()) return UsageError("--gateway HOST:PORT is required");
  // Mutual TLS like `generate` (--tls-cert/--tls-key/--tls-ca), plain text only with --insecure.
  if (absl::Status s = server::SettleSecurity(flags, security); !s.ok()) {
    return UsageError(std::string(s.message()));
  }
  if (!security.insecure && !flags.WasSet("tenant")) tenant.clear();  // the credential's
  std::string bearer_token;
  if (!token_file.empty()) {
    absl::StatusOr<std::string> text = ReadFileToString(token_file);
    if (!text.ok()) return UsageError(absl::StrCat("--token-file: ", text.status().message()));
    bearer_token = std::string(absl::StripAsciiWhitespace(*text));
  }
  if (max_requests < 1)
    return UsageError(absl::StrCat("--max-requests must be >= 1, got ", max_requests));
  if (max_duration <= absl::ZeroDuration() || max_duration == absl::InfiniteDuration()) {
    return UsageError("--max-duration must be positive and finite");
  }
  if (timeout <= absl::ZeroDuration()) return UsageError("--timeout must be positive");
  if (concurrency < 1 || concurrency > 1024) {
    return UsageError(absl::StrCat("--concurrency must be in [1, 1024], got ", concurrency));
  }
  if (arrival != "poisson" && arrival != "fixed") {
    return UsageError(absl::StrCat("--arrival must be poisson or fixed, got '", arrival, "'"));
  }
  if (verify && model_dir.empty()) return UsageError("--verify needs --model DIR");
  if (temperature < 0 || temperature > 100) {
    return UsageError(absl::StrCat("--temperature must be in [0, 100], got ", temperature));
  }
  if (seed < 0) return UsageError(absl::StrCat("--seed must be >= 0, got ", seed));
  absl::StatusOr<Slo> slo = ParseSlo(slo_text);
  if (!slo.ok()) return UsageError(std::string(slo.status().message()));
  std::optional<FaultContract> contract;
  if (!contract_text.empty()) {
    absl::StatusOr<FaultContract> parsed =
        ParseFaultContract(contract_text == "default" ? std::string() : contract_text);
    if (!parsed.ok()) return UsageError(std::string(parsed.status().message()));
    if (events_path.empty()) return UsageError("--fault-contract needs --events FILE");
    contract = *parsed;
  }
  absl::StatusOr<std::vector<double>> sweep = ParseRates(sweep_text);
  if (!sweep.ok()) return UsageError(std::string(sweep.status().message()));
  if (sweep_duration < absl::ZeroDuration() ||
      (sweep_duration > absl::ZeroDuration() && (sweep->empty() || !trace_path.empty()))) {
    return UsageError(
        "--sweep-duration: a positive duration, with --sweep-rates and a synthetic workload");
  }
  if (sweep_past_saturation < 0 || (sweep_past_saturation > 0 && sweep->empty())) {
    return UsageError("--sweep-past-saturation: a positive multiple, with --sweep-rates");
  }
  if (sweep_extra_rates < 0 || sweep_extra_rates > 10) {
    return UsageError(
        absl::StrCat("--sweep-extra-rates must be in [0, 10], got ", sweep_extra_rates));
  }

  // The served model bounds the prompts: its vocab, its context, its KV block.
  int32_t context_tokens = 0;
  if (!model_dir.empty()) {
    absl::StatusOr<kv::ModelConfig> config = kv::LoadHfConfig(model_dir + "/config.json");
    if (!config.ok()) return UsageError(absl::StrCat("--model: ", config.status().message()));
    if (!flags.WasSet("vocab")) vocab = config->vocab_size;
    if (!flags.WasSet("block-tokens")) block_tokens = config->layout.block_tokens();
    context_tokens = config->max_position_embeddings;
  }
  if (vocab < 1) return UsageError("give --model DIR or --vocab N (token ids must fit the model)");
  PromptOptions prompt;
  // A synthetic prompt is made of blocks too; by default the served model's KV block, so that
  // --shared-prefix-ratio is honoured to the block.
  prompt.tokens_per_hash_id =
      trace_path.empty() && !flags.WasSet("tokens-per-hash-id") ? block_tokens : tokens_per_hash_id;
  prompt.trace_block_tokens = trace_block_tokens;
  prompt.vocab_size = vocab;
  prompt.max_output_tokens = trace_path.empty() ? output_tokens : max_output_tokens;
  prompt.cache_block_tokens = block_tokens;
  prompt.seed = static_cast<uint64_t>(seed);
  prompt.max_prompt_tokens = max_prompt_tokens > 0 ? max_prompt_tokens
                             : context_tokens > 0  ? context_tokens - prompt.max_output_tokens
                                                   : 4096;

  // The workload, built once per rate (a sweep rescales the arrivals only).
  std::vector<TraceEntry> trace;
  std::string description;
  if (!trace_path.empty()) {
    absl::StatusOr<std::vector<TraceEntry>> loaded = LoadMooncakeTrace(trace_path);
    if (!loaded.ok()) return UsageError(std::string(loaded.status().message()));
    trace = *std::move(loaded);
    if (trace_offset < 0 || trace_offset >= static_cast<int64_t>(trace.size())) {
      return UsageError(
          absl::StrCat("--trace-offset must be in [0, ", trace.size(), "), got ", trace_offset));
    }
    trace.erase(trace.begin(), trace.begin() + trace_offset);
    description = absl::StrFormat(
        "trace %s: %d requests from #%d of %d, %d tokens per hash id, output <= %d tokens, %s",
        trace_path, std::min<int64_t>(max_requests, static_cast<int64_t>(trace.size())),
        trace_offset, static_cast<int64_t>(trace.size()) + trace_offset, tokens_per_hash_id,
        max_output_tokens,
        rate > 0 ? absl::StrFormat("arrivals rescaled to %.3g req/s", rate)
                 : absl::StrFormat("time scale %.3g", time_scale));
  } else {
    description = absl::StrFormat(
        "synthetic: %s, %d prompt + %d output tokens, %.0f%% shared prefix over %d "
        "groups, %s",
        sweep_duration > absl::ZeroDuration()
            ? absl::StrCat("rate x ", absl::FormatDuration(sweep_duration), " requests")
            : absl::StrCat(std::min(num_requests, max_requests), " requests"),
        input_tokens, output_tokens, 100 * shared_prefix_ratio, prefix_groups,
        rate > 0 ? absl::StrFormat("%s arrivals at %.3g req/s", arrival, rate)
                 : absl::StrFormat("closed loop at concurrency %d", concurrency));
  }
  auto build = [&](double at_rate) -> absl::StatusOr<std::vector<WorkloadRequest>> {
    if (!trace.empty()) {
      absl::StatusOr<std::vector<WorkloadRequest>> w =
          BuildTraceWorkload(trace, prompt, time_scale, max_requests);
      if (w.ok() && at_rate > 0) ScaleToRate(at_rate, &*w);
      return w;
    }
    SyntheticOptions s;
    s.num_requests = std::min(num_requests, max_requests);
    if (sweep_duration > absl::ZeroDuration() && at_rate > 0) {
      s.num_requests = std::min(
          max_requests,
          static_cast<int64_t>(std::ceil(at_rate * absl::ToDoubleSeconds(sweep_duration))));
    }
    s.input_tokens = input_tokens;
    s.output_tokens = output_tokens;
    s.shared_prefix_ratio = shared_prefix_ratio;
    s.prefix_groups = prefix_groups;
    s.rate = at_rate;
    s.poisson = arrival == "poisson";
    return BuildSyntheticWorkload(s, prompt);
  };
  std::vector<std::optional<double>> steps;
  if (sweep->empty()) {
    steps.push_back(std::nullopt);
  } else {
    for (double r : *sweep) steps.push_back(r);
  }
  // Validate every step's workload before sending anything.
  std::vector<std::vector<WorkloadRequest>> workloads;
  for (const std::optional<double>& step : steps) {
    absl::StatusOr<std::vector<WorkloadRequest>> w = build(step.value_or(rate));
    if (!w.ok()) return UsageError(std::string(w.status().message()));
    workloads.push_back(*std::move(w));
  }
  ReportContext context;
  context.workload = description;
  context.slo_text = slo_text;
  context.verify = verify;
  int64_t blocks = 0, hit_blocks = 0;
  for (const WorkloadRequest& w : workloads.front()) {
    blocks += w.blocks;
    hit_blocks += w.ideal_hit_blocks;
    context.truncated_prompts += w.truncated ? 1 : 0;
  }
  if (!trace.empty() && blocks > 0) {
    context.trace_ideal_block_hit_rate = static_cast<double>(hit_blocks) / blocks;
  }

  std::vector<std::unique_ptr<GatewayClient>> clients;
  std::vector<const GatewayClient*> client_list;
  for (absl::string_view address : absl::StrSplit(gateway, ',', absl::SkipWhitespace())) {
    clients.push_back(
        std::make_unique<GatewayClient>(std::string(address), security, bearer_token));
    client_list.push_back(clients.back().get());
    if (wait_ready > absl::ZeroDuration()) {
      if (absl::Status s = WaitReady(std::string(address), *clients.back(), security, model_name,
                                     vocab, wait_ready);
          !s.ok()) {
        std::fprintf(stderr, "kvrelay bench-serve: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }
  if (clients.empty()) return UsageError("--gateway HOST:PORT is required");
  std::vector<RunReport> runs;
  int32_t extra_rates_left = sweep_past_saturation > 0 ? sweep_extra_rates : 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    RunOptions options;
    options.concurrency = concurrency;
    options.closed_loop = trace.empty() && !steps[i] && rate <= 0;
    options.max_requests = max_requests;
    options.max_duration = max_duration;
    options.timeout = timeout;
    options.model = model_name;
    // Each rate of a sweep on its own tenant (a cold cache), where the tenant is ours to name.
    options.tenant =
        steps.size() > 1 && security.insecure ? absl::StrCat(tenant, "-rate", i) : tenant;
    options.temperature = static_cast<float>(temperature);
    options.progress = !quiet;
    if (steps[i]) options.label = absl::StrFormat("rate %.3g/s", *steps[i]);
    if (!start_file.empty() && i == 0) {
      if (absl::Status s = WriteText(
              start_file, absl::StrFormat("%.6f\n", absl::ToUnixMicros(absl::Now()) / 1e6));
          !s.ok()) {
        return UsageError(absl::StrCat("--start-file: ", s.message()));
      }
    }
    RunResult result = RunLoad(client_list, workloads[i], options);
    RunReport run;
    run.rate = steps[i];
    run.records = std::move(result.records);
    run.not_sent = result.not_sent;
    run.stopped_by_duration = result.stopped_by_duration;
    run.start_unix = absl::ToUnixMicros(result.start) / 1e6;
    runs.push_back(std::move(run));
    if (i + 1 == steps.size() && extra_rates_left > 0) {
      if (std::optional<double> next = NextOverloadRate(runs, *slo, sweep_past_saturation)) {
        absl::StatusOr<std::vector<WorkloadRequest>> w = build(*next);
        if (!w.ok()) return UsageError(std::string(w.status().message()));
        steps.push_back(*next);
        workloads.push_back(*std::move(w));
        --extra_rates_left;
      }
    }
  }

  int exit_code = 0;
  if (verify) {
    for (size_t i = 0; i < runs.size(); ++i) {
      absl::Status s = VerifyRecords(model_dir, verify_threads, static_cast<float>(temperature),
                                     workloads[i], verify_sample, &runs[i].records);
      if (!s.ok()) {
        std::fprintf(stderr, "kvrelay bench-serve: %s\n", s.ToString().c_str());
        exit_code = 1;
      }
    }
  }
  for (RunReport& run : runs) {
    run.summary = Summarize(run.records, *slo);
    double end_s = 0;
    for (const RequestRecord& r : run.records) end_s = std::max(end_s, r.end_s);
    if (!events_path.empty() && runs.size() == 1) {
      absl::StatusOr<std::string> text = ReadFileToString(events_path);
      absl::StatusOr<std::vector<FaultEvent>> events =
          text.ok() ? ParseFaultEvents(*text, run.start_unix, end_s)
                    : absl::StatusOr<std::vector<FaultEvent>>(text.status());
      if (!events.ok()) {
        std::fprintf(stderr, "kvrelay bench-serve: --events: %s\n",
                     events.status().ToString().c_str());
        exit_code = 1;
      } else {
        run.faults = CostOfFaults(run.records, *events, *slo, end_s);
        if (contract.has_value()) {
          run.contract = CheckFaultContract(run.records, *events, ParseNodeAddresses(*text),
                                            *contract, absl::ToDoubleSeconds(timeout));
        }
      }
    }
  }
  const std::string table = FormatTable(context, runs);
  if (json_path != "-") std::fputs(table.c_str(), stdout);
  const nlohmann::json report = ReportJson(context, runs, /*with_requests=*/true);
  if (!json_path.empty()) {
    const nlohmann::json summary_only = ReportJson(context, runs, /*with_requests=*/false);
    if (absl::Status s = WriteText(json_path, summary_only.dump(2) + "\n"); !s.ok()) {
      std::fprintf(stderr, "kvrelay bench-serve: --json: %s\n", s.ToString().c_str());
      exit_code = 1;
    }
  }
  if (!csv_path.empty()) {
    if (absl::Status s = WriteText(csv_path, RecordsCsv(runs)); !s.ok()) {
      std::fprintf(stderr, "kvrelay bench-serve: --csv: %s\n", s.ToString().c_str());
      exit_code = 1;
    }
  }
  if (!plot_path.empty()) {
    if (absl::Status s = WritePlot(plot_path, report, python); !s.ok()) {
      std::fprintf(stderr, "kvrelay bench-serve: %s\n", s.ToString().c_str());
      exit_code = 1;
    } else {
      std::fprintf(json_path == "-" ? stderr : stdout, "plot: %s\n", plot_path.c_str());
    }
  }
  std::fflush(stdout);
  int64_t ok = 0, wrong = 0;
  for (const RunReport& run : runs) {
    ok += run.summary.ok;
    wrong += run.summary.wrong_tokens;
  }
  if (wrong > 0) {
    std::fprintf(stderr, "kvrelay bench-serve: %lld WRONG TOKENS served\n",
                 static_cast<long long>(wrong));
    return 3;
  }
  if (ok == 0) {
    std::fprintf(stderr, "kvrelay bench-serve: no request succeeded\n");
    return 1;
  }
  for (const RunReport& run : runs) {
    if (run.contract.has_value() && !run.contract->kept()) {
      std::fprintf(stderr, "kvrelay bench-serve: the fault contract was broken (%zu violations)\n",
                   run.contract->violations.size());
      return 4;
    }
  }
  return exit_code;
}

}  // namespace kvrelay::cli::bench_serve
