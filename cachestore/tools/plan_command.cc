// `kvrelay plan`: the capacity planner (see planner.h).

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cachestore/eviction_policy.h"
#include "cachestore/tools/command.h"
#include "cachestore/tools/planner.h"
#include "common/file_util.h"
#include "common/flags.h"
#include "kv/model_layout.h"

extern char** environ;

namespace kvrelay::cachestore::tools {

namespace {

int Fail(const absl::Status& status) { return CommandFailed("plan", status); }

// Hit rate vs memory, one curve per (model, policy), drawn by Debian's python3-matplotlib.
constexpr char kPlotScript[] = R"PY(
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
data = json.load(open(sys.argv[1]))
fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
for curve in data["curves"]:
    ax.plot(curve["gib"], curve["hit_rate"], marker="o", label=curve["label"],
            linestyle="--" if curve["policy"] == "belady" else "-")
if data.get("target"):
    ax.axhline(data["target"], color="grey", linewidth=0.8, linestyle=":")
ax.set_xscale("log", base=2)
ticks = sorted({g for c in data["curves"] for g in c["gib"]})
ax.set_xticks(ticks)
ax.set_xticklabels(["%g" % t for t in ticks])
ax.set_xlabel("KV cache memory per node (GiB)")
ax.set_ylabel("prefix hit rate (blocks)")
ax.set_ylim(0, 1)
ax.set_title(data["title"])
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[2])
)PY";

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

absl::Status WritePlot(const std::string& png, const std::string& title, double target,
                       const std::vector<PlanRow>& rows) {
  std::map<std::pair<std::string, std::string>, std::vector<const PlanRow*>> curves;
  for (const PlanRow& r : rows) curves[{r.model, r.policy}].push_back(&r);
  std::string json =
      absl::StrCat("{\"title\": ", JsonString(title), ", \"target\": ", target, ", \"curves\": [");
  bool first = true;
  for (const auto& [key, points] : curves) {
    std::string gib, hit;
    for (const PlanRow* p : points) {
      absl::StrAppend(&gib, gib.empty() ? "" : ", ", p->memory_gib);
      absl::StrAppend(&hit, hit.empty() ? "" : ", ", p->hit_rate);
    }
    absl::StrAppend(&json, first ? "" : ", ",
                    "{\"label\": ", JsonString(key.first + " " + key.second),
                    ", \"policy\": ", JsonString(key.second), ", \"gib\": [", gib,
                    "], \"hit_rate\": [", hit, "]}");
    first = false;
  }
  json += "]}\n";
  const std::string data_path = png + ".data.json";
  if (absl::Status s = WriteFileAtomically(data_path, json); !s.ok()) return s;
  std::vector<std::string> argv_s = {"/usr/bin/python3", "-c", kPlotScript, data_path, png};
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    unlink(data_path.c_str());
    return absl::FailedPreconditionError(
        absl::StrCat("plot: cannot run /usr/bin/python3 (install python3-matplotlib): errno ", rc));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  unlink(data_path.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::FailedPreconditionError(
        "plot: /usr/bin/python3 with matplotlib failed (Debian package python3-matplotlib)");
  }
  return absl::OkStatus();
}

std::string Bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", b, units[u]);
}

// One line per model: the KV dtype its blocks are sized in and their bytes.
void PrintModels(const std::vector<PlanModel>& models) {
  for (const PlanModel& m : models) {
    const kv::ModelLayout& layout = m.config.layout;
    std::printf("model %s: KV %s, %lld bytes per %d-token block\n", m.name.c_str(),
                std::string(kv::DTypeName(layout.dtype())).c_str(),
                static_cast<long long>(m.parts.full_bytes + m.parts.window_bytes),
                layout.block_tokens());
  }
}

}  // namespace

