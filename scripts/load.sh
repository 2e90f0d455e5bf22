#!/usr/bin/env bash
# The default load scenario: the whole system under load with faults, in a few minutes on 2 cores.
#
#   scripts/load.sh [--out DIR] [--no-faults | --rollout | --disk] [--requests N] [--trace FILE]
#
# Starts a cluster in network namespaces (scripts/cluster/run.sh: cache store, 2 prefill and 2
# decode workers, 1 gateway, each its own "host", UCX over tcp) serving a generated tiny llama,
# and replays 120 requests of the Mooncake FAST'25 trace (from request #3000, where prefixes
# repeat within a short window) through it with `kvrelay bench-serve`: prompts derived from the
# trace's hash_ids at 8 tokens per id, output capped at 16 tokens, arrivals slowed 4x
# (~1 request/s, about what a 2-core machine serves), SLO TTFT 2 s / TPOT 250 ms. Faults:
#   at 20s  stop decode-0 for 6s     (SIGSTOP, then SIGCONT)
#   at 35s  cut store for 8s         (its link down, then up)
#   at 50s  shape decode-1 50mbit    (tc tbf on its link, until the end)
#   at 65s  kill decode-1            (SIGKILL, not restarted)
#   at 80s  restart store            (SIGKILL, started again on its WAL)
# --rollout replaces them with a rolling restart at 20 s (every worker drained by SIGTERM and
# started again under its node id, one at a time) checked by --fault-contract: no request may
# fail, and the table gives the p99 TTFT during the rollout beside the one before it.
# --disk runs the load twice without faults, each worker with --cache-slots 64 (DRAM far
# smaller than the load's prefixes): with DRAM alone, then with a disk tier of 8x those slots
# (run.sh --ssd-slots 512); it prints both hit rates and where each prefix came from, and fails
# unless the disk run's hit rate is higher and no token is wrong (OUT/dram, OUT/disk).
# Every served token is checked against the co-located reference (--verify). Prints the table
# and the path of the plot. Needs root (network namespaces); builds build/bin/kvrelay if missing.
# Without the trace (../shared/data/traces/synthetic_trace.jsonl, or --trace / $KVRELAY_TRACE)
# it runs a synthetic workload with 50% shared prefixes instead.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT="" FAULTS=1 ROLLOUT=0 DISK=0 REQUESTS=120
TRACE=${KVRELAY_TRACE:-}
while (($#)); do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --no-faults) FAULTS=0; shift ;;
    --rollout) ROLLOUT=1; shift ;;
    --disk) DISK=1; shift ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --trace) TRACE=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "load.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
export KVRELAY_BIN_DIR=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
if [[ ! -x $KVRELAY_BIN_DIR/kvrelay ]]; then
  echo "load.sh: building kvrelay first" >&2
  "$ROOT/scripts/setup.sh"
  TARGETS=kvrelay "$ROOT/scripts/build.sh"
fi
if [[ -z $TRACE ]]; then
  for t in "$ROOT/../shared/data/traces/synthetic_trace.jsonl" \
           /work/shared/data/traces/synthetic_trace.jsonl; do
    [[ -f $t ]] && { TRACE=$t; break; }
  done
fi
OUT=${OUT:-$(mktemp -d /tmp/kvrelay-load-XXXXXX)}

fault_args=() contract_args=()
if ((ROLLOUT)); then
  fault_args=(--fault "at=20.03s rollout")
  contract_args=(--fault-contract default)
elif ((FAULTS)); then
  fault_args=(--fault "at=20s stop decode-0 for 6s" --fault "at=35s cut store for 8s"
              --fault "at=50s shape decode-1 50mbit" --fault "at=65s kill decode-1"
              --fault "at=80s restart store")
fi
if [[ -n $TRACE ]]; then
  workload=(--trace "$TRACE" --trace-offset 3000 --tokens-per-hash-id 8 --max-output-tokens 16
            --time-scale 4)
else
  echo "load.sh: no Mooncake trace found; running a synthetic workload instead" >&2
  workload=(--num-requests "$REQUESTS" --input-tokens 384 --output-tokens 16
            --shared-prefix-ratio 0.5 --prefix-groups 8 --rate 1.5)
fi
load_args=("${workload[@]}" --max-requests "$REQUESTS" --max-duration 150s --timeout 20s
           --concurrency 32 --slo ttft=2s,tpot=250ms --verify --verify-threads 2)
if ((DISK)); then
  for tier in dram disk; do
    ssd=()
    [[ $tier == dram ]] || ssd=(--ssd-slots 512)
    "$ROOT/scripts/cluster/run.sh" --prefill 2 --decode 2 --gateways 1 --out "$OUT/$tier" \
      --cache-slots 64 "${ssd[@]}" -- "${load_args[@]}"
  done
  exec /usr/bin/python3 - "$OUT/dram" "$OUT/disk" <<'PY'
import collections, csv, json, sys
runs = {}
for d in sys.argv[1:]:
    summary = json.load(open(f"{d}/report.json"))["runs"][0]["summary"]
    sources = collections.Counter(r["prefix_source"] for r in csv.DictReader(open(f"{d}/requests.csv")))
    runs[d] = summary
    print(f"{d}: hit rate {summary['hit_rate']:.3f} of an ideal {summary['ideal_hit_rate']:.3f}, "
          f"{summary['ok']} ok, {summary['failed']} failed, {summary['wrong_tokens']} wrong of "
          f"{summary['verified']} verified, TTFT p50 {summary['ttft_ms']['p50']:.0f} ms p99 "
          f"{summary['ttft_ms']['p99']:.0f} ms; prefix source {dict(sorted(sources.items()))}")
dram, disk = runs[sys.argv[1]], runs[sys.argv[2]]
ok = disk["hit_rate"] > dram["hit_rate"] and dram["wrong_tokens"] == 0 and disk["wrong_tokens"] == 0
print(f"disk tier: hit rate {dram['hit_rate']:.3f} -> {disk['hit_rate']:.3f} at the same DRAM "
      f"({'PASS' if ok else 'FAIL'})")
sys.exit(0 if ok else 1)
PY
fi
exec "$ROOT/scripts/cluster/run.sh" --prefill 2 --decode 2 --gateways 1 --out "$OUT" \
  "${fault_args[@]}" -- "${load_args[@]}" "${contract_args[@]}"
