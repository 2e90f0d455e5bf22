#!/usr/bin/env bash
# Rolling restart under load (issue 35), on network namespaces: store, 2 prefill, 2 decode, 1
# gateway that discovers workers from the store, verified requests at 6/s for about 40 s. At 8 s
# 'rollout' drains every worker one at a time (SIGTERM: it refuses new work with
# FAILURE_DRAINING, which the gateway skips without spending an attempt or opening a breaker,
# finishes what it admitted, deregisters, exits 0) and starts it again under the same node id
# (a new incarnation), each serving again before the next. Checks: 0 failed requests, 0 wrong
# tokens (--verify), every drain exited by itself, and the fault contract (each restarted worker
# serves again within 5 s). Prints each drain's SIGTERM-to-exit time and the p99 TTFT of the
# requests sent during the rollout beside the steady one before it. Skips (77) without netns.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

NAME=kvr$$
# fair-share=0: the contract's fair-share clause is printed, not enforced, until routing learns
# and forgets (issue 34): a drained and restarted decode worker got 10% of decode requests in the
# window after its serve-again limit (fair 50%), as in faults_test.sh.
run_cluster "$NAME" "3 = wrong tokens, 4 = fault contract broken" \
  --prefill 2 --decode 2 \
  --fault "at=8.03s rollout" \
  -- --rate 6 --arrival fixed --num-requests 240 --max-duration 40s --input-tokens 80 \
  --output-tokens 48 --shared-prefix-ratio 0.5 --prefix-groups 3 --concurrency 64 --timeout 20s \
  --verify --fault-contract fair-share=0
/usr/bin/python3 - "$WORK/run" <<'PY' || { KEEP=1; fail "bad report (in $WORK)"; }
import json, sys
out = sys.argv[1]
run = json.load(open(out + "/report.json"))["runs"][0]
s, k = run["summary"], run["contract"]
print(f"requests {s['requests']} ok {s['ok']} failed {s['failed']} verified {s['verified']} "
      f"wrong {s['wrong_tokens']}")
assert s["failed"] == 0 and s["wrong_tokens"] == 0 and s["verified"] >= s["ok"] > 150, s
assert k["kept"], k["violations"]
drains = [l.split() for l in open(out + "/drains.txt")]
for node, seconds, how in drains:
    print(f"  drain {node}: SIGTERM to exit {float(seconds) * 1e3:.0f} ms ({how})")
assert sorted(d[0] for d in drains) == ["decode-0", "decode-1", "prefill-0", "prefill-1"], drains
assert all(d[2] == "drained" for d in drains), drains
rollout = next(f for f in run["faults"] if f["label"].startswith("rollout"))
print(f"rollout {rollout['end_s'] - rollout['start_s']:.1f} s: p99 TTFT "
      f"{rollout['ttft_p99_during_ms']:.0f} ms over {rollout['requests_during']} requests sent "
      f"during it, {rollout['ttft_p99_before_ms']:.0f} ms steady before it")
assert rollout["requests_during"] > 30, rollout
PY
echo PASS
