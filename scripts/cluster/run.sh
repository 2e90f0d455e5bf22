#!/usr/bin/env bash
# A multi-host kvrelay cluster on one machine, driven by `kvrelay bench-serve`, with faults.
#
# Every component runs in its own network namespace (one "host" each): the cache store (or N HA
# replicas and their etcd), M prefill workers, K decode workers, G gateways and the load client, joined by a bridge that lives in a
# namespace of its own. Addresses are 10.x inside the namespaces only; nothing in the root
# namespace gets one or contacts them. UCX_TLS=tcp, so workers talk as separate hosts would
# (namespaces do not isolate shared memory). Everything is torn down on exit, Ctrl-C or failure:
# no namespace, process or veth is left behind.
#
# Usage:
#   scripts/cluster/run.sh [options] [-- bench-serve flags...]
# Options:
#   --prefill M --decode K --gateways G   workers and gateways (default 2 2 1)
#   --stores N                            cache store replicas (default 1: one store, node 'store');
#                                         N >= 2: an etcd node and HA replicas store-0..store-N-1
#                                         (cachestore --etcd; every client gets all N addresses)
#   --spare-prefill M --spare-decode K    workers with a namespace but not started: 'add' starts
#                                         them while the cluster runs (default 0 0)
#   --fixed-workers                       gateways take fixed worker lists (--prefill/--decode)
#                                         instead of discovering workers from the store
#   --model DIR | --arch A                model to serve (default: a generated tiny llama)
#   --threads N                           compute threads per worker (default 1)
#   --pool-blocks N --cache-slots N       per-worker KV slots (default 1024 / 4096)
#   --ssd-slots N                         a disk tier of N block slots per worker (--ssd-dir
#                                         OUT/ssd/NODE, --ssd-bytes N slots of the model's layout;
#                                         a restarted node finds its disk again)
#   --prefill-args A --decode-args A      extra flags for every prefill / decode worker / gateway
#   --gateway-args A                      (e.g. --gateway-args '--prefix-routing=false')
#   --store-args A                        extra flags for every cache store replica
#   --fault 'at=20s kill decode-1'        repeatable; also 'at=T stop NODE for D', 'at=T cut NODE
#                                         for D' (link down), 'at=T shape NODE 200mbit' (tc tbf,
#                                         both directions, until the end; at=0s: before the first
#                                         request is sent), 'at=T restart NODE',
#                                         'at=T kill NODE for D' (SIGKILL, started again after D),
#                                         'at=T add NODE' (start a spare worker), 'at=T dup NODE'
#                                         (start a second process with NODE's node id on another
#                                         host; it must be refused)
#                                         'at=T drain NODE' (SIGTERM: a worker, store or gateway
#                                         drains and exits; started again with the same node id),
#                                         'at=T rollout [prefill|decode|workers|stores|gateways|
#                                         all]' (drain and restart every running node of the kind,
#                                         default workers, one at a time, each serving again before
#                                         the next; all = stores, then workers, then gateways),
#                                         NODE may be 'leader' with --stores N: the replica that
#                                         leads when the fault strikes (events name it)
#                                         'at=T retire NODE' (SIGTERM drain of a worker, not started
#                                         again: scale-in); drains.txt gets each drain's
#                                         SIGTERM-to-exit time; 'at=T status' (kvrelay status from
#                                         the client host, saved to status-<T>s.txt and printed)
#   --out DIR                             logs, report.json, requests.csv, plot.png
#   --sample-every S                      every S seconds, each running node's RSS, open file
#                                         descriptors, CPU seconds and load gauges (requests running and
#                                         waiting, KV pool use, reservation memory regions, store
#                                         leases, gateway requests in flight; the store's index
#                                         bytes, retained events, kept token blocks) go to
#                                         samples.csv
#   --settle S                            after the load, wait S seconds, then take a last sample
#                                         (t = "final") and save every node's /metrics in
#                                         metrics/NODE.prom: what is still held when idle;
#                                         each node's descriptors and TCP connections in
#                                         fds/NODE.txt
#   --subnet 10.77.0                      first three octets of the namespace addresses
#   --name ID                             namespace prefix (default kvr<pid>): ID-hub, ID-store..
#   --external HOST:PORT[,...]            no namespaces: drive gateways that already run on real
#                                         hosts (faults are not available there)
#   --print-commands                      print the command each node runs (for a real
#                                         multi-host deployment), then exit
# Node names: store (or etcd, store-0..), prefill-0.., decode-0.., gateway-0.., client, dup (the
# host of 'dup' processes). bench-serve gets --gateway, --model, --events and --start-file from here; everything
# after `--` is passed on. The events file also lists every node's addresses ('@node NAME
# GRPC,DATA'), which bench-serve's --fault-contract uses to tell which requests a node served.
# Exit: bench-serve's status (3 = wrong tokens, 4 = fault contract broken), 77 when network
# namespaces are unavailable.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
KVRELAY="$BIN/kvrelay"
ETCD_BIN=${KVRELAY_ETCD:-/usr/bin/etcd}
PREFILL=2 DECODE=2 GATEWAYS=1 STORES=1 THREADS=1 POOL_BLOCKS=1024 CACHE_SLOTS=4096 SSD_SLOTS=0
SPARE_PREFILL=0 SPARE_DECODE=0 FIXED_WORKERS=0 SAMPLE_EVERY=0 SETTLE=0
PREFILL_ARGS="" DECODE_ARGS="" GATEWAY_ARGS="" STORE_ARGS=""
MODEL="" ARCH=llama OUT="" SUBNET=10.77.0 EXTERNAL="" PRINT_ONLY=0 ID="kvr$$"
FAULTS=()
BENCH_ARGS=()

