#!/usr/bin/env bash
# Goodput past saturation (issue 34): a rate sweep on the namespace cluster, judged.
#
#   scripts/overload.sh [--rates 4,8,16,32,64] [--window 15s] [--input-tokens 1024]
#                       [--output-tokens 32] [--min-ratio 0.9] [--out DIR] [--name ID]
#
# Starts scripts/cluster/run.sh (cache store, 2 prefill and 2 decode workers with
# --max-queue-wait 1s, 1 gateway, each in its own network namespace, UCX over tcp, a generated
# tiny llama) and offers each rate of --rates for --window (rate x window requests, Poisson
# arrivals, half of each prompt a shared prefix over 8 groups, timeout 20 s), every token
# checked against the co-located reference. Saturation is the peak goodput (requests/s that
# met the SLO, TTFT 2 s / TPOT 250 ms); where the last rate offers less than 4x that, the
# sweep adds rates (up to 3) until one does, so a faster machine is judged at 4x too. Checks,
# each printed with its figures:
#   - every rate offered at 2x saturation or more keeps a goodput >= --min-ratio x the peak
#     (and the sweep reaches 4x: a sweep that does not is reported as not judged, a failure);
#   - every refused request is RESOURCE_EXHAUSTED, answered within 100 ms;
#   - no breaker opened (the gateway's kvrelay:gateway_breaker_opens_total stays 0);
#   - 0 wrong tokens.
# Prints the sweep table and the plot of goodput and TTFT p50/p99 against the offered rate.
# Exit 0 when every check holds, 1 when one fails, 3 on wrong tokens, 77 without namespaces.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RATES=4,8,16,32,64 WINDOW=15s INPUT=1024 OUTPUT=32 MIN_RATIO=0.9 OUT="" NAME="ovl$$" MODEL_ARGS=()
while (($#)); do
  case "$1" in
    --rates) RATES=$2; shift 2 ;;
    --window) WINDOW=$2; shift 2 ;;
    --input-tokens) INPUT=$2; shift 2 ;;
    --output-tokens) OUTPUT=$2; shift 2 ;;
    --min-ratio) MIN_RATIO=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --model) MODEL_ARGS=(--model "$2"); shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "overload.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
export KVRELAY_BIN_DIR=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
[[ -x $KVRELAY_BIN_DIR/kvrelay ]] || { echo "overload.sh: no $KVRELAY_BIN_DIR/kvrelay; build it first" >&2; exit 2; }
OUT=${OUT:-$(mktemp -d /tmp/kvrelay-overload-XXXXXX)}
mkdir -p "$OUT"

set +e
"$ROOT/scripts/cluster/run.sh" --name "$NAME" --out "$OUT" "${MODEL_ARGS[@]}" --settle 1 \
  --prefill-args '--max-queue-wait 1s' --decode-args '--max-queue-wait 1s' -- \
  --input-tokens "$INPUT" --output-tokens "$OUTPUT" --shared-prefix-ratio 0.5 --prefix-groups 8 \
  --sweep-rates "$RATES" --sweep-past-saturation 4 --sweep-duration "$WINDOW" \
  --max-requests 100000 --timeout 20s \
  --concurrency 512 --slo ttft=2s,tpot=250ms --verify --quiet >"$OUT/bench.txt" 2>"$OUT/cluster.txt"
rc=$?
set -e
((rc != 77)) || { echo "SKIP: network namespaces are not available here"; exit 77; }
sed -n '/^sweep/,/^====/p' "$OUT/bench.txt" | sed '$d'
((rc == 0 || rc == 3)) || { tail -20 "$OUT/cluster.txt" >&2; echo "overload: the run failed (exit $rc)" >&2; exit 1; }

/usr/bin/python3 - "$OUT" "$MIN_RATIO" "$rc" <<'PY'
import csv, json, re, sys
out, min_ratio, rc = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
runs = json.load(open(f"{out}/report.json"))["runs"]
rows = list(csv.DictReader(open(f"{out}/requests.csv")))
failures = []
peak = max(r["summary"]["goodput"] for r in runs)
print(f"saturation (peak goodput): {peak:.2f} req/s")
reached = 0.0
for r in runs:
    rate, good = r["rate"], r["summary"]["goodput"]
    if rate >= 2 * peak:
        reached = max(reached, rate / peak)
        ok = good >= min_ratio * peak
        print(f"  offered {rate:g} req/s = {rate / peak:.1f}x saturation: goodput {good:.2f} = "
              f"{good / peak:.2f}x the peak: {'ok' if ok else 'BELOW ' + str(min_ratio)}")
        if not ok:
            failures.append(f"goodput {good / peak:.2f}x the peak at {rate / peak:.1f}x saturation")
if reached < 4:
    failures.append(f"the sweep reaches {reached:.1f}x saturation, not 4x (not judged)")
refused = [r for r in rows if r["outcome"] != "OK"]
codes = sorted({r["outcome"] for r in refused})
slow = [r for r in refused if float(r["end_s"]) - float(r["send_s"]) > 0.1]
worst = max((float(r["end_s"]) - float(r["send_s"]) for r in refused), default=0)
print(f"refused: {len(refused)} of {len(rows)} ({', '.join(codes) or 'none'}), slowest answer "
      f"{worst * 1e3:.0f} ms, {len(slow)} over 100 ms")
if any(c != "RESOURCE_EXHAUSTED" for c in codes):
    failures.append(f"refusals other than RESOURCE_EXHAUSTED: {codes}")
if slow:
    failures.append(f"{len(slow)} refusals took over 100 ms")
opens = 0.0
for line in open(f"{out}/metrics/gateway-0.prom"):
    if re.match(r"kvrelay:gateway_breaker_opens_total\{", line):
        opens += float(line.split()[-1])
print(f"breaker opens: {opens:g}")
if opens:
    failures.append(f"{opens:g} breakers opened")
wrong = sum(r["summary"]["wrong_tokens"] for r in runs)
print(f"wrong tokens: {wrong}")
if rc == 3 or wrong:
    failures.append("wrong tokens")
print(f"plot: {out}/plot.png")
if failures:
    print("OVERLOAD FAILED: " + "; ".join(failures))
    sys.exit(1)
print("overload: every check holds")
PY
