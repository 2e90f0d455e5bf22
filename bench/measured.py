#!/usr/bin/python3
"""Reruns the benchmarks behind the README's "Measured" headline table and prints it.

Every row comes from one benchmark run that measures its baseline in the same run, and names the
command that produced it, so a reader can rerun one row alone. Nothing here is a figure typed by
hand: a benchmark that fails or prints something unexpected makes its row say so (and the exit
status non-zero) instead of leaving an old number.

  /usr/bin/python3 bench/measured.py [--bin build/bin] [--only transfer,store,...] [--json]

Sections (--only): kv, transfer, store, policy, model. The whole run takes about 10 minutes on
the 2-core VM; `--only` picks parts.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time


class BenchFailed(Exception):
    pass


def run(cmd, timeout_s):
    """Runs `cmd` (a list), returns its stdout; raises BenchFailed naming the command."""
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchFailed(f"{shlex.join(cmd)}: no result within {timeout_s} s")
    except OSError as e:
        raise BenchFailed(f"{shlex.join(cmd)}: {e}")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise BenchFailed(f"{shlex.join(cmd)}: exit {done.returncode}: {' | '.join(tail)}")
    sys.stderr.write(f"measured: {shlex.join(cmd)} ({time.monotonic() - started:.0f} s)\n")
    return done.stdout


def last_json_line(text, cmd):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise BenchFailed(f"{shlex.join(cmd)}: printed no JSON line")


def match(pattern, text, cmd):
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        raise BenchFailed(f"{shlex.join(cmd)}: output has no line matching /{pattern}/")
    return m


def short(cmd, bindir):
    """The command as a reader types it (paths relative to the repository)."""
    return shlex.join(os.path.relpath(c) if c.startswith(bindir) else c for c in cmd)


def kv_rows(bindir):
    cmd = [f"{bindir}/kv_bench", "--benchmark_min_time=0.2", "--benchmark_color=false"]
    out = run(cmd, 300)
    rows = []
    for name, ours, base_name, base, ratio in re.findall(
            r"^ratio (\S+)\s+([\d.]+) GB/s vs (\S+)\s+([\d.]+) GB/s = ([\d.]+)", out, re.M):
        rows.append({
            "part": f"kv: {name}",
            "figure": f"{ours} GB/s",
            "baseline": f"{base_name} {base} GB/s",
            "ratio": float(ratio),
            "command": short(cmd, bindir),
        })
    if not rows:
        raise BenchFailed(f"{shlex.join(cmd)}: printed no ratio lines")
    return rows


def transfer_rows(bindir):
    rows = []
    # (block, inflight, region: None = the bench's default 1 GiB); 32 MiB is the L3-sized
    # region where per-block overhead shows most (issue 19).
    shm_cases = [(65536, 64, 32 << 20), (65536, 64, None), (262144, 64, None), (16 << 20, 16, None)]
    for block, inflight, region in shm_cases:
        cmd = [f"{bindir}/kvrelay", "transfer-bench", "--tls", "shm", "--block-bytes", str(block),
               "--inflight", str(inflight)]
        if region is not None:
            cmd += ["--region-bytes", str(region)]
        cmd += ["--json"]
        j = last_json_line(run(cmd, 600), cmd)
        tail = j["p99_block_us"] / j["p50_block_us"] if j["p50_block_us"] > 0 else 0.0
        rows.append({
            "part": f"transfer: UCX shm put, {block >> 10} KiB blocks into "
                    f"{j['region_bytes'] >> 20} MiB (steady pass)",
            "figure": f"{j['bandwidth_gbps']:.2f} GB/s; p99/p50 per block {tail:.1f}x; "
                      f"receiver page faults {j['receiver_minor_faults']}",
            "baseline": f"memcpy of the same blocks {j['memcpy_gbps']:.2f} GB/s",
            "ratio": j["ratio_vs_memcpy"],
            "command": short(cmd, bindir),
        })
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "transfer_vs_ucx_perftest.sh")
    for block in (65536, 1 << 20):
        cmd = [script, "--tls", "tcp", "--block-bytes", str(block), "--rounds", "3", "--json"]
        env_cmd = cmd
        out = run(["env", f"KVRELAY_BIN={bindir}/kvrelay"] + env_cmd, 600)
        j = last_json_line(out, cmd)
        rows.append({
            "part": f"transfer: UCX tcp put, {block >> 10} KiB blocks (median of 3 rounds)",
            "figure": f"p99/p50 per block {j['median_p99_over_p50']:.1f}x",
            "baseline": "ucx_perftest ucp_put_bw, same size and window",
            "ratio": j["median_ratio"],
            "command": "KVRELAY_BIN=build/bin/kvrelay " + shlex.join(
                [os.path.relpath(script)] + cmd[1:]),
        })
    return rows


def store_rows(bindir):
    cmd = [f"{bindir}/cachestore_bench", "--skip=server,memory,trace"]
    out = run(cmd, 600)
    rows = []
    redis = match(r"^\s+redis-server \(pipeline of 256 EXISTS\)\s*:\s*(\d+) blocks/s", out, cmd)
    for mode, ours in re.findall(r"^\s+kvrelay cachestore, (.+?)\s*:\s*(\d+) blocks/s", out, re.M):
        rows.append({
            "part": f"store: {mode} of a 256-block chain, 16 clients",
            "figure": f"{int(ours) / 1e6:.2f} M blocks/s",
            "baseline": f"redis-server, pipelines of 256 EXISTS: {int(redis[1]) / 1e6:.2f} M/s",
            "ratio": int(ours) / int(redis[1]),
            "command": short(cmd, bindir),
        })
    if not rows:
        raise BenchFailed(f"{shlex.join(cmd)}: printed no kvrelay lookup rate")
    pinned = re.search(r"each server on CPU (\d+) \(--cpus / server_cpulist\): MatchPrefixStream "
                       r"(\d+) blocks/s, redis (\d+) blocks/s", out, re.M)
    if pinned:
        rows.append({
            "part": "store: MatchPrefixStream of a 256-block chain, 16 clients, each server "
                    f"pinned to CPU {pinned[1]} (--cpus; redis server_cpulist)",
            "figure": f"{int(pinned[2]) / 1e6:.2f} M blocks/s",
            "baseline": f"redis-server on the same CPU, pipelines of 256 EXISTS: "
                        f"{int(pinned[3]) / 1e6:.2f} M/s",
            "ratio": int(pinned[2]) / int(pinned[3]),
            "command": short(cmd, bindir),
        })
    lat = re.search(r"one lookup, 1 client, p50 / p99 \(us\)\s*:\s*(.*)$", out, re.M)
    if lat:
        rows.append({
            "part": "store: one 256-block MatchPrefix, 1 client, p50 / p99",
            "figure": lat[1].strip(),
            "baseline": "(redis figures in the same line)",
            "ratio": None,
            "command": short(cmd, bindir),
        })
    return rows


def policy_rows(bindir):
    cmd = [f"{bindir}/policy_table", "--requests", "2000", "--no-window"]
    # Mooncake's real conversation trace, which no policy was developed on (cachestore/README.md,
    # "Held-out trace"); not in the shared data, so only where the environment names it.
    held_out = os.environ.get("KVRELAY_HELDOUT_TRACE")
    if held_out:
        cmd += ["--held-out", held_out]
    out = run(cmd, 900)
    header = None
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "lru" in cells and "belady" in cells:
            header = cells
            continue
        if header is None or len(cells) != len(header):
            continue
        if cells[0].startswith("mooncake"):
            trace = "Mooncake trace"
        elif cells[0].startswith("held-out:"):
            trace = f"held-out {cells[0][len('held-out:'):]}"
        else:
            continue
        cell = dict(zip(header, cells))
        default = next(h for h in header if "(default)" in h)
        rows.append({
            "part": f"policy: prefix hit rate, {trace}, {cell['capacity']} blocks",
            "figure": f"{default} {cell[default]}; Belady {cell['belady']}"
                      + (f" (leaf-first {cell['belady-leaf']})" if "belady-leaf" in cell else ""),
            "baseline": f"LRU {cell['lru']}",
            "ratio": float(cell[default]) / float(cell["lru"]),
            "command": short(cmd, bindir),
        })
    if not rows:
        raise BenchFailed(f"{shlex.join(cmd)}: printed no mooncake-synthetic rows")
    return rows


def model_rows(bindir):
    cmd = [f"{bindir}/model_bench", "--models", "tiny,mid", "--tiles", "0", "--no-decode",
           "--tokens", "2048", "--reps", "2"]
    out = run(cmd, 900)
    rows = []
    # model  gemm tile  prefill tok/s  GFLOP/s  model-shape sgemm  of that rate*  ...
    for m in re.finditer(r"^(?P<name>\S.*?\))\s+(?P<tile>\d+(?: \(block\))?)\s+(?P<tps>[\d.]+)"
                         r"\s+(?P<gflops>[\d.]+)\s+(?P<sgemm>[\d.]+)\s+(?P<pct>[\d.]+)%", out, re.M):
        rows.append({
            "part": f"model: CPU prefill, {m['name']}, 2,048-token prompt, bit-exact at any start",
            "figure": f"{m['tps']} tokens/s, {m['gflops']} GFLOP/s",
            "baseline": f"OpenBLAS sgemm over the model's projection shapes: {m['sgemm']} GFLOP/s",
            "ratio": float(m["pct"]) / 100.0,
            "command": short(cmd, bindir),
        })
    if not rows:
        raise BenchFailed(f"{shlex.join(cmd)}: printed no prefill-vs-sgemm line")
    return rows


SECTIONS = {
    "kv": kv_rows,
    "transfer": transfer_rows,
    "store": store_rows,
    "policy": policy_rows,
    "model": model_rows,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default="build/bin", help="folder of the built binaries")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help="comma-separated sections: " + ", ".join(SECTIONS))
    parser.add_argument("--json", action="store_true", help="one JSON object per row instead")
    args = parser.parse_args()
    bindir = os.path.abspath(args.bin)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(unknown)}; "
                     f"known: {', '.join(SECTIONS)}")
    failed = 0
    if not args.json:
        print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start:\n")
        print("| part | figure | baseline in the same run | ratio | command |")
        print("|---|---|---|---:|---|")
    for section in wanted:
        try:
            rows = SECTIONS[section](bindir)
        except BenchFailed as e:
            failed += 1
            rows = [{"part": section, "figure": f"FAILED: {e}", "baseline": "", "ratio": None,
                     "command": ""}]
        for r in rows:
            if args.json:
                print(json.dumps(r))
            else:
                ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}x"
                print(f"| {r['part']} | {r['figure']} | {r['baseline']} | {ratio} | "
                      f"`{r['command']}` |" if r["command"] else
                      f"| {r['part']} | {r['figure']} | | | |")
        sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
