#include "sim/tools/command.h"

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cachestore/tools/planner.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "kv/presets.h"
#include "nlohmann/json.hpp"
#include "sim/simulation.h"

namespace kvrelay::sim::tools {

namespace {

constexpr char kName[] = "simulate";

// "ttft=2s,tpot=250ms" -> the two bounds.
absl::Status ParseSlo(const std::string& text, TrafficSpec& traffic) {
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    absl::Duration d;
    if (!absl::ParseDuration(kv.second, &d) || d <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat("slo: want ttft=DUR,tpot=DUR, got '", part, "'"));
    }
    if (kv.first == "ttft") {
      traffic.slo_ttft = d;
    } else if (kv.first == "tpot") {
      traffic.slo_tpot = d;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("slo: unknown bound '", kv.first, "'"));
    }
  }
  return absl::OkStatus();
}

// Applies one swept value; InvalidArgument for an unknown key or a bad value.
absl::Status ApplySweep(const std::string& key, const std::string& value, ClusterSpec& cluster,
                        TrafficSpec& traffic) {
  double number = 0;
  if (!absl::SimpleAtod(value, &number) || number <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sweep: '", value, "' is not a positive number"));
  }
  const auto whole = static_cast<int64_t>(number);
  if (key == "prefill") {
    cluster.prefill_nodes = static_cast<int32_t>(whole);
  } else if (key == "decode") {
    cluster.decode_nodes = static_cast<int32_t>(whole);
  } else if (key == "cache-blocks") {
    cluster.cache_blocks = whole;
  } else if (key == "disk-blocks") {
    cluster.disk_blocks = whole;
  } else if (key == "max-batch") {
    cluster.max_batch = static_cast<int32_t>(whole);
  } else if (key == "time-scale") {
    traffic.time_scale = number;
  } else if (key == "populations") {
    traffic.populations = static_cast<int32_t>(whole);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("sweep: unknown key '", key,
                     "' (prefill, decode, cache-blocks, disk-blocks, max-batch, time-scale, "
                     "populations)"));
  }
  return absl::OkStatus();
}

}  // namespace