int RunPlanCommand(const std::vector<std::string>& args) {
  FlagSet flags("plan",
                "Capacity planner: replays a trace per model and memory size and prints prefix "
                "hit rate, prefill compute saved and KV bytes moved per request.");
  TraceSourceFlags source;
  std::string models_text = "llama3-70b,deepseek-v3";
  std::string memory_text = "8,16,32,64,128,256";
  // The store's own policy: a plan is for the cache the service will run.
  std::string policies_text(kDefaultPolicy);
  bool window_aware = true;
  double target = 0.5;
  std::string plot;
  bool json = false;
  std::string kv_dtype_text = "auto";
  source.Register(flags);
  flags.AddString("model", &models_text, "comma list of presets or config.json paths");
  flags.AddString("kv-dtype", &kv_dtype_text,
                  "the KV cache's dtype the blocks are sized in: auto (each model's own), bf16, "
                  "fp16, fp32 or fp8_e4m3 (about half of bf16: E4M3 values, scales in the block)");
  flags.AddString("memory-gib", &memory_text, "comma list of KV cache memory per node, GiB");
  flags.AddString(
      "policy", &policies_text,
      "comma list: lru, leaf-lru, lrfu, probation-lru, probation-lag, adaptive (the store's "
      "default), belady, belady-leaf; all = every one but belady-leaf");
  flags.AddBool("window-aware", &window_aware,
                "keep sliding-window parts apart and reclaim interior ones first");
  flags.AddDouble("target-hit-rate", &target,
                  "print the least memory (interpolated) that reaches this hit rate");
  flags.AddString("plot", &plot, "write a PNG: hit rate vs memory, one curve per model");
  flags.AddBool("json", &json, "one JSON object per row");
  std::string tiers_text;
  TierRates rates;
  double prefill_tflops = rates.prefill_flops_per_second / 1e12;
  double disk_gbps = rates.disk_read_bytes_per_second / 1e9;
  flags.AddDouble("prefill-tflops", &prefill_tflops,
                  "with --tiers: effective prefill TFLOP/s of a node, for the TTFT saving (about "
                  "40% of an H100's dense BF16 peak)");
  flags.AddDouble("disk-gbps", &disk_gbps,
                  "with --tiers: disk read GB/s, for the TTFT saving (one PCIe 4.0 NVMe drive)");
  flags.AddString("tiers", &tiers_text,
                  "dram=SIZE,ssd=SIZE (e.g. dram=64GiB,ssd=2TiB): DRAM per node with a disk tier "
                  "behind it instead of --memory-gib; prints the hit rate per tier against the "
                  "same DRAM alone (online policies)");
  if (std::optional<int> exit_code = ParseCommandLine(flags, args)) return *exit_code;
  if (!tiers_text.empty()) {
    if (!(prefill_tflops > 0) || !(disk_gbps > 0)) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--prefill-tflops and --disk-gbps must be positive, got ", prefill_tflops,
                       " and ", disk_gbps)));
    }
    rates.prefill_flops_per_second = prefill_tflops * 1e12;
    rates.disk_read_bytes_per_second = disk_gbps * 1e9;
    absl::StatusOr<TierSizes> sizes = ParseTierSizes("--tiers", tiers_text);
    if (!sizes.ok()) return Fail(sizes.status());
    absl::StatusOr<std::vector<std::string>> policies = ParsePolicyList("policy", policies_text);
    if (!policies.ok()) return Fail(policies.status());
    absl::StatusOr<std::optional<kv::DType>> kv_dtype =
        kv::ParseKvDTypeFlag("--kv-dtype", kv_dtype_text);
    if (!kv_dtype.ok()) return Fail(kv_dtype.status());
    absl::StatusOr<LoadedTrace> trace = source.Load();
    if (!trace.ok()) return Fail(trace.status());
    if (!json) {
      std::printf("trace %s: %zu requests; DRAM %s + SSD %s per node\n", trace->name.c_str(),
                  trace->requests.size(), Bytes(static_cast<double>(sizes->dram_bytes)).c_str(),
                  Bytes(static_cast<double>(sizes->ssd_bytes)).c_str());
      std::printf(
          "TTFT saved: the prefill of the extra hits at %.0f TFLOP/s less their disk "
          "reads at %.1f GB/s, per request\n",
          prefill_tflops, disk_gbps);
      std::printf("%-14s %-13s %10s %10s %8s %8s %8s %10s %14s %12s %12s\n", "model", "policy",
                  "dram blk", "ssd blk", "hit", "dram", "disk", "dram only", "+tokens/req",
                  "disk rd/req", "TTFT saved");
    }
    for (absl::string_view spec : absl::StrSplit(models_text, ',')) {
      absl::StatusOr<PlanModel> m = LoadPlanModel(std::string(spec), *kv_dtype);
      if (!m.ok()) return Fail(m.status());
      absl::StatusOr<std::vector<TieredPlanRow>> rows =
          PlanTiered(*trace, *m, *sizes, *policies, rates);
      if (!rows.ok()) return Fail(rows.status());
      for (const TieredPlanRow& r : *rows) {
        if (json) {
          std::printf(
              "{\"model\": %s, \"policy\": \"%s\", \"dram_blocks\": %lld, \"ssd_blocks\": "
              "%lld, \"hit_rate\": %.6f, \"dram_hit_rate\": %.6f, \"disk_hit_rate\": %.6f, "
              "\"dram_only_hit_rate\": %.6f, \"extra_hit_tokens_per_request\": %.1f, "
              "\"disk_read_bytes_per_request\": %.0f, \"ttft_saved_ms_per_request\": %.1f}\n",
              JsonString(r.model).c_str(), r.policy.c_str(), static_cast<long long>(r.dram_blocks),
              static_cast<long long>(r.ssd_blocks), r.hit_rate, r.dram_hit_rate, r.disk_hit_rate,
              r.dram_only_hit_rate, r.extra_hit_tokens_per_request, r.disk_read_bytes_per_request,
              r.ttft_saved_ms_per_request);
        } else {
          std::printf(
              "%-14s %-13s %10lld %10lld %7.1f%% %7.1f%% %7.1f%% %9.1f%% %14.0f %12s "
              "%9.0f ms\n",
              r.model.c_str(), r.policy.c_str(), static_cast<long long>(r.dram_blocks),
              static_cast<long long>(r.ssd_blocks), 100 * r.hit_rate, 100 * r.dram_hit_rate,
              100 * r.disk_hit_rate, 100 * r.dram_only_hit_rate, r.extra_hit_tokens_per_request,
              Bytes(r.disk_read_bytes_per_request).c_str(), r.ttft_saved_ms_per_request);
        }
      }
    }
    return 0;
  }
  if (!(target > 0 && target < 1)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("target-hit-rate: want a fraction in (0, 1), got ", target)));
  }
  PlanOptions options;
  options.window_aware = window_aware;
  absl::StatusOr<std::vector<double>> memory = ParsePositiveDoubles("memory-gib", memory_text);
  if (!memory.ok()) return Fail(memory.status());
  options.memory_gib = *memory;
  absl::StatusOr<std::vector<std::string>> policies = ParsePolicyList("policy", policies_text);
  if (!policies.ok()) return Fail(policies.status());
  options.policies = *policies;
  absl::StatusOr<std::optional<kv::DType>> kv_dtype =
      kv::ParseKvDTypeFlag("--kv-dtype", kv_dtype_text);
  if (!kv_dtype.ok()) return Fail(kv_dtype.status());
  std::vector<PlanModel> models;
  for (absl::string_view spec : absl::StrSplit(models_text, ',')) {
    absl::StatusOr<PlanModel> m = LoadPlanModel(std::string(spec), *kv_dtype);
    if (!m.ok()) return Fail(m.status());
    models.push_back(*std::move(m));
  }
  absl::StatusOr<LoadedTrace> trace = source.Load();
  if (!trace.ok()) return Fail(trace.status());
  std::vector<PlanRow> all;
  if (!json) {
    std::printf("trace %s: %zu requests\n", trace->name.c_str(), trace->requests.size());
    PrintModels(models);
    std::printf("%-14s %-13s %9s %10s %8s %10s %12s %12s\n", "model", "policy", "GiB/node",
                "blocks", "hit", "compute", "read/req", "written/req");
  }
  for (const PlanModel& m : models) {
    const std::string dtype(kv::DTypeName(m.config.layout.dtype()));
    absl::StatusOr<std::vector<PlanRow>> rows = Plan(*trace, m, options);
    if (!rows.ok()) return Fail(rows.status());
    for (const PlanRow& r : *rows) {
      const std::string compute =
          r.compute_saved < 0 ? "-" : absl::StrFormat("%.1f%%", 100 * r.compute_saved);
      if (json) {
        std::printf(
            "{\"model\": %s, \"kv_dtype\": \"%s\", \"policy\": \"%s\", \"memory_gib\": %g, "
            "\"capacity_blocks\": %lld, \"hit_rate\": %.6f, \"compute_saved\": %.6f, "
            "\"bytes_read_per_request\": %.0f, \"bytes_written_per_request\": %.0f}\n",
            JsonString(r.model).c_str(), dtype.c_str(), r.policy.c_str(), r.memory_gib,
            static_cast<long long>(r.capacity_blocks), r.hit_rate, r.compute_saved,
            r.bytes_read_per_request, r.bytes_written_per_request);
      } else {
        std::printf("%-14s %-13s %9g %10lld %7.1f%% %10s %12s %12s\n", r.model.c_str(),
                    r.policy.c_str(), r.memory_gib, static_cast<long long>(r.capacity_blocks),
                    100 * r.hit_rate, compute.c_str(), Bytes(r.bytes_read_per_request).c_str(),
                    Bytes(r.bytes_written_per_request).c_str());
      }
    }
    // Least memory reaching the target, interpolated in log2(memory) between measured sizes.
    for (const std::string& policy : options.policies) {
      const PlanRow* prev = nullptr;
      std::string answer = "not reached in the given range";
      for (const PlanRow& r : *rows) {
        if (r.policy != policy) continue;
        if (r.hit_rate >= target) {
          double gib = r.memory_gib;
          if (prev != nullptr && r.hit_rate > prev->hit_rate) {
            const double f = (target - prev->hit_rate) / (r.hit_rate - prev->hit_rate);
            gib = std::exp2(std::log2(prev->memory_gib) +
                            f * (std::log2(r.memory_gib) - std::log2(prev->memory_gib)));
          }
          // Reached at the smallest size given: the least memory is somewhere below it.
          answer = prev == nullptr
                       ? absl::StrFormat("at most %.1f GiB per node (the smallest size given)", gib)
                       : absl::StrFormat("%.1f GiB per node", gib);
          break;
        }
        prev = &r;
      }
      if (!json) {
        std::printf("  %s %s: %.0f%% prefix hits need %s (KV %s)\n", m.name.c_str(), policy.c_str(),
                    100 * target, answer.c_str(), dtype.c_str());
      }
    }
    all.insert(all.end(), rows->begin(), rows->end());
  }
  if (!plot.empty()) {
    const std::string dtype = kv_dtype->has_value() ? std::string(kv::DTypeName(**kv_dtype)) : "";
    absl::Status s = WritePlot(plot,
                               absl::StrCat("prefix hit rate vs memory, trace ", trace->name,
                                            dtype.empty() ? "" : ", KV ", dtype),
                               target, all);
    if (!s.ok()) return Fail(s);
    if (!json) std::printf("wrote %s\n", plot.c_str());
  }
  return 0;
}

}  // namespace kvrelay::cachestore::tools
