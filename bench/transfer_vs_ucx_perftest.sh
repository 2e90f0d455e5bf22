#!/usr/bin/env bash
# Transfer bandwidth: `kvrelay transfer-bench` (two processes, our Transport over UCX RMA with
# per-Post DONE/ACK) against `ucx_perftest ucp_put_bw|ucp_get` (two processes, raw UCP RMA)
# with the same UCX transports, message size and outstanding operations, measured in the same
# run, alternating, so machine load hits both alike. Prints each round and the median ratio.
# Also prints, per round, a one-process memcpy of the same distinct blocks between two regions
# of the region's size (transfer-bench measures it). Over shared memory that memcpy is the limit
# (a put is a memcpy into the peer's segment) and the headline ratio is against it: ucx_perftest
# rewrites one cache-hot buffer, so over shared memory it measures cache bandwidth, while
# transfer-bench moves distinct blocks over a region of realistic size (default 1 GiB per
# side, like a decode pool). Over tcp the headline ratio is against ucx_perftest.
#
#   bench/transfer_vs_ucx_perftest.sh --tls tcp --block-bytes 262144 --inflight 64
#   KVRELAY_BIN=build/bin/kvrelay bench/transfer_vs_ucx_perftest.sh --tls shm --block-bytes 16384
#   bench/transfer_vs_ucx_perftest.sh --tls shm --block-bytes 16777216 --inflight 16 \
#     --region-bytes 4294967296
#
# Flags: --tls tcp|shm  --block-bytes B  --inflight D  --blocks N  --direction put|get
#        --region-bytes R (default 1 GiB)  --rounds R  --json (one JSON line at the end)
# KVRELAY_BIN: a binary with the transfer-bench subcommand (default build/bin/kvrelay, else
# build/bin/kvrelay_transfer_peer). Needs ucx_perftest (Debian package ucx-utils).
set -euo pipefail

tls=tcp block=262144 inflight=64 blocks=0 direction=put rounds=3 json=0 region=$((1 << 30))
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tls) tls=$2; shift 2 ;;
    --block-bytes) block=$2; shift 2 ;;
    --inflight) inflight=$2; shift 2 ;;
    --blocks) blocks=$2; shift 2 ;;
    --direction) direction=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --region-bytes) region=$2; shift 2 ;;
    --json) json=1; shift ;;
    *) echo "transfer_vs_ucx_perftest.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
case "$tls" in
  tcp) ucx_tls=tcp ;;
  shm) ucx_tls=posix,sysv,cma,self ;;
  *) echo "transfer_vs_ucx_perftest.sh: --tls must be tcp or shm, got $tls" >&2; exit 2 ;;
esac
case "$direction" in
  put) ptest=ucp_put_bw ;;
  get) ptest=ucp_get ;;
  *) echo "transfer_vs_ucx_perftest.sh: --direction must be put or get" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${KVRELAY_BIN:-}
if [[ -z "$bin" ]]; then
  for c in "$root/build/bin/kvrelay" "$root/build/bin/kvrelay_transfer_peer"; do
    [[ -x "$c" ]] && { bin=$c; break; }
  done
fi
[[ -x "$bin" ]] || { echo "no kvrelay binary; set KVRELAY_BIN" >&2; exit 1; }
command -v ucx_perftest >/dev/null || { echo "ucx_perftest missing (apt-get install ucx-utils)" >&2; exit 1; }

# One pass over the region's slots (distinct blocks), at least 2000 blocks, at most 65536.
if [[ "$blocks" -eq 0 ]]; then
  blocks=$(( region / block ))
  (( blocks < 2000 )) && blocks=2000
  (( blocks > 65536 )) && blocks=65536
fi
(( region < block )) && region=$block

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

