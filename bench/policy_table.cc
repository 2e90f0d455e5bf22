// Issue 17's policy table and window-aware figure in one run: every eviction policy on every
// trace (the shared Mooncake trace when present, plus the generated shapes) at every capacity,
// with Belady's offline optimum as the ceiling and each policy's ratio to LRU measured in the
// same run. Then prefix hit rate vs cache bytes for a Gemma-3-27B-shaped layout, window-aware vs
// every layer alike.
//
//   build/bin/policy_table [--trace PATH] [--requests N] [--no-window]

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cachestore/trace_gen.h"
#include "cachestore/trace_replay.h"
#include "cachestore/window_store.h"

using namespace kvrelay::cachestore;

int main(int argc, char** argv) {
  std::string mooncake = "/work/shared/data/traces/synthetic_trace.jsonl";
  int64_t requests = 4000;
  bool window = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-window") == 0) {
      window = false;
    } else if (i + 1 < argc && std::strcmp(argv[i], "--trace") == 0) {
      mooncake = argv[++i];
    } else if (i + 1 < argc && std::strcmp(argv[i], "--requests") == 0) {
      requests = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: policy_table [--trace PATH] [--requests N] [--no-window]\n");
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
    if (!t.ok()) return 1;
    traces.push_back({"gen:" + shape, *std::move(t)});
  }
  const std::vector<std::string> policies = {"lru",           "leaf-lru", "lrfu",   "probation-lru",
                                             "probation-lag", "adaptive", "belady", "belady-leaf"};
  const std::vector<int64_t> capacities = {1000, 2000, 6000, 20000};
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
