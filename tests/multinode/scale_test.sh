#!/usr/bin/env bash
# Scale decode out and in under load (issue 35), on network namespaces: store, 2 prefill, 2 decode
# (+1 spare), 1 gateway that discovers workers from the store, verified requests at 6/s for about
# 35 s. At 6 s the spare decode-2 joins ('add': registered, found by discovery); at 22 s it is
# scaled in ('retire': SIGTERM, it refuses new work with FAILURE_DRAINING, finishes what it
# admitted, deregisters and exits). Checks: 0 failed requests, 0 wrong tokens, decode-2 served a
# request within 10 s of joining and nothing after it retired, the drain exited cleanly, and the
# fault contract (no failure, no request past its deadline). Skips (77) without `ip netns add`.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

NAME=kvs$$
run_cluster "$NAME" "3 = wrong tokens, 4 = fault contract broken" \
  --prefill 2 --decode 2 --spare-decode 1 \
  --fault "at=6s add decode-2" \
  --fault "at=22.03s retire decode-2" \
  -- --rate 6 --arrival fixed --num-requests 200 --max-duration 35s --input-tokens 80 \
  --output-tokens 48 --shared-prefix-ratio 0.5 --prefix-groups 3 --concurrency 64 --timeout 20s \
  --verify --fault-contract serve-again=10s
cat "$WORK/run/drains.txt"
/usr/bin/python3 - "$WORK/run" <<'PY' || { KEEP=1; fail "bad report (in $WORK)"; }
import csv, json, sys
out = sys.argv[1]
run = json.load(open(out + "/report.json"))["runs"][0]
s, k = run["summary"], run["contract"]
print(f"requests {s['requests']} ok {s['ok']} failed {s['failed']} verified {s['verified']} "
      f"wrong {s['wrong_tokens']}")
assert s["failed"] == 0 and s["wrong_tokens"] == 0 and s["verified"] >= s["ok"] > 100, s
assert k["kept"], k["violations"]
verdicts = {f["action"]: f for f in k["faults"]}
add, retire = verdicts["add"], verdicts["retire"]
print(f"decode-2 served {add['served_again_s']:.1f} s after it joined; "
      f"retire failed {retire['failed']}")
assert 0 <= add["served_again_s"] <= 10, add
assert retire["failed"] == 0, retire
drains = [l.split() for l in open(out + "/drains.txt")]
assert drains == [[drains[0][0], drains[0][1], "drained"]] and drains[0][0] == "decode-2", drains
# Per node: what decode-2 served, and nothing sent after its drain ended.
addr = next(l.split()[2].split(",")[0] for l in open(out + "/events.txt")
            if l.startswith("@node decode-2 "))
rows = list(csv.DictReader(open(out + "/requests.csv")))
on_new = [r for r in rows if r.get("decode_worker") == addr]
print(f"decode-2 ({addr}) served {len(on_new)} of {len(rows)} requests")
assert on_new, "decode-2 served nothing"
retired_at = next(f["end_s"] for f in run["faults"] if f["label"].startswith("retire"))
late = [r for r in on_new if float(r["send_s"]) > retired_at + 0.5]
assert not late, f"{len(late)} requests sent after the retirement went to decode-2"
PY
echo PASS
