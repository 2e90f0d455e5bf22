#!/usr/bin/python3
"""Plots `kvrelay simulate --json` reports: goodput and TTFT p50/p99 against the swept value (a --sweep report), or against the cluster's node count
(a list of single reports: the files of one series joined by commas).

    scripts/sim_plot.py SERIES OUT.png [SERIES ...]
    SERIES: a sweep report, or a,b,c (single reports of one series), optionally LABEL=...
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    series = [sys.argv[1]] + sys.argv[3:]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    key = None
    for spec in series:
        label, _, paths = spec.rpartition("=")
        runs = []
        for path in paths.split(","):
            loaded = json.load(open(path))
            runs.extend(loaded if isinstance(loaded, list) else [loaded])
        if "sweep" in runs[0]:
            key = runs[0]["sweep"]["key"]
            xs = [float(r["sweep"]["value"]) for r in runs]
        else:
            key = "nodes (prefill + decode)"
            xs = [r["cluster"]["prefill"] + r["cluster"]["decode"] for r in runs]
            ax1.set_xscale("log", base=2)
            ax2.set_xscale("log", base=2)
        label = label or f"{runs[0]['cluster']['routing']} routing"
        ax1.plot(xs, [r["goodput_rps"] for r in runs], "o-", label=label)
        ax2.plot(xs, [r["ttft_ms"]["p50"] for r in runs], "o-", label=f"p50, {label}")
        ax2.plot(xs, [r["ttft_ms"]["p99"] for r in runs], "s--", label=f"p99, {label}")
    for ax, title in ((ax1, "goodput (req/s)"), (ax2, "TTFT (ms)")):
        ax.set_xlabel(key)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax2.set_yscale("log")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
