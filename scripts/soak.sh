#!/usr/bin/env bash
# A soak: the namespace cluster under steady verified load with a fault every minute, checked
# for leaks (issue 34).
#
#   scripts/soak.sh [--minutes 30] [--rate R] [--fault-every 60] [--rss-from 300]
#                   [--rss-growth 2] [--fd-slack 4] [--cache-slots N] [--event-retention N]
#                   [--snapshot-every N] [--verify-sample N] [--out DIR] [--name ID]
#
# Starts scripts/cluster/run.sh (cache store, 2 prefill and 2 decode workers, 1 gateway, each in
# its own network namespace, UCX over tcp, a generated tiny llama) and sends Poisson arrivals
# at --rate (default 20 req/s: about 65% of this workload's saturation, 32 req/s, on the 2-core
# VM; see the README) of 512-token prompts (half a shared prefix over 16 groups) and 16 output
# tokens for --minutes, every token checked against the co-located reference (or
# --verify-sample requests spread over the run). --cache-slots (per worker, default 4096) sets
# how soon the caches and the store's index are full, --event-retention (the store's, default
# 65536 events of about 350 bytes) how soon its event ring is, --snapshot-every (the store's
# WAL records between snapshots, default 100000: about 16 minutes at 20 req/s) how soon it
# writes its first snapshot: a short run needs all three small to reach its steady state. A fault every --fault-every
# seconds, in turn:
#   stop decode-0 for 6s, cut store for 8s, kill prefill-1 for 5s (a new incarnation),
#   stop prefill-0 for 5s, cut decode-1 for 5s, stop store for 8s (a hung store),
#   drain decode-0 (SIGTERM, started again)
# (The store is paused and cut, not restarted, so that its memory is judged over the whole
# run too; tests/multinode/faults_test.sh restarts it.)
# Every 10 s each process's RSS, open file descriptors and load gauges are sampled
# (samples.csv); 25 s after the load (past the 20 s deadline every reservation lapses with, and
# the decode workers' sweep a second after) a last sample is taken.
# Checks, each printed with its figures:
#   - 0 wrong tokens;
#   - RSS: every process that ran from --rss-from (default minute 5) to the end grows by less
#     than --rss-growth percent, from the median of its samples in the 30 s from --rss-from
#     to the idle end (processes restarted by a fault are listed with their own figures, not
#     judged);
#   - descriptors: the same processes hold at most max(--fd-slack, 10%) more at the end than the most
#     they held in those 30 s (a leak per fault or per request grows without bound; a
#     connection opened lazily is not one); a failure lists what the descriptors are;
#   - processes: every node runs at the end, and only a kill or drain fault gave it a new pid (a
#     crash the load rode over still fails the soak);
#   - slots: when idle, nothing is still held: no request running or waiting, no decode KV pool
#     block in use, no reservation memory region, no store lease, no gateway request in flight.
# Exit 0 when every check holds, 1 when one fails, 3 on wrong tokens, 77 without namespaces.
# CI runs a 2-minute version (tests/multinode/soak_test.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MINUTES=30 RATE=20 FAULT_EVERY=60 RSS_FROM=300 RSS_GROWTH=2 FD_SLACK=4 OUT="" NAME="soak$$" MODEL_ARGS=()
CACHE_SLOTS=4096 VERIFY_SAMPLE=0 EVENT_RETENTION=65536 SNAPSHOT_EVERY=100000
while (($#)); do
  case "$1" in
    --minutes) MINUTES=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --fault-every) FAULT_EVERY=$2; shift 2 ;;
    --rss-from) RSS_FROM=$2; shift 2 ;;
    --rss-growth) RSS_GROWTH=$2; shift 2 ;;
    --fd-slack) FD_SLACK=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --name) NAME=$2; shift 2 ;;
    --model) MODEL_ARGS=(--model "$2"); shift 2 ;;
    --cache-slots) CACHE_SLOTS=$2; shift 2 ;;
    --verify-sample) VERIFY_SAMPLE=$2; shift 2 ;;
    --event-retention) EVENT_RETENTION=$2; shift 2 ;;
    --snapshot-every) SNAPSHOT_EVERY=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "soak.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for n in MINUTES FAULT_EVERY RSS_FROM CACHE_SLOTS EVENT_RETENTION SNAPSHOT_EVERY FD_SLACK; do
  [[ ${!n} =~ ^[0-9]+$ ]] && ((${!n} >= 1)) || { echo "soak.sh: --${n,,} must be a positive integer" >&2; exit 2; }
