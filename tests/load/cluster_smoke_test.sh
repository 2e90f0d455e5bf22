#!/usr/bin/env bash
# Namespace cluster smoke test (bounded: two short runs, about a minute on 2 cores):
#   1. the same trace replayed twice (two tenants, one request at a time) gives the same prefix
#      hit rate and the same prompt/cached/output token counts;
#   2. a run with a decode worker killed midway ends, reports the fault's cost and serves no
#      wrong token (--verify);
#   and after each run no namespace, veth or process of the cluster is left.
# Skips (exit 77) where `ip netns add` is not allowed.
set -euo pipefail
ROOT=${KVRELAY_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
export KVRELAY_BIN_DIR=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
WORK=$(mktemp -d /tmp/kvrelay-load-test-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# A Mooncake-format trace: 24 requests over 4 prefix families (ids are chained prefix blocks).
TRACE=$WORK/trace.jsonl
/usr/bin/python3 - "$TRACE" <<'PY'
import json, sys
lines = []
for i in range(24):
    family = i % 4
    shared = [100 * family + k for k in range(3)]          # 3 blocks shared within a family
    own = [10000 + 10 * i + k for k in range(1 + i % 3)]    # 1-3 blocks of its own
    ids = shared + own
    lines.append({"timestamp": 300 * i, "input_length": 512 * (len(ids) - 1) + 200,
                  "output_length": 4 + i % 5, "hash_ids": ids})
open(sys.argv[1], "w").write("".join(json.dumps(l) + "\n" for l in lines))
PY

MODEL=$WORK/model
"$KVRELAY_BIN_DIR/kvrelay" make-test-model --arch llama --seed 5 --out "$MODEL" >/dev/null

leftovers() {  # namespaces of the cluster named $1, or any of its processes, still there
  ip netns list 2>/dev/null | grep -E "^$1-" || true
  pgrep -af -- "kvrelay .*$WORK/" || true
}

NAME=kvt$$
set +e
"$ROOT/scripts/cluster/run.sh" --name "${NAME}a" --prefill 2 --decode 1 --model "$MODEL" \
  --out "$WORK/${NAME}a" -- --trace "$TRACE" --tokens-per-hash-id 16 --time-scale 0.2 \
  --concurrency 1 --sweep-rates 4,4 --max-requests 12 --max-duration 60s --quiet \
  >"$WORK/a.out" 2>"$WORK/a.err"
rc=$?
set -e
if ((rc == 77)); then
  cat "$WORK/a.err" >&2
  echo "SKIP: network namespaces are not available here"
  exit 77
fi
cat "$WORK/a.out"
((rc == 0)) || { tail -40 "$WORK/a.err" >&2; fail "run 1 exited $rc"; }
[[ -z $(leftovers "${NAME}a") ]] || fail "run 1 left: $(leftovers "${NAME}a")"
/usr/bin/python3 - "$WORK/${NAME}a/report.json" <<'PY' || fail "replays differ"
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
assert len(runs) == 2, runs
a, b = (r["summary"] for r in runs)
for key in ("ok", "prompt_tokens", "cached_tokens", "computed_tokens", "output_tokens",
            "hit_rate"):
    print(f"{key}: {a[key]} vs {b[key]}")
    assert a[key] == b[key], key
assert a["ok"] == 12 and a["cached_tokens"] > 0, a
PY

set +e
"$ROOT/scripts/cluster/run.sh" --name "${NAME}b" --prefill 1 --decode 2 --model "$MODEL" \
  --out "$WORK/${NAME}b" --fault "at=2s kill decode-1" -- --trace "$TRACE" \
  --tokens-per-hash-id 16 --time-scale 1 --concurrency 4 --max-requests 24 \
  --max-duration 40s --timeout 15s --verify --slo ttft=5s --quiet \
  >"$WORK/b.out" 2>"$WORK/b.err"
rc=$?
set -e
cat "$WORK/b.out"
((rc == 0 || rc == 1)) || { tail -40 "$WORK/b.err" >&2; fail "run 2 exited $rc (3 = wrong tokens)"; }
[[ -z $(leftovers "${NAME}b") ]] || fail "run 2 left: $(leftovers "${NAME}b")"
grep -q "kill decode-1" "$WORK/b.out" || fail "the fault is not in the table"
[[ -s $WORK/${NAME}b/plot.png ]] || fail "no plot"
/usr/bin/python3 - "$WORK/${NAME}b/report.json" <<'PY' || fail "bad fault report"
import json, sys
run = json.load(open(sys.argv[1]))["runs"][0]
s = run["summary"]
print("ok", s["ok"], "failed", s["failed"], "verified", s["verified"], "wrong", s["wrong_tokens"])
assert s["requests"] == 24, s
assert s["wrong_tokens"] == 0 and s["verified"] >= s["ok"] > 0, s
assert [f["label"] for f in run["faults"]] == ["kill decode-1"], run["faults"]
PY
echo PASS
