#!/usr/bin/env bash
# The image's HEALTHCHECK, run for real: starts a cache store on loopback, runs the exact command
# deploy/docker/Dockerfile's HEALTHCHECK runs (kvrelay health against $KVRELAY_HEALTH_ADDRESS)
# and expects exit 0 while it serves, 1 once it is gone, 2 on a malformed address.
# Usage: deploy/ci/health_command_test.sh build/bin/kvrelay
set -euo pipefail
kvrelay=$(realpath "${1:?usage: health_command_test.sh KVRELAY}")
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
store_pid=""
cleanup() {
  if [[ -n $store_pid ]]; then kill "$store_pid" 2>/dev/null || true; wait "$store_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# The HEALTHCHECK's CMD array, as Docker would run it (a JSON array after CMD).
cmd_json=$(grep -A1 '^HEALTHCHECK' "$repo/deploy/docker/Dockerfile" | sed -n 's/^ *CMD \(\[.*\]\) *$/\1/p')
[[ -n $cmd_json ]] || fail "no HEALTHCHECK CMD [...] in deploy/docker/Dockerfile"
mapfile -t health_cmd < <(/usr/bin/python3 -c 'import json,sys; print("\n".join(json.loads(sys.argv[1])))' "$cmd_json")
mkdir -p "$work/bin" && ln -s "$kvrelay" "$work/bin/kvrelay"
# The store below is plain text, so the check runs with --insecure instead of the image's TLS
# flags (the same variable the image sets).
run_healthcheck() {
  PATH="$work/bin:$PATH" KVRELAY_HEALTH_ADDRESS="$1" KVRELAY_HEALTH_TLS=--insecure "${health_cmd[@]}"
}

"$kvrelay" cachestore --host 127.0.0.1 --port 0 --metrics-port 0 --insecure >"$work/store.out" 2>"$work/store.err" &
store_pid=$!
for _ in $(seq 100); do
  grep -q "listening on" "$work/store.out" 2>/dev/null && break
  kill -0 "$store_pid" 2>/dev/null || fail "cachestore exited: $(cat "$work/store.err")"
  sleep 0.1
done
address=$(sed -n 's/^cachestore listening on \([0-9.]*:[0-9]*\) .*/\1/p' "$work/store.out")
[[ -n $address ]] || fail "no listening line from the cache store"

out=$(run_healthcheck "$address") || fail "healthcheck against a serving store exited $?"
[[ $out == "$address SERVING" ]] || fail "unexpected output '$out'"
echo "serving store: exit 0 ($out)"

set +e
"$kvrelay" health --address not-an-address --insecure 2>"$work/usage.err"; rc=$?
set -e
[[ $rc == 2 ]] || fail "malformed address: exit $rc, want 2"
echo "malformed address: exit 2 ($(cat "$work/usage.err"))"

kill -TERM "$store_pid"
wait "$store_pid" || fail "cache store did not stop cleanly"
store_pid=""
set +e
run_healthcheck "$address" 2>"$work/gone.err"; rc=$?
set -e
[[ $rc == 1 ]] || fail "stopped store: exit $rc, want 1"
echo "stopped store: exit 1 ($(cat "$work/gone.err"))"
echo "health command: 3 passed, 0 failed"
