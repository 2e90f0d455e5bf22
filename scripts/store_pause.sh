#!/usr/bin/env bash
# A hung cache store costs reuse, not latency (issue 34): the store, then the HA store leader,
# SIGSTOPped for 10 s under load on the namespace cluster, judged.
#
#   scripts/store_pause.sh [--pause 10] [--rate 4] [--out DIR] [--only single|ha]
#
# Runs scripts/cluster/run.sh twice (2 prefill, 2 decode, 1 gateway, UCX over tcp, a generated
# tiny llama; 512-token prompts, half of each a shared prefix over 64 groups, 16 output tokens,
# Poisson arrivals at --rate for 45 s, every token verified):
#   single: one cache store, `stop store for PAUSE` at 15 s;
#   ha:     3 HA store replicas on etcd (lease TTL 2 s), `stop leader for PAUSE` at 15 s.
# Checks, each printed with its figures:
#   - 0 failed requests, 0 wrong tokens;
#   - the p99 TTFT of the requests sent during the pause <= the p99 TTFT of the cold requests
#     (no prefix hit) sent outside it + 600 ms (single: one bounded wait per process, then the
#     store is skipped); ha: + the lease TTL + 1 s (calls wait for the next leader: at most the
#     lease TTL plus one call);
#   - ha: the gateway's store calls reach the new leader within the lease TTL + 1 s of the
#     pause (from its "answers" log line), every worker's within 1 s after the gateway's (a
#     worker looks up and commits only for requests whose gateway lookup got an answer, so its
#     first call to the new leader follows the gateway's), and requests hit prefixes again
#     during the pause.
# Exit 0 when every check holds, 1 when one fails, 77 without namespaces.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PAUSE=10 RATE=4 OUT="" ONLY=""
while (($#)); do
  case "$1" in
    --pause) PAUSE=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "store_pause.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $PAUSE =~ ^[0-9]+$ && $RATE =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
  { echo "store_pause.sh: --pause takes whole seconds, --rate a number" >&2; exit 2; }
[[ -z $ONLY || $ONLY == single || $ONLY == ha ]] || { echo "store_pause.sh: --only single|ha" >&2; exit 2; }
export KVRELAY_BIN_DIR=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
OUT=${OUT:-$(mktemp -d /tmp/kvrelay-store-pause-XXXXXX)}
mkdir -p "$OUT"
REQUESTS=$(awk -v r="$RATE" 'BEGIN { printf "%d", r * 45 }')
LOAD=(--rate "$RATE" --num-requests "$REQUESTS" --input-tokens 512 --output-tokens 16
      --shared-prefix-ratio 0.5 --prefix-groups 64 --concurrency 64 --timeout 20s --verify --quiet)

failed=0
for scenario in single ha; do
  [[ -z $ONLY || $ONLY == "$scenario" ]] || continue
  if [[ $scenario == single ]]; then
    args=(--fault "at=15s stop store for ${PAUSE}s")
  else
    args=(--stores 3 --fault "at=15s stop leader for ${PAUSE}s")
  fi
  set +e
  "$ROOT/scripts/cluster/run.sh" --name "sp${scenario:0:1}$$" --out "$OUT/$scenario" "${args[@]}" -- \
    "${LOAD[@]}" >"$OUT/$scenario.txt" 2>"$OUT/$scenario.err"
  rc=$?
  set -e
  ((rc != 77)) || { echo "SKIP: network namespaces are not available here"; exit 77; }
  if ((rc != 0)); then
    tail -20 "$OUT/$scenario.err" >&2
    echo "store_pause: the $scenario run failed (exit $rc)"
    failed=1
    continue
  fi
  /usr/bin/python3 - "$OUT/$scenario" "$scenario" <<'PY' || failed=1
import csv, glob, json, os, re, sys
from datetime import datetime, timezone
out, scenario = sys.argv[1], sys.argv[2]
run = json.load(open(f"{out}/report.json"))["runs"][0]
t0 = run["start_unix"]
rows = list(csv.DictReader(open(f"{out}/requests.csv")))
fault = [l.split() for l in open(f"{out}/events.txt") if " stop " in l][0]
start, end, node = float(fault[0]), float(fault[1]), fault[3]
failures = []
def p99(values):
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))] if v else float("nan")
ok = [r for r in rows if r["outcome"] == "OK"]
sent = lambda r: t0 + float(r["send_s"])
during = [float(r["ttft_ms"]) for r in ok if start <= sent(r) < end]
cold = [float(r["ttft_ms"]) for r in ok
        if not (start - 1 <= sent(r) < end + 5) and int(r["cached_tokens"]) == 0]
s = run["summary"]
print(f"{scenario}: {node} paused {end - start:.1f} s; {s['ok']} ok, {s['failed']} failed of "
      f"{s['requests']}, wrong tokens {s['wrong_tokens']}")
if s["failed"] or s["wrong_tokens"]:
    failures.append("failed requests or wrong tokens")
ttl = 2.0
bound = p99(cold) + (600 if scenario == "single" else 1000 * (ttl + 1))
print(f"  p99 TTFT sent during the pause {p99(during):.0f} ms ({len(during)} requests); cold p99 "
      f"{p99(cold):.0f} ms ({len(cold)} requests); bound {bound:.0f} ms")
if not during or p99(during) > bound:
    failures.append("p99 TTFT during the pause over the bound")
hits = [sent(r) - start for r in ok if start <= sent(r) < end and int(r["cached_tokens"]) > 0]
print(f"  requests with a prefix hit during the pause: {len(hits)}"
      + (f", the first sent {hits[0]:.2f} s into it" if hits else ""))
if scenario == "ha":
    if not hits:
        failures.append("no prefix hit during the leader's pause")
    # The gateway first: the workers' bound follows from its figure.
    logs = sorted(glob.glob(f"{out}/logs/*.log"),
                  key=lambda l: (not os.path.basename(l).startswith("gateway"), l))
    gateway_reached = None
    for log in logs:
        name = os.path.basename(log)[:-4]
        if not re.match(r"(gateway|prefill|decode)-", name):
            continue
        reached = None
        for line in open(log, errors="replace"):
            m = re.match(r"I (\d\d):(\d\d):(\d\d\.\d+) .*cachestore client: (\S+) answers", line)
            if not m:
                continue
            day = datetime.fromtimestamp(start, timezone.utc)
            t = day.replace(hour=int(m[1]), minute=int(m[2]), second=0, microsecond=0).timestamp()
            t += float(m[3])
            if t >= start:
                reached = (t - start, m[4])
                break
        if reached is None:
            print(f"  {name}: made no store call that reached another replica during the run")
            continue
        if name.startswith("gateway"):
            bound = ttl + 1
            gateway_reached = reached[0] if gateway_reached is None else max(gateway_reached,
                                                                            reached[0])
        else:
            bound = (gateway_reached if gateway_reached is not None else ttl + 1) + 1
        verdict = "ok" if reached[0] <= bound else f"LATE (bound {bound:.2f} s)"
        print(f"  {name}: reached {reached[1]} {reached[0]:.2f} s after the pause began: {verdict}")
        if reached[0] > bound:
            failures.append(f"{name} reached the new leader after {reached[0]:.1f} s")
if failures:
    print("  FAILED: " + "; ".join(failures))
    sys.exit(1)
print("  every check holds")
PY
done
exit "$failed"
