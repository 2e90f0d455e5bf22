# Shared by the multinode tests (source it): a work dir removed on exit unless kept, a tiny
# llama model, and `run_cluster NAME WHAT ARGS...`, which runs scripts/cluster/run.sh with
# ARGS (logs and report under $WORK/run), exits 77 when namespaces are unavailable, fails the
# test when bench-serve failed (WHAT says what its non-zero exits mean) or a namespace is left.
ROOT=${KVRELAY_SOURCE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
export KVRELAY_BIN_DIR=${KVRELAY_BIN_DIR:-$ROOT/build/bin}
WORK=$(mktemp -d /tmp/kvrelay-multinode-test-XXXXXX)
KEEP=${KVRELAY_KEEP_TEST_DIR:-0}
trap '((KEEP)) || rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

MODEL=$WORK/model
"$KVRELAY_BIN_DIR/kvrelay" make-test-model --arch llama --seed 5 --out "$MODEL" >/dev/null

run_cluster() {
  local name=$1 what=$2 rc
  shift 2
  set +e
  "$ROOT/scripts/cluster/run.sh" --name "$name" --model "$MODEL" --out "$WORK/run" "$@" \
    >"$WORK/out.txt" 2>"$WORK/err.txt"
  rc=$?
  set -e
  if ((rc == 77)); then
    cat "$WORK/err.txt" >&2
    echo "SKIP: network namespaces are not available here"
    exit 77
  fi
  cat "$WORK/out.txt"
  if ((rc != 0)); then
    tail -30 "$WORK/err.txt" >&2
    KEEP=1
    fail "bench-serve exited $rc ($what); logs in $WORK/run/logs"
  fi
  local leftover
  leftover=$(ip netns list 2>/dev/null | grep -E "^$name-" || true)
  [[ -z $leftover ]] || fail "namespaces left: $leftover"
}