done
[[ $VERIFY_SAMPLE =~ ^[0-9]+$ ]] || { echo "soak.sh: --verify-sample must be a count" >&2; exit 2; }
[[ $RATE =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "soak.sh: --rate must be a number" >&2; exit 2; }
DURATION=$((MINUTES * 60))
((RSS_FROM < DURATION - 20)) || { echo "soak.sh: --rss-from must be 20 s before the end" >&2; exit 2; }
export KVRELAY_BIN_DIR=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
[[ -x $KVRELAY_BIN_DIR/kvrelay ]] || { echo "soak.sh: no $KVRELAY_BIN_DIR/kvrelay; build it first" >&2; exit 2; }
OUT=${OUT:-$(mktemp -d /tmp/kvrelay-soak-XXXXXX)}
mkdir -p "$OUT"

CYCLE=("stop decode-0 for 6s" "cut store for 8s" "kill prefill-1 for 5s" "stop prefill-0 for 5s"
       "cut decode-1 for 5s" "stop store for 8s" "drain decode-0")
faults=()
restarts=""  # the nodes a fault restarts (a new process), one word per restart
for ((k = 0, at = FAULT_EVERY / 2; at + 20 < DURATION; k++, at += FAULT_EVERY)); do
  fault=${CYCLE[k % ${#CYCLE[@]}]}
  faults+=(--fault "at=${at}s $fault")
  [[ $fault =~ ^(kill|drain)\ ([a-z0-9-]+) ]] && restarts+=" ${BASH_REMATCH[2]}"
done
REQUESTS=$(awk -v r="$RATE" -v d="$DURATION" 'BEGIN { printf "%d", r * d }')
echo "soak: ${MINUTES} min at ${RATE} req/s ($REQUESTS requests), $((${#faults[@]} / 2)) faults; out $OUT" >&2

set +e
"$ROOT/scripts/cluster/run.sh" --name "$NAME" --out "$OUT" "${MODEL_ARGS[@]}" --sample-every 10 \
  --cache-slots "$CACHE_SLOTS" --settle 25 \
  --store-args "--event-retention $EVENT_RETENTION --snapshot-every $SNAPSHOT_EVERY" \
  "${faults[@]}" -- --rate "$RATE" --num-requests "$REQUESTS" --max-requests "$REQUESTS" \
  --max-duration "$((DURATION + 60))s" --input-tokens 512 --output-tokens 16 \
  --shared-prefix-ratio 0.5 --prefix-groups 16 --concurrency 128 --timeout 20s \
  --slo ttft=2s,tpot=250ms --verify --verify-sample "$VERIFY_SAMPLE" --quiet \
  >"$OUT/bench.txt" 2>"$OUT/cluster.txt"
rc=$?
set -e
((rc != 77)) || { echo "SKIP: network namespaces are not available here"; exit 77; }
sed -n '/^requests/,/^wrong tokens/p' "$OUT/bench.txt"
((rc == 0 || rc == 3)) || { tail -20 "$OUT/cluster.txt" >&2; echo "soak: the run failed (exit $rc)" >&2; exit 1; }

/usr/bin/python3 - "$OUT" "$RSS_FROM" "$RSS_GROWTH" "$rc" "$FD_SLACK" "$restarts" <<'PY'
import csv, json, sys
out, rss_from, growth_limit, rc = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
fd_min_slack = int(sys.argv[5])
planned_restarts = {}
for node in sys.argv[6].split():
    planned_restarts[node] = planned_restarts.get(node, 0) + 1
rows = list(csv.DictReader(open(f"{out}/samples.csv")))
final = [r for r in rows if r["t"] == "final"]
timed = [r for r in rows if r["t"] != "final"]
failures = []

def describe_fds(node):
    # What the node's descriptors were at the end (run.sh --settle wrote them): kinds, and its
    # TCP connections by state and peer host.
    try:
        lines = open(f"{out}/fds/{node}.txt").read().splitlines()
    except OSError:
        return
    kinds, peers = {}, {}
    for line in lines:
        if " -> " in line:
            target = line.split(" -> ", 1)[1]
            kind = target.split(":", 1)[0] if ":" in target else target
            kinds[kind] = kinds.get(kind, 0) + 1
        elif line.split()[:1] and line.split()[0] in ("ESTAB", "CLOSE-WAIT", "SYN-SENT", "FIN-WAIT-1",
                                                      "FIN-WAIT-2", "LAST-ACK", "CLOSING"):
            f = line.split()
            key = f"{f[0]} {f[4].rsplit(':', 1)[0]}"
            peers[key] = peers.get(key, 0) + 1
    print("    descriptors: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    print("    connections: " + ", ".join(f"{k} x{v}" for k, v in sorted(peers.items())))

summary = json.load(open(f"{out}/report.json"))["runs"][0]["summary"]
print(f"requests: {summary['ok']} ok, {summary['failed']} failed of {summary['requests']}; "
      f"wrong tokens {summary['wrong_tokens']} ({summary['verified']} verified)")
if rc == 3 or summary["wrong_tokens"] != 0:
    failures.append("wrong tokens")

# Every process runs to the end, and only the faults restart one: a crash (the process gone,
# or a new pid no fault explains) fails the soak even when the load rode over it.
print("processes (distinct pids per node; restarts the faults planned):")
for node in sorted({r["node"] for r in rows}):
    pids = []
    for r in timed + [r for r in final if r["node"] == node]:
        if r["node"] == node and (not pids or pids[-1] != r["pid"]):
            pids.append(r["pid"])
    planned = planned_restarts.get(node, 0)
    at_end = any(r["node"] == node for r in final)
    verdict = "ok"
    if not at_end:
        verdict = "EXITED"
        failures.append(f"{node} was not running at the end (pids {', '.join(pids)})")
    elif len(pids) > planned + 1:
        verdict = "UNPLANNED RESTART"
        failures.append(f"{node} ran {len(pids)} processes, {planned} restarts planned")
    print(f"  {node:10} {len(pids)} pids, {planned} restarts planned: {verdict}")

print(f"memory and descriptors from {rss_from:.0f} s to the end (after settling):")
for node in sorted({r["node"] for r in rows}):
    ends = [r for r in final if r["node"] == node]
    if not ends:
        print(f"  {node:10} not running at the end")
        continue
    end = ends[0]
    same = [r for r in timed if r["node"] == node and r["pid"] == end["pid"]]
    start = [r for r in same if float(r["t"]) >= rss_from]
    if not start or float(same[0]["t"]) > rss_from:
        born = same[0]["t"] if same else "?"
        print(f"  {node:10} restarted by a fault (this process from {born} s): RSS "
              f"{int(end['rss_kb']) / 1024:.1f} MiB, {end['fds']} fds at the end (not judged)")
        continue
    # The baseline is the first 30 s of the window: the median RSS (one sample is noisy under
    # load) and the most descriptors (connections opened lazily then are not a leak).
    early = [r for r in start if float(r["t"]) < rss_from + 30] or start[:1]
    rss0 = sorted(int(r["rss_kb"]) for r in early)[len(early) // 2]
    fd0 = max(int(r["fds"]) for r in early)
    rss1, fd1 = int(end["rss_kb"]), int(end["fds"])
    grew = 100.0 * (rss1 - rss0) / rss0
    fd_slack = max(fd_min_slack, int(0.1 * fd0))
    verdict = "ok"
    if grew >= growth_limit:
        verdict = "RSS GREW"
        failures.append(f"{node} RSS grew {grew:.2f}%")
    if fd1 > fd0 + fd_slack:
        verdict = "FD LEAK"
        failures.append(f"{node} descriptors {fd0} -> {fd1}")
    print(f"  {node:10} RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB ({grew:+.2f}%), "
          f"fds {fd0} -> {fd1}: {verdict}")
    if verdict == "FD LEAK":
        describe_fds(node)

print("held when idle (last sample, 25 s after the load):")
for r in final:
    held = {k: float(r[k]) for k in ("running", "waiting", "regions", "leases", "in_flight")
            if r[k] != ""}
    # The decode KV pool holds only running sequences; a prefill's holds only its requests.
    if r["kv_usage"] != "":
        held["kv_pool_use"] = float(r["kv_usage"])
    busy = {k: v for k, v in held.items() if v != 0}
    print(f"  {r['node']:10} " + (", ".join(f"{k} {v:g}" for k, v in held.items()) or "-") +
          (": LEAK" if busy else ""))
    if busy:
        failures.append(f"{r['node']} still holds {busy}")
if failures:
    print("SOAK FAILED: " + "; ".join(failures))
    sys.exit(1)
print("soak: every check holds")
PY
