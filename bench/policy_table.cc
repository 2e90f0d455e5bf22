// Issue 17's policy table and window-aware figure in one run: every eviction policy on every
// trace (the shared Mooncake trace when present, plus the generated shapes, plus any held-out
// traces named) at every capacity, with Belady's offline optimum as the ceiling and each
// policy's ratio to LRU measured in the same run. Then prefix hit rate vs cache bytes for a
// Gemma-3-27B-shaped layout, window-aware vs every layer alike.
//
//   build/bin/policy_table [--trace PATH] [--held-out PATH]... [--capacities LIST]
//                          [--requests N] [--no-window]
//
// A held-out trace is one no policy was developed on (README: Mooncake's real conversation
// trace); its rows are named "held-out:" and the file's name. An unreadable one is an error,
// not a skipped row: a table that silently lacks the held-out trace would read as a pass.

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "cachestore/sim/trace_gen.h"
#include "cachestore/sim/trace_replay.h"
#include "cachestore/sim/window_store.h"
#include "cachestore/tools/planner.h"

using namespace kvrelay::cachestore;
using namespace kvrelay::cachestore::sim;
using namespace kvrelay::cachestore::tools;

int main(int argc, char** argv) {
  std::string mooncake = "/work/shared/data/traces/synthetic_trace.jsonl";
  int64_t requests = 4000;
  bool window = true;
  std::vector<std::string> held_out;
  std::vector<int64_t> capacities = {1000, 2000, 6000, 20000};
  const char* usage =
      "usage: policy_table [--trace PATH] [--held-out PATH]... [--capacities LIST] "
      "[--requests N] [--no-window]\n";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-window") == 0) {
      window = false;
    } else if (i + 1 < argc && std::strcmp(argv[i], "--trace") == 0) {
      mooncake = argv[++i];
    } else if (i + 1 < argc && std::strcmp(argv[i], "--held-out") == 0) {
      held_out.push_back(argv[++i]);
    } else if (i + 1 < argc && std::strcmp(argv[i], "--capacities") == 0) {
      absl::StatusOr<std::vector<int64_t>> parsed = ParsePositiveList("--capacities", argv[++i]);
      if (!parsed.ok()) {
        std::fprintf(stderr, "%s\n", std::string(parsed.status().message()).c_str());
        return 2;
      }
      capacities = *std::move(parsed);
    } else if (i + 1 < argc && std::strcmp(argv[i], "--requests") == 0) {
      if (!absl::SimpleAtoi(argv[++i], &requests) || requests <= 0) {
        std::fprintf(stderr, "--requests: '%s' is not a positive number of requests\n", argv[i]);
        return 2;
      }
    } else {
      std::fputs(usage, stderr);
      return 2;
    }
  }
  struct Named {
    std::string name;
    std::vector<TraceRequest> trace;
  };
  std::vector<Named> traces;
  if (auto t = LoadTrace(mooncake); t.ok()) {
    traces.push_back({"mooncake-synthetic", *std::move(t)});
  } else {
    std::fprintf(stderr, "skipping %s: %s\n", mooncake.c_str(), t.status().ToString().c_str());
  }
  for (const std::string& shape : TraceShapeNames()) {
    auto t = GenerateTrace(shape, 1, requests);
    if (!t.ok()) {
      std::fprintf(stderr, "trace shape %s: %s\n", shape.c_str(), t.status().ToString().c_str());
      return 2;
    }
    traces.push_back({"gen:" + shape, *std::move(t)});
  }
  for (const std::string& path : held_out) {
    auto t = LoadTrace(path);
    if (!t.ok()) {
      std::fprintf(stderr, "--held-out %s: %s\n", path.c_str(), t.status().ToString().c_str());
      return 2;
    }
    std::string name = path.substr(path.find_last_of('/') + 1);
    if (name.size() > 6 && name.ends_with(".jsonl")) name.resize(name.size() - 6);
    traces.push_back({"held-out:" + name, *std::move(t)});
  }
  const std::vector<std::string> policies = {"lru",           "leaf-lru", "lrfu",   "probation-lru",
                                             "probation-lag", "adaptive", "belady", "belady-leaf"};
  std::printf(
      "| trace | blocks | capacity | lru | leaf-lru | lrfu | probation-lru | probation-lag | "
      "adaptive "
      "(default) | belady | belady-leaf | adaptive/lru | gap closed (adaptive) |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Named& t : traces) {
    int64_t blocks = 0;
    for (const TraceRequest& r : t.trace) blocks += static_cast<int64_t>(r.hash_ids.size());
    for (int64_t c : capacities) {
      auto rs = ReplaySweep(t.trace, {c}, policies);
      if (!rs.ok()) return 1;
      const double lru = (*rs)[0].hit_rate(), ada = (*rs)[5].hit_rate(), bel = (*rs)[6].hit_rate();
      std::printf(
          "| %s | %lld | %lld | %.4f | %.4f | %.4f | %.4f | %.4f | %.4f | %.4f | %.4f | %.3fx | %s "
          "|\n",
          t.name.c_str(), static_cast<long long>(blocks), static_cast<long long>(c), lru,
          (*rs)[1].hit_rate(), (*rs)[2].hit_rate(), (*rs)[3].hit_rate(), (*rs)[4].hit_rate(), ada,
          bel, (*rs)[7].hit_rate(), lru > 0 ? ada / lru : 0.0,
          bel - lru > 1e-9 ? std::to_string(static_cast<int>(100 * (ada - lru) / (bel - lru)))
                                 .append("%")
                                 .c_str()
                           : "-");
    }
  }
  if (!window) return 0;
  // Gemma 3 27B per 512-token block: 10 global layers (full part) and 52 sliding-window layers
  // (1,024 tokens = 2 blocks), 16 KV heads x 128, bf16 K and V.
  const BlockParts gemma{int64_t{512} * 10 * 16 * 128 * 4, int64_t{512} * 52 * 16 * 128 * 4, 2};
  const double block_gib = static_cast<double>(gemma.full_bytes + gemma.window_bytes) / (1 << 30);
  std::printf("\nGemma-3-27B layout, prefix hit rate vs cache bytes (adaptive; block = %.3f GiB)\n",
              block_gib);
  std::printf("| trace | GiB | alike | window-aware | aware/alike |\n|---|---:|---:|---:|---:|\n");
  for (const Named& t : traces) {
    for (double gib : {64.0, 128.0, 256.0, 512.0, 1024.0}) {
      const int64_t bytes = static_cast<int64_t>(gib * (1 << 30));
      auto alike = ReplayWindowed(t.trace, bytes, gemma, false, "adaptive");
      auto aware = ReplayWindowed(t.trace, bytes, gemma, true, "adaptive");
      if (!alike.ok() || !aware.ok()) return 1;
      std::printf("| %s | %.0f | %.4f | %.4f | %.2fx |\n", t.name.c_str(), gib, alike->hit_rate(),
                  aware->hit_rate(),
                  alike->hit_rate() > 0 ? aware->hit_rate() / alike->hit_rate() : 0);
    }
  }
  return 0;
}