die() { echo "cluster: $*" >&2; exit 2; }
while (($#)); do
  case "$1" in
    --prefill) PREFILL=$2; shift 2 ;;
    --decode) DECODE=$2; shift 2 ;;
    --gateways) GATEWAYS=$2; shift 2 ;;
    --stores) STORES=$2; shift 2 ;;
    --spare-prefill) SPARE_PREFILL=$2; shift 2 ;;
    --spare-decode) SPARE_DECODE=$2; shift 2 ;;
    --fixed-workers) FIXED_WORKERS=1; shift ;;
    --model) MODEL=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --pool-blocks) POOL_BLOCKS=$2; shift 2 ;;
    --cache-slots) CACHE_SLOTS=$2; shift 2 ;;
    --ssd-slots) SSD_SLOTS=$2; shift 2 ;;
    --prefill-args) PREFILL_ARGS=$2; shift 2 ;;
    --decode-args) DECODE_ARGS=$2; shift 2 ;;
    --gateway-args) GATEWAY_ARGS=$2; shift 2 ;;
    --store-args) STORE_ARGS=$2; shift 2 ;;
    --fault) FAULTS+=("$2"); shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --sample-every) SAMPLE_EVERY=$2; shift 2 ;;
    --settle) SETTLE=$2; shift 2 ;;
    --subnet) SUBNET=$2; shift 2 ;;
    --name) ID=$2; shift 2 ;;
    --external) EXTERNAL=$2; shift 2 ;;
    --print-commands) PRINT_ONLY=1; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
for n in PREFILL DECODE GATEWAYS THREADS; do
  [[ ${!n} =~ ^[0-9]+$ ]] && ((${!n} >= 1 && ${!n} <= 16)) || die "--${n,,} must be 1-16, got '${!n}'"
done
[[ $STORES =~ ^[0-9]+$ ]] && ((STORES >= 1 && STORES <= 7)) || die "--stores must be 1-7, got '$STORES'"
((STORES == 1)) || [[ -x $ETCD_BIN ]] ||
  die "--stores $STORES needs etcd at $ETCD_BIN (Debian: apt-get install etcd-server)"
for n in SPARE_PREFILL SPARE_DECODE; do
  [[ ${!n} =~ ^[0-9]+$ ]] && ((${!n} <= 8)) || die "--${n,,} must be 0-8, got '${!n}'"
done
((FIXED_WORKERS == 0 || SPARE_PREFILL + SPARE_DECODE == 0)) ||
  die "spare workers are found by discovery: drop --fixed-workers"
[[ $SAMPLE_EVERY =~ ^[0-9]+$ ]] || die "--sample-every must be whole seconds, got '$SAMPLE_EVERY'"
[[ $SETTLE =~ ^[0-9]+$ ]] || die "--settle must be whole seconds, got '$SETTLE'"
[[ $SUBNET =~ ^10\.[0-9]+\.[0-9]+$ ]] || die "--subnet must be 10.A.B, got '$SUBNET'"
[[ $ID =~ ^[a-z][a-z0-9]{0,11}$ ]] || die "--name must be 1-12 lowercase letters/digits, got '$ID'"
[[ -x $KVRELAY ]] || die "no $KVRELAY; build it first (TARGETS=kvrelay scripts/build.sh)"
OUT=${OUT:-$(mktemp -d /tmp/kvrelay-cluster-XXXXXX)}
mkdir -p "$OUT/logs" "$OUT/pids"
OUT=$(cd "$OUT" && pwd)
# The gateway has no default tenant secret; a random one per cluster.
[[ -s $OUT/tenant-secret ]] || (umask 077 && head -c 32 /dev/urandom | base64 >"$OUT/tenant-secret")

