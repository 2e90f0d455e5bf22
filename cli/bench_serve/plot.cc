// The PNG plot: the report JSON goes to matplotlib (Debian's python3-matplotlib, run with
// Debian's /usr/bin/python3) through a script written beside the PNG.

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "cli/bench_serve/report.h"

namespace kvrelay::cli::bench_serve {
namespace {

constexpr char kPlotScript[] = R"PY(
import json, math, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

report = json.load(open(sys.argv[1]))
png = sys.argv[2]
runs = report["runs"]

def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    rank = p / 100 * (len(v) - 1)
    lo = int(math.floor(rank)); hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)

def mark_faults(ax, faults, label_them):
    for i, f in enumerate(faults):
        if f["end_s"] > f["start_s"] + 0.05:
            # A fault that lasts to the end of the run (shape) is shaded lighter.
            lasting = i + 1 < len(faults) and f["end_s"] > faults[i + 1]["start_s"]
            ax.axvspan(f["start_s"], f["end_s"], color="tab:red", alpha=0.05 if lasting else 0.14,
                       lw=0)
        ax.axvline(f["start_s"], color="tab:red", lw=1.0, ls="--")
        if label_them:
            ax.annotate(f["label"], xy=(f["start_s"], 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -2), textcoords="offset points", va="top", fontsize=7,
                        color="tab:red", rotation=90)

def timeline(run, axes, title):
    reqs = run["requests"]
    if not reqs:
        return
    end = max(r["end_s"] for r in reqs)
    width = max(1.0, end / 60.0)
    n = int(end // width) + 1
    buckets = [[] for _ in range(n)]
    for r in reqs:
        buckets[min(n - 1, int(r["end_s"] // width))].append(r)
    t = [(i + 0.5) * width for i in range(n)]
    ok = [[r for r in b if r["code"] == "OK"] for b in buckets]
    ax = axes[0]
    for key, name, color in (("ttft_ms", "TTFT", "tab:blue"), ("tpot_ms", "TPOT", "tab:green")):
        for p, ls in ((50, "-"), (99, ":")):
            ys = [pct([r[key] for r in b if r[key] >= 0], p) for b in ok]
            ax.plot(t, ys, ls, color=color, marker=".", ms=3, label=f"{name} p{p}")
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms)")
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    ax.set_title(title, fontsize=9)
    ax = axes[1]
    hit = [sum(r["cached_tokens"] for r in b) / max(1, sum(r["prompt_tokens"] for r in b))
           if b else float("nan") for b in ok]
    ideal = [sum(r["ideal_cached_tokens"] for r in b) / max(1, sum(r["prompt_tokens"] for r in b))
             if b else float("nan") for b in ok]
    # The ideal is drawn wide and underneath: where the two agree it shows as a gray halo.
    ax.plot(t, ideal, "-", color="gray", lw=4, alpha=0.35, label="ideal (infinite cache)")
    ax.plot(t, hit, "-", color="tab:purple", marker=".", ms=3, lw=1.2, label="prefix hit rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("hit rate")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax = axes[2]
    okn = [len(b) / width for b in ok]
    bad = [sum(1 for r in b if r["code"] != "OK") / width for b in buckets]
    ax.bar(t, okn, width=width * 0.9, color="tab:blue", alpha=0.6, label="ok / s")
    ax.bar(t, bad, width=width * 0.9, bottom=okn, color="tab:red", alpha=0.8, label="failed / s")
    wrong = [sum(max(0, r["wrong_tokens"]) for r in b) for b in buckets]
    if any(wrong):
        ax.plot(t, wrong, "kx", label="wrong tokens")
    ax.set_ylabel("requests / s")
    ax.set_xlabel("time since start of run (s), by request end")
    ax.legend(loc="upper left", fontsize=7, ncol=3)
    for i, a in enumerate(axes):
        mark_faults(a, run["faults"], label_them=(i == 1))

sweep = len(runs) > 1 and all(r["rate"] is not None for r in runs)
if sweep:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    rates = [r["rate"] for r in runs]
    s = [r["summary"] for r in runs]
    for key, name, color in (("ttft_ms", "TTFT", "tab:blue"), ("tpot_ms", "TPOT", "tab:green")):
        axes[0].plot(rates, [x[key]["p50"] if x[key]["p50"] is not None else float("nan") for x in s],
                     "-o", color=color, label=f"{name} p50")
        axes[0].plot(rates, [x[key]["p99"] if x[key]["p99"] is not None else float("nan") for x in s],
                     ":o", color=color, label=f"{name} p99")
    axes[0].set_xlabel("offered request rate (req/s)")
    axes[0].set_ylabel("latency (ms)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].set_title("latency vs request rate", fontsize=9)
    axes[1].plot(rates, [x["request_rate"] for x in s], "-o", label="completed req/s")
    axes[1].plot(rates, [x["goodput"] for x in s], "-o", label="goodput req/s")
    axes[1].plot(rates, rates, "--", color="gray", lw=1, label="offered")
    axes[1].set_xlabel("offered request rate (req/s)")
    axes[1].set_ylabel("req/s")
    axes[1].legend(fontsize=8)
    axes[1].set_title("throughput and goodput (SLO: %s)" % (report["slo"] or "none"), fontsize=9)
else:
    run = runs[0]
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True,
                             gridspec_kw={"height_ratios": [2, 1.2, 1]})
    s = run["summary"]
    timeline(run, axes, "%s\nok %d of %d, goodput %.2f req/s (SLO %s), prefix hit rate %.3f "
             "(ideal %.3f), wrong tokens %s" % (
                 report["workload"][:160], s["ok"], s["requests"], s["goodput"],
                 report["slo"] or "none", s["hit_rate"], s["ideal_hit_rate"],
                 s["wrong_tokens"] if report["verify"] else "not checked"))
fig.suptitle("kvrelay bench-serve", fontsize=11)
fig.tight_layout()
fig.savefig(png, dpi=110)
)PY";

}  // namespace

absl::Status WritePlot(const std::string& png, const nlohmann::json& report,
                       const std::string& python) {
  const std::string data_path = png + ".data.json";
  const std::string script_path = png + ".plot.py";
  {
    std::ofstream data(data_path);
    data << report.dump();
    std::ofstream script(script_path);
    script << kPlotScript;
    if (!data || !script) {
      return absl::UnavailableError(
          absl::StrCat("--plot: cannot write ", data_path, " or ", script_path));
    }
  }
  const std::string command =
      absl::StrCat("'", python, "' '", script_path, "' '", data_path, "' '", png, "' 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::UnavailableError(absl::StrCat("--plot: cannot run ", python));
  std::string output;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  if (status != 0) {
    return absl::UnavailableError(
        absl::StrCat("--plot: ", python,
                     " (needs Debian's python3-matplotlib; scripts/setup.sh installs it) "
                     "failed: ",
                     output.substr(output.size() > 800 ? output.size() - 800 : 0)));
  }
  std::remove(script_path.c_str());
  return absl::OkStatus();
}

}  // namespace kvrelay::cli::bench_serve
