#!/usr/bin/env bash
# Installs every Debian 12 package that kvrelay's build, tests, benchmarks and demo need, then
# the pinned npm tools of the deploy/ checks (deploy/ci/setup.sh).
# Idempotent: runs apt-get (and apt-get update) only when something is missing. Needs root,
# or sudo, when something must be installed.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git clang-format clang libclang-rt-14-dev
  libabsl-dev libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  libucx-dev ucx-utils
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev libssl-dev libcpp-httplib-dev libopenblas-dev nlohmann-json3-dev libyaml-cpp-dev
  libre2-dev libicu-dev zlib1g-dev libzmq3-dev libmsgpack-dev liburing-dev fio
  redis-server iproute2 procps python3 python3-matplotlib python3-zmq python3-msgpack python3-prometheus-client
  etcd-server etcd-client
  prometheus python3-yaml
)

install_missing() {
  echo "setup.sh: installing ${missing[*]}" >&2
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then sudo="sudo"; else
      echo "setup.sh: need root to install: ${missing[*]}" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

# deploy/ci's checks (part of scripts/test.sh) run on Node.js: Debian's, unless the machine
# already has one. SETUP_DEPLOY_CHECKS=0 skips them (the container image build does).
SETUP_DEPLOY_CHECKS=${SETUP_DEPLOY_CHECKS:-1}
if [[ $SETUP_DEPLOY_CHECKS == 1 ]] && ! command -v npm >/dev/null; then
  for pkg in nodejs npm; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$pkg")
  done
fi

if ((${#missing[@]} > 0)); then
  install_missing
fi
# etcd's v3 gRPC protos for cachestore/etcd (from Debian's golang-etcd-server-dev, unpacked).
ETCD_PROTO_DIR=/usr/local/share/kvrelay/etcd-proto
if [[ ! -s $ETCD_PROTO_DIR/etcd/etcdserver/etcdserverpb/rpc.proto ]]; then
  if [[ $(id -u) -ne 0 ]]; then
    sudo "$(dirname "$0")/etcd_protos.sh" "$ETCD_PROTO_DIR"
  else
    "$(dirname "$0")/etcd_protos.sh" "$ETCD_PROTO_DIR"
  fi
fi
if [[ $SETUP_DEPLOY_CHECKS == 1 ]]; then
  "$(dirname "$0")/../deploy/ci/setup.sh"
fi
# The OpenAI-client end-to-end test's pinned packages (tests/e2e/openai/package-lock.json).
if [[ $SETUP_DEPLOY_CHECKS == 1 ]]; then
  openai_dir="$(dirname "$0")/../tests/e2e/openai"
  if [[ ! -f $openai_dir/node_modules/.package-lock.json ||
        $openai_dir/package-lock.json -nt $openai_dir/node_modules/.package-lock.json ]]; then
    echo "setup.sh: npm ci in tests/e2e/openai" >&2
    (cd "$openai_dir" && { npm ci --no-audit --no-fund --loglevel=error ||
                           { sleep 5; npm ci --no-audit --no-fund --loglevel=error; }; })
  fi
fi