# --- external mode: real hosts, nothing started here --------------------------------------------
if [[ -n $EXTERNAL ]]; then
  ((${#FAULTS[@]} == 0)) || die "--fault needs the namespace cluster (not --external)"
  set +e
  "$KVRELAY" bench-serve --gateway "$EXTERNAL" --json "$OUT/report.json" \
    --csv "$OUT/requests.csv" --plot "$OUT/plot.png" "${BENCH_ARGS[@]}"
  exit $?
fi

if [[ -z $MODEL ]]; then
  MODEL=$OUT/model
  [[ -f $MODEL/config.json ]] || "$KVRELAY" make-test-model --arch "$ARCH" --seed 5 --out "$MODEL" >/dev/null
fi
MODEL=$(cd "$MODEL" && pwd)
SSD_BYTES=0
if ((SSD_SLOTS > 0)); then
  # A disk slot is a 4 KiB header and the block (every layer group), 4 KiB aligned
  # (kv/disk/DiskTier).
  block_bytes=$("$KVRELAY" layout --config "$MODEL/config.json" --json |
    /usr/bin/python3 -c 'import json, sys; print(sum(g["block_bytes"] for g in json.load(sys.stdin)["groups"]))')
  SSD_BYTES=$((SSD_SLOTS * (4096 + (block_bytes + 4095) / 4096 * 4096)))
fi
ssd_args() {  # a worker's disk tier flags ($1: its node name)
  ((SSD_BYTES > 0)) || return 0
  mkdir -p "$OUT/ssd/$1"
  echo "--ssd-dir $OUT/ssd/$1 --ssd-bytes $SSD_BYTES"
}

# --- nodes: name -> address, command --------------------------------------------------------------
HUB="$ID-hub"
if ((STORES == 1)); then
  NODES=(store)
else
  NODES=(etcd)
  for ((i = 0; i < STORES; i++)); do NODES+=("store-$i"); done
fi
for ((i = 0; i < PREFILL + SPARE_PREFILL; i++)); do NODES+=("prefill-$i"); done
for ((i = 0; i < DECODE + SPARE_DECODE; i++)); do NODES+=("decode-$i"); done
for ((i = 0; i < GATEWAYS; i++)); do NODES+=("gateway-$i"); done
NODES+=(client dup)
declare -A SPARE
for ((i = PREFILL; i < PREFILL + SPARE_PREFILL; i++)); do SPARE[prefill-$i]=1; done
for ((i = DECODE; i < DECODE + SPARE_DECODE; i++)); do SPARE[decode-$i]=1; done
declare -A ADDR INDEX
for ((k = 0; k < ${#NODES[@]}; k++)); do
  ADDR[${NODES[k]}]="$SUBNET.$((k + 10))"
  INDEX[${NODES[k]}]=$k
done
store_names() {  # the cache store nodes: store, or store-0..store-N-1
  if ((STORES == 1)); then echo store; else local i; for ((i = 0; i < STORES; i++)); do echo "store-$i"; done; fi
}
store_list() { local n out=(); for n in $(store_names); do out+=("${ADDR[$n]}:7000"); done; local IFS=,; echo "${out[*]}"; }
STORE=$(store_list)  # what workers and gateways take as --cachestore (every replica)
ETCD_URL=""
((STORES == 1)) || ETCD_URL="http://${ADDR[etcd]}:2379"
prefill_list() { local i out=(); for ((i = 0; i < PREFILL; i++)); do out+=("${ADDR[prefill-$i]}:7100"); done; local IFS=,; echo "${out[*]}"; }
decode_list() { local i out=(); for ((i = 0; i < DECODE; i++)); do out+=("${ADDR[decode-$i]}:7200"); done; local IFS=,; echo "${out[*]}"; }
gateway_list() { local i out=(); for ((i = 0; i < GATEWAYS; i++)); do out+=("${ADDR[gateway-$i]}:8000"); done; local IFS=,; echo "${out[*]}"; }

# The kvrelay arguments of a node (also what --print-commands shows for a real deployment);
# `host` (default: the node's own address) runs it elsewhere under the same node id ('dup').
node_args() {
  local name=$1 a=${2:-${ADDR[$1]}}
  case "$name" in
    store) echo "cachestore --host $a --port 7000 --metrics-port 0 --data-dir $OUT/store-data" \
                "--insecure $STORE_ARGS" ;;
    store-*) echo "cachestore --host $a --port 7000 --metrics-port 0 --data-dir $OUT/$name" \
                  "--etcd $ETCD_URL --etcd-lease-ttl 2s --insecure $STORE_ARGS" ;;
    # etcd's own arguments (its binary is not kvrelay); a heartbeat and election as short as the
    # HA tests use (tests/cachestore/ha_cluster.h), so a lost etcd leader is noticed fast.
    etcd) echo "--name etcd --data-dir $OUT/etcd-data --listen-client-urls http://$a:2379" \
               "--advertise-client-urls http://$a:2379 --listen-peer-urls http://$a:2380" \
               "--initial-advertise-peer-urls http://$a:2380 --initial-cluster etcd=http://$a:2380" \
               "--heartbeat-interval 50 --election-timeout 300" ;;
    prefill-*) echo "prefill --host $a --port 7100 --metrics-port 0 --transport-host $a" \
                    "--transport-port 7300 --cachestore $STORE --model $MODEL --node-id $name" \
                    "--threads $THREADS --pool-blocks $POOL_BLOCKS --cache-slots $CACHE_SLOTS" \
                    "$(ssd_args "$name") --insecure $PREFILL_ARGS" ;;
    decode-*) echo "decode --host $a --port 7200 --metrics-port 0 --transport-host $a" \
                   "--transport-port 7300 --cachestore $STORE --model $MODEL --node-id $name" \
                   "--threads $THREADS --pool-blocks $POOL_BLOCKS --cache-slots $CACHE_SLOTS" \
                   "$(ssd_args "$name") --insecure $DECODE_ARGS" ;;
    gateway-*)
      if ((FIXED_WORKERS)); then
        echo "gateway --host $a --port 8000 --metrics-port 0 --cachestore $STORE" \
             "--prefill $(prefill_list) --decode $(decode_list) --model $MODEL" \
             "--tenant-secret-file $OUT/tenant-secret --insecure $GATEWAY_ARGS"
      else  # workers are discovered from the store's registry
        echo "gateway --host $a --port 8000 --metrics-port 0 --cachestore $STORE --model $MODEL" \
             "--tenant-secret-file $OUT/tenant-secret --insecure $GATEWAY_ARGS"
      fi ;;
  esac
}
node_binary() { if [[ $1 == etcd ]]; then echo "$ETCD_BIN"; else echo "$KVRELAY"; fi; }
node_addresses() {  # the addresses a gateway or an error may name the node by
  case "$1" in
    prefill-*) echo "${ADDR[$1]}:7100,${ADDR[$1]}:7300" ;;
    decode-*) echo "${ADDR[$1]}:7200,${ADDR[$1]}:7300" ;;
    store|store-*) echo "${ADDR[$1]}:7000" ;;
    etcd) echo "${ADDR[$1]}:2379" ;;
    gateway-*) echo "${ADDR[$1]}:8000" ;;
  esac
}

