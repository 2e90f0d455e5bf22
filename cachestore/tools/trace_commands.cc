// `kvrelay trace-replay` and `kvrelay trace-gen`.

#include <algorithm>
#include <bit>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/sim/trace_gen.h"
#include "cachestore/sim/trace_replay.h"
#include "cachestore/tools/command.h"
#include "cachestore/tools/planner.h"
#include "common/file_util.h"
#include "common/flags.h"

namespace kvrelay::cachestore::tools {

namespace {}  // namespace

int RunTraceReplayCommand(const std::vector<std::string>& args) {
  FlagSet flags("trace-replay",
                "Replays a request trace through the cache store's index and eviction policies. "
                "Prints the prefix hit rate of every policy at every capacity (Belady = offline "
                "optimum).");
  TraceSourceFlags source;
  std::string capacities_text = "2000";
  std::string policies_text(kDefaultPolicy);
  bool json = false;
  int64_t learner_sampling = 1;
  int64_t ssd_blocks = 0;
  source.Register(flags);
  flags.AddString("capacity-blocks", &capacities_text,
                  "cache capacity in 512-token blocks; a comma list sweeps (2000,6000,20000)");
  flags.AddString("policy", &policies_text,
                  "comma list of lru, leaf-lru, lrfu, probation-lru, probation-lag, adaptive "
                  "(default), belady, belady-leaf (Belady leaf-first, as the store evicts); "
                  "all = each");
  flags.AddBool("json", &json, "one JSON object per result");
  flags.AddInt64("ssd-blocks", &ssd_blocks,
                 "a disk tier of this many blocks behind each DRAM capacity (0 = none): blocks "
                 "DRAM evicts are demoted to it, hits on it promoted back; online policies "
                 "also print the tiered hit rate, split by tier");
  flags.AddInt64("learner-sampling", &learner_sampling,
                 "adaptive: its shadows learn from 1 in N times fewer chains (a power of two), "
                 "as the store's learner does over its CPU budget under load");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (ssd_blocks < 0) {
    return CommandFailed(
        "trace-replay", absl::InvalidArgumentError(absl::StrCat(
                            "ssd-blocks: want a non-negative number of blocks, got ", ssd_blocks)));
  }
  if (learner_sampling < 1 || !std::has_single_bit(static_cast<uint64_t>(learner_sampling))) {
    return CommandFailed(
        "trace-replay", absl::InvalidArgumentError(absl::StrCat(
                            "learner-sampling: want a power of two >= 1, got ", learner_sampling)));
  }
  sim::ReplayOptions replay_options;
  replay_options.learner_halvings = std::countr_zero(static_cast<uint64_t>(learner_sampling));
  absl::StatusOr<std::vector<int64_t>> capacities =
      ParsePositiveList("capacity-blocks", capacities_text);
  if (!capacities.ok()) return CommandFailed("trace-replay", capacities.status());
  absl::StatusOr<std::vector<std::string>> policies = ParsePolicyList("policy", policies_text);
  if (!policies.ok()) return CommandFailed("trace-replay", policies.status());
  absl::StatusOr<LoadedTrace> trace = source.Load();
  if (!trace.ok()) return CommandFailed("trace-replay", trace.status());
  absl::StatusOr<std::vector<sim::ReplayResult>> results =
      sim::ReplaySweep(trace->requests, *capacities, *policies, replay_options);
  if (!results.ok()) return CommandFailed("trace-replay", results.status());
  for (const sim::ReplayResult& r : *results) {
    if (json) {
      std::printf(
          "{\"trace\": \"%s\", \"policy\": \"%s\", \"capacity_blocks\": %lld, \"hit_rate\": "
          "%.6f, \"requests\": %lld, \"blocks\": %lld, \"hit_blocks\": %lld, \"evictions\": "
          "%lld}\n",
          trace->name.c_str(), r.policy.c_str(), static_cast<long long>(r.capacity_blocks),
          r.hit_rate(), static_cast<long long>(r.requests), static_cast<long long>(r.blocks),
          static_cast<long long>(r.hit_blocks), static_cast<long long>(r.evictions));
    } else {
      std::printf(
          "%s policy %s capacity %lld blocks: hit rate %.4f (%lld of %lld blocks, %lld "
          "requests, %lld evictions)\n",
          trace->name.c_str(), r.policy.c_str(), static_cast<long long>(r.capacity_blocks),
          r.hit_rate(), static_cast<long long>(r.hit_blocks), static_cast<long long>(r.blocks),
          static_cast<long long>(r.requests), static_cast<long long>(r.evictions));
    }
    if (ssd_blocks == 0 || sim::IsOfflinePolicy(r.policy)) continue;
    absl::StatusOr<sim::TieredReplayResult> tiered =
        sim::ReplayTiered(trace->requests, r.capacity_blocks, ssd_blocks, r.policy, replay_options);
    if (!tiered.ok()) return CommandFailed("trace-replay", tiered.status());
    const sim::TieredReplayResult& t = *tiered;
    const double blocks = static_cast<double>(std::max<int64_t>(t.total.blocks, 1));
    if (json) {
      std::printf(
          "{\"trace\": \"%s\", \"policy\": \"%s\", \"capacity_blocks\": %lld, \"ssd_blocks\": "
          "%lld, \"hit_rate\": %.6f, \"dram_hit_rate\": %.6f, \"ssd_hit_rate\": %.6f, "
          "\"demotions\": %lld, \"promotions\": %lld, \"ssd_evictions\": %lld}\n",
          trace->name.c_str(), t.total.policy.c_str(),
          static_cast<long long>(t.total.capacity_blocks), static_cast<long long>(t.disk_blocks),
          t.total.hit_rate(), t.dram_hit_blocks / blocks, t.disk_hit_blocks / blocks,
          static_cast<long long>(t.demotions), static_cast<long long>(t.promotions),
          static_cast<long long>(t.disk_evictions));
    } else {
      std::printf(
          "%s policy %s capacity %lld blocks + ssd %lld blocks: hit rate %.4f (dram %.4f, ssd "
          "%.4f; %lld demoted, %lld promoted, %lld dropped from ssd)\n",
          trace->name.c_str(), t.total.policy.c_str(),
          static_cast<long long>(t.total.capacity_blocks), static_cast<long long>(t.disk_blocks),
          t.total.hit_rate(), t.dram_hit_blocks / blocks, t.disk_hit_blocks / blocks,
          static_cast<long long>(t.demotions), static_cast<long long>(t.promotions),
          static_cast<long long>(t.disk_evictions));
    }
  }
  return 0;
}

int RunTraceGenCommand(const std::vector<std::string>& args) {
  FlagSet flags("trace-gen",
                "Writes a deterministic generated trace (Mooncake JSON-lines format) to stdout "
                "or --out. Shapes: multiturn, agent, scan, shift.");
  std::string shape = "multiturn";
  int64_t seed = 1;
  int64_t requests = 3000;
  std::string out;
  flags.AddString("shape", &shape, "multiturn | agent | scan | shift");
  flags.AddInt64("seed", &seed, "generator seed (same seed, same trace)");
  flags.AddInt64("requests", &requests, "number of requests (1..10000000)");
  flags.AddString("out", &out, "output file; empty = stdout");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  absl::StatusOr<std::vector<sim::TraceRequest>> trace =
      sim::GenerateTrace(shape, static_cast<uint64_t>(seed), requests);
  if (!trace.ok()) return CommandFailed("trace-gen", trace.status());
  const std::string text = sim::TraceToJsonLines(*trace);
  if (out.empty()) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  if (absl::Status s = WriteFileAtomically(out, text); !s.ok())
    return CommandFailed("trace-gen", s);
  return 0;
}

}  // namespace kvrelay::cachestore::tools
