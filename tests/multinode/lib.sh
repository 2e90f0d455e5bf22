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

# `run_checking_script NAME WHAT OUT COMMAND...`: runs a script that judges a run itself
# (scripts/soak.sh, scripts/overload.sh) with namespaces named NAME-* and its files in OUT;
# exits 77 when it found no namespaces, fails the test on any other non-zero exit (OUT kept)
# or a namespace left behind.
run_checking_script() {
  local name=$1 what=$2 out=$3 rc leftover
  shift 3
  set +e
  "$@"
  rc=$?
  set -e
  ((rc != 77)) || exit 77
  if ((rc != 0)); then
    KEEP=1
    tail -20 "$out/cluster.txt" >&2
    fail "$what failed (exit $rc); files in $out"
  fi
  leftover=$(ip netns list 2>/dev/null | grep -E "^$name-" || true)
  [[ -z $leftover ]] || fail "namespaces left: $leftover"
}
