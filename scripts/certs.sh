#!/usr/bin/env bash
# A development CA and one certificate per kvrelay component, with openssl.
#
#   scripts/certs.sh OUT_DIR [ROLE/ID[@HOST,HOST...] ...]
#
# Writes OUT_DIR/ca.pem + ca.key (once; kept when present, so later calls add certificates) and
# for each ROLE/ID OUT_DIR/ROLE-ID.pem + .key: an ECDSA P-256 certificate carrying the identity
# URI spiffe://kvrelay/ROLE/ID (common/server/auth.h), valid for TLS server and client use and for
# the host names/addresses after @ (default localhost,127.0.0.1; 127.0.0.1 lets a pod's own
# `kvrelay health` probe verify it). ROLE is gateway, prefill, decode, store, client (ID = the
# tenant) or admin. Without ROLE/ID arguments: the set `kvrelay up --prefill 1 --decode 1` uses.
# Components take them as --tls-cert OUT/ROLE-ID.pem --tls-key OUT/ROLE-ID.key --tls-ca OUT/ca.pem.
#
# In Kubernetes, put each pod's pair and ca.pem in the Secret kvrelay-tls as tls.crt, tls.key
# and ca.crt (deploy/README.md); the worker's ID must equal its --node-id (pod name).
set -euo pipefail
out=${1:?usage: scripts/certs.sh OUT_DIR [ROLE/ID[@HOST,...] ...]}
shift
specs=("$@")
if ((${#specs[@]} == 0)); then
  specs=(store/cachestore prefill/prefill-0 decode/decode-0 gateway/gateway client/default admin/ops)
fi
days=${KVRELAY_CERT_DAYS:-30}
mkdir -p "$out"
chmod 700 "$out"
umask 077

if [[ ! -s $out/ca.pem || ! -s $out/ca.key ]]; then
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -sha256 \
    -days "$((days + 1))" -subj "/O=kvrelay/CN=kvrelay dev CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$out/ca.key" -out "$out/ca.pem" 2>/dev/null
  chmod 644 "$out/ca.pem"
  echo "certs.sh: CA $out/ca.pem"
fi

for spec in "${specs[@]}"; do
  identity=${spec%%@*}
  hosts=localhost,127.0.0.1
  [[ $spec == *@* ]] && hosts=${spec#*@}
  role=${identity%%/*}
  id=${identity#*/}
  case $role in
    gateway | prefill | decode | store | client | admin) ;;
    *) echo "certs.sh: unknown role '$role' in '$spec'" >&2; exit 2 ;;
  esac
  if [[ -z $id || $id == "$identity" || ! $id =~ ^[A-Za-z0-9._:-]{1,128}$ ]]; then
    echo "certs.sh: '$spec': want ROLE/ID with ID 1-128 of [A-Za-z0-9._:-]" >&2
    exit 2
  fi
  san="URI:spiffe://kvrelay/$role/$id"
  IFS=, read -r -a names <<<"$hosts"
  for h in "${names[@]}"; do
    if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
  done
  base="$out/$role-$id"
  ext=$(mktemp)
  trap 'rm -f "$ext"' EXIT
  cat >"$ext" <<EOF
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyAgreement
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san
authorityKeyIdentifier=keyid
EOF
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/O=kvrelay/CN=$role $id" -keyout "$base.key" -out "$base.csr" 2>/dev/null
  openssl x509 -req -in "$base.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" -CAcreateserial \
    -days "$days" -sha256 -extfile "$ext" -out "$base.pem" 2>/dev/null
  rm -f "$base.csr" "$ext"
  chmod 644 "$base.pem"
  echo "certs.sh: $base.pem ($san)"
done