perftest_gbps() {
  local port; port=$(free_port)
  UCX_TLS=$ucx_tls ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  local out=""
  for _ in $(seq 1 50); do
    if out=$(UCX_TLS=$ucx_tls timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t "$ptest" \
               -s "$block" -n "$blocks" -w $(( blocks / 10 + 10 )) -O "$inflight" -f -v 2>/dev/null); then
      break
    fi
    sleep 0.1
  done
  wait "$server" 2>/dev/null || true
  # CSV: iterations, latency typical/avg/overall (us), bandwidth avg/overall (MiB/s), rate...
  echo "$out" | awk -F, 'NF >= 8 && $1 ~ /^[0-9]+$/ { printf "%.4f\n", $6 * 1048576 / 1e9 }' | tail -1
}

ours_json() {
  "$bin" transfer-bench --tls "$tls" --block-bytes "$block" --blocks "$blocks" \
    --inflight "$inflight" --direction "$direction" --region-bytes "$region" --json
}

echo "transfer vs ucx_perftest: tls=$tls ($ucx_tls) direction=$direction block=$block bytes" \
     "inflight=$inflight blocks=$blocks region=$region rounds=$rounds" \
     "load=$(cut -d' ' -f1 /proc/loadavg)"
ratios=() mratios=() tails=()
for r in $(seq 1 "$rounds"); do
  base=$(perftest_gbps)
  js=$(ours_json)
  ours=$(echo "$js" | python3 -c 'import json,sys; print(json.load(sys.stdin)["bandwidth_gbps"])')
  p50=$(echo "$js" | python3 -c 'import json,sys; print(json.load(sys.stdin)["p50_block_us"])')
  p99=$(echo "$js" | python3 -c 'import json,sys; print(json.load(sys.stdin)["p99_block_us"])')
  mcp=$(echo "$js" | python3 -c 'import json,sys; print(json.load(sys.stdin).get("memcpy_gbps", 0))')
  cold=$(echo "$js" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("%s GB/s, p99 %s us" % (d["cold_gbps"], d["cold_p99_block_us"]))')
  faults=$(echo "$js" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("sender %d receiver %d" % (d["sender_minor_faults"], d["receiver_minor_faults"]))')
  ratio=$(python3 -c "b=float('${base:-0}'); print('%.3f' % (float('$ours')/b if b > 0 else 0))")
  mratio=$(python3 -c "b=float('${mcp:-0}'); print('%.3f' % (float('$ours')/b if b > 0 else 0))")
  tail=$(python3 -c "print('%.2f' % (float('$p99')/float('$p50') if float('$p50') > 0 else 0))")
  ratios+=("$ratio") mratios+=("$mratio") tails+=("$tail")
  printf '  round %d: ucx_perftest %s GB/s   kvrelay %s GB/s (p50 %s us, p99 %s us per block, p99/p50 %s)   ratio %s   [memcpy of the same blocks %s GB/s, ratio %s]  cold pass %s  steady faults: %s\n' \
    "$r" "${base:-?}" "$ours" "$p50" "$p99" "$tail" "$ratio" "$mcp" "$mratio" "$cold" "$faults"
done
med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
median=$(med "${ratios[@]}") mmedian=$(med "${mratios[@]}") tmedian=$(med "${tails[@]}")
echo "median ratio kvrelay/ucx_perftest: $median"
echo "median ratio kvrelay/memcpy of the same blocks: $mmedian   median p99/p50 per block: $tmedian"
if [[ "$tls" == shm ]]; then
  echo "headline (shm: against memcpy of the same distinct blocks, the shared-memory limit): $mmedian"
else
  echo "headline (tcp: against ucx_perftest): $median"
fi
if [[ "$json" -eq 1 ]]; then
  echo "{\"tls\":\"$tls\",\"direction\":\"$direction\",\"block_bytes\":$block,\"inflight\":$inflight,\"region_bytes\":$region,\"median_ratio\":$median,\"median_ratio_vs_memcpy\":$mmedian,\"median_p99_over_p50\":$tmedian}"
fi