int RunSimulateCommand(const std::vector<std::string>& args) {
  FlagSet flags(kName,
                "Simulates a cluster serving a request trace: the gateway's own routing "
                "(pickers, breakers, the reuse cost model, GenerateCall), the cache store's own "
                "index, placement and eviction, and the workers' own admission rules, on a "
                "simulated clock; compute and transfers cost what --profile says. Prints TTFT / "
                "TPOT / E2E percentiles, goodput under --slo, the prefix hit rate, bytes moved, "
                "store calls per second, queueing and utilisation per node, and the busiest "
                "resource. Deterministic: the same inputs give the same run.");
  cachestore::tools::TraceSourceFlags source;
  source.Register(flags);
  std::string model = "llama3-8b";
  int32_t block_tokens = 16;
  std::string profile_path;
  ClusterSpec cluster;
  TrafficSpec traffic;
  std::string routing = "prefix";
  std::string slo = "ttft=2s,tpot=250ms";
  std::string json_path, csv_path, sweep;
  flags.AddString("model", &model, "model preset whose KV layout is simulated (kv/presets.h)");
  flags.AddInt32("block-tokens", &block_tokens,
                 "tokens per KV block (the workers' --block-tokens); larger blocks make the "
                 "store's work per request, and the simulation, cheaper");
  flags.AddString("profile", &profile_path,
                  "hardware profile JSON (sim/profiles/*.json; see sim/profile.h); empty: the "
                  "built-in defaults");
  flags.AddInt32("prefill", &cluster.prefill_nodes, "prefill nodes");
  flags.AddInt32("decode", &cluster.decode_nodes, "decode nodes");
  flags.AddInt64("cache-blocks", &cluster.cache_blocks,
                 "cache-store segment of every node, in the model's KV blocks");
  flags.AddInt64(
      "disk-blocks", &cluster.disk_blocks,
      "each node's disk tier (--ssd-dir/--ssd-bytes), in the model's KV blocks; 0: none");
  flags.AddInt64("decode-kv-blocks", &cluster.decode_kv_blocks, "each decode node's KV pool");
  flags.AddInt32("max-batch", &cluster.max_batch, "sequences per decode step");
  flags.AddInt32("max-queued", &cluster.max_queued, "sequences waiting for a decode batch");
  flags.AddDuration("max-queue-wait", &cluster.max_queue_wait,
                    "both roles' --max-queue-wait (admission refuses a longer predicted wait; "
                    "0: only past the deadline)");
  flags.AddString("policy", &cluster.policy,
                  "the store's eviction policy (lrfu, lru, leaf-lru, probation-lru, "
                  "probation-lag; adaptive learns on a thread, so its runs vary)");
  flags.AddString("routing", &routing, "prefix (KV-aware, the gateway's default) or load");
  flags.AddDouble("time-scale", &traffic.time_scale,
                  "arrival times multiplied by this, as bench-serve's (0.5: twice as fast)");
  flags.AddInt32("populations", &traffic.populations,
                 "independent copies of the trace's users, each with its own prompts");
  flags.AddInt64("max-requests", &traffic.max_requests, "stop after this many (0: all)");
  flags.AddDuration("timeout", &traffic.timeout, "each request's deadline");
  flags.AddInt64("trace-offset", &traffic.trace_offset, "skip the trace's first N requests");
  flags.AddInt32("tokens-per-hash-id", &traffic.tokens_per_hash_id,
                 "prompt tokens per trace block id (512 = the trace's own; fewer shrink "
                 "prompts as bench-serve's flag does)");
  flags.AddInt32("max-output-tokens", &traffic.max_output_tokens,
                 "the trace's output lengths are capped to this");
  flags.AddString("slo", &slo, "goodput counts requests within both: ttft=DUR,tpot=DUR");
  flags.AddString("json", &json_path, "write the report (JSON; a list when sweeping) here");
  flags.AddString("csv", &csv_path, "write one line per request here (the last run of a sweep)");
  flags.AddString("sweep", &sweep,
                  "KEY=V1,V2,...: one run per value of prefill, decode, cache-blocks, "
                  "max-batch, time-scale or populations");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;

  if (routing != "prefix" && routing != "load") {
    return CommandFailed(kName, absl::InvalidArgumentError(absl::StrCat(
                                    "routing: want prefix or load, got '", routing, "'")));
  }
  cluster.prefix_routing = routing == "prefix";
  if (absl::Status st = ParseSlo(slo, traffic); !st.ok()) return CommandFailed(kName, st);
  HardwareProfile profile;
  if (!profile_path.empty()) {
    absl::StatusOr<HardwareProfile> loaded = LoadProfile(profile_path);
    if (!loaded.ok()) return CommandFailed(kName, loaded.status());
    profile = *std::move(loaded);
  }
  kv::ConfigOptions config_options;
  config_options.block_tokens = block_tokens;
  absl::StatusOr<kv::ModelConfig> config = kv::LoadPreset(model, config_options);
  if (!config.ok()) return CommandFailed(kName, config.status());
  absl::StatusOr<cachestore::tools::LoadedTrace> trace = source.Load();
  if (!trace.ok()) return CommandFailed(kName, trace.status());

  std::string sweep_key;
  std::vector<std::string> sweep_values = {""};
  if (!sweep.empty()) {
    std::pair<std::string, std::string> kv = absl::StrSplit(sweep, absl::MaxSplits('=', 1));
    sweep_key = kv.first;
    sweep_values = absl::StrSplit(kv.second, ',', absl::SkipEmpty());
    if (sweep_values.empty()) {
      return CommandFailed(kName, absl::InvalidArgumentError("sweep: want KEY=V1,V2,..."));
    }
  }
  nlohmann::json reports = nlohmann::json::array();
  std::string csv;
  for (const std::string& value : sweep_values) {
    ClusterSpec c = cluster;
    TrafficSpec t = traffic;
    if (!sweep_key.empty()) {
      if (absl::Status st = ApplySweep(sweep_key, value, c, t); !st.ok()) {
        return CommandFailed(kName, st);
      }
    }
    absl::StatusOr<SimReport> report = Simulate(trace->requests, c, t, profile, config->layout);
    if (!report.ok()) return CommandFailed(kName, report.status());
    std::printf("%s%s: %d prefill + %d decode nodes, %s routing, %s\n",
                sweep_key.empty() ? "" : absl::StrCat(sweep_key, "=", value, " ").c_str(),
                trace->name.c_str(), c.prefill_nodes, c.decode_nodes, routing.c_str(),
                profile.name.empty() ? "default profile" : profile.name.c_str());
    std::printf("%s\n", report->Summary().c_str());
    nlohmann::json j = nlohmann::json::parse(report->ToJson());
    if (!sweep_key.empty()) j["sweep"] = {{"key", sweep_key}, {"value", value}};
    j["cluster"] = {{"prefill", c.prefill_nodes},
                    {"decode", c.decode_nodes},
                    {"cache_blocks", c.cache_blocks},
                    {"disk_blocks", c.disk_blocks},
                    {"routing", routing},
                    {"model", model},
                    {"profile", profile.name},
                    {"trace", trace->name}};
    reports.push_back(std::move(j));
    csv = report->RecordsCsv();
  }
  if (!json_path.empty()) {
    absl::Status st =
        WriteFileAtomically(json_path, (sweep_key.empty() ? reports[0] : reports).dump(2) + "\n");
    if (!st.ok()) return CommandFailed(kName, st);
  }
  if (!csv_path.empty()) {
    absl::Status st = WriteFileAtomically(csv_path, csv);
    if (!st.ok()) return CommandFailed(kName, st);
  }
  return 0;
}

}  // namespace kvrelay::sim::tools
