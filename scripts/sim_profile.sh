#!/usr/bin/env bash
# Measures a HardwareProfile for `kvrelay simulate` on this machine: what the namespace
# cluster (scripts/cluster/run.sh, a generated tiny llama on CPU, 1 compute thread per worker,
# UCX over tcp) costs here.
#
#   scripts/sim_profile.sh [--out FILE] [--calibrate RUN_DIR]     (default: print the JSON)
#
#   prefill tokens/s     bench/model_bench --models tiny --threads 1 (its 512-token prefill)
#   decode step          fixed + per sequence, fitted to the same run's decode steps at batch
#                        1, 8 and 32 (batch-invariant, as the workers run)
#   network              `kvrelay transfer-bench --tls tcp` steady GB/s over loopback
#   rpc                  a gRPC call between namespaces, about 1 ms here (not measured)
# --calibrate RUN_DIR (a scripts/cluster/run.sh --out directory) replaces the compute figures
# with what that real run's requests show, the workers' whole request path included (model_bench
# times the model alone: the worker's prefill ran 2.7x slower per token here): prefill from a
# least-squares fit of TTFT against the tokens each request computed, the decode step from its
# median TPOT (at that run's batch sizes, about one sequence).
# About 30 s. Needs build/bin/model_bench and build/bin/kvrelay (scripts/build.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
OUT="" CALIBRATE=""
while (($#)); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --calibrate) CALIBRATE=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "sim_profile.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
for b in model_bench kvrelay; do
  [[ -x $BIN/$b ]] || { echo "sim_profile.sh: no $BIN/$b; build it first" >&2; exit 2; }
done
model=$("$BIN/model_bench" --models tiny --threads 1 --tokens 512 --reps 3)
net=$("$BIN/kvrelay" transfer-bench --tls tcp 2>/dev/null)
gbps=$(awk '$1 == "steady" { print $2; exit }' <<<"$net")
[[ -n ${gbps:-} ]] || { echo "sim_profile.sh: no steady rate in:" >&2; echo "$net" >&2; exit 1; }
json=$(/usr/bin/python3 - "$gbps" "$(hostname)" "$model" "$CALIBRATE" <<'PY'
import csv, json, sys, time
gbps, host, model, calibrate = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
prefill, steps = None, {}
for line in model.splitlines():
    f = line.split()
    if not line.startswith("tiny-llama"):
        continue
    if "(block)" in f:  # the prefill table's row at the worker's own tile (its block)
        prefill = float(f[f.index("(block)") + 1])
    elif len(f) == 7:  # the decode table: batch, batch-invariant tok/s, batched tok/s, ratio
        batch, tok_s = int(f[3]), float(f[4])
        steps[batch] = 1000.0 * batch / tok_s  # ms per step of that batch
if prefill is None or len(steps) < 2:
    sys.exit(f"sim_profile.sh: no tiny-llama prefill row or decode batches in:\n{model}")
# step(batch) = fixed + per_sequence * batch, least squares over the measured batches.
n = len(steps)
mx = sum(steps) / n
my = sum(steps.values()) / n
per_seq = sum((b - mx) * (t - my) for b, t in steps.items()) / sum((b - mx) ** 2 for b in steps)
fixed = max(0.0, my - per_seq * mx)
prefill_fixed = 1.0
sources_extra = []
if calibrate:
    rows = [r for r in csv.DictReader(open(f"{calibrate}/requests.csv")) if r["outcome"] == "OK"]
    xs = [float(r["computed_tokens"]) for r in rows]
    ys = [float(r["ttft_ms"]) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    prefill = 1000.0 / slope
    prefill_fixed = max(0.0, my - slope * mx)
    tpots = sorted(float(r["tpot_ms"]) for r in rows if r["tpot_ms"] not in ("", "-1"))
    tpot = tpots[len(tpots) // 2]
    fixed = max(0.0, tpot - per_seq)
    sources_extra.append(
        f"calibrated on the real run {calibrate} ({len(rows)} requests): TTFT = "
        f"{prefill_fixed:.1f} ms + computed tokens / {prefill:.0f} tok/s; median TPOT {tpot:.2f} ms")
print(json.dumps({
    "name": f"namespace cluster on {host} (tiny-llama, CPU, 1 thread per worker)"
            + (", calibrated" if calibrate else ""),
    "sources": [f"measured by scripts/sim_profile.sh on {time.strftime('%Y-%m-%d')}: "
                f"model_bench tiny-llama prefill {prefill:.0f} tok/s (512-token prompt); decode "
                "steps (batch-invariant, as the workers run) " +
                ", ".join(f"batch {b}: {t:.3f} ms" for b, t in sorted(steps.items())) +
                f"; transfer-bench tcp {gbps:.2f} GB/s",
                "rpc: about 1 ms per gRPC call between namespaces (assumed, not measured)"]
               + sources_extra,
    "prefill": {"fixed_ms": round(prefill_fixed, 3), "tokens_per_second": round(prefill, 1)},
    "decode": {"fixed_ms": round(fixed, 4), "per_sequence_ms": round(per_seq, 4)},
    "network": {"bytes_per_second": gbps * 1e9, "latency_us": 200},
    "rpc_ms": 1.0}, indent=2))
PY
)
if [[ -n $OUT ]]; then echo "$json" >"$OUT"; echo "sim_profile.sh: wrote $OUT" >&2; else echo "$json"; fi
