#!/bin/sh
# Prints, one a line, the Debian packages that own the shared libraries BINARY links, so the
# runtime image installs exactly those. Fails naming any library no package owns, except those
# under $RUNTIME_PACKAGES_OWN_PREFIX (a tree the image copies itself, e.g. /opt/ for a UCX built
# with CUDA in Dockerfile.cuda-gpudirect).
# Usage: [RUNTIME_PACKAGES_OWN_PREFIX=/opt/] deploy/docker/runtime-packages.sh BINARY
set -eu
binary=${1:?usage: runtime-packages.sh BINARY}
if ! ldd "$binary" >/dev/null 2>&1; then
  echo "runtime-packages.sh: ldd cannot read $binary" >&2
  exit 1
fi
unowned=""
packages=""
own_prefix=${RUNTIME_PACKAGES_OWN_PREFIX:-}
for lib in $(ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'); do
  if [ -n "$own_prefix" ]; then
    case "$lib" in "$own_prefix"*) continue ;; esac
  fi
  owner=""
  # Debian 12 is /usr-merged: dpkg records a library under /lib or /usr/lib, whichever its
  # package ships, and ldd may print either one or a symlink to it.
  real=$(realpath "$lib")
  for path in "$lib" "$real" "/usr$lib" "/usr$real" "${lib#/usr}" "${real#/usr}"; do
    owner=$(dpkg-query -S "$path" 2>/dev/null | grep -v '^diversion' | head -n 1 | cut -d: -f1) \
      || true
    [ -n "$owner" ] && break
  done
  if [ -z "$owner" ]; then
    unowned="$unowned $lib"
  else
    packages="$packages $owner"
  fi
done
if [ -n "$unowned" ]; then
  echo "runtime-packages.sh: no Debian package owns:$unowned" >&2
  exit 1
fi
echo "$packages" | tr ' ' '\n' | sed '/^$/d' | sort -u