if ((PRINT_ONLY)); then
  for name in "${NODES[@]}"; do
    [[ $name == client || $name == dup ]] && continue
    if [[ $name == etcd ]]; then
      echo "# $name (${ADDR[$name]}): etcd $(node_args "$name")"
    else
      echo "# $name (${ADDR[$name]}): UCX_TLS=tcp kvrelay $(node_args "$name")"
    fi
  done
  echo "# client: kvrelay bench-serve --gateway $(gateway_list) --model $MODEL --insecure ${BENCH_ARGS[*]}"
  exit 0
fi

# --- namespaces and teardown -------------------------------------------------------------------
if ! err=$(ip netns add "$ID-probe" 2>&1); then
  echo "cluster: SKIP: cannot create network namespaces here ('ip netns add' failed: $err);" \
       "this needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN" >&2
  exit 77
fi
ip netns del "$ID-probe"

CREATED=()
HELPERS=()
CLEANED=0
cleanup() {
  local rc=$?
  ((CLEANED)) && return
  CLEANED=1
  trap - EXIT INT TERM
  local pid f
  for pid in "${HELPERS[@]}"; do
    pkill -TERM -P "$pid" 2>/dev/null || true
    kill -TERM "$pid" 2>/dev/null || true
  done
  for f in "$OUT"/pids/*; do
    [[ -f $f ]] || continue
    pid=$(cat "$f")
    kill -CONT "$pid" 2>/dev/null || true   # a stopped process cannot take SIGTERM
    kill -TERM "$pid" 2>/dev/null || true
  done
  local deadline=$((SECONDS + 10))
  for f in "$OUT"/pids/*; do
    [[ -f $f ]] || continue
    pid=$(cat "$f")
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  local ns
  for ns in "${CREATED[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
  done
  wait 2>/dev/null || true
  for ns in "${CREATED[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  echo "cluster: torn down (${#CREATED[@]} namespaces removed); logs in $OUT/logs" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$HUB"
CREATED+=("$HUB")
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" link set br0 up
ip -n "$HUB" link set lo up
for name in "${NODES[@]}"; do
  ns="$ID-$name"
  ip netns add "$ns"
  CREATED+=("$ns")
  k=${INDEX[$name]}
  # Both ends are created inside the namespaces: the root namespace never holds them.
  ip link add eth0 netns "$ns" type veth peer name "h$k" netns "$HUB"
  ip -n "$HUB" link set "h$k" master br0
  ip -n "$HUB" link set "h$k" up
  ip -n "$ns" addr add "${ADDR[$name]}/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done

start_node() {
  local name=$1
  # shellcheck disable=SC2046
  ip netns exec "$ID-$name" env UCX_TLS=tcp UCX_NET_DEVICES=eth0 \
    "$(node_binary "$name")" $(node_args "$name") >>"$OUT/logs/$name.log" 2>&1 &
  echo $! >"$OUT/pids/$name"
  disown "$!"  # killed by faults on purpose: no "Killed" job notices; teardown uses the pid files
}
# A second process with `target`'s node id, on the 'dup' host. Prints "refused" when it exits
# non-zero naming ALREADY_EXISTS within 30 s, else "accepted" (and stops it).
start_duplicate() {
  local target=$1 log="$OUT/logs/dup-$1.log" pid deadline
  # shellcheck disable=SC2046
  ip netns exec "$ID-dup" env UCX_TLS=tcp UCX_NET_DEVICES=eth0 \
    "$KVRELAY" $(node_args "$target" "${ADDR[dup]}") >>"$log" 2>&1 &
  pid=$!
  echo "$pid" >"$OUT/pids/dup-$target"
  deadline=$((SECONDS + 30))
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo accepted
  elif ! wait "$pid" && grep -q ALREADY_EXISTS "$log"; then
    echo refused
  else
    echo accepted
  fi
}
node_pid() { cat "$OUT/pids/$1"; }

log_count() {  # how many lines of node $1's log contain $2
  local n
  n=$(grep -c -- "$2" "$OUT/logs/$1.log" 2>/dev/null) || true
  echo "${n:-0}"
}
listen_count() {  # how many times a node's log says it listens (once per start)
  if [[ $1 == etcd ]]; then log_count etcd "ready to serve client requests"; else log_count "$1" "listening on"; fi
}
# How many times an HA store replica's log says it took its part: it leads, or it follows the
# leader with a complete snapshot.
replica_count() { echo $(($(log_count "$1" "leads with term") + $(log_count "$1" "cachestore: following .* (term "))); }
# Waits up to `timeout` s until replica $1 took its part more than `seen` times.
wait_replica() {
  local name=$1 timeout=$2 seen=$3 deadline
  deadline=$((SECONDS + timeout))
  while (($(replica_count "$name") <= seen)); do
    ((SECONDS < deadline)) || { echo "cluster: $name neither leads nor follows after ${timeout}s" >&2; return 1; }
    sleep 0.1
  done
}
wait_listening() {
  local name=$1 timeout=${2:-60} seen=${3:-1} deadline
  deadline=$((SECONDS + timeout))
  while (($(listen_count "$name") < seen)); do
    if ! kill -0 "$(node_pid "$name")" 2>/dev/null; then
      echo "cluster: $name exited before it listened:" >&2
      tail -20 "$OUT/logs/$name.log" >&2
      return 1
    fi
    ((SECONDS < deadline)) || { echo "cluster: $name not listening after ${timeout}s" >&2; return 1; }
    sleep 0.2
  done
}

echo "cluster: ${#NODES[@]} namespaces ($ID-*), store $STORE${ETCD_URL:+ (etcd $ETCD_URL)}," \
     "prefill $(prefill_list), decode $(decode_list), gateway $(gateway_list); logs in $OUT/logs" >&2
if ((STORES > 1)); then
  start_node etcd
  wait_listening etcd
fi
for name in $(store_names); do start_node "$name"; done
for name in $(store_names); do wait_listening "$name"; done
if ((STORES > 1)); then  # one replica leads before the workers register
  deadline=$((SECONDS + 30))
  until grep -q "leads with term" "$OUT"/logs/store-*.log; do
    ((SECONDS < deadline)) || die "no store replica leads after 30 s (logs in $OUT/logs)"
    sleep 0.1
  done
fi
is_worker() { [[ ($1 == prefill-* || $1 == decode-*) && -z ${SPARE[$1]:-} ]]; }
for name in "${NODES[@]}"; do
  if is_worker "$name"; then start_node "$name"; fi
done
for name in "${NODES[@]}"; do
  if is_worker "$name"; then wait_listening "$name"; fi
done
for ((i = 0; i < GATEWAYS; i++)); do start_node "gateway-$i"; done
for ((i = 0; i < GATEWAYS; i++)); do wait_listening "gateway-$i"; done

# --- faults ------------------------------------------------------------------------------------
EVENTS=$OUT/events.txt
START_FILE=$OUT/start.txt
: >"$EVENTS"
for name in "${NODES[@]}"; do
  [[ $name == client || $name == dup ]] || echo "@node $name $(node_addresses "$name")" >>"$EVENTS"
done
rm -f "$START_FILE"
now() { date +%s.%N; }
seconds() {  # "20s" / "20" / "1.5s" -> 20 / 1.5
  [[ $1 =~ ^([0-9]+(\.[0-9]+)?)s?$ ]] || return 1
  echo "${BASH_REMATCH[1]}"
}
fault_error() { echo "cluster: --fault '$1': $2" >&2; exit 2; }
check_fault() {
  local spec=$1 at action target rest
  read -r at action target rest <<<"$spec"
  [[ $at == at=* ]] && seconds "${at#at=}" >/dev/null || fault_error "$spec" "want 'at=<seconds>s ...'"
  if [[ $action == rollout ]]; then
    [[ -z $rest && ${target:-workers} =~ ^(prefill|decode|workers|stores|gateways|all)$ ]] ||
      fault_error "$spec" "want 'rollout [prefill|decode|workers|stores|gateways|all]'"
    return 0
  fi
  if [[ $action == status ]]; then
    [[ -z $target ]] || fault_error "$spec" "'status' takes nothing more"
    return 0
  fi
  if [[ $target == leader ]]; then  # the HA store replica that leads when the fault strikes
    ((STORES > 1)) || fault_error "$spec" "'leader' needs --stores 2 or more"
    [[ $action =~ ^(stop|cut|kill|restart|drain)$ ]] ||
      fault_error "$spec" "'leader' takes stop, cut, kill, restart or drain"
    [[ $action != kill || -n $rest ]] || fault_error "$spec" "want 'kill leader for <seconds>s'"
    [[ $action != stop && $action != cut ]] || [[ $rest =~ ^for\ ([0-9.]+s?)$ ]] ||
      fault_error "$spec" "want '$action leader for <seconds>s'"
    return 0
  fi
  [[ -n ${ADDR[$target]:-} && $target != client && $target != dup ]] ||
    fault_error "$spec" "unknown node '$target'"
  case "$action" in
    drain) [[ -z $rest && $target != etcd ]] ||
             fault_error "$spec" "'drain NODE' takes a worker, a store or a gateway" ;;
    retire) [[ -z $rest && ($target == prefill-* || $target == decode-*) ]] ||
              fault_error "$spec" "'retire NODE' takes a worker" ;;
    restart) [[ -z $rest ]] || fault_error "$spec" "'$action NODE' takes nothing more" ;;
    kill) [[ -z $rest || ($rest =~ ^for\ ([0-9.]+s?)$ && -n $(seconds "${BASH_REMATCH[1]}")) ]] ||
            fault_error "$spec" "want 'kill NODE' or 'kill NODE for <seconds>s'" ;;
    add) [[ -z $rest && -n ${SPARE[$target]:-} ]] ||
           fault_error "$spec" "'add NODE' takes a spare worker (--spare-prefill/--spare-decode)" ;;
    dup) [[ -z $rest && ($target == prefill-* || $target == decode-*) ]] ||
           fault_error "$spec" "'dup NODE' takes a worker" ;;
    stop|cut) [[ $rest =~ ^for\ ([0-9.]+s?)$ ]] && seconds "${BASH_REMATCH[1]}" >/dev/null ||
                fault_error "$spec" "want '$action NODE for <seconds>s'" ;;
    shape) [[ $rest =~ ^[0-9]+(kbit|mbit|gbit)$ ]] || fault_error "$spec" "want 'shape NODE 200mbit'" ;;
    *) fault_error "$spec" "unknown action '$action' (kill, stop, cut, shape, restart, add, dup," \
                   "drain, retire, rollout, status)" ;;
  esac
}
for spec in "${FAULTS[@]}"; do check_fault "$spec"; done

# SIGTERM, wait for the exit (the node's --drain-timeout bounds it; SIGKILL after 60 s), then
# (unless $2 is 'retire') start it again under the same node id and wait until it listens and
# gateways can have discovered it (one discovery interval; an HA store replica: until it leads or
# follows the leader again). Appends 'NODE SECONDS drained|killed' to drains.txt and the event
# ('drain NODE' or 'retire NODE').
drain_node() {
  local target=$1 action=${2:-drain} seen drained pid t0 t1 how=drained deadline replica=0
  seen=$(listen_count "$target")
  [[ $target != store-* ]] || replica=$(replica_count "$target")
  drained=$(grep -c ": drained" "$OUT/logs/$target.log" 2>/dev/null) || true
  pid=$(node_pid "$target")
  t0=$(now)
  kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + 60))
  while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.02; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    how=killed
  fi
  t1=$(now)
  (($(grep -c ": drained" "$OUT/logs/$target.log" 2>/dev/null || true) > ${drained:-0})) ||
    how=killed
  echo "$target $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }') $how" >>"$OUT/drains.txt"
  if [[ $action == retire ]]; then
    echo "$t0 $t1 retire $target" >>"$EVENTS"
    return 0
  fi
  # Back from the new process's start (its start-up counts against serve-again): a gateway
  # gives a newly registered worker its next request, and prefix routing may send it nothing
  # more at a light load, so that first request must count.
  local back
  back=$(now)
  start_node "$target"
  wait_listening "$target" 60 $((seen + 1)) || true
  # A replica that neither leads nor follows yet would leave the next drain one standby short.
  [[ $target != store-* ]] || wait_replica "$target" 30 "$replica" || true
  echo "$t0 $back drain $target" >>"$EVENTS"
  sleep 1.5  # the gateways' discovery interval (1 s) and a margin before the next drain
}
running_nodes() {  # the nodes of kind $1 (prefill, decode, workers, stores, gateways) that run now
  local name
  for name in "${NODES[@]}"; do
    case "$1" in
      workers) [[ $name == prefill-* || $name == decode-* ]] || continue ;;
      stores) [[ $name == store || $name == store-* ]] || continue ;;
      gateways) [[ $name == gateway-* ]] || continue ;;
      *) [[ $name == "$1"-* ]] || continue ;;
    esac
    [[ -f $OUT/pids/$name ]] && kill -0 "$(node_pid "$name")" 2>/dev/null && echo "$name"
  done
  return 0
}
# The HA store replica whose log last said it leads (after its last "following" line, if any).
store_leader() {
  local name best="" last_lead last_follow
  for name in $(store_names); do
    last_lead=$(grep -n "leads with term" "$OUT/logs/$name.log" 2>/dev/null | tail -1 | cut -d: -f1)
    last_follow=$(grep -n "cachestore: following \|stepped down" "$OUT/logs/$name.log" 2>/dev/null |
                  tail -1 | cut -d: -f1)
    [[ -n $last_lead ]] && ((last_lead > ${last_follow:-0})) || continue
    best=$name
  done
  echo "$best"
}
# `kvrelay status` from the client host: what an operator sees; saved and printed.
cluster_status() {
  local file="$OUT/status-$1s.txt"
  ip netns exec "$ID-client" "$KVRELAY" status --gateway "$(gateway_list)" --insecure >"$file" 2>&1 ||
    echo "(kvrelay status exited $?)" >>"$file"
  { echo "cluster: status at $1s:"; cat "$file"; } >&2
}

run_fault() {  # $2 = now: at once, before the load starts
  local spec=$1 at action target rest t0 when d start ns=""
  read -r at action target rest <<<"$spec"
  at=$(seconds "${at#at=}")
  if [[ ${2:-} != now ]]; then
    while [[ ! -s $START_FILE ]]; do sleep 0.1; done
    t0=$(cat "$START_FILE")
    when=$(awk -v a="$t0" -v b="$at" -v n="$(now)" 'BEGIN { d = a + b - n; print (d > 0 ? d : 0) }')
    sleep "$when"
  fi
  start=$(now)
  if [[ $target == leader ]]; then
    target=$(store_leader)
    [[ -n $target ]] || { echo "cluster: fault at ${at}s: no store replica leads" >&2; return 0; }
  fi
  case "$action" in
    kill)
      local seen
      seen=$(listen_count "$target")
      kill -KILL "$(node_pid "$target")" 2>/dev/null || true
      if [[ -z $rest ]]; then
        echo "$start $start kill $target" >>"$EVENTS"
      else  # kill NODE for D: the host comes back after D with a new process (a new incarnation)
        d=$(seconds "${rest#for }")
        sleep "$d"
        start_node "$target"
        wait_listening "$target" 60 $((seen + 1)) || true
        echo "$start $(now) kill $target for ${d}s" >>"$EVENTS"
      fi ;;
    add)
      start_node "$target"
      wait_listening "$target" 60 || true
      echo "$(now) $(now) add $target" >>"$EVENTS" ;;
    dup)
      echo "$start $(now) dup $target $(start_duplicate "$target")" >>"$EVENTS" ;;
    stop)
      d=$(seconds "${rest#for }")
      echo "$start $(awk -v a="$start" -v b="$d" 'BEGIN{printf "%.3f", a + b}') stop $target for ${d}s" >>"$EVENTS"
      kill -STOP "$(node_pid "$target")"
      sleep "$d"
      kill -CONT "$(node_pid "$target")" ;;
    cut)
      d=$(seconds "${rest#for }")
      echo "$start $(awk -v a="$start" -v b="$d" 'BEGIN{printf "%.3f", a + b}') cut $target for ${d}s" >>"$EVENTS"
      ip -n "$HUB" link set "h${INDEX[$target]}" down
      sleep "$d"
      ip -n "$HUB" link set "h${INDEX[$target]}" up ;;
    shape)
      # Token bucket on both ends of the node's link: its sends and its receives are limited.
      tc -n "$ID-$target" qdisc replace dev eth0 root tbf rate "$rest" burst 64kb latency 100ms
      tc -n "$HUB" qdisc replace dev "h${INDEX[$target]}" root tbf rate "$rest" burst 64kb latency 100ms
      echo "$start - shape $target $rest" >>"$EVENTS" ;;
    drain|retire) drain_node "$target" "$action" ;;
    rollout)
      local name kind kinds=${target:-workers}
      [[ $kinds != all ]] || kinds="stores workers gateways"
      for kind in $kinds; do
        for name in $(running_nodes "$kind"); do drain_node "$name"; done
      done
      echo "$start $(now) rollout ${target:-workers}" >>"$EVENTS" ;;
    status) cluster_status "$at" ;;
    restart)
      local seen
      seen=$(listen_count "$target")
      kill -KILL "$(node_pid "$target")" 2>/dev/null || true
      while kill -0 "$(node_pid "$target")" 2>/dev/null; do sleep 0.05; done
      start_node "$target"
      wait_listening "$target" 60 $((seen + 1)) || true
      echo "$start $(now) restart $target" >>"$EVENTS" ;;
  esac
  echo "cluster: fault at ${at}s: $action $target${rest:+ $rest}" >&2
}
for spec in "${FAULTS[@]}"; do
  read -r fault_at fault_action _ <<<"$spec"
  if [[ $fault_action == shape && $(seconds "${fault_at#at=}") =~ ^0(\.0*)?$ ]]; then
    # A link slow from the start: shaped before the first request, not up to 0.1 s into the
    # load (the fault threads poll for the start), when a request may already have used it.
    run_fault "$spec" now
    continue
  fi
  run_fault "$spec" &
  HELPERS+=($!)
done

# --- samples: memory, descriptors and load gauges of every node ------------------------------------
metrics_address() {  # HOST:PORT of node $1's /metrics, from its latest "listening on" line
  grep -o "listening on [^ ]* metrics [^ ]*" "$OUT/logs/$1.log" 2>/dev/null | tail -1 | cut -d' ' -f5
}
scrape_metrics() {  # node $1's /metrics text (empty when it does not answer within 2 s)
  local addr
  addr=$(metrics_address "$1")
  [[ -n $addr ]] || return 0
  ip netns exec "$ID-client" curl -s --max-time 2 "http://$addr/metrics" 2>/dev/null || true
}
SAMPLES=$OUT/samples.csv
sample_nodes() {  # one row per running node, t = $1
  local name pid rss fds gauges
  for name in "${NODES[@]}"; do
    [[ -f $OUT/pids/$name && $name != client && $name != dup ]] || continue
    pid=$(node_pid "$name")
    rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null) || true
    [[ -n $rss ]] || continue  # not running (killed, not yet restarted)
    fds=$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
    # utime + stime (fields 14, 15 after the parenthesised name) in clock ticks
    cpu=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null |
          awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($12 + $13) / hz }') || true
    gauges=$(scrape_metrics "$name" | awk '
      function add(k, v) { sum[k] += v; seen[k] = 1 }
      /^kvrelay:num_requests_running[{ ]/ { add("running", $NF) }
      /^kvrelay:num_requests_waiting[{ ]/ { add("waiting", $NF) }
      /^kvrelay:kv_cache_usage_perc[{ ]/ { add("kv_usage", $NF) }
      /^kvrelay:decode_reservation_memory_regions[{ ]/ { add("regions", $NF) }
      /^kvrelay:cachestore_active_leases[{ ]/ { add("leases", $NF) }
      /^kvrelay:gateway_requests_in_flight[{ ]/ { add("in_flight", $NF) }
      /^kvrelay:cachestore_index_bytes[{ ]/ { add("index_bytes", $NF) }
      /^kvrelay:cachestore_retained_events[{ ]/ { add("events", $NF) }
      /^kvrelay:cachestore_kept_token_blocks[{ ]/ { add("token_blocks", $NF) }
      END { n = split("running waiting kv_usage regions leases in_flight index_bytes events token_blocks", k, " ")
            for (i = 1; i <= n; i++) printf "%s%s", (i > 1 ? "," : ""), (seen[k[i]] ? sum[k[i]] : "")
            print "" }')
    echo "$1,$name,$pid,$rss,$fds,$cpu,$gauges" >>"$SAMPLES"
  done
}
if ((SAMPLE_EVERY > 0 || SETTLE > 0)); then
  echo "t,node,pid,rss_kb,fds,cpu_s,running,waiting,kv_usage,regions,leases,in_flight,index_bytes,events,token_blocks" >"$SAMPLES"
fi
if ((SAMPLE_EVERY > 0)); then
  (
    while [[ ! -s $START_FILE ]]; do sleep 0.2; done
    t0=$(cat "$START_FILE")
    while :; do
      sample_nodes "$(awk -v a="$t0" -v n="$(now)" 'BEGIN { printf "%.0f", n - a }')"
      sleep "$SAMPLE_EVERY"
    done
  ) &
  HELPERS+=($!)
fi

# --- the load ----------------------------------------------------------------------------------
set +e
ip netns exec "$ID-client" "$KVRELAY" bench-serve --gateway "$(gateway_list)" --model "$MODEL" \
  --insecure --wait-ready 60s --start-file "$START_FILE" --events "$EVENTS" --json "$OUT/report.json" \
  --csv "$OUT/requests.csv" --plot "$OUT/plot.png" "${BENCH_ARGS[@]}"
rc=$?
set -e
if ((SETTLE > 0)); then
  echo "cluster: load done; settling ${SETTLE}s before the last sample" >&2
  sleep "$SETTLE"
  sample_nodes final
  mkdir -p "$OUT/metrics" "$OUT/fds"
  for name in "${NODES[@]}"; do
    [[ -f $OUT/pids/$name && $name != client && $name != dup && $name != etcd ]] || continue
    scrape_metrics "$name" >"$OUT/metrics/$name.prom"
    # What each descriptor is, and the node's TCP connections: where a descriptor count grew.
    { ls -l "/proc/$(node_pid "$name")/fd" 2>&1; echo
      ip netns exec "$ID-$name" ss -tanp 2>&1; } >"$OUT/fds/$name.txt" || true
  done
fi
echo "cluster: report $OUT/report.json, per request $OUT/requests.csv, plot $OUT/plot.png" >&2
exit "$rc"
