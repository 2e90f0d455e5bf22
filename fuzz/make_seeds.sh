#!/usr/bin/env bash
# Regenerates the committed seed corpora under fuzz/corpus/ (small valid and near-valid inputs
# for every target). Deterministic; needs protoc (protobuf-compiler), /usr/bin/python3 and a
# built `kvrelay` (for make-test-model): KVRELAY=build/bin/kvrelay fuzz/make_seeds.sh
# Crash inputs found later are added by hand as fuzz/corpus/<target>/regress-*; this script
# never deletes those.
set -euo pipefail
cd "$(dirname "$0")/.."
KVRELAY=${KVRELAY:-build/bin/kvrelay}
C=fuzz/corpus
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for t in hf_config_fuzzer safetensors_fuzzer wal_fuzzer control_frame_fuzzer \
         generate_request_fuzzer reserve_request_fuzzer cachestore_rpc_fuzzer; do
  mkdir -p "$C/$t"
  find "$C/$t" -type f ! -name 'regress-*' -delete
done

# --- HF configs and safetensors files of the test models (1 layer, tiny) ---------------------
for arch in llama deepseek_v3 gemma3 gpt2 mamba; do
  "$KVRELAY" make-test-model --arch "$arch" --out "$tmp/$arch" --layers 1 --hidden 16 \
    --intermediate 16 --heads 2 --vocab 8 --seed 1 >/dev/null 2>&1 ||
    "$KVRELAY" make-test-model --arch "$arch" --out "$tmp/$arch" --layers 1 --seed 1 >/dev/null
  cp "$tmp/$arch/config.json" "$C/hf_config_fuzzer/$arch.json"
  st=$(ls "$tmp/$arch"/*.safetensors | head -1)
  if [[ $(stat -c %s "$st") -le 16384 ]]; then cp "$st" "$C/safetensors_fuzzer/$arch.safetensors"; fi
done

PROTO="protoc -I proto"
enc() {  # enc <file.proto> <message> <text>  -> binary on stdout
  printf '%s' "$3" | $PROTO --encode="kvrelay.v1.$2" "proto/kvrelay/v1/$1"
}

# --- Generate requests -----------------------------------------------------------------------
G=$C/generate_request_fuzzer
enc gateway.proto GenerateRequest 'tokens: [1, 2, 3, 4] tenant: "alice" max_tokens: 8' >"$G/valid"
enc gateway.proto GenerateRequest 'tokens: [1, 2, 3] model: "llama3-8b" tenant: "t" max_tokens: 4
  sampling { temperature: 0.7 top_p: 0.9 seed: 5 } eos_token: 2 has_eos_token: true' >"$G/sampling"
enc gateway.proto GenerateRequest 'tokens: [-1] tenant: "t" max_tokens: 1' >"$G/negative-token"
enc gateway.proto GenerateRequest 'tokens: [1] tenant: "" max_tokens: 1' >"$G/no-tenant"
enc gateway.proto GenerateRequest 'tokens: [1] tenant: "t" max_tokens: 2147483647' >"$G/huge-max"
enc gateway.proto GenerateRequest 'tokens: [1] tenant: "t" max_tokens: 1
  sampling { temperature: nan }' >"$G/nan-temperature"
enc gateway.proto GenerateRequest 'tokens: [128255] model: "other" tenant: "t" max_tokens: 1' \
  >"$G/unknown-model"

# --- Reserve requests (first byte 1: the fuzzer stamps the right layout fingerprint) ---------
R=$C/reserve_request_fuzzer
rsv() { { printf '\001'; enc decode.proto ReserveRequest "$1"; } >"$R/$2"; }
rsv 'request_id: "r-1" model: "llama3-8b" prompt_tokens: 100 max_tokens: 8' valid
rsv 'request_id: "r-1" prompt_tokens: 32768 max_tokens: 4096' limits
rsv 'request_id: "bad id!" prompt_tokens: 1 max_tokens: 1' bad-id
rsv 'request_id: "r" prompt_tokens: 0 max_tokens: 1' zero-prompt
rsv 'request_id: "r" prompt_tokens: 1 max_tokens: -1' negative-max
{ printf '\000'; enc decode.proto ReserveRequest 'request_id: "r" prompt_tokens: 5 max_tokens: 5
  layout_fingerprint: "0123456789abcdef"'; } >"$R/wrong-layout"

# --- Cache store call sequences: u8 call | u16 LE length | protobuf ------------------------
call() {  # call <n> <message> <text>: one record on stdout
  local bin="$tmp/msg"
  enc cachestore.proto "$2" "$3" >"$bin"
  /usr/bin/python3 -c 'import sys,struct; d=open(sys.argv[2],"rb").read();
sys.stdout.buffer.write(bytes([int(sys.argv[1])])+struct.pack("<H",len(d))+d)' "$1" "$bin"
}
S=$C/cachestore_rpc_fuzzer
REG='node_id: "prefill-0" address { kind: "ucx" address: "127.0.0.1:7000" } ttl_ms: 10000
  incarnation: 7 role: NODE_ROLE_PREFILL grpc_address: "127.0.0.1:7001"
  segments { segment_id: "s0" tier: TIER_HOST capacity_slots: 64 slot_bytes: 4096 memory_key: "k" }'
H1='hi: 1 lo: 2'
H2='hi: 3 lo: 4'
{
  call 0 RegisterNodeRequest "$REG"
  call 5 AllocateRequest "blocks { hash { $H1 } size_bytes: 4096 }
    blocks { hash { $H2 } parent { $H1 } size_bytes: 4096 } node_id: \"prefill-0\" incarnation: 7"
  call 6 CommitRequest 'allocation_id: 1 node_id: "prefill-0" incarnation: 7'
  call 3 MatchPrefixRequest "chain { $H1 } chain { $H2 } lease_ttl_ms: 1000 node_id: \"prefill-0\"
    incarnation: 7"
  call 3 MatchPrefixRequest "chain { $H1 } columnar: true"
  call 8 ReleaseLeaseRequest 'lease_id: 1 node_id: "prefill-0" incarnation: 7'
  call 1 HeartbeatRequest 'node_id: "prefill-0" incarnation: 7 load { free_kv_blocks: 3 }'
  call 12 WatchEventsRequest 'from_sequence: 1'
  call 13 WatchEventsRequest ''
  call 12 WatchEventsRequest 'from_sequence: 1'
} >"$S/register-allocate-commit-match-watch"
{
  call 0 RegisterNodeRequest "$REG"
  call 5 AllocateRequest "blocks { hash { $H1 } size_bytes: 4096 } node_id: \"prefill-0\"
    incarnation: 7"
  call 7 AbortRequest 'allocation_id: 1'
  call 9 DeregisterNodeRequest 'node_id: "prefill-0" incarnation: 7'
  call 10 ListNodesRequest ''
  call 11 StatsRequest ''
} >"$S/abort-deregister"
# Issue 13.5: WatchEvents{from_sequence: 1} segfaulted the store (EventsSince read past its
# deque once sequence numbers and retained events diverged).
call 12 WatchEventsRequest 'from_sequence: 1' >"$S/regress-watch-events-from-1"
{
  call 0 RegisterNodeRequest "$REG"
  for i in $(seq 1 70); do
    call 5 AllocateRequest "blocks { hash { hi: $i lo: 9 } size_bytes: 4096 }
      node_id: \"prefill-0\" incarnation: 7"
    call 6 CommitRequest "allocation_id: $i node_id: \"prefill-0\" incarnation: 7"
  done
  call 12 WatchEventsRequest 'from_sequence: 1'
  call 12 WatchEventsRequest 'from_sequence: 18446744073709551615'
  call 13 WatchEventsRequest ''
} >"$S/regress-watch-events-past-retention"
{
  call 3 MatchPrefixRequest "chain { $H1 } chain_packed: \"0123456789abcdef\""
  call 3 MatchPrefixRequest 'chain_packed: "0000000000000000"'
  call 5 AllocateRequest 'replicas: 99 preferred_tier: TIER_SSD'
  call 0 RegisterNodeRequest 'node_id: "x" ttl_ms: 1 segments { capacity_slots: 9223372036854775807
    slot_bytes: 18446744073709551615 }'
} >"$S/near-valid"

# --- WAL records and logs, data-plane frames: python (XXH32 written out) ------------------
/usr/bin/python3 fuzz/make_seeds.py "$C"
echo "make_seeds.sh: $(find "$C" -type f | wc -l) seeds, $(du -sk "$C" | cut -f1) KiB"
