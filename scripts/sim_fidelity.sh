#!/usr/bin/env bash
# How well `kvrelay simulate` predicts a real run: the namespace cluster (scripts/cluster/run.sh:
# store, 2 prefill and 2 decode workers, 1 gateway, tiny llama on CPU, UCX over tcp) serving the
# load.sh workload (120 requests of the Mooncake trace from #3000, 8 tokens per block id, at
# most 16 output tokens) without faults at several arrival rates, and the simulator on the same
# requests with a profile measured here (scripts/sim_profile.sh), twice: from the benchmarks
# alone, and with two figures calibrated on the first rate's real run (the decode step to its
# median TPOT, the prefill rate to its median TTFT), so the other rates are predictions the
# calibration never saw. Prints predicted against measured TTFT p50, p99 and prefix hit rate
# per rate, with the relative error.
#
#   scripts/sim_fidelity.sh [--out DIR] [--scales 8,4,2] [--requests 120] [--real-from DIR]
#
# --real-from reuses the real runs of an earlier invocation (its DIR/real-<scale>, where there).
# --scales are bench-serve time scales (4 is load.sh's: about 1 request/s). About 2-4 minutes
# per scale. Needs root (network namespaces) and the trace (../shared/data/traces, or
# $KVRELAY_TRACE).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
OUT="" SCALES="8,4,2" REQUESTS=120 REAL_FROM=""
TRACE=${KVRELAY_TRACE:-$ROOT/../shared/data/traces/synthetic_trace.jsonl}
while (($#)); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --scales) SCALES=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --real-from) REAL_FROM=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "sim_fidelity.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[[ -f $TRACE ]] || { echo "sim_fidelity.sh: no trace at $TRACE" >&2; exit 2; }
OUT=${OUT:-$(mktemp -d /tmp/kvrelay-fidelity-XXXXXX)}
mkdir -p "$OUT"
workload=(--trace "$TRACE" --trace-offset 3000 --tokens-per-hash-id 8 --max-output-tokens 16
          --max-requests "$REQUESTS" --timeout 20s)
for ts in ${SCALES//,/ }; do
  if [[ -n $REAL_FROM && -d $REAL_FROM/real-$ts ]]; then
    [[ $REAL_FROM/real-$ts -ef $OUT/real-$ts ]] || cp -r "$REAL_FROM/real-$ts" "$OUT/real-$ts"
    continue
  fi
  echo "sim_fidelity.sh: time scale $ts: the real cluster" >&2
  "$ROOT/scripts/cluster/run.sh" --prefill 2 --decode 2 --gateways 1 --out "$OUT/real-$ts" -- \
    "${workload[@]}" --time-scale "$ts" --max-duration 600s --concurrency 32 \
    --slo ttft=2s,tpot=250ms --quiet >"$OUT/real-$ts.txt" 2>&1
done
first=${SCALES%%,*}
"$ROOT/scripts/sim_profile.sh" --out "$OUT/profile-bench.json"
# Calibration: the benchmarks time the model alone, not the workers' whole request path. Keep
# their shape, and fit two figures to the first rate's real run only: the decode step to its
# median TPOT, the prefill rate (by bisection, running the simulator) to its median TTFT.
/usr/bin/python3 - "$OUT" "$first" "$BIN/kvrelay" "${workload[@]}" <<'PY'
import csv, json, subprocess, sys
out, first, kvrelay, workload = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
profile = json.load(open(f"{out}/profile-bench.json"))
real = json.load(open(f"{out}/real-{first}/report.json"))["runs"][0]["summary"]
rows = [r for r in csv.DictReader(open(f"{out}/real-{first}/requests.csv")) if r["outcome"] == "OK"]
tpots = sorted(float(r["tpot_ms"]) for r in rows if r["tpot_ms"] not in ("", "-1"))
tpot = tpots[len(tpots) // 2]
profile["decode"]["fixed_ms"] = round(max(0.0, tpot - profile["decode"]["per_sequence_ms"]), 4)
def simulated_p50(rate):
    profile["prefill"]["tokens_per_second"] = rate
    json.dump(profile, open(f"{out}/profile-calibrated.json", "w"), indent=2)
    subprocess.run([kvrelay, "simulate", *workload, "--time-scale", first, "--model", "tiny-llama",
                    "--profile", f"{out}/profile-calibrated.json", "--prefill", "2", "--decode", "2",
                    "--cache-blocks", "4096", "--decode-kv-blocks", "1024",
                    "--json", f"{out}/calibrating.json"], check=True, capture_output=True)
    return json.load(open(f"{out}/calibrating.json"))["ttft_ms"]["p50"]
lo, hi = 500.0, profile["prefill"]["tokens_per_second"] * 4
for _ in range(12):
    mid = (lo * hi) ** 0.5
    if simulated_p50(mid) > real["ttft_ms"]["p50"]:
        lo = mid  # too slow: a higher rate
    else:
        hi = mid
rate = round((lo * hi) ** 0.5, 1)
simulated_p50(rate)
profile["name"] += ", calibrated"
profile["sources"].append(
    f"calibrated on the real run real-{first} ({len(rows)} requests): decode step fixed part from "
    f"its median TPOT {tpot:.2f} ms; prefill {rate:.0f} tok/s, the rate at which the simulated "
    f"median TTFT equals its {real['ttft_ms']['p50']:.1f} ms")
json.dump(profile, open(f"{out}/profile-calibrated.json", "w"), indent=2)
print(f"sim_fidelity.sh: calibrated prefill {rate:.0f} tok/s, decode fixed {profile['decode']['fixed_ms']} ms",
      file=sys.stderr)
PY
for profile in bench calibrated; do
  for ts in ${SCALES//,/ }; do
    "$BIN/kvrelay" simulate "${workload[@]}" --time-scale "$ts" --model tiny-llama \
      --profile "$OUT/profile-$profile.json" --prefill 2 --decode 2 --cache-blocks 4096 \
      --decode-kv-blocks 1024 --json "$OUT/sim-$profile-$ts.json" >"$OUT/sim-$profile-$ts.txt" 2>&1
  done
done
/usr/bin/python3 - "$OUT" "$SCALES" <<'PY'
import json, sys
out, scales = sys.argv[1], sys.argv[2].split(",")
def err(pred, real):
    return f"{100 * (pred - real) / real:+.0f}%" if real else "-"
print("| profile | time scale | offered req/s | TTFT p50 real / sim | err | TTFT p99 real / sim | err | hit rate real / sim | err |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for profile in ("bench", "calibrated"):
    for i, ts in enumerate(scales):
        real = json.load(open(f"{out}/real-{ts}/report.json"))["runs"][0]["summary"]
        sim = json.load(open(f"{out}/sim-{profile}-{ts}.json"))
        r50, r99, rh = real["ttft_ms"]["p50"], real["ttft_ms"]["p99"], real["hit_rate"]
        s50, s99, sh = sim["ttft_ms"]["p50"], sim["ttft_ms"]["p99"], sim["hit_rate"]
        note = " (calibrated on)" if profile == "calibrated" and i == 0 else ""
        print(f"| {profile} | {ts}{note} | {sim['offered_rps']:.2f} | {r50:.0f} / {s50:.0f} ms | "
              f"{err(s50, r50)} | {r99:.0f} / {s99:.0f} ms | {err(s99, r99)} | "
              f"{rh:.3f} / {sh:.3f} | {err(sh, rh)} |")
PY
echo "sim_fidelity.sh: runs in $OUT" >&2
