#!/usr/bin/env bash
# The README's main command: installs what is missing, builds, and runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build} TARGETS=kvrelay scripts/build.sh
BIN=${BUILD_DIR:-build}/bin
echo "== KV-cache bytes per model (kvrelay layout --seed-table)"
"$BIN/kvrelay" layout --seed-table

# == Disaggregated serving on this machine ==================================================
# For a GQA model (llama) and an MLA model (deepseek_v3), both tiny random-weight models
# generated here: `kvrelay up` starts a cache store, one prefill worker, two decode workers
# and a gateway on loopback; then a scripted workload runs against the gateway with
# `kvrelay generate --json`: a cold request, a second request sharing ~90% of its prefix,
# then 8 concurrent requests. Everything is bounded in time and stopped on exit.
KVRELAY="$BIN/kvrelay"
STEP_TIMEOUT=${DEMO_STEP_TIMEOUT:-60}  # seconds for each start-up and each request
# The KV cache's dtype: auto (the model's, bf16) or e.g. fp8_e4m3 (half the bytes per token).
KV_DTYPE=${DEMO_KV_CACHE_DTYPE:-auto}
WORK=$(mktemp -d /tmp/kvrelay-demo-XXXXXX)
UP_PID=""
cleanup() {
  if [[ -n "$UP_PID" ]] && kill -0 "$UP_PID" 2>/dev/null; then
    kill -TERM "$UP_PID" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$UP_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$UP_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# A ~300-byte "system prompt" every request shares (byte-level tokenizer: one token per byte).
SYSTEM="You are kvrelay's demo assistant. Answer briefly and precisely. The cluster moves KV-cache blocks from a prefill worker to a decode worker over UCX, layer by layer, and a cache store remembers where every block lives so that a later request sharing the prefix reuses it instead of computing it again. "

generate() {  # generate OUT_JSON PROMPT (as tenant "demo", with the client certificate)
  # shellcheck disable=SC2086
  timeout "$STEP_TIMEOUT" "$KVRELAY" generate --gateway "$GATEWAY" --prompt "$2" \
    --max-tokens 12 --json --timeout "${STEP_TIMEOUT}s" $CLIENT_TLS >"$1"
}

report() {  # report LAYOUT_JSON BLOCK_TOKENS LABEL:FILE...
  python3 - "$@" <<'PY'
import json, sys
layout = json.load(open(sys.argv[1]))
bpt = layout["bytes_per_token"]
block = layout["block_tokens"]
print(f"layout: KV {layout['kv_dtype']}, {bpt} bytes per token, {block}-token blocks")
print(f"{'request':<14}{'prompt':>7}{'cached':>8}{'computed':>9}{'TTFT ms':>9}"
      f"{'KV moved':>11}{'B/pushed tok':>13}{'layout B/tok':>13}  generated tokens")
for arg in sys.argv[2:]:
    label, path = arg.split(":", 1)
    r = json.load(open(path))
    # Full blocks are pushed, except that the decode worker always computes the last prompt
    # token itself (its logits give the first token): floor((n - 1) / block) blocks.
    pushed = ((r["prompt_tokens"] - 1) // block) * block
    per_tok = f"{r['transferred_bytes'] / pushed:.0f}" if pushed else "-"
    print(f"{label:<14}{r['prompt_tokens']:>7}{r['prefix_hit_tokens']:>8}"
          f"{r['computed_prompt_tokens']:>9}{r['ttft_ms']:>9.1f}{r['transferred_bytes']:>11}"
          f"{per_tok:>13}{bpt:>13}  {r['tokens']}")
PY
}

run_cluster() {  # run_cluster ARCH
  local arch=$1 dir="$WORK/$1"
  mkdir -p "$dir"
  echo
  echo "== $arch: kvrelay up --model $dir/model --prefill 1 --decode 2 --kv-cache-dtype $KV_DTYPE"
  "$KVRELAY" make-test-model --arch "$arch" --seed 7 --out "$dir/model" >/dev/null
  "$KVRELAY" layout --config "$dir/model/config.json" --kv-dtype "$KV_DTYPE" --json \
    >"$dir/layout.json"
  # Mutual TLS on: `up` makes a throwaway CA and certificates under $dir/data/tls.
  "$KVRELAY" up --model "$dir/model" --prefill 1 --decode 2 --gateway-address 127.0.0.1:0 \
    --data-dir "$dir/data" --tenant demo --kv-cache-dtype "$KV_DTYPE" >"$dir/up.log" 2>&1 &
  UP_PID=$!
  GATEWAY=""
  for _ in $(seq 1 $((STEP_TIMEOUT * 10))); do
    GATEWAY=$(sed -n 's/^kvrelay up: ready; gateway \([^ ]*\).*/\1/p' "$dir/up.log")
    [[ -n "$GATEWAY" ]] && break
    if ! kill -0 "$UP_PID" 2>/dev/null; then break; fi
    sleep 0.1
  done
  if [[ -z "$GATEWAY" ]]; then
    echo "demo: the $arch cluster did not start; its log:" >&2
    tail -n 40 "$dir/up.log" >&2
    exit 1
  fi
  sed -n '/^kvrelay up: model /p; /^kvrelay up: endpoints/,/^kvrelay up: ready/p' "$dir/up.log"
  CLIENT_TLS=$(sed -n 's/^kvrelay up: mutual TLS; client flags \(--tls-cert [^ ]* --tls-key [^ ]* --tls-ca [^ ]*\).*/\1/p' "$dir/up.log")
  if [[ -z "$CLIENT_TLS" ]]; then
    echo "demo: kvrelay up printed no client certificate" >&2
    exit 1
  fi

  # The second request shares the system prompt and "Question: " (~90% of its bytes).
  local cold="$SYSTEM Question: what does the cache store do with cold blocks?"
  local warm="$SYSTEM Question: how is a block verified?"
  generate "$dir/cold.json" "$cold"
  generate "$dir/warm.json" "$warm"
  local pids=()
  for i in $(seq 1 8); do
    generate "$dir/c$i.json" "$SYSTEM Question $i: how many bytes per token does layer $i move?" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  local args=("cold:$dir/cold.json" "90% shared:$dir/warm.json")
  for i in $(seq 1 8); do args+=("concurrent $i:$dir/c$i.json"); done
  report "$dir/layout.json" "${args[@]}"
  python3 - "$dir/cold.json" "$dir/warm.json" <<'PY'
import json, sys
cold, warm = (json.load(open(p)) for p in sys.argv[1:3])
share = 100.0 * warm["prefix_hit_tokens"] / warm["prompt_tokens"]
print(f"second request: {warm['prefix_hit_tokens']} of {warm['prompt_tokens']} prompt tokens "
      f"({share:.0f}%) came from the cache; TTFT {cold['ttft_ms']:.1f} ms cold -> "
      f"{warm['ttft_ms']:.1f} ms warm")
PY
  # What an operator runs first: the cluster as the gateway and the store see it (the admin
  # certificate `up` issued).
  local status_cmd
  status_cmd=$(sed -n 's/^kvrelay up: status: kvrelay status //p' "$dir/up.log")
  echo "-- kvrelay status --gateway $GATEWAY (admin certificate)"
  # shellcheck disable=SC2086
  timeout "$STEP_TIMEOUT" "$KVRELAY" status $status_cmd

  kill -TERM "$UP_PID"
  local code=0
  wait "$UP_PID" || code=$?
  UP_PID=""
  tail -n 1 "$dir/up.log"
  if [[ $code -ne 0 ]]; then
    echo "demo: kvrelay up exited with $code; its log:" >&2
    tail -n 40 "$dir/up.log" >&2
    exit 1
  fi
}

run_cluster llama        # GQA
run_cluster deepseek_v3  # MLA
echo
echo "demo: done"
