#!/usr/bin/env bash
# Multi-host fault contract (issue 10), on network namespaces, one host per service, UCX over tcp:
# store, 2 prefill, 2 decode (+1 spare), 1 gateway that discovers workers from the store, under a
# steady stream of verified requests (5/s, about 2.5 minutes on 2 cores). Each fault strikes 30 ms
# after a request was sent, so requests are in flight on the faulted node. Faults, in order:
#   dup prefill-0          a second process with prefill-0's node id, on another host: refused
#   stop decode-0 for 6s   SIGSTOP (a hung host)
#   cut decode-1 for 10s   its link down (a partition)
#   cut store for 10s      the store's link down
#   restart store          kill -9 and start again (recovers from its WAL)
#   kill decode-0 for 2s   kill -9, back 2 s later as a new incarnation
#   add decode-2           a worker joins while the gateway runs
# bench-serve --fault-contract checks, for every fault: wrong tokens 0 (--verify on every
# request); failed requests at most those in flight on the faulted node when it struck; the node
# serves again within 5 s of being back (the store: a request with prefix hits within 5 s); no
# request outlives its deadline; the duplicate was refused; the added worker served within 5 s.
# The contract's latency and fair-share clauses (issue 34) are enforced: p99 TTFT of the requests
# sent while a fault is active within 2x the fault-free p99 + 750 ms, and a worker that is back
# (or added) gets at least half its fair share of decode requests 5-10 s after. The build before
# routing learned broke both: a request sent to a stopped or cut decode worker waited the fixed
# 2 s reserve timeout (p99 TTFT 2011 / 2013 ms against 82 ms fault-free), and prefix affinity
# starved a worker back from a kill (24% of decode requests, fair 50%) or just added (4%, fair
# 33%). Now the Reserve timeout adapts to measured round trips (floor 250 ms), a failure's cost
# is learned at once and forgotten in seconds, a worker heartbeating again is probed at once,
# and a held prefix wins ties only up to its share (gateway/worker_set.h, PickDecode).
# Skips (exit 77) where `ip netns add` is not allowed.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

NAME=kvf$$
run_cluster "$NAME" "3 = wrong tokens, 4 = fault contract broken" \
  --prefill 2 --decode 2 --spare-decode 1 \
  --fault "at=4s dup prefill-0" \
  --fault "at=10.03s stop decode-0 for 6s" \
  --fault "at=24.03s cut decode-1 for 10s" \
  --fault "at=42.03s cut store for 10s" \
  --fault "at=62.03s restart store" \
  --fault "at=74.03s kill decode-0 for 2s" \
  --fault "at=86s add decode-2" \
  -- --rate 5 --arrival fixed --num-requests 700 --max-duration 100s --input-tokens 80 \
  --output-tokens 96 --shared-prefix-ratio 0.8 --prefix-groups 3 --concurrency 64 --timeout 20s \
  --verify --slo ttft=2s --fault-contract default
/usr/bin/python3 - "$WORK/run/report.json" <<'PY' || { KEEP=1; fail "bad report (in $WORK)"; }
import json, sys
run = json.load(open(sys.argv[1]))["runs"][0]
s, k = run["summary"], run["contract"]
print(f"requests {s['requests']} ok {s['ok']} failed {s['failed']} verified {s['verified']} "
      f"wrong {s['wrong_tokens']} hit rate {s['hit_rate']:.3f}")
# Requests cut by --max-duration at the end are verified as far as they got.
assert s["wrong_tokens"] == 0 and s["verified"] >= s["ok"] > 150, s
assert k["kept"], k["violations"]
actions = [(f["action"], f["target"]) for f in k["faults"]]
want = [("dup", "prefill-0"), ("stop", "decode-0"), ("cut", "decode-1"), ("cut", "store"),
        ("restart", "store"), ("kill", "decode-0"), ("add", "decode-2")]
assert actions == want, actions
for f in k["faults"]:
    print(f"  {f['label']:<28} in flight on node {f['in_flight_on_target']}/{f['in_flight']} "
          f"failed {f['failed']} serves again {f['served_again_s']:.1f}s "
          f"hits again {f['hits_again_s']:.1f}s p99 TTFT while active {f['window_ttft_p99_ms']:.0f} ms "
          f"(fault-free {k['steady_ttft_p99_ms']:.0f} ms) share after {f['share']:.2f} "
          f"of fair {f['fair_share']:.2f}")
PY
echo PASS
