#!/usr/bin/env bash
# Puts etcd v3's gRPC protos (rpc.proto, kv.proto, auth.proto of etcd 3.4, the version Debian 12
# ships as etcd-server) into DIR, as `etcd/<path>.proto`, ready for protoc: taken from Debian's
# golang-etcd-server-dev package (downloaded and unpacked, not installed: installing it would pull
# ~150 Go packages), with the gogoproto and google.api.http options stripped (they only steer Go
# code generation and the HTTP gateway). Idempotent: does nothing when DIR already has them.
# Usage: scripts/etcd_protos.sh DIR
set -euo pipefail
out=${1:?usage: scripts/etcd_protos.sh DIR}
want=(etcd/etcdserver/etcdserverpb/rpc.proto etcd/mvcc/mvccpb/kv.proto etcd/auth/authpb/auth.proto)
have=1
for f in "${want[@]}"; do [[ -s $out/$f ]] || have=0; done
((have)) && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 0777 "$work"  # apt downloads as the _apt user
(cd "$work" && apt-get download golang-etcd-server-dev >/dev/null) || {
  echo "etcd_protos.sh: 'apt-get download golang-etcd-server-dev' failed (run apt-get update?)" >&2
  exit 1
}
dpkg-deb -x "$work"/golang-etcd-server-dev_*.deb "$work/x"
src="$work/x/usr/share/gocode/src/go.etcd.io/etcd"
mkdir -p "$out"
for f in "${want[@]}"; do
  mkdir -p "$out/$(dirname "$f")"
  /usr/bin/python3 - "$src/${f#etcd/}" "$out/$f" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
text = re.sub(r'^import "(gogoproto/gogo|google/api/annotations)\.proto";\n', "", text, flags=re.M)
text = re.sub(r'^option \(gogoproto\.[a-z_]+\) = [a-z]+;\n', "", text, flags=re.M)
# HTTP gateway options, some with nested `additional_bindings { ... }`: drop through the brace that
# closes the option.
while (m := re.search(r'\s*option \(google\.api\.http\) = \{', text)):
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    text = text[:m.start()] + text[i:].removeprefix(";")
# Field options such as [(gogoproto.nullable) = false] or [(gogoproto.customname) = "ID"].
text = re.sub(r'\s*\[\s*\(gogoproto\.[a-z_]+\)\s*=\s*[^\]]*\]', "", text)
text = re.sub(r'^\s*option \(gogoproto\.[a-z_]+\) = [a-z]+;\n', "", text, flags=re.M)
if "gogoproto" in text or "google.api" in text:
    sys.exit(f"etcd_protos.sh: {sys.argv[1]} still names gogoproto or google.api after stripping")
open(sys.argv[2], "w").write(text)
PY
done
echo "etcd_protos.sh: etcd protos in $out" >&2
