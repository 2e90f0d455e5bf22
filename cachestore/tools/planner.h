#pragma once

// The capacity planner behind `kvrelay plan`, and the trace-source flags the offline tools
// share. A plan replays one trace (the requests one node sees) per model and memory size through
// the cache store's index and policy, sized in that model's exact bytes per 512-token block
// (kv::ModelLayout: MHA / GQA / MLA / sliding window / SSM state), and reports per request the
// prefix hit rate, the prefill compute saved and the KV bytes moved.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cachestore/sim/trace_replay.h"
#include "cachestore/sim/window_store.h"
#include "common/flags.h"
#include "kv/hf_config.h"

namespace kvrelay::cachestore::tools {

// "--trace FILE" or a generated trace ("--shape multiturn --seed 1 --requests 3000").
struct LoadedTrace {
  std::string name;  // file base name or "gen:<shape>"
  std::vector<sim::TraceRequest> requests;
};
struct TraceSourceFlags {
  std::string trace;
  std::string shape;
  int64_t seed = 1;
  int64_t requests = 3000;
  void Register(FlagSet& flags);
  // InvalidArgument naming the flag (both or neither of --trace / --shape) or the trace line.
  absl::StatusOr<LoadedTrace> Load() const;
};

// "1,2,3" -> {1,2,3}; InvalidArgument naming `flag` for an empty list, a non-number or a value
// <= 0.
absl::StatusOr<std::vector<int64_t>> ParsePositiveList(const std::string& flag,
                                                       const std::string& text);
absl::StatusOr<std::vector<double>> ParsePositiveDoubles(const std::string& flag,
                                                         const std::string& text);
// Comma list of policy names ("all" = lru, leaf-lru, lrfu, probation-lru, probation-lag,
// adaptive, belady); InvalidArgument naming `flag` and the unknown name.
absl::StatusOr<std::vector<std::string>> ParsePolicyList(const std::string& flag,
                                                         const std::string& text);

// What the planner needs to know about one model.
struct PlanModel {
  std::string name;
  kv::ModelConfig config;               // layout with 512-token blocks, in the KV dtype
  sim::BlockParts parts;                // bytes of one 512-token block: full part, window part
  double linear_flops_per_token = 0;    // 2 x parameters a token passes through (dense estimate)
  double attention_flops_per_pair = 0;  // per (query, key) pair, summed over full layers
  double window_flops_per_pair = 0;     // same, over sliding-window layers
  int64_t window_tokens = 0;
};
// A preset name (kv/presets.h) or a path to a Hugging Face config.json, its cache in `kv_dtype`
// (nullopt: the model's dtype; fp8_e4m3 blocks carry their scales, kv/model_layout.h).
// InvalidArgument naming the model (unknown, or a kv_dtype its layout refuses: fp8 for an SSM).
absl::StatusOr<PlanModel> LoadPlanModel(const std::string& spec,
                                        std::optional<kv::DType> kv_dtype = std::nullopt);
// FLOPs to prefill the first n tokens of a sequence (linear layers + attention score/value).
double PrefillFlops(const PlanModel& model, int64_t n);

struct PlanRow {
  std::string model;
  std::string policy;
  double memory_gib = 0;
  int64_t capacity_blocks = 0;           // whole blocks (both parts) that fit
  double hit_rate = 0;                   // usable prefix blocks / all blocks
  double compute_saved = 0;              // prefill FLOPs skipped / prefill FLOPs of all prompts
  double bytes_read_per_request = 0;     // KV read from the cache (hit blocks, parts needed)
  double bytes_written_per_request = 0;  // KV of newly computed full blocks stored
};

struct PlanOptions {
  std::vector<double> memory_gib;     // per node
  std::vector<std::string> policies;  // policies (belady allowed: sized in whole blocks)
  bool window_aware = true;           // split sliding-window parts (no effect without them)
};
// InvalidArgument naming the flag for an empty or non-positive memory list, or a memory size
// smaller than one block of the model.
absl::StatusOr<std::vector<PlanRow>> Plan(const LoadedTrace& trace, const PlanModel& model,
                                          const PlanOptions& options);

// `kvrelay plan --tiers dram=SIZE,ssd=SIZE`: DRAM per node with a disk tier behind it.
struct TierSizes {
  uint64_t dram_bytes = 0;
  uint64_t ssd_bytes = 0;
};
// "dram=64GiB,ssd=2TiB" (units B, KiB, MiB, GiB, TiB; both keys required); InvalidArgument
// naming the flag and the part that does not parse.
absl::StatusOr<TierSizes> ParseTierSizes(const std::string& flag, const std::string& text);

// What a request's TTFT saving from the disk tier is estimated with: the prefill compute a
// disk hit saves and the disk read it costs instead (reads and compute not overlapped).
struct TierRates {
  // Effective prefill FLOP/s of one node: about 40% of an H100's 989 dense BF16 TFLOP/s.
  double prefill_flops_per_second = 400e12;
  // One PCIe 4.0 NVMe drive's sequential read.
  double disk_read_bytes_per_second = 6e9;
};

struct TieredPlanRow {
  std::string model;
  std::string policy;
  int64_t dram_blocks = 0;
  int64_t ssd_blocks = 0;
  double hit_rate = 0;            // leading blocks found in DRAM or on disk / all blocks
  double dram_hit_rate = 0;       // of those, found in DRAM
  double disk_hit_rate = 0;       // found on disk (each read back: a disk read, not compute)
  double dram_only_hit_rate = 0;  // the same DRAM without the disk tier
  // Prompt tokens not recomputed thanks to the disk tier, per request: the prefill work a
  // request saves over DRAM alone (what its TTFT saves, less the disk reads).
  double extra_hit_tokens_per_request = 0;
  double disk_read_bytes_per_request = 0;  // KV read back from disk
  // Prefill time the extra hits save (at TierRates::prefill_flops_per_second, each extra token
  // at the trace's mean prompt length) less the disk reads' time, per request. Negative: the
  // disk is slower than recomputing (workers then recompute: nothing saved).
  double ttft_saved_ms_per_request = 0;
};
// Replays the trace through DRAM (sized in the model's whole blocks) with a disk tier behind it
// (sim::ReplayTiered, online policies only) and through the same DRAM alone.
absl::StatusOr<std::vector<TieredPlanRow>> PlanTiered(const LoadedTrace& trace,
                                                      const PlanModel& model, TierSizes sizes,
                                                      const std::vector<std::string>& policies,
                                                      TierRates rates = {});

}  // namespace kvrelay::cachestore::tools
