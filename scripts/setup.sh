#!/usr/bin/env bash
# Installs every Debian 12 package that kvrelay's build, tests, benchmarks and demo need.
# Idempotent: runs apt-get (and apt-get update) only when something is missing. Needs root,
# or sudo, when something must be installed.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  libucx-dev ucx-utils
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev libssl-dev libopenblas-dev nlohmann-json3-dev libyaml-cpp-dev
  redis-server iproute2 procps python3
  python3-matplotlib  # kvrelay plan --plot (cachestore/tools)
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "setup.sh: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "setup.sh: need root to install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
